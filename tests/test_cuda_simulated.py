"""tests/test_cuda.py on a simulated GPU, so that CPU-only CI runs the GPU bookkeeping.

tests/simgpu holds a host-memory stand-in for the part of CuPy that actorshm uses (see
its README): slabs, IPC handles, leases, recycling, forwarding and device mapping run
for real across processes; CUDA itself (kernels, streams, ordering) is not simulated.
The GPU tests run in a subprocess, so that the stand-in never meets this process's
imports (or a real CuPy).
"""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIMGPU = os.path.join(ROOT, "tests", "simgpu")


def test_gpu_tests_pass_on_a_simulated_gpu():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SIMGPU, env.get("PYTHONPATH")) if p)
    env.pop("CUDA_VISIBLE_DEVICES", None)  # the simulated machine has two GPUs
    env.pop("PYTEST_ADDOPTS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         os.path.join("tests", "test_cuda.py")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    summary = out.strip().splitlines()[-1]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= 10, summary
    assert "skipped" not in summary and "failed" not in summary, summary
