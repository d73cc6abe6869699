"""Config composition (include, overlays, env, --set), validation paths and the CLI's exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import Result
from typer.testing import CliRunner

from kvstrata.cli import app
from kvstrata.core.config import compose, config_json_schema, load, parse_override
from kvstrata.plugins import ConfigError, PluginHost

REPO = Path(__file__).resolve().parents[1]

BASE = {
    "model": {
        "name": "demo",
        "page_size": 64,
        "pools": {"kv": {"type": "kv", "layers": 2, "kv_heads": 2, "head_dim": 64, "dtype": "bfloat16"}},
    },
    "tiers": {"host": {"capacity_tokens": 1000}, "storage": {"l3": {"type": "file", "path": "/tmp/a"}}},
}


def write(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    return subprocess.run(
        [sys.executable, "-m", "kvstrata", *args], capture_output=True, text=True, env=env, check=False
    )


def test_precedence_include_then_file_then_env_then_set(tmp_path: Path, kvstrata_host: PluginHost) -> None:
    write(tmp_path / "base.yaml", BASE)
    write(
        tmp_path / "site.yaml",
        {"include": "base.yaml", "tiers": {"host": {"capacity_tokens": 2000, "reserve_bytes": 7}}},
    )
    overlay = tmp_path / "overlay.toml"
    overlay.write_text("[tiers.host]\ncapacity_tokens = 3000\n[model]\npage_size = 32\n")
    environ = {"KVSTRATA_TIERS__HOST__CAPACITY_TOKENS": "4000", "KVSTRATA_POLICY__WRITE": "write_back"}
    config = load(
        [tmp_path / "site.yaml", overlay],
        overrides=["tiers.host.capacity_tokens=5000"],
        plugins=kvstrata_host,
        environ=environ,
    )
    assert config.tiers.host.capacity_tokens == 5000  # --set beats env beats files
    assert config.policy.write == "write_back"  # env beats defaults
    assert config.model.page_size == 32  # later file beats earlier
    assert config.tiers.host.reserve_bytes == 7  # including file beats the included one
    assert config.model.pools["kv"].layers == 2  # included file still contributes
    without_set = load([tmp_path / "site.yaml", overlay], plugins=kvstrata_host, environ=environ)
    assert without_set.tiers.host.capacity_tokens == 4000
    only_files = load([tmp_path / "site.yaml", overlay], plugins=kvstrata_host, environ={})
    assert only_files.tiers.host.capacity_tokens == 3000


def test_set_values_are_yaml(tmp_path: Path, kvstrata_host: PluginHost) -> None:
    write(tmp_path / "c.yaml", BASE)
    config = load(
        [tmp_path / "c.yaml"],
        overrides=["tiers.host.capacity_tokens=0", "tiers.storage={}"],
        plugins=kvstrata_host,
        environ={},
    )
    assert config.tiers.host.capacity_tokens == 0 and isinstance(config.tiers.host.capacity_tokens, int)
    assert config.tiers.storage == {}
    assert parse_override("a.b=[1, 2]") == (["a", "b"], [1, 2])
    with pytest.raises(ConfigError):
        parse_override("no-equals-sign")


def test_type_change_replaces_the_node_instead_of_merging(tmp_path: Path, kvstrata_host: PluginHost) -> None:
    write(tmp_path / "a.yaml", BASE)
    write(tmp_path / "b.yaml", {"tiers": {"storage": {"l3": {"type": "mooncake", "master": "127.0.0.1:5"}}}})
    config = load([tmp_path / "a.yaml", tmp_path / "b.yaml"], plugins=kvstrata_host, environ={})
    l3 = config.tiers.storage["l3"]
    assert l3.type == "mooncake" and l3.master == "127.0.0.1:5"
    # the same through --set: the file backend's `path` must not leak into the mooncake node
    data = compose([tmp_path / "a.yaml"], ["tiers.storage.l3.type=mooncake"], environ={})
    assert data["tiers"]["storage"]["l3"] == {"type": "mooncake"}


def test_errors_carry_dotted_paths(tmp_path: Path, kvstrata_host: PluginHost) -> None:
    write(tmp_path / "c.yaml", BASE)
    with pytest.raises(ConfigError) as info:
        load(
            [tmp_path / "c.yaml"],
            overrides=[
                "tiers.storage.l3.capacity_bytes=-5",
                "model.pools.kv.head_dim=wide",
                "parallel.tp_rank=3",
            ],
            plugins=kvstrata_host,
            environ={},
        )
    paths = {path for path, _ in info.value.errors}
    assert {"tiers.storage.l3.capacity_bytes", "model.pools.kv.head_dim", "parallel"} <= paths
    assert "tp_rank 3 must be below tp_size 1" in str(info.value)


def test_plugin_config_typos_are_rejected(tmp_path: Path, kvstrata_host: PluginHost) -> None:
    write(tmp_path / "c.yaml", BASE)
    with pytest.raises(ConfigError) as info:
        load([tmp_path / "c.yaml"], overrides=["tiers.storage.l3.pth=/x"], plugins=kvstrata_host, environ={})
    assert info.value.errors[0][0] == "tiers.storage.l3.pth"


def test_stack_needs_exactly_one_anchor_and_known_index_sources(
    tmp_path: Path, kvstrata_host: PluginHost
) -> None:
    write(tmp_path / "c.yaml", BASE)
    second_anchor = "model.pools.other={type: kv, layers: 1, kv_heads: 1, head_dim: 8}"
    with pytest.raises(ConfigError, match="exactly one anchor"):
        load([tmp_path / "c.yaml"], overrides=[second_anchor], plugins=kvstrata_host, environ={})
    sidecar = "model.pools.idx={type: nsa, layers: 1, index_source: nowhere}"
    with pytest.raises(ConfigError, match="unknown pool 'nowhere'"):
        load([tmp_path / "c.yaml"], overrides=[sidecar], plugins=kvstrata_host, environ={})


def test_include_cycle_and_unreadable_files_are_config_errors(tmp_path: Path) -> None:
    write(tmp_path / "a.yaml", {"include": "b.yaml"})
    write(tmp_path / "b.yaml", {"include": "a.yaml"})
    with pytest.raises(ConfigError, match="include cycle"):
        compose([tmp_path / "a.yaml"], environ={})
    with pytest.raises(ConfigError, match="cannot read"):
        compose([tmp_path / "missing.yaml"], environ={})
    (tmp_path / "bad.yaml").write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="cannot parse"):
        compose([tmp_path / "bad.yaml"], environ={})


@pytest.mark.parametrize(
    ("text", "where"),
    [
        (
            "model: [unclosed\n  x: 1\n",
            "line 2, column 4: expected ',' or ']', but got ':' (while parsing a flow",
        ),
        (
            "model:\n  name: a\nmodel:\n  name: b\n",
            "line 3, column 1: key 'model' given twice in one mapping",
        ),
    ],
)
def test_a_yaml_file_that_does_not_parse_is_one_line_naming_the_file_and_line(
    tmp_path: Path, text: str, where: str
) -> None:
    """PyYAML's message spans several lines, names the source ``"<unicode string>"`` instead of
    the file, and draws a caret under a copy of the line: one ``error:`` line it is not."""
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    out = validate_in_process(str(bad))
    assert out.exit_code == 2, out.output
    assert out.stderr.strip().count("\n") == 0, out.stderr
    assert f"{bad}: <root>: cannot parse: {where}" in out.stderr, out.stderr
    assert "<unicode string>" not in out.stderr
    good = write(tmp_path / "good.yaml", BASE)
    override = validate_in_process(str(good), "--set", "model={a: 1")
    assert override.exit_code == 2 and "<unicode string>" not in override.stderr, override.stderr
    assert "cannot parse value '{a: 1': line 1, column 6: expected ',' or '}'" in override.stderr


def test_json_schema_has_a_discriminated_union_of_installed_plugins(kvstrata_host: PluginHost) -> None:
    schema = config_json_schema(kvstrata_host)
    text = json.dumps(schema)
    for config_name in ("KVConfig", "MambaConfig", "FileConfig", "MooncakeConfig"):
        assert config_name in schema["$defs"]
    assert '"discriminator"' in text


def test_cli_validate_wrong_value_exits_2_and_prints_the_path(tmp_path: Path) -> None:
    config = write(tmp_path / "c.yaml", BASE)
    bad = run_cli("config", "validate", str(config), "--set", "tiers.host.capacity_tokens=-1")
    assert bad.returncode == 2
    assert "tiers.host.capacity_tokens" in bad.stderr
    good = run_cli("config", "validate", str(config))
    assert good.returncode == 0, good.stderr
    unknown = run_cli("config", "validate", str(config), "--set", "tiers.storage.l3.type=redis")
    assert unknown.returncode == 2 and "installed: " in unknown.stderr
    listed = unknown.stderr.split("installed: ", 1)[1].split(".", 1)[0].split(", ")
    assert {"file", "hf3fs", "mooncake"} <= set(listed)  # and memory once its entry point is installed


def test_cli_show_prints_resolved_config_with_defaults(tmp_path: Path) -> None:
    config = write(tmp_path / "c.yaml", BASE)
    shown = run_cli("config", "show", str(config), "--json", "--set", "model.page_size=16")
    assert shown.returncode == 0, shown.stderr
    data = json.loads(shown.stdout)
    assert data["model"]["page_size"] == 16
    assert data["policy"]["prefetch"]["policy"] == "timeout"  # a default, filled in
    assert data["tiers"]["storage"]["l3"]["type"] == "file"
    assert yaml.safe_load(run_cli("config", "show", str(config)).stdout)["model"]["name"] == "demo"


def test_a_single_config_error_is_one_line_for_engine_logs() -> None:
    """Issue 27 item 10: an adapter's config error printed on two lines lost its reason in the
    engine's log line; one error is one line, several are an indented list."""
    from kvstrata.plugins.errors import ConfigError

    one = str(ConfigError([("kvstrata.model.name", "required")], source="SGLang extra_config"))
    assert one == "invalid configuration in SGLang extra_config: kvstrata.model.name: required"
    two = str(ConfigError([("a", "x"), ("b", "y")])).splitlines()
    assert two == ["invalid configuration:", "  a: x", "  b: y"]


