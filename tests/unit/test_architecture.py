"""The package's shape: imports point down the layers (the import-linter contract in pyproject.toml,
function-level imports included), no two modules import each other however indirectly, and no module
grows past about 400 lines."""
import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[2]
MAX_MODULE_LINES = 420


def test_imports_point_down_the_layers():
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    contracts = (ROOT / "pyproject.toml").read_text().count("[[tool.importlinter.contracts]]")
    assert f"{contracts} kept, 0 broken" in result.stdout


def test_no_module_is_over_about_400_lines():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in (ROOT / "aligner").rglob("*.py")}
    assert {name: n for name, n in sizes.items() if n > MAX_MODULE_LINES} == {}


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of two or more nodes (Tarjan's, without recursion)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            successor = next(successors, None)
            if successor is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = [stack.pop()]
                    while component[-1] != node:
                        component.append(stack.pop())
                    on_stack.difference_update(component)
                    if len(component) > 1:
                        found.append(sorted(component))
            elif successor not in index:
                index[successor] = low[successor] = len(index)
                stack.append(successor)
                on_stack.add(successor)
                work.append((successor, iter(sorted(edges[successor]))))
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
    return found


def test_strongly_connected_finds_cycles_and_only_them():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": {"d"}, "f": {"a"}, "g": set()}
    assert sorted(strongly_connected(edges)) == [["a", "b", "c"], ["d", "e"]]
    assert strongly_connected({"a": {"b"}, "b": set()}) == []


def describe_cycle(graph, component: list[str]) -> str:
    """One cycle through the component's first module, each import with its line."""
    start, others = component[0], set(component)
    back = min((graph.find_shortest_chain(importer=m, imported=start) or (m, start) for m in
                graph.find_modules_directly_imported_by(start) & others), key=len)
    steps = [start, *back]
    hops = []
    for importer, imported in zip(steps, steps[1:]):
        details = graph.get_import_details(importer=importer, imported=imported)
        hops.append(f"{importer} -> {imported} (line {details[0]['line_number'] if details else '?'})")
    return f"{', '.join(component)}:\n    " + "\n    ".join(hops)


def test_no_import_cycles_between_modules():
    """Module by module (a package is its __init__), function-level imports included: a deferred import
    hides a cycle from start-up but not from the design."""
    graph = grimp.build_graph("aligner", cache_dir=None)
    edges = {module: graph.find_modules_directly_imported_by(module) for module in graph.modules}
    cycles = [describe_cycle(graph, component) for component in strongly_connected(edges)]
    assert not cycles, "import cycles:\n" + "\n".join(cycles)
