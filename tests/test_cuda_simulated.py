"""tests/test_cuda.py on a simulated GPU, so that CPU-only CI runs the GPU bookkeeping.

tests/simgpu holds a host-memory stand-in for the part of CuPy that actorshm uses (see
its README): slabs, IPC handles, leases, recycling, forwarding and device mapping run
for real across processes; CUDA itself (kernels, streams, ordering) is not simulated.
The GPU tests run in a subprocess, so that the stand-in never meets this process's
imports (or a real CuPy).
"""

import asyncio
import gc
import importlib.util
import os
import re
import subprocess
import sys

import pytest

import actorshm
from actorshm import actor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIMGPU = os.path.join(ROOT, "tests", "simgpu")


def _run_simulated(*args):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SIMGPU, ROOT, env.get("PYTHONPATH"))
                                        if p)
    env.pop("CUDA_VISIBLE_DEVICES", None)  # the simulated machine has two GPUs
    env.pop("PYTEST_ADDOPTS", None)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_gpu_tests_pass_on_a_simulated_gpu():
    proc = _run_simulated("-m", "pytest", "-q", "-p", "no:cacheprovider",
                          os.path.join("tests", "test_cuda.py"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    summary = out.strip().splitlines()[-1]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= 16, summary
    assert "skipped" not in summary and "failed" not in summary, summary


def test_torch_cuda_tests_pass_on_a_simulated_gpu():
    # torch CUDA tensors through the GPU pool, with a stand-in for torch's CUDA tensors
    # (tests/simgpu/simtorchcuda.py): lookup, copy, leases, IPC and rebuild run for real.
    pytest.importorskip("torch", reason="torch is not installed (the torch extra)")
    proc = _run_simulated("-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                          os.path.join("tests", "test_torch_cuda.py"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    summary = out.strip().splitlines()[-1]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= 8, summary
    assert "failed" not in summary, summary
    # only the tests that need torch's real CUDA tensors skip
    skips = [ln for ln in out.splitlines() if ln.startswith("SKIPPED")]
    assert all("needs torch's real CUDA tensors" in ln for ln in skips), skips


def test_gpu_benchmark_script_runs_on_a_simulated_gpu():
    # Keeps benchmarks/gpu_bench.py from rotting; its timings here mean nothing.
    proc = _run_simulated(os.path.join("benchmarks", "gpu_bench.py"), "--quick")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "CuPy argument via CUDA IPC" in proc.stdout
    assert "steady state per batch: 0.00 new GPU blocks, 0 GPU bytes copied" in proc.stdout



@actor
class MixedResults:
    """Returns host and GPU arrays together; CuPy is imported in the actor only."""

    def make(self):
        import actorshm.cuda
        return [actorshm.zeros(10), actorshm.cuda.zeros(10), actorshm.zeros(20)]

    def host_blocks_live(self):
        gc.collect()
        return actorshm.stats()["blocks_live"]


async def test_gpu_array_reaching_a_process_without_cupy(rt):
    # This process has no CuPy; the actor has the simulated one. The call fails with a
    # TypeError that says why, every lease in the result still comes back, and the
    # connection carries on.
    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("this process has CuPy")
    a = await MixedResults.options(env={"PYTHONPATH": SIMGPU}).spawn()
    with pytest.raises(TypeError, match="No module named 'cupy'"):
        await a.make()
    await asyncio.sleep(0.1)
    assert await a.host_blocks_live() == 0
