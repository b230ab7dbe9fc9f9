"""Declared options: one dataclass field is one option, with its help text, flag and choices.

A frozen config dataclass declares each user option once::

    @dataclass(frozen=True)
    class CacheConfig:
        block_size: int = option(16, "tokens per KV block")
        kv_press: str | None = option(None, "...", choices=lambda: PRESSES.names())

and everything else is derived from that declaration: argparse flags
(``add_arguments``), reading them back (``from_namespace``), keyword construction with a
``TypeError`` for unknown names (``build``), choice checks (``check_choices``) and the
option list in docstrings (``describe``). A field whose type is itself a config
dataclass is a *part*: its options are flattened into the parent's, so
``EngineConfig.cache.block_size`` is the option ``block_size`` and the flag
``--block-size``.

Invariants: option names are unique across a config and its parts (they are keyword
arguments and argparse dests); ``convert`` is idempotent (``convert(convert(x)) ==
convert(x)``), so a value may be converted once from the CLI and again by ``build``;
``choices`` is called lazily (a registry's module may import torch, and ``kvstack
--help`` must not). Layer 0: imports nothing from kvstack but the errors.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvstack.core.errors import ConfigError

C = TypeVar("C")
_KEY = "kvstack.option"


@dataclass(frozen=True)
class Option:
    """How one option looks outside its config class.

    ``flag`` defaults to ``--`` + the field name with dashes; a bool defaulting to True
    needs a ``--no-...`` flag (it is stored False when given). ``convert`` turns CLI
    text or a keyword value into the field's value (``parse_size``); with it the flag
    takes text as is. ``label`` names the option in "unknown ..." errors (default: the
    field name). ``env`` names the environment variable(s) read for the flag's default (the first
    set one wins).
    ``flag_help`` replaces ``help`` in ``--help`` where the flag says the opposite of the
    option (``--no-chunked-prefill`` for ``enable_chunked_prefill``). ``aliases`` are
    other spellings of the flag (vLLM's, e.g. ``--no-enable-chunked-prefill``);
    ``switches`` are argument-less flags that set the option (``Switch``).
    """

    help: str
    flag: str | None = None
    group: str = "options"
    choices: Callable[[], Iterable[str]] | None = None
    metavar: str | None = None
    convert: Callable[[Any], Any] | None = None
    label: str | None = None
    env: str | tuple[str, ...] | None = None
    flag_help: str | None = None
    aliases: tuple[str, ...] = ()
    switches: tuple[Switch, ...] = ()
    nargs: str | None = None  # argparse's ("+": one or more values, a list)


@dataclass(frozen=True)
class Switch:
    """A flag without argument that sets an option (vLLM's ``--no-enable-prefix-caching``
    sets ``prefix_cache`` to "none"). ``value`` may be a function of the current value
    (``--enable-prefix-caching`` keeps a chosen cache, restores the default from "none")."""

    flag: str
    value: Any
    help: str


def option(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field that is a user option (``kw``: the fields of ``Option``)."""
    return field(default=default, metadata={_KEY: Option(help, **kw)})


@dataclass(frozen=True)
class OptionSpec:
    """One declared option as seen from the outermost config (``part``: "" or a field)."""

    name: str
    part: str
    default: Any
    type: Any
    option: Option

    @property
    def flag(self) -> str:
        return self.option.flag or "--" + self.name.replace("_", "-")

    @property
    def value_type(self) -> Any:
        """The annotation without ``None`` (``int`` for ``int | None``)."""
        args = [a for a in typing.get_args(self.type) if a is not type(None)]
        if isinstance(self.type, types.UnionType) or typing.get_origin(self.type) is typing.Union:
            return args[0] if len(args) == 1 else Any
        return self.type

    def choices(self) -> tuple[str, ...] | None:
        return None if self.option.choices is None else tuple(self.option.choices())

    def convert(self, value: Any) -> Any:
        if value is None or self.option.convert is None:
            return value
        return self.option.convert(value)


class LazyChoices(Sequence[str]):
    """argparse ``choices=`` whose names are read only when argparse looks at them."""

    def __init__(self, names: Callable[[], Iterable[str]]) -> None:
        self._names = names

    def _get(self) -> tuple[str, ...]:
        return tuple(self._names())

    def __iter__(self) -> Iterator[str]:
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())

    def __contains__(self, value: object) -> bool:
        return value in self._get()

    def __getitem__(self, i: Any) -> Any:
        return self._get()[i]


_SPECS: dict[type, tuple[OptionSpec, ...]] = {}


def option_specs(cls: type) -> tuple[OptionSpec, ...]:
    """Every option of config class ``cls`` and of its parts, in declaration order."""
    if cls not in _SPECS:
        _SPECS[cls] = _collect(cls)
    return _SPECS[cls]


def _collect(cls: type) -> tuple[OptionSpec, ...]:
    specs: list[OptionSpec] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        opt = f.metadata.get(_KEY)
        if opt is not None:
            specs.append(OptionSpec(f.name, "", f.default, hints[f.name], opt))
        elif dataclasses.is_dataclass(hints[f.name]):
            for s in option_specs(hints[f.name]):
                specs.append(dataclasses.replace(s, part=f.name))
    names = [s.name for s in specs]
    dup = {n for n in names if names.count(n) > 1}
    assert not dup, f"option names must be unique in {cls.__name__}: {sorted(dup)}"
    return tuple(specs)


