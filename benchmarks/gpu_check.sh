#!/usr/bin/env bash
# The checks that need a GPU, in one run (docs/gpu.md records what they gave): the CUDA tests (the saver's pinned
# asynchronous copy racing training kernels, the online averager on a GPU model, `merge --device cuda` alone and
# under torchrun), then the merge benchmark with `--device cuda` beside the CPU merge and the I/O floor.
#   bash benchmarks/gpu_check.sh [OUT_DIR]      (logs under OUT_DIR, default $OUT or /tmp/gpu-check)
set -uo pipefail
out=${1:-${OUT:-/tmp/gpu-check}}
mkdir -p "$out"
export OMP_WAIT_POLICY=PASSIVE PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $py -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version(), "gpus", torch.cuda.device_count())'
  nproc; free -g | head -2
} 2>&1 | tee "$out/machine.txt"
$py -m pytest -p no:cacheprovider -q -ra --durations=10 tests/test_gpu.py \
  "tests/test_saver.py::test_snapshot_of_a_gpu_model_is_its_weights" 2>&1 | tee "$out/tests.log"
tests=${PIPESTATUS[0]}
$py benchmarks/bench_merge.py --full --cuda --skip naive mergekit cold timed --repeats 2 \
  --data "${BENCH_DATA:-/tmp/bench-data}" 2>&1 | tee "$out/bench.log"
bench=${PIPESTATUS[0]}
echo "tests exit $tests, bench exit $bench" | tee -a "$out/machine.txt"
exit $(( tests || bench ))
