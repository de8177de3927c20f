"""The product's modules import each other without circles: every import counts (at
module level, inside a function, or under ``TYPE_CHECKING``), since each is a
dependency a reader and a refactoring must follow. Stages never import the
orchestrator, and the stage packages stand on each other in layers (``LAYERS``): none
imports a higher layer's package. The import graph is read from the source with
``ast``."""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("stages", "orchestrator")


def modules() -> dict[str, Path]:
    found = {}
    for pkg in PACKAGES:
        for path in (REPO / pkg).rglob("*.py"):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _imported(module: str, path: Path) -> Iterator[str]:
    """Every dotted name ``module`` imports, relative imports resolved."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def import_graph() -> dict[str, set[str]]:
    """Module -> the product modules it imports (a package's own submodules and its
    parents are not edges: importing a submodule runs its package first anyway)."""
    mods = modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in mods.items():
        edges = {resolve(name) for name in _imported(module, path)}
        graph[module] = {
            t for t in edges if t is not None and t != module and not module.startswith(t + ".")
        }
    return graph


def circles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[frozenset[str]] = set()
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
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
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
                if len(component) > 1:
                    found.add(frozenset(component))
    return found


def test_the_product_has_no_import_circle() -> None:
    found = circles(import_graph())
    assert not found, sorted(sorted(c) for c in found)


def test_stages_never_import_the_orchestrator() -> None:
    graph = import_graph()
    upward = sorted(
        (m, t)
        for m, targets in graph.items()
        if m.startswith("stages")
        for t in targets
        if t.startswith("orchestrator")
    )
    assert not upward, upward


def test_a_circle_is_found_where_two_modules_import_each_other() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == {frozenset({"a", "b", "c"})}
    assert circles({"a": {"b"}, "b": set()}) == set()


# The layer of the modules directly in stages/.
BASICS = "stages"
# The stage packages in layers, lowest first: a package imports packages of its own
# layer or lower ones, never a higher one, and no two packages import each other.
LAYERS: tuple[tuple[str, ...], ...] = (
    # The basics every stage stands on: the modules directly in stages/ (config base,
    # errors, events, presets, placement, safe paths, ...). They import no package.
    (BASICS,),
    # Storage and planning that know no model: the checkpoint format, the planner.
    ("stages.checkpointing", "stages.parallelism"),
    # What several stages share of the model: the Llama, building it (HF config, loss),
    # the byte tokenizer.
    ("stages.model",),
    # Hugging Face formats of that model: exports, the transformers view, the tokenizer.
    ("stages.hf",),
    # Eval batteries and gates over the HF view, with a post-training objective's
    # evaluation, which the engine runs on its ranks.
    ("stages.evals",),
    # The curriculum's phases, each naming its eval battery.
    ("stages.curriculum",),
    # The training engine: trains the model with everything below.
    ("stages.trainer",),
    # Data prep: its ladder probe borrows the trainer's ranks.
    ("stages.data_prep",),
    # Post-training trains on the engine, on data prep's refs.
    ("stages.post_training",),
)


def stage_package(module: str) -> str | None:
    """The stage package ``module`` belongs to; a module directly in stages/ belongs
    to the basics; None outside stages."""
    parts = module.split(".")
    if parts[0] != "stages":
        return None
    if len(parts) > 1 and (REPO / "stages" / parts[1]).is_dir():
        return f"stages.{parts[1]}"
    return BASICS


def _layer_of(layers: tuple[tuple[str, ...], ...]) -> dict[str, int]:
    return {pkg: i for i, layer in enumerate(layers) for pkg in layer}


def upward_imports(
    graph: dict[str, set[str]], layers: tuple[tuple[str, ...], ...] = LAYERS
) -> list[tuple[str, str]]:
    """(module, imported module) for each import of a higher layer's package."""
    layer = _layer_of(layers)
    found = []
    for module, targets in graph.items():
        here = stage_package(module)
        if here is None:
            continue
        for target in targets:
            there = stage_package(target)
            if there is not None and layer[there] > layer[here]:
                found.append((module, target))
    return sorted(found)


def orchestrator_package(module: str) -> str | None:
    """The orchestrator's package (or top module) ``module`` belongs to."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "orchestrator" and len(parts) > 1 else None


def mutual_packages(
    graph: dict[str, set[str]], package: Callable[[str], str | None] = stage_package
) -> set[frozenset[str]]:
    """The pairs of packages (stage packages by default) that import each other."""
    imports: dict[str, set[str]] = {}
    for module, targets in graph.items():
        here = package(module)
        for target in targets:
            there = package(target)
            if here is not None and there is not None and here != there:
                imports.setdefault(here, set()).add(there)
    return {frozenset({a, b}) for a, bs in imports.items() for b in bs if a in imports.get(b, ())}


def test_every_stage_package_has_a_layer() -> None:
    packages = {p for m in modules() if (p := stage_package(m)) is not None}
    assert packages == set(_layer_of(LAYERS)), "place a new package in LAYERS"


def test_no_stage_package_imports_a_higher_layer() -> None:
    assert not upward_imports(import_graph())


def test_no_two_stage_packages_import_each_other() -> None:
    found = mutual_packages(import_graph())
    assert not found, sorted(sorted(pair) for pair in found)


def test_no_two_orchestrator_packages_import_each_other() -> None:
    # The API, the store, the gates and the runtime stand on each other too: the
    # runtime builds stages from the gates' manifest, the settings open the store.
    graph = import_graph()
    found = mutual_packages(graph, orchestrator_package)
    assert not found, sorted(sorted(pair) for pair in found)
    planted = {m: set(ts) for m, ts in graph.items()}
    planted["orchestrator.db.store"].add("orchestrator.settings")  # the store reading settings
    assert mutual_packages(planted, orchestrator_package) == {
        frozenset({"orchestrator.db", "orchestrator.settings"})
    }


def test_an_upward_import_is_found_where_one_is_planted() -> None:
    graph = import_graph()
    planted = {m: set(ts) for m, ts in graph.items()}
    planted["stages.hf.view"].add("stages.trainer.rank.loop")  # the HF view importing the engine
    assert upward_imports(planted) == [("stages.hf.view", "stages.trainer.rank.loop")]
    assert mutual_packages(planted) == {frozenset({"stages.hf", "stages.trainer"})}
    planted = {m: set(ts) for m, ts in graph.items()}
    planted["stages.base"].add("stages.model.llama")  # a basic module importing a package
    assert upward_imports(planted) == [("stages.base", "stages.model.llama")]
    # The same layer may import sideways, but never both ways.
    sideways = {"stages.checkpointing.a": {"stages.parallelism.b"}, "stages.parallelism.b": set()}
    assert upward_imports(sideways) == []
    sideways["stages.parallelism.b"].add("stages.checkpointing.a")
    assert upward_imports(sideways) == []
    assert mutual_packages(sideways) == {frozenset({"stages.checkpointing", "stages.parallelism"})}