def _parts(cls: type) -> dict[str, type]:
    hints = typing.get_type_hints(cls)
    return {
        f.name: hints[f.name]
        for f in dataclasses.fields(cls)
        if _KEY not in f.metadata and dataclasses.is_dataclass(hints[f.name])
    }


def unknown_keyword(what: str, name: str, valid: Iterable[str]) -> TypeError:
    """Python's own message for a bad keyword, plus the closest option names."""
    near = difflib.get_close_matches(name, list(valid), n=3)
    hint = f" (did you mean {', '.join(near)}?)" if near else ""
    return TypeError(f"{what} got an unexpected keyword argument {name!r}{hint}")


def build(cls: type[C], values: Mapping[str, Any], what: str | None = None) -> C:
    """``cls`` (and its parts) from option values by name; unnamed options keep defaults.

    An unknown name raises ``TypeError`` naming it; each value goes through its
    option's ``convert``; invalid values raise the classes' own ``ConfigError``.
    """
    specs = {s.name: s for s in option_specs(cls)}
    for name in values:
        if name not in specs:
            raise unknown_keyword(what or f"{cls.__name__}()", name, specs)
    own: dict[str, Any] = {}
    by_part: dict[str, dict[str, Any]] = {}
    for name, value in values.items():
        s = specs[name]
        (by_part.setdefault(s.part, {}) if s.part else own)[name] = s.convert(value)
    for part, part_cls in _parts(cls).items():
        own[part] = part_cls(**by_part.get(part, {}))
    return cls(**own)


def flatten(config: Any) -> dict[str, Any]:
    """Option name → value of a config and its parts (what ``build`` takes back)."""
    out: dict[str, Any] = {}
    for s in option_specs(type(config)):
        holder = getattr(config, s.part) if s.part else config
        out[s.name] = getattr(holder, s.name)
    return out


def check_choices(config: Any) -> None:
    """``ConfigError`` for the first option of ``config`` (not its parts) off its choices."""
    for s in option_specs(type(config)):
        value = getattr(config, s.name) if not s.part else None
        names = s.choices() if value is not None else None
        if names is not None and value not in names:
            label = s.option.label or s.name
            raise ConfigError(f"unknown {label} {value!r}; choose one of: {', '.join(names)}")


def add_arguments(
    parser: argparse.ArgumentParser,
    cls: type,
    groups: dict[str, argparse._ArgumentGroup] | None = None,
) -> dict[str, argparse._ArgumentGroup]:
    """Add one flag per option of ``cls``, in argument groups titled by ``Option.group``.

    Returns the groups by title (those passed in, plus the new ones) so a command can
    add its own flags next to them. The dest of every flag is the option's name.
    """
    groups = dict(groups or {})
    for s in option_specs(cls):
        title = s.option.group
        if title not in groups:
            groups[title] = parser.add_argument_group(title)
        _add_one(groups[title], s)
    return groups


def _add_one(group: argparse._ArgumentGroup, s: OptionSpec) -> None:
    text = s.option.flag_help or s.option.help
    kw: dict[str, Any] = {"dest": s.name, "help": text.replace("%", "%%")}
    default = s.default
    envs = (s.option.env,) if isinstance(s.option.env, str) else s.option.env or ()
    for name in reversed(envs):
        default = os.environ.get(name, default)
    if s.value_type is bool:
        if default is True and not s.flag.startswith("--no-"):
            raise AssertionError(f"option {s.name} defaults to True: its flag must be --no-...")
        kw["action"] = "store_false" if default is True else "store_true"
    else:
        kw["default"] = default
        if s.option.metavar is not None:
            kw["metavar"] = s.option.metavar
        if s.option.nargs is not None:
            kw["nargs"] = s.option.nargs
        if s.option.convert is None and s.value_type in (int, float):
            kw["type"] = s.value_type
    action = group.add_argument(s.flag, *s.option.aliases, **kw)
    if s.option.choices is not None:
        # Set after add_argument, which formats the metavar (and would read the names).
        action.choices = LazyChoices(s.option.choices)
    for sw in s.option.switches:
        group.add_argument(sw.flag, dest=s.name, action=_SwitchAction, const=sw.value,
                           default=argparse.SUPPRESS, help=sw.help.replace("%", "%%"))  # fmt: skip


class _SwitchAction(argparse.Action):
    """Sets ``dest`` to ``const`` (or ``const(current)`` when it is a function)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kw: Any) -> None:
        kw.pop("nargs", None)
        super().__init__(option_strings, dest, nargs=0, **kw)

    def __call__(self, parser: Any, ns: argparse.Namespace, values: Any, opt: Any = None) -> None:
        value = self.const(getattr(ns, self.dest)) if callable(self.const) else self.const
        setattr(ns, self.dest, value)


def from_namespace(cls: type[C], ns: argparse.Namespace) -> C:
    """``cls`` from the flags ``add_arguments(parser, cls)`` added (other dests ignored)."""
    return build(cls, {s.name: getattr(ns, s.name) for s in option_specs(cls)})


def describe(cls: type, indent: str = "    ") -> str:
    """One reST line per option: name, default, choices and help (for docstrings)."""
    lines = []
    for s in option_specs(cls):
        names = s.choices()
        one_of = f"; one of {' | '.join(names)}" if names else ""
        lines.append(f"{indent}``{s.name}`` (default ``{s.default!r}``{one_of}): {s.option.help}")
    return "\n".join(lines)
