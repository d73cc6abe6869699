"""Two prompts with a shared prefix, answered by a Hugging Face model in two processes.

    pip install 'torch==2.13.0' -e '.[hf]'
    python examples/hf_generate.py [--family qwen3_next] [--prefix-tokens 1024] [--l3 DIR]

The first process answers prompt 1 (a shared prefix + its own question): nothing is cached, so
it computes every token and ``HFStateCache`` stores each page in a file L3. The second process
-- a fresh interpreter with empty device and host tiers -- answers prompt 2 (the same prefix,
another question): it restores the shared prefix from L3 and computes only its own question.
Each process prints the tokens it reused, the tier they came from, its prefill time, the time
the same prefill takes without kvstrata (measured in that process), and whether its answer is
token-for-token the answer computed without kvstrata.

The model is a tiny random-weight one built from its config (``kvstrata.testing.hf_models``), so
nothing is downloaded; with a real checkpoint use ``AutoModelForCausalLM.from_pretrained``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

PAGE = 16
ANSWER_TOKENS = 8


def prompt(number: int, prefix_tokens: int) -> torch.Tensor:
    """A shared prefix (a long system prompt or document) and a question of its own."""
    shared = torch.randint(3, 256, (prefix_tokens,), generator=torch.Generator().manual_seed(0))
    question = torch.randint(3, 256, (23,), generator=torch.Generator().manual_seed(number))
    return torch.cat([shared, question])


def greedy(model, past, logits: torch.Tensor, argument: str) -> list[int]:
    """``ANSWER_TOKENS`` greedy tokens after ``logits``."""
    answer = []
    with torch.no_grad():
        for _ in range(ANSWER_TOKENS):
            token = int(logits.argmax())
            answer.append(token)
            out = model(input_ids=torch.tensor([[token]]), use_cache=True, **{argument: past})
            logits = out.logits[0, -1]
    return answer


def without_kvstrata(model, ids: torch.Tensor, argument: str) -> tuple[float, list[int]]:
    """The same chunk schedule on the model's own empty cache: prefill seconds, answer."""
    from transformers import DynamicCache

    past = DynamicCache(config=model.config)
    started = time.perf_counter()
    with torch.no_grad():
        for start in range(0, len(ids), PAGE):
            out = model(input_ids=ids[start : start + PAGE].unsqueeze(0), use_cache=True, **{argument: past})
    seconds = time.perf_counter() - started
    return seconds, greedy(model, past, out.logits[0, -1], argument)


def answer(number: int, family: str, l3: Path, prefix_tokens: int) -> None:
    """One process: answer prompt ``number`` through kvstrata and report what it reused."""
    import transformers

    from kvstrata.adapters.hf import HFStateCache
    from kvstrata.testing.hf_models import tiny_model

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    model = tiny_model(family)  # seeded: both processes build the same weights
    ids = prompt(number, prefix_tokens)
    config = {
        "tiers": {"storage": {"l3": {"type": "file", "path": str(l3)}}},
        "policy": {"prefetch": {"policy": "wait_complete"}},
    }
    with HFStateCache(model, config, page_size=PAGE, state_slots=256) as cache:
        argument = cache.layout.cache_argument
        started = time.perf_counter()
        result = cache.prefill(ids)  # restore, then one page per forward, committing each page
        seconds = time.perf_counter() - started
        reply = greedy(model, result.past_key_values, result.logits[0], argument)
        info = cache.last_restore
    baseline, expected = without_kvstrata(model, ids, argument)
    tiers = ", ".join(f"{tier} {pages * PAGE}" for tier, pages in info.pages.items() if pages) or "none"
    # a gap with nothing reused is noise (or the cost of storing), never time kvstrata saved
    gap = (
        f"{(baseline - seconds) * 1000:+.0f} ms saved"
        if result.cached_tokens
        else "nothing reused: this run computed and stored the prefix"
    )
    print(
        f"[process {number}, pid {os.getpid()}] {family}, prompt {number} ({len(ids)} tokens): "
        f"reused {result.cached_tokens} tokens (from: {tiers}); prefill {seconds * 1000:.0f} ms "
        f"vs {baseline * 1000:.0f} ms without kvstrata ({gap}); "
        f"answer {reply}, same as without kvstrata: {reply == expected}",
        flush=True,
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--family", default="qwen3_next", help="a family of kvstrata.testing.hf_models")
    parser.add_argument("--prefix-tokens", type=int, default=1024)
    parser.add_argument("--l3", type=Path, help="L3 directory (default: a temporary one)")
    parser.add_argument("--answer", type=int, choices=[1, 2], help=argparse.SUPPRESS)  # one process
    args = parser.parse_args()
    if args.answer:
        answer(args.answer, args.family, args.l3, args.prefix_tokens)
        return 0
    with tempfile.TemporaryDirectory(prefix="kvstrata-hf-l3-") as scratch:
        l3 = args.l3 or Path(scratch)
        for number in (1, 2):  # two processes, one after the other, sharing only the L3
            command = [sys.executable, __file__, "--answer", str(number), "--family", args.family]
            command += ["--prefix-tokens", str(args.prefix_tokens), "--l3", str(l3)]
            subprocess.run(command, check=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
