"""The shared request traces for tests: found, or the test is skipped naming where it looked."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

TRACE_DIR_ENV = "KVSTRATA_TRACE_DIR"
REPO = Path(__file__).resolve().parents[1]


def full_trace(name: str) -> Path:
    """Path of ``name`` (e.g. conversation_trace.jsonl), or skip naming where it was looked for."""
    candidates = [Path(os.environ[TRACE_DIR_ENV])] if os.environ.get(TRACE_DIR_ENV) else []
    candidates += [REPO.parent / "shared" / "data" / "traces", REPO.parents[1] / "shared" / "data" / "traces"]
    for directory in candidates:
        if (directory / name).is_file():
            return directory / name
    pytest.skip(f"{name} not found in {', '.join(map(str, candidates))}; set {TRACE_DIR_ENV}")
