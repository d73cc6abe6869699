"""kvstrata as vLLM's KV connector: every KV cache group (full attention, sliding window,
Mamba/GDN state) stored in kvstrata's storage tier, shared across processes and restarts.

Load it without patching vLLM (the README has a complete ``vllm serve`` line)::

    kv_transfer_config={"kv_connector": "KvstrataConnector",
                        "kv_connector_module_path": "kvstrata.adapters.vllm",
                        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                        "kv_connector_extra_config": {"config": {"tiers": {"storage": {
                            "l3": {"type": "file", "path": "/mnt/kv"}}}}}}

``kv_connector_extra_config``: ``config`` (a kvstrata config path or mapping, validated by
:class:`VllmConnectorConfig`: the storage instance, checksum policy, optional model name and
vouched weights digest) and ``overrides`` (``{"a.b": value}`` or ``["a.b=value"]``). The pools
(one per prefix-cacheable KV cache group), page size (vLLM's block size), dtypes and layouts
come from vLLM (:mod:`kvstrata.adapters._vllm_layout`).

Keys are chained hashes of token ids (vLLM's block hashes are salted per process) rooted in a
namespace of model, weights digest, dtype, KV cache groups, block size and parallel sizes, and
in the request's ``cache_salt``. A damaged, foreign or missing object fails the request's load,
which vLLM recomputes (set ``kv_load_failure_policy: recompute``); never wrong tokens.

``kv_role``: ``kv_both`` loads and saves; ``kv_consumer`` only loads (a read-only instance of a
shared L3, e.g. the decode side of a disaggregated deployment); ``kv_producer`` only saves.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, ValidationError
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvstrata.adapters._shared import EngineIdentity, EngineStorage
from kvstrata.adapters._vllm_keys import vllm_extra_keys
from kvstrata.adapters._vllm_layout import StoreLayout, build_layout, identity_of
from kvstrata.adapters._vllm_scheduler import SchedulerSide, StepPlan
from kvstrata.adapters._vllm_telemetry import CounterDelta, EventLog, KvstrataConnectorStats, KvstrataKVEvents
from kvstrata.adapters._vllm_worker import WorkerSide
from kvstrata.engine_kit import (
    ParallelConfig,
    PluginBackendConfig,
    dotted,
    load_file,
    parse_override,
    set_path,
)
from kvstrata.plugins import ConfigError, PluginHost
from kvstrata.plugins.user_config import UserConfig

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

CONFIG_KEY = "config"
OVERRIDES_KEY = "overrides"


class VllmModelSettings(UserConfig):
    name: str | None = Field(default=None, min_length=1, description="readable model id (default: vLLM's)")
    weights: str | None = Field(
        default=None,
        min_length=1,
        description="a weights digest you vouch for (default: xxh3 of every weight file of a local model)",
    )


class VllmTiersSettings(UserConfig):
    storage: dict[str, PluginBackendConfig] = Field(
        min_length=1, max_length=1, description="one storage instance: instance name -> backend config"
    )


class VllmPolicySettings(UserConfig):
    checksum: Literal["xxh3", "none"] = "xxh3"


class VllmConnectorConfig(UserConfig):
    """``kv_connector_extra_config.config``: the kvstrata config keys the connector reads."""

    model: VllmModelSettings = VllmModelSettings()
    tiers: VllmTiersSettings
    policy: VllmPolicySettings = VllmPolicySettings()


def load_connector_config(extra: Mapping[str, Any] | None, plugins: PluginHost) -> VllmConnectorConfig:
    """Validate ``config`` + ``overrides`` of vLLM's extra config. Every error names what the user
    wrote: ``config.<dotted path>`` of an inline mapping, ``<dotted path> in <file>`` of a config
    file, ``overrides[<entry>]`` of an override, ``kv_connector_extra_config.<key>`` of a key the
    connector does not read (a misspelt ``overrides`` would otherwise be silently ignored)."""
    extra = dict(extra or {})
    unknown = sorted(set(extra) - {CONFIG_KEY, OVERRIDES_KEY})
    if unknown:
        reason = f"unknown key: the kvstrata connector reads {CONFIG_KEY!r} and {OVERRIDES_KEY!r}"
        raise ConfigError([(f"kv_connector_extra_config.{key}", reason) for key in unknown])
    value = extra.get(CONFIG_KEY)
    source, prefix = None, f"{CONFIG_KEY}."
    if isinstance(value, (str, Path)):
        source, prefix = str(value), ""
        data: dict[str, Any] = load_file(value)
    elif isinstance(value, Mapping):
        data = _plain(value)
    else:
        raise ConfigError(
            [(CONFIG_KEY, "give a kvstrata config path or mapping in kv_connector_extra_config")]
        )
    overrides = _overrides(extra.get(OVERRIDES_KEY) or {})
    for _label, path, item in overrides:
        set_path(data, path, item)
    try:
        return VllmConnectorConfig.model_validate(data, context={"plugins": plugins})
    except ValidationError as exc:
        errors, from_overrides = [], False
        for err in exc.errors():
            where = dotted(err["loc"])
            label = _overridden_by(overrides, where)
            from_overrides |= label is not None
            errors.append((f"{label}: {where}" if label else f"{prefix}{where}", err["msg"]))
        raise ConfigError(errors, None if from_overrides else source) from None


def _overrides(raw: Any) -> list[tuple[str, list[str], Any]]:
    """``overrides`` as (label naming the entry, dotted path, value) triples, in order."""
    if isinstance(raw, Mapping):
        return [(f"{OVERRIDES_KEY}[{key!r}]", str(key).split("."), item) for key, item in raw.items()]
    if not isinstance(raw, Sequence) or isinstance(raw, str):
        raise ConfigError([(OVERRIDES_KEY, "give a {'a.b': value} mapping or a list of 'a.b=value' strings")])
    out = []
    for position, text in enumerate(raw):
        label = f"{OVERRIDES_KEY}[{position}]"
        if not isinstance(text, str):
            raise ConfigError([(label, f"expected an 'a.b=value' string, got {type(text).__name__}")])
        try:
            path, item = parse_override(text)
        except ConfigError as exc:
            raise ConfigError([(label, reason) for _, reason in exc.errors]) from None
        out.append((label, path, item))
    return out


def _overridden_by(overrides: list[tuple[str, list[str], Any]], where: str) -> str | None:
    """The last override that set ``where`` or a field above or below it (its label), or None."""
    for label, path, _item in reversed(overrides):
        dotted_path = ".".join(path)
        if where == dotted_path or where.startswith(dotted_path + ".") or dotted_path.startswith(where + "."):
            return label
    return None


def _plain(data: Mapping[str, Any]) -> dict[str, Any]:
    return {key: _plain(item) if isinstance(item, Mapping) else item for key, item in dict(data).items()}


@dataclass
class KvstrataConnectorMetadata(KVConnectorMetadata):
    """The scheduler's plan for one step (loads per request, saves per group)."""

    plan: StepPlan = field(default_factory=StepPlan)


