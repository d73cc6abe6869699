"""The root configuration model and how it is composed from files, environment and overrides.

Precedence, lowest first: each file in the order given (its ``include:`` files first), then
``KVSTRATA_A__B=value`` environment variables, then ``--set a.b=value`` overrides. Files deep-merge,
except that a node whose ``type`` changes is replaced whole (a new backend must not inherit the
old one's fields). Override values are parsed as YAML, so ``3`` is an int and ``{}`` a mapping.

:func:`load` (``kvstrata.load``) is the one entry point: a path, paths, a mapping or a config
object, composed and validated alike; ``kvstrata.open`` and the CLI call it.

Pool and backend configs are validated by the model their ``type`` names, looked up lazily in a
:class:`~kvstrata.plugins.PluginHost` passed as validation context: only selected plugins import.
"""

from __future__ import annotations

import tomllib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    Field,
    SerializeAsAny,
    ValidationError,
    ValidationInfo,
    WrapValidator,
    model_validator,
)

from kvstrata.core.config_text import (
    deep_merge,
    env_items,
    env_overrides,
    match_case,
    parse_config_text,
    parse_override,
    parse_problem,
    scalar_text,
    set_path,
)
from kvstrata.core.policy_config import AdmissionTiers, RetentionConfig
from kvstrata.plugins.errors import ConfigError, PluginError
from kvstrata.plugins.eviction_policy import EvictionPolicyConfig
from kvstrata.plugins.host import PluginHost
from kvstrata.plugins.pool_type import Layout, PoolConfig, PoolRole
from kvstrata.plugins.storage_backend import BackendConfig
from kvstrata.plugins.user_config import UserConfig

#: Default bound on one request's tokens (``model.max_request_tokens``): 1 Mi tokens, five times
#: the longest request of the published Mooncake traces.
DEFAULT_MAX_REQUEST_TOKENS = 1 << 20


def _host(info: ValidationInfo) -> PluginHost:
    context = info.context or {}
    host = context.get("plugins")
    if host is None:
        raise ValueError("internal: validate configs with context={'plugins': PluginHost}")
    return host


def _resolver(registry_attr: str, base: type[BaseModel]) -> Any:
    """A wrap-validator that validates a mapping with the Config of the plugin its ``type`` names."""

    def resolve(value: Any, handler: Any, info: ValidationInfo) -> Any:
        if isinstance(value, base):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"expected a mapping with a `type` key, got {type(value).__name__}")
        type_name = value.get("type")
        if not isinstance(type_name, str):
            raise ValueError("missing `type` (the plugin name)")
        registry = getattr(_host(info), registry_attr)
        try:
            config_cls = registry.get(type_name).Config
        except PluginError as exc:
            raise ValueError(str(exc)) from None
        return config_cls.model_validate(dict(value), context=info.context)

    return WrapValidator(resolve)


PluginPoolConfig = Annotated[SerializeAsAny[PoolConfig], _resolver("pool_types", PoolConfig)]
PluginBackendConfig = Annotated[SerializeAsAny[BackendConfig], _resolver("storage_backends", BackendConfig)]
#: ``policy.eviction``: a policy name, or a mapping with ``type`` and the policy's options
PluginEvictionConfig = Annotated[
    SerializeAsAny[EvictionPolicyConfig],
    _resolver("eviction_policies", EvictionPolicyConfig),
    BeforeValidator(lambda v: {"type": v} if isinstance(v, str) else v),
]


def anchor_instances(pools: Mapping[str, PoolConfig], host: PluginHost) -> list[str]:
    """The instances that anchor the stack: no ``index_source`` and a type whose default role is
    anchor (a valid stack has exactly one)."""
    return [
        instance
        for instance, pool in pools.items()
        if pool.index_source is None and host.pool_types.get(pool.type).default_role is PoolRole.ANCHOR
    ]


