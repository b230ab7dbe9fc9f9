"""The shape of the source tree (docs/architecture.md): layers, no import circles, sizes.

Walks ``src/kvstack`` with ``ast`` (nothing is imported). An import counts wherever it is
written: inside a function, and inside ``if TYPE_CHECKING:`` too (a type-only import is
still a dependency; a circle it closes is a circle). The layer of a module is the layer of
its top-level folder (``LAYERS``, lowest first); a module imports only modules of its own
layer or lower ones, except the pairs in ``EXCEPTIONS``, each with its reason. No module
imports another module's ``_private`` name.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass, field
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "kvstack"

# Top-level folders of src/kvstack by layer, lowest first ("" = the package itself).
LAYERS: list[tuple[str, ...]] = [
    ("core", "sampling_params"),  # 0 the shared vocabulary (and vLLM's import path)
    ("kv", "sched"),  # 1 KV memory and bookkeeping, the scheduler
    ("model",),  # 2 the model, its runner, sampler and kernels
    ("spec",),  # 3 speculative decoding: proposers, the drafter, rejection sampling
    ("config",),  # 4 engine options, checked against the registries
    ("engine", "testing", ""),  # 5 the engine and the offline API ("" = kvstack)
    ("serve",),  # 6 the OpenAI server
    ("route", "tools"),  # 7 applications on top of the server/engine
    ("deploy",),  # 8 manifests that run the applications
    ("cli",),  # 9 the command line
]

# (importer, imported) pairs allowed to go upward, at most 5, each with its reason.
EXCEPTIONS: dict[tuple[str, str], str] = {
    ("core.request", "kv.press.state"): (
        "a request carries its press's per-request state (type only); the state's class "
        "lives with the presses that define it"
    ),
}

MAX_FILE_LINES = 450
MAX_FUNCTION_LINES = 120
# Files allowed past MAX_FILE_LINES, at most 5, each with its reason.
LONG_FILES: dict[str, str] = {}
# Modules allowed at the package root, each with its reason.
ROOT_MODULES: dict[str, str] = {
    "__init__.py": "the package",
    "sampling_params.py": "vLLM's import path (``vllm.sampling_params``), kept for drop-in use",
}


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
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                mod.imports |= _targets(mod, node, names)
        # A package importing its own parent is Python loading the parent first.
        mod.imports = {m for m in mod.imports if m != mod.name and not _is_parent(m, mod.name)}
    return mods


def _is_parent(candidate: str, name: str) -> bool:
    return candidate == "" or name.startswith(candidate + ".")


def layer_of(name: str) -> int:
    """The layer of the top-level folder holding ``kvstack.name``."""
    top = name.split(".")[0] if name else ""
    for i, folders in enumerate(LAYERS):
        if top in folders:
            return i
    raise AssertionError(f"kvstack.{name}: folder {top!r} is in no layer: add it to LAYERS")


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
    assert len(LONG_FILES) <= 5, "at most 5 files past the size limit, each with its reason"
    big, long = [], []
    for mod in load_modules().values():
        lines = len(mod.path.read_text(encoding="utf-8").splitlines())
        if lines > MAX_FILE_LINES and str(mod.path.relative_to(SRC)) not in LONG_FILES:
            big.append(f"{mod.path.relative_to(SRC)}: {lines} lines")
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{mod.path.relative_to(SRC)}: {node.name} {n} lines")
    assert not big and not long, "\n".join(big + long)


def private_imports(mods: dict[str, Module]) -> list[str]:
    """``from kvstack.x import _name`` lines: another module's private name."""
    bad = []
    for mod in mods.values():
        for node in ast.walk(mod.tree):
            if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith(
                "kvstack"
            ):
                continue
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    bad.append(f"kvstack.{mod.name} imports {node.module}.{alias.name}")
    return bad


def test_no_private_name_imports() -> None:
    bad = private_imports(load_modules())
    assert not bad, "imports of private names:\n" + "\n".join(bad)


def test_package_root_holds_no_loose_modules() -> None:
    """Every module lives in the folder of its concept; the root only has the package."""
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in ROOT_MODULES)
    assert not loose, f"modules at src/kvstack/ outside any folder: {loose}"


def test_checker_sees_function_local_and_type_only_imports(tmp_path: Path) -> None:
    """The walker counts an import inside a function and one under TYPE_CHECKING, and the
    private-name check names the offender."""
    code = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from kvstack import cli\n"
        "def f():\n    from kvstack.kv import manager\n"
        "from kvstack.kv.manager import _hidden\n"
    )
    mod = Module("x", tmp_path / "x.py", ast.parse(code))
    found: set[str] = set()
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            found |= _targets(mod, node, {"cli", "kv", "kv.manager"})
    assert found == {"cli", "kv", "kv.manager"}
    assert private_imports({"x": mod}) == ["kvstack.x imports kvstack.kv.manager._hidden"]


def test_a_circle_through_a_type_only_import_is_found(tmp_path: Path) -> None:
    a = Module("a", tmp_path / "a.py", ast.Module(body=[], type_ignores=[]), {"b"})
    b = Module("b", tmp_path / "b.py", ast.Module(body=[], type_ignores=[]), {"a"})
    assert import_cycles({"a": a, "b": b}) == [["a", "b"]]
