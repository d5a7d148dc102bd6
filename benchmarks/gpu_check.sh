#!/usr/bin/env bash
# Every GPU check and the GPU benchmark, on a machine with CuPy and a GPU (< 5 minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import actorshm; assert actorshm.cuda.available(), 'CuPy sees no GPU'"
python -m pytest -q tests/test_cuda.py -p no:cacheprovider
python benchmarks/gpu_bench.py
