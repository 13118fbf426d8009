#!/usr/bin/env bash
# The checks that need a GPU, in one run of at most ~8 minutes on a 16-core GPU node (docs/gpu.md records what they
# gave): the machine, the cores and memory this process may use, pinned and pageable host-to-device copy rates; the
# CUDA tests (the saver's pinned asynchronous copy racing training kernels, the online averager on a GPU model,
# `merge --device cuda` alone and under torchrun) and the fold's own tests; `inspect --plan` on the benchmark's
# inputs (the fold's workers and why); then the merge benchmark at 8 x 1.61 GB bf16, warm, 3 interleaved repeats:
# the I/O floor, `pmakit merge` (fold workers sized from the node), the same with the 2 workers it had before
# (pmakit-2w), `--device cuda`, and the CPU merge's in-process timers (timed).
#   bash benchmarks/gpu_check.sh [OUT_DIR]   (results under OUT_DIR, default $OUT or /tmp/gpu-check;
#                                             inputs under $BENCH_DATA, default /tmp/bench-data, ~14 GB)
#   GPU_CHECK_QUICK=1 bash benchmarks/gpu_check.sh   the machine, the inputs and the benchmark only (~3.5 min:
#                                             for a second look at the timings when the tests ran before)
# The GPU image's python3 holds the CUDA build of torch and pmakit's dependencies (nothing can be installed
# there: no network); PYTHON=... picks another interpreter. Each step is timed and logged; a failed step is
# recorded and the next one runs; the exit status is non-zero if any failed. results.txt ends with a summary.
set -euo pipefail
out=${1:-${OUT:-/tmp/gpu-check}}
data=${BENCH_DATA:-/tmp/bench-data}
mkdir -p "$out" "$data"
export OMP_WAIT_POLICY=PASSIVE PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
start=$(date +%s)
failed=()
: >"$out/results.txt"

note() { echo "[gpu_check +$(($(date +%s) - start))s] $*" | tee -a "$out/results.txt"; }

# step NAME LIMIT_S LOG CMD...: run CMD with a time limit, its output to LOG (and the terminal), its status and
# time to results.txt; a failure is recorded, not fatal.
step() {
  local name=$1 limit=$2 log=$3 t0 rc
  shift 3
  note "start $name (limit ${limit}s)"
  t0=$(date +%s)
  set +e
  timeout --kill-after=20 "$limit" "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  set -e
  note "done  $name: exit $rc in $(($(date +%s) - t0))s"
  if [ "$rc" -ne 0 ]; then failed+=("$name"); fi
}

probe=$(mktemp /tmp/gpu-probe-XXXX.py)
cat >"$probe" <<'PROBE'
import sys, time
import torch
from pmakit.merge.resources import read_node

print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "gpus", torch.cuda.device_count())
print("pmakit sees:", read_node().describe())
assert torch.cuda.is_available(), "this torch has no CUDA device"
print("gpu:", torch.cuda.get_device_name(0))
n = 1 << 30  # 1 GiB, four copies after a warm-up
for pinned in (True, False):
    host = torch.ones(n, dtype=torch.uint8)
    host = host.pin_memory() if pinned else host
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    dev.copy_(host, non_blocking=pinned)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(4):
        dev.copy_(host, non_blocking=pinned)
    torch.cuda.synchronize()
    kind = "pinned" if pinned else "pageable"
    print(f"host->device {kind}: {4 * n / (time.perf_counter() - t0) / 1e9:.1f} GB/s")
PROBE

step machine 90 "$out/machine.txt" bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version \
  --format=csv,noheader; echo nproc \$(nproc), load \$(cut -d' ' -f1-3 /proc/loadavg); free -g | head -2; \
  df -h $data | tail -1; $py -c 'import safetensors, click, rich, numpy, pytest' && $py $probe"
if [ ${#failed[@]} -ne 0 ]; then
  note "no usable CUDA torch here: stopping (failed: ${failed[*]})"
  exit 1
fi

quick=${GPU_CHECK_QUICK:-0}
[ "$quick" = 1 ] && note "GPU_CHECK_QUICK=1: the tests and the plan are skipped"
[ "$quick" = 1 ] || step tests 240 "$out/tests.log" "$py" -m pytest -p no:cacheprovider -q -ra --durations=10 tests/test_gpu.py \
  "tests/test_saver.py::test_snapshot_of_a_gpu_model_is_its_weights" tests/test_merge_stream.py \
  tests/test_resources.py

step make-inputs 240 "$out/bench.log" "$py" benchmarks/bench_merge.py --full --make-only --data "$data"

run="$data/L15-H2048-I5632-V32000"
[ "$quick" = 1 ] || step plan 90 "$out/plan.txt" bash -c "$py -m pmakit inspect --plan $run --last 8 && \
  $py -m pmakit merge $run --last 8 -o $data/dry --dry-run | tail -1"

# Per repeat: a warming cat before each run (~2 s), the floor ~2 s, CPU merges ~3-9 s each, the CUDA merge, the
# timed CPU merge. A merge that fails or hangs (--run-timeout) is reported and left out; the others go on.
step bench 330 "$out/bench-run.log" "$py" benchmarks/bench_merge.py --full --cuda --workers 2 \
  --skip naive mergekit cold --repeats 3 --run-timeout 120 --data "$data"

{
  echo
  echo "== summary =="
  head -1 "$out/machine.txt" | cut -c1-200
  grep -E "^(host->device|pmakit sees|nproc|gpu:|python)" "$out/machine.txt" || true
  tail -3 "$out/tests.log" 2>/dev/null || true
  grep -E "^fold per rank|^expected time|^one process|work memory" "$out/plan.txt" 2>/dev/null || true
  sed -n '/snapshots x/,$p' "$out/bench-run.log"
  grep -E "FAILED" "$out/bench-run.log" || true
  echo "failed steps: ${failed[*]:-none}; total $(($(date +%s) - start)) s"
} | tee -a "$out/results.txt"
rm -rf "$data/out" "$data/dry" "$probe"
[ ${#failed[@]} -eq 0 ]
