"""An L3 write a transient failure lost is written again at its prefix's next reuse.

Nothing else writes a prefix again while L1/L2 serve it (a hit reads no L3), and every key below
it chains through its pages: one timed-out put of a hot prompt left each later page written
under it unreachable to a fresh cache. A put the backend answered "not stored" (full, read-only)
is not retried (``test_l3_hot_prefix``: the failures of a run would depend on timing).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from controller_support import open_cache, serve, tokens, verify
from kvstrata.core.breaker import CircuitBreaker

PROMPT_PAGES = 4


def _fresh_restores(example: str, l3: Path, requests: list[torch.Tensor]) -> list[int]:
    """Pages a fresh cache on the same L3 restores of each request, every byte checked."""
    restored = []
    with open_cache(example, l3) as fresh:
        for request in requests:
            lease = fresh.lookup(request, prefetch="wait")
            fresh.admit(lease)
            assert verify(fresh, lease) == 0
            restored.append(lease.cached_pages)
            fresh.release(lease)
    return restored


@pytest.mark.parametrize("example", ["kv", "hybrid-mamba"])
def test_a_prompt_whose_write_timed_out_is_written_again_at_its_next_reuse(
    example: str, tmp_path: Path
) -> None:
    """The prompt's put times out once (fault injection); three chats reuse the prompt from the
    device and store their own pages. A fresh cache restores every chat whole -- it restored
    nothing while the prompt's lost write was never retried."""
    prompt = tokens(1, PROMPT_PAGES)
    chats = [torch.cat([prompt, tokens(10 + i, 2)]) for i in range(3)]
    with open_cache(example, tmp_path / "l3") as cache:
        put = cache.engine.backend.put
        timeouts = [TimeoutError("injected: the put timed out")]

        def put_once_timing_out(objects: object, **options: object) -> list[bool]:
            if timeouts:
                raise timeouts.pop()
            return put(objects, **options)  # type: ignore[arg-type]

        cache.engine.backend.put = put_once_timing_out  # type: ignore[method-assign]
        serve(cache, prompt)
        cache.flush()
        assert cache.metrics.snapshot()["storage"]["put_failed"] > 0
        for chat in chats:
            _, bad = serve(cache, chat)
            assert bad == 0
        cache.flush()
    assert _fresh_restores(example, tmp_path / "l3", chats) == [PROMPT_PAGES + 2] * 3


def test_a_write_the_open_breaker_refused_is_written_once_it_closes(tmp_path: Path) -> None:
    """Puts fail until the write breaker opens (fault injection); the prompt written meanwhile
    is refused without a call. Once L3 answers again and the breaker lets a write through, the
    prompt's next reuse writes it."""
    prompt = tokens(1, PROMPT_PAGES)
    chat = torch.cat([prompt, tokens(10, 2)])
    now = [0.0]
    with open_cache("kv", tmp_path / "l3") as cache:
        cache.engine.write_breaker = CircuitBreaker(1, 5.0, clock=lambda: now[0])  # a test's clock
        put = cache.engine.backend.put

        def down(objects: object, **options: object) -> list[bool]:
            raise ConnectionError("injected: L3 is down")

        cache.engine.backend.put = down  # type: ignore[method-assign]
        serve(cache, tokens(99, 1))  # its failed put opens the breaker
        cache.flush()
        assert cache.engine.write_breaker.refusing()
        serve(cache, prompt)  # refused at once: never reaches the backend
        cache.flush()
        cache.engine.backend.put = put  # type: ignore[method-assign]
        now[0] += 5.0  # the cooldown is over: the next write is the breaker's trial
        serve(cache, chat)
        cache.flush()
    assert _fresh_restores("kv", tmp_path / "l3", [chat]) == [PROMPT_PAGES + 2]
