"""Drives tiny Hugging Face models through ``kvstrata.adapters.hf`` as a user would, for
``tests/test_adapter_hf.py``; also a command line, so a phase can run in a fresh process:

    python tests/hf_support.py write --l3 DIR --evict-l3 DIR2 --out W.json llama mamba2:bfloat16 ...
    python tests/hf_support.py read  --l3 DIR --out R.json llama mamba2:bfloat16 ...
    python tests/hf_support.py evict-share --runs 20 --l3 DIR --out E.json falcon_h1 mamba2 qwen3_next gemma3

The reference for every comparison is the same model run from an empty cache with the same
chunk schedule (one page per forward, then greedy decoding); a restored run continues from the
restored page with that schedule, so every logit it produces must be ``torch.equal`` to the
reference's logit at the same position.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import torch

from kvstrata.core.keys import KEY_VERSION

PAGE = 16
#: torch device of the in-process model tests (``KVSTRATA_TEST_DEVICE=cuda`` runs them on a GPU)
DEVICE = os.environ.get("KVSTRATA_TEST_DEVICE", "cpu")
HEADER_BYTES = 64  # kvstrata's object header (docs/storage.md)
PROMPT_PAGES = 12  # what the writer stores
EXTRA_TOKENS = 1  # the reader's prompt: the stored pages and one new token (the decode path)
DECODE = 8
FILLERS = 4


def quiet() -> None:
    """Keep transformers' notes about reference kernels out of test output."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)


def tokens(seed: int, count: int) -> torch.Tensor:
    """Deterministic token ids in [3, 256) (clear of pad / bos / eos)."""
    return torch.randint(3, 256, (count,), generator=torch.Generator().manual_seed(seed))


def prompt_a(family: str) -> torch.Tensor:
    return tokens(1000 + len(family), PROMPT_PAGES * PAGE)


def reader_prompt(family: str) -> torch.Tensor:
    return torch.cat([prompt_a(family), tokens(2000 + len(family), EXTRA_TOKENS)])


def storage(l3: Path, *, small: bool = False) -> dict[str, Any]:
    """A kvstrata config: file L3 at ``l3``; ``small`` tiers hold about two prompts."""
    device, host = (48 * PAGE, 64 * PAGE) if small else (4096, 8192)
    return {
        "tiers": {
            "device": {"capacity_tokens": device},
            "host": {"capacity_tokens": host},
            "storage": {"l3": {"type": "file", "path": str(l3)}},
        },
        "policy": {"prefetch": {"policy": "wait_complete"}},
    }


def open_cache(model: Any, l3: Path, *, small: bool = False) -> Any:
    from kvstrata.adapters.hf import HFStateCache

    return HFStateCache(model, storage(l3, small=small), page_size=PAGE, state_slots=16 if small else 96)


def model_of(spec: str) -> tuple[str, Any]:
    """``family`` or ``family:dtype`` -> (spec, seeded tiny model)."""
    from kvstrata.testing.hf_models import tiny_model

    family, _, dtype = spec.partition(":")
    return family, tiny_model(family, getattr(torch, dtype or "float32"))


# --- running a model page by page ------------------------------------------------------------


