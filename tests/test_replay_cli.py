"""`kvstrata replay` on the command line: the README's first command, the JSON contract, exit codes."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from kvstrata.cli import app
from replay_contract import REQUIRED_JSON_KEYS

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def no_arg_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """`kvstrata replay --json OUT` (otherwise no arguments) in a fresh process, from another cwd."""
    tmp = tmp_path_factory.mktemp("replay-cli")
    scratch = tmp / "tmp"
    scratch.mkdir()
    out = tmp / "result.json"
    env = dict(
        os.environ,
        TMPDIR=str(scratch),
        COLUMNS="120",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")])),
    )
    proc = subprocess.run(
        [sys.executable, "-m", "kvstrata", "replay", "--json", str(out)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp,
        timeout=240,
    )
    return {"proc": proc, "json": json.loads(out.read_text()) if out.is_file() else None, "tmp": scratch}


def test_no_arg_run_prints_tier_hit_rates_and_no_served_corruption(no_arg_run: dict[str, Any]) -> None:
    proc = no_arg_run["proc"]
    assert proc.returncode == 0, proc.stderr
    for tier in ("device", "host", "storage", "total"):
        assert any(
            line.split("│")[1:2] and line.split("│")[1].strip() == tier for line in proc.stdout.splitlines()
        ), f"no {tier} row in:\n{proc.stdout}"
    served = [line for line in proc.stdout.splitlines() if "corrupt_pages_served" in line]
    assert served and served[0].split("│")[2].strip() == "0"
    result = no_arg_run["json"]
    assert result["requests"] == 300  # the whole bundled sample
    assert result["corrupt_pages_served"] == 0
    assert result["hit_rate"]["total"] > 0
    # the temporary L3 directory is gone afterwards
    assert list(no_arg_run["tmp"].iterdir()) == []


def test_json_has_exactly_the_contract_keys(no_arg_run: dict[str, Any]) -> None:
    result = no_arg_run["json"]
    assert set(result) == REQUIRED_JSON_KEYS
    assert set(result["hit_rate"]) == {"device", "host", "storage", "total"}
    assert set(result["bytes"]) == {"device_to_host", "host_to_device", "host_to_storage", "storage_to_host"}
    rates = result["hit_rate"]
    assert rates["device"] + rates["host"] + rates["storage"] == pytest.approx(rates["total"])
    assert result["bytes"]["host_to_storage"] > 0  # the sample stack writes through to the file L3
    assert result["tokens_per_s"] == pytest.approx(result["tokens"] / result["wall_s"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["/nonexistent/trace.jsonl"], "cannot open"),
        (["--set", "model.page_size=0"], "model.page_size"),
        (["--warmup-fraction", "1.5"], "--warmup-fraction"),
        (["-c", "/nonexistent/config.yaml"], "cannot read"),
    ],
)
def test_bad_input_exits_2_with_a_clear_message(args: list[str], message: str, tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["replay", *args])
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_bad_trace_line_names_file_and_line(tmp_path: Path) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\nnot json\n')
    result = CliRunner().invoke(app, ["replay", str(trace)])
    assert result.exit_code == 2
    assert f"{trace}:2" in result.output


def test_a_pool_short_of_its_own_device_units_is_named_not_the_tier(tmp_path: Path) -> None:
    # a mamba pool with `device_units: 1` ran out of slots; the summary said "raise
    # tiers.device.capacity_tokens" (the tier held 128 times the request; raising it changed nothing)
    stack = tmp_path / "stack.yaml"
    stack.write_text(
        "model:\n  name: units\n  page_size: 512\n  pools:\n"
        "    kv: {type: kv, layers: 2, kv_heads: 1, head_dim: 16, dtype: bfloat16}\n"
        "    m: {type: mamba, layers: 1, states: {conv: {shape: [4, 8]}}, device_units: 1, host_units: 1}\n"
        "tiers: {device: {capacity_tokens: 262144}, host: {capacity_tokens: 1048576}, storage: {}}\n"
    )
    trace = tmp_path / "trace.jsonl"
    blocks = [[0, 1], [0, 1, 2], [0, 1, 2, 3]]  # each extends the last: its locked prefix holds the slot
    trace.write_text(
        "".join(
            json.dumps({"timestamp": i, "input_length": len(ids) * 512, "output_length": 1, "hash_ids": ids})
            + "\n"
            for i, ids in enumerate(blocks)
        )
    )
    result = CliRunner().invoke(app, ["replay", str(trace), "-c", str(stack)])
    assert result.exit_code == 1, result.output
    words = " ".join(result.output.split())
    assert "error: 2 of 3 requests FAILED: pool 'm' had no device unit left for 2 of them" in words, words
    assert "raise model.pools.m.device_units" in words
    assert "tiers.device.capacity_tokens" not in words


def test_failures_of_both_kinds_name_both_settings() -> None:
    from kvstrata.replay.report import ReplayDetails, ReplayResult, failed_requests_sentence

    result = ReplayResult.model_construct(requests=10)
    details = ReplayDetails(
        failed_requests=4, longest_failed_tokens=9000, failed_pool_units={"m": 3}, failed_tier_requests=1
    )
    sentence = failed_requests_sentence(result, details, 4096)
    assert sentence.startswith("4 of 10 requests FAILED: pool 'm' had no device unit left for 3 of them")
    assert sentence.endswith(
        "; for 1 of them the device tier (4,096 tokens) cannot hold a whole request (the longest failed "
        "one has 9,000 tokens); raise tiers.device.capacity_tokens above that"
    )
    tier_only = ReplayDetails(failed_requests=2, longest_failed_tokens=9000)
    assert "model.pools" not in failed_requests_sentence(result, tier_only)


def test_start_up_line_hides_a_url_password() -> None:
    """``kvstrata replay`` prints each L3's ``url``: a password in it (``redis://user:secret@host``,
    the valkey plugin's documented form) went to stderr, and from there into CI logs."""
    from types import SimpleNamespace
    from typing import Literal, cast

    from kvstrata.cli.replay_cmd import describe_storage
    from kvstrata.plugins.storage_backend import BackendConfig

    class UrlConfig(BackendConfig):
        type: Literal["urlstore"] = "urlstore"
        url: str

    storage = {
        "l3": UrlConfig(url="redis://alice:s3cret@10.0.0.5:6379/0"),
        "l4": UrlConfig(url="rediss://:t0ken@cache.internal:6380/1"),
        "l5": UrlConfig(url="redis://10.0.0.6:6379/0"),
    }
    lines = describe_storage(cast(Any, SimpleNamespace(tiers=SimpleNamespace(storage=storage))))
    assert lines == [
        "L3 l3 (urlstore): redis://alice:***@10.0.0.5:6379/0",
        "L3 l4 (urlstore): rediss://:***@cache.internal:6380/1",
        "L3 l5 (urlstore): redis://10.0.0.6:6379/0",
    ]


