"""A newcomer's first hour (issue 17), through the real ``kvstrata`` entry point in fresh processes:
failed requests said loudly and counted once, output paths checked before a run, errors blamed on
what the user wrote, install hints printed literally, progress when piped, ``--version``, disabled
and broken plugins listed with the reason and what to install."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from kvstrata.cli import app

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples" / "configs"
BACKENDS = "kvstrata.storage_backends"


def run_cli(
    *args: str, cwd: Path, env: dict[str, str] | None = None, site: Path | None = None, timeout: int = 240
) -> subprocess.CompletedProcess[str]:
    """``python -m kvstrata ARGS`` in a fresh process (stdout and stderr are pipes, not a terminal).
    ``site``: a folder of fake distributions put first on the path."""
    paths = [str(site)] if site else []
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVSTRATA_")}
    full_env = {
        **base,
        "COLUMNS": "200",
        "KVSTRATA_CACHE_DIR": str(cwd / "user-cache"),
        "PYTHONPATH": os.pathsep.join([*paths, str(REPO / "src")]),
        **(env or {}),
    }
    return subprocess.run(
        [sys.executable, "-m", "kvstrata", *args],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=cwd,
        timeout=timeout,
        check=False,
    )


def write_trace(path: Path, *blocks: int) -> Path:
    """One request per entry, with that many fresh full 512-token blocks."""
    lines, next_id = [], 0
    for i, count in enumerate(blocks):
        ids = list(range(next_id, next_id + count))
        next_id += count
        lines.append(
            json.dumps({"timestamp": i, "input_length": count * 512, "output_length": 1, "hash_ids": ids})
        )
    path.write_text("\n".join(lines) + "\n")
    return path


def tiny_stack(path: Path, device_tokens: int, host_tokens: int = 0) -> Path:
    """KV only, 64 bytes per token, 512-token pages, no L3 (and by default no host tier)."""
    path.write_text(
        yaml.safe_dump(
            {
                "model": {
                    "name": "newcomer",
                    "page_size": 512,
                    "pools": {"kv": {"type": "kv", "layers": 2, "kv_heads": 1, "head_dim": 8}},
                },
                "tiers": {
                    "device": {"capacity_tokens": device_tokens},
                    "host": {"capacity_tokens": host_tokens},
                },
            }
        )
    )
    return path


def test_no_warning_for_a_longest_request_whose_whole_pages_fit(tmp_path: Path) -> None:
    """1000 tokens of device tier are 2 pages of 512 (capacity rounds up to whole pages), and a
    1024-token request needs those 2: it was warned about (1024 > 1000) and then served."""
    trace = write_trace(tmp_path / "t.jsonl", 2, 1)
    stack = tiny_stack(tmp_path / "stack.yaml", device_tokens=1000)
    proc = run_cli("replay", str(trace), "-c", str(stack), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "smaller than the longest request" not in proc.stderr


# --- 1 and 2: failed requests are said loudly, counted once, and not counted as throughput ------


def test_failed_requests_exit_1_naming_the_setting_and_are_counted_once(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", 1, 1, 4, 1)  # the 2048-token request cannot fit
    stack = tiny_stack(tmp_path / "stack.yaml", device_tokens=1024)
    out = tmp_path / "r.json"
    proc = run_cli("replay", str(trace), "-c", str(stack), "--json", str(out), cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert "smaller than the longest request" in proc.stderr  # warned before the run
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: 1 of 4 requests FAILED") and "tiers.device.capacity_tokens" in last
    assert "FAILED" in proc.stdout  # the summary says it too
    result = json.loads(out.read_text())  # the result is still written
    assert result["failures"] == 1  # the controller's own count of the failed allocation is not added
    assert result["tokens"] == 7 * 512
    served_tokens = 3 * 512
    assert result["tokens_per_s"] * result["wall_s"] == pytest.approx(served_tokens)


def replay_example(config: Path, trace: Path, limit: int, tmp_path: Path) -> dict[str, Any]:
    out = tmp_path / f"{config.stem}-{trace.stem}.json"
    args = ["replay", str(trace), "-c", str(config), "--limit", str(limit), "--json", str(out)]
    # each run its own user cache: a hit must come from this trace, not from an earlier run's L3
    proc = run_cli(*args, cwd=tmp_path, env={"KVSTRATA_CACHE_DIR": str(tmp_path / config.stem)})
    return {"proc": proc, "result": json.loads(out.read_text()) if out.is_file() else None}


#: Requests replayed per bundled trace: the fewest after which every example hits (a Mamba stack
#: needs a stored state where the shared prefix ends; the synthetic trace shares nothing before
#: its 50th request).
TRACE_LIMITS = {"conversation_trace.jsonl": 20, "synthetic_trace.jsonl": 60}


@pytest.mark.parametrize("trace_name", sorted(TRACE_LIMITS))
def test_every_example_config_replays_the_bundled_traces(trace_name: str, tmp_path: Path) -> None:
    """Each example exits 0 with hits and no failure, or nonzero with a sentence naming a setting."""
    from concurrent.futures import ThreadPoolExecutor

    from trace_files import full_trace

    trace = full_trace(trace_name)
    configs = sorted(EXAMPLES.glob("*.yaml"))
    assert len(configs) >= 7
    limit = TRACE_LIMITS[trace_name]
    with ThreadPoolExecutor(2) as pool:  # two processes at a time: CI has two cores
        results = pool.map(lambda c: replay_example(c, trace, limit, tmp_path), configs)
        runs = dict(zip(configs, results, strict=True))
    for config, run in runs.items():
        proc, result = run["proc"], run["result"]
        if proc.returncode == 0:
            assert result["hit_rate"]["total"] > 0, f"{config.name}: no hits\n{proc.stdout}"
            assert result["failures"] == 0 and result["corrupt_pages_served"] == 0, config.name
        else:
            last = proc.stderr.strip().splitlines()[-1]
            assert "tiers." in last or "model." in last, f"{config.name}: {last}"
            pytest.fail(f"{config.name} on {trace_name} does not replay: {last}")


# --- 4: install hints printed literally; mooncake availability by loading it -------------------


NEEDY_BACKEND = """
from typing import Literal
from kvstrata.plugins import BackendCapabilities, BackendConfig, PoolCapabilities, StorageBackend

