#!/usr/bin/env bash
# Every GPU check and the GPU benchmark, on a machine with CuPy and a GPU (a few minutes).
# Runs from the repository root without installing; needs numpy, cloudpickle, uvloop,
# CuPy, pytest, pytest-asyncio and pytest-timeout; torch with CUDA for the torch CUDA
# tensor checks (tests/test_torch_cuda.py skips without it). PYTHON picks the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$py" -c "import actorshm; assert actorshm.cuda.available(), 'CuPy sees no GPU'"
"$py" -c "import cupy; print('CuPy', cupy.__version__, '| CUDA runtime',
  cupy.cuda.runtime.runtimeGetVersion(), '| driver', cupy.cuda.runtime.driverGetVersion(),
  '|', cupy.cuda.runtime.getDeviceCount(), 'GPU(s)')"
"$py" -c "import torch; print('torch', torch.__version__, '| CUDA', torch.version.cuda,
  '| torch sees a GPU:', torch.cuda.is_available())" || echo "torch not installed"
"$py" -m pytest -q -rs -p no:cacheprovider tests/test_cuda.py tests/test_arrays.py \
  tests/test_torch_cuda.py
"$py" benchmarks/gpu_bench.py