class ModelConfig(UserConfig):
    """The model stack: its namespace, page size and pools keyed by instance name."""

    name: str = Field(pattern=r"^[A-Za-z0-9._/-]+$", description="namespace of every stored object")
    page_size: int = Field(default=64, ge=1, description="tokens per page")
    cache_salt: str = Field(default="", description="tenant / salt: separates otherwise equal prefixes")
    max_request_tokens: int = Field(
        default=DEFAULT_MAX_REQUEST_TOKENS,
        ge=1,
        description="longest request accepted; a trace holding a longer one is refused when it is "
        "read, before any memory is sized for it",
    )
    pools: dict[str, PluginPoolConfig] = Field(min_length=1)

    @model_validator(mode="after")
    def _one_anchor(self, info: ValidationInfo) -> ModelConfig:
        for instance, pool in self.pools.items():
            if pool.index_source == instance:  # (an anchor naming itself read as "found none")
                raise ValueError(f"pools.{instance}.index_source names the pool itself; name another pool")
            if pool.index_source is not None and pool.index_source not in self.pools:
                raise ValueError(f"pools.{instance}.index_source names unknown pool {pool.index_source!r}")
        anchors = anchor_instances(self.pools, _host(info))
        if len(anchors) != 1:
            raise ValueError(
                "a model stack needs exactly one anchor pool (a pool whose type is an anchor "
                f"type, with no index_source); found {anchors or 'none'}"
            )
        return self


class DeviceTierConfig(UserConfig):
    capacity_tokens: int = Field(
        default=65536, ge=0, description="rounded up to whole pages (`kvstrata config show` says so)"
    )
    device: str = Field(default="cpu", description="torch device of L1 pools: cpu, cuda, cuda:1 ...")


class HostTierConfig(UserConfig):
    capacity_tokens: int = Field(
        default=262144,
        ge=0,
        description="0 disables the host tier (only without L3: L3 I/O goes through L2); "
        "rounded up to whole pages",
    )
    layout: Layout = Layout.PAGE_FIRST
    pin_memory: bool | None = Field(default=None, description="default: pin when L1 is on CUDA")
    reserve_bytes: int = Field(default=0, ge=0, description="host memory left for everything else")
    ranks_per_host: int = Field(default=1, ge=1)


class TiersConfig(UserConfig):
    device: DeviceTierConfig = DeviceTierConfig()
    host: HostTierConfig = HostTierConfig()
    storage: dict[str, PluginBackendConfig] = Field(
        default_factory=dict, description="instance name -> backend; empty means no L3"
    )


class PrefetchPolicyConfig(UserConfig):
    policy: Literal["best_effort", "wait_complete", "timeout"] = "timeout"
    threshold_tokens: int = Field(default=0, ge=0, description="skip L3 reads shorter than this")
    timeout_base_s: float = Field(default=1.0, ge=0)
    timeout_per_ki_token_s: float = Field(default=0.25, ge=0)
    timeout_max_s: float | None = Field(default=30.0, gt=0)
    host_fraction_limit: float = Field(default=0.5, gt=0, le=1, description="rate limit")


class PolicyConfig(UserConfig):
    write: Literal["write_through", "write_through_selective", "write_back"] = "write_through"
    write_through_threshold: int = Field(default=2, ge=1, description="hits before selective backup")
    write_through_batch_pages: int = Field(
        default=64,
        ge=1,
        description="write_through backs up a lease kept open (insert close=False) once this many of its "
        "pages wait, and at its close, release and every flush; 1: at every insert",
    )
    load_back_threshold_tokens: int = Field(default=10, ge=0)
    backup_wait_s: float = Field(
        default=5.0,
        ge=0,
        description="how long a backup may wait for in-flight L3 writes to free host units",
    )
    prefetch: PrefetchPolicyConfig = PrefetchPolicyConfig()
    checksum: Literal["xxh3", "none"] = "xxh3"
    eviction: PluginEvictionConfig | None = Field(
        default=None,
        description="eviction policy of every tier: a name (`kvstrata plugins`) or {type, options}; "
        "null: least recently used, by the tree's own stamps (as the `lru` plugin ranks)",
    )
    admission: AdmissionTiers = AdmissionTiers()
    retention: RetentionConfig = RetentionConfig()


class ParallelConfig(UserConfig):
    """Parallel coordinates of this process; they feed keys and the rank agreement."""

    tp_rank: int = Field(default=0, ge=0)
    tp_size: int = Field(default=1, ge=1)
    pp_rank: int = Field(default=0, ge=0)
    pp_size: int = Field(default=1, ge=1)
    cp_rank: int = Field(default=0, ge=0)
    cp_size: int = Field(default=1, ge=1)
    dp_rank: int = Field(default=0, ge=0)
    dp_size: int = Field(default=1, ge=1)

    @model_validator(mode="after")
    def _ranks_below_sizes(self) -> ParallelConfig:
        for axis in ("tp", "pp", "cp", "dp"):
            rank, size = getattr(self, f"{axis}_rank"), getattr(self, f"{axis}_size")
            if rank >= size:
                raise ValueError(f"{axis}_rank {rank} must be below {axis}_size {size}")
        return self


