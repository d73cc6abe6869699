"""``kvstrata.open`` and the package's public names."""

from __future__ import annotations

import subprocess
import sys

import pytest

import kvstrata
from controller_support import EXAMPLES, REPO

KV = EXAMPLES["kv"]


def test_every_public_name_resolves() -> None:
    for name in kvstrata.__all__:
        assert getattr(kvstrata, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        kvstrata.nope  # noqa: B018


def test_importing_kvstrata_does_not_import_torch() -> None:
    """Plugins import ``kvstrata`` for ``hookimpl``: that must stay cheap."""
    code = "import sys, kvstrata; assert kvstrata.hookimpl; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO
    ).stdout.strip()
    assert out == "False"


def test_open_from_a_path_a_mapping_or_a_config_with_overrides() -> None:
    with kvstrata.open(KV, overrides=["tiers.storage={}"], environ={}) as from_path:
        assert not from_path.storage_enabled
        config = from_path.config
    data = config.model_dump(mode="json")
    with kvstrata.open(data, overrides={"tiers.host.capacity_tokens": 0}, environ={}) as from_dict:
        assert not from_dict.pools.host_enabled
    assert data["tiers"]["host"]["capacity_tokens"] > 0, "the caller's mapping is not modified"
    with kvstrata.open(config, overrides={"model.name": "other"}, environ={}) as from_object:
        assert from_object.config.model.name == "other"
        assert from_object.namespace_root != from_path.namespace_root
    env = {"KVSTRATA_TIERS__DEVICE__CAPACITY_TOKENS": "128"}
    with kvstrata.open(data, environ=env) as from_env:
        assert from_env.pools.device_pages == 2


def test_a_bad_field_names_its_dotted_path_whatever_the_source() -> None:
    bad = {"model": {"name": "m", "page_size": 64, "pools": {"kv": {"type": "kv", "layers": 0}}}}
    with pytest.raises(kvstrata.ConfigError, match=r"model\.pools\.kv\.layers"):
        kvstrata.open(bad, environ={})
    with pytest.raises(kvstrata.ConfigError, match=r"tiers\.host\.capacity_tokens"):
        kvstrata.open(KV, overrides={"tiers.host.capacity_tokens": -1}, environ={})
    with pytest.raises(TypeError, match="not one string"):
        kvstrata.open(KV, overrides="tiers.storage={}")  # type: ignore[arg-type]


def test_one_entry_point_to_a_configuration_without_torch() -> None:
    """``kvstrata.load`` is the configuration's one front door: ``kvstrata.open`` and the CLI go
    through it, and validating a config (``kvstrata config validate``) stays torch-free."""
    from kvstrata import api
    from kvstrata.cli import _checks
    from kvstrata.core import config

    assert kvstrata.load is api.load is config.load is _checks.load
    assert not hasattr(config, "load_config")
    code = (
        "import sys, kvstrata; "
        f"c = kvstrata.load({str(KV)!r}, overrides={{'tiers.storage': {{}}}}, environ={{}}); "
        "print(c.model.name, 'torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO
    ).stdout.split()
    assert out[-1] == "False" and out[0] == kvstrata.load(KV, environ={}).model.name
    with pytest.raises(ValueError, match="no config given"):
        kvstrata.load([])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            {"policy": {"eviction": "belady"}},
            r"^policy\.eviction: eviction policy 'belady' needs future accesses",
        ),
        (
            {"tiers": {"device": {"device": "meta"}}},
            r"^tiers\.device\.device 'meta': the device tier is 'cpu'",
        ),
    ],
)
def test_open_refuses_what_startup_refuses_naming_the_setting(override: dict, message: str) -> None:
    # `kvstrata.open` raised a bare ValueError from deep in the build for belady, and opened a
    # meta device tier that failed at the first copy ("torch.cuda.Stream requires CUDA support")
    from kvstrata.core.builder import StartupError

    config = {
        "model": {"name": "m", "pools": {"kv": {"type": "kv", "layers": 1, "kv_heads": 1, "head_dim": 8}}}
    }
    with pytest.raises(StartupError, match=message):
        kvstrata.open(config | override, environ={})
