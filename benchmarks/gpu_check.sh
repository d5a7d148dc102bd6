#!/usr/bin/env bash
# Every GPU check and the GPU benchmark, on a machine with CuPy and a GPU (a few minutes).
# Runs from the repository root without installing; needs numpy, cloudpickle, uvloop,
# CuPy, pytest, pytest-asyncio and pytest-timeout. PYTHON picks the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$py" -c "import actorshm; assert actorshm.cuda.available(), 'CuPy sees no GPU'"
"$py" -c "import cupy; print('CuPy', cupy.__version__, '| CUDA runtime',
  cupy.cuda.runtime.runtimeGetVersion(), '| driver', cupy.cuda.runtime.driverGetVersion(),
  '|', cupy.cuda.runtime.getDeviceCount(), 'GPU(s)')"
"$py" -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_arrays.py
"$py" benchmarks/gpu_bench.py
