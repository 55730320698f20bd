"""The import structure of attnlab: layers that only point down, and no import cycles.

The graph is every import between attnlab's modules, those inside functions included (grimp reads them
all): an import that runs only when a function is called still ties the two modules together.

Layers, top to bottom. A module may import its own layer and the layers below it, never one above. A
module belongs to the most specific entry that names it or a package above it (`attnlab.data.cli` is a
command, the rest of `attnlab.data` is core). Within a layer the entries may import one another, one way
only: no cycle between entries, nor between modules. Function-level imports remain for optional or heavy
dependencies (`attnlab --help` imports neither torch nor transformers); they are edges here all the same.

An import of an attnlab module inside a function stays there only when importing it at module level would load a
heavy third-party package that the importing module does not load already; every other one is at the top of its
module (test_function_level_imports_are_lazy_for_a_reason).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = "attnlab"
FACADE = "attnlab"  # attnlab/__init__.py: __version__ and lazy load/generate for users; it imports on call only
SRC = Path(__file__).resolve().parent.parent / "src"

LAYERS: list[tuple[str, list[str]]] = [
    ("entry point", [
        "attnlab.cli",  # the Typer app: wires every command
    ]),
    ("commands", [
        "attnlab.data.cli",  # attnlab data prepare
        "attnlab.eval.cli",  # attnlab eval, attnlab score
        "attnlab.eval.niah_cli",  # attnlab eval --task niah
        "attnlab.finetune.cli",  # attnlab finetune, attnlab merge
        "attnlab.bench",  # attnlab bench ...
        "attnlab.sweep",  # attnlab sweep
        "attnlab.report",  # attnlab report
    ]),
    ("services", [  # ordered (ORDERED): each imports only the services listed below it
        "attnlab.loading",  # a model and its tokenizer from whatever the user points at (adapters and GGUF included)
        "attnlab.finetune",  # fine-tuning runs, adapters, the style metric
        "attnlab.train",  # training runs: preflight, the trainer, checkpoints, telemetry
        "attnlab.eval",  # evaluation tasks and their runner, evaluation during training
        "attnlab.generation",  # the decoding engine
    ]),
    ("core", [
        "attnlab.models",  # the model, mixers, kernels, model files and checkpoints on disk, conversion
        "attnlab.data",  # tokenizers, corpora, prepared shards, datasets
        "attnlab.config",  # the config schemas, YAML loading and overrides, the preflight rules
    ]),
    ("utilities", [
        "attnlab.errors",
        "attnlab.outputs",
        "attnlab.console",
        "attnlab.noise",
        "attnlab.launch",
        "attnlab.sections",
    ]),
]


ORDERED = {"services"}  # layers whose entries import only the entries listed below them


@pytest.fixture(scope="module")
def graph():
    import grimp  # the dev extra installs it; imported here so that a `-m cuda` run without it still collects this file

    graph = grimp.build_graph(PACKAGE, cache_dir=None)
    assert "attnlab.cli" in graph.modules and "attnlab.models.modeling" in graph.modules
    for importer in graph.find_modules_that_directly_import(FACADE):
        graph.remove_import(importer=importer, imported=FACADE)
    for imported in graph.find_modules_directly_imported_by(FACADE):
        graph.remove_import(importer=FACADE, imported=imported)
    return graph


def _imports(graph) -> dict[str, set[str]]:
    """Module -> the modules it imports, the facade left out."""
    return {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules if m != FACADE}


def _where(graph, importer: str, imported: str) -> str:
    """'src/attnlab/x.py:12': the first line of `importer` that imports `imported`."""
    details = sorted(graph.get_import_details(importer=importer, imported=imported), key=lambda d: d["line_number"])
    line = details[0]["line_number"] if details else "?"
    path = SRC.joinpath(*importer.split("."))
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    return f"{path.relative_to(SRC.parent)}:{line}"


def _layer_of(module: str) -> tuple[int, str] | None:
    """(layer index, entry) of the most specific layer entry that holds `module`."""
    best = None
    for index, (_, entries) in enumerate(LAYERS):
        for entry in entries:
            if module == entry or module.startswith(entry + "."):
                if best is None or len(entry) > len(best[1]):
                    best = (index, entry)
    return best


def _tangles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (nodes that reach each other), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(components)


def _cycle_through(edges: dict[str, set[str]], start: str) -> list[str]:
    """The shortest cycle from `start` back to itself: [start, ..., start]."""
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges[v]):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{start} is in no cycle")


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Cycles that together pass through every node of every tangle (the shortest through each node, once)."""
    cycles: list[list[str]] = []
    for component in _tangles(edges):
        covered: set[str] = set()
        for node in component:
            if node not in covered:
                cycle = _cycle_through(edges, node)
                covered.update(cycle)
                cycles.append(cycle)
    return cycles


