"""Replay result: exact JSON keys, recorder arithmetic, summary rendering and the plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from kvstrata.replay.report import ReplayRecorder, plot_hit_rates, render_summary
from replay_contract import REQUIRED_JSON_KEYS


def recorded() -> ReplayRecorder:
    rec = ReplayRecorder(warmup_requests=1)
    rec.record_request(1000, device=1000)  # warm-up: ignored
    rec.record_request(100, device=20, host=30, storage=10)
    rec.record_request(300, device=0, host=0, storage=0)
    rec.add_bytes("host_to_device", 4096)
    rec.add_bytes("storage_to_host", 512)
    rec.add_latency("match", 0.001)
    rec.add_latency("match", 0.003)
    rec.add_failure("storage_put")
    rec.add_corrupt(detected=2)
    return rec


def test_json_has_exactly_the_contract_keys() -> None:
    result, _ = recorded().finish(wall_s=2.0)
    data = json.loads(result.to_json())
    assert set(data) == REQUIRED_JSON_KEYS
    assert set(data["hit_rate"]) == {"device", "host", "storage", "total"}
    assert set(data["bytes"]) == {"device_to_host", "host_to_device", "host_to_storage", "storage_to_host"}


def test_recorder_arithmetic() -> None:
    result, details = recorded().finish(wall_s=2.0)
    assert (result.requests, result.tokens) == (2, 400)
    assert result.hit_rate.device == pytest.approx(20 / 400)
    assert result.hit_rate.host == pytest.approx(30 / 400)
    assert result.hit_rate.storage == pytest.approx(10 / 400)
    assert result.hit_rate.total == pytest.approx(60 / 400)
    assert result.bytes.host_to_device == 4096 and result.bytes.storage_to_host == 512
    assert (result.failures, result.corrupt_pages_detected, result.corrupt_pages_served) == (1, 2, 0)
    assert result.tokens_per_s == pytest.approx(200.0)
    assert details.warmup_requests == 1
    assert details.latencies["match"].count == 2
    assert details.latencies["match"].p50_ms == pytest.approx(2.0)
    assert details.timeline_hits["host"] == [30, 0]


def test_recorder_rejects_inconsistent_input() -> None:
    rec = ReplayRecorder()
    with pytest.raises(ValueError, match="inconsistent hits"):
        rec.record_request(10, device=8, host=5)
    with pytest.raises(ValueError, match="unknown direction"):
        rec.add_bytes("device_to_storage", 1)  # type: ignore[arg-type]


def test_summary_shows_tiers_and_corruption_counters() -> None:
    result, details = recorded().finish(wall_s=2.0, baseline_hit_rate=0.2, baseline_label="simulator")
    console = Console(record=True, width=120)
    render_summary(result, details, console)
    text = console.export_text()
    for needle in (
        "device",
        "host",
        "storage",
        "15.00%",
        "corrupt_pages_served",
        "storage_put: 1",
        "simulator",
    ):
        assert needle in text


def test_plot_writes_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    _, details = recorded().finish(wall_s=1.0)
    path = plot_hit_rates(details, tmp_path / "hits.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    _, details = recorded().finish(wall_s=1.0)
    with pytest.raises(Exception, match=r"pip install 'kvstrata\[plot\]'"):
        plot_hit_rates(details, tmp_path / "hits.png")
