"""Fault matrix: a failing disk, damaged and forged objects, through ``kvstrata replay`` in fresh
processes (issue 15, defect 4: a run that failed operations or served corrupt pages must not
exit 0).

What must hold:

- disk full / file-size limit: no crash, failures counted and summarised, exit 1 unless
  ``--tolerate-failures``, 0 corrupt pages served, the user's file in the L3 directory untouched;
- bit flips and headers downgraded to "no checksum" (policy ``xxh3``): every damaged object is a
  counted miss, 0 corrupt pages served, exit 0;
- the same damage with ``policy.checksum: none`` (nothing can detect it in the store): the replay's
  own byte check catches the served pages, prints a loud line and exits 3, with or without
  ``--tolerate-failures``.
"""

from __future__ import annotations

import resource
from pathlib import Path

import pytest
from fault_support import error_lines, file_l3, object_files, replay_json, write_stack, write_trace

pytestmark = pytest.mark.faults

#: Bytes a process may write per file: the JSON result fits, no 32 KiB page object does.
FILE_SIZE_LIMIT = 8192


def _limit_file_size() -> None:  # runs in the child between fork and exec
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE_LIMIT, FILE_SIZE_LIMIT))


def test_a_disk_that_refuses_writes_is_counted_summarised_and_exits_1(tmp_path: Path) -> None:
    l3 = tmp_path / "l3"
    l3.mkdir()
    user_file = l3 / "notes.txt"
    user_file.write_text("the user's own file")
    stack = write_stack(tmp_path / "stack.yaml", storage=file_l3(l3, capacity_bytes=1 << 30))
    trace = write_trace(tmp_path / "trace.jsonl", conversations=3, turns=3)

    proc, result = replay_json(tmp_path, stack, trace, preexec_fn=_limit_file_size)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert result is not None and result["failures"] > 0 and result["corrupt_pages_served"] == 0
    last = error_lines(proc)[-1]
    assert "operations FAILED" in last and "put_failed" in last and "--tolerate-failures" in last
    assert user_file.read_text() == "the user's own file"
    assert object_files(l3) == [], "no object was stored"

    tolerated, again = replay_json(
        tmp_path, stack, trace, "--tolerate-failures", label="t", preexec_fn=_limit_file_size
    )
    assert tolerated.returncode == 0, tolerated.stderr
    assert "tolerated (--tolerate-failures):" in tolerated.stderr and "operations FAILED" in tolerated.stderr
    assert again is not None and again["failures"] == result["failures"]


def _damage(objects: list[Path]) -> None:
    """Even objects: one payload bit flipped. Odd ones: the header downgraded to declare no
    checksum (kind and value zeroed), then a payload byte changed -- the forged-object attack."""
    for index, path in enumerate(objects):
        raw = bytearray(path.read_bytes())
        if index % 2:
            raw[6:8] = bytes(2)
            raw[40:48] = bytes(8)
            raw[64 + 100] ^= 0x5A
        else:
            raw[64 + 1000] ^= 0x01
        path.write_bytes(bytes(raw))


def test_flipped_and_forged_objects_are_counted_misses_never_served(tmp_path: Path) -> None:
    l3 = tmp_path / "l3"
    stack = write_stack(tmp_path / "stack.yaml", storage=file_l3(l3))
    trace = write_trace(tmp_path / "trace.jsonl", conversations=3, turns=3)
    first, _ = replay_json(tmp_path, stack, trace, label="first")
    assert first.returncode == 0, first.stderr
    objects = object_files(l3)
    assert len(objects) >= 8
    _damage(objects)

    second, result = replay_json(tmp_path, stack, trace, label="second")
    assert second.returncode == 0, second.stderr
    assert result is not None
    assert result["corrupt_pages_served"] == 0
    assert result["corrupt_pages_detected"] >= 2, "the first object of each conversation was read"
    assert result["hit_rate"]["storage"] == 0.0, "no damaged object counts as a hit"
    assert result["failures"] == 0, "a refused object is a miss, not a failed operation"


def test_served_corruption_is_a_loud_line_and_exit_3_never_tolerated(tmp_path: Path) -> None:
    """With no checksum in the store, damage reaches the engine: the replay's byte check is the
    last line of defence, and it must say so loudly and fail the run."""
    l3 = tmp_path / "l3"
    stack = write_stack(tmp_path / "stack.yaml", storage=file_l3(l3), checksum="none")
    trace = write_trace(tmp_path / "trace.jsonl", conversations=3, turns=3)
    first, _ = replay_json(tmp_path, stack, trace, label="first")
    assert first.returncode == 0, first.stderr
    for path in object_files(l3):
        raw = bytearray(path.read_bytes())
        raw[64 + 1000] ^= 0x01
        path.write_bytes(bytes(raw))

    for extra in ([], ["--tolerate-failures"]):
        proc, result = replay_json(tmp_path, stack, trace, *extra, label="second")
        assert proc.returncode == 3, proc.stderr
        assert result is not None and result["corrupt_pages_served"] > 0
        last = error_lines(proc)[-1]
        assert last.startswith(
            f"error: CORRUPT DATA SERVED: {result['corrupt_pages_served']:,} restored pages"
        )
        assert "Traceback" not in proc.stderr
