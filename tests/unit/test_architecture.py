"""The package's shape: imports point down the layers (the import-linter contract in pyproject.toml,
function-level imports included), no two modules import each other however indirectly, and no module
grows past about 400 lines."""
import ast
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


def unexplained_function_imports(source: str) -> list[int]:
    """Lines of imports inside functions with no comment saying why: on the import, on the line above, or
    on the first import of the run of imports it belongs to (blank lines allowed between them)."""
    lines = source.splitlines()

    def explained(number: int) -> bool:  # 1-based
        return "#" in lines[number - 1] or (number > 1 and lines[number - 2].lstrip().startswith("#"))

    imports = sorted({(node.lineno, node.end_lineno) for function in ast.walk(ast.parse(source))
                      if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
                      for node in ast.walk(function) if isinstance(node, (ast.Import, ast.ImportFrom))})
    found, run_explained, previous_end = [], False, None
    for start, end in imports:
        contiguous = previous_end is not None and all(not lines[k].strip() for k in range(previous_end, start - 1))
        run_explained = any(explained(n) for n in range(start, end + 1)) or (contiguous and run_explained)
        if not run_explained:
            found.append(start)
        previous_end = end
    return found


def test_unexplained_function_imports_are_found():
    source = ("def f():\n    import os\n\n"
              "def g():\n    import os  # optional\n    import sys\n\n    import json\n    x = 1\n    import re\n\n"
              "def h():\n    # deferred: heavy\n    import os\n\n"
              "def k():\n    if True:\n        import os\n")
    assert unexplained_function_imports(source) == [2, 10, 18]


def test_every_function_level_import_says_why():
    """An import inside a function is an optional dependency, a heavy import deferred for CLI start-up, or a
    subprocess entry point, and says so; anything else belongs at module level."""
    missing = {str(path.relative_to(ROOT)): lines for path in sorted((ROOT / "aligner").rglob("*.py"))
               if (lines := unexplained_function_imports(path.read_text()))}
    assert missing == {}
