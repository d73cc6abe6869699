"""Trace parsing: the bundled sample loads; every kind of bad line names its line number."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstrata.replay.trace import TraceError, TraceRequest, iter_trace, read_trace, sample_trace_path

GOOD = {"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [1, 2]}


def write(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_bundled_sample_loads_and_is_consistent() -> None:
    requests = read_trace()
    assert len(requests) == 300
    assert sample_trace_path().is_file()
    for r in requests:
        assert len(r.hash_ids) == -(-r.input_length // 512)
        assert sum(r.block_tokens(512)) == r.input_length
    assert [r.timestamp_ms for r in requests] == sorted(r.timestamp_ms for r in requests)


def test_limit_and_blank_lines(tmp_path: Path) -> None:
    path = write(tmp_path, [json.dumps(GOOD), "", json.dumps({**GOOD, "timestamp": 3})])
    assert len(read_trace(path)) == 2
    assert read_trace(path, limit=1) == [TraceRequest(0.0, 1000, 5, (1, 2))]
    assert read_trace(None, limit=7)[-1] == read_trace()[6]


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        (json.dumps({k: v for k, v in GOOD.items() if k != "hash_ids"}), "missing key(s) hash_ids"),
        (json.dumps({**GOOD, "input_length": 0}), "input_length must be a positive integer"),
        (json.dumps({**GOOD, "input_length": 10.5}), "input_length must be a positive integer"),
        (json.dumps({**GOOD, "output_length": -1}), "output_length"),
        (json.dumps({**GOOD, "timestamp": -5}), "timestamp"),
        (json.dumps({**GOOD, "hash_ids": []}), "non-empty list"),
        (json.dumps({**GOOD, "hash_ids": [1, "x"]}), "non-negative integers"),
        (json.dumps({**GOOD, "hash_ids": [1, 2, 3]}), "expected ceil(1000/512) = 2"),
    ],
)
def test_bad_line_names_line_number(tmp_path: Path, bad: str, reason: str) -> None:
    path = write(tmp_path, [json.dumps(GOOD), json.dumps(GOOD), bad])
    with pytest.raises(TraceError) as info:
        read_trace(path)
    assert info.value.line == 3
    assert f"{path}:3:" in str(info.value)
    assert reason in str(info.value)


def test_unsorted_timestamps_rejected(tmp_path: Path) -> None:
    path = write(tmp_path, [json.dumps({**GOOD, "timestamp": 10}), json.dumps({**GOOD, "timestamp": 9})])
    with pytest.raises(TraceError, match=r":2: timestamp 9 is before the previous line's 10"):
        read_trace(path)


def test_block_size_mismatch_hint(tmp_path: Path) -> None:
    path = write(tmp_path, [json.dumps(GOOD)])
    assert read_trace(path, block_size=500)[0].block_tokens(500) == [500, 500]
    with pytest.raises(TraceError, match="wrong --block-size"):
        read_trace(path, block_size=256)


def test_missing_and_empty_files(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot open"):
        read_trace(tmp_path / "nope.jsonl")
    with pytest.raises(TraceError, match="no requests"):
        read_trace(write(tmp_path, [""]))


def test_streaming_stops_at_limit_before_bad_line(tmp_path: Path) -> None:
    path = write(tmp_path, [json.dumps(GOOD), "garbage"])
    assert len(list(iter_trace(path, limit=1))) == 1
