#!/usr/bin/env bash
# One lent-GPU session in one call (the device tool's $OUT receives every log as it is written):
#   1. the CUDA tests (tests/test_gpu.py: cold start + RL steps on cuda per replay mode, bit-exact record/replay
#      per family, bf16 rollout vs fp32 training, a 1-process NCCL torchrun run);
#   2. the GPU-scale run of benchmarks/bench_gpu_scale.py (16 layers, hidden 1024, 64 experts top-8; GRPO,
#      GRPO + R2, GSPO). Its 10 GB checkpoints and cold-start cache stay in /tmp; only the tables come back.
# Each step has its own timeout, well inside the call's, so a stuck step still returns the others' logs.
#   OUT=DIR bash scripts/gpu_check.sh    (from the repository root; GPU_TESTS_S=0 skips the tests)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
[ -x /opt/torch/.venv/bin/python3 ] && export PATH=/opt/torch/.venv/bin:$PATH  # the lent machine's CUDA torch
export PYTHONPATH=$PWD MOE_LAB_HOME_GUARD=0 OMP_NUM_THREADS=4
LOG=$OUT/check.txt
step() {  # step NAME SECONDS CMD...: full log in NAME.log, its tail in check.txt
  local name=$1 t=$2; shift 2
  echo "== $name: $* (timeout ${t}s, start $(date -u +%FT%TZ))" | tee -a "$LOG"
  timeout "$t" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  tail -n 60 "$OUT/$name.log" >> "$LOG"
  echo "== $name exit $rc (end $(date -u +%FT%TZ))" | tee -a "$LOG"
}
step env 60 bash -c 'hostname; git log --oneline -1 2>/dev/null || true; which python3; python3 -c "import torch, transformers, sys; \
print(sys.version.split()[0], \"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"transformers\", transformers.__version__, \
\"device\", torch.cuda.get_device_name() if torch.cuda.is_available() else None)"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader'
[ "${GPU_TESTS_S:-200}" = 0 ] || step gpu_tests ${GPU_TESTS_S:-200} python3 -m pytest -q -m gpu tests/test_gpu.py -rs
step gpu_scale ${GPU_SCALE_S:-300} python3 benchmarks/bench_gpu_scale.py --out /tmp/gpu_scale --cache /tmp/gpu_scale_cache \
  --steps ${GPU_SCALE_STEPS:-10}
# one archive: the device tool returns a limited number of files
tar czf "$OUT/gpu_scale.tgz" -C /tmp/gpu_scale --exclude checkpoint --exclude '*.lock' . 2>/dev/null
echo "== done $(date -u +%FT%TZ)" | tee -a "$LOG"
