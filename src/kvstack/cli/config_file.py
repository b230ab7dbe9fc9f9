"""``--config FILE.yaml``: options from a YAML file, as vLLM's ``--config``.

The file maps option names (``port``, ``max-num-seqs`` or ``max_num_seqs``) to values;
they become command-line flags placed right after the command, so flags given on the
command line win (argparse keeps the last). ``true`` is the flag, ``false`` its ``--no-``
form where there is one (nothing where false is the default); a list is several
values; a mapping is JSON (``kv-events-config: {enable_kv_cache_events: true}``).
An unknown name, a malformed file or a value of the wrong shape is one
``ConfigError`` line.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import yaml

from kvstack.core.errors import ConfigError


def expand_config_file(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``argv`` with ``--config FILE`` replaced by the file's flags (after the command)."""
    path, rest = _take_config(argv)
    if path is None:
        return argv
    if not rest:
        raise ConfigError("--config needs a command before it (e.g. kvstack serve --config f)")
    sub = _subparser(parser, rest[0])
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"--config {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: must map option names to values")
    flags: list[str] = []
    for key, value in data.items():
        flags += _flags(sub, path, str(key), value)
    return [rest[0], *flags, *rest[1:]]


def _take_config(argv: list[str]) -> tuple[str | None, list[str]]:
    out, path, i = [], None, 0
    while i < len(argv):
        a = argv[i]
        if a == "--config":
            if i + 1 >= len(argv):
                raise ConfigError("--config needs a file")
            path, i = argv[i + 1], i + 2
            continue
        if a.startswith("--config="):
            path = a.split("=", 1)[1]
        else:
            out.append(a)
        i += 1
    return path, out


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]
    raise ConfigError(f"--config: unknown command {command!r}")


def _flags(sub: argparse.ArgumentParser, path: str, key: str, value: Any) -> list[str]:
    flag = "--" + key.replace("_", "-")
    actions = sub._option_string_actions
    if flag not in actions and not (isinstance(value, bool) and "--no-" + flag[2:] in actions):
        raise ConfigError(f"--config {path}: unknown option {key!r}")
    if isinstance(value, bool):
        takes_value = flag in actions and actions[flag].nargs != 0
        if takes_value:
            return [flag, str(value)]
        if value:
            if flag not in actions:
                raise ConfigError(f"--config {path}: {key} can only be false")
            return [flag]
        neg = "--no-" + flag[2:]
        return [neg] if neg in actions else []
    if actions[flag].nargs == 0:
        raise ConfigError(f"--config {path}: {key} is a switch: true or false, got {value!r}")
    if isinstance(value, list):
        return [flag, *(json.dumps(v) if isinstance(v, dict | list) else str(v) for v in value)]
    if isinstance(value, dict):
        return [flag, json.dumps(value)]
    return [flag, str(value)]