def test_every_module_is_in_a_layer(graph):
    unplaced = sorted(m for m in graph.modules if m != FACADE and _layer_of(m) is None)
    assert not unplaced, "modules in no layer of tests/test_architecture.py (add them to LAYERS): " + ", ".join(unplaced)


def _above(importer: tuple[int, str], imported: tuple[int, str]) -> bool:
    """Whether `imported` sits above `importer`: in a higher layer, or listed before it in an ORDERED layer."""
    if imported[0] != importer[0]:
        return imported[0] < importer[0]
    name, entries = LAYERS[importer[0]]
    return name in ORDERED and entries.index(imported[1]) < entries.index(importer[1])


def test_no_module_imports_a_higher_layer(graph):
    upward = []
    for importer, imported in sorted((a, b) for a, bs in _imports(graph).items() for b in bs):
        low, high = _layer_of(importer), _layer_of(imported)
        if low and high and _above(low, high):
            upward.append(f"  {_where(graph, importer, imported)}: {importer} ({LAYERS[low[0]][0]}: {low[1]}) imports "
                          f"{imported} ({LAYERS[high[0]][0]}: {high[1]})")
    assert not upward, ("imports from a lower layer to a higher one; move what is imported down (or the importer up):\n"
                        + "\n".join(upward))


def test_no_import_cycle_between_modules(graph):
    edges = _imports(graph)
    report = []
    for cycle in _cycles(edges):
        report.append("  " + " -> ".join(cycle))
        report += [f"      {_where(graph, a, b)} imports {b}" for a, b in zip(cycle, cycle[1:])]
    assert not report, "import cycles between modules; move what both sides need into a module below them:\n" + "\n".join(report)


def _component(module: str) -> str:
    """The entry of LAYERS that holds `module`: a package, or a module that the map places apart from its package."""
    return _layer_of(module)[1]


SHOWN = 5  # imports listed per edge of a cycle between packages


def test_no_import_cycle_between_packages(graph):
    """Between the packages (and the modules placed apart) that LAYERS names: within a layer they may import
    each other, one way only."""
    edges: dict[str, set[str]] = {}
    through: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for importer, imported in ((a, b) for a, bs in _imports(graph).items() for b in bs):
        if _layer_of(importer) is None or _layer_of(imported) is None:
            continue  # test_every_module_is_in_a_layer names it
        p, q = _component(importer), _component(imported)
        edges.setdefault(p, set())
        edges.setdefault(q, set())
        if p != q:
            edges[p].add(q)
            through.setdefault((p, q), []).append((importer, imported))
    report = []
    for cycle in _cycles(edges):
        report.append("  " + " -> ".join(cycle))
        for p, q in zip(cycle, cycle[1:]):
            imports = sorted(through[(p, q)])
            report += [f"      {_where(graph, a, b)} imports {b}" for a, b in imports[:SHOWN]]
            report += [f"      ... and {len(imports) - SHOWN} more imports of {q} by {p}"] if len(imports) > SHOWN else []
    assert not report, "import cycles between packages (each edge with the imports that make it):\n" + "\n".join(report)


# Function-level imports. Whether importing a module at module level would load a heavy package is read from the
# source: a module loads what its top-level statements import (inside try/except too; `if TYPE_CHECKING:` blocks
# aside), the attnlab modules among them followed through their own top-level imports, each with the packages
# above it (`import attnlab.a.b` runs attnlab/a/__init__.py first).

HEAVY = {  # third-party packages that take seconds to import, or bring a GPU stack with them
    "torch", "transformers", "triton", "fla", "peft", "accelerate", "datasets", "matplotlib", "safetensors",
    "bitsandbytes", "tensorboard", "sacrebleu", "rouge_score", "sqlglot",
}
HELP_LOADS = {"numpy", "pydantic", "rich", "typer", "yaml"}  # the third-party packages `attnlab --help` imports
# (python -X importtime -m attnlab.cli --help): for attnlab.cli and every module it loads, any other package is heavy

LAZY_ALLOWED: dict[tuple[str, str], str] = {  # (importer, imported): why the import stays in a function
    ("attnlab", "attnlab.config"): "the facade: `import attnlab`, which every `import attnlab.x` runs first, loads "
                                   "attnlab.noise only, so that attnlab.errors and the other utilities stay light",
}


