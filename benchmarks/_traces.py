"""Where the benchmarks find the shared request traces (one place for every script)."""

from __future__ import annotations

import os
from pathlib import Path


def find_trace(name: str) -> Path:
    """``$KVSTRATA_TRACE_DIR/name``, else ``shared/data/traces/name`` beside or above the repo."""
    env = os.environ.get("KVSTRATA_TRACE_DIR")
    repo = Path(__file__).resolve().parents[1]
    candidates = (
        [Path(env)] if env else [repo.parent / "shared/data/traces", repo.parents[1] / "shared/data/traces"]
    )
    for candidate in candidates:
        if (candidate / name).is_file():
            return candidate / name
    raise SystemExit(f"{name} not found: set KVSTRATA_TRACE_DIR to the folder holding the traces")
