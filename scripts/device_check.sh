#!/usr/bin/env bash
# GPU check, one command, well under 8 minutes on one GPU, fetching nothing from the network:
#
#   bash scripts/device_check.sh [RESULTS_DIR]          (default: runs/device_check)
#
# Prints the device, then runs (1) bench_feed with aligned pageable and pinned host buffers,
# (2) the quickstart, (3) the routed/direct × prefetch 0/2 comparison, and leaves their JSON
# (and the comparison table and plots) flat in RESULTS_DIR. The mesh is `data:-1` over the
# GPUs present: with one GPU, routed and direct are the same path, and bench_feed still
# measures host→device bandwidth against np.copy of the same bytes.
#
# Needs a python3 with a CUDA jax, flax, optax, numpy, PyYAML, rich and matplotlib. Missing
# pure-Python packages (tensorboardX) install from ./.whl when present, with --no-index:
# fetch them beforehand, on a machine with a package index, with scripts/fetch_device_wheels.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
RESULTS=$(mkdir -p "${1:-runs/device_check}" && cd "${1:-runs/device_check}" && pwd)
WORK=$(mktemp -d -t meshpar-device-check.XXXXXX)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" .whl/*.whl
  export PYTHONPATH="$PYTHONPATH:$WORK/site"
fi
log() { printf '\n=== %s (%s)\n' "$1" "$(date +%T)"; }

log "device"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "nvidia-smi: not available"
python3 -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__); print(jax.devices())"

log "bench_feed: host→device placement vs np.copy, pageable (aligned) and pinned host buffers"
timeout 240 python3 scripts/bench_feed.py --sizes-mib 1,16,64,256 --meshes 1,2,4,8 \
  --host-memory aligned,pinned --out "$RESULTS/bench_feed.json" | tee "$RESULTS/bench_feed.txt"

log "quickstart"
timeout 150 python3 -m meshpar.train --config experiments/quickstart.yaml mesh=data:-1,model:1 \
  train.progress=false workdir="$WORK/quickstart"
cp "$WORK/quickstart/summary.json" "$RESULTS/quickstart_summary.json"

log "compare_feeding: routed vs direct, prefetch 0 and 2"
timeout 240 python3 -m meshpar.compare_feeding --config experiments/quickstart.yaml mesh=data:-1,model:1 \
  train.steps=100 workdir="$WORK/compare"
cp "$WORK/compare/feed_comparison.json" "$WORK/compare/feed_comparison.md" "$WORK/compare/"*.png "$RESULTS/"

log "done: results in $RESULTS"
ls -l "$RESULTS"