class DebugConfig(UserConfig):
    """Checks too costly for production that find bugs where they start."""

    unit_digests: bool = Field(
        default=False,
        description="digest every unit's bytes at commit and check them at backup, L3 write and "
        "L3 restore, naming the first stage where they changed (a pass over every byte moved; "
        "memory grows by one digest per page and pool ever committed: tests and replays only)",
    )


class KvstrataConfig(UserConfig):
    """Root of every kvstrata configuration."""

    model: ModelConfig
    tiers: TiersConfig = TiersConfig()
    policy: PolicyConfig = PolicyConfig()
    parallel: ParallelConfig = ParallelConfig()
    debug: DebugConfig = DebugConfig()


# --- composition ------------------------------------------------------------------------------


def _read_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([("", f"cannot read {path}: {exc.strerror or exc}")], str(path)) from None
    except UnicodeDecodeError as exc:
        reason = f"not UTF-8 text (byte {exc.start}: {exc.reason})"
        raise ConfigError([("", reason)], str(path)) from None
    try:
        data = parse_config_text(text, path.suffix)
    except (yaml.YAMLError, tomllib.TOMLDecodeError, ValueError) as exc:  # (JSONDecodeError too)
        raise ConfigError([("", f"cannot parse: {parse_problem(exc)}")], str(path)) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([("", "the top level must be a mapping")], str(path))
    return data


