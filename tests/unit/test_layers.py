"""Layers run one way and nothing imports in a circle (issue 32).

Every import of every module of ``kvcalib`` and ``kvcalib_kernels`` is read from the source --
module-level and inside functions alike, only ``if TYPE_CHECKING:`` blocks are skipped -- and
checked against the layer order below: a module may import its own layer or a lower one, never
a higher one, and the import graph has no cycle at all (not even inside one layer).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"kvcalib": ROOT / "kvcalib", "kvcalib_kernels": ROOT / "kernels"}

# (layer, module prefixes), bottom first. A module belongs to the layer of its longest prefix.
LAYERS = [
    ("utilities", ("kvcalib", "kvcalib.errors", "kvcalib.io", "kvcalib.paths", "kvcalib.progress",
                   "kvcalib.accel")),
    ("spec", ("kvcalib.quant", "kvcalib.reservoir", "kvcalib.layout", "kvcalib.assets", "kvcalib.models", "kvcalib.stats",
              "kvcalib.data", "kvcalib_kernels")),
    ("methods", ("kvcalib.methods",)),
    ("codec", ("kvcalib.codec",)),
    ("recipe", ("kvcalib.recipe",)),
    ("runtime", ("kvcalib.runtime",)),
    ("offline", ("kvcalib.simulate", "kvcalib.collection", "kvcalib.calibrate", "kvcalib.optimize",
                 "kvcalib.export", "kvcalib.eval", "kvcalib.inspect", "kvcalib.serving", "kvcalib.preflight")),
    ("api", ("kvcalib.api", "kvcalib.cli")),
]
# the kernels depend on the quantization spec only
KERNEL_ALLOWED = ("kvcalib.quant", "kvcalib.errors", "kvcalib_kernels")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg, root in PACKAGES.items():
        for path in root.rglob("*.py"):
            rel = path.relative_to(root).with_suffix("")
            parts = [pkg, *rel.parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules ``module`` imports anywhere in its source (TYPE_CHECKING blocks aside)."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            names = []
        for name in names:
            while name and name not in modules:
                name = name.rsplit(".", 1)[0] if "." in name else ""
            if name and name != module:
                found.add(name)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _layer(module: str) -> int:
    best, rank = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), i
    assert rank is not None, f"{module} is in no layer: add it to LAYERS"
    return rank


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(m, p, modules) for m, p in modules.items()}


def test_every_import_runs_down_the_layers():
    graph = _graph()
    upward = [f"{m} ({LAYERS[_layer(m)][0]}) -> {d} ({LAYERS[_layer(d)][0]})"
              for m, deps in graph.items() for d in sorted(deps) if _layer(d) > _layer(m)]
    assert not upward, "imports that run upward:\n" + "\n".join(upward)


def test_kernels_depend_on_the_quantization_spec_only():
    graph = _graph()
    bad = [f"{m} -> {d}" for m, deps in graph.items() if m.startswith("kvcalib_kernels")
           for d in sorted(deps) if not any(d == a or d.startswith(a + ".") for a in KERNEL_ALLOWED)]
    assert not bad, "kernels importing above the quantization spec:\n" + "\n".join(bad)


def test_no_import_cycles():
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def strongconnect(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    import sys

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10000))
    try:
        for v in sorted(graph):
            if v not in index:
                strongconnect(v)
    finally:
        sys.setrecursionlimit(limit)
    assert not cycles, "modules that import each other in a circle:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_methods_are_named_only_by_their_own_files():
    """Outside kvcalib/methods/, no module of the package imports a method's own module except
    through the registry or a seam listed below with its reason (none today; no folder is exempt):
    what several methods share lives below them (kvcalib.quant, kvcalib.reservoir), the runtime
    reaches a method's rule through the state the codec holds (OTT's pool: LayerCodec.pool) or the
    registry (PATS's schedules, Huffman's codebooks)."""
    graph = _graph()
    seams: set[tuple[str, str]] = set()  # none left (issue 52): add one only with its one-line reason
    found = sorted((m, d) for m, deps in graph.items() for d in deps
                   if d.startswith("kvcalib.methods.") and d != "kvcalib.methods.base"
                   and not m.startswith("kvcalib.methods") and m.startswith("kvcalib."))
    unexpected = [f"{m} -> {d}" for m, d in found if (m, d) not in seams]
    assert not unexpected, "modules naming a method's module directly:\n" + "\n".join(unexpected)
    stale = sorted(seams - set(found))
    assert not stale, f"seams no module uses any more (remove them): {stale}"


def test_methods_do_not_import_each_other():
    """Methods compose through the pipeline (registry order, the tensors earlier methods fitted),
    not by importing each other: a method module imports the contract (``kvcalib.methods.base``)
    and the layers below, and what several methods share lives there (issue 52)."""
    graph = _graph()
    crossed = sorted(f"{m} -> {d}" for m, deps in graph.items() if m.startswith("kvcalib.methods.")
                     for d in deps if d.startswith("kvcalib.methods.") and d != "kvcalib.methods.base")
    assert not crossed, "method modules importing another method's module:\n" + "\n".join(crossed)
