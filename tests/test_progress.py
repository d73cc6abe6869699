"""Progress of long CLI runs when the output is not a terminal: plain lines, one at the end."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from kvstrata.progress import INTERVAL_ENV, progress
from kvstrata.replay.simulate import simulate
from kvstrata.replay.trace import TraceRequest


def _piped() -> Console:
    return Console(file=io.StringIO(), force_terminal=False, width=200)


def test_the_completion_line_is_printed_once_however_often_the_end_is_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``simulate`` reports every 256th request and the end: a trace of a multiple of 256
    requests reported its end twice, and the piped output said "simulated 256/256 requests
    (100%)" twice."""
    monkeypatch.setenv(INTERVAL_ENV, "3600")
    console = _piped()
    requests = [
        TraceRequest(timestamp_ms=i, input_length=512, output_length=1, hash_ids=(i,)) for i in range(256)
    ]
    with progress(console, "simulated", len(requests)) as update:
        simulate(requests, progress=lambda n: update(n, len(requests)))
    lines = console.file.getvalue().splitlines()  # type: ignore[attr-defined]
    assert [line.split(",")[0] for line in lines] == ["simulated 256/256 requests (100%)"]


def test_piped_progress_prints_a_line_per_interval_with_an_eta(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(INTERVAL_ENV, "0")
    console = _piped()
    with progress(console, "replayed", 4) as update:
        for done in range(1, 5):
            update(done, 4)
    lines = console.file.getvalue().splitlines()  # type: ignore[attr-defined]
    assert len(lines) == 4 and "ETA" in lines[0] and lines[-1].startswith("replayed 4/4 requests (100%), in ")
