"""The shape of the source tree (docs/architecture.md): layers, no import circles, sizes.

Walks ``src/kvstack`` with ``ast`` (nothing is imported). An import counts wherever it is
written, inside a function too; only ``if TYPE_CHECKING:`` blocks are skipped, since they
never run. The layer rule: a module imports only modules of its own layer or lower ones
(``LAYERS``, lowest first), except the pairs in ``EXCEPTIONS``, each with its reason.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass, field
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "kvstack"

# Module name prefixes by layer, lowest first; the longest matching prefix decides.
LAYERS: list[tuple[str, ...]] = [
    (
        "errors",
        "units",
        "registry",
        "options",
        "model_config",
        "structured_outputs",
        "request",
        "segment_marks",
        "prompts",
        "hugepages",
    ),
    ("kv", "sched", "spec", "stats"),  # 1 bookkeeping and KV memory, speculation
    ("model",),  # 2 the model, its runner and sampler
    (
        "config",
        "config_choices",
        "vllm_args",
        "segment_config",
    ),  # 3 engine options, checked against registries
    # 4 the engine ("" = kvstack)
    (
        "engine",
        "engine_stats",
        "step_isolation",
        "segment_support",
        "hybrid_support",
        "llm",
        "output_processor",
        "testing",
        "",
    ),
    ("serve",),  # 5 the OpenAI server
    ("route", "tools"),  # 6 applications on top of the server/engine
    ("deploy",),  # 7 manifests that run the applications
    ("cli",),  # 8 the command line
]

# (importer, imported) pairs allowed to go upward, at most 5, each with its reason.
EXCEPTIONS: dict[tuple[str, str], str] = {}

MAX_FILE_LINES = 450
MAX_FUNCTION_LINES = 120


@dataclass
class Module:
    name: str  # "kv.manager" (relative to kvstack; "" for the package itself)
    path: Path
    tree: ast.Module
    imports: set[str] = field(default_factory=set)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def _targets(mod: Module, node: ast.Import | ast.ImportFrom, names: set[str]) -> set[str]:
    """kvstack modules an import statement loads (a ``from pkg import mod`` loads both)."""
    if isinstance(node, ast.Import):
        full = [a.name for a in node.names]
    else:
        if node.level:
            base = mod.name.split(".") if mod.name else []
            if mod.path.name != "__init__.py":
                base = base[:-1]
            base = base[: len(base) - (node.level - 1)]
            prefix = ".".join(["kvstack", *base, *([node.module] if node.module else [])])
        else:
            prefix = node.module or ""
        full = [prefix] + [f"{prefix}.{a.name}" for a in node.names]
    out = set()
    for name in full:
        if name == "kvstack" or name.startswith("kvstack."):
            rel = name.removeprefix("kvstack").removeprefix(".")
            if rel in names:
                out.add(rel)
    return out


@functools.cache
def load_modules() -> dict[str, Module]:
    mods = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        mod = Module(_module_name(path), path, ast.parse(path.read_text(encoding="utf-8")))
        mods[mod.name] = mod
    names = set(mods)
    for mod in mods.values():
        skip = _type_checking_nodes(mod.tree)
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.Import | ast.ImportFrom) and id(node) not in skip:
                mod.imports |= _targets(mod, node, names)
        # A package importing its own parent is Python loading the parent first.
        mod.imports = {m for m in mod.imports if m != mod.name and not _is_parent(m, mod.name)}
    return mods


def _is_parent(candidate: str, name: str) -> bool:
    return candidate == "" or name.startswith(candidate + ".")


def layer_of(name: str) -> int:
    best, best_len = -1, -1
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            hit = name == p or (p != "" and name.startswith(p + "."))
            if hit and len(p) > best_len:
                best, best_len = i, len(p)
    assert best >= 0, f"module kvstack.{name} is in no layer: add it to LAYERS"
    return best


def import_cycles(mods: dict[str, Module]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(mods[v].imports):
            if w not in index:
                visit(w)
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

    for v in sorted(mods):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_circles() -> None:
    cycles = import_cycles(load_modules())
    assert not cycles, "import circles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_no_module_imports_past_its_layer() -> None:
    assert len(EXCEPTIONS) <= 5, "at most 5 stated exceptions to the layer rule"
    bad = []
    for mod in load_modules().values():
        for dep in sorted(mod.imports):
            if layer_of(dep) > layer_of(mod.name) and (mod.name, dep) not in EXCEPTIONS:
                bad.append(
                    f"kvstack.{mod.name} (layer {layer_of(mod.name)}) imports "
                    f"kvstack.{dep} (layer {layer_of(dep)})"
                )
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_exceptions_are_still_needed() -> None:
    mods = load_modules()
    stale = [
        pair
        for pair in EXCEPTIONS
        if pair[1] not in mods.get(pair[0], Module("", SRC, ast.Module())).imports
    ]
    assert not stale, f"exceptions no longer used, remove them: {stale}"


def test_file_and_function_sizes() -> None:
    big, long = [], []
    for mod in load_modules().values():
        lines = len(mod.path.read_text(encoding="utf-8").splitlines())
        if lines > MAX_FILE_LINES:
            big.append(f"{mod.path.relative_to(SRC)}: {lines} lines")
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{mod.path.relative_to(SRC)}: {node.name} {n} lines")
    assert not big and not long, "\n".join(big + long)


def test_checker_sees_function_local_imports(tmp_path: Path) -> None:
    """The walker must count an import inside a function and skip TYPE_CHECKING ones."""
    code = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from kvstack import cli\n"
        "def f():\n    from kvstack.kv import manager\n"
    )
    mod = Module("x", tmp_path / "x.py", ast.parse(code))
    skip = _type_checking_nodes(mod.tree)
    found: set[str] = set()
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.Import | ast.ImportFrom) and id(node) not in skip:
            found |= _targets(mod, node, {"cli", "kv", "kv.manager"})
    assert found == {"kv", "kv.manager"}
