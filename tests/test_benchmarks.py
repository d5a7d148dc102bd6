"""The benchmarks must never rot: CI runs the quick mode and checks what it reports."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_quick_benchmarks_run(tmp_path):
    out_file = tmp_path / "bench.md"
    # pinned to one CPU, as docs/benchmarks-pinned.md is made (it also steadies CI)
    p = subprocess.run([sys.executable, "-m", "benchmarks", "--quick", "--pin-cpu", "0",
                        "--out", str(out_file)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert p.returncode == 0, p.stderr[-3000:]
    report = out_file.read_text()
    for section in ("Trivial call round trip", "Pipelined calls", "numpy argument",
                    "Recycling loop", "Actor start-up", "Broadcast: one shared 64 MiB array",
                    "ActorGroup.spawn"):
        assert section in report
    assert "not measured" in report  # peers skipped in quick mode say so
    assert "pins every process to CPU 0 (" in report  # the affinity in effect
    # behaviour, not speed: the recycling loop copies nothing and maps nothing new
    line = [ln for ln in report.splitlines() if ln.startswith("| ") and "|" in ln]
    recycle = report.split("Recycling loop")[1].splitlines()[4]
    cells = [c.strip() for c in recycle.strip("|").split("|")]
    assert cells[0] == "actorshm" and cells[4] == "0" and cells[5] == "0.00", recycle
    assert line
