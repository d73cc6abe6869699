"""Config composition edges a user meets: environment overrides that switch a backend's type or
name a mixed-case instance, a later file's empty mapping, ``true`` where numbers go, and where
an unset variable in a path is blamed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import kvstrata
from kvstrata.plugins import ConfigError

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "examples" / "configs" / "demo.yaml"
KV = {"type": "kv", "layers": 2, "kv_heads": 1, "head_dim": 8}
MODEL = {"name": "x", "page_size": 16, "pools": {"kv": KV}}


def test_an_environment_type_switch_keeps_the_fields_set_beside_it() -> None:
    """Variables applied in name order put ``CAPACITY_BYTES`` before ``TYPE``, whose change then
    reset the node: the cap the user set was dropped without a word (an unbounded L3)."""
    environ = {
        "KVSTRATA_TIERS__STORAGE__L3__TYPE": "memory",
        "KVSTRATA_TIERS__STORAGE__L3__CAPACITY_BYTES": "1000",
    }
    l3 = kvstrata.load(DEMO, environ=environ).tiers.storage["l3"]
    assert (l3.type, l3.capacity_bytes) == ("memory", 1000)


def test_an_environment_switch_to_the_file_backend_takes_its_path_from_it(tmp_path: Path) -> None:
    base = {"model": MODEL, "tiers": {"storage": {"l3": {"type": "memory"}}}}
    environ = {
        "KVSTRATA_TIERS__STORAGE__L3__TYPE": "file",
        "KVSTRATA_TIERS__STORAGE__L3__PATH": str(tmp_path / "l3"),
    }
    assert kvstrata.load(base, environ=environ).tiers.storage["l3"].path == tmp_path / "l3"


def test_a_variable_reaches_an_instance_the_files_name_in_capitals(tmp_path: Path) -> None:
    """Variables are upper-case and were lower-cased: ``..._STORAGE__SSD__PATH`` made a new,
    typeless instance ``ssd`` beside the files' ``SSD``."""
    config_file = tmp_path / "upper.yaml"
    config_file.write_text(DEMO.read_text().replace("    l3: {type: file", "    SSD: {type: file"))
    config = kvstrata.load(config_file, environ={"KVSTRATA_TIERS__STORAGE__SSD__PATH": str(tmp_path / "ssd")})
    assert list(config.tiers.storage) == ["SSD"]
    assert config.tiers.storage["SSD"].path == tmp_path / "ssd"


def test_a_later_file_or_an_including_one_with_an_empty_storage_mapping_has_no_l3(tmp_path: Path) -> None:
    """README: an empty mapping means no L3. Merged into the earlier file's, it changed nothing."""
    no_l3 = tmp_path / "no-l3.yaml"
    no_l3.write_text("tiers:\n  storage: {}\n")
    assert kvstrata.load([DEMO, no_l3], environ={}).tiers.storage == {}
    top = tmp_path / "top.yaml"
    top.write_text(f"include: {DEMO}\ntiers:\n  storage: {{}}\n")
    assert kvstrata.load(top, environ={}).tiers.storage == {}
    # a mapping with keys still merges
    cap = tmp_path / "cap.yaml"
    cap.write_text(yaml.safe_dump({"tiers": {"storage": {"l3": {"capacity_bytes": 1234}}}}))
    l3 = kvstrata.load([DEMO, cap], environ={}).tiers.storage["l3"]
    assert (l3.type, l3.capacity_bytes) == ("file", 1234)


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"model.pools.kv.layer_ids": [True, 3]}, "model.pools.kv.layer_ids.0"),
        (
            {"model.pools.m": {"type": "mamba", "layers": 1, "states": {"conv": {"shape": [4, False]}}}},
            "model.pools.m.states.conv.shape.1",
        ),
        (
            {"tiers.storage.l3": {"type": "memory", "circuit_breaker": {"failures": True}}},
            "tiers.storage.l3.circuit_breaker.failures",
        ),
    ],
    ids=["layer_ids", "mamba-state-shape", "circuit_breaker.failures"],
)
def test_true_is_not_a_number_in_lists_or_nested_sections(override: dict, field: str) -> None:
    """``layer_ids: [true, false]`` became [1, 0], a state shape ``[4, false]`` (4, 0), and
    ``failures: true`` a breaker opening at one failure."""
    with pytest.raises(ConfigError) as info:
        kvstrata.load({"model": MODEL}, overrides=override, environ={})
    assert [path for path, _ in info.value.errors] == [field]
    assert "expected a number, got" in str(info.value)


