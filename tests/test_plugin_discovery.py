"""Discovery through real entry points: fake dist-infos on sys.path, the registry and the CLI."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pluggy
import pytest

import kvstrata
from kvstrata.plugins import (
    MissingDependencyError,
    PluginCollisionError,
    PluginHost,
    PluginLoadError,
    UnknownPluginError,
)

BACKENDS = "kvstrata.storage_backends"

FAKE_BACKEND = """
from typing import Literal
from kvstrata.plugins import BackendCapabilities, BackendConfig, PoolCapabilities, StorageBackend

class EchoConfig(BackendConfig):
    type: Literal["{name}"] = "{name}"
    url: str = "mem://"

class EchoBackend(StorageBackend):
    name = "{name}"
    Config = EchoConfig
    capabilities = BackendCapabilities(pools={{"kv": PoolCapabilities(zero_copy=True)}}, batch_exists=True)
    requires = {requires}

    def exists(self, keys):
        return [False] * len(keys)

    def put(self, objects):
        return [False] * len(objects)

    def get(self, objects):
        return [-1] * len(objects)
"""


def backend_module(name: str, requires: str = "{}") -> str:
    return FAKE_BACKEND.format(name=name, requires=requires)


def backend_class(name: str, requires: str = "{}") -> type:
    """Define the fake backend in-process (``dont_inherit``: no postponed annotations from here)."""
    namespace: dict = {"__name__": f"fake_{name}"}
    exec(compile(backend_module(name, requires), f"<fake {name}>", "exec", dont_inherit=True), namespace)
    return namespace["EchoBackend"]


def install_echo(make_distribution) -> Path:
    """The working fake distribution ``kvstrata-echo 0.3.1`` with backend ``echo``."""
    return make_distribution(
        "kvstrata-echo",
        "0.3.1",
        {BACKENDS: {"echo": "kvstrata_echo:EchoBackend"}},
        {"kvstrata_echo": backend_module("echo")},
    )


def install_broken(make_distribution, module_source: str) -> None:
    """The fake distribution ``kvstrata-broken 9.9`` whose backend module fails to import."""
    make_distribution(
        "kvstrata-broken",
        "9.9",
        {BACKENDS: {"broken": "kvstrata_broken:Backend"}},
        {"kvstrata_broken": module_source},
    )


def test_fake_distribution_backend_is_listed_and_loads(make_distribution) -> None:
    install_echo(make_distribution)
    host = PluginHost(autoload=True, disabled=set())
    assert "echo" in host.storage_backends.names()
    entry = host.storage_backends.entry("echo")
    assert (entry.provider, entry.version) == ("kvstrata-echo", "0.3.1")
    cls = host.storage_backends.get("echo")
    assert cls.__name__ == "EchoBackend"
    assert cls.capabilities.for_pool("kv").zero_copy
    # built-ins travel the same path
    assert {"file", "mooncake", "hf3fs"} <= set(host.storage_backends.names())


def test_a_host_scans_the_installed_distributions_once(
    make_distribution, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every scan reads each installed distribution's files (~4 ms with a few hundred): a host
    reads them once for its four groups, and loading a plugin uses what discovery read."""
    install_echo(make_distribution)
    scans: list[dict[str, object]] = []
    real = importlib.metadata.distributions

    def counted(**selection: object):
        scans.append(selection)
        return real(**selection)

    monkeypatch.setattr(importlib.metadata, "distributions", counted)
    host = PluginHost(autoload=True, disabled=set())
    assert scans == [{}], scans
    assert host.storage_backends.get("echo").__name__ == "EchoBackend"
    assert host.storage_backends.get("file").name == "file"
    assert host.pool_types.get("kv").name == "kv"
    assert scans == [{}], "get() scanned the distributions again"
    assert (host.storage_backends.entry("echo").provider, host.storage_backends.entry("echo").version) == (
        "kvstrata-echo",
        "0.3.1",
    )
    host.storage_backends.discover()  # an explicit rediscovery (after an install) scans again
    assert scans[1:] == [{}]


