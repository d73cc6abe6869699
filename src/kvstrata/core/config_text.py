"""Config file text to data: YAML, TOML or JSON, refusing a key given twice in one mapping.

PyYAML and ``json`` keep the last of two equal keys, so a second ``tiers:`` block silently reset
the first one's settings to their defaults (TOML refuses it already).
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Hashable
from typing import Any

import yaml


def parse_config_text(text: str, suffix: str) -> Any:
    """``.toml``, ``.json``, anything else YAML; raises the parser's error (``ValueError`` for
    JSON, with ``JSONDecodeError`` a subclass of it)."""
    if suffix == ".toml":
        return tomllib.loads(text)
    if suffix == ".json":
        return json.loads(text, object_pairs_hook=_unique_pairs)
    return yaml.load(text, Loader=_UniqueKeyLoader)


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
