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
        (json.dumps({**GOOD, "timestamp": 10**400}), "must be a non-negative number of ms, got 1000"),
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


# --- hostile traces (issue 15, defect 7): refused with file and line, nothing slurped -----------


def write_bytes(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "hostile.jsonl"
    path.write_bytes(data)
    return path


def test_non_utf8_line_is_named_with_its_byte(tmp_path: Path) -> None:
    path = write_bytes(tmp_path, json.dumps(GOOD).encode() + b'\n{"timestamp": 1,\xff\xfe}\n')
    with pytest.raises(TraceError) as info:
        read_trace(path)
    assert info.value.line == 2
    assert "not UTF-8 text (byte 0xff at column 17)" in str(info.value)


def test_deeply_nested_json_is_a_trace_error_not_a_recursion_error(tmp_path: Path) -> None:
    path = write(tmp_path, [json.dumps(GOOD), "[" * 50_000 + "]" * 50_000])
    with pytest.raises(TraceError, match=r":2: JSON nested too deeply"):
        read_trace(path)


def test_hash_ids_beyond_64_bits_are_refused_not_truncated(tmp_path: Path) -> None:
    """2^64 + 5 used to become 5 (the token generator keeps 64 bits), aliasing another block."""
    top = (1 << 64) - 1
    assert read_trace(write(tmp_path, [json.dumps({**GOOD, "hash_ids": [top, 5]})]))[0].hash_ids == (top, 5)
    path = write(tmp_path, [json.dumps({**GOOD, "hash_ids": [(1 << 64) + 5, 5]})])
    with pytest.raises(
        TraceError, match=r":1: hash_ids must be below 2\^64 \(unsigned 64-bit\), found 18446744073709551621"
    ):
        read_trace(path)
    huge = write(
        tmp_path,
        ['{"timestamp": 0, "input_length": 1000, "output_length": 1, "hash_ids": [1, %s]}' % ("9" * 3000)],
    )
    with pytest.raises(TraceError, match=r"below 2\^64.*\(3000 characters\)"):
        read_trace(huge)


def test_request_longer_than_the_bound_is_refused_at_read(tmp_path: Path) -> None:
    path = write(tmp_path, [json.dumps({**GOOD, "input_length": 4096, "hash_ids": list(range(8))})])
    assert read_trace(path, max_request_tokens=4096)[0].input_length == 4096
    with pytest.raises(TraceError, match=r"input_length 4,096 is above the longest request allowed \(4,095"):
        read_trace(path, max_request_tokens=4095)


def test_a_bound_too_large_for_one_read_reads_the_trace(tmp_path: Path) -> None:
    """``--max-request-tokens 99999999999999999999999`` (or ``model.max_request_tokens`` in a
    config: neither has an upper bound) was an ``OverflowError`` traceback from the line reader in
    ``simulate`` and ``replay``; a bound no read can reach is no bound."""
    path = write(tmp_path, [json.dumps({**GOOD, "input_length": 4096, "hash_ids": list(range(8))})])
    assert read_trace(path, max_request_tokens=10**23)[0].input_length == 4096


def test_a_request_of_ten_million_hash_ids_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    """A 10^7-id line (5*10^9 tokens, ~41 GB of token ids in a replay) stops at the line length a
    request within the bound can need: at most that many bytes are read."""
    ids = ", ".join(["123456789"] * 10_000_000)
    line = f'{{"timestamp": 0, "input_length": 5120000000, "output_length": 1, "hash_ids": [{ids}]}}\n'
    path = write_bytes(tmp_path, line.encode())
    with pytest.raises(
        TraceError,
        match=r":1: line longer than 114,688 bytes, more than a request of at most 1,048,576 tokens",
    ):
        read_trace(path)


def test_endless_file_without_newlines_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="line longer than"):
        read_trace("/dev/zero")


def test_a_directory_is_not_a_trace(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="is a directory"):
        read_trace(tmp_path)


def test_limit_never_reads_past_the_last_line_wanted(tmp_path: Path) -> None:
    path = write_bytes(tmp_path, json.dumps(GOOD).encode() + b"\n\xff\xff\xff\n")
    assert len(read_trace(path, limit=1)) == 1


def test_a_gzip_trace_is_named_as_compressed(tmp_path: Path) -> None:
    """A compressed trace read as 'not UTF-8 text (byte 0x8b at column 2)'."""
    import gzip

    path = write_bytes(tmp_path, gzip.compress((json.dumps(GOOD) + "\n").encode()))
    with pytest.raises(TraceError, match=r":1: gzip-compressed: decompress it first"):
        read_trace(path)


def test_unsorted_timestamps_of_a_long_trace_are_told_apart(tmp_path: Path) -> None:
    """Six significant digits printed 3537002 and 3537001 alike: 'timestamp 3.537e+06 is before the
    previous line's 3.537e+06'."""
    path = write(tmp_path, [json.dumps({**GOOD, "timestamp": t}) for t in (3_537_002, 3_537_001)])
    with pytest.raises(TraceError, match=r"timestamp 3537001 is before the previous line's 3537002"):
        read_trace(path)
    path = write(tmp_path, [json.dumps({**GOOD, "timestamp": t}) for t in (0.25, 0.125)])
    with pytest.raises(TraceError, match=r"timestamp 0.125 is before the previous line's 0.25"):
        read_trace(path)
