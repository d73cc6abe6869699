"""A newcomer's second hour (issue 27), through the installed ``kvstrata`` console script in fresh
processes: start-up refuses an unusable L3 with doctor's own checks, one ``-c/--config``
convention, plugin errors with the right fix, nothing cut at 80 columns in a pipe."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples" / "configs"
DEMO = EXAMPLES / "demo.yaml"


def kvstrata(
    *args: str, cwd: Path, env: dict[str, str] | None = None, site: Path | None = None, timeout: int = 240
) -> subprocess.CompletedProcess[str]:
    """The ``kvstrata`` console script (``python -m kvstrata`` where none is on PATH), output piped:
    what a CI log or ``| tee`` sees. ``site``: fake distributions put first on the path."""
    script = shutil.which("kvstrata")
    argv = [script] if script else [sys.executable, "-m", "kvstrata"]
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVSTRATA_") and k != "COLUMNS"}
    paths = [str(site)] if site else []
    full_env = {
        **base,
        "KVSTRATA_CACHE_DIR": str(cwd / "user-cache"),
        "XDG_CACHE_HOME": str(cwd / "xdg"),
        "PYTHONPATH": os.pathsep.join([*paths, str(REPO / "src")]),
        **(env or {}),
    }
    return subprocess.run(
        [*argv, *args], capture_output=True, text=True, env=full_env, cwd=cwd, timeout=timeout, check=False
    )


# --- 2: start-up runs doctor's backend checks ---------------------------------------------------


def test_an_unwritable_l3_is_refused_before_the_first_request(tmp_path: Path) -> None:
    """/sys/fs passes the permission bits for root but refuses every new file: the probe writes."""
    args = ["-c", str(DEMO), "--set", "tiers.storage.l3.path=/sys/fs"]
    doctor = kvstrata("doctor", *args, cwd=tmp_path)
    assert doctor.returncode == 1 and "not writable" in doctor.stderr, doctor.stderr
    proc = kvstrata("replay", "--limit", "3", *args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "tiers.storage.l3 (file) cannot be used: directory /sys/fs is not writable" in proc.stderr
    assert "--set tiers.storage.l3.path=DIR" in proc.stderr
    assert "replaying" not in proc.stderr and proc.stdout == ""  # nothing ran


def test_an_unreachable_server_is_refused_before_the_first_request(tmp_path: Path) -> None:
    with socket.socket() as sock:  # a loopback port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    l3 = f"tiers.storage.l3={{type: mooncake, master: '127.0.0.1:{port}', metadata_server: 'P2PHANDSHAKE'}}"
    proc = kvstrata("replay", "--limit", "3", "-c", str(DEMO), "--set", l3, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "tiers.storage.l3 (mooncake) cannot be used" in proc.stderr and "unreachable" in proc.stderr


def test_too_little_free_space_is_a_probe_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fault injection: the file system reports 1 MiB free (a full disk cannot be made here)."""
    from kvstrata.storage_backends import file as file_backend

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(file_backend.shutil, "disk_usage", lambda _p: usage._replace(free=1 << 20))
    backend = file_backend.FileBackend("l3", file_backend.FileConfig(path=tmp_path / "l3"))
    reason = backend.probe()
    assert reason is not None and "1.0 MiB free" in reason, reason


# --- 6: one config convention for every subcommand ----------------------------------------------


CONFIG_FORMS = [
    (command, form)
    for command in (["doctor"], ["config", "validate"], ["config", "show"], ["replay"])
    for form in ("-c", "--config", "positional")
    if not (form == "positional" and command == ["replay"])  # replay's positional is the trace
]