def test_broken_plugin_is_reported_with_its_distribution_and_others_still_load(make_distribution) -> None:
    install_echo(make_distribution)
    install_broken(make_distribution, "raise RuntimeError('boom at import')\n")
    host = PluginHost(autoload=True, disabled=set())
    error = host.storage_backends.load_error("broken")
    assert isinstance(error, PluginLoadError)
    assert error.distribution == "kvstrata-broken" and error.version == "9.9"
    assert "boom at import" in str(error) and "kvstrata-broken 9.9" in str(error)
    assert host.storage_backends.get("echo").name == "echo"
    assert host.storage_backends.get("file").name == "file"


def test_name_collision_names_both_distributions(make_distribution) -> None:
    for dist in ("kvstrata-echo-a", "kvstrata-echo-b"):
        module = dist.replace("-", "_")
        make_distribution(
            dist, "1.0", {BACKENDS: {"echo": f"{module}:EchoBackend"}}, {module: backend_module("echo")}
        )
    host = PluginHost(autoload=True, disabled=set())
    with pytest.raises(PluginCollisionError) as info:
        host.storage_backends.get("echo")
    assert "kvstrata-echo-a 1.0" in str(info.value) and "kvstrata-echo-b 1.0" in str(info.value)


def run_cli_with(site: Path, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m kvstrata ARGS`` in a child that sees the fake distributions under ``site``."""
    src = Path(__file__).resolve().parents[1] / "src"
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{src}", "XDG_CACHE_HOME": str(tmp_path / "c")}
    env.pop("KVSTRATA_DISABLED_PLUGINS", None)
    return subprocess.run(
        [sys.executable, "-m", "kvstrata", *args], capture_output=True, text=True, env=env, check=False
    )


def test_cli_plugins_json_lists_fake_distribution_and_broken_one(make_distribution, tmp_path: Path) -> None:
    site = install_echo(make_distribution)
    install_broken(make_distribution, "import not_a_real_module_xyz\n")
    result = run_cli_with(site, tmp_path, "plugins", "--json")
    assert result.returncode == 0, result.stderr
    rows = {(row["kind"], row["name"]): row for row in json.loads(result.stdout)}
    echo = rows[("storage backend", "echo")]
    assert echo["distribution"] == "kvstrata-echo" and echo["status"] == "available"
    assert echo["capabilities"]["pools"]["kv"]["zero_copy"] is True
    broken = rows[("storage backend", "broken")]
    assert broken["status"] == "load error" and broken["distribution"] == "kvstrata-broken"
    assert "not_a_real_module_xyz" in broken["error"]
    assert rows[("pool type", "kv")]["status"] == "available"


def test_missing_dependency_names_the_install_command(kvstrata_bare_host: PluginHost) -> None:
    cls = backend_class("needy", "{'surely_missing_module_xyz': \"pip install 'kvstrata[needy]'\"}")
    kvstrata_bare_host.storage_backends.register(cls)
    with pytest.raises(MissingDependencyError) as info:
        kvstrata_bare_host.storage_backends.require("needy")
    assert "pip install 'kvstrata[needy]'" in str(info.value)
    assert "surely_missing_module_xyz" in str(info.value)


def test_unknown_type_lists_installed_names(kvstrata_host: PluginHost) -> None:
    with pytest.raises(UnknownPluginError) as info:
        kvstrata_host.storage_backends.get("redis")
    message = str(info.value)
    listed = message.split("installed: ", 1)[1].split(".", 1)[0].split(", ")
    assert "redis" in message and {"file", "hf3fs", "mooncake"} <= set(listed), message


def test_in_process_registration_through_the_hook_lands_in_the_same_registry(
    kvstrata_host: PluginHost,
) -> None:
    import kvstrata

    cls = backend_class("inproc")

    class Contributor:
        @kvstrata.hookimpl
        def kvstrata_register_storage_backends(self, register):
            register(cls)

    kvstrata_host.register_plugin(Contributor())
    assert kvstrata_host.storage_backends.get("inproc").name == "inproc"
    entry = kvstrata_host.storage_backends.entry("inproc")
    assert entry.source == "in_process"


def test_in_process_registration_colliding_with_an_entry_point_is_an_error(kvstrata_host: PluginHost) -> None:
    with pytest.raises(PluginCollisionError) as info:
        kvstrata_host.storage_backends.register(backend_class("file"))
    assert "kvstrata 0.1.0" in str(info.value)


@pytest.mark.parametrize(
    ("patch", "expected"),
    [
        ("name = 'other'", "entry point says"),
        ("Config = None", "Literal"),
        ("api_version = 99", "backend API"),
        ("capabilities = {'pools': {}}", "BackendCapabilities"),
        ("requires = ['somemodule']", "requires must map module names"),
    ],
)
def test_contract_violations_are_load_errors(make_distribution, patch: str, expected: str) -> None:
    attribute, value = patch.split(" = ")
    source = backend_module("bad") + f"\nEchoBackend.{attribute} = {value}\n"
    module = f"kvstrata_bad_{attribute}"  # one module per case: sys.modules caches imports
    make_distribution("kvstrata-bad", "0.1", {BACKENDS: {"bad": f"{module}:EchoBackend"}}, {module: source})
    host = PluginHost(autoload=True, disabled=set())
    with pytest.raises(PluginLoadError) as info:
        host.storage_backends.get("bad")
    assert expected in str(info.value) and "kvstrata-bad 0.1" in str(info.value)


def test_env_switches_disable_autoload_and_single_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTRATA_DISABLED_PLUGINS", "mooncake, swa")
    host = PluginHost()
    assert "mooncake" not in host.storage_backends.names() and "file" in host.storage_backends.names()
    assert "swa" not in host.pool_types.names() and "kv" in host.pool_types.names()
    monkeypatch.setenv("KVSTRATA_DISABLE_PLUGIN_AUTOLOAD", "1")
    assert PluginHost().storage_backends.names() == []


def test_an_empty_switch_variable_is_an_unset_one(monkeypatch: pytest.MonkeyPatch) -> None:
    # `KVSTRATA_DISABLE_PLUGIN_AUTOLOAD=` (a compose file's way to leave it off) stopped every
    # command: "Input should be a valid boolean"
    monkeypatch.setenv("KVSTRATA_DISABLE_PLUGIN_AUTOLOAD", "")
    monkeypatch.setenv("KVSTRATA_DISABLED_PLUGINS", "")
    host = PluginHost()
    assert host.autoload and not host.disabled and "file" in host.storage_backends.names()


def test_broken_hook_plugin_is_reported_not_fatal(make_distribution) -> None:
    make_distribution(
        "kvstrata-observer",
        "2.0",
        {"kvstrata.plugins": {"observer": "kvstrata_observer"}},
        {"kvstrata_observer": "raise ImportError('observer needs prometheus')\n"},
    )
    with pytest.warns(UserWarning, match="observer"):
        host = PluginHost(autoload=True, disabled=set())
    [error] = host.hook_plugin_errors
    assert error.distribution == "kvstrata-observer" and "prometheus" in error.error
    assert "file" in host.storage_backends.names()


def test_hook_plugin_from_entry_point_receives_events(make_distribution) -> None:
    make_distribution(
        "kvstrata-observer",
        "2.0",
        {"kvstrata.plugins": {"observer": "kvstrata_observer"}},
        {
            "kvstrata_observer": """
            import kvstrata
            seen = []

            @kvstrata.hookimpl
            def kvstrata_eviction(tier, pool, units):
                seen.append((tier, pool, units))
        """
        },
    )
    host = PluginHost(autoload=True, disabled=set())
    host.hook.kvstrata_eviction(tier="device", pool="kv", units=3)
    import kvstrata_observer  # type: ignore[import-not-found]

    assert kvstrata_observer.seen == [("device", "kv", 3)]


def test_a_hook_plugin_registering_a_bad_class_is_reported_alone(make_distribution) -> None:
    # its registration hook once raised out of PluginHost(): every command failed, `kvstrata
    # plugins` (the tool that diagnoses it) too
    make_distribution(
        "kvstrata-registrar",
        "1.0",
        {"kvstrata.plugins": {"registrar": "kvstrata_registrar"}},
        {
            "kvstrata_registrar": """
            import kvstrata

            class NotABackend:
                name = "notabackend"

            @kvstrata.hookimpl
            def kvstrata_register_storage_backends(register):
                register(NotABackend)
        """
        },
    )
    with pytest.warns(UserWarning, match="registrar"):
        host = PluginHost(autoload=True, disabled=set())
    [error] = host.hook_plugin_errors
    assert error.distribution == "kvstrata-registrar" and "not a kvstrata StorageBackend" in error.error
    assert "notabackend" not in host.storage_backends.names() and "file" in host.storage_backends.names()
    assert host.pm.get_plugin("registrar") is None, "its other hooks are not called either"


def test_cli_plugins_lists_misbehaving_backends_with_the_right_fix(make_distribution, tmp_path: Path) -> None:
    site = make_distribution(
        "kvstrata-odd",
        "1.0",
        {BACKENDS: {"odd": "kvstrata_odd:EchoBackend", "file": "kvstrata_odd:FileTwin"}},
        {
            "kvstrata_odd": backend_module("odd")
            + """
def _boom(cls, config=None):
    raise RuntimeError("boom in unavailable_reason")

EchoBackend.unavailable_reason = classmethod(_boom)
FileTwin = type("FileTwin", (EchoBackend,), {"name": "file"})
"""
        },
    )
    result = run_cli_with(site, tmp_path, "plugins", "--json")
    assert result.returncode == 0, result.stderr
    rows = {(row["distribution"], row["name"]): row for row in json.loads(result.stdout)}
    odd = rows[("kvstrata-odd", "odd")]
    assert odd["status"] == "unavailable" and "boom in unavailable_reason" in odd["error"]
    twin = rows[("kvstrata-odd", "file")]
    assert twin["status"] == "load error" and "KVSTRATA_DISABLED_PLUGINS" in twin["error"]
    assert twin["install"] is None, "a reinstall does not mend a name collision"


def test_cli_doctor_reports_a_backend_that_raises_as_a_problem(make_distribution, tmp_path: Path) -> None:
    site = make_distribution(
        "kvstrata-fragile",
        "1.0",
        {BACKENDS: {"fragile": "kvstrata_fragile:EchoBackend"}},
        {
            "kvstrata_fragile": backend_module("fragile")
            + """
def _boom(self):
    raise RuntimeError("boom in instance_capabilities")

EchoBackend.instance_capabilities = _boom
"""
        },
    )
    config = Path(__file__).resolve().parents[1] / "examples" / "configs" / "demo.yaml"
    result = run_cli_with(
        site, tmp_path, "doctor", "-c", str(config), "--set", "tiers.storage={l3: {type: fragile}}"
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "backend 'l3' (fragile): RuntimeError: boom in instance_capabilities" in result.stderr


HOOK_REGISTERING_KV = """
import kvstrata
from kvstrata.pool_types.kv import KVPoolType

class K(KVPoolType):
    pass

@kvstrata.hookimpl
def kvstrata_register_pool_types(register):
    register(K)
"""


def test_a_hook_plugin_taking_a_built_in_name_gets_a_fix_that_works(make_distribution) -> None:
    # the hint said KVSTRATA_DISABLED_PLUGINS=kv, which blocks the built-in `kv` and the hook's
    # class alike (no kv pool type at all), and a reinstall, which cannot mend a collision
    from kvstrata.cli.plugins_cmd import plugin_rows

    hook = {"kvstrata.plugins": {"dupkv": "kvstrata_dupkv"}}
    make_distribution("kvstrata-dupkv", "1.0", hook, {"kvstrata_dupkv": HOOK_REGISTERING_KV})
    with pytest.warns(UserWarning, match="dupkv"):
        host = PluginHost(autoload=True, disabled=set())
    [row] = [r for r in plugin_rows(host) if r["kind"] == "hook plugin"]
    assert "KVSTRATA_DISABLED_PLUGINS=kvstrata:kv" in row["error"], row["error"]
    assert row["install"] is None, "a reinstall does not mend a name collision"
    fixed = PluginHost(autoload=True, disabled={"kvstrata:kv"})  # following the hint
    assert fixed.hook_plugin_errors == [] and fixed.pool_types.get("kv").__module__ == "kvstrata_dupkv"


def test_a_hook_plugin_that_fails_to_import_still_gets_the_reinstall(make_distribution) -> None:
    from kvstrata.cli.plugins_cmd import plugin_rows

    hook = {"kvstrata.plugins": {"gone": "kvstrata_gone"}}
    make_distribution(
        "kvstrata-gone", "1.0", hook, {"kvstrata_gone": "raise ImportError('half installed')\n"}
    )
    with pytest.warns(UserWarning, match="gone"):
        host = PluginHost(autoload=True, disabled=set())
    [row] = [r for r in plugin_rows(host) if r["kind"] == "hook plugin"]
    assert row["install"] == "pip install --force-reinstall 'kvstrata-gone'"


@pytest.mark.parametrize("name", ["", "[1,2", "Two Words"])
def test_an_unknown_name_no_package_could_have_gets_no_pip_command(
    name: str, kvstrata_host: PluginHost
) -> None:
    # `--eviction ''` suggested `pip install kvstrata-`
    with pytest.raises(UnknownPluginError) as info:
        kvstrata_host.eviction_policies.get(name)
    assert "pip install" not in str(info.value) and "lower-case letters" in str(info.value)
    with pytest.raises(UnknownPluginError, match=r"pip install kvstrata-redis"):
        kvstrata_host.storage_backends.get("redis")


def _half_installed(site: Path, metadata: str | None, entry_points: str) -> None:
    """What an interrupted ``pip install`` can leave: entry points without METADATA, or a line
    that is not ``name = target``."""
    info = site / "kvstrata_half-1.0.dist-info"
    info.mkdir(parents=True)
    if metadata is not None:
        (info / "METADATA").write_text(metadata)
    (info / "entry_points.txt").write_text(entry_points)


@pytest.mark.parametrize(
    ("metadata", "entry_points"),
    [
        (None, f"[{BACKENDS}]\nhalf = kvstrata_half:Backend\n"),
        ("", f"[{BACKENDS}]\nhalf = kvstrata_half:Backend\n"),
        ("Metadata-Version: 2.1\nName: kvstrata-half\nVersion: 1.0\n", f"[{BACKENDS}]\nhalf\n"),
    ],
    ids=["no-METADATA", "empty-METADATA", "entry-point-line-without-target"],
)
def test_a_half_installed_package_does_not_stop_discovery(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, metadata: str | None, entry_points: str
) -> None:
    """It raised from ``PluginHost()`` (a None distribution name, or importlib's parse error),
    so every command and ``kvstrata.open`` failed, ``kvstrata plugins`` too."""
    _half_installed(tmp_path / "site", metadata, entry_points)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the skipped package is reported as a warning
        host = PluginHost()
    assert host.storage_backends.get("file").name == "file"
    if metadata is not None and metadata:  # the unparsable line: the package is reported
        assert any("kvstrata_half-1.0.dist-info" in problem for problem in host.distribution_errors)
    else:  # its entry loads as far as its missing module, from an unknown distribution
        with pytest.raises(PluginLoadError):
            host.storage_backends.get("half")


def test_the_cli_runs_beside_a_half_installed_package(tmp_path: Path) -> None:
    _half_installed(tmp_path / "site", None, f"[{BACKENDS}]\nhalf = kvstrata_half:Backend\n")
    src = Path(__file__).resolve().parents[1] / "src"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(src)])}
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    proc = subprocess.run(
        [sys.executable, "-m", "kvstrata", "plugins"], capture_output=True, text=True, env=env, check=False
    )
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "half" in proc.stdout and "file" in proc.stdout


OBSERVER = """
import kvstrata
seen = []

@kvstrata.hookimpl
def {hook}(tier, pool, units):
    seen.append((tier, pool, units))
"""


def test_a_hook_plugin_with_a_misspelt_hook_is_reported_not_silently_deaf(make_distribution) -> None:
    # pluggy took the implementation of a hook no spec declares and never called it; nothing ran
    # its check_pending, so a metrics plugin with a typo was deaf without a word
    make_distribution(
        "kvstrata-typo",
        "1.0",
        {"kvstrata.plugins": {"typo": "kvstrata_typo"}},
        {"kvstrata_typo": OBSERVER.format(hook="kvstrata_evicton")},
    )
    with pytest.warns(UserWarning, match="kvstrata_evicton"):
        host = PluginHost(autoload=True, disabled=set())
    [error] = host.hook_plugin_errors
    assert error.distribution == "kvstrata-typo" and "kvstrata_evicton" in error.error
    assert not error.import_failed, "a reinstall cannot mend a misspelt hook"
    assert host.pm.get_plugin("typo") is None


def test_an_in_process_plugin_with_a_misspelt_hook_is_refused() -> None:
    class Typo:
        @kvstrata.hookimpl
        def kvstrata_evicton(self, tier: str, pool: str, units: int) -> None: ...

    class Newer:  # a hook of a later kvstrata, marked optional: accepted
        @kvstrata.hookimpl(optionalhook=True)
        def kvstrata_future_event(self) -> None: ...

    host = PluginHost(autoload=False)
    typo = Typo()
    with pytest.raises(pluggy.PluginValidationError, match="kvstrata_evicton"):
        host.register_plugin(typo)
    assert not host.pm.is_registered(typo)
    host.register_plugin(Newer())


def test_two_distributions_hook_plugins_of_one_name_are_reported_not_silently_dropped(
    make_distribution, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the second was skipped without a word: its observers never ran
    for dist, module in (("kvstrata-obs-a", "obs_a"), ("kvstrata-obs-b", "obs_b")):
        make_distribution(
            dist,
            "1.0",
            {"kvstrata.plugins": {"obs": module}},
            {module: OBSERVER.format(hook="kvstrata_eviction")},
        )
    with pytest.warns(UserWarning, match="is taken by kvstrata-obs-"):
        host = PluginHost(autoload=True, disabled=set())
    [error] = host.hook_plugin_errors
    first = "kvstrata-obs-b" if error.distribution == "kvstrata-obs-a" else "kvstrata-obs-a"
    assert f"taken by {first} 1.0" in error.error and not error.import_failed
    assert f"KVSTRATA_DISABLED_PLUGINS={error.distribution}:obs" in error.error
    assert host.pm.get_plugin("obs") is not None, "the first one still loads"
    # the fix it names works: blocking one distribution's entry loads the other, with no error
    blocked = PluginHost(autoload=True, disabled={f"{first}:obs"})
    assert blocked.hook_plugin_errors == [] and blocked.pm.get_plugin("obs") is not None


def test_a_required_module_whose_package_raises_at_import_is_missing_not_a_traceback(
    make_distribution,
) -> None:
    # find_spec imports a dotted module's parents: a RuntimeError there escaped `kvstrata plugins`
    # (every plugin's listing) and a cache's open (instead of the install command)
    from kvstrata.cli.plugins_cmd import plugin_rows

    root = make_distribution("kvstrata-dep", "1.0", {}, {"kvstrata_brokendep.io": ""})
    (root / "kvstrata_brokendep" / "__init__.py").write_text("raise RuntimeError('half upgraded')\n")
    host = PluginHost(autoload=False)
    host.storage_backends.register(
        backend_class("needy", "{'kvstrata_brokendep.io': 'pip install kvstrata-dep'}")
    )
    [row] = [row for row in plugin_rows(host) if row["name"] == "needy"]
    assert row["status"] == "missing dependency" and row["install"] == "pip install kvstrata-dep"
    with pytest.raises(MissingDependencyError, match="pip install kvstrata-dep"):
        host.storage_backends.require("needy")


def test_kvstrata_plugins_lists_an_installed_hook_plugin_that_loaded(make_distribution) -> None:
    # only a hook plugin that failed was listed: a working metrics plugin was invisible, so nobody
    # could tell it was installed and loaded
    from kvstrata.cli.plugins_cmd import _details, plugin_rows

    make_distribution(
        "kvstrata-metrics",
        "3.1",
        {"kvstrata.plugins": {"metrics": "kvstrata_metrics"}},
        {"kvstrata_metrics": OBSERVER.format(hook="kvstrata_eviction")},
    )
    host = PluginHost(autoload=True, disabled=set())
    [row] = [r for r in plugin_rows(host) if r["kind"] == "hook plugin"]
    assert (row["name"], row["distribution"], row["version"], row["status"]) == (
        "metrics",
        "kvstrata-metrics",
        "3.1",
        "available",
    )
    assert row["hooks"] == ["kvstrata_eviction"] and _details(row) == "hooks: kvstrata_eviction"


def test_a_rediscovery_after_an_install_loads_what_failed_before(make_distribution) -> None:
    # discover() says it is safe to call again after installs, but get() kept raising the import
    # error it cached before the missing module was installed
    make_distribution(
        "kvstrata-late",
        "1.0",
        {BACKENDS: {"late": "kvstrata_late:EchoBackend"}},
        {"kvstrata_late": "import kvstrata_late_dep\n" + backend_module("late")},
    )
    host = PluginHost(autoload=True, disabled=set())
    with pytest.raises(PluginLoadError, match="kvstrata_late_dep"):
        host.storage_backends.get("late")
    make_distribution("kvstrata-late-dep", "1.0", {}, {"kvstrata_late_dep": ""})  # the pip install
    host.storage_backends.discover()
    assert host.storage_backends.get("late").name == "late"