def load_file(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """One file with its ``include:`` files merged underneath it (paths relative to the file)."""
    path = Path(path).resolve()
    if path in _seen:
        chain = " -> ".join(str(p) for p in (*_seen, path))
        raise ConfigError([("include", f"include cycle: {chain}")], str(path))
    data = _read_file(path)
    includes = data.pop("include", [])
    if isinstance(includes, str):
        includes = [includes]
    if not isinstance(includes, list) or not all(isinstance(i, str) for i in includes):
        raise ConfigError([("include", "must be a path or a list of paths")], str(path))
    merged: dict[str, Any] = {}
    for include in includes:
        merged = deep_merge(merged, load_file(path.parent / include, (*_seen, path)))
    return deep_merge(merged, data)


def compose(
    files: Iterable[str | Path] = (),
    overrides: Iterable[str] = (),
    environ: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Raw composed mapping (not validated): files, then env, then ``--set`` overrides."""
    data: dict[str, Any] = {}
    for file in files:
        data = deep_merge(data, load_file(file))
    for path, value in env_overrides(environ):
        set_path(data, match_case(data, path), value)
    for text in overrides:
        path, value = parse_override(text)
        set_path(data, path, value)
    return data


def dotted(loc: Sequence[str | int]) -> str:
    return ".".join(str(part) for part in loc)


#: pydantic's errors for a value a string (or path) field does not take
_NOT_TEXT = frozenset({"string_type", "path_type"})


def validate_config(
    data: Mapping[str, Any],
    host: PluginHost,
    source: str | None = None,
    texts: Mapping[tuple[str, ...], str] | None = None,
) -> KvstrataConfig:
    """Validate a composed mapping; errors carry the dotted path of each bad field. ``texts``:
    the text of each environment / ``--set`` value YAML read as a number, boolean or date, by
    path: a string field refusing that value takes the text as written instead."""
    try:
        return KvstrataConfig.model_validate(dict(data), context={"plugins": host})
    except ValidationError as exc:
        errors = exc.errors()
        texts = texts or {}
        as_text = [loc for err in errors if err["type"] in _NOT_TEXT and (loc := _loc(err["loc"])) in texts]
        if as_text:
            retried = _plain(data)
            for loc in as_text:
                set_path(retried, list(loc), texts[loc])
            return validate_config(retried, host, source)
        raise ConfigError([_located(err, data) for err in errors], source) from None


def _loc(loc: Sequence[str | int]) -> tuple[str, ...]:
    return tuple(str(part) for part in loc)


def _located(error: Any, data: Mapping[str, Any]) -> tuple[str, str]:
    """(dotted path, reason) of one pydantic error, the path as the user wrote it: a tagged
    union (``policy.admission.*``) puts the ``type`` it chose in the location, and
    ``policy.admission.storage.reuse.min_hits`` is no key anyone wrote (nor one the CLI can blame
    on the ``--set`` that gave it)."""
    path: list[str | int] = []
    node: Any = data
    for part in error["loc"]:
        if isinstance(node, Mapping) and part not in node and node.get("type") == part:
            continue  # the tag of a tagged union, not a key
        path.append(part)
        node = node.get(part) if isinstance(node, Mapping) else None
    reason = error["msg"]
    if error["type"] == "union_tag_not_found":  # pydantic: "Unable to extract tag using discriminator"
        reason = f"missing `{error['ctx']['discriminator'].strip(chr(39))}`"
    return dotted(path), reason


#: what :func:`load` reads: a file, files (later override earlier), a mapping or a config object
ConfigSource = str | Path | Sequence[str | Path] | Mapping[str, Any] | KvstrataConfig
#: ``"a.b=value"`` strings (values parsed as YAML) or a ``{"a.b": value}`` mapping
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
    YAML, or a ``{"a.b": value}`` mapping).

    The one entry point to a configuration (``kvstrata.load``; ``kvstrata.open`` and the CLI
    call it), so every form is composed and validated alike and an error names the dotted path
    of the bad field whichever form was used.
    """
    host = plugins or PluginHost()
    texts: list[str | None]  # each override's text (a mapping's values are Python values: none)
    if isinstance(overrides, Mapping):
        pairs = [(key.split("."), value) for key, value in overrides.items()]
        texts = [None] * len(pairs)
    else:
        strings = _strings(overrides, "overrides")
        pairs = [parse_override(text) for text in strings]
        texts = [text.partition("=")[2] for text in strings]
    source: str | None = None
    if isinstance(config, KvstrataConfig | Mapping):
        # a config object: every field, also one assigned on a section that came from defaults
        data = config.model_dump(mode="json") if isinstance(config, KvstrataConfig) else _plain(config)
    else:
        files = [config] if isinstance(config, str | Path) else _paths(config)
        data, source = compose(files, (), {}), ", ".join(str(f) for f in files)
    written: dict[tuple[str, ...], str] = {}  # by path: the text of an env / --set number or boolean
    for path, value, raw in env_items(environ):
        _override(data, match_case(data, path), value, raw, written)
    for (path, value), raw in zip(pairs, texts, strict=True):
        _override(data, [part.strip() for part in path], value, raw, written)
    return validate_config(data, host, source, written)


def _override(
    data: dict[str, Any], path: list[str], value: Any, raw: str | None, texts: dict[tuple[str, ...], str]
) -> None:
    set_path(data, path, value)
    text = None if raw is None else scalar_text(raw, value)
    if text is None:
        texts.pop(tuple(path), None)
    else:
        texts[tuple(path)] = text


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
        raise ValueError(
            "kvstrata.open / kvstrata.load: no config given (a path, a list of paths, a mapping or a config)"
        )
    return paths


def config_json_schema(host: PluginHost) -> dict[str, Any]:
    """JSON schema of the root config with every installed plugin's config as a tagged union.

    This is the one place that imports every plugin: it is for tooling, not for runtime.
    """
    from typing import Union

    from pydantic import create_model

    def union(registry: Any) -> Any:
        classes = []
        for name in registry.names():
            if registry.load_error(name) is None:
                classes.append(registry.get(name).Config)
        if not classes:
            return dict[str, Any]
        if len(classes) == 1:
            return dict[str, classes[0]]
        return dict[str, Annotated[Union[tuple(classes)], Field(discriminator="type")]]  # noqa: UP007

    model_schema = create_model("ModelConfig", __base__=ModelConfig, pools=(union(host.pool_types), ...))
    tiers_schema = create_model(
        "TiersConfig", __base__=TiersConfig, storage=(union(host.storage_backends), {})
    )
    policies = union(host.eviction_policies).__args__[1]  # the value type of the dict
    policy_schema = create_model(
        "PolicyConfig",
        __base__=PolicyConfig,
        eviction=(str | policies | None, None),
    )
    root = create_model(
        "KvstrataConfig",
        __base__=KvstrataConfig,
        model=(model_schema, ...),
        tiers=(tiers_schema, TiersConfig()),
        policy=(policy_schema, PolicyConfig()),
    )
    return root.model_json_schema()
