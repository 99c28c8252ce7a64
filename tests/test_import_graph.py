"""The import graph of the package (docs/design.md, "Layers"): no import circle, imports run down the layers, and
so do the imports between folders (each folder sits in one layer, whole).

Built from the source with `ast`, so nothing is imported: every ``import tracelock...`` and
``from tracelock... import ...`` counts, at module level or inside a function (a lazy import still ties the two
modules together). Importing a module runs its packages' ``__init__`` files too, so an import of ``a.b.c`` also
points at ``a.b`` and ``a``, unless the importer lives inside that package.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tracelock"
KERNELS = ROOT / "kernels"  # installed as tracelock.kernels

# the package's rooms from the bottom up: a module may import its own layer and those below. Each room is a folder
# (a subpackage) or a top-level module, whole: no folder is split across layers.
LAYERS = [
    # the package root loads its public names lazily, by name: importing it costs nothing
    ["tracelock"],
    # foundations: no tracelock import above them
    ["tracelock.states", "tracelock.atomic", "tracelock.text", "tracelock.progress", "tracelock.distributed",
     "tracelock.sandbox", "tracelock.signals", "tracelock._triton", "tracelock._ext", "tracelock.integrity",
     "tracelock.checks", "tracelock.cli_parser", "tracelock.cli_values",
     "tracelock.cli_threads", "tracelock.policy_specs", "tracelock.cli_options", "tracelock.names"],
    # the ops, their self-check and the environment report that runs it
    ["tracelock.kernels", "tracelock.ops", "tracelock.selfcheck", "tracelock.selfcheck_inputs", "tracelock.env"],
    ["tracelock.models"],
    # the tasks: prompts, answers and scoring (the testbed's, GSM8K's answer rules)
    ["tracelock.tasks"],
    # trace data: what a decode recorded, stored and replayed
    ["tracelock.traces"],
    ["tracelock.features"],
    ["tracelock.controller", "tracelock.l2p"],
    ["tracelock.policies"],
    ["tracelock.decode"],
    ["tracelock.generate", "tracelock.reference", "tracelock.throughput", "tracelock.api", "tracelock.llm",
     "tracelock.llada"],
    # producers: decode with a policy and record traces or features
    ["tracelock.recording", "tracelock.features_cli"],
    ["tracelock.train"],
    # what runs whole jobs on top of everything else
    ["tracelock.testbed", "tracelock.eval", "tracelock.rl", "tracelock.serve", "tracelock.testing",
     "tracelock.generate_cli", "tracelock.recipe"],
    ["tracelock.cli", "tracelock.__main__"],
]



def _modules() -> dict:
    """{module name: source path} of every module of the package (kernels under tracelock.kernels)."""
    out = {}
    for base, prefix in ((PACKAGE, ("tracelock",)), (KERNELS, ("tracelock", "kernels"))):
        for path in base.rglob("*.py"):
            parts = prefix + path.relative_to(base).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict) -> set:
    """The tracelock modules ``name`` imports, with the packages whose ``__init__`` the import runs."""
    is_package = path.name == "__init__.py"
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                module = ".".join(base + ([module] if module else []))
            # `from a import b` imports the module a.b when there is one, else a name of a
            found = [f"{module}.{alias.name}" if f"{module}.{alias.name}" in modules else module
                     for alias in node.names]
        else:
            continue
        for target in found:
            if target != "tracelock" and not target.startswith("tracelock."):
                continue
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                package = ".".join(parts[:i])
                if package in modules and package != name and not name.startswith(package + "."):
                    targets.add(package)
    return targets


def _graph() -> dict:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _layer(name: str) -> int:
    best, layer = -1, None
    for i, rooms in enumerate(LAYERS):
        for room in rooms:
            if (name == room or name.startswith(room + ".")) and len(room) > best:
                best, layer = len(room), i
    return layer


def _cycles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _upward(graph: dict) -> set:
    """(importer, imported) pairs that point up the layers; an import of a.b.c counts as one of a.b.c (the packages
    it runs on the way count for circles)."""
    out = set()
    for importer, targets in graph.items():
        named = {t for t in targets if not any(other.startswith(t + ".") for other in targets)}
        out |= {(importer, t) for t in named if _layer(t) > _layer(importer)}
    return out


def test_every_module_has_a_layer():
    missing = sorted(name for name in _graph() if _layer(name) is None)
    assert not missing, f"modules in no room of LAYERS (add their room, at the lowest layer that fits): {missing}"


def test_the_import_graph_has_no_circle():
    assert _cycles(_graph()) == []


def test_imports_run_down_the_layers():
    upward = _upward(_graph())
    assert not upward, f"imports from a lower layer to a higher one: {sorted(upward)}"


def _folder(name: str) -> str:
    """A module's folder: its subpackage under tracelock (tracelock.decode for tracelock.decode.step), or the
    top-level module itself."""
    return ".".join(name.split(".")[:2])


def test_every_room_is_a_whole_folder():
    rooms = [room for rooms in LAYERS for room in rooms]
    assert all(room.count(".") <= 1 for room in rooms), [room for room in rooms if room.count(".") > 1]
    assert len(rooms) == len(set(rooms))


def test_no_folder_imports_one_above_it():
    """Between folders, not only modules: a folder's modules import nothing of a folder in a higher layer, so no
    chain of imports between folders comes back to where it started."""
    pairs = {(_folder(a), _folder(b)) for a, targets in _graph().items() for b in targets if _folder(a) != _folder(b)}
    upward = sorted((a, b) for a, b in pairs if b != "tracelock" and _layer(b) > _layer(a))
    assert not upward, f"folders importing a folder above them: {upward}"
    folder_graph = {}
    for a, b in pairs:
        folder_graph.setdefault(a, set()).add(b)
    assert _cycles(folder_graph) == [], "a circle between folders"


def test_the_checker_sees_a_circle_and_an_upward_import():
    graph = {"tracelock.checks": {"tracelock.policies"}, "tracelock.policies": {"tracelock.checks"}}
    assert _cycles(graph) == [["tracelock.checks", "tracelock.policies"]]
    assert _upward(graph) == {("tracelock.checks", "tracelock.policies")}


def test_the_checker_reads_relative_and_lazy_imports(tmp_path):
    path = tmp_path / "rule.py"
    path.write_text("def f():\n    from .base import Policy\n    import tracelock.decode.step\n")
    modules = dict.fromkeys(["tracelock", "tracelock.policies", "tracelock.policies.base", "tracelock.decode",
                             "tracelock.decode.step"])
    assert _imports("tracelock.policies.rule", path, modules) == {"tracelock.policies.base", "tracelock.decode",
                                                                  "tracelock.decode.step"}