@pytest.mark.parametrize(("command", "form"), CONFIG_FORMS)
def test_every_subcommand_takes_its_config_alike(command: list[str], form: str, tmp_path: Path) -> None:
    config = [str(DEMO)] if form == "positional" else [form, str(DEMO)]
    extra = ["--set", f"tiers.storage.l3.path={tmp_path / 'l3'}"]
    if command == ["replay"]:
        extra += ["--limit", "2"]
    proc = kvstrata(*command, *config, *extra, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "no config given" not in proc.stderr  # the file given was used, not the default
    assert "storage: l3 (file)" in proc.stdout + proc.stderr or "l3" in proc.stdout


@pytest.mark.parametrize("command", [["doctor"], ["config", "validate"]])
def test_no_config_means_the_packaged_default_and_says_so(command: list[str], tmp_path: Path) -> None:
    proc = kvstrata(*command, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "no config given (-c FILE): using the packaged default stack" in proc.stderr
    assert "Usage:" not in proc.stderr


# --- 7: plugin errors suggest the right fix -----------------------------------------------------

SECOND_FILE = """
from typing import Literal
from kvstrata.storage_backends.file import FileBackend, FileConfig

class OtherFileConfig(FileConfig):
    type: Literal["file"] = "file"

class OtherFileBackend(FileBackend):
    name = "file"
    Config = OtherFileConfig
"""


def test_a_disabled_plugin_is_reported_as_disabled_not_unknown(tmp_path: Path) -> None:
    env = {"KVSTRATA_DISABLED_PLUGINS": "file"}
    proc = kvstrata("config", "validate", "-c", str(DEMO), cwd=tmp_path, env=env)
    assert proc.returncode == 2, proc.stderr
    assert (
        "storage backend 'file'" in proc.stderr and "is disabled by KVSTRATA_DISABLED_PLUGINS" in proc.stderr
    )
    assert "remove 'file' from that variable" in proc.stderr
    assert "pip install kvstrata-file" not in proc.stderr and "unknown" not in proc.stderr


def test_a_collision_names_a_fix_that_keeps_one_of_the_two(make_distribution, tmp_path: Path) -> None:
    site = make_distribution(
        "kvstrata-otherfile",
        "0.3",
        {"kvstrata.storage_backends": {"file": "kvstrata_otherfile:OtherFileBackend"}},
        {"kvstrata_otherfile": SECOND_FILE},
    )
    args = ["config", "validate", "-c", str(DEMO)]
    clash = kvstrata(*args, cwd=tmp_path, site=site)
    assert clash.returncode == 2, clash.stderr
    assert "is provided by both" in clash.stderr
    assert "KVSTRATA_DISABLED_PLUGINS=kvstrata-otherfile:file" in clash.stderr, clash.stderr
    # the fix it names works: the built-in stays, the other distribution's entry is blocked
    fixed = kvstrata(
        *args, cwd=tmp_path, site=site, env={"KVSTRATA_DISABLED_PLUGINS": "kvstrata-otherfile:file"}
    )
    assert fixed.returncode == 0, fixed.stderr
    listing = kvstrata(
        "plugins",
        "--json",
        cwd=tmp_path,
        site=site,
        env={"KVSTRATA_DISABLED_PLUGINS": "kvstrata_otherfile:file"},
    )
    rows = [r for r in json.loads(listing.stdout) if r["name"] == "file"]
    status = {r["distribution"]: r["status"] for r in rows}
    assert status == {"kvstrata": "available", "kvstrata-otherfile": "disabled"}, rows
    assert "remove 'kvstrata_otherfile:file'" in next(r["error"] for r in rows if r["status"] == "disabled")


# --- 8: nothing the user must act on is cut at 80 columns ---------------------------------------


def test_plugins_in_a_pipe_prints_every_reason_and_fix_whole(make_distribution, tmp_path: Path) -> None:
    long_fix = (
        "pip install 'kvstrata-needy[fast]' --extra-index-url https://packages.example.org/simple/needy"
    )
    site = make_distribution(
        "kvstrata-needy",
        "1.0",
        {"kvstrata.storage_backends": {"needy": "kvstrata_needy:NeedyBackend"}},
        {"kvstrata_needy": NEEDY.replace("INSTALL", long_fix)},
    )
    proc = kvstrata("plugins", cwd=tmp_path, site=site)  # no COLUMNS, not a terminal: like CI
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    needy = [line for line in lines if " needy " in line]
    assert needy == [
        f"storage backend needy (kvstrata-needy 1.0): missing dependency: needs zz_missing_mod: {long_fix}"
    ]
    assert any("set mock: true to use the file-backed mock" in line for line in lines)  # hf3fs's reason
    assert not any("…" in line for line in lines)


NEEDY = """
from typing import Literal
from kvstrata.plugins import BackendCapabilities, BackendConfig, PoolCapabilities, StorageBackend

class NeedyConfig(BackendConfig):
    type: Literal["needy"] = "needy"

class NeedyBackend(StorageBackend):
    name = "needy"
    Config = NeedyConfig
    capabilities = BackendCapabilities(pools={"*": PoolCapabilities()})
    requires = {"zz_missing_mod": "INSTALL"}

    def exists(self, keys):
        return [False] * len(keys)

    def put(self, objects):
        return [False] * len(objects)

    def get(self, objects):
        return [-1] * len(objects)
"""


# --- 9: results that depend on an earlier run say so; --fresh ------------------------------------


def objects_in(directory: Path) -> int:
    return sum(1 for p in directory.rglob("*") if p.is_file())


def test_a_second_run_says_what_came_from_the_first_and_fresh_ignores_it(tmp_path: Path) -> None:
    args = ["replay", "-c", str(EXAMPLES / "kv.yaml"), "--limit", "12"]
    first = kvstrata(*args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert "from an earlier run" not in first.stdout
    l3 = tmp_path / "user-cache" / "l3" / "kv"  # the example's own directory
    stored = objects_in(l3)
    assert stored > 0
    second = kvstrata(*args, cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    row = next(line for line in second.stdout.splitlines() if "of which from an earlier run" in line)
    tokens = int(row.split("│")[-2].strip().replace(",", ""))
    assert tokens > 0
    assert (
        f"{tokens:,} tokens came from L3 objects an earlier run (or another process) wrote" in second.stdout
    )
    assert "--fresh replays against an empty L3" in second.stdout
    fresh = kvstrata(*args, "--fresh", cwd=tmp_path)
    assert fresh.returncode == 0, fresh.stderr
    assert "from an earlier run" not in fresh.stdout
    assert "(empty, temporary, removed afterwards)" in fresh.stderr
    assert objects_in(l3) == stored  # the per-user L3 was neither read into nor written
    # the default config with the L3 pointed at the user's directory: theirs, not a scratch one
    own = kvstrata("replay", "--limit", "2", "--set", f"tiers.storage.l3.path={l3}", cwd=tmp_path)
    assert own.returncode == 0, own.stderr
    assert f"{l3}" in own.stderr and "temporary" not in own.stderr


# --- 10: minor items ------------------------------------------------------------------------------


@pytest.mark.parametrize("tail", ['{"timestamp": 1, "input_le', '{"timestamp": 1, "input_length": 51', "{"])
def test_a_truncated_trace_line_is_called_truncated(tail: str, tmp_path: Path) -> None:
    good = '{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1]}\n'
    trace = tmp_path / "cut.jsonl"
    trace.write_text(good + tail)
    proc = kvstrata("simulate", str(trace), cwd=tmp_path)
    assert proc.returncode == 2
    assert f"{trace}:2: truncated: the line ends (after {len(tail)} character" in proc.stderr, proc.stderr
    assert "column 1" not in proc.stderr


def test_help_text_is_never_wrapped_mid_sentence(tmp_path: Path) -> None:
    """Docstrings are reflowed: on a wide terminal a command's description is one line."""
    proc = kvstrata("--help", cwd=tmp_path, env={"COLUMNS": "300"})
    assert proc.returncode == 0, proc.stderr
    assert (
        "List installed pool types, storage backends and eviction policies: status, capabilities, and for "
        "a plugin that cannot be used the reason and what to install."
    ) in proc.stdout
    replay = kvstrata("replay", "--help", cwd=tmp_path, env={"COLUMNS": "300"})
    assert "verifying every restored byte; prints per-tier hit rates, bytes moved" in replay.stdout


def test_the_summary_says_which_part_its_wall_time_measures(tmp_path: Path) -> None:
    proc = kvstrata("replay", "--limit", "3", cwd=tmp_path, env={"COLUMNS": "200"})
    assert proc.returncode == 0, proc.stderr
    assert "wall time (measured requests; start-up, warm-up excluded)" in proc.stdout
