"""Fault matrix: a real Mooncake master SIGSTOPped and SIGCONTed, killed and restarted (by PID)
while ``kvstrata replay`` runs against it.

What must hold: the replay keeps serving from L1/L2 while the master is gone (requests are
replayed during the outage: the RPC deadlines and the circuit breaker keep a dead tier off the
request path), ends within its deadline (no hang, including the close of a client whose master is
stopped), serves 0 corrupt pages, counts the failed operations, exits 1 with the summary (0 with
``--tolerate-failures``), and prints the outage as a few collapsed lines, not thousands. The
in-process halves (deadlines, breaker state, read-back after recovery, no leaked host slot) are
``test_mooncake_backend.py::test_stopped_master_opens_the_breaker_then_recovers`` and
``test_storage_breaker.py``.
"""

from __future__ import annotations

import json
import os
import signal
import uuid
from pathlib import Path

import pytest
from fault_support import FollowedRun, write_stack, write_trace

from kvstrata.testing.mooncake_servers import MooncakeMaster

pytestmark = [pytest.mark.faults, pytest.mark.mooncake]

#: The whole replay, outage included, must end within this (a hang fails the test here).
RUN_DEADLINE_S = 150
#: Lines of native Mooncake output one outage may print (it printed thousands before).
MAX_NATIVE_LINES = 80


def mooncake_stack(tmp_path: Path, master: MooncakeMaster) -> Path:
    storage = {
        "l3": {
            "type": "mooncake",
            "master": master.address,
            "metadata_server": master.metadata_url,
            "segment_bytes": 256 << 20,
            "local_buffer_bytes": 0,
            "rpc_timeout_s": 1,
            "connect_timeout_s": 1,
            "circuit_breaker": {"failures": 2, "cooldown_s": 1},
        }
    }
    return write_stack(tmp_path / "stack.yaml", name=f"faults-{uuid.uuid4().hex[:8]}", storage=storage)


def native_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line[:1] in "IWEF" and line[1:5].isdigit()]


@pytest.mark.parametrize("outage", ["sigstop", "kill_and_restart"])
def test_master_outage_mid_replay(outage: str, tmp_path: Path) -> None:
    master = MooncakeMaster(log_dir=tmp_path, client_ttl_s=120).start()
    pid = master.process.pid
    assert pid is not None
    stopped = False
    tolerate = ["--tolerate-failures"] if outage == "kill_and_restart" else []
    trace = write_trace(tmp_path / "trace.jsonl", conversations=300, turns=5)
    out = tmp_path / "result.json"
    try:
        run = FollowedRun(
            "replay", trace, "-c", mooncake_stack(tmp_path, master), "--json", out, *tolerate, cwd=tmp_path
        )
        run.wait_until(lambda: run.replayed() >= 200, 90, "200 requests replayed before the outage")
        if outage == "sigstop":
            os.kill(pid, signal.SIGSTOP)
            stopped = True
        else:
            os.kill(pid, signal.SIGKILL)
            master.process.popen.wait(timeout=10)  # type: ignore[union-attr]
        at_outage = run.replayed()
        run.wait_until(
            lambda: run.replayed() >= at_outage + 200, 60, "200 requests replayed during the outage"
        )
        if outage == "sigstop":
            os.kill(pid, signal.SIGCONT)
            stopped = False
        else:
            master.process.start()  # the same ports: the client's reconnects find it
        code, _, stderr = run.finish(RUN_DEADLINE_S)
    finally:
        if stopped:
            os.kill(pid, signal.SIGCONT)
        master.stop()
    assert "Traceback" not in stderr
    result = json.loads(out.read_text())
    assert result["requests"] == 1500 and result["corrupt_pages_served"] == 0
    assert result["failures"] > 0, "the outage's failed operations are counted"
    if tolerate:
        assert code == 0, stderr
        assert "tolerated (--tolerate-failures):" in stderr
    else:
        assert code == 1, stderr
        assert "operations FAILED" in stderr.splitlines()[-1]
    assert len(native_lines(stderr)) <= MAX_NATIVE_LINES, stderr
