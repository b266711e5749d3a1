#!/usr/bin/env bash
# The CUDA check (<= 5 min on one GPU): the gpu-marked tests, then the step benchmark with few repeats.
#   bash scripts/gpu_check.sh        (from the repository root, in an environment with a CUDA torch)
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda); \
sys.exit(0 if torch.cuda.is_available() else 'no CUDA device visible: nothing to check')"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
python -m pytest -q -m gpu tests/test_gpu.py
python benchmarks/bench_step.py --repeats 2