def run_pages(
    cache: Any, past: Any, ids: torch.Tensor, start: int, commit_every: int = 0
) -> list[torch.Tensor]:
    """Forward ``ids[start:]`` one page at a time (the last chunk may be partial); commit every
    ``commit_every`` pages and at the end when asked. Returns each chunk's last logits."""
    model, argument = cache.model, cache.layout.cache_argument
    device = next(model.parameters()).device
    logits = []
    position = start
    with torch.no_grad():
        while position < len(ids):
            end = min(position + PAGE, len(ids))
            chunk = ids[position:end].to(device).unsqueeze(0)
            out = model(input_ids=chunk, use_cache=True, **{argument: past})
            logits.append(out.logits[0, -1].clone())
            position = end
            if commit_every and (end // PAGE % commit_every == 0 or end == len(ids)):
                cache.commit(ids, end, past)
    return logits


def decode(cache: Any, past: Any, last: torch.Tensor) -> list[torch.Tensor]:
    """``DECODE`` greedy steps after the logits ``last``; returns their logits."""
    model, argument = cache.model, cache.layout.cache_argument
    logits = []
    with torch.no_grad():
        for _ in range(DECODE):
            token = last.argmax().reshape(1, 1)
            out = model(input_ids=token, use_cache=True, **{argument: past})
            last = out.logits[0, -1].clone()
            logits.append(last)
    return logits


def stock_cache(model: Any) -> Any:
    """The cache the model builds for itself when given none (transformers' own layers)."""
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def reference(cache: Any, ids: torch.Tensor) -> list[torch.Tensor]:
    """Logits of every page chunk of ``ids`` from the model's own empty cache, then of the
    decode steps: the run without kvstrata."""
    past = stock_cache(cache.model)
    chunks = run_pages(cache, past, ids, 0)
    return chunks + decode(cache, past, chunks[-1])


def continue_from_restore(cache: Any, ids: torch.Tensor) -> tuple[int, list[torch.Tensor]]:
    """Restore the longest cached prefix of ``ids``, run the rest page by page, decode."""
    past, cached = cache.restore(ids)
    chunks = run_pages(cache, past, ids, cached)
    return cached, chunks + decode(cache, past, chunks[-1])


def matches(reference_logits: list[torch.Tensor], cached: int, continued: list[torch.Tensor]) -> bool:
    """Every continued logit equals the reference at its position (chunks from ``cached`` on)."""
    tail = reference_logits[cached // PAGE :]
    return len(tail) == len(continued) and all(
        torch.equal(a, b) for a, b in zip(tail, continued, strict=True)
    )


# --- object files of a file L3 -----------------------------------------------------------------


def page_hashes(cache: Any, ids: torch.Tensor) -> list[str]:
    lease = cache.cache.lookup(ids, prefetch="off", record=False)
    hashes = list(lease.page_hashes)
    cache.cache.release(lease)
    return hashes


def object_file(l3: Path, namespace: str, pool: str, page_hash: str) -> Path | None:
    """The stored object of ``pool`` for page ``page_hash`` (file names are kvstrata keys)."""
    component = re.compile(rf"\.[A-Za-z0-9_]+-{re.escape(pool)}-[0-9a-f]{{10}}\.")  # pool type-pool-layout
    found = [p for p in stored_objects(l3, namespace) if page_hash in p.name and component.search(p.name)]
    return found[0] if found else None


def stored_objects(l3: Path, namespace: str) -> list[Path]:
    """Every object file of one namespace (keys start with ``{KEY_VERSION}-{namespace}``)."""
    return sorted(p for p in l3.glob("*/*") if p.name.startswith(f"{KEY_VERSION}-{namespace[:48]}"))


def verified_offset(rng: Any, size: int) -> int:
    """A byte the integrity check covers: the payload, else the header before its 16 reserved
    bytes (kvstrata's header ends in reserved bytes that no check reads)."""
    return rng.randrange(HEADER_BYTES, size) if size > HEADER_BYTES else rng.randrange(HEADER_BYTES - 16)


def flip(path: Path, offset: int) -> bytes:
    """Flip one bit of the byte at ``offset``; returns the original bytes (kvstrata removes an
    object that fails verification, so the caller puts them back)."""
    original = path.read_bytes()
    data = bytearray(original)
    data[offset % len(data)] ^= 0x01
    path.write_bytes(bytes(data))
    return original


def needed_objects(pools: dict[str, dict[str, Any]], pages: int) -> list[tuple[str, int]]:
    """(pool, page) of one object per pool that a restore of ``pages`` pages reads: a middle
    page of every all-pages pool, the last page of window and state pools."""
    needed = []
    for name, config in pools.items():
        source = pools.get(config.get("index_source") or "", config)
        all_pages = config["type"] == "logical" or (config["type"] == "kv" and source["type"] == "kv")
        needed.append((name, pages // 2 if all_pages else pages - 1))
    return needed


# --- the phases --------------------------------------------------------------------------------


def write_phase(specs: list[str], l3: Path, evict_l3: Path) -> dict[str, Any]:
    """Store prompt A of every model (one page per forward, commit per page) and close; then,
    with tiers that hold about two prompts, store A, let fillers evict it, and restore it (L3)."""
    results: dict[str, Any] = {}
    for spec in specs:
        family, model = model_of(spec)
        ids = prompt_a(family)
        with open_cache(model, l3) as cache:
            past, _ = cache.restore(ids)
            run_pages(cache, past, ids, 0, commit_every=1)
            namespace = cache.namespace
        with open_cache(model, evict_l3, small=True) as small:
            past, _ = small.restore(ids)
            run_pages(small, past, ids, 0, commit_every=1)
            for filler in range(FILLERS):
                other = tokens(3000 + filler, 20 * PAGE)
                run_pages(small, small.restore(other)[0], other, 0, commit_every=1)
            full = reader_prompt(family)
            want = reference(small, full)
            cached, got = continue_from_restore(small, full)
            results[spec] = {
                "namespace": namespace,
                "evicted_cached": cached,
                "evicted_pages": small.last_restore.pages,
                "evicted_equal": matches(want, cached, got),
            }
    return results


def read_phase(specs: list[str], l3: Path) -> dict[str, Any]:
    """In a new process: restore the reader prompt from L3, continue, compare; then flip one
    byte in stored objects the restore needs (and in random ones) and restore again."""
    import random

    results: dict[str, Any] = {}
    for spec in specs:
        family, model = model_of(spec)
        full = reader_prompt(family)
        with open_cache(model, l3) as cache:
            want = reference(cache, full)
            cached, got = continue_from_restore(cache, full)
            out: dict[str, Any] = {
                "namespace": cache.namespace,
                "pools": cache.layout.pools,
                "cached": cached,
                "pages": cache.last_restore.pages,
                "equal": matches(want, cached, got),
            }
            hashes = page_hashes(cache, full)
            namespace, pools = cache.namespace, cache.layout.pools
        rng = random.Random(family)
        flips = [  # one object per pool that this restore reads, flipped in a verified byte
            (f"{name}@{page}", object_file(l3, namespace, name, hashes[page]), "verified")
            for name, page in needed_objects(pools, cached // PAGE)
        ]
        everything = stored_objects(l3, namespace)
        flips += [(f"random:{p.name.split('.')[1]}", p, "any") for p in rng.sample(everything, 3)]
        out["flips"] = []
        for label, path, where in flips:
            if path is None:
                out["flips"].append({"object": label, "missing": True})
                continue
            size = path.stat().st_size
            offset = rng.randrange(size) if where == "any" else verified_offset(rng, size)
            original = flip(path, offset)
            try:
                with open_cache(model, l3) as fresh:
                    short, again = continue_from_restore(fresh, full)
                    out["flips"].append(
                        {
                            "object": label,
                            "offset": offset,
                            "size": size,
                            "cached": short,
                            "equal": matches(want, short, again),
                            "skipped": fresh.last_restore.skipped,
                        }
                    )
            finally:
                path.write_bytes(original)  # kvstrata removed the damaged object
        results[spec] = out
    return results


#: issue 29's scenario: tiers of 64 / 128 pages, prompt A of 50 pages, four 50-page fillers,
#: prompt B sharing A's first 37 pages; the families it went wrong on
EVICT_SHARE_FAMILIES = ["falcon_h1", "mamba2", "qwen3_next", "gemma3"]


def evict_share_phase(specs: list[str], root: Path, *, hold: bool = False) -> dict[str, Any]:
    """Issue 29, as an engine author met it: in one process, per model, prefill prompt A page by
    page (commit per page), four fillers push it out of L1 and L2, then restore prompt B (A's
    first 37 pages, 13 new), prefill its rest page by page and decode; compare every logit with
    B computed from scratch with the same chunks. ``hold``: the L3 write of A's page 37 waits on
    the writer thread until page 39 is committed (the race made certain; timing injection only)."""
    results: dict[str, Any] = {}
    for spec in specs:
        family, model = model_of(spec)
        config = storage(root / family.replace(":", "-"))
        config["tiers"]["device"]["capacity_tokens"] = 64 * PAGE
        config["tiers"]["host"]["capacity_tokens"] = 128 * PAGE
        with open_hf_cache(model, config) as cache:
            _hold_write(cache, 37 if hold else 0, until_commit=39)
            first = tokens(40, 50 * PAGE)
            for ids in [first, *(tokens(50 + n, 50 * PAGE) for n in range(FILLERS))]:
                run_pages(cache, cache.restore(ids)[0], ids, 0, commit_every=1)
            second = torch.cat([first[: 37 * PAGE], tokens(41, 13 * PAGE)])
            want = reference(cache, second)
            cached, got = continue_from_restore(cache, second)
            results[spec] = {
                "cached": cached,
                "pages": cache.last_restore.pages,
                "equal": matches(want, cached, got),
            }
    return results


def _hold_write(cache: Any, write: int, *, until_commit: int) -> None:
    """Hold the ``write``-th L3 write (0: none) on the writer thread until ``until_commit``
    commits are done: what a busy CPU does to the writer thread (timing injection only)."""
    import threading

    gate, writes, commits = threading.Event(), [0], [0]
    put_group, commit = cache.cache.engine.put_group, cache.commit

    def held_put_group(batches: Any) -> Any:
        writes[0] += 1
        if writes[0] == write:
            gate.wait(30)
        return put_group(batches)

    def counted_commit(*args: Any) -> Any:
        out = commit(*args)
        commits[0] += 1
        if commits[0] >= until_commit:
            gate.set()
        return out

    cache.cache.engine.put_group, cache.commit = held_put_group, counted_commit


def open_hf_cache(model: Any, config: dict[str, Any]) -> Any:
    from kvstrata.adapters.hf import HFStateCache

    return HFStateCache(model, config, page_size=PAGE)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("phase", choices=["write", "read", "evict-share"])
    parser.add_argument("specs", nargs="+")
    parser.add_argument("--l3", type=Path, required=True)
    parser.add_argument("--runs", type=int, default=1, help="evict-share: repeat, fresh L3 each run")
    parser.add_argument("--hold", action="store_true", help="evict-share: hold page 37's L3 write")
    parser.add_argument("--evict-l3", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    quiet()
    if args.phase == "evict-share":
        runs = [evict_share_phase(args.specs, args.l3 / f"run{n}", hold=args.hold) for n in range(args.runs)]
        wrong = [(n, spec) for n, run in enumerate(runs) for spec, got in run.items() if not got["equal"]]
        print(f"{args.runs} runs x {len(args.specs)} models: {len(wrong)} wrong {wrong}")
        args.out.write_text(json.dumps({"pid": os.getpid(), "runs": runs, "wrong": wrong}, default=str))
        return 1 if wrong else 0
    if args.phase == "write":
        results = write_phase(args.specs, args.l3, args.evict_l3)
    else:
        results = read_phase(args.specs, args.l3)
    args.out.write_text(json.dumps({"pid": os.getpid(), "results": results}, default=str))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    raise SystemExit(main())
