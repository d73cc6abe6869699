"""One validator table keyed by plugin kind: each registry checks its kind's class contract."""

from __future__ import annotations

from typing import Any

import pytest

from kvstrata.eviction_policies.lru import LruPolicy
from kvstrata.plugins import PluginHost
from kvstrata.plugins.errors import PluginLoadError
from kvstrata.plugins.host import PLUGIN_KINDS
from kvstrata.pool_types.kv import KVPoolType
from kvstrata.storage_backends.memory import MemoryBackend

BUILT_INS: dict[str, tuple[str, type]] = {
    "pool_types": ("kv", KVPoolType),
    "storage_backends": ("memory", MemoryBackend),
    "eviction_policies": ("lru", LruPolicy),
}


def _variant(cls: type, **attributes: Any) -> type:
    """``cls`` with some class attributes replaced (its name and Config kept)."""
    return type(cls.__name__, (cls,), attributes)


def test_every_registry_of_a_host_is_built_from_the_table() -> None:
    host = PluginHost(autoload=False)
    for attribute, kind in PLUGIN_KINDS.items():
        registry = getattr(host, attribute)
        assert (registry.kind, registry.group) == (kind.kind, kind.group)
    with pytest.raises(TypeError):
        PLUGIN_KINDS["x"] = PLUGIN_KINDS["pool_types"]  # type: ignore[index]  # read-only


@pytest.mark.parametrize("attribute", list(BUILT_INS))
def test_a_built_in_passes_and_each_broken_contract_is_named(attribute: str) -> None:
    kind = PLUGIN_KINDS[attribute]
    name, cls = BUILT_INS[attribute]
    kind.validate(name, cls)
    with pytest.raises(ValueError, match=f"is not a kvstrata {kind.base.__name__} subclass"):
        kind.validate(name, object)
    with pytest.raises(ValueError, match="entry point says"):
        kind.validate("other", cls)
    with pytest.raises(ValueError, match=f"written for {kind.api_name} 99, this kvstrata supports"):
        kind.validate(name, _variant(cls, api_version=99))
    if kind.capabilities is not None:
        with pytest.raises(ValueError, match=f"must be a {kind.capabilities.__name__} instance"):
            kind.validate(name, _variant(cls, capabilities=None))
        newer = cls.capabilities.model_copy(update={"api": 99})
        with pytest.raises(ValueError, match=f"written for {kind.api_name} 99"):
            kind.validate(name, _variant(cls, capabilities=newer))


def test_a_pool_type_needs_a_default_role() -> None:
    with pytest.raises(ValueError, match="default_role must be a PoolRole"):
        PLUGIN_KINDS["pool_types"].validate("kv", _variant(KVPoolType, default_role="anchor"))


def test_registering_a_broken_class_names_the_kind_and_the_reason() -> None:
    host = PluginHost(autoload=False)
    with pytest.raises(PluginLoadError, match="eviction-policy API 99"):
        host.eviction_policies.register(_variant(LruPolicy, api_version=99))
    assert "lru" not in host.eviction_policies.names()
