"""The package's house rules, read from its source: no import cycles (lazy
and TYPE_CHECKING imports included), each layer imports only the layers
below it, and no module grows past 600 lines."""

import ast
from pathlib import Path

import torchmpmd

ROOT = Path(torchmpmd.__file__).parent
MAX_LINES = 600

# Each subpackage, with the subpackages it may import. The top-level modules
# (torchmpmd/__init__.py, schedules.py, viz.py, testing.py) re-export and may
# import anything; `version` and the native `_C` are importable by all.
ALLOWED = {
    "graph": set(),
    "schedule": {"graph"},
    "runtime": {"graph", "schedule", "parallel"},
    "parallel": {"graph", "schedule"},
    "planner": {"graph", "schedule"},
    "checkpoint": {"graph", "runtime"},
}


def _modules():
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = ["torchmpmd", *path.relative_to(ROOT).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _imports(mods):
    """Module -> the torchmpmd modules it imports anywhere in its source."""
    graph = {}
    for name, path in mods.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                subs = [f"{target}.{a.name}" for a in node.names]
                named = [s for s in subs if s in mods or s.endswith("._C")]
                found.update(named if len(named) == len(subs) else [target, *named])
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
        graph[name] = {m for m in found if m in mods and m != name}
    return graph


def _cycles(graph):
    """Strongly connected groups of more than one module (Tarjan)."""
    index, low, stack, on, groups = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def _layer(module):
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ALLOWED else None


def test_no_import_cycles():
    assert _cycles(_imports(_modules())) == []


def test_cycle_finder_finds_one():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_each_layer_imports_only_the_layers_below_it():
    wrong = []
    for module, imported in sorted(_imports(_modules()).items()):
        layer = _layer(module)
        if layer is None:
            continue
        for other in sorted(imported):
            other_layer = _layer(other)
            if other_layer in (None, layer):
                continue
            if other_layer not in ALLOWED[layer]:
                wrong.append(f"{module} imports {other}")
    assert wrong == []


def test_no_module_over_600_lines():
    long = {
        str(path.relative_to(ROOT)): n
        for path in ROOT.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}