def test_a_config_object_keeps_what_was_set_on_its_default_sections(kvstrata_host: PluginHost) -> None:
    # load(config object) re-validated only the fields pydantic saw set: a value assigned on a
    # section that came from defaults was dropped (rank 1 of 2 then stored under rank 0's keys)
    config = load(BASE, plugins=kvstrata_host, environ={})
    config.parallel.tp_size, config.parallel.tp_rank = 2, 1
    config.tiers.device.capacity_tokens = 128
    config.policy.prefetch.policy = "wait_complete"
    again = load(config, plugins=kvstrata_host, environ={"KVSTRATA_POLICY__WRITE": "write_back"})
    assert (again.parallel.tp_size, again.parallel.tp_rank) == (2, 1)
    assert again.tiers.device.capacity_tokens == 128 and again.policy.prefetch.policy == "wait_complete"
    assert again.policy.write == "write_back", "the environment still applies on top"
    config.parallel.tp_rank = 2
    with pytest.raises(ConfigError, match="parallel"):
        load(config, plugins=kvstrata_host, environ={})  # and is validated again


def test_unreadable_text_and_bad_environment_values_are_config_errors(
    tmp_path: Path, kvstrata_host: PluginHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00model: {}\n")
    with pytest.raises(ConfigError, match="not UTF-8 text") as info:  # was a UnicodeDecodeError
        load(binary, plugins=kvstrata_host, environ={})
    assert info.value.source == str(binary)
    environ = {"KVSTRATA_TIERS__DEVICE__CAPACITY_TOKENS": "[1"}
    with pytest.raises(ConfigError) as info:
        load(BASE, plugins=kvstrata_host, environ=environ)
    assert info.value.errors[0][0] == "tiers.device.capacity_tokens", "the field, not 'x'"
    assert info.value.source == "environment variable KVSTRATA_TIERS__DEVICE__CAPACITY_TOKENS"
    monkeypatch.setenv("KVSTRATA_DISABLE_PLUGIN_AUTOLOAD", "banana")
    with pytest.raises(ConfigError, match="KVSTRATA_DISABLE_PLUGIN_AUTOLOAD") as info:
        PluginHost()  # every command builds one: a pydantic traceback stopped them all
    assert info.value.source == "the environment"


def test_a_storage_path_naming_an_unset_variable_is_refused(
    kvstrata_host: PluginHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    # left as written, `$L3_ROOT/l3` was a directory literally named `$L3_ROOT` in the working
    # directory: the objects went where nobody would look
    monkeypatch.delenv("KVSTRATA_TEST_L3_ROOT", raising=False)
    overrides = {"tiers.storage.l3.path": "${KVSTRATA_TEST_L3_ROOT}/l3"}
    with pytest.raises(ConfigError, match="not set: KVSTRATA_TEST_L3_ROOT") as info:
        load(BASE, overrides=overrides, plugins=kvstrata_host, environ={})
    assert info.value.errors[0][0] == "tiers.storage.l3.path"  # the field, not its section
    monkeypatch.setenv("KVSTRATA_TEST_L3_ROOT", "/srv/cache")
    config = load(BASE, overrides=overrides, plugins=kvstrata_host, environ={})
    assert str(config.tiers.storage["l3"].path) == "/srv/cache/l3"


@pytest.mark.parametrize(
    ("pool", "path", "message"),
    [
        # mla typed its dtype as any string: `bf16` passed validation and failed at open with a
        # bare pydantic error about a BufferSpec
        ({"type": "mla", "layers": 1, "dtype": "bf16"}, "model.pools.side.dtype", "bfloat16"),
        # draft's split_heads was accepted and never read (whole shards were stored): gone
        (
            {"type": "draft", "layers": 1, "kv_heads": 1, "head_dim": 8, "split_heads": True},
            "model.pools.side.split_heads",
            "Extra inputs are not permitted",
        ),
    ],
)
def test_pool_fields_are_checked_at_load(
    pool: dict, path: str, message: str, kvstrata_host: PluginHost
) -> None:
    data = json.loads(json.dumps(BASE))
    data["model"]["pools"]["side"] = pool
    if pool["type"] == "mla":  # an anchor of its own: the stack's only one
        data["model"]["pools"] = {"side": pool}
    with pytest.raises(ConfigError) as info:
        load(data, plugins=kvstrata_host, environ={})
    assert any(where == path and message in reason for where, reason in info.value.errors), info.value.errors


def test_a_key_given_twice_in_a_file_is_refused(tmp_path: Path, kvstrata_host: PluginHost) -> None:
    # PyYAML and json keep the last of two equal keys: a second `tiers:` block reset the first's
    # device capacity to the default without a word
    model = "model: {name: m, pools: {kv: {type: kv, layers: 1, kv_heads: 1, head_dim: 8}}}\n"
    twice = tmp_path / "twice.yaml"
    twice.write_text(
        model + "tiers:\n  device: {capacity_tokens: 262144}\ntiers:\n  host: {capacity_tokens: 1024}\n"
    )
    with pytest.raises(ConfigError, match=r"line 4, column 1: key 'tiers' given twice") as caught:
        load(twice, plugins=kvstrata_host, environ={})
    assert str(twice) in str(caught.value)
    merged = tmp_path / "merged.yaml"  # a merge key may still override what it brings in
    merged.write_text(
        model + "base: &base {capacity_tokens: 4096}\ntiers:\n  device: {<<: *base, capacity_tokens: 8192}\n"
    )
    with pytest.raises(ConfigError, match="base"):  # (an unknown top-level key, not a duplicate)
        load(merged, plugins=kvstrata_host, environ={})
    merged.write_text(model + "tiers:\n  device: {<<: {capacity_tokens: 4096}, capacity_tokens: 8192}\n")
    assert load(merged, plugins=kvstrata_host, environ={}).tiers.device.capacity_tokens == 8192
    as_json = tmp_path / "twice.json"
    as_json.write_text('{"model": {"name": "m", "name": "n", "pools": {}}}')
    with pytest.raises(ConfigError, match="key 'name' given twice"):
        load(as_json, plugins=kvstrata_host, environ={})


def validate_in_process(*args: str, env: dict[str, str] | None = None) -> Result:
    """``kvstrata config validate ARGS`` through typer's runner (no KVSTRATA_ variable but ``env``)."""
    clean = {name: None for name in os.environ if name.startswith("KVSTRATA_")}
    return CliRunner().invoke(app, ["config", "validate", *args], env={**clean, **(env or {})})


@pytest.mark.parametrize(
    ("override", "env", "culprit"),
    [
        ("tiers.hostt.capacity_tokens=1", {}, "--set tiers.hostt.capacity_tokens=1"),
        ("tiers.storage.l9.path=/tmp/q", {}, "--set tiers.storage.l9.path=/tmp/q"),
        (None, {"KVSTRATA_TIERS__HOSTT__CAPACITY_TOKENS": "1"}, "KVSTRATA_TIERS__HOSTT__CAPACITY_TOKENS=1"),
    ],
)
def test_an_override_that_creates_a_bad_section_is_blamed_not_the_file(
    override: str | None, env: dict[str, str], culprit: str, tmp_path: Path
) -> None:
    # the error sits at the section the override created (tiers.hostt, an L3 without a type),
    # above the override's own path: it was blamed on the file, which has no such section
    config = write(tmp_path / "c.yaml", BASE)
    result = validate_in_process(str(config), *(["--set", override] if override else []), env=env)
    assert result.exit_code == 2, result.output
    line = " ".join(result.output.split())
    assert culprit in line and "c.yaml" not in line, line


@pytest.mark.parametrize(
    "override",
    ["tiers.storage.l3.type=nosuch", "model.pools.kv.type=nosuch", "model.pools.kv={type: nosuch}"],
)
def test_an_unknown_type_an_override_set_is_blamed_on_it(override: str, tmp_path: Path) -> None:
    """The error about a node's unknown ``type`` sits at the node (``tiers.storage.l3``), above
    the override's path (``tiers.storage.l3.type``), in a section the file has: it read
    "invalid configuration in c.yaml" although the file names a valid type."""
    config = write(tmp_path / "c.yaml", BASE)
    result = validate_in_process(str(config), "--set", override)
    assert result.exit_code == 2, result.output
    line = " ".join(result.output.split())
    assert f"--set {override}" in line and "c.yaml" not in line, line


def test_an_error_in_a_section_the_file_has_stays_the_files(tmp_path: Path) -> None:
    data = json.loads(json.dumps(BASE))
    data["tiers"]["storage"]["l3"] = {"path": "/tmp/a"}  # the file forgot the type
    config = write(tmp_path / "c.yaml", data)
    result = validate_in_process(str(config), "--set", "tiers.storage.l3.capacity_bytes=5")
    assert result.exit_code == 2, result.output
    assert "invalid configuration in " + str(config) in " ".join(result.output.split())


def test_names_that_look_like_markup_are_printed_as_written(tmp_path: Path) -> None:
    # a pool named `kv[/x]` crashed `config validate` with rich's MarkupError
    data = json.loads(json.dumps(BASE))
    data["model"]["pools"] = {"kv[/x]": data["model"]["pools"]["kv"]}
    result = validate_in_process(str(write(tmp_path / "c.yaml", data)))
    assert result.exit_code == 0, result.output
    assert "pools: kv[/x] (kv)" in result.output


def test_an_error_never_prints_a_url_password(tmp_path: Path) -> None:
    """An error quotes the override it blames (``environment NAME=value``, ``--set a=value``), and
    a backend's message quotes a URL it refuses: a password in a CI variable landed in the log,
    though ``config show`` masks it (a URL whose port does not parse could not be masked)."""
    config = write(tmp_path / "c.yaml", BASE)
    url = "redis://user:s3cret@cache.internal:port0/0"
    from_env = validate_in_process(str(config), env={"KVSTRATA_MODEL__PAGE_SIZE": url})
    from_set = validate_in_process(str(config), "--set", f"model.page_size={url}")
    for out in (from_env, from_set):
        assert out.exit_code == 2, out.output
        assert "s3cret" not in out.output and "redis://user:***@cache.internal:port0/0" in out.output
