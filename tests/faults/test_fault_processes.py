"""Fault matrix: processes dying and competing over one file L3, end to end.

What must hold:

- ``kill -9`` of a replay mid-run (its L3 writer thread busy putting objects): the next process on
  the same directory serves 0 corrupt pages, refuses no torn object, trips on none of the dead writer's
  leftovers and exits 0; the user's file in the directory is untouched. (The deterministic
  mid-``put`` kill of one writer is ``test_storage_file_backend.py::
  test_kill_minus_9_writer_leaves_a_temp_file_the_next_open_sweeps``.)
- two processes writing the same keys at once: both exit 0 with 0 corrupt pages; a third process
  is served from what they stored, bit exact.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from fault_support import FollowedRun, file_l3, object_files, popen_cli, replay_json, write_stack, write_trace

pytestmark = pytest.mark.faults


def test_kill_minus_9_mid_replay_leaves_nothing_the_next_process_trips_on(tmp_path: Path) -> None:
    l3 = tmp_path / "l3"
    l3.mkdir()
    (l3 / "README.txt").write_text("user file")
    stack = write_stack(tmp_path / "stack.yaml", storage=file_l3(l3, stale_temp_s=3600))
    trace = write_trace(tmp_path / "trace.jsonl", conversations=200, turns=4)
    run = FollowedRun("replay", trace, "-c", stack, cwd=tmp_path)
    run.wait_until(lambda: run.replayed() >= 150, 90, "150 requests replayed")
    os.kill(run.proc.pid, signal.SIGKILL)
    code, _, _ = run.finish(30)
    assert code == -signal.SIGKILL
    stored = object_files(l3)
    assert stored, "the killed run had stored objects"

    proc, result = replay_json(tmp_path, stack, trace, "--limit", "400")
    assert proc.returncode == 0, proc.stderr
    assert result is not None
    assert result["corrupt_pages_served"] == 0 and result["corrupt_pages_detected"] == 0
    assert result["hit_rate"]["storage"] > 0, "the dead process's objects are served"
    assert (l3 / "README.txt").read_text() == "user file"


def test_two_processes_writing_the_same_keys_then_a_third_reads_them(tmp_path: Path) -> None:
    l3 = tmp_path / "l3"
    stack = write_stack(tmp_path / "stack.yaml", storage=file_l3(l3))
    trace = write_trace(tmp_path / "trace.jsonl", conversations=40, turns=4)
    runs = [
        popen_cli("replay", trace, "-c", stack, "--json", tmp_path / f"w{i}.json", cwd=tmp_path)
        for i in range(2)
    ]
    for run in runs:
        _, err = run.communicate(timeout=180)
        assert run.returncode == 0, err
    for i in range(2):
        result = (tmp_path / f"w{i}.json").read_text()
        assert '"corrupt_pages_served": 0' in result and '"failures": 0' in result

    proc, result = replay_json(tmp_path, stack, trace, label="reader")
    assert proc.returncode == 0, proc.stderr
    assert result is not None
    assert result["corrupt_pages_served"] == 0 and result["corrupt_pages_detected"] == 0
    assert result["hit_rate"]["storage"] > 0.5, result["hit_rate"]  # 0.94 unloaded
