"""The package's house rules, read from its source: no import cycles (lazy
and TYPE_CHECKING imports included), each layer imports only the layers
below it, and no module grows past 600 lines."""

import ast
import re
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
    "planner": {"graph", "schedule", "parallel"},
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


# The parallelisms inside a stage are driven through their protocol
# (torchmpmd/parallel/protocol.py) and the mesh's layout: the runtime names
# none of them, nor the mesh dimensions they own. Public API names that say
# "data parallel" or "tp" (RunnerOptions' fields, PipelineRunner.dp_group /
# dp_size) are the exceptions.
_PARALLEL_MODULES = {"layout", "protocol"}  # what runtime/ may import of parallel/
_PARALLEL_NAMES = re.compile(r"(?:^|_)(?:dp|tp|pp|fsdp|hsdp|tensor_parallel)(?:_|$)")
_PARALLEL_CLASSES = {"Replicas", "FSDP", "FSDPModule", "TensorParallel", "ShardedGrads"}
_PUBLIC = {"dp_group", "dp_size", "tp_plan", "data_parallel"}
_MESH_DIMS = {"pp", "dp", "tp", "dp_shard", "dp_replicate", "fsdp", "replicate"}


def _docstrings(tree):
    """The constants that are docstrings (of the module, classes, functions)."""
    out = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        first = body[0] if isinstance(body, list) and body else None
        if (
            isinstance(first, ast.Expr)
            and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)
        ):
            out.add(id(first.value))
    return out


def _parallelism_names(path):
    """Where the source at `path` names a parallelism: an import of one's
    module, a class, an identifier or a mesh dimension's name (comments and
    docstrings aside)."""
    tree = ast.parse(path.read_text())
    docs = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and "parallel" in node.module:
            module = node.module.rpartition("parallel")[2].lstrip(".")
            if module and module.split(".")[0] not in _PARALLEL_MODULES:
                found.append(f"line {node.lineno}: imports parallel.{module}")
        names = []
        if isinstance(node, ast.Name):
            names.append(node.id)
        elif isinstance(node, ast.Attribute):
            names.append(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, ast.arg):
            names.append(node.arg)
        elif isinstance(node, ast.alias):
            names.append(node.asname or node.name.rpartition(".")[2])
        for name in names:
            if name in _PUBLIC:
                continue
            if name in _PARALLEL_CLASSES or _PARALLEL_NAMES.search(name):
                found.append(f"line {node.lineno}: {name}")
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docs
            and node.value in _MESH_DIMS
        ):
            found.append(f"line {node.lineno}: {node.value!r}")
    return found


def test_the_runtime_names_no_parallelism():
    found = {
        str(path.relative_to(ROOT)): names
        for path in sorted((ROOT / "runtime").rglob("*.py"))
        if (names := _parallelism_names(path))
    }
    assert found == {}


def test_the_parallelism_check_finds_one(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        'from ..parallel.tensor import TensorParallel\n"""doc: dp"""\nx = mesh["dp"]\n'
        "def f(tp_group): pass\n"
    )
    assert sorted(_parallelism_names(path)) == [
        "line 1: TensorParallel",
        "line 1: imports parallel.tensor",
        "line 3: 'dp'",
        "line 4: tp_group",
    ]


def _stage_kind_branches(path):
    """Where the source at `path` asks which kind of stage it holds (`.traced`,
    `isinstance(..., GraphModule)`) instead of what it uses of the stage."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr == "traced":
            found.append(f"line {node.lineno}: .traced")
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "isinstance"
            and len(node.args) == 2
            and "GraphModule" in ast.unparse(node.args[1])
        ):
            found.append(f"line {node.lineno}: isinstance(..., GraphModule)")
    return found


def test_no_branch_on_the_kind_of_stage_outside_graph():
    found = {
        str(path.relative_to(ROOT)): names
        for path in sorted(ROOT.rglob("*.py"))
        if path.relative_to(ROOT).parts[0] != "graph" and (names := _stage_kind_branches(path))
    }
    assert found == {}
