"""The shape of the code: each layer's import graph and the size of its modules.

    python scripts/structure.py report [--lines]   # per layer: modules, imports, imports running back up,
                                                   # circles, floors (and, with --lines, each module's lines)
    python scripts/structure.py sizes              # exit 1 when a module of service/ or sdk/ is over 600 lines

`make lint` runs `sizes`. The report is how the structure issue measured the house before and after: a floor
is a module's height in the import graph (a module importing nothing of its layer is on floor 1; circles are
condensed into one node first), an import "runs back up" when it goes to a module on the same floor or a higher
one than its importer, which only an import inside a circle can do, and a circle is a set of two or more modules
that reach each other through imports. The graph is grimp's, the one import-linter checks.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 600
SIZED = ("service", "sdk")
LAYERS = (
    "caller_memory.service.domain",
    "caller_memory.service.storage",
    "caller_memory.service.http",
)


def module_file(module: str) -> Path:
    """The source file of a module of the project (``caller_memory.X.Y`` lives at ``X/Y.py`` or ``X/Y/``)."""
    parts = module.split(".")[1:]
    path = ROOT.joinpath(*parts)
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def line_count(path: Path) -> int:
    if not path.exists():  # a folder of data files grimp sees as a namespace package
        return 0
    with path.open("rb") as source:
        return sum(1 for _ in source)


def oversized() -> list[tuple[Path, int]]:
    found = []
    for top in SIZED:
        for path in sorted((ROOT / top).rglob("*.py")):
            lines = line_count(path)
            if lines > LIMIT:
                found.append((path.relative_to(ROOT), lines))
    return found


def circles(nodes: set[str], edges: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components (Tarjan, iterative), every one of them, single modules included."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[set[str]] = []
    counter = 0
    for start in sorted(nodes):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                found.append(component)
    return found


def layer_report(graph: object, layer: str, lines: bool) -> None:
    nodes = set(graph.find_descendants(layer)) | {layer}  # type: ignore[attr-defined]
    edges: dict[str, set[str]] = defaultdict(set)
    for importer in nodes:
        for imported in graph.find_modules_directly_imported_by(importer):  # type: ignore[attr-defined]
            if imported in nodes and imported != importer:
                edges[importer].add(imported)
    for node in nodes:
        edges.setdefault(node, set())
    components = circles(nodes, edges)
    component_of = {m: i for i, c in enumerate(components) for m in c}
    floor: dict[int, int] = {}
    for i, component in enumerate(components):  # Tarjan yields a component after all it imports
        below = {component_of[t] for m in component for t in edges[m]} - {i}
        floor[i] = 1 + max((floor[j] for j in below), default=0)
    imports = sum(len(targets) for targets in edges.values())
    back_up = sum(
        1 for m, targets in edges.items() for t in targets if floor[component_of[t]] >= floor[component_of[m]]
    )
    loops = [sorted(c) for c in components if len(c) > 1]
    short = len(layer) + 1
    print(
        f"{layer}: {len(nodes)} modules, {imports} imports, {back_up} running back up, "
        f"{len(loops)} circles, {max(floor.values())} floors"
    )
    for loop in loops:
        print("  circle: " + ", ".join(m[short:] or "(package)" for m in loop))
    if lines:
        for module in sorted(nodes):
            name = module[short:] or "__init__"
            print(f"  {line_count(module_file(module)):5d}  floor {floor[component_of[module]]:2d}  {name}")


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    report = commands.add_parser("report", help="each layer's import graph")
    report.add_argument("--lines", action="store_true", help="each module with its lines and floor")
    commands.add_parser("sizes", help=f"fail on a module over {LIMIT} lines")
    args = parser.parse_args()
    if args.command == "sizes":
        found = oversized()
        for path, lines in found:
            print(f"{path}: {lines} lines (over {LIMIT}: split it along a seam it already shows)")
        return 1 if found else 0
    import grimp  # import-linter's graph builder, installed with it

    graph = grimp.build_graph("caller_memory.service", "caller_memory.sdk", cache_dir=None)
    for layer in LAYERS:
        layer_report(graph, layer, args.lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
