"""Mooncake FAST'25 request traces (JSONL): parsing and validation.

Each line is ``{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}`` with one
remapped prefix-block id per ``block_size`` tokens. We validate every line up front because a replay
that silently skips or misreads a request reports hit rates that look plausible and are wrong.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from kvstrata.plugins.errors import KvstrataError

#: Token count of one hash block in the published Mooncake traces.
MOONCAKE_BLOCK_SIZE = 512

_REQUIRED_KEYS = ("timestamp", "input_length", "output_length", "hash_ids")


class TraceError(KvstrataError):
    """A trace file is missing or a line is malformed; the message names file and line number."""

    def __init__(self, path: str, line: int | None, reason: str) -> None:
        self.path, self.line, self.reason = path, line, reason
        where = f"{path}:{line}" if line is not None else path
        super().__init__(f"bad trace {where}: {reason}")


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace; ``hash_ids[i]`` names the prefix up to the end of block ``i``."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def block_tokens(self, block_size: int) -> list[int]:
        """Token count of each block: all full except the last, which has its real length."""
        n = len(self.hash_ids)
        return [block_size] * (n - 1) + [self.input_length - block_size * (n - 1)]


def sample_trace_path() -> Path:
    """The bundled sample (first 300 requests of the conversation trace; see data/README.md)."""
    return Path(str(resources.files("kvstrata.replay") / "data" / "sample_trace.jsonl"))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_request(line: str, block_size: int = MOONCAKE_BLOCK_SIZE) -> TraceRequest:
    """Parse and validate one JSONL line; raises ``ValueError`` with the reason (no location)."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in _REQUIRED_KEYS if k not in obj]
    if missing:
        raise ValueError(f"missing key(s) {', '.join(missing)}")
    ts = obj["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts) or ts < 0:
        raise ValueError(f"timestamp must be a non-negative number of ms, got {ts!r}")
    n_in, n_out = obj["input_length"], obj["output_length"]
    if not _is_int(n_in) or n_in < 1:
        raise ValueError(f"input_length must be a positive integer, got {n_in!r}")
    if not _is_int(n_out) or n_out < 0:
        raise ValueError(f"output_length must be a non-negative integer, got {n_out!r}")
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or not ids:
        raise ValueError("hash_ids must be a non-empty list of integers")
    bad = next((x for x in ids if not _is_int(x) or x < 0), None)
    if bad is not None:
        raise ValueError(f"hash_ids must hold non-negative integers, found {bad!r}")
    expected = -(-n_in // block_size)
    if len(ids) != expected:
        raise ValueError(
            f"{len(ids)} hash_ids for input_length {n_in} with block size {block_size} "
            f"(expected ceil({n_in}/{block_size}) = {expected}); wrong --block-size?"
        )
    return TraceRequest(float(ts), n_in, n_out, tuple(ids))


def iter_trace(
    path: str | Path | None = None, *, limit: int | None = None, block_size: int = MOONCAKE_BLOCK_SIZE
) -> Iterator[TraceRequest]:
    """Stream requests from ``path`` (the bundled sample when None), validating every line.

    Blank lines are skipped; timestamps must not decrease (the format is sorted by arrival).
    """
    if limit is not None and limit < 0:
        raise TraceError(str(path), None, f"limit must be >= 0, got {limit}")
    if block_size < 1:
        raise TraceError(str(path), None, f"block size must be >= 1, got {block_size}")
    source = Path(path) if path is not None else sample_trace_path()
    try:
        handle = source.open(encoding="utf-8")
    except OSError as exc:
        raise TraceError(str(source), None, f"cannot open: {exc.strerror or exc}") from None
    emitted = 0
    last_ts = -math.inf
    with handle:
        for lineno, line in enumerate(handle, start=1):
            if limit is not None and emitted >= limit:
                return
            if not line.strip():
                continue
            try:
                request = parse_request(line, block_size)
            except ValueError as exc:
                raise TraceError(str(source), lineno, str(exc)) from None
            if request.timestamp_ms < last_ts:
                raise TraceError(
                    str(source),
                    lineno,
                    f"timestamp {request.timestamp_ms:g} is before the previous line's {last_ts:g}"
                    " (traces must be sorted by arrival)",
                )
            last_ts = request.timestamp_ms
            emitted += 1
            yield request
    if emitted == 0 and limit != 0:
        raise TraceError(str(source), None, "no requests in trace")


def read_trace(
    path: str | Path | None = None, *, limit: int | None = None, block_size: int = MOONCAKE_BLOCK_SIZE
) -> list[TraceRequest]:
    """Read a whole trace into memory (the largest published one is a few MB)."""
    return list(iter_trace(path, limit=limit, block_size=block_size))
