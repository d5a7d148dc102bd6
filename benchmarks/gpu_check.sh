#!/usr/bin/env bash
# Every GPU check, the GPU benchmark and the examples' GPU options, on a machine with CuPy and a GPU (a few minutes).
# Runs from the repository root without installing; needs numpy, cloudpickle, uvloop,
# CuPy, pytest, pytest-asyncio and pytest-timeout; torch with CUDA for the torch CUDA
# tensor checks (tests/test_torch_cuda.py skips without it). PYTHON picks the interpreter.
# Ends with the GPU memory in use before and after, every process gone: the crash cases
# in tests/test_cuda.py (a receiver, a relay and an owner killed) must leak none.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$py" -c "import actorshm; assert actorshm.cuda.available(), 'CuPy sees no GPU'"
"$py" -c "import cupy; print('CuPy', cupy.__version__, '| CUDA runtime',
  cupy.cuda.runtime.runtimeGetVersion(), '| driver', cupy.cuda.runtime.driverGetVersion(),
  '|', cupy.cuda.runtime.getDeviceCount(), 'GPU(s):',
  (lambda n: n.decode() if isinstance(n, bytes) else n)(
      cupy.cuda.runtime.getDeviceProperties(0)['name']))"
"$py" -c "import torch; print('torch', torch.__version__, '| CUDA', torch.version.cuda,
  '| torch sees a GPU:', torch.cuda.is_available())" || echo "torch not installed"
used() {  # GPU memory in use on device 0, in MiB, read from a fresh process
  "$py" -c "import cupy; f, t = cupy.cuda.runtime.memGetInfo(); print((t - f) >> 20)"
}
before=$(used)
status=0
"$py" -m pytest -q -rs -p no:cacheprovider tests/test_cuda.py tests/test_arrays.py \
  tests/test_torch_cuda.py || status=$?
"$py" benchmarks/gpu_bench.py || status=$?
# the examples' GPU options: gradients on the GPU with CuPy, then with torch
"$py" examples/parameter_server.py --quick --device cuda || status=$?
"$py" -c "import torch" 2>/dev/null &&
  { "$py" examples/parameter_server.py --quick --device cuda --torch || status=$?; }
sleep 1
after=$(used)
echo "GPU memory in use: ${before} MiB before, ${after} MiB after (every process gone)"
if (( after - before > 16 )); then
  echo "FAIL: $((after - before)) MiB of GPU memory leaked"; status=1
fi
exit $status
