"""Reading a config: YAML files (duplicate keys refused), dotted ``key=value`` overrides, and
typed coercion into the schema, every error naming the key."""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from jddp.config.schema import Config, key_ranges
from jddp.errors import ConfigError

# ---------------------------------------------------------------------------------------------
# Introspection


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def iter_keys(cls: type = Config, prefix: str = "") -> list[tuple[str, Any, Any, str]]:
    """All leaf keys as ``(dotted_key, type, default, help)``, in declaration order."""
    out = []
    hints = _hints(cls)
    defaults = cls()
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        key = prefix + f.name
        if _is_section(tp):
            out.extend(iter_keys(tp, key + "."))
        else:
            out.append((key, tp, getattr(defaults, f.name), f.metadata.get("help", "")))
    return out


def _all_keys() -> list[str]:
    return [k for k, *_ in iter_keys()]


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "|".join(str(a) for a in typing.get_args(tp))
    if origin is list:
        return "list of " + "".join(_type_name(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def type_and_range(key: str, tp: Any) -> str:
    """``key``'s type as --help and docs/config.md show it, with its range: ``int, > 0``."""
    bound = key_ranges().get(key)
    return _type_name(tp) + (f", {bound}" if bound else "")


def help_text() -> str:
    """Every config key with its type, default and meaning, one per line."""
    rows = []
    for key, tp, default, meaning in iter_keys():
        flow = isinstance(default, list)  # [tensorboard], not a YAML block
        shown = yaml.safe_dump(default, default_flow_style=flow).strip().removesuffix("...").strip()
        rows.append(f"  {key:<28} {type_and_range(key, tp):<24} default: {shown:<10}  {meaning}")
    return "config keys (set in the YAML file or as key=value overrides):\n" + "\n".join(rows)


# ---------------------------------------------------------------------------------------------
# Type checking and coercion


class _NotFinite(ConfigError):
    """A float key holding NaN or +-Inf (every float key must be finite)."""


def _coerce(key: str, value: Any, tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            try:
                return _coerce(key, value, options[0])
            except _NotFinite:
                raise
            except ConfigError as e:
                raise ConfigError(f"{e} (or null)") from None
        for a in options:
            try:
                return _coerce(key, value, a)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if isinstance(value, bool) and {"on", "off"} <= set(allowed):
            value = "on" if value else "off"  # YAML 1.1 reads a bare on/off as a bool
        if value not in allowed:
            close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            choices = ", ".join(map(str, allowed))
            if isinstance(value, bool):  # not the user's word: YAML's reading of it
                written = "on, yes or true" if value else "off, no or false"
                word = "none" if not value and "none" in allowed else None
                hint = f" (did you mean {word!r}?)" if word else ""
                raise ConfigError(
                    f"{key}: YAML reads {written} as the boolean {str(value).lower()}, which is "
                    f"not allowed; choose one of {choices}{hint}"
                )
            raise ConfigError(f"{key}: {value!r} is not allowed; choose one of {choices}{hint}")
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        if not math.isfinite(number):
            raise _NotFinite(f"{key}: must be a finite number, got {number}")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    if origin is list:  # a YAML list, or names separated by commas (log.trackers=a,b)
        if isinstance(value, str):
            value = [item.strip() for item in value.split(",") if item.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, e.g. [a, b], got {value!r}")
        (item_tp,) = typing.get_args(tp)
        return [_coerce(key, item, item_tp) for item in value]
    if tp is dict:  # free-form options for the user's factories
        if isinstance(value, dict):
            return dict(value)
        raise ConfigError(f"{key}: expected a mapping of options, got {value!r}")
    raise ConfigError(f"{key}: unsupported type {tp}")


def _unknown_key(key: str) -> ConfigError:
    close = difflib.get_close_matches(key, _all_keys(), n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else "; see --help for every key"
    return ConfigError(f"unknown config key {key!r}{hint}")


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    hints = _hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in data.items():
        key = prefix + str(k)
        if k not in names:
            while isinstance(v, dict) and len(v) == 1:  # name the whole dotted key
                ((sub, v),) = v.items()
                key = f"{key}.{sub}"
            raise _unknown_key(key)
        tp = hints[k]
        kwargs[k] = _build(tp, v, key + ".") if _is_section(tp) else _coerce(key, v, tp)
    return cls(**kwargs)


def set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    """Set ``tree[a][b][c] = value`` for ``key="a.b.c"``, creating sections as needed."""
    parts = key.split(".")
    node = tree
    for p in parts[:-1]:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise _unknown_key(key)
        node = child
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """Split ``key.sub=value`` and type the value as YAML does (``0.2``, ``true``, ``null``)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like key.sub=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if re.fullmatch(r"\s*\d+\s*:\s*\d+\s*", raw):  # YAML 1.1 would read 2:4 as 124
        return key, raw.strip()
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"{key}: cannot parse value {raw!r}: {e}") from None
    return key, value


_MERGE_TAG = "tag:yaml.org,2002:merge"


class _DuplicateKey(yaml.YAMLError):
    """A mapping in a YAML file names the same key twice."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` whose mappings refuse a key given twice (PyYAML silently keeps the
    last one); the error names the dotted key and both lines."""

    def construct_document(self, node: yaml.Node) -> Any:
        # Before anything is constructed (merges rewrite mappings in place): each mapping's
        # dotted prefix and the keys written in it.
        self._mappings: dict[int, tuple[str, list[yaml.Node]]] = {}
        self._label(node, "")
        return super().construct_document(node)

    def _label(self, node: yaml.Node, prefix: str) -> None:
        if isinstance(node, yaml.SequenceNode):
            for item in node.value:
                self._label(item, prefix)
        if not isinstance(node, yaml.MappingNode) or id(node) in self._mappings:
            return
        own = [k for k, _ in node.value if k.tag != _MERGE_TAG]
        self._mappings[id(node)] = (prefix, own)
        for key_node, value_node in node.value:
            sub = key_node.value if isinstance(key_node, yaml.ScalarNode) else "?"
            self._label(value_node, f"{prefix}{sub}.")

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> Any:
        prefix, own = self._mappings.get(id(node), ("", []))
        seen: dict[Any, int] = {}
        for key_node in own:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                if key in seen:
                    raise _DuplicateKey(
                        f"duplicate key {prefix + str(key)!r} (lines {seen[key]} and {line}); "
                        "give each key once"
                    )
                seen[key] = line
            except TypeError:  # an unhashable key: the base class reports it
                break
        return super().construct_mapping(node, deep=deep)


MAX_CONFIG_BYTES = 2**20  # a config file is a few KiB


def read_file(path: str | Path) -> dict[str, Any]:
    """The mapping in a YAML config file; ``ConfigError`` naming the file when it cannot be
    read, is not UTF-8, is not valid YAML, names a key twice or is not a mapping."""
    p = Path(path)
    where = f"--config {str(p)!r}"
    if p.is_dir():
        raise ConfigError(f"{where}: is a directory, not a YAML file")
    if not p.exists():
        raise ConfigError(f"{where}: no such file")
    try:
        with p.open("rb") as f:  # bounded: /dev/zero or a data file would read until OOM
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"{where}: cannot read: {e.strerror or e}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"{where}: larger than {MAX_CONFIG_BYTES // 2**20} MiB; not a config file"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{where}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); "
            "save it as UTF-8"
        ) from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader) or {}  # noqa: S506 - a SafeLoader
    except _DuplicateKey as e:
        raise ConfigError(f"{where}: {e}") from None
    except yaml.YAMLError as e:
        msg = " ".join(str(e).split())
        raise ConfigError(f"{where}: not valid YAML: {msg}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of sections at top level")
    return data