def test_numbers_in_the_same_fields_still_load() -> None:
    config = kvstrata.load(
        {"model": MODEL},
        overrides={
            "model.pools.kv.layer_ids": [3, 5],
            "tiers.storage.l3": {"type": "memory", "circuit_breaker": {"failures": 2}},
        },
        environ={},
    )
    assert config.model.pools["kv"].layer_ids == [3, 5]
    assert config.tiers.storage["l3"].circuit_breaker.failures == 2


def test_an_unset_variable_in_a_set_path_names_the_set_and_the_field(tmp_path: Path) -> None:
    """Raised for the whole backend section, the error named ``tiers.storage.l3`` and blamed the
    config file, which never held the value."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTRATA_")}
    env |= {"PYTHONPATH": str(REPO / "src"), "KVSTRATA_CACHE_DIR": str(tmp_path)}
    env.pop("KVSTRATA_TEST_UNSET_VARIABLE", None)
    setting = "tiers.storage.l3.path=$KVSTRATA_TEST_UNSET_VARIABLE/x"
    proc = subprocess.run(
        [sys.executable, "-m", "kvstrata", "config", "validate", "-c", str(DEMO), "--set", setting],
        capture_output=True, text=True, env=env, cwd=tmp_path, check=False, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert f"--set {setting}" in proc.stderr and "tiers.storage.l3.path:" in proc.stderr
    assert "KVSTRATA_TEST_UNSET_VARIABLE" in proc.stderr and str(DEMO) not in proc.stderr


def test_a_variable_or_set_gives_a_string_field_its_text_where_yaml_reads_a_number(tmp_path: Path) -> None:
    """A variable's value is text, but YAML read ``12345`` as a number and ``no`` as a boolean:
    ``KVSTRATA_MODEL__CACHE_SALT=12345`` was refused ("Input should be a valid string"), a tenant
    salt of ``no`` or a model named ``2024-01-01`` too, unless quoted twice."""
    environ = {
        "KVSTRATA_MODEL__CACHE_SALT": "0123",  # YAML 1.1: octal 83; the salt must stay as written
        "KVSTRATA_MODEL__NAME": "2024-01-01",
        "KVSTRATA_TIERS__STORAGE__L3__TYPE": "file",
        "KVSTRATA_TIERS__STORAGE__L3__PATH": str(tmp_path / "l3"),
    }
    config = kvstrata.load({"model": MODEL}, environ=environ, overrides=["tiers.storage.l3.path=2024"])
    assert (config.model.cache_salt, config.model.name) == ("0123", "2024-01-01")
    assert str(config.tiers.storage["l3"].path) == "2024"
    config = kvstrata.load({"model": MODEL}, environ={}, overrides=["model.cache_salt= no "])
    assert config.model.cache_salt == "no"
    # numbers and booleans still are numbers and booleans where a field takes them
    config = kvstrata.load({"model": MODEL}, environ={"KVSTRATA_TIERS__HOST__PIN_MEMORY": "no"})
    assert config.tiers.host.pin_memory is False
    with pytest.raises(ConfigError, match=r"tiers\.host\.capacity_tokens"):
        kvstrata.load({"model": MODEL}, environ={"KVSTRATA_TIERS__HOST__CAPACITY_TOKENS": "yes"})
    # a value given in Python is taken as given: an int for a string is the caller's mistake
    with pytest.raises(ConfigError, match=r"model\.cache_salt: Input should be a valid string"):
        kvstrata.load({"model": MODEL}, environ={}, overrides={"model.cache_salt": 12345})


@pytest.mark.parametrize("name", ["STACK.TOML", "stack.Json"])
def test_a_config_file_suffix_in_capitals_picks_its_format(tmp_path: Path, name: str) -> None:
    """``.TOML`` was read as YAML: a valid file refused with a YAML parse error."""
    path = tmp_path / name
    if name.lower().endswith(".toml"):
        path.write_text(
            '[model]\nname = "x"\n[model.pools.kv]\ntype = "kv"\nlayers = 2\nkv_heads = 1\nhead_dim = 8\n'
        )
    else:
        path.write_text('{"model": {"name": "x", "pools": {"kv": ' + json.dumps(KV) + "}}}")
    assert kvstrata.load(path, environ={}).model.pools["kv"].type == "kv"


def test_an_admission_filter_error_names_the_path_as_written() -> None:
    """The tagged union put the filter's ``type`` in the location: the error named
    ``policy.admission.storage.reuse.min_hits``, a key nobody wrote (and the CLI could not blame
    the ``--set`` that gave it); a section without ``type`` read "Unable to extract tag"."""
    overrides = ["policy.admission.storage.type=reuse", "policy.admission.storage.min_hits=0"]
    with pytest.raises(ConfigError) as info:
        kvstrata.load({"model": MODEL}, environ={}, overrides=overrides)
    assert [path for path, _ in info.value.errors] == ["policy.admission.storage.min_hits"]
    with pytest.raises(ConfigError) as info:
        kvstrata.load({"model": MODEL}, environ={}, overrides=["policy.admission.host.min_hits=2"])
    assert info.value.errors == [("policy.admission.host", "missing `type`")]
    from kvstrata.cli._checks import blame_overrides

    blamed = blame_overrides(
        ConfigError([("policy.admission.storage.min_hits", "x")]), ["policy.admission.storage.min_hits=0"]
    )
    assert blamed.source == "--set policy.admission.storage.min_hits=0"


def test_a_key_a_yaml_base_set_is_reset_to_null_past_a_toml_file(tmp_path: Path) -> None:
    """TOML has no null, and a key a TOML file leaves out keeps the base's value: the README's
    ways to reset one whose null means something (no cap, Mooncake's own deadline) must work on
    top of a TOML file."""
    import yaml

    base = tmp_path / "base.yaml"
    storage = {"l3": {"type": "file", "path": str(tmp_path / "l3"), "capacity_bytes": 1 << 20}}
    base.write_text(
        yaml.safe_dump(
            {"model": MODEL, "policy": {"prefetch": {"timeout_max_s": 10}}, "tiers": {"storage": storage}}
        )
    )
    toml = tmp_path / "over.toml"
    toml.write_text("[policy.prefetch]\ntimeout_base_s = 2.0\n")
    later = tmp_path / "reset.json"
    later.write_text(json.dumps({"policy": {"prefetch": {"timeout_max_s": None}}}))
    kept = kvstrata.load([base, toml], environ={})
    assert kept.policy.prefetch.timeout_max_s == 10 and kept.tiers.storage["l3"].capacity_bytes == 1 << 20
    env = {
        "KVSTRATA_POLICY__PREFETCH__TIMEOUT_MAX_S": "null",
        "KVSTRATA_TIERS__STORAGE__L3__CAPACITY_BYTES": "null",
    }
    sets = ["policy.prefetch.timeout_max_s=null", "tiers.storage.l3.capacity_bytes=null"]
    for config in (
        kvstrata.load([base, toml], environ=env),
        kvstrata.load([base, toml], environ={}, overrides=sets),
    ):
        assert (
            config.policy.prefetch.timeout_max_s is None and config.tiers.storage["l3"].capacity_bytes is None
        )
    assert kvstrata.load([base, toml, later], environ={}).policy.prefetch.timeout_max_s is None
