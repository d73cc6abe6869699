"""``kvstrata.open``: one public constructor for a cache, from whatever a caller holds.

An engine holds a config file, a dict built in code, or a config object, and wants to tweak a
field or two; every form goes through the same composition and validation as the CLI, so an error
names the dotted path of the bad field whichever form was used.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvstrata.core.builder import DeviceTensors
from kvstrata.core.collective import Collective
from kvstrata.core.config import (
    KvstrataConfig,
    compose,
    env_overrides,
    parse_override,
    set_path,
    validate_config,
)
from kvstrata.core.controller import CacheController
from kvstrata.plugins import PluginHost

ConfigSource = str | Path | Sequence[str | Path] | Mapping[str, Any] | KvstrataConfig
Overrides = Sequence[str] | Mapping[str, Any]


def load(
    config: ConfigSource,
    *,
    overrides: Overrides = (),
    plugins: PluginHost | None = None,
    environ: Mapping[str, str] | None = None,
) -> KvstrataConfig:
    """Compose and validate a config: files (later override earlier), a mapping or a config
    object; then ``KVSTRATA_A__B`` variables of ``environ`` (default ``os.environ``; pass ``{}``
    to ignore the environment); then ``overrides`` (``"a.b=value"`` strings, values parsed as
    YAML, or a ``{"a.b": value}`` mapping)."""
    host = plugins or PluginHost()
    pairs = (
        [(key.split("."), value) for key, value in overrides.items()]
        if isinstance(overrides, Mapping)
        else [parse_override(text) for text in _strings(overrides, "overrides")]
    )
    source: str | None
    if isinstance(config, KvstrataConfig):
        data, source = config.model_dump(mode="json", exclude_unset=True), None
        for path, value in env_overrides(environ):
            set_path(data, path, value)
    elif isinstance(config, Mapping):
        data, source = _plain(config), None
        for path, value in env_overrides(environ):
            set_path(data, path, value)
    else:
        files = [config] if isinstance(config, str | Path) else list(_paths(config))
        data, source = compose(files, (), environ), ", ".join(str(f) for f in files)
    for path, value in pairs:
        set_path(data, [part.strip() for part in path], value)
    return validate_config(data, host, source)


def open(
    config: ConfigSource,
    *,
    overrides: Overrides = (),
    plugins: PluginHost | None = None,
    collective: Collective | None = None,
    device_tensors: DeviceTensors | None = None,
    environ: Mapping[str, str] | None = None,
) -> CacheController:
    """A ready cache: ``kvstrata.open("stack.yaml", overrides={"tiers.device.capacity_tokens": 65536})``.

    ``plugins``: a :class:`~kvstrata.plugins.PluginHost` with in-process registrations (default: the
    installed plugins); ``collective``: how ranks agree on reuse (default: one rank);
    ``device_tensors``: the engine's own device memory as L1 (pool -> buffer -> tensor, or a list
    of per-layer tensors), validated against each pool's spec. Close the cache (or use it as a
    context manager) to flush L3 writes.
    """
    host = plugins or PluginHost()
    config_object = load(config, overrides=overrides, plugins=host, environ=environ)
    return CacheController(config_object, host, collective=collective, device_tensors=device_tensors)


def _plain(data: Mapping[str, Any]) -> dict[str, Any]:
    """A deep, mutable copy of a mapping (overrides must not touch the caller's dict)."""
    return {key: _plain(value) if isinstance(value, Mapping) else value for key, value in dict(data).items()}


def _strings(values: Sequence[str], what: str) -> list[str]:
    if isinstance(values, str):
        raise TypeError(f"{what}: give a list of 'a.b=value' strings or a mapping, not one string")
    return list(values)


def _paths(values: Sequence[str | Path]) -> list[str | Path]:
    paths = list(values)
    if not paths:
        raise ValueError("kvstrata.open: no config given (a path, a list of paths, a mapping or a config)")
    return paths
