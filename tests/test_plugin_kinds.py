"""One validator table keyed by plugin kind: each registry checks its kind's class contract."""

from __future__ import annotations

from typing import Any, Literal

import pytest
from pydantic import create_model

import kvstrata
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


@pytest.mark.parametrize("attribute", list(BUILT_INS))
@pytest.mark.parametrize("extra", ["ignore", "allow"])
def test_a_plugin_config_that_accepts_unknown_keys_is_a_load_error(attribute: str, extra: str) -> None:
    """A third-party Config setting extra='ignore' loaded: a misspelt key (``capacity_byts``)
    was dropped without a word, the setting it meant left at its default."""
    name, cls = BUILT_INS[attribute]
    lax = type("Lax", (cls.Config,), {"model_config": {**cls.Config.model_config, "extra": extra}})
    with pytest.raises(ValueError, match=f"Config sets extra='{extra}'"):
        PLUGIN_KINDS[attribute].validate(name, _variant(cls, Config=lax))


def test_a_pool_type_needs_a_default_role() -> None:
    with pytest.raises(ValueError, match="default_role must be a PoolRole"):
        PLUGIN_KINDS["pool_types"].validate("kv", _variant(KVPoolType, default_role="anchor"))


def test_registering_a_broken_class_names_the_kind_and_the_reason() -> None:
    host = PluginHost(autoload=False)
    with pytest.raises(PluginLoadError, match="eviction-policy API 99"):
        host.eviction_policies.register(_variant(LruPolicy, api_version=99))
    assert "lru" not in host.eviction_policies.names()


def _renamed(cls: type, name: str) -> type:
    """A valid plugin class of ``cls``'s kind under a new name (its Config's ``type`` too)."""
    config = create_model(f"{name}_config", __base__=cls.Config, type=(Literal[name], name))
    return type(cls.__name__, (cls,), {"name": name, "Config": config})


def test_a_hook_plugin_registers_into_every_kind_s_registry() -> None:
    """Each kind's registration hook (named in the table) feeds that kind's registry."""
    renamed = {attribute: _renamed(cls, f"hooked_{name}") for attribute, (name, cls) in BUILT_INS.items()}

    class Plugin:
        @kvstrata.hookimpl
        def kvstrata_register_pool_types(self, register: Any) -> None:
            register(renamed["pool_types"])

        @kvstrata.hookimpl
        def kvstrata_register_storage_backends(self, register: Any) -> None:
            register(renamed["storage_backends"])

        @kvstrata.hookimpl
        def kvstrata_register_eviction_policies(self, register: Any) -> None:
            register(renamed["eviction_policies"])

    host = PluginHost(autoload=False, plugins=[Plugin()])
    for attribute, kind in PLUGIN_KINDS.items():
        assert hasattr(host.hook, kind.register_hook)  # a declared hook spec
        cls = renamed[attribute]
        assert getattr(host, attribute).get(cls.name) is cls


class _SpecConfig(KVPoolType.Config):  # type: ignore[name-defined,misc]
    type: Literal["speckv"] = "speckv"


def _spec_plugin(**update: Any) -> type:
    """A kv pool type named ``speckv`` whose spec() changes ``update`` (a plugin's slip)."""

    def spec(self: KVPoolType) -> Any:
        return KVPoolType.spec(self).model_copy(update=update)

    return type("SpecKV", (KVPoolType,), {"name": "speckv", "Config": _SpecConfig, "spec": spec})


@pytest.mark.parametrize(
    ("update", "named"),
    [
        ({"name": "main"}, "name is 'main', not the instance name 'kv'"),
        ({"pool_type": "kv"}, "pool_type is 'kv', not the plugin's name 'speckv'"),
        ({"page_size": 16}, "page_size is 16, not the model's page_size 4"),
    ],
)
def test_a_pool_spec_that_contradicts_its_instance_is_refused_naming_the_plugin(
    update: dict[str, Any], named: str
) -> None:
    """A spec naming another instance crashed start-up with a bare KeyError; another type or
    page size was accepted (another type's capabilities and keys, a tree in other pages)."""
    host = PluginHost(autoload=False)
    host.pool_types.register(_spec_plugin(**update))
    pool = {"type": "speckv", "layers": 1, "kv_heads": 1, "head_dim": 4, "dtype": "float32"}
    config = {
        "model": {"name": "m", "page_size": 4, "pools": {"kv": pool}},
        "tiers": {"device": {"capacity_tokens": 64}, "host": {"capacity_tokens": 128}},
    }
    with pytest.raises(kvstrata.plugins.PluginError, match="pool type 'speckv' from in-process") as info:
        kvstrata.open(config, plugins=host, environ={}).close()
    assert named in str(info.value)


@pytest.mark.parametrize(("returned", "named"), [("dict", "returned a dict"), ("api", "returned api 2")])
def test_instance_capabilities_outside_the_contract_fail_the_open_and_close_the_backend(
    returned: str, named: str
) -> None:
    """The class's ``capabilities`` are checked at load, an instance's never: a dict failed start-up
    with a bare AttributeError and the opened backend left open; another API's were planned from."""
    closed: list[str] = []

    class Odd(MemoryBackend):
        def instance_capabilities(self) -> Any:
            caps = super().instance_capabilities()
            return caps.model_dump() if returned == "dict" else caps.model_copy(update={"api": 2})

        def close(self) -> None:
            closed.append(self.instance)
            super().close()

    odd = type(
        "Odd",
        (Odd,),
        {
            "name": "oddmem",
            "Config": create_model(
                "OddConfig", __base__=MemoryBackend.Config, type=(Literal["oddmem"], "oddmem")
            ),
        },
    )
    host = PluginHost(autoload=False)
    host.storage_backends.register(odd)
    host.pool_types.register(KVPoolType)
    pool = {"type": "kv", "layers": 1, "kv_heads": 1, "head_dim": 4, "dtype": "float32"}
    config = {
        "model": {"name": "m", "page_size": 4, "pools": {"kv": pool}},
        "tiers": {"host": {"capacity_tokens": 128}, "storage": {"l3": {"type": "oddmem"}}},
    }
    with pytest.raises(kvstrata.plugins.PluginError, match=f"instance_capabilities\\(\\) of 'l3' {named}"):
        kvstrata.open(config, plugins=host, environ={}).close()
    assert closed == ["l3"]
