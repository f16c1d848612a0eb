"""The shape of the code: no import cycles, packages layered, one entry point per dimension, no global step timer."""

import ast
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "fivefold"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """fivefold module -> the fivefold modules it imports anywhere in its body (inside functions and
    under TYPE_CHECKING too: a cycle hidden in a function is still a cycle)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("fivefold"):
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
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
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    part = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        part.append(top)
                        if top == node:
                            break
                    if len(part) > 1:
                        found.append(sorted(part))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def part_graph(graph: dict[str, set[str]], parent: str) -> dict[str, set[str]]:
    """The import graph between the parts directly inside package `parent` (a part: a module, or a
    subpackage with everything below it), from the module graph."""
    def part(module: str) -> str | None:
        rest = module.removeprefix(parent + ".")
        return None if rest == module else f"{parent}.{rest.split('.')[0]}"

    parts: dict[str, set[str]] = {}
    for module, targets in graph.items():
        if (a := part(module)) is not None:
            parts.setdefault(a, set()).update(b for t in targets if (b := part(t)) not in (None, a))
    return parts


# The layering the folders show: no two parts of fivefold, nor of fivefold.parallel, fivefold.planner
# or fivefold.checkpoint, import each other, even through others. model/ stands on nothing else of fivefold.
@pytest.mark.parametrize("parent", ["fivefold", "fivefold.parallel", "fivefold.planner", "fivefold.checkpoint"])
def test_the_parts_of_a_package_are_layered(parent):
    graph = part_graph(import_graph(), parent)
    assert len(graph) > 3, "the part graph found almost nothing: it would pass on anything"
    assert cycles(graph) == []


def test_the_model_stands_on_nothing_else_of_fivefold():
    graph = part_graph(import_graph(), "fivefold")
    assert graph["fivefold.model"] == set()


def test_the_layering_check_sees_a_loop_between_two_packages():
    graph = {"p.a.x": {"p.b.y"}, "p.b.y": set(), "p.b.z": {"p.a.w"}, "p.a.w": set(), "p.c": {"p.a.x"}}
    assert part_graph(graph, "p") == {"p.a": {"p.b"}, "p.b": {"p.a"}, "p.c": {"p.a"}}
    assert cycles(part_graph(graph, "p")) == [["p.a", "p.b"]]


def test_the_cycle_finder_finds_a_cycle_hidden_in_a_function():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_every_module_imports_alone():
    """Each module imports in a fresh interpreter (an order-dependent import would hide a cycle)."""
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)"
    modules = sorted(m for m in import_graph() if m != "fivefold.__main__")
    subprocess.run([sys.executable, "-c", code, *modules], cwd=ROOT, check=True, timeout=120)


def test_every_benchmark_imports():
    """Benchmarks are not run by the suite, but they import each other's sides: a renamed helper
    must not leave one that cannot start (tensor_parallel.py once imported a name that had moved)."""
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)"
    modules = sorted(f"benchmarks.{p.stem}" for p in (ROOT / "benchmarks").glob("*.py"))
    assert "benchmarks.startup_memory" in modules
    subprocess.run([sys.executable, "-c", code, *modules], cwd=ROOT, check=True, timeout=120)


@pytest.mark.parametrize("module,entry", [
    ("fivefold.parallel.pipeline.stages", "apply_pipeline_parallel"),
    ("fivefold.parallel.tensor", "apply_tensor_parallel"),
    ("fivefold.parallel.expert", "apply_expert_parallel"),
    ("fivefold.parallel.context", "apply_context_parallel"),
    ("fivefold.parallel.recompute", "apply_recompute"),
    ("fivefold.parallel.data", "apply_data_parallel"),
])
def test_every_dimension_has_the_same_entry_shape(module, entry):
    import importlib

    fn = getattr(importlib.import_module(module), entry)
    params = inspect.signature(fn).parameters.values()
    # What an earlier dimension returned (the pipeline's chunks, for data parallel) comes keyword-only.
    assert [q.name for q in params if q.kind != q.KEYWORD_ONLY] == ["model", "mesh", "cfg", "derived"]


def test_no_module_level_step_timer():
    """The step timer is the mesh's (every AxisGroup carries it), not a module global."""
    for path in PACKAGE.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                called = ast.unparse(node.value.func)
                assert called not in ("StepTimer", "CommStats"), f"{path}:{node.lineno}: a module-level {called}"
