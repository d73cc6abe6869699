"""Claims the docs make that a change elsewhere can silently falsify (audit s35): the tests the
docs cite as proof exist, ``kvstrata.open`` raises the documented ``ConfigError`` for every
config ``kvstrata config validate`` refuses at start-up, and (s43) every config example of the
docs validates and every config key they name exists."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest

import kvstrata
from kvstrata.plugins import ConfigError

REPO = Path(__file__).resolve().parents[1]


def test_every_test_the_docs_cite_as_proof_exists() -> None:
    sources = {path.name: path.read_text() for path in (REPO / "tests").rglob("*.py")}
    missing = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            for file, name in re.findall(r"(test_[a-z0-9_]+\.py)::(test_[a-z0-9_]+)(?![a-z0-9_*])", line):
                text = sources.get(file)
                if text is None or not re.search(rf"\bdef {name}\b", text):
                    missing.append(f"{doc.relative_to(REPO)}:{number}: {file}::{name}")
    assert not missing, "cited tests that do not exist:\n" + "\n".join(missing)


@pytest.mark.parametrize("case", ["host 0 under an L3", "two storage instances", "belady", "device 0"])
def test_open_raises_config_error_for_a_config_start_up_refuses(case: str, tmp_path: Path) -> None:
    """README: ``kvstrata.open`` raises ``kvstrata.plugins.ConfigError`` for a bad config. These
    raised ``StartupError``, a bare ``ValueError`` (still one, for callers catching that)."""
    kv = {"type": "kv", "layers": 1, "kv_heads": 1, "head_dim": 4}
    config: dict[str, Any] = {
        "model": {"name": "claims", "page_size": 4, "pools": {"kv": kv}},
        "tiers": {"device": {"capacity_tokens": 64}, "host": {"capacity_tokens": 128}},
    }
    if case == "host 0 under an L3":
        config["tiers"]["host"]["capacity_tokens"] = 0
        config["tiers"]["storage"] = {"l3": {"type": "file", "path": str(tmp_path / "l3")}}
    elif case == "two storage instances":
        config["tiers"]["storage"] = {
            name: {"type": "file", "path": str(tmp_path / name)} for name in ("a", "b")
        }
    elif case == "belady":
        config["policy"] = {"eviction": "belady"}
    else:
        config["tiers"]["device"]["capacity_tokens"] = 0
    with pytest.raises(ConfigError) as raised:
        kvstrata.open(config, environ={})
    assert isinstance(raised.value, ValueError)
    assert raised.value.errors and str(raised.value)


# --- every config example of the docs validates with the current schema (audit s43) ---------------

#: What a docs fragment that is not a whole config is merged into.
BASE_STACK = {
    "model": {"name": "docs", "page_size": 512, "pools": {}},
    "tiers": {"device": {"capacity_tokens": 262144}, "host": {"capacity_tokens": 1048576}},
}
ANCHOR_TYPES = {"kv", "mla", "logical"}
DOCS = ["README.md", *sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md"))]
DOCS.append("examples/plugins/kvstrata-valkey/README.md")


def yaml_examples() -> list[tuple[str, str]]:
    """``(file:line, text)`` of every ``yaml`` block of the README, docs/ and the plugin guide."""
    found = []
    for name in DOCS:
        text = (REPO / name).read_text()
        for block in re.finditer(r"```yaml\n(.*?)```", text, re.S):
            found.append((f"{name}:{text[: block.start()].count(chr(10)) + 1}", block.group(1)))
    return found


def as_config(fragment: dict) -> dict:
    """A whole config from a docs block: a root config, a ``pools:`` mapping or bare pool entries;
    a stack without an anchor pool gets one (``kv``)."""
    config = copy.deepcopy(BASE_STACK)
    if set(fragment) <= {"model", "tiers", "policy", "parallel", "debug"}:
        for key, value in fragment.items():
            config.setdefault(key, {}).update(value)
        pools = config["model"]["pools"]
    else:
        pools = config["model"]["pools"] = dict(fragment.get("pools", fragment))
    if not any(p.get("type") in ANCHOR_TYPES and "index_source" not in p for p in pools.values()):
        pools["anchor"] = {"type": "kv", "layers": 2, "kv_heads": 1, "head_dim": 16}
    return config


def test_the_docs_have_config_examples() -> None:
    assert len(yaml_examples()) >= 10


@pytest.mark.parametrize(("where", "text"), yaml_examples(), ids=[w for w, _ in yaml_examples()])
def test_every_docs_config_example_validates(
    where: str, text: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import yaml

    monkeypatch.setenv("KVSTRATA_CACHE_DIR", str(tmp_path))
    fragment = yaml.safe_load(text)
    assert isinstance(fragment, dict), where
    kvstrata.load(as_config(fragment), environ={})


@pytest.mark.parametrize("example", sorted((REPO / "examples/configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_config_validates(
    example: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVSTRATA_CACHE_DIR", str(tmp_path))
    kvstrata.load(example, environ={})


#: Dotted keys the docs name that belong to an adapter's own config model, not ``KvstrataConfig``.
ADAPTER_KEYS = {"model.weights_digest", "model.kv_cache_dtype", "model.weights"}


def names_a_field(model: type, parts: list[str]) -> bool:
    """Whether ``parts`` is a path of fields under ``model`` (anything below a plugin's config or
    a mapping is the plugin's to check)."""
    import types
    import typing

    from pydantic import BaseModel

    for part in parts:
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return True
        field = model.model_fields.get(part)
        if field is None:
            return False
        model = field.annotation
        if typing.get_origin(model) in (typing.Union, types.UnionType):
            model = next(a for a in typing.get_args(model) if a is not type(None))
    return True


def test_every_config_key_the_docs_name_exists() -> None:
    from kvstrata.core.config import KvstrataConfig

    unknown = []
    for name in DOCS:
        text = (REPO / name).read_text()
        for key in sorted(set(re.findall(r"`((?:model|tiers|policy|parallel|debug)\.[a-z_.]+)", text))):
            key = key.rstrip(".")
            if key not in ADAPTER_KEYS and not names_a_field(KvstrataConfig, key.split(".")):
                unknown.append(f"{name}: {key}")
    assert not unknown, "config keys the docs name that the schema lacks:\n" + "\n".join(unknown)


# --- every option of a bundled plugin's config is in the docs' tables, with its default (s45) ------


def shown_default(field: Any) -> set[str]:
    """How a docs table may show a pydantic field's default."""
    from pydantic_core import PydanticUndefined

    value = field.default
    if value is PydanticUndefined:
        return {"required"}
    if value is None:
        return {"none", "null"}
    if isinstance(value, bool):
        return {str(value).lower()}
    if isinstance(value, (int, float)):
        return {str(value), f"{value:g}", repr(float(value))}
    return {str(value), f'"{value}"'}


def table_defaults(text: str, leading: int) -> dict[tuple[str, ...], str]:
    """``(first cells..., option) -> default`` of every table row whose cells after ``leading``
    start with a backticked option and its default (its first word, before any ``(``)."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) > leading + 1:
            option = re.fullmatch(r"`([a-z_0-9]+)`", cells[leading])
            if option:
                where = tuple(c.strip("`") for c in cells[:leading])
                rows[(*where, option.group(1))] = cells[leading + 1].split(" (")[0].strip("`")
    return rows


@pytest.mark.parametrize("backend", ["file", "memory", "mooncake", "hf3fs"])
def test_every_backend_option_is_in_the_storage_docs_with_its_default(backend: str) -> None:
    """Mooncake's ``staging_bytes`` and ``local_hostname``, the memory backend's ``latency_s``
    and others were documented nowhere; a new option must join its backend's table."""
    from kvstrata.plugins.host import PluginHost

    config = PluginHost().storage_backends.get(backend).Config
    heading = f"## `{backend}` backend"
    text = (REPO / "docs/storage.md").read_text()
    assert heading in text, f"docs/storage.md has no section for the {backend} backend"
    rows = table_defaults(text.split(heading, 1)[1].split("\n## ")[0], 0)
    wrong = []
    for name, field in config.model_fields.items():
        if name in ("type", "circuit_breaker"):
            continue
        shown = rows.get((name,))
        if shown is None or shown not in shown_default(field):
            wrong.append(f"{name}: docs {shown!r}, code {shown_default(field)}")
    assert not wrong, f"docs/storage.md, {backend} backend table:\n" + "\n".join(wrong)


def test_every_pool_type_key_is_in_the_pools_docs_with_its_default() -> None:
    """Pool types' own keys (``kv_lora_rank``, ``replication``, ``window`` ...) were described in
    prose only; every key of every pool type's config (and of a mamba state) must be a row of
    docs/pools.md's table with its default and a type."""
    from enum import Enum

    from kvstrata.plugins.host import PluginHost
    from kvstrata.plugins.pool_type import PoolConfig
    from kvstrata.pool_types.mamba import StateShape

    heading = "### Config keys of every pool type"
    text = (REPO / "docs/pools.md").read_text()
    assert heading in text, f"docs/pools.md has no {heading!r} table"
    text = text.split(heading, 1)[1]
    rows: dict[tuple[str, str], tuple[str, str]] = {}
    for line in text.split("\n#", 1)[0].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        key = re.fullmatch(r"`([a-z_0-9]+)`", cells[1]) if line.startswith("|") and len(cells) > 3 else None
        if key:
            for owner in cells[0].split(","):
                rows[(owner.strip().replace("`", ""), key.group(1))] = (cells[2].strip("`"), cells[3])

    def defaults(field: Any) -> set[str]:
        value = field.default
        if isinstance(value, Enum):
            return {str(value.value)}
        if value == ():
            return {"[]", "()"}
        return shown_default(field)

    registry = PluginHost().pool_types
    configs = [(name, registry.get(name).Config) for name in registry.names()]
    wrong, keys = [], 0
    for owner, config in [("every", PoolConfig), *configs, ("mamba state", StateShape)]:
        for key, field in config.model_fields.items():
            if key == "type" or (owner not in ("every", "mamba state") and key in PoolConfig.model_fields):
                continue
            keys += 1
            shown, kind = rows.get((owner, key), (None, ""))
            if shown is None or shown not in defaults(field) or not kind:
                wrong.append(f"{owner}.{key}: docs {shown!r} ({kind!r}), code {defaults(field)}")
    assert keys >= 30 and not wrong, "docs/pools.md config keys table:\n" + "\n".join(wrong)


def test_every_eviction_policy_option_is_in_the_eviction_docs_with_its_default() -> None:
    from kvstrata.plugins.host import PluginHost

    registry = PluginHost().eviction_policies
    rows = table_defaults((REPO / "docs/eviction.md").read_text(), 1)
    wrong, options = [], 0
    for name in registry.names():
        for option, field in registry.get(name).Config.model_fields.items():
            if option != "type":
                options += 1
                shown = rows.get((name, option))
                if shown is None or shown not in shown_default(field):
                    wrong.append(f"{name}.{option}: docs {shown!r}, code {shown_default(field)}")
    assert options >= 15 and not wrong, "docs/eviction.md options table:\n" + "\n".join(wrong)


#: Root config keys whose value is a plugin's config or a mapping of them: documented as one row.
WHOLE = {
    "model.pools",
    "tiers.storage",
    "policy.eviction",
    "policy.admission.host",
    "policy.admission.storage",
}


def root_keys(model: type, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> pydantic field of every leaf of ``model`` (the ``WHOLE`` ones as leaves)."""
    from pydantic import BaseModel

    keys = {}
    for name, field in model.model_fields.items():
        key = prefix + name
        sub = field.annotation
        if key not in WHOLE and isinstance(sub, type) and issubclass(sub, BaseModel):
            keys.update(root_keys(sub, key + "."))
        else:
            keys[key] = field
    return keys


def readme_key_table() -> dict[str, str]:
    """Dotted key -> default cell of the README's table of root keys (``a.b``, ``c`` rows share
    ``a.``; ``{x,y}_{r,s}`` expands, its defaults following the last group)."""
    import itertools

    text = (REPO / "README.md").read_text()
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if (
            not line.startswith("| `")
            or len(cells) != 3
            or not re.match(r"`(model|tiers|policy|parallel|debug)\.", cells[0])
        ):
            continue
        names = re.findall(r"`([^`]+)`", cells[0])
        parent = names[0].rsplit(".", 1)[0] + "."
        keys = [names[0], *(parent + n for n in names[1:])]
        groups = re.findall(r"\{([^}]*)\}", keys[0])
        if groups:
            template = re.sub(r"\{[^}]*\}", "{}", keys[0])
            keys = [template.format(*combo) for combo in itertools.product(*(g.split(",") for g in groups))]
        defaults = [d.strip().strip("`") for d in cells[1].split(",")]
        if groups:
            defaults = defaults * (len(keys) // len(defaults))
        if len(defaults) != len(keys):
            defaults = [cells[1]] * len(keys)
        rows.update(zip(keys, defaults, strict=True))
    return rows


def test_the_readme_lists_every_root_config_key_with_its_default() -> None:
    """Audit s45: ``model.page_size``, both tiers' ``capacity_tokens``, ``policy.checksum`` and the
    retention cap had no default anywhere, and ``parallel.dp_size`` only through a brace form."""
    from kvstrata.core.config import KvstrataConfig

    table = readme_key_table()
    special = {"tiers.host.pin_memory": "pin when L1 is on CUDA", "tiers.storage": "{}", "model.pools": None}
    wrong = []
    for key, field in root_keys(KvstrataConfig).items():
        if key in special:
            ok = special[key] is None or table.get(key) == special[key]
        elif key.startswith("policy.admission."):
            ok = table.get(key) == field.default.type
        else:
            ok = table.get(key) in shown_default(field)
        if not ok:
            wrong.append(f"{key}: README {table.get(key)!r}, code {shown_default(field)}")
    stale = sorted(set(table) - set(root_keys(KvstrataConfig)))
    assert not wrong and not stale, "README config table:\n" + "\n".join(
        wrong + [f"gone: {k}" for k in stale]
    )


# --- docs/eviction.md's "Writing a policy" example is a policy the conformance kit accepts (s45) ---


def docs_mru_policy() -> type:
    """The ``MruPolicy`` class of docs/eviction.md's example, executed as printed."""
    text = (REPO / "docs/eviction.md").read_text()
    block = re.search(r"```python\n(# kvstrata_mru/policy\.py\n.*?)```", text, re.S)
    assert block is not None, "docs/eviction.md lost its policy example"
    namespace: dict[str, Any] = {}  # compiled without this module's future import, as a plugin is
    exec(compile(block.group(1), "docs/eviction.md", "exec", dont_inherit=True), namespace)
    return namespace["MruPolicy"]


from kvstrata.testing.policy_kit import EvictionPolicyConformance  # noqa: E402


class TestTheDocsPolicyExample(EvictionPolicyConformance):
    policy = "mru"

    @pytest.fixture
    def policy_host(self, kvstrata_host):
        kvstrata_host.eviction_policies.register(docs_mru_policy())
        return kvstrata_host


def test_the_api_reference_names_every_public_name() -> None:
    """docs/api/kvstrata.rst left out ``ConcurrentUseError``, ``OpenLeasesWarning``,
    ``KvstrataConfig`` and ``CacheController.unpin`` / ``poll`` / ``open_leases`` (audit s45)."""
    from kvstrata.core.controller import CacheController

    reference = (REPO / "docs/api/kvstrata.rst").read_text()
    missing = [name for name in kvstrata.__all__ if not re.search(rf"\b{re.escape(name)}\b", reference)]
    members = re.search(r"CacheController\n   :members: ([^\n]*)", reference)
    assert members is not None
    public = {name for name in vars(CacheController) if not name.startswith("_")}
    documented = set(members.group(1).split(", "))
    readme = (REPO / "README.md").read_text()
    called = {name for name in public if f"cache.{name}(" in readme or f"`{name}`" in readme}
    assert not missing and called <= documented, (missing, sorted(called - documented))


def test_docs_storage_names_every_storage_counter() -> None:
    """``snapshot()["storage"]`` and ``kvstrata_storage_events`` show every ``StorageMetrics``
    counter; ``get_hits``, ``put_skipped_read_only`` and others were named nowhere (audit s45)."""
    import dataclasses

    from kvstrata.core.storage_metrics import StorageMetrics

    text = (REPO / "docs/storage.md").read_text()
    missing = [f.name for f in dataclasses.fields(StorageMetrics) if f"`{f.name}`" not in text]
    assert not missing, f"docs/storage.md does not name these storage counters: {missing}"
