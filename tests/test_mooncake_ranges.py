"""The ``mooncake`` backend's registered-memory intervals, without a Mooncake install: a batch plan
reads them without the lock a registration holds, so a reader must never see half an update."""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

from kvstrata.storage_backends import _mooncake_memory
from kvstrata.storage_backends._mooncake_memory import _Ranges


def test_covers_and_gaps_of_merged_ranges() -> None:
    ranges = _Ranges()
    ranges.add(100, 100)
    ranges.add(300, 100)
    ranges.add(150, 100)  # merges with [100, 200): [100, 250)
    assert ranges.covers(100, 150) and ranges.covers(300, 100)
    assert not ranges.covers(150, 200) and not ranges.covers(260, 8)
    assert ranges.gaps(50, 400) == [(50, 50), (250, 50), (400, 50)]


def test_a_plan_beside_a_registration_never_calls_a_gap_registered() -> None:
    """A pool registered while the I/O thread plans a batch. A thread switch may come between any
    two bytecodes of ``add``: here a reader runs at every one of them (an opcode trace), where
    threads hit the window only now and then. Edited in place, the intervals were read with the
    starts of one version and the ends of another, and an unregistered header lying between two
    pools was called registered (Mooncake was handed memory it cannot move)."""
    ranges = _Ranges()
    for start in (100, 300, 500):
        ranges.add(start, 100)
    queries = ((150, 200), (260, 8), (450, 20))  # each spans a gap or lies in one, before and after
    wrong: list[tuple[int, int, str]] = []

    def plan() -> None:
        for ptr, nbytes in queries:
            try:
                if ranges.covers(ptr, nbytes):
                    wrong.append((ptr, nbytes, "covered"))
            except IndexError:
                wrong.append((ptr, nbytes, "IndexError"))

    def at_each_opcode(frame: FrameType, event: str, arg: Any) -> Any:
        plan()
        return at_each_opcode

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code.co_name == "add" and frame.f_code.co_filename == _mooncake_memory.__file__:
            frame.f_trace_opcodes = True
            return at_each_opcode
        return None

    before = sys.gettrace()
    sys.settrace(trace)
    try:
        for start, nbytes in ((150, 100), (420, 20), (610, 20), (50, 40)):
            ranges.add(start, nbytes)
    finally:
        sys.settrace(before)
    assert not wrong, f"regions in a gap called registered mid-update: {sorted(set(wrong))}"
    assert ranges.gaps(0, 700) == [(0, 50), (90, 10), (250, 50), (400, 20), (440, 60), (600, 10), (630, 70)]
