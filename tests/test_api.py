"""The public surface: names, modules, and imports that must not need a GPU."""

import importlib
import subprocess
import sys
import textwrap

import pytest

import actorshm


def test_public_names_report_actorshm_module():
    for name in actorshm.__all__:
        if name == "cuda":
            continue
        obj = getattr(actorshm, name)
        if isinstance(obj, type) or callable(obj):
            assert obj.__module__ == "actorshm", name


def test_errors_hierarchy():
    assert issubclass(actorshm.ActorDiedError, actorshm.ActorError)
    assert issubclass(actorshm.RemoteError, actorshm.ActorError)
    assert issubclass(actorshm.SharedMemoryError, MemoryError)
    assert issubclass(actorshm.ActorGroupError, actorshm.ActorError)
    if sys.version_info >= (3, 11):
        assert issubclass(actorshm.ActorGroupError, ExceptionGroup)  # noqa: F821


def test_import_needs_no_cupy():
    code = ("import sys, actorshm; actorshm.zeros(3); "
            "assert actorshm.stats()['cuda_bytes_zero_copy'] == 0; "
            "assert 'cupy' not in sys.modules; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.strip() == "ok", out.stderr


def test_decorator_rejects_reserved_names_and_bad_options():
    import pytest
    with pytest.raises(TypeError, match="reserves"):
        @actorshm.actor
        class Bad:
            def kill(self):
                pass
    # a subclass of an actor class, not decorated itself, is held to the same names
    # (spawned, its handle's kill() would have killed the actor instead of calling it)

    @actorshm.actor
    class Base:
        pass

    class Mixin:
        pid = 3

    for sub in (type("Sub", (Base,), {"kill": lambda self: None}),
                type("Mixed", (Mixin, Base), {}), type("MixedLast", (Base, Mixin), {})):
        with pytest.raises(TypeError, match=r"defines \['(kill|pid)'\].*rename"):
            sub.spawn
        with pytest.raises(TypeError, match="reserves"):
            sub.options(name="x")
    assert callable(type("Fine", (Base,), {"step": lambda self: 1}).spawn)
    assert callable(actorshm.actor(type("Again", (Base,), {})).spawn)  # decorated too
    with pytest.raises(TypeError, match="reserves"):  # a base of its own defines one
        actorshm.actor(type("FromMixin", (Mixin,), {}))
    with pytest.raises(TypeError, match="unknown actor option"):
        actorshm.actor(max_concurency=2)(type("X", (), {}))
    with pytest.raises(ValueError, match="max_concurrency"):
        actorshm.actor(max_concurrency=0)(type("Y", (), {}))


def test_an_optional_module_whose_library_is_missing_is_no_attribute(monkeypatch):
    # hasattr / getattr(..., None) probe for optional features: False, not an ImportError;
    # using it says what to install, and importing it raises ImportError as any import.
    monkeypatch.setitem(sys.modules, "torch", None)  # (an import of torch fails)
    monkeypatch.delitem(sys.modules, "actorshm.torch", raising=False)
    monkeypatch.delitem(actorshm.__dict__, "torch", raising=False)
    assert not hasattr(actorshm, "torch") and getattr(actorshm, "torch", None) is None
    with pytest.raises(AttributeError, match=r"pip install 'actorshm\[torch\]'"):
        actorshm.torch.empty(3)
    with pytest.raises(ImportError, match=r"pip install 'actorshm\[torch\]'"):
        importlib.import_module("actorshm.torch")


def test_elsewhere_than_linux_the_errors_say_it_needs_linux():
    # (they were an AttributeError of os.memfd_create, and actors that exited at once)
    code = textwrap.dedent("""
        import sys
        sys.platform = "darwin"
        import actorshm
        for what in (lambda: actorshm.zeros(10), lambda: actorshm.run(_main())):
            try:
                what()
            except RuntimeError as exc:
                print(exc)
        """).replace("_main()", "__import__('asyncio').sleep(0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    lines = out.stdout.splitlines()
    assert len(lines) == 2, out.stdout + out.stderr
    assert lines[0].startswith("actorshm: shared memory needs Linux")
    assert lines[1].startswith("actorshm: the local backend needs Linux")
    assert all("'darwin'" in x and "Linux container" in x for x in lines)
