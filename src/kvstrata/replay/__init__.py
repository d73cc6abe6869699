"""Trace replay: Mooncake-format traces, deterministic tokens and page content, a reference
hit-rate simulator and the result report. Nothing here depends on the tier controller, so the
simulator is an independent baseline for the replay's measured hit rates.
"""

from __future__ import annotations

from kvstrata.replay.trace import (
    MOONCAKE_BLOCK_SIZE,
    TraceError,
    TraceRequest,
    iter_trace,
    read_trace,
    sample_trace_path,
)

__all__ = [
    "MOONCAKE_BLOCK_SIZE",
    "TraceError",
    "TraceRequest",
    "iter_trace",
    "read_trace",
    "sample_trace_path",
]
