"""Run every benchmark in benchmarks/ and print one markdown table of figures and ratios.

Each benchmark is a script following the convention in README.md (``--json OUT``). Scripts that
do not exist yet are listed as "not yet available"; one that exits with ``SKIP_EXIT`` (77: a peer
or an optional dependency not installed here) as "skipped" with its reason; a script that fails
is listed with its exit status and the last line of its stderr, and the others still run. The
exit status is 1 when any failed (not when some were skipped).

    python benchmarks/run_all.py [--quick] [--only NAME ...] [--json OUT] [--timeout S]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _results import SKIP_EXIT, read_results

HERE = Path(__file__).resolve().parent
#: Benchmark name -> script, in the order the table shows them.
BENCHMARKS = {
    "pools": "pools.py",
    "vllm_staging": "vllm_staging.py",
    "storage": "storage.py",
    "checksum": "checksum.py",
    "tree": "tree.py",
    "engine": "engine.py",
    "engine_calls": "engine_calls.py",
    "boundary": "boundary.py",
    "replay": "replay.py",
    "simulate": "simulate.py",
    "eviction": "eviction.py",
    "eviction_oracles": "eviction_oracles.py",
    "eviction_ceiling": "eviction_ceiling.py",
    "eviction_scale": "eviction_scale.py",
    "sglang_l3": "sglang_l3.py",
    "hf": "hf.py",
    "weights_digest": "weights_digest.py",
    "peers_storage": "peers/storage.py",
    "faults": "faults.py",
    "peers_copies": "peers/copies.py",
    "peers_lmcache": "peers/lmcache.py",
    "peers_tree": "peers/tree.py",
}


def fmt(value: object, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def run_one(name: str, script: Path, quick: bool, timeout: float) -> tuple[str, list[dict], float]:
    """Returns (status, figures, seconds)."""
    if not script.is_file():
        return "not yet available", [], 0.0
    with tempfile.TemporaryDirectory(prefix=f"kvstrata-bench-{name}-") as tmp:
        out = Path(tmp) / "results.json"
        cmd = [sys.executable, str(script), "--json", str(out), *(["--quick"] if quick else [])]
        # a source checkout works without installing: put its src/ first on the path
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parent / "src"), env.get("PYTHONPATH")]))
        start = time.perf_counter()
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=timeout, cwd=HERE.parent, env=env
            )
        except subprocess.TimeoutExpired:
            return f"timed out after {timeout:.0f} s", [], time.perf_counter() - start
        seconds = time.perf_counter() - start
        last = (proc.stderr.strip().splitlines() or ["(no stderr)"])[-1]
        if proc.returncode == SKIP_EXIT:  # a peer or optional dependency not installed here
            return (last if last.startswith("skipped") else f"skipped: {last}"), [], seconds
        if proc.returncode != 0:
            return f"failed (exit {proc.returncode}): {last}", [], seconds
        try:
            data = read_results(out)
        except (OSError, ValueError) as exc:
            return f"bad results: {exc}", [], seconds
        return "ok", data["figures"], seconds


def markdown(rows: list[tuple[str, str, list[dict], float]]) -> str:
    lines = [
        "| benchmark | metric | value | unit | baseline | ratio |",
        "| --- | --- | ---: | --- | ---: | ---: |",
    ]
    for name, status, figures, _ in rows:
        if status != "ok":
            lines.append(f"| {name} | {status} | | | | |")
            continue
        for f in figures:
            label = f" ({f['baseline_label']})" if f.get("baseline_label") else ""
            ratio = f"{f['ratio']:.3f}x" if isinstance(f["ratio"], int | float) else "-"
            lines.append(
                f"| {name} | {f['metric']} | {fmt(f['value'])} | {f['unit']} | "
                f"{fmt(f['baseline'])}{label} | {ratio} |"
            )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="pass --quick to every benchmark (CI-sized)")
    parser.add_argument("--only", nargs="+", choices=sorted(BENCHMARKS), help="run only these")
    parser.add_argument("--json", type=Path, help="also write all results to this file")
    parser.add_argument("--timeout", type=float, default=600.0, help="per-benchmark limit in seconds")
    args = parser.parse_args()
    names = args.only or list(BENCHMARKS)
    rows = []
    for name in names:
        print(f"running {name} ...", file=sys.stderr, flush=True)
        status, figures, seconds = run_one(name, HERE / BENCHMARKS[name], args.quick, args.timeout)
        print(f"  {name}: {status} ({seconds:.1f} s)", file=sys.stderr, flush=True)
        rows.append((name, status, figures, seconds))
    print(markdown(rows))
    if args.json:
        payload = [{"name": n, "status": s, "seconds": t, "figures": f} for n, s, f, t in rows]
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    failed = [
        n for n, s, _, _ in rows if s != "ok" and s != "not yet available" and not s.startswith("skipped")
    ]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
