"""The serialization plug-in registry: how the CuPy (and torch) plug-ins hook in."""

import sys

import pytest

from actorshm import _serialization as ser


class Meters:
    def __init__(self, v):
        self.v = v


class Feet(Meters):
    pass


def _rebuild_meters(v):
    return Meters(v)


class _Conn:
    sent_regions: set = set()


@pytest.fixture
def registered():
    seen = []

    def reduce_meters(enc, obj):
        seen.append(type(obj))
        return _rebuild_meters, (obj.v * 10,)

    ser.register_reducer(Meters, reduce_meters)
    yield seen
    ser._reducers.pop(Meters, None)
    ser._reducers.pop(Feet, None)
    ser._not_reduced.clear()


def test_a_registered_reducer_sends_its_type_and_subclasses(registered):
    payload, fds, enc, flags = ser.encode({"a": Meters(1), "b": [Feet(2)]}, _Conn())
    out = ser.decode(payload, list(fds), _Conn(), flags)
    assert registered == [Meters, Feet]
    assert (type(out["a"]), out["a"].v, out["b"][0].v) == (Meters, 10, 20)


def test_register_reducer_checks_its_arguments():
    with pytest.raises(TypeError, match="a type and a callable"):
        ser.register_reducer("torch.Tensor", lambda enc, obj: None)


def test_a_lazy_plugin_loads_once_its_module_is_imported(monkeypatch):
    loads = []
    monkeypatch.setitem(ser._lazy_plugins, "fake_plugin_lib", lambda: loads.append(1))
    ser.encode([Meters(1)], _Conn())
    assert loads == []  # not imported: nothing loads
    monkeypatch.setitem(sys.modules, "fake_plugin_lib", object())
    ser.encode([Meters(1)], _Conn())
    ser.encode([Meters(1)], _Conn())
    assert loads == [1] and "fake_plugin_lib" not in ser._lazy_plugins


def test_the_base_layers_import_no_plugin():
    # Lazy imports inside functions count: the plug-in registers itself instead.
    import ast
    import pathlib

    pkg = pathlib.Path(ser.__file__).parent
    for name in ("_wire", "_leases", "_shm", "_serialization", "_ledger", "_framing",
                 "_protocol"):
        tree = ast.parse((pkg / f"{name}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [a.name for a in node.names]
                assert not {"_cuda", "_plugins", "cuda", "cupy", "torch"} & \
                    {n.lstrip(".").rsplit(".", 1)[-1] for n in names}, (name, names)
            elif isinstance(node, ast.Import):
                assert not any(a.name.split(".")[0] in ("cupy", "torch") for a in node.names)


def _package_imports() -> dict:
    """Each module of the package -> the package's modules it imports, lazy imports
    inside functions included (``from . import x``, ``from ._x import y``,
    ``import actorshm._x``; ``import actorshm`` and ``from actorshm import name`` of a
    name that is no module import ``__init__``; ``importlib.import_module`` of a
    constant string, or of one that begins "actorshm." and then a module of it)."""
    import ast
    import pathlib

    pkg = pathlib.Path(ser.__file__).parent
    names = {p.stem for p in pkg.glob("*.py")}
    graph = {}
    for name in names:
        deps = set()
        for node in ast.walk(ast.parse((pkg / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level == 1 and node.module:  # from ._x import y
                    deps.add(node.module.split(".")[0])
                elif node.level == 1:  # from . import _x, _y
                    deps.update(a.name for a in node.names if a.name in names)
                elif node.level == 0 and (node.module or "").startswith("actorshm."):
                    deps.add(node.module.split(".")[1])
                elif node.module == "actorshm":
                    deps.update(a.name if a.name in names else "__init__"
                                for a in node.names)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name == "actorshm":
                        deps.add("__init__")
                    elif a.name.startswith("actorshm."):
                        deps.add(a.name.split(".")[1])
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(
                    node.func, "id", None)) == "import_module" and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.BinOp):  # "actorshm." + name: any module of it
                    arg = arg.left
                    if isinstance(arg, ast.Constant) and arg.value == "actorshm.":
                        deps.update(n for n in names if not n.startswith("_"))
                elif isinstance(arg, ast.Constant) and str(arg.value).startswith(
                        "actorshm."):
                    deps.add(str(arg.value).split(".")[1])
        graph[name] = deps & names - {name}
    return graph


def test_the_package_imports_have_no_cycle():
    # docs/design.md: each module imports only modules below it, lazy imports included.
    graph = _package_imports()
    assert "_protocol" in graph["_worker"] and "_wire" in graph["_framing"]  # (it reads)
    assert {"cuda", "torch"} <= graph["__init__"]  # (its lazy import_module: seen too)
    done, path = set(), []

    def visit(name):
        if name in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(name):] +
                                                                [name]))
        if name in done:
            return
        path.append(name)
        for dep in sorted(graph[name]):
            visit(dep)
        path.pop()
        done.add(name)
    for name in sorted(graph):
        visit(name)