def open_storage(
    identity: EngineIdentity, layout: StoreLayout, settings: VllmConnectorConfig
) -> EngineStorage:
    """The configured backend with one pool per KV cache group (every group must be storable)."""
    ((instance, backend_config),) = settings.tiers.storage.items()
    storage = EngineStorage(
        identity,
        instance,
        backend_config,
        checksum=settings.policy.checksum,
        config_path=f"{CONFIG_KEY}.tiers.storage",
    )
    try:
        for group in layout.groups:
            plan = storage.add_pool(group.pool, group.spec)
            if not plan.enabled:
                raise ValueError(
                    f"storage {instance!r} cannot store vLLM group {group.group_id}: {plan.reason}"
                )
    except BaseException:
        storage.close()
        raise
    return storage


class KvstrataConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector over kvstrata's storage tier (see the module docstring)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        plugins = PluginHost()
        try:
            settings = load_connector_config(transfer.kv_connector_extra_config, plugins)
        finally:
            plugins.close()
        if getattr(transfer, "kv_load_failure_policy", "recompute") != "recompute":
            log.warning(
                "kvstrata: kv_load_failure_policy is %r: a damaged or missing object fails the request "
                "instead of being recomputed; set it to 'recompute'",
                transfer.kv_load_failure_policy,
            )
        self.layout = build_layout(
            vllm_config, kv_cache_config, model_name=settings.model.name, weights=settings.model.weights
        )
        parallel_config = vllm_config.parallel_config
        rank = int(getattr(parallel_config, "rank", 0) or 0) if role == KVConnectorRole.WORKER else 0
        tp = int(parallel_config.tensor_parallel_size)
        self.identity = identity_of(self.layout, ParallelConfig(tp_rank=rank % tp, tp_size=tp))
        self.namespace = self.identity.namespace
        self._storage = open_storage(self.identity, self.layout, settings)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._counters = CounterDelta()
        self._load_errors: set[int] = set()  # blocks of failed loads ``get_finished`` reported
        self._events = EventLog(self.layout.block_size)
        # kv_role (module docstring), read as vLLM reads it
        loads = bool(getattr(transfer, "is_kv_consumer", True))
        saves = bool(getattr(transfer, "is_kv_producer", True))
        # a consumer never removes another writer's objects (another layout or format: valid to
        # its readers, e.g. during a rolling upgrade); damaged ones help nobody and still go
        self._storage.engine.keep_foreign = not saves
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(
                self._storage.engine,
                self.layout,
                self.identity,
                may_load=loads,
                may_save=saves,
                extra_keys=vllm_extra_keys(),
            )
        else:
            self._worker = WorkerSide(self._storage.engine, self.layout)
            problem = self._storage.write_problem() if saves else None
            if problem is not None:  # else every save fails, seen only in a counter
                log.warning(
                    "kvstrata: storage %r cannot store blocks now (%s): saves will fail until it can "
                    "(counted in save_failures); loads go on",
                    self._storage.backend.instance,
                    problem,
                )
        log.info(
            "kvstrata connector (%s, %s): namespace %s, groups %s",
            role.name,
            "loads and saves" if loads and saves else "loads only" if loads else "saves only",
            self.namespace,
            [(g.group_id, g.kind, len(g.layer_names)) for g in self.layout.groups],
        )

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a later miss

    # --- scheduler side -------------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._scheduler is not None:
            self._scheduler.kv_cache_manager = kv_cache_manager

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        try:
            return self._scheduler.matched_tokens(request, num_computed_tokens)
        except Exception:  # a failing backend is a miss, never a failed engine
            log.exception("kvstrata: lookup of %s failed; a miss", request.request_id)
            return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.after_alloc(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return KvstrataConnectorMetadata(self._scheduler.build_plan(scheduler_output))

    def update_connector_output(self, connector_output: Any) -> None:
        if self._scheduler is None:
            return
        published = getattr(connector_output, "kv_cache_events", None)
        if isinstance(published, KvstrataKVEvents):  # the workers' stores, kept where every rank stored
            self._events.add(published.aggregate().get_all_events())
        failed = set(connector_output.failed_recving or ())
        if failed:
            self._scheduler.loads_failed(failed)

    def reset_cache(self) -> bool:
        """vLLM resets the connector's cache after a weight update: from now on this instance
        neither serves nor overwrites what was stored before (see ``SchedulerSide.reset``).
        The workers hold nothing across steps."""
        if self._scheduler is not None:
            self._scheduler.reset()
            log.info("kvstrata connector: cache reset; earlier L3 objects are no longer served here")
        return True

    def take_events(self) -> list[Any]:
        """``BlockStored`` / ``BlockRemoved`` with medium ``STORAGE`` (kvstrata's L3): what the
        workers stored, and the loaded blocks whose objects they refused and removed, published
        by them."""
        if self._scheduler is None:
            return []
        return self._events.take()

    def get_kv_connector_kv_cache_events(self) -> KvstrataKVEvents | None:
        """Worker role: ``BlockStored`` for the block ranges whose anchor objects this rank stored
        since the last call (a failed save is never announced), ``BlockRemoved`` for loaded blocks
        whose objects it refused as damaged or foreign and the blocks after them. With several
        ranks an empty report still goes out: vLLM counts the ranks by their reports, so one
        rank's ``BlockStored`` was announced whenever the others had stored nothing."""
        if self._worker is None:
            return None
        ranks = int(self.layout.facts["tp_size"]) * int(self.layout.facts["pp_size"])
        if ranks == 1 and not (self._worker.stored_ranges or self._worker.removed_ranges):
            return None
        events = EventLog(self.layout.block_size)
        for hashes, parent, tokens in self._worker.take_stored_ranges():
            events.stored(hashes, parent, tokens)
        for hashes in self._worker.take_removed_ranges():
            events.removed(hashes)
        published = KvstrataKVEvents(num_workers=1)
        published.add_events(events.take())
        return published

    def get_kv_connector_stats(self) -> KvstrataConnectorStats | None:
        side = self._scheduler if self._scheduler is not None else self._worker
        if side is None:
            return None
        return self._counters.take(side.stats, self._storage.metrics)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvstrataConnectorStats | None:
        return KvstrataConnectorStats(data=dict(data)) if data is not None else KvstrataConnectorStats()

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self._scheduler is not None:
            self._scheduler.finished(request)
        return False, None

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, [])

    # --- worker side ----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if self._worker is not None and isinstance(meta, KvstrataConnectorMetadata) and meta.plan.loads:
            self._worker.load(meta.plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # whole steps are saved in wait_for_save (never called for Mamba layers anyway)

    def wait_for_save(self) -> None:
        if self._worker is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if isinstance(meta, KvstrataConnectorMetadata) and meta.plan.for_workers():
            self._worker.save(meta.plan)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """For a caller of this rather than ``get_transfer_results`` (vLLM 0.32 calls that; an
        older vLLM or a wrapping connector this): a failed load is reported finished -- vLLM
        waits for it -- and its blocks go to ``get_block_ids_with_load_errors`` (vLLM recomputes
        from the first), never as loaded."""
        if self._worker is None:
            return None, None
        failed_blocks = self._worker.failed_blocks  # (``take_finished`` starts a new set)
        results = self.get_transfer_results(finished_req_ids)
        self._load_errors |= failed_blocks
        return None, results.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Only loads ``get_finished`` reported: ``get_transfer_results`` reports failed loads by
        request (``failed_recving``), and vLLM refuses block ids for several KV cache groups."""
        blocks, self._load_errors = self._load_errors, set()
        return blocks

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._worker is None:
            return KVConnectorTransferResults()
        done, failed = self._worker.take_finished()
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def shutdown(self) -> None:
        self._storage.close()
