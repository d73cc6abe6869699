"""Mooncake FAST'25 request traces (JSONL): parsing and validation.

Each line is ``{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}`` with one
remapped prefix-block id per ``block_size`` tokens. We validate every line up front because a replay
that silently skips or misreads a request reports hit rates that look plausible and are wrong.

A trace is input from outside, so reading it is bounded: a line is read up to the length the
longest allowed request can need (``max_request_tokens``), then decoded as strict UTF-8, parsed,
and each field checked (hash ids are unsigned 64-bit; a larger one would otherwise be cut to 64 bits
and alias another block). Every refusal is a :class:`TraceError` naming the file and line.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import BinaryIO

from kvstrata.core.config import DEFAULT_MAX_REQUEST_TOKENS
from kvstrata.plugins.errors import KvstrataError

#: Token count of one hash block in the published Mooncake traces.
MOONCAKE_BLOCK_SIZE = 512

#: Where the bound on request length is set (the replay's config key, the simulator's option).
_BOUND = "model.max_request_tokens / --max-request-tokens"

#: Hash ids are unsigned 64-bit integers.
HASH_ID_LIMIT = 1 << 64

#: Bytes a line may take per hash id (up to 20 digits, a comma, spaces) ...
_LINE_BYTES_PER_ID = 24
#: ... plus this much for the other keys, whitespace and extra fields.
_LINE_BYTES_SLACK = 64 * 1024

_REQUIRED_KEYS = ("timestamp", "input_length", "output_length", "hash_ids")

#: The first bytes of a gzip file (a trace kept compressed).
_GZIP_MAGIC = b"\x1f\x8b"


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


def line_limit(max_request_tokens: int, block_size: int = MOONCAKE_BLOCK_SIZE) -> int:
    """Longest line (bytes) a request of at most ``max_request_tokens`` tokens can need."""
    return _LINE_BYTES_PER_ID * -(-max_request_tokens // block_size) + _LINE_BYTES_SLACK


def _show(value: object) -> str:
    """``repr`` of a bad value, shortened: a line may hold a number with thousands of digits."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} characters)"


def _json_problem(line: str, exc: json.JSONDecodeError) -> str:
    """Why a line is not JSON, in words: a line cut short (a copy or a writer that stopped) is
    said to be truncated, with its length, instead of a column that points at its start."""
    text = line.rstrip("\r\n")
    if "\x00" in text:
        return f"holds NUL bytes at column {text.index(chr(0)) + 1} (a partly written file?)"
    if exc.pos >= len(text.rstrip()) or exc.msg.startswith("Unterminated"):
        chars = f"{len(text)} character" + ("" if len(text) == 1 else "s")
        return f"truncated: the line ends (after {chars}) before its JSON object does"
    return f"not valid JSON: {exc.msg} at column {exc.colno}"


def _ms(value: float) -> str:
    """A timestamp as written: whole ms without a fraction, never cut to 6 digits (``:g`` printed
    3537002 and 3537001 alike)."""
    return str(int(value)) if value.is_integer() and value < 1e15 else repr(value)


