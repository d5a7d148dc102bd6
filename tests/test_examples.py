"""Run each example's main() in quick mode (a few seconds each)."""

import os
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
if EXAMPLES not in sys.path:
    sys.path.insert(0, EXAMPLES)  # actor processes inherit the driver's sys.path

pytest.importorskip("sklearn")

import data_parallel  # noqa: E402
import data_pipeline  # noqa: E402
import hogwild  # noqa: E402
import parameter_server  # noqa: E402


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_parameter_server(mode, capsys):
    out = parameter_server.main(["--quick", "--mode", mode, "--workers", "2"])
    assert out["test_accuracy"] > 0.85
    text = capsys.readouterr().out
    assert "final test accuracy: " in text.splitlines()[-1]
    hist = out["history"]
    assert all(h["bytes_copied"] == 0 for h in hist)
    assert all(h["bytes_zero_copy"] > 0 for h in hist)
    assert hist[-1]["pool_allocs"] == 0  # gradient buffers are recycled
    if mode == "async":
        assert out["staleness"] >= 0


def test_parameter_server_torch(capsys):
    pytest.importorskip("torch", reason="torch is not installed (the torch extra)")
    out = parameter_server.main(["--quick", "--torch", "--workers", "2", "--epochs", "3"])
    assert out["test_accuracy"] > 0.85
    text = capsys.readouterr().out
    assert "torch" in text.splitlines()[0]
    assert "final test accuracy: " in text.splitlines()[-1]
    hist = out["history"]
    # weights and gradients are actorshm.torch tensors: by reference, recycled
    assert all(h["bytes_copied"] == 0 for h in hist)
    assert all(h["bytes_zero_copy"] > 0 for h in hist)
    assert hist[-1]["pool_allocs"] == 0
    # autograd computes the numpy path's gradients: the same training, loss for loss
    ref = parameter_server.main(["--quick", "--single", "--workers", "2", "--epochs", "3"])
    single = parameter_server.main(["--quick", "--single", "--torch", "--workers", "2",
                                    "--epochs", "3"])
    assert [h["loss"] for h in single["history"]] == pytest.approx(
        [h["loss"] for h in ref["history"]])


def test_parameter_server_single():
    out = parameter_server.main(["--quick", "--single"])
    assert out["test_accuracy"] > 0.85


def test_parameter_server_cuda_flag():
    try:
        import cupy  # noqa: F401
    except ImportError:
        with pytest.raises(SystemExit, match="cuda path not available"):
            parameter_server.main(["--quick", "--device", "cuda"])
    else:  # pragma: no cover - needs a GPU
        assert parameter_server.main(["--quick", "--device", "cuda"])["test_accuracy"] > 0.85


def test_hogwild():
    out = hogwild.main(["--quick"])
    assert out["test_accuracy"] > 0.85
    assert out["single_accuracy"] > 0.85
    assert out["bytes_copied"] == 0


def test_torch_hogwild():
    pytest.importorskip("torch", reason="torch is not installed (the torch extra)")
    import torch_hogwild
    out = torch_hogwild.main(["--quick"])
    assert out["accuracy"] > 0.8  # the actors' steps reached the shared model
    assert out["single_accuracy"] > 0.8
    assert out["bytes_copied"] == 0 and out["bytes_zero_copy"] > 0


@pytest.mark.parametrize("example, argv", [
    ("hogwild", ["--workers", "0"]), ("hogwild", ["--epochs", "0"]),
    ("data_pipeline", ["--loaders", "0"]), ("data_pipeline", ["--batches", "0"]),
    ("parameter_server", ["--epochs", "0"]), ("data_parallel", ["--epochs", "0"]),
    ("torch_hogwild", ["--workers", "0"]), ("parameter_server", ["--batch-size", "0"]),
    ("hogwild", ["--batch-size", "0"]), ("data_parallel", ["--batch-size", "-1"]),
    ("data_pipeline", ["--batch-size", "0"]), ("torch_hogwild", ["--batch", "0"])])
def test_a_count_below_one_is_a_usage_error(example, argv, capsys):
    # They ran with 0 actors (accuracy 0.100), divided by zero or indexed an empty list;
    # a batch size of 0 divided by zero or raised from inside an actor's method.
    if example == "torch_hogwild":
        pytest.importorskip("torch", reason="torch is not installed (the torch extra)")
    module = __import__(example)
    with pytest.raises(SystemExit) as exc:
        module.main(argv)
    assert exc.value.code == 2
    assert f"{argv[0]} must be >= 1" in capsys.readouterr().err


def test_a_negative_warm_up_is_a_usage_error(capsys):
    # It skipped the start of the clock and failed at the end (None - float).
    import data_pipeline
    with pytest.raises(SystemExit) as exc:
        data_pipeline.main(["--warmup", "-1"])
    assert exc.value.code == 2
    assert "--warmup must be >= 0" in capsys.readouterr().err


def test_data_pipeline():
    out = data_pipeline.main(["--quick"])
    assert out["bytes_copied_per_batch"] == 0
    assert out["new_blocks_per_batch"] == 0
    assert out["bytes_zero_copy_per_batch"] > 0
    assert out["test_accuracy"] > 0.85


def test_parameter_server_on_ray(mode="sync"):
    pytest.importorskip("ray", reason="the Ray backend needs Ray: pip install 'actorshm[ray]'")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray binds 127.0.0.1
    out = parameter_server.main(["--quick", "--mode", mode, "--workers", "2",
                                 "--backend", "ray", "--epochs", "3"])
    assert out["test_accuracy"] > 0.8
    assert all(h["bytes_zero_copy"] == 0 for h in out["history"])  # Ray copies instead


def test_data_parallel_matches_the_parameter_server(capsys):
    out = data_parallel.main(["--quick", "--workers", "2"])
    assert out["test_accuracy"] > 0.85
    hist = out["history"]
    assert all(h["bytes_copied"] == 0 for h in hist)  # weights and gradients: shared
    assert all(h["bytes_zero_copy"] > 0 for h in hist)
    assert all(h["pool_allocs"] == 0 for h in hist)
    # the same algorithm as the sync parameter server: the same losses, step by step
    ps = out["parameter_server"]
    assert [h["loss"] for h in hist] == pytest.approx([h["loss"] for h in ps["history"]])
    assert out["test_accuracy"] == pytest.approx(ps["test_accuracy"])
    assert "final test accuracy: " in capsys.readouterr().out.splitlines()[-1]


def test_the_examples_help_works_under_python_OO():
    # -OO strips docstrings, which their argument parsers took their description from
    import subprocess
    for example in ("parameter_server", "hogwild", "data_pipeline", "data_parallel"):
        p = subprocess.run([sys.executable, "-OO", os.path.join(EXAMPLES, f"{example}.py"),
                            "--help"], capture_output=True, text=True, timeout=120)
        assert p.returncode == 0 and "usage:" in p.stdout, (example, p.stderr[-1000:])
