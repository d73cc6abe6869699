"""Fault matrix: a backend raising in its worker threads, and the noise of an outage (issue 15,
defect 8: one outage printed 7,246 warning lines).

What must hold: repeated warnings from one place are printed at most ``burst`` times per interval,
the next printed one says how many were held back, the run ends with a summary; native lines
(glog, written by C++ straight to file descriptor 2) get the same treatment, and what was written
before a ``kill -9`` still comes out. A backend raising on every call (the labelled fault
injector, ``kvstrata.testing.faults``) fails only its operations: the replay finishes, counts
them, exits 1 (0 with ``--tolerate-failures``) and serves 0 corrupt pages.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from fault_support import REPO, replay_json, write_stack, write_trace

from kvstrata.replay.noise import RepeatFilter, RepeatLimiter

pytestmark = pytest.mark.faults


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_limiter_prints_a_burst_per_interval_then_reports_what_it_held() -> None:
    clock = Clock()
    limiter = RepeatLimiter(interval_s=10, burst=2, clock=clock)
    answers = [limiter.admit("a", f"line {i}") for i in range(5)]
    assert [printed for printed, _, _ in answers] == [True, True, False, False, False]
    assert limiter.admit("b", "other place")[0], "places are limited apart"
    clock.now = 12.0
    assert limiter.admit("a", "line 5") == (True, 3, 12.0)
    assert limiter.admit("a", "line 6") == (True, 0, 0.0)
    assert not limiter.admit("a", "line 7")[0]
    assert limiter.summary() == [
        "4 repeated lines held back from 1 place; most frequent:",
        "  4 more like: line 0",
    ]


def test_limiter_with_interval_zero_prints_everything() -> None:
    limiter = RepeatLimiter(interval_s=0, burst=1, clock=Clock())
    assert all(limiter.admit("a", "x")[0] for _ in range(50)) and limiter.summary() == []


def test_repeated_warnings_of_one_logging_call_collapse() -> None:
    clock = Clock()
    logger = logging.getLogger("kvstrata.test_noise")
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    handler.addFilter(RepeatFilter(RepeatLimiter(interval_s=5, burst=3, clock=clock)))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)

    def put_failed(i: int) -> None:
        logger.warning("put failed: key %d", i)  # one place, whatever the key

    try:
        for i in range(1000):
            put_failed(i)
            if i % 100 == 0:
                logger.warning("breaker open")  # another place
            if i < 2:
                logger.info("info %d is not limited", i)
        clock.now = 6.0
        put_failed(1000)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
    puts = [m for m in seen if m.startswith("put failed")]
    assert puts[:3] == ["put failed: key 0", "put failed: key 1", "put failed: key 2"]
    assert puts[3:] == ["put failed: key 1000 (997 more like this in the last 6 s)"]
    assert len([m for m in seen if m.startswith("breaker open")]) == 3
    assert "info 0 is not limited" in seen and "info 1 is not limited" in seen


NATIVE_WRITER = textwrap.dedent(
    """
    import os, sys
    from kvstrata.replay.noise import native_line_limiter
    with native_line_limiter(interval_s=60, burst=2):
        print("python stderr line", file=sys.stderr, flush=True)
        for i in range(500):
            os.write(2, b"E1123 20:43:29.795897 28510 client_service.cpp:308] RPC failed %d\\n" % i)
        os.write(2, b"W1123 20:43:29.795897 28510 master_client.cpp:361] Client not available\\n")
        os.write(2, b"a plain native line\\n")
        if sys.argv[1] == "kill":
            os.kill(os.getpid(), 9)
    print("after the block", file=sys.stderr)
    """
)


@pytest.mark.parametrize("end", ["normal", "kill"])
def test_native_glog_lines_are_collapsed_and_survive_a_kill_minus_9(end: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run(
        [sys.executable, "-c", NATIVE_WRITER, end], capture_output=True, text=True, env=env, timeout=60
    )
    lines = proc.stderr.splitlines()
    rpc = [line for line in lines if "client_service.cpp:308]" in line and "more like" not in line]
    assert [line.rsplit(" ", 1)[1] for line in rpc] == ["0", "1"], proc.stderr
    assert any("master_client.cpp:361] Client not available" in line for line in lines)
    assert "a plain native line" in lines and "python stderr line" in lines
    assert "native log: 498 repeated lines held back from 1 place; most frequent:" in lines
    if end == "kill":
        assert proc.returncode == -signal.SIGKILL and "after the block" not in lines
    else:
        assert proc.returncode == 0 and lines[-1] == "after the block"


FAULTS_DIST = {"kvstrata.storage_backends": {"faults": "kvstrata.testing.faults:FaultyBackend"}}


def test_a_backend_raising_on_every_call_fails_its_operations_quietly(
    make_distribution: Any, tmp_path: Path
) -> None:
    """The labelled fault injector installed as a plugin (an entry point of a fake distribution),
    its breaker disabled so every one of hundreds of calls raises in a worker thread."""
    site = make_distribution("kvstrata-fault-injector", "0", FAULTS_DIST, {})
    storage = {"broken": {"type": "faults", "fail": "raise", "circuit_breaker": {"failures": 0}}}
    stack = write_stack(tmp_path / "stack.yaml", storage=storage)
    trace = write_trace(tmp_path / "trace.jsonl", conversations=8, turns=5)
    proc, result = replay_json(tmp_path, stack, trace, site=site)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert result is not None and result["requests"] == 40 and result["corrupt_pages_served"] == 0
    # each request's existence query and its write raise: one failure per failed call
    assert result["failures"] >= 2 * result["requests"], "every failed call is counted"
    assert result["hit_rate"]["device"] + result["hit_rate"]["host"] > 0, "L1/L2 kept serving"
    warnings = [
        line for line in proc.stderr.splitlines() if line.startswith("warning: ") and "failed" in line
    ]
    assert 0 < len(warnings) <= 3 * 3, f"{len(warnings)} warning lines:\n{proc.stderr}"
    summary = [line for line in proc.stderr.splitlines() if line.startswith("warnings: ")]
    assert summary and "repeated lines held back" in summary[0]
    held = int(summary[0].split()[1].replace(",", ""))
    last = proc.stderr.splitlines()[-1]
    assert "operations FAILED" in last
    backend_errors = re.search(r"backend_errors ([\d,]+)", last)
    assert backend_errors is not None, last
    errors = int(backend_errors.group(1).replace(",", ""))
    assert errors >= 50 and held + len(warnings) == errors, "each failed call is printed or counted"

    tolerated, _ = replay_json(tmp_path, stack, trace, "--tolerate-failures", label="t", site=site)
    assert tolerated.returncode == 0, tolerated.stderr