def _stop_after(checks: int) -> Any:
    """``sigint_handled`` whose stop turns true at the ``checks``-th look (a Ctrl-C between two
    requests), without a signal."""
    from contextlib import contextmanager

    from kvstrata.cli.interrupt import ReplayInterrupt

    class Stop(ReplayInterrupt):
        seen = 0

        @property  # type: ignore[override]
        def requested(self) -> bool:
            Stop.seen += 1
            return Stop.seen > checks

        @requested.setter
        def requested(self, _value: bool) -> None:
            pass

    @contextmanager
    def handled() -> Any:
        yield Stop()

    return handled


def test_ctrl_c_keeps_the_report_of_what_was_replayed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C printed one line and exited 130: the summary of the requests replayed so far and
    the ``--json`` / ``--plot`` asked for were lost (a long run left nothing to read)."""
    import kvstrata.cli.replay_cmd as replay_cmd

    monkeypatch.setattr(replay_cmd, "sigint_handled", _stop_after(3))
    report, plot = tmp_path / "partial.json", tmp_path / "partial.png"
    args = ["replay", "-c", str(REPO / "examples" / "configs" / "demo.yaml"), "--set", "tiers.storage={}"]
    extra = ["--limit", "10", "--json", str(report)]
    if importlib.util.find_spec("matplotlib") is not None:
        extra += ["--plot", str(plot)]
    result = CliRunner().invoke(app, [*args, *extra])
    assert result.exit_code == 130, result.output
    words = " ".join(result.output.split())
    assert "interrupted after 3 of 10 requests" in words, words
    assert "corrupt_pages_served" in words  # the summary table
    data = json.loads(report.read_text())
    assert set(data) == REQUIRED_JSON_KEYS and data["requests"] == 3
    assert not importlib.util.find_spec("matplotlib") or plot.read_bytes()[:4] == b"\x89PNG"


def test_ctrl_c_in_the_warm_up_writes_a_report_of_nothing_measured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stopped before any request was measured: the JSON says 0 requests, no plot is drawn (there
    is nothing to draw), and the exit is still 130, not a traceback."""
    import kvstrata.cli.replay_cmd as replay_cmd

    monkeypatch.setattr(replay_cmd, "sigint_handled", _stop_after(2))
    report, plot = tmp_path / "partial.json", tmp_path / "partial.png"
    args = ["replay", "-c", str(REPO / "examples" / "configs" / "demo.yaml"), "--set", "tiers.storage={}"]
    extra = ["--limit", "10", "--warmup-fraction", "0.5", "--json", str(report)]
    if importlib.util.find_spec("matplotlib") is not None:
        extra += ["--plot", str(plot)]
    result = CliRunner().invoke(app, [*args, *extra])
    assert result.exit_code == 130, result.output
    assert "Traceback" not in result.output and "interrupted after 2 of 10" in result.output
    assert json.loads(report.read_text())["requests"] == 0
    assert not plot.exists()
