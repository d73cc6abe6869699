"""Which Mamba/GDN state checkpoints a vLLM step leaves, and which of them a later request may
start from (the scheduler role of kvstrata's vLLM connector saves them; see ``_vllm_scheduler``).

vLLM's align mode writes a checkpoint where a step ends on a block boundary (it cuts prefill
chunks there), and vLLM 0.32 also hands its checkpoints to a connector with their exact blocks.
A checkpoint past the tokens a request's prefill began with was written by a *decode* step,
whose kernel computes other low bits than a prefill of the same tokens (audit 29: 1.1 % apart
on a GDN model, where two prefill chunkings are bit-identical). vLLM serves no such state to
another request (a next turn restored from one left vLLM's own tokens), but it is the state the
request itself goes on from: resumed after a preemption from it, the request continues as if
never preempted. So it is stored under a key only that request asks for
(``_vllm_keys.private_key``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvstrata.adapters._vllm_layout import STATE, StoreLayout

#: ``(group id, block id, blocks of the prefix the checkpoint ends)``
Checkpoint = tuple[int, int, int]


def handed_over(scheduler_output: Any) -> dict[str, list[Checkpoint]]:
    """vLLM's own hand-off of the checkpoints its step leaves, ``{request id: [(group id, block
    id, boundary tokens)]}`` (vLLM 0.32's ``kv_connector_block_state``: exact blocks, where the
    block table's position can name another after a copy-on-write or a speculative block's
    move); empty where this vLLM hands none over."""
    block_state = getattr(scheduler_output, "kv_connector_block_state", None)
    return getattr(block_state, "boundary_state_offloads", None) or {}


def restarted(scheduler_output: Any) -> set[str]:
    """Requests this step starts prefilling from scratch: new ones, and ones resumed after a
    preemption (they prefill the tokens they had generated too)."""
    new = {getattr(r, "req_id", None) for r in getattr(scheduler_output, "scheduled_new_reqs", ()) or ()}
    cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
    resumed = set(getattr(cached, "resumed_req_ids", ()) or ())  # (a vLLM without it: none)
    return {r for r in new if r is not None} | resumed


def step_checkpoints(
    layout: StoreLayout,
    step_start: int,
    step_end: int,
    known_tokens: int,
    save_from: int,
    block_ids: Callable[[], tuple[list[int], ...] | None],
    offered: list[Checkpoint],
) -> list[Checkpoint]:
    """The checkpoints a step of tokens ``[step_start, step_end)`` leaves, ``(group id, block id,
    blocks of the prefix)``: the block align mode writes where the step ends on a boundary (its
    token ids known, beyond the ``save_from`` blocks vLLM held itself), and those vLLM
    ``offered`` past ``step_start`` (whole blocks only: a partial block has no key of ours),
    which win. An offer at or before ``step_start`` is a state this step did not compute: vLLM
    offers the blocks of a finished load too (it caches them), and saving a loaded state again
    would cost a put of it, or -- a resumed request's own decode-time checkpoint, loaded and
    then counted as its new prefill's -- publish it under the shared key and drop its own."""
    bs = layout.block_size
    state_groups = {g.group_id for g in layout.groups if g.kind == STATE}
    found: dict[tuple[int, int], int] = {}
    end = step_end // bs
    if state_groups and step_end <= known_tokens and not step_end % bs and end > save_from:
        ids = block_ids()
        for group_id in state_groups if ids is not None else ():
            row = ids[group_id]
            if end <= len(row) and row[end - 1] != 0:
                found[group_id, end] = row[end - 1]
    for group_id, block_id, tokens in offered:
        if group_id in state_groups and block_id != 0 and tokens > step_start and not tokens % bs:
            found[group_id, tokens // bs] = block_id
    return [(group_id, block_id, blocks) for (group_id, blocks), block_id in found.items()]
