"""The benchmark result convention shared by every script in benchmarks/ (see README.md).

A script run as ``python benchmarks/NAME.py --json OUT`` writes
``{"name": NAME, "figures": [{"metric", "value", "unit", "baseline", "ratio"}, ...]}`` to OUT;
``baseline`` is the same metric measured for the baseline in the same run (or null when there is
none) and ``ratio = value / baseline``. Scripts import this module (``benchmarks/`` is on
``sys.path`` when they run as scripts) so the format lives in one place.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NoReturn

#: exit status of a script whose optional peer or dependency is not installed here (automake's
#: "skipped"): ``run_all.py`` lists it as skipped, with the reason, not as a failure
SKIP_EXIT = 77


@dataclass(frozen=True)
class Figure:
    """One measured number, with its baseline from the same run and what the baseline was."""

    metric: str
    value: float
    unit: str
    baseline: float | None = None
    ratio: float | None = None
    baseline_label: str | None = None  # optional: e.g. "memcpy", "raw pwrite", "paper Table 2"

    @classmethod
    def against(
        cls, metric: str, value: float, unit: str, baseline: float | None, label: str | None = None
    ) -> Figure:
        """A figure whose ratio is computed here (value / baseline), so every script agrees on it."""
        ratio = value / baseline if baseline not in (None, 0) and math.isfinite(baseline) else None
        return cls(metric, value, unit, baseline, ratio, label)


def skip(reason: str) -> NoReturn:
    """End a script that cannot run here (a peer or an optional dependency missing): the reason
    on stderr, exit status :data:`SKIP_EXIT`."""
    print(f"skipped: {reason}", file=sys.stderr, flush=True)
    raise SystemExit(SKIP_EXIT)


def write_results(path: str | Path, name: str, figures: list[Figure]) -> None:
    """Write the JSON file ``run_all.py`` reads."""
    data = {"name": name, "figures": [asdict(f) for f in figures]}
    Path(path).write_text(json.dumps(data, indent=2) + "\n")


def read_results(path: str | Path) -> dict:
    """Read and check a results file; raises ValueError naming what is wrong."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        raise ValueError(f"{path}: expected an object with a string 'name'")
    figures = data.get("figures")
    if not isinstance(figures, list):
        raise ValueError(f"{path}: 'figures' must be a list")
    for i, fig in enumerate(figures):
        missing = {"metric", "value", "unit", "baseline", "ratio"} - set(fig)
        if missing:
            raise ValueError(f"{path}: figure {i} lacks {', '.join(sorted(missing))}")
    return data
