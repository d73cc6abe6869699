"""Config text to data: YAML, TOML or JSON, refusing a key given twice in one mapping; and the
raw mapping's composition rules (files merged, environment variables and ``--set`` applied).

PyYAML and ``json`` keep the last of two equal keys, so a second ``tiers:`` block silently reset
the first one's settings to their defaults (TOML refuses it already).
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import yaml

from kvstrata.plugins.errors import ConfigError

ENV_PREFIX = "KVSTRATA_"
ENV_NESTING = "__"


def parse_config_text(text: str, suffix: str) -> Any:
    """``.toml``, ``.json``, anything else YAML; raises the parser's error (``ValueError`` for
    JSON, with ``JSONDecodeError`` a subclass of it). The suffix in any case: ``STACK.TOML`` was
    read as YAML and refused with a YAML parse error."""
    suffix = suffix.lower()
    if suffix == ".toml":
        return tomllib.loads(text)
    if suffix == ".json":
        return json.loads(text, object_pairs_hook=_unique_pairs)
    return yaml.load(text, Loader=_UniqueKeyLoader)


def parse_problem(exc: Exception) -> str:
    """A parser's error on one line: PyYAML's spans several, each naming ``"<unicode string>"``
    (the file is named by the caller) with a caret drawn under a copy of the line."""
    if not isinstance(exc, yaml.MarkedYAMLError) or exc.problem_mark is None:
        return str(exc)
    mark, problem = exc.problem_mark, exc.problem or "invalid YAML"
    text = f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    if exc.context:  # e.g. "while parsing a flow sequence", and where that began
        began = exc.context_mark
        text += f" ({exc.context}" + (
            f" started at line {began.line + 1}, column {began.column + 1})" if began else ")"
        )
    return text


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.safe_load`` refusing a key given twice in one mapping (merges, ``<<``, may still
    override)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:  # the node's own keys: a merge (``<<``) may override
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)  # type: ignore[no-untyped-call]
            if isinstance(key, Hashable):
                if key in seen:
                    where = key_node.start_mark
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} given twice in one mapping", where
                    )
                seen.add(key)
        return super().construct_mapping(node, deep)


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``'s ``object_pairs_hook``: a key given twice is an error, not the last one."""
    data: dict[str, Any] = {}
    for key, value in pairs:
        if key in data:
            raise ValueError(f"key {key!r} given twice in one object")
        data[key] = value
    return data


def deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """Merge ``over`` into ``base``; a mapping whose ``type`` changes replaces the old one whole,
    and so does an empty one: a later file's ``storage: {}`` means "no L3", as it does alone (merged,
    it would change nothing and keep the earlier file's backends without a word)."""
    result = dict(base)
    for key, value in over.items():
        old = result.get(key)
        if (
            isinstance(old, Mapping)
            and isinstance(value, Mapping)
            and value
            and not _type_changed(old, value)
        ):
            result[key] = deep_merge(old, value)
        else:
            result[key] = value
    return result


def _type_changed(old: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    return "type" in new and "type" in old and new["type"] != old["type"]


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b=value`` -> (["a", "b"], value parsed as YAML)."""
    path, sep, raw = text.partition("=")
    if not sep or not path.strip():
        raise ConfigError([("", f"override {text!r} is not of the form dotted.path=value")])
    try:
        value = parse_config_text(raw, ".yaml") if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError([(path.strip(), f"cannot parse value {raw!r}: {parse_problem(exc)}")]) from None
    return [part.strip() for part in path.strip().split(".")], value


def set_path(data: dict[str, Any], path: Sequence[str], value: Any) -> dict[str, Any]:
    """Set one value; setting a different ``type`` on a node resets that node to ``{type: ...}``."""
    node = data
    for part in path[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    last = path[-1]
    if last == "type" and node.get("type") not in (None, value):
        node.clear()
    node[last] = value
    return data


def scalar_text(raw: str, value: Any) -> str | None:
    """The text of an override whose value YAML read as a number, boolean or date (``12345``,
    ``yes``, ``2024-01-01``): what a string field takes instead, as written (a variable's value is
    text; quoting it again, ``'"12345"'``, is not what anyone writes for a tenant salt)."""
    if value is None or isinstance(value, str | list | dict):
        return None
    return raw.strip()


def env_overrides(environ: Mapping[str, str] | None = None) -> list[tuple[list[str], Any]]:
    """``KVSTRATA_TIERS__HOST__CAPACITY_TOKENS=0`` -> (["tiers", "host", "capacity_tokens"], 0).

    Only names containing ``__`` are config; single-level ``KVSTRATA_*`` names are switches.
    """
    return [(path, value) for path, value, _ in env_items(environ)]


def env_items(environ: Mapping[str, str] | None = None) -> list[tuple[list[str], Any, str]]:
    """:func:`env_overrides` with each variable's text: (path, value parsed as YAML, text)."""
    environ = os.environ if environ is None else environ
    result = []
    names = [name for name in environ if name.startswith(ENV_PREFIX) and ENV_NESTING in name]
    for name in sorted(names, key=_env_order):  # (only these get a sort key, not all of environ)
        path = env_path(name)
        try:
            _, value = parse_override(f"x={environ[name]}")
        except ConfigError as exc:  # the field and the variable the user set, not "x"
            errors = [(".".join(path), message) for _, message in exc.errors]
            raise ConfigError(errors, f"environment variable {name}") from None
        result.append((path, value, environ[name]))
    return result


def env_path(name: str) -> list[str]:
    """The config path a ``KVSTRATA_A__B`` variable names, lower-cased (variables are upper-case
    by convention; :func:`match_case` finds a mixed-case name the files use)."""
    return [part.lower() for part in name[len(ENV_PREFIX) :].split(ENV_NESTING)]


def _env_order(name: str) -> tuple[tuple[bool, str], ...]:
    """Variables applied parents first, and a node's ``type`` before its other fields: applied in
    name order, ``..._L3__CAPACITY_BYTES`` came before ``..._L3__TYPE``, whose change then reset
    the node and dropped the capacity the user had set beside it."""
    return tuple((part != "type", part) for part in name.lower().split(ENV_NESTING.lower()))


def match_case(data: Mapping[str, Any], path: Sequence[str]) -> list[str]:
    """``path`` (from an upper-case variable, lower-cased) with each part spelled as the composed
    ``data`` spells it where exactly one key there matches it ignoring case: an instance the
    files name ``SSD`` is the one ``KVSTRATA_TIERS__STORAGE__SSD__PATH`` sets, not a new ``ssd``."""
    out: list[str] = []
    node: Any = data
    for part in path:
        if isinstance(node, Mapping) and part not in node:
            same = [key for key in node if isinstance(key, str) and key.lower() == part]
            if len(same) == 1:
                part = same[0]
        out.append(part)
        node = node.get(part) if isinstance(node, Mapping) else None
    return out
