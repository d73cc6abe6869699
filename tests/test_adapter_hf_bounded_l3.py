"""The HF adapter with a bounded (``capacity_bytes``) file L3 shared by two caches.

``HFStateCache.restore`` is a core ``lookup``, so a prefix hit on the device is asked of L3
(``core/l3_touch.py``): its pages, and for sliding-window and state models the window / state
objects at the system prompt's end, which a restore of any new question on that prompt needs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

import hf_support as hs
from kvstrata.adapters.hf import HFStateCache
from kvstrata.testing.hf_models import tiny_model

P = hs.PAGE
SYSTEM_PAGES = 2


def _config(l3: Path, capacity: int | None) -> dict[str, Any]:
    config = hs.storage(l3)
    if capacity is not None:
        config["tiers"]["storage"]["l3"]["capacity_bytes"] = capacity
    return config


def _page_bytes(model: Any, tmp: Path) -> int:
    """The bytes one page stores in L3 (every pool's object of it), measured on disk."""
    probe = tmp / "probe"
    with HFStateCache(model, _config(probe, None), page_size=P) as cache:
        cache.prefill(hs.tokens(99, P + 1))
    return sum(f.stat().st_size for f in probe.glob("*/*") if f.is_file())


@pytest.mark.parametrize("family", ["llama", "gemma3", "mamba2"])
def test_a_new_question_on_a_hot_system_prompt_restores_it_from_a_bounded_shared_l3(
    tmp_path: Path, family: str
) -> None:
    """Cache A prefills six chats on one two-page system prompt (hit on A's device from the
    second on); the L3 holds about four chats' worth of pages (the prompt and three chats). A
    second cache B restores the last chat whole (recent), and the prompt for a new question on
    it, as with an unbounded L3. For window and state models it restored nothing
    (``skipped: incomplete_stack``) while only pages were asked for: the prompt's window / state
    objects were evicted first."""
    hs.quiet()
    model = tiny_model(family)
    capacity = 4 * SYSTEM_PAGES * _page_bytes(model, tmp_path)
    system = hs.tokens(1, SYSTEM_PAGES * P)
    chats = [torch.cat([system, hs.tokens(10 + i, 2 * P + 1)]) for i in range(6)]
    question = torch.cat([system, hs.tokens(77, 2 * P + 1)])

    def run(l3: Path, cap: int | None) -> tuple[int, int]:
        with HFStateCache(model, _config(l3, cap), page_size=P) as a:
            for n, chat in enumerate(chats):
                a.prefill(chat)
                assert a.last_restore is not None
                assert a.last_restore.pages["device"] == (SYSTEM_PAGES if n else 0)
        with HFStateCache(model, _config(l3, cap), page_size=P) as b:
            _, last = b.restore(chats[-1])
            _, new = b.restore(question)
        return last, new

    assert run(tmp_path / "unbounded", None) == (4 * P, SYSTEM_PAGES * P)  # the reference
    last, new = run(tmp_path / "l3", capacity)
    assert last == 4 * P
    assert new == SYSTEM_PAGES * P, "the hot system prompt's window/state objects were LRU-evicted"
