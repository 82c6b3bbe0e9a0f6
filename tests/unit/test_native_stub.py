"""The stub of the native core (_C.pyi) must name every binding of every
submodule, so the type checker sees the whole typed boundary and no binding
reaches the package as Any."""

import ast
from pathlib import Path

import torchmpmd
from torchmpmd import _C

STUB = Path(torchmpmd.__file__).with_name("_C.pyi")


def _stub_names() -> dict[str, set[str]]:
    tree = ast.parse(STUB.read_text())
    out: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            out[node.name] = {
                n.name for n in node.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))
            }
    return out


def test_every_native_binding_is_in_the_stub():
    stub = _stub_names()
    for sub in ("graph", "schedule", "runtime"):
        module = getattr(_C, sub)
        native = {n for n in dir(module) if not n.startswith("_")}
        assert native <= stub[sub], f"_C.{sub}: missing from _C.pyi: {sorted(native - stub[sub])}"
        assert stub[sub] <= native, (
            f"_C.{sub}: in _C.pyi but not bound: {sorted(stub[sub] - native)}"
        )
    assert "Error" in {n.name for n in ast.parse(STUB.read_text()).body if hasattr(n, "name")}
