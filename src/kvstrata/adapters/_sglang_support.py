"""What the SGLang adapter needs beside its storage class: ``kvstrata_config`` (the kvstrata side
of SGLang's extra config, validated like a kvstrata config file, errors naming
``kvstrata_config.<dotted path>``), the per-batch stats SGLang drains, and the hit-policy
arithmetic of the v2 existence query."""

from __future__ import annotations

import json
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError

from kvstrata.engine_kit import PluginBackendConfig, dotted, load_file
from kvstrata.plugins import ConfigError, PluginHost
from kvstrata.plugins.user_config import UserConfig

#: The key of SGLang's extra config that holds kvstrata's settings.
CONFIG_KEY = "kvstrata_config"


class SGLangModelSettings(UserConfig):
    name: str | None = Field(
        default=None,
        min_length=1,
        description="namespace of the stored pages; default: SGLang's served model name",
    )
    cache_salt: str = Field(default="", description="tenant / salt: separates otherwise equal prefixes")
    weights_digest: str | None = Field(
        default=None,
        min_length=1,
        description="identifies the exact weights (a digest or revision); set it when the served "
        "name stays while the weights change -- the adapter cannot read SGLang's weights",
    )
    kv_cache_dtype: str | None = Field(
        default=None,
        min_length=1,
        description="SGLang's --kv-cache-dtype (e.g. fp8_e4m3, fp8_e5m2): SGLang hands host pools "
        "every fp8 cache as uint8, so only this tells the fp8 variants' pages apart",
    )


class SGLangTiersSettings(UserConfig):
    storage: dict[str, PluginBackendConfig] = Field(
        min_length=1, max_length=1, description="one storage instance: instance name -> backend config"
    )


class SGLangPolicySettings(UserConfig):
    checksum: Literal["xxh3", "none"] = Field(
        default="xxh3", description="payload checksum in every object header (none: header checks only)"
    )


class SGLangL3Config(UserConfig):
    """``kvstrata_config``: the same key names as a kvstrata config file (``model``, ``tiers.storage``,
    ``policy.checksum``); the model layout and parallel coordinates come from SGLang."""

    model: SGLangModelSettings = SGLangModelSettings()
    tiers: SGLangTiersSettings
    policy: SGLangPolicySettings = SGLangPolicySettings()


def load_l3_config(value: Any, plugins: PluginHost) -> SGLangL3Config:
    """Validate ``kvstrata_config`` (path, mapping, or a JSON object as text); errors name
    ``kvstrata_config.<dotted path>`` of an inline mapping, ``<dotted path> in <file>`` of a config
    file (the file has no such key)."""
    source: str | None = None
    if isinstance(value, str) and value.lstrip().startswith("{"):  # inline JSON inside SGLang's JSON
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConfigError([(CONFIG_KEY, f"looks like inline JSON but does not parse: {exc}")]) from None
    if isinstance(value, (str, Path)):
        source = str(value)
        data: Any = load_file(value)  # its errors name the file and the path within it
    elif isinstance(value, Mapping):
        data = dict(value)
    elif value is None:
        raise ConfigError(
            [
                (
                    CONFIG_KEY,
                    "missing: give a kvstrata config path or an inline mapping in SGLang's extra config",
                )
            ]
        )
    else:
        raise ConfigError([(CONFIG_KEY, f"expected a path or a mapping, got {type(value).__name__}")])
    try:
        return SGLangL3Config.model_validate(data, context={"plugins": plugins})
    except ValidationError as exc:
        where = (lambda path: path) if source is not None else _prefixed
        errors = [(where(dotted(err["loc"])), err["msg"]) for err in exc.errors()]
        raise ConfigError(errors, source) from None


def _prefixed(path: str) -> str:
    return f"{CONFIG_KEY}.{path}" if path else CONFIG_KEY


#: batches of each kind ``Stats`` keeps until drained: SGLang drains them only with its storage
#: metrics on, and without them the lists grew by one entry per batch for the process's life
STATS_KEPT = 4096


class Stats:
    """Pages and bandwidth per batch, drained by ``get_stats`` (SGLang's storage metrics); the
    newest ``STATS_KEPT`` batches of each kind when nothing drains them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.prefetch_pgs: deque[int] = deque(maxlen=STATS_KEPT)
        self.backup_pgs: deque[int] = deque(maxlen=STATS_KEPT)
        self.prefetch_bandwidth: deque[float] = deque(maxlen=STATS_KEPT)
        self.backup_bandwidth: deque[float] = deque(maxlen=STATS_KEPT)

    def record(self, reading: bool, pages: int, nbytes: int, seconds: float) -> None:
        if pages <= 0:
            return
        gbps = nbytes / seconds / 1e9 if seconds > 0 else 0.0
        with self.lock:
            if reading:
                self.prefetch_pgs.append(pages)
                self.prefetch_bandwidth.append(gbps)
            else:
                self.backup_pgs.append(pages)
                self.backup_bandwidth.append(gbps)

    def drain(self) -> tuple[list[int], list[int], list[float], list[float]]:
        with self.lock:
            kept = (self.prefetch_pgs, self.backup_pgs, self.prefetch_bandwidth, self.backup_bandwidth)
            out = (list(kept[0]), list(kept[1]), list(kept[2]), list(kept[3]))
            for entries in kept:
                entries.clear()
        return out


def trailing_prefixes(present: Sequence[bool], window: int) -> set[int]:
    """Prefix lengths ``p`` whose last ``window`` pages (``[p - window, p)``) are all present."""
    allowed: set[int] = set()
    run = 0
    for index, flag in enumerate(present):
        run = run + 1 if flag else 0
        if run >= min(window, index + 1):
            allowed.add(index + 1)
    return allowed
