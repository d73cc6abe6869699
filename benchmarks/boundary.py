"""What the engine-boundary checks cost per call (issue 25): the one-thread guard on every lease
call and the token-id validation of ``lookup`` / ``extend``. (The lease-owner check, one identity
test inline in ``_check_lease``, cannot be taken out and runs on both sides.)

Two engine loops on a kv stack with tiny buffers (the controller's own time, no model):

* decode: one lease, ``extend([token])`` + ``allocate(partial_page=True)`` per token and
  ``insert(close=False)`` per page (the calls an engine makes per step);
* chunked prefill: 1-page chunks (``allocate`` / ``insert(close=False)`` / ``extend``).

Each is timed as shipped and against a baseline in the same run with the checks taken out (the
guard unwrapped, the old coercion ``torch.as_tensor(tokens, dtype=int64).flatten()`` in place of
``token_ids`` in ``lookup`` and of ``token_bytes`` in ``Lease.extend``), alternating. Also each
check alone, best of many calls: the guard on ``cache.poll()`` against the unwrapped call, and
``token_ids`` for 1, 64 and 8192 tokens against the old coercion. On a shared machine the loop
ratios are noisy; the per-check figures are not.

    python benchmarks/boundary.py [--quick] [--json OUT]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from _results import Figure, write_results

import kvstrata
import kvstrata.core.controller as controller_module
import kvstrata.core.lease as lease_module
from kvstrata.core.controller import CacheController
from kvstrata.core.tokens import token_bytes, token_ids

PAGE = 64
GUARDED = ("lookup", "admit", "allocate", "insert", "release", "poll", "flush", "fork_state")


def _old_coercion(tokens: Any, what: str = "tokens") -> torch.Tensor:
    return torch.as_tensor(tokens, dtype=torch.int64).flatten().cpu()


def _old_bytes(tokens: Any, what: str = "tokens") -> bytes:
    """``Lease.extend``'s ids without the check: the old coercion, as the int64 bytes it keys."""
    return _old_coercion(tokens, what).numpy().tobytes()


@contextmanager
def checks_removed() -> Iterator[None]:
    """The baseline: guarded methods unwrapped, token ids coerced as before the checks."""
    saved = {name: getattr(CacheController, name) for name in GUARDED}
    try:
        for name, method in saved.items():
            setattr(CacheController, name, method.__wrapped__)
        # ``lookup`` checks through ``token_ids``, ``Lease.extend`` through ``token_bytes``
        controller_module.token_ids = _old_coercion  # type: ignore[assignment]
        lease_module.token_bytes = _old_bytes  # type: ignore[assignment]
        yield
    finally:
        for name, method in saved.items():
            setattr(CacheController, name, method)
        controller_module.token_ids = token_ids  # type: ignore[assignment]
        lease_module.token_bytes = token_bytes  # type: ignore[assignment]


def _config(pages: int) -> dict[str, Any]:
    return {
        "model": {
            "name": "bench-boundary",
            "page_size": PAGE,
            "pools": {"kv": {"type": "kv", "layers": 1, "kv_heads": 1, "head_dim": 8, "dtype": "bfloat16"}},
        },
        "tiers": {"device": {"capacity_tokens": (pages + 8) * PAGE}, "host": {"capacity_tokens": 0}},
    }


def decode(cache: CacheController, pages: int) -> int:
    """Decode ``pages`` pages token by token on one lease; returns the calls made."""
    lease = cache.lookup([1] * 10)
    cache.admit(lease)
    calls = 2
    for step in range(pages * PAGE):
        lease.extend([step % 50_000])
        cache.allocate(lease, partial_page=True)
        calls += 2
        if len(lease.tokens) % PAGE == 0:
            cache.insert(lease, close=False)
            calls += 1
    cache.insert(lease)
    return calls + 1


def chunked(cache: CacheController, pages: int) -> int:
    request = torch.randint(0, 50_000, (pages * PAGE,))
    lease = cache.lookup(request[:PAGE])
    cache.admit(lease)
    calls = 2
    while True:
        cache.allocate(lease)
        last = lease.pages >= pages
        cache.insert(lease, close=last)
        calls += 2
        if last:
            return calls
        lease.extend(request[lease.pages * PAGE : (lease.pages + 1) * PAGE])
        calls += 1


def timed(loop: Callable[[CacheController, int], int], pages: int, rounds: int) -> tuple[float, int]:
    """Best-of-rounds seconds of ``loop`` in a fresh cache, and its call count."""
    best, calls = float("inf"), 0
    for _ in range(rounds):
        with kvstrata.open(_config(pages), environ={}) as cache:
            started = time.perf_counter()
            calls = loop(cache, pages)
            best = min(best, time.perf_counter() - started)
    return best, calls


def best_of(call: Callable[[], object], rounds: int) -> float:
    """Best seconds per call over ``rounds`` batches of 2,000 calls."""
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(2000):
            call()
        best = min(best, (time.perf_counter() - started) / 2000)
    return best


def validation(n: int, rounds: int) -> tuple[float, float]:
    """Best seconds per call of ``token_ids`` and of the old coercion, for ``n`` tokens."""
    given: Any = [7] * n if n <= 8 else torch.randint(0, 50_000, (n,))
    return best_of(lambda: token_ids(given), rounds * 3), best_of(lambda: _old_coercion(given), rounds * 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer pages and rounds")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    pages, rounds = (4, 3) if args.quick else (16, 9)
    figures = []
    for name, loop, size in (("decode", decode, pages), ("chunked_prefill", chunked, pages * 32)):
        checked = bare = float("inf")
        for _ in range(rounds):  # alternate, so drift of a shared machine hits both alike
            seconds, calls = timed(loop, size, 1)
            checked = min(checked, seconds)
            with checks_removed():
                bare = min(bare, timed(loop, size, 1)[0])
        per_call = (checked - bare) / calls * 1e9
        print(
            f"{name:16s} {size:5d} pages, {calls:6d} calls: {checked * 1e3:8.1f} ms with checks, "
            f"{bare * 1e3:8.1f} ms without ({checked / bare:.3f}x), {per_call:+.0f} ns per call"
        )
        figures.append(Figure.against(f"{name}_loop_s", checked, "s", bare, "checks removed"))
        figures.append(Figure(f"{name}_check_ns_per_call", per_call, "ns"))
    with kvstrata.open(_config(8), environ={}) as cache:
        guarded, bare = (
            best_of(lambda: cache.poll(), rounds),
            best_of(lambda: CacheController.poll.__wrapped__(cache), rounds),
        )
    print(f"one-thread guard: cache.poll() {guarded * 1e9:.0f} ns, unguarded {bare * 1e9:.0f} ns")
    figures.append(Figure.against("guarded_poll_s", guarded, "s", bare, "unguarded poll"))
    for n in (1, 64, 8192):
        new, old = validation(n, rounds)
        print(
            f"token_ids({n:5d} tokens): {new * 1e6:6.2f} us, "
            f"old coercion {old * 1e6:6.2f} us ({new / old:.2f}x)"
        )
        figures.append(Figure.against(f"token_ids_{n}_s", new, "s", old, "old coercion"))
    if args.json:
        write_results(args.json, "boundary", figures)


if __name__ == "__main__":
    main()