def _finite(value: int | float) -> bool:
    """Whether a JSON number is a finite float (an integer beyond float range is not a time)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def parse_request(
    line: str, block_size: int = MOONCAKE_BLOCK_SIZE, max_request_tokens: int = DEFAULT_MAX_REQUEST_TOKENS
) -> TraceRequest:
    """Parse and validate one JSONL line; raises ``ValueError`` with the reason (no location)."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(_json_problem(line, exc)) from None
    except RecursionError:
        raise ValueError("JSON nested too deeply (a request is one flat object)") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in _REQUIRED_KEYS if k not in obj]
    if missing:
        raise ValueError(f"missing key(s) {', '.join(missing)}")
    ts = obj["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not _finite(ts) or ts < 0:
        raise ValueError(f"timestamp must be a non-negative number of ms, got {_show(ts)}")
    n_in, n_out = obj["input_length"], obj["output_length"]
    if not _is_int(n_in) or n_in < 1:
        raise ValueError(f"input_length must be a positive integer, got {_show(n_in)}")
    if not _is_int(n_out) or n_out < 0:
        raise ValueError(f"output_length must be a non-negative integer, got {_show(n_out)}")
    if n_in > max_request_tokens:
        raise ValueError(
            f"input_length {n_in:,} is above the longest request allowed ({max_request_tokens:,}, "
            f"{_BOUND}); raise it if requests this long are real"
        )
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or not ids:
        raise ValueError("hash_ids must be a non-empty list of integers")
    bad = next((x for x in ids if not _is_int(x) or x < 0), None)
    if bad is not None:
        raise ValueError(f"hash_ids must hold non-negative integers, found {_show(bad)}")
    big = next((x for x in ids if x >= HASH_ID_LIMIT), None)
    if big is not None:
        raise ValueError(f"hash_ids must be below 2^64 (unsigned 64-bit), found {_show(big)}")
    expected = -(-n_in // block_size)
    if len(ids) != expected:
        raise ValueError(
            f"{len(ids)} hash_ids for input_length {n_in} with block size {block_size} "
            f"(expected ceil({n_in}/{block_size}) = {expected}); wrong --block-size?"
        )
    return TraceRequest(float(ts), n_in, n_out, tuple(ids))


def _lines(handle: BinaryIO, source: Path, max_tokens: int, block_size: int) -> Iterator[tuple[int, str]]:
    """(line number, text) of each line, read at most ``max_bytes`` at a time and decoded as
    strict UTF-8: an endless or binary file is refused at its first bad line, never slurped."""
    # a bound beyond what one read can ask for (``--max-request-tokens 1e23``) is no bound
    max_bytes = min(line_limit(max_tokens, block_size), sys.maxsize - 1)
    lineno = 0
    while raw := handle.readline(max_bytes + 1):
        lineno += 1
        if lineno == 1 and raw.startswith(_GZIP_MAGIC):
            raise TraceError(str(source), 1, "gzip-compressed: decompress it first (gunzip)")
        if len(raw) > max_bytes:
            raise TraceError(
                str(source),
                lineno,
                f"line longer than {max_bytes:,} bytes, more than a request of at most "
                f"{max_tokens:,} tokens ({_BOUND}) can need",
            )
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise TraceError(
                str(source), lineno, f"not UTF-8 text (byte 0x{raw[exc.start]:02x} at column {exc.start + 1})"
            ) from None
        yield lineno, text


def iter_trace(
    path: str | Path | None = None,
    *,
    limit: int | None = None,
    block_size: int = MOONCAKE_BLOCK_SIZE,
    max_request_tokens: int = DEFAULT_MAX_REQUEST_TOKENS,
) -> Iterator[TraceRequest]:
    """Stream requests from ``path`` (the bundled sample when None), validating every line.

    Blank lines are skipped; timestamps must not decrease (the format is sorted by arrival); a
    request longer than ``max_request_tokens`` is refused.
    """
    if limit is not None and limit < 0:
        raise TraceError(str(path), None, f"limit must be >= 0, got {limit}")
    if block_size < 1:
        raise TraceError(str(path), None, f"block size must be >= 1, got {block_size}")
    if max_request_tokens < 1:
        raise TraceError(str(path), None, f"max request tokens must be >= 1, got {max_request_tokens}")
    source = Path(path) if path is not None else sample_trace_path()
    if source.is_dir():
        raise TraceError(str(source), None, "is a directory, not a trace file")
    try:
        handle = source.open("rb")
    except OSError as exc:
        raise TraceError(str(source), None, f"cannot open: {exc.strerror or exc}") from None
    emitted = 0
    last_ts = -math.inf
    if limit == 0:
        handle.close()
        return
    with handle:
        for lineno, line in _lines(handle, source, max_request_tokens, block_size):
            if not line.strip():
                continue
            try:
                request = parse_request(line, block_size, max_request_tokens)
            except ValueError as exc:  # json's own ValueErrors too (e.g. a 5,000-digit number)
                raise TraceError(str(source), lineno, str(exc)) from None
            if request.timestamp_ms < last_ts:
                raise TraceError(
                    str(source),
                    lineno,
                    f"timestamp {_ms(request.timestamp_ms)} is before the previous line's {_ms(last_ts)}"
                    " (traces must be sorted by arrival)",
                )
            last_ts = request.timestamp_ms
            emitted += 1
            yield request
            if limit is not None and emitted >= limit:
                return  # never read past the last line wanted
    if emitted == 0 and limit != 0:
        raise TraceError(str(source), None, "no requests in trace")


def read_trace(
    path: str | Path | None = None,
    *,
    limit: int | None = None,
    block_size: int = MOONCAKE_BLOCK_SIZE,
    max_request_tokens: int = DEFAULT_MAX_REQUEST_TOKENS,
) -> list[TraceRequest]:
    """Read a whole trace into memory (the largest published one is a few MB)."""
    return list(iter_trace(path, limit=limit, block_size=block_size, max_request_tokens=max_request_tokens))
