"""``kvstrata.open``: one public constructor for a cache, from whatever a caller holds.

An engine holds a config file, a dict built in code, or a config object, and wants to tweak a
field or two; every form goes through the same composition and validation as the CLI, so an error
names the dotted path of the bad field whichever form was used.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvstrata.core.builder import DeviceTensors
from kvstrata.core.collective import Collective
from kvstrata.core.config import ConfigSource, Overrides, load
from kvstrata.core.controller import CacheController
from kvstrata.plugins import PluginHost

__all__ = ["ConfigSource", "Overrides", "load", "open"]


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
    installed plugins); ``collective``: how ranks agree on reuse (default: none, for a config of one
    rank; one of several is refused without it: ``TorchCollective``, or ``LocalCollective`` to decide alone);
    ``device_tensors``: the engine's own device memory as L1 (pool -> buffer -> tensor, or a list
    of per-layer tensors), validated against each pool's spec. Close the cache (or use it as a
    context manager) to flush L3 writes.
    """
    host = plugins or PluginHost()
    config_object = load(config, overrides=overrides, plugins=host, environ=environ)
    return CacheController(config_object, host, collective=collective, device_tensors=device_tensors)