MODULES = {".".join(p.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__"): p
           for p in sorted((SRC / PACKAGE).rglob("*.py"))}
THIRD_PARTY_EXCLUDED = set(sys.stdlib_module_names) | {"__future__"}


def _split_imports(tree: ast.Module) -> tuple[list[ast.stmt], list[ast.stmt]]:
    """(the imports a module runs when it is loaded, the imports inside its functions)."""
    top: list[ast.stmt] = []
    inner: list[ast.stmt] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and not in_function and ast.unparse(child.test) in ("TYPE_CHECKING",
                                                                                              "typing.TYPE_CHECKING"):
                children = child.orelse  # what a type checker alone reads is never imported
            else:
                children = [child]
            for c in children:
                if isinstance(c, (ast.Import, ast.ImportFrom)):
                    (inner if in_function else top).append(c)
                visit(c, in_function or isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return top, inner


TREES = {m: ast.parse(p.read_text(), filename=str(p)) for m, p in MODULES.items()}
IMPORTS = {m: _split_imports(tree) for m, tree in TREES.items()}


def _bound_at_top(module: str, imported_too: bool) -> set[str]:
    """Names a module's top level binds: defined (def, class, assignment), and imported if `imported_too`."""
    names = set()
    for node in TREES[module].body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif imported_too and isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def _with_packages(module: str) -> set[str]:
    """`module` and the packages above it: what `import module` runs."""
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts) + 1)} & set(MODULES)


def _targets(node: ast.stmt, importer: str) -> tuple[set[str], set[str]]:
    """(the attnlab modules an import statement names, the third-party packages it imports)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = importer.split(".") if MODULES[importer].name == "__init__.py" else importer.split(".")[:-1]
        base = base[:len(base) - node.level + 1] if node.level else []
        names = [".".join(base + ([node.module] if node.module else []))]
    ours = {n for n in names if n.split(".")[0] == PACKAGE}
    third = {n.split(".")[0] for n in names} - {PACKAGE} - THIRD_PARTY_EXCLUDED
    if isinstance(node, ast.ImportFrom) and ours:
        (package,) = ours
        for alias in node.names:
            if f"{package}.{alias.name}" in MODULES:
                ours.add(f"{package}.{alias.name}")  # from attnlab.x import submodule
            elif MODULES[package].name == "__init__.py" and alias.name not in _bound_at_top(package, True):
                # a lazy export (the package's __getattr__ imports it on first use): the submodules that define it
                ours |= {m for m in MODULES if m.startswith(package + ".") and alias.name in _bound_at_top(m, False)}
    return ours, third


def _load_closure(modules: set[str]) -> tuple[set[str], set[str]]:
    """(the attnlab modules, the third-party packages) that importing `modules` loads, through module-level imports."""
    seen: set[str] = set()
    third: set[str] = set()
    stack = [p for m in modules for p in _with_packages(m)]
    while stack:
        module = stack.pop()
        if module in seen:
            continue
        seen.add(module)
        for node in IMPORTS[module][0]:
            ours, theirs = _targets(node, module)
            third |= theirs
            stack += [p for m in ours for p in _with_packages(m)]
    return seen, third


def test_function_level_imports_are_lazy_for_a_reason():
    """An attnlab module imported inside a function would load, at module level, a heavy package that the
    importing module does not load already (for attnlab.cli and what it loads: any package `attnlab --help` does
    not import); any other such import belongs at the top of its module. LAZY_ALLOWED names the exceptions."""
    help_modules, _ = _load_closure({"attnlab.cli"})
    flagged, used = [], set()
    for importer in sorted(MODULES):
        _, loaded = _load_closure({importer})
        for node in IMPORTS[importer][1]:
            ours, _ = _targets(node, importer)
            if not ours:
                continue
            added = _load_closure(ours)[1] - loaded
            heavy = added - HELP_LOADS if importer in help_modules else added & HEAVY
            named = {m for m in ours if not any(o.startswith(m + ".") for o in ours)}  # the most specific names
            allowed = {(importer, m) for m in named} & set(LAZY_ALLOWED)
            used |= allowed
            if not heavy and not allowed:
                flagged.append(f"  {MODULES[importer].relative_to(SRC.parent)}:{node.lineno}: {ast.unparse(node)}")
    stale = sorted(set(LAZY_ALLOWED) - used)
    assert not flagged, ("imports inside functions that load nothing heavy the module does not load already; move "
                         "them to the top of the module (or name them in LAZY_ALLOWED with the reason):\n"
                         + "\n".join(flagged))
    assert not stale, "LAZY_ALLOWED entries that match no import inside a function; remove them: " + ", ".join(
        map(str, stale))


def test_attnlab_help_loads_no_heavy_package():
    """`attnlab --help` stays fast: importing the CLI in a fresh interpreter loads none of the heavy packages
    (HEAVY, and the data stack that datasets would bring)."""
    import json
    import subprocess
    import sys

    code = "import sys, json; import attnlab.cli; print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    loaded = set(json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                           cwd=SRC).stdout))
    heavy = loaded & (HEAVY | {"pyarrow", "pandas", "scipy", "PIL", "gguf", "psutil"})
    assert not heavy, f"importing attnlab.cli loads {sorted(heavy)}: import them inside the commands that use them"