class NeedyConfig(BackendConfig):
    type: Literal["needy"] = "needy"

class NeedyBackend(StorageBackend):
    name = "needy"
    Config = NeedyConfig
    capabilities = BackendCapabilities(pools={"*": PoolCapabilities()})
    requires = {"surely_missing_module_xyz": "pip install 'kvstrata-needy[fast]'"}

    def exists(self, keys):
        return [False] * len(keys)

    def put(self, objects):
        return [False] * len(objects)

    def get(self, objects):
        return [-1] * len(objects)
"""


def test_install_hints_keep_their_extras_in_brackets(make_distribution, tmp_path: Path) -> None:
    site = make_distribution(
        "kvstrata-needy",
        "1.0",
        {BACKENDS: {"needy": "kvstrata_needy:NeedyBackend"}},
        {"kvstrata_needy": NEEDY_BACKEND},
    )
    listing = run_cli("plugins", cwd=tmp_path, site=site)
    assert listing.returncode == 0, listing.stderr
    assert "pip install 'kvstrata-needy[fast]'" in listing.stdout
    stack = tiny_stack(tmp_path / "stack.yaml", 4096, host_tokens=8192)
    proc = run_cli(
        "replay",
        "--limit",
        "2",
        "-c",
        str(stack),
        "--set",
        "tiers.storage.l3={type: needy}",
        cwd=tmp_path,
        site=site,
    )
    assert proc.returncode != 0
    assert "pip install 'kvstrata-needy[fast]'" in proc.stderr


FAKE_CUDA_STORE = """
# Fault injection (a fake, labelled): the CUDA wheel's module on a machine without libcuda.
raise OSError("libcuda.so.1: cannot open shared object file: No such file or directory")
"""


def mooncake_row(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert proc.returncode == 0, proc.stderr
    return next(r for r in json.loads(proc.stdout) if r["name"] == "mooncake")


def test_mooncake_that_fails_to_load_is_unavailable_with_the_cpu_extra_named(
    make_distribution, tmp_path: Path
) -> None:
    site = make_distribution("fake-cuda-only-module", "0", {}, {"mooncake.store": FAKE_CUDA_STORE})
    row = mooncake_row(run_cli("plugins", "--json", cwd=tmp_path, site=site))
    assert row["status"] == "unavailable"
    assert "libcuda" in row["error"] and "kvstrata[mooncake-cpu]" in row["error"]


def test_both_mooncake_wheels_installed_is_refused_with_the_commands(
    make_distribution, tmp_path: Path
) -> None:
    site = make_distribution("mooncake-transfer-engine", "0.3.13", {}, {})
    make_distribution("mooncake-transfer-engine-non-cuda", "0.3.13", {}, {})
    row = mooncake_row(run_cli("plugins", "--json", cwd=tmp_path, site=site))
    assert row["status"] == "unavailable"
    assert "exclude each other" in row["error"]
    assert "pip uninstall -y mooncake-transfer-engine mooncake-transfer-engine-non-cuda" in row["error"]


# --- 5: output paths checked before the run; file errors in words; --set blamed -----------------


@pytest.mark.parametrize(
    ("option", "target", "message"),
    [
        ("--json", "missing-dir/r.json", "does not exist"),
        ("--plot", ".", "is a directory"),
    ],
)
def test_bad_output_path_fails_before_the_run(option: str, target: str, message: str, tmp_path: Path) -> None:
    proc = run_cli("replay", "--limit", "2", option, str(tmp_path / target), cwd=tmp_path)
    assert proc.returncode == 2
    assert f"error: {option} " in proc.stderr and message in proc.stderr
    assert "replaying" not in proc.stderr  # nothing ran


def test_unusable_storage_path_names_the_setting_not_an_errno(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    proc = run_cli(
        "replay",
        "--limit",
        "2",
        "-c",
        str(EXAMPLES / "kv.yaml"),
        "--set",
        f"tiers.storage.l3.path={tmp_path / 'a-file' / 'l3'}",
        cwd=tmp_path,
    )
    assert proc.returncode == 2  # refused at start-up (issue 27), not after every write failed
    assert "tiers.storage.l3.path" in proc.stderr and "Not a directory" in proc.stderr
    assert "[Errno" not in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("command", [["replay", "--limit", "1"], ["config", "validate"]])
def test_set_errors_are_blamed_on_the_set_argument(command: list[str], tmp_path: Path) -> None:
    config = str(EXAMPLES / "kv.yaml")
    args = [*command, "-c", config] if command[0] == "replay" else [*command, config]
    proc = run_cli(*args, "--set", "tiers.device.capacity_tokens=-1", cwd=tmp_path)
    assert proc.returncode == 2
    assert "invalid configuration in --set tiers.device.capacity_tokens=-1" in proc.stderr
    assert "kv.yaml" not in proc.stderr


def test_environment_override_errors_are_blamed_on_the_variable(tmp_path: Path) -> None:
    proc = run_cli(
        "config", "validate", str(EXAMPLES / "kv.yaml"), cwd=tmp_path, env={"KVSTRATA_MODEL__PAGE_SIZE": "0"}
    )
    assert proc.returncode == 2
    assert "environment KVSTRATA_MODEL__PAGE_SIZE=0" in proc.stderr


# --- 6: the examples' L3 lives in the per-user cache directory, capped, and is printed -----------


def test_examples_use_the_per_user_cache_dir_with_a_cap() -> None:
    for config in sorted(EXAMPLES.glob("*.yaml")):
        text = config.read_text()
        assert "/tmp" not in text, config.name
        for instance, backend in yaml.safe_load(text)["tiers"]["storage"].items():
            assert str(backend["path"]) == f"$KVSTRATA_CACHE_DIR/l3/{config.stem}", (config.name, instance)
            assert backend["capacity_bytes"] > 0, (config.name, instance)


def test_replay_prints_where_the_per_user_cache_is_and_writes_there(tmp_path: Path) -> None:
    xdg = tmp_path / "xdg-cache"
    env = {"XDG_CACHE_HOME": str(xdg), "KVSTRATA_CACHE_DIR": ""}  # unset: the platform's directory
    proc = run_cli("replay", "--limit", "5", "-c", str(EXAMPLES / "kv.yaml"), cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    l3 = xdg / "kvstrata" / "l3" / "kv"  # each example its own directory (issue 27)
    assert f"L3 l3 (file): {l3}, capped at 4.00 GiB" in proc.stderr
    assert any(p.is_file() for p in l3.rglob("*")), "objects are written to the per-user directory"


# --- 8: progress when piped, --version, disabled and broken plugins -----------------------------


def test_piped_replay_prints_progress_lines_with_eta(tmp_path: Path) -> None:
    proc = run_cli("replay", "--limit", "40", cwd=tmp_path, env={"KVSTRATA_PROGRESS_S": "0"})
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("replayed ")]
    assert any("replayed 16/40 requests" in line and "ETA" in line for line in lines), proc.stderr
    assert lines[-1].startswith("replayed 40/40 requests (100%)")


def test_version(tmp_path: Path) -> None:
    proc = run_cli("--version", cwd=tmp_path)
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"kvstrata {importlib.metadata.version('kvstrata')}"


#: runs the entry point in this process, then says on stderr whether torch was imported
_TORCH_PROBE = (
    "import sys\nfrom kvstrata.cli import main\nsys.argv = ['kvstrata', *sys.argv[1:]]\n"
    "try:\n    main()\nexcept SystemExit as exc:\n    code = exc.code\nelse:\n    code = 0\n"
    "print('torch imported:', 'torch' in sys.modules, 'exit:', code, file=sys.stderr)\n"
)


@pytest.mark.parametrize(
    "args",
    [["--version"], ["--help"], ["config", "show", "-c", str(EXAMPLES / "demo.yaml")], ["replay", "--help"]],
    ids=["version", "help", "config-show", "replay-help"],
)
def test_commands_that_compute_nothing_start_without_torch(tmp_path: Path, args: list[str]) -> None:
    """Importing torch takes seconds: ``--version``, help and ``config show`` never need it
    (validation, doctor, plugins and replay do, and import it when they run)."""
    proc = subprocess.run(
        [sys.executable, "-c", _TORCH_PROBE, *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "COLUMNS": "200", "PYTHONPATH": str(REPO / "src")},
        timeout=120,
        check=False,
    )
    assert "torch imported: False exit: 0" in proc.stderr, proc.stderr
    assert proc.stdout.strip()


def test_plugins_lists_disabled_and_broken_plugins_with_reason_and_install_hint(
    make_distribution, tmp_path: Path
) -> None:
    site = make_distribution(
        "kvstrata-brokenredis",
        "0.2",
        {BACKENDS: {"brokenredis": "kvstrata_brokenredis:Backend"}},
        {"kvstrata_brokenredis": "import surely_missing_client_xyz\n"},
        requires=("surely-missing-client-xyz>=6",),
    )
    proc = run_cli("plugins", "--json", cwd=tmp_path, site=site, env={"KVSTRATA_DISABLED_PLUGINS": "swa"})
    assert proc.returncode == 0, proc.stderr
    rows = {(r["kind"], r["name"]): r for r in json.loads(proc.stdout)}
    broken = rows[("storage backend", "brokenredis")]
    assert broken["status"] == "load error" and broken["distribution"] == "kvstrata-brokenredis"
    assert "surely_missing_client_xyz" in broken["error"]
    assert broken["install"] == "pip install 'surely-missing-client-xyz>=6'"
    disabled = rows[("pool type", "swa")]
    assert disabled["status"] == "disabled" and "KVSTRATA_DISABLED_PLUGINS" in disabled["error"]
    table = run_cli("plugins", cwd=tmp_path, site=site)
    assert "fix: pip install 'surely-missing-client-xyz>=6'" in table.stdout


# --- 9b: options that would be ignored are refused; user text is never rich markup -------------


@pytest.mark.parametrize("option", [["--capacities", "1,2"], ["--policies", "lru,fifo"]])
def test_sweep_options_without_sweep_are_refused(option: list[str]) -> None:
    # `simulate --capacities 1,2` ran one unlimited simulation and exited 0
    result = CliRunner().invoke(app, ["simulate", "--limit", "3", *option])
    assert result.exit_code == 2, result.output
    assert f"{option[0]} applies to a sweep only: add --sweep" in result.output


def test_simulate_prints_a_trace_path_that_looks_like_markup(tmp_path: Path) -> None:
    # `.../a[/b].jsonl` in the table title crashed with rich's MarkupError
    (tmp_path / "a[").mkdir()
    trace = write_trace(tmp_path / "a[" / "b].jsonl", 2, 1)
    result = CliRunner().invoke(app, ["simulate", str(trace)])
    assert result.exit_code == 0, result.output
    assert str(trace) in "".join(result.output.split())  # the title wraps where the width says


# --- 9: the README's first screen points at the library API ------------------------------------


def test_readme_first_screen_links_the_library_api() -> None:
    lines = (REPO / "README.md").read_text().splitlines()
    first_screen = "\n".join(lines[:25])
    anchor = "#library-api"
    assert f"]({anchor})" in first_screen
    headings = {line.lstrip("#").strip().lower().replace(" ", "-") for line in lines if line.startswith("#")}
    assert anchor[1:] in headings
