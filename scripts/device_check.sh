#!/usr/bin/env bash
# GPU check, one command, under 8 minutes on one GPU, fetching nothing from the network:
#
#   bash scripts/device_check.sh [--dry-run] [RESULTS_DIR]   (default: runs/device_check[_dry])
#
# Sections, each writing its JSON into RESULTS_DIR as it finishes (scripts/device_check.py):
#   device      the devices, versions, and the topology the time model predicts on
#   a_feed      bench_feed: pinned vs pageable host→device bandwidth, ratio to the link's nominal
#   plan        python -m meshpar.plan on experiments/gpu_lm.yaml: memory plan, predicted step
#   b_gpu_lm    gpu_lm for a few dozen steps: step time, tokens/s, MFU (bf16 peak), memory_stats peak vs plan
#   c_feeding   routed vs direct (compare_feeding) on every mesh of the devices present
#   d_offload   scripts/bench_offload.py, or one "skipped: ..." line
#   d_unified_memory   unified memory vs swap: gpu_lm at the batch size the plan says needs ~1.3x the
#               GPU, priced by python -m meshpar.plan --compare-out-of-core, trained with the plan's
#               unified-memory row and its fastest swap row that fits: median step and memory_stats
#               peak beside the predictions; off a CUDA GPU skipped, with the plan and meshpar.train's
#               refusal recorded
#   e_predictions + summary.md   the time model's prediction beside each measurement (scripts/device_report.py)
# Each section has its own time limit (printed with its wall time) and the whole check a
# budget, DEVICE_CHECK_BUDGET seconds (default 460; 900 with --dry-run): a section that hangs
# is stopped and reported, and the ones after it still run with what is left.
#
# --dry-run shrinks every workload (gpu_lm to two layers of width 128, a few steps; two
# simulated CPU devices) so the whole check, every output file included, runs on a laptop.
#
# Needs a python3 (PYTHON=...) with jax (CUDA on a GPU), flax, optax, numpy, PyYAML and rich;
# tensorboardX, matplotlib, orbax and tensorflow_datasets are not needed (their outputs are
# skipped with a line saying so). Wheels in ./.whl install with --no-index when present
# (scripts/fetch_device_wheels.sh fetches them beforehand, on a machine with a package index).
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=()
if [[ "${1:-}" == "--dry-run" ]]; then DRY=(--dry-run); shift; fi
DEFAULT=runs/device_check; [[ ${#DRY[@]} -gt 0 ]] && DEFAULT=runs/device_check_dry
RESULTS=$(mkdir -p "${1:-$DEFAULT}" && cd "${1:-$DEFAULT}" && pwd) || exit 2
BUDGET=${DEVICE_CHECK_BUDGET:-$([[ ${#DRY[@]} -gt 0 ]] && echo 900 || echo 460)}
PY=${PYTHON:-python3}
WORK=$(mktemp -d -t meshpar-device-check.XXXXXX)
rm -f "$RESULTS"/*.json "$RESULTS"/*.log "$RESULTS"/sections.tsv "$RESULTS"/summary.md
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# One compilation cache for the whole check: the plan's AOT compile of gpu_lm is the run's.
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$WORK/jax_cache}
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" .whl/*.whl
  export PYTHONPATH="$PYTHONPATH:$WORK/site"
fi
START=$SECONDS
REPORT_RESERVE=20  # kept for the predictions and the summary

# section NAME JSON LIMIT: run one section with the smaller of LIMIT and the budget left.
section() {
  local name=$1 json=$2 limit=$3
  local left=$((BUDGET - (SECONDS - START) - REPORT_RESERVE))
  local seconds=$((limit < left ? limit : left))
  printf '\n=== %s (%s; limit %d s, %d s of the budget left)\n' "$name" "$(date +%T)" "$seconds" "$left"
  local t0=$SECONDS rc
  if ((seconds < 5)); then
    rc=skipped
    printf '{"section": "%s", "status": "skipped", "note": "skipped: the check'"'"'s %d s budget is spent"}\n' "$json" "$BUDGET" >"$RESULTS/$json.json"
  else
    # The driver stops what it runs at its limit; `timeout` stops the driver should it hang itself.
    timeout -k 5 $((seconds + 15)) "$PY" scripts/device_check.py "$name" --results "$RESULTS" --work "$WORK" --seconds "$seconds" "${DRY[@]}"
    rc=$?
    if [[ ! -s "$RESULTS/$json.json" ]]; then
      printf '{"section": "%s", "status": "failed", "note": "the section driver exited %s without writing its result"}\n' "$json" "$rc" >"$RESULTS/$json.json"
    fi
  fi
  printf '%s\t%s\t%d\t%d\n' "$json" "$rc" $((SECONDS - t0)) "$seconds" >>"$RESULTS/sections.tsv"
  printf '=== %s: %d s wall\n' "$name" $((SECONDS - t0))
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$RESULTS/nvidia-smi.txt" 2>&1 || echo "nvidia-smi: not available" >"$RESULTS/nvidia-smi.txt"
cat "$RESULTS/nvidia-smi.txt"
# Planned GPU times (one H200): device ~10 s, feed ~20, plan ~45 (AOT compile of a 1 B model),
# gpu_lm ~60 (cache hit + 40 steps), feeding ~45, offload ~30, unified ~200 (the batch-size sweep
# ~20, the plan's compile of gpu_lm (remat none) at 3x its batch ~40, the unified-memory run ~80:
# its compile possibly the plan's, then 5 steps paging ~60 GB over PCIe each; the swap run,
# activation offload, ~60), report ~5: ~415 s of 460.
section info device 40
section feed a_feed 45
section plan plan 90
section lm b_gpu_lm 110
section feeding c_feeding 70
section kernels f_kernels 60
section offload d_offload 60
section unified d_unified_memory 240

printf '\n=== e_predictions + summary (%s)\n' "$(date +%T)"
t0=$SECONDS
timeout -k 5 $((REPORT_RESERVE + 30)) "$PY" scripts/device_report.py --results "$RESULTS" \
  --command "bash scripts/device_check.sh ${DRY[*]}"
rc=$?
printf '%s\t%s\t%d\t%d\n' e_predictions "$rc" $((SECONDS - t0)) "$REPORT_RESERVE" >>"$RESULTS/sections.tsv"
printf '=== e_predictions + summary: %d s wall\n' $((SECONDS - t0))
[[ -s "$RESULTS/summary.md" ]] || echo "# GPU check: the summary could not be written (see the sections' JSON)" >"$RESULTS/summary.md"
[[ -s "$RESULTS/e_predictions.json" ]] || echo '{"section": "e_predictions", "status": "failed", "note": "device_report.py did not finish"}' >"$RESULTS/e_predictions.json"

printf '\n=== done in %d s: results in %s\n' $((SECONDS - START)) "$RESULTS"
cut -f1-3 "$RESULTS/sections.tsv" | awk -F'\t' '{printf "  %-14s exit %-8s %5d s\n", $1, $2, $3}'
ls -l "$RESULTS"
rm -rf "$WORK"
