#!/usr/bin/env bash
# Download, into ./.whl, the pure-Python wheels that scripts/device_check.sh installs offline
# on an accelerator machine whose image lacks them. Run where a package index is reachable.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download --no-deps --only-binary=:all: -d .whl "tensorboardX>=2.6"
