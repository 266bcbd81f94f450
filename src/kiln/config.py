"""Config plumbing shared by every area: dataclass <-> dict, `--section.key=value` overrides, printing.

Configs are plain nested dataclasses that validate themselves in `__post_init__`. This module only
converts them: from a dict (unknown keys are errors that name the key and the valid ones), to a
dict (for JSON and checkpoints), and with command-line overrides applied.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

from kiln.errors import KilnError

T = TypeVar("T")


def to_dict(cfg: Any) -> dict[str, Any]:
    """A JSON-ready dict of a (nested) config dataclass."""
    out = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            v = to_dict(v)
        elif isinstance(v, tuple):
            v = list(v)
        out[f.name] = v
    return out


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Convert `value` (from JSON or a command-line string) to the annotated type `tp`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if len(args) < len(typing.get_args(tp)):
                return None
        last: Exception | None = None
        for a in args:
            try:
                return _coerce(value, a, where)
            except KilnError as e:
                last = e
        raise last or KilnError(f"{where}: cannot use {value!r}")
    if _is_dataclass_type(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            key = where.partition(".")[2] or where
            raise KilnError(
                f"{where} is a section, not a value (got {value!r}): set its keys, e.g. --{key}.KEY=VALUE "
                f'or {{"{key}": {{"KEY": VALUE}}}} in a config file'
            )
        return from_dict(tp, value, where)
    if tp is Any:
        return value
    if origin in (list, tuple):
        if isinstance(value, str):
            value = json.loads(value) if value.strip().startswith("[") else [v for v in value.split(",") if v]
        (elem,) = typing.get_args(tp)[:1] or (Any,)
        items = [_coerce(v, elem, where) for v in value]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if isinstance(value, str):
            value = json.loads(value)
        if not isinstance(value, dict):
            raise KilnError(f"{where}: expected a JSON object, got {value!r}")
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("0", "false", "no", "off"):
            return False
        raise KilnError(f"{where}: expected true/false, got {value!r}")
    if tp in (int, float):
        if isinstance(value, bool):
            raise KilnError(f"{where}: expected a number, got {value!r}")
        try:
            if tp is int:
                f = float(value)
                if f != int(f):
                    raise ValueError
                return int(f)
            return float(value)
        except (TypeError, ValueError):
            raise KilnError(f"{where}: expected {tp.__name__}, got {value!r}") from None
    if tp is str:
        return str(value)
    return value


def from_dict(cls: type[T], data: dict[str, Any], where: str = "config") -> T:
    """Build dataclass `cls` from `data`; unknown keys and bad values raise KilnError."""
    hints = _field_types(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - names)
    if unknown:
        raise KilnError(
            f"unknown config key {where}.{unknown[0]}: valid keys of '{where}' are {', '.join(sorted(names))}"
        )
    kwargs = {k: _coerce(v, hints[k], f"{where}.{k}") for k, v in data.items()}
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        raise KilnError(f"invalid {where}: {e}") from None


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """`["--train.steps=10", "--model.d_model", "64"]` -> {"train": {"steps": "10"}, "model": {...}}."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise KilnError(f"unexpected argument {arg!r}: overrides look like --section.key=value")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            # the next argument is the value, unless it is another option (`--train.steps --out X`)
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                raise KilnError(f"override --{key} has no value: write --{key}=VALUE")
            value = args[i + 1]
            i += 1
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise KilnError(f"override --{key} conflicts with another override")
        node[leaf] = value
        i += 1
    return out


def read_json_object(path: str | Path, what: str = "config file") -> dict[str, Any]:
    """The JSON object in file `path`; a missing path, a directory, non-UTF-8 bytes, bad JSON or a
    non-object (a list, a number) is a KilnError naming the file and what it should hold."""
    path = Path(path)
    if not path.exists():
        raise KilnError(f"{what} {path} does not exist")
    if not path.is_file():
        raise KilnError(f"{what} {path} is a directory, not a file: pass a JSON file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise KilnError(
            f"{what} {path} is not UTF-8 text ({e.reason} at byte {e.start}): save it as UTF-8 JSON"
        ) from None
    except OSError as e:
        raise KilnError(f"cannot read {what} {path}: {e.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise KilnError(f"{what} {path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
            type(data), "a number"
        )
        raise KilnError(
            f'{what} {path} holds {kind}, not a JSON object: write {{"section": {{"key": value}}, ...}}'
        )
    return data


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """Recursive dict merge: values in `extra` win; sections merge key by key."""
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = v
    return out


def format_config(cfg: Any) -> str:
    """The resolved config as indented JSON, for printing at the start of a run."""
    return json.dumps(to_dict(cfg), indent=2, sort_keys=False)
