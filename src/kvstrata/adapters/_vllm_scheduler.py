"""The scheduler role of kvstrata's vLLM connector: lookups against L3 and the per-step plan.

Runs in vLLM's engine-core process. It never moves bytes: it asks the storage backend which
blocks exist (``exists``, side-effect free), and tells the workers, once per step, which blocks
to load into which block ids and which blocks the step completes (to save). Loads are
asynchronous in vLLM's sense (``(tokens, True)``): the request waits until the worker reports the
load, so vLLM's Mamba align-mode precopy (checkpoint ``n-1`` into the running slot) runs on
restored data, and a failed load is a request-level failure vLLM recomputes (block-level load
errors are not supported by vLLM for models with several KV cache groups).

Pipeline parallel: vLLM gives this role stage 0's KV cache config (``generate_scheduler_kv_cache_config``;
the stages differ in layer names, which name their pools), so a lookup asks for stage 0's objects
only. A block another stage lost (an eviction, a failed put) fails that stage's load; the request
recomputes (``loads_failed`` sets ``stored_blocks`` to 0) and saves every block on every stage.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from kvstrata.adapters._shared import EngineIdentity
from kvstrata.adapters._vllm_checkpoints import Checkpoint, handed_over, restarted, step_checkpoints
from kvstrata.adapters._vllm_keys import (
    ExtraKeys,
    extend_chain,
    has_extra_keys,
    object_keys,
    private_key,
)
from kvstrata.adapters._vllm_layout import STATE, GroupLayout, StoreLayout
from kvstrata.adapters._vllm_plan import GroupTransfer, StepPlan, Stored, once_each, written_since
from kvstrata.engine_kit import StorageEngine

__all__ = ["GroupTransfer", "SchedulerSide", "StepPlan"]  # (the plan's types, for the worker)

log = logging.getLogger(__name__)

#: Second chunk of a prefix existence query (after one probe block); each further chunk doubles.
FIRST_EXISTS_CHUNK = 16


@dataclass
class _Request:
    request: Any
    root: str  # chain root: namespace + cache salt
    #: whose decode-time checkpoints these are: the scheduler instance's own random id and the
    #: request id (vLLM's offline ids are counters, the same in every process sharing an L3)
    owner: str
    hashes: list[str] = field(default_factory=list)
    stored_blocks: int = 0  # blocks known stored (found by the lookup, loaded, or saved)
    hit_blocks: int = 0  # last lookup's answer
    lookup_from: int = 0  # blocks vLLM had locally at the last lookup
    last_lookup: tuple[int, int, int] | None = None  # (computed tokens, tokens, preemptions) last asked
    save_from: int | None = None  # blocks vLLM had when the request was first scheduled
    #: tokens the request had when its prefill (first, or again after a preemption) began: a
    #: state checkpoint past it is a decode step's (see ``_vllm_checkpoints``)
    prefill_end: int = 0
    #: blocks whose state checkpoint this request stored from a decode step, under its own key
    decode_states: set[int] = field(default_factory=set)
    pending_load: tuple[int, int] | None = None  # (first block, end block) to load; end < 0: fail it
    load_failed: bool = False  # a load of this request failed: it recomputes, never asks again
    extras: bool = False  # its blocks carry extra keys (LoRA, multimodal, prompt embeddings)
    uncacheable: bool = False  # extra keys this vLLM cannot tell: never looked up nor saved
    reset_while_running: bool = False  # a connector reset came while it ran (``reset``)

    def object_keys(self, group: GroupLayout, hashes: list[str], indices: Iterable[int]) -> list[str]:
        """Keys of ``group``'s blocks ``indices`` (its own for decode-time checkpoints)."""
        return object_keys(group, hashes, indices, self.decode_states, self.owner)

    def checkpoint_key(self, index: int, key: str, decode: bool, drops: list[str]) -> str:
        """The key of the state checkpoint at block ``index`` (``key``: the block's): a decode
        step's is the request's own; a prefill's is the block's, and an own one it replaces
        goes to ``drops`` (a resumed request's prefill of tokens it had generated)."""
        if decode:
            self.decode_states.add(index)
            return private_key(key, self.owner)
        if index in self.decode_states:
            self.decode_states.discard(index)
            drops.append(private_key(key, self.owner))
        return key

    def uncacheable_now(self, extra_keys: ExtraKeys | None, block_size: int) -> bool:
        """Whether the request is neither looked up nor saved, its extra keys asked again (at
        every lookup and step): a streaming-input session (one request, extended in place) gains
        an image after a text chunk. From then on its blocks mix theirs in (or, where this vLLM
        cannot tell them, ``extra_keys`` None, it is uncacheable); the blocks hashed before keep
        their keys where they have none (a block's link is mixed only by its own extra keys),
        the rest are hashed again."""
        if self.extras or not has_extra_keys(self.request):
            return self.uncacheable
        self.extras, self.uncacheable = True, extra_keys is None
        keep = 0
        while keep < len(self.hashes) and extra_keys is not None:
            if extra_keys(self.request, keep * block_size, (keep + 1) * block_size):
                break
            keep += 1
        del self.hashes[keep:]
        return self.uncacheable

    def own_keys(self) -> list[str]:
        """The keys of every decode-time checkpoint the request stored under its own key."""
        return [private_key(self.hashes[i], self.owner) for i in sorted(self.decode_states)]


def leading_run(engine: StorageEngine, pool: str, hashes: list[str]) -> int:
    """Leading run of stored blocks, asked in chunks of 1, 16, 32 ...: a miss costs one query."""
    done, chunk = 0, 1
    while done < len(hashes):
        batch = hashes[done : done + chunk]
        found = engine.exists_prefix(pool, batch)
        done += found
        if found < len(batch):
            break
        chunk = FIRST_EXISTS_CHUNK if chunk == 1 else chunk * 2
    return done


def held_prefix(layout: StoreLayout, ids: tuple[list[int], ...], hashes: list[str]) -> list[GroupTransfer]:
    """The blocks ``hashes`` of a prefix vLLM holds itself, per group (``StepPlan.held``): where
    vLLM keeps a block of its own, no lookup or load of it touches L3 again. A state group's is
    the checkpoint at the prefix end, asked for only (no block: vLLM's block there may hold the
    running state by now, which is never stored under the prefix's key)."""
    transfers = []
    for group in layout.groups:
        if group.kind == STATE:
            transfers.append(GroupTransfer(group.group_id, hashes[-1:], []))
            continue
        row = ids[group.group_id]
        kept = [i for i in range(min(len(hashes), len(row))) if row[i] != 0]
        if kept:
            transfers.append(GroupTransfer(group.group_id, [hashes[i] for i in kept], [row[i] for i in kept]))
    return transfers


def failed_load(layout: StoreLayout, ids: tuple[list[int], ...] | None, first: int) -> list[GroupTransfer]:
    """A load for the worker to fail (no objects), with the anchor's blocks from ``first`` on
    (``ids``: vLLM's per group): a vLLM that asks ``get_finished`` learns of the failure by them."""
    row = ids[layout.anchor.group_id] if ids is not None else []
    return [GroupTransfer(layout.anchor.group_id, [], [b for b in row[first:] if b])]


class SchedulerSide:
    """Lookup and planning state of the scheduler role (one per engine)."""

    def __init__(
        self,
        engine: StorageEngine,
        layout: StoreLayout,
        identity: EngineIdentity,
        *,
        may_load: bool = True,
        may_save: bool = True,
        extra_keys: ExtraKeys | None = None,
    ) -> None:
        self.engine = engine
        #: a block's extra keys (see :func:`vllm_extra_keys`); None: requests with any are skipped
        self.extra_keys = extra_keys
        self.layout = layout
        self.identity = identity
        #: vLLM's ``kv_role``: a consumer (``kv_consumer``) only loads, a producer only saves
        self.may_load, self.may_save = may_load, may_save
        self.block_size = layout.block_size
        self.requests: dict[str, _Request] = {}
        self.kv_cache_manager: Any = None
        self.stats = {"lookups": 0, "offered_blocks": 0, "loads_planned": 0, "save_blocks_planned": 0}
        #: mixed into every chain root after ``reset``: "" until the first
        self._generation = ""
        self._instance = uuid.uuid4().hex  # owns its requests' decode-time checkpoints
        self.drops: list[str] = []  # own checkpoints no lookup asks for again (``StepPlan.drops``)
        self._written: set[int] | None = None  # vLLM blocks written since ``reset`` (None: none yet)

    # --- keys ---------------------------------------------------------------------------------

    def _state(self, request: Any) -> _Request:
        state = self.requests.get(request.request_id)
        if state is None:
            state = _Request(request, self._root(request), f"{self._instance}:{request.request_id}")
            self.requests[request.request_id] = state
        state.uncacheable_now(self.extra_keys, self.block_size)
        return state

    def _root(self, request: Any) -> str:
        """The chain root of a request: the namespace, its cache salt, the reset generation."""
        salt = getattr(request, "cache_salt", None) or ""
        return self.identity.chain_root(f"{salt}\x00reset:{self._generation}" if self._generation else salt)

    def reset(self) -> None:
        """vLLM's ``reset_prefix_cache(reset_connector=True)``, which it issues after a weight
        update: nothing stored before may be served again (it is another model's state now).
        The shared L3 is not emptied (other instances still run the old weights): this
        instance keys everything under a fresh generation from now on, its requests' hashes
        included, so it neither reads the old objects nor writes new KV under their keys."""
        self._generation, self._written = uuid.uuid4().hex, set()
        for state in self.requests.values():
            self.drops += state.own_keys()  # keyed by the old generation: nobody's now
            state.root, state.hashes = self._root(state.request), []
            state.stored_blocks = state.hit_blocks = 0
            state.save_from, state.last_lookup, state.pending_load = None, None, None
            state.reset_while_running = True  # its blocks so far are the old weights': never held
            state.decode_states.clear()

    def _hashes(self, state: _Request, blocks: int) -> list[str]:
        """Chain hashes of the first ``blocks`` blocks of the request's tokens (extended lazily,
        a block's extra keys mixed into its link)."""
        if blocks > len(state.hashes):
            assert self.extra_keys is not None or not state.extras, "never hashed: extra keys unknown"
            extras = self.extra_keys if state.extras else None
            extend_chain(state.hashes, state.root, state.request, blocks, self.block_size, extras)
        return state.hashes[:blocks]

    # --- lookup -------------------------------------------------------------------------------

    def matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """``get_num_new_matched_tokens``: tokens loadable beyond vLLM's local hit, async."""
        state = self._state(request)  # a producer too: its saves are planned from this state
        if not self.may_load:
            return 0, False
        if state.load_failed or state.uncacheable:  # (existence answers may lag removal of bad objects)
            return 0, False
        # A request waiting for blocks is asked about at every step: each answer is fresh (its
        # own saves or another request's may have added blocks), but the stats count a lookup
        # once per (computed tokens, prompt length, preemptions) -- not once per step it waits;
        # a request preempted before it sampled a token, its blocks gone, asks the same again
        asked = (num_computed_tokens, request.num_tokens, getattr(request, "num_preemptions", 0))
        counted = state.last_lookup != asked
        state.last_lookup = asked
        if counted:
            self.stats["lookups"] += 1
        # at least one token is always computed (vLLM samples from it): a prompt of whole blocks
        # is offered one block less, but asked about whole, so a stored last block is not saved
        # again (it was, at every repeat)
        most = (request.num_tokens - 1) // self.block_size
        whole = request.num_tokens // self.block_size
        local = num_computed_tokens // self.block_size
        if whole <= local:
            return 0, False
        hashes = self._hashes(state, whole)
        blocks, stored = self._usable_blocks(state, hashes, local, most)
        state.hit_blocks, state.lookup_from = blocks, local
        # from L3's first gap on (an eviction, a failed put) blocks are saved when computed: a
        # resumed request's own saves had passed a gap, which then stranded every block after it
        state.stored_blocks = max(local, stored)
        if blocks <= local:
            return 0, False
        if counted:
            self.stats["offered_blocks"] += blocks - local
        return blocks * self.block_size - num_computed_tokens, True

    def _usable_blocks(self, state: _Request, hashes: list[str], local: int, most: int) -> tuple[int, int]:
        """``(usable, stored)``: the longest prefix of at most ``most`` blocks every
        group can restore on top of the ``local`` blocks vLLM holds itself (anchor blocks from
        there on, then each group's rule), and the longest of any length, or 0 if none beyond
        them. Keys are chained, so a block's object stands for its whole prefix: blocks below
        ``local`` need not be stored (L3 may have evicted a prefix vLLM keeps serving from its own
        cache), and each group's blocks below it are vLLM's (its own hit at ``local`` holds every
        group's)."""
        anchor = self.layout.anchor
        stateful = anchor.kind == STATE  # (no attention group: the state groups' rule decides)
        count = len(hashes) if stateful else local + leading_run(self.engine, anchor.pool, hashes[local:])
        if count <= local:
            return 0, 0
        # the groups whose rule decides beyond the anchor's run (a state anchor's own included)
        ruled = self.layout.groups if stateful else self.layout.groups[1:]
        present: dict[int, list[bool]] = {}
        for group in ruled:
            result = self.engine.exists(group.pool, state.object_keys(group, hashes, range(local, count)))
            found = list(result.ok) if result.error is None else [False] * (count - local)
            present[group.group_id] = [True] * local + found
        stored = 0
        for n in range(count, local, -1):  # from the longest: at most one more than ``most``
            if all(all(present[g.group_id][i] for i in g.needed_blocks(n)) for g in ruled):
                stored = stored or n
                if n <= most:
                    return n, stored
        return 0, stored

    def after_alloc(self, request: Any, num_external_tokens: int) -> None:
        """``update_state_after_alloc``: vLLM accepted ``num_external_tokens`` from us."""
        state = self.requests.get(request.request_id)
        if state is None or num_external_tokens <= 0:
            return
        first = state.lookup_from
        end = first + num_external_tokens // self.block_size
        if end > state.hit_blocks or num_external_tokens % self.block_size:
            log.warning(
                "kvstrata: vLLM accepted %d external tokens for %s, beyond the %d blocks found; "
                "failing the load (vLLM recomputes)",
                num_external_tokens,
                request.request_id,
                state.hit_blocks,
            )
            # the request waits for a load report: a failed one, never none (it would wait forever)
            state.pending_load = (first, -1)
            return
        state.pending_load = (first, end)

    # --- the step plan ------------------------------------------------------------------------

    def build_plan(self, scheduler_output: Any) -> StepPlan:
        plan = StepPlan()
        for req_id, state in self.requests.items():
            if state.pending_load is None:
                continue
            first, end = state.pending_load
            state.pending_load = None
            transfers = self._load_transfers(req_id, state, first, end) if end >= 0 else None
            transfers = transfers or failed_load(self.layout, self._block_ids(req_id), first)
            plan.loads[req_id] = transfers
            self.stats["loads_planned"] += 1
        if not self.may_save:
            return plan
        saves: dict[int, GroupTransfer] = {}
        offers, restarts = handed_over(scheduler_output), restarted(scheduler_output)
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            state = self.requests.get(req_id)
            if state is None or scheduled <= 0 or state.uncacheable_now(self.extra_keys, self.block_size):
                continue
            computed = state.request.num_computed_tokens
            if req_id in restarts or not state.prefill_end:
                state.prefill_end = len(state.request.all_token_ids)
            starting = state.save_from is None and not state.reset_while_running
            self._plan_saves(req_id, state, computed, scheduled, saves, plan.stored)
            if starting and state.save_from and (ids := self._block_ids(req_id)) is not None:
                plan.held += held_prefix(self.layout, ids, self._hashes(state, state.save_from))
            offered = offers.get(req_id, [])
            self._plan_checkpoints(req_id, state, computed, computed + scheduled, offered, saves)
        plan.saves, plan.stored = once_each(saves.values(), plan.stored, self.block_size)
        self.stats["save_blocks_planned"] += sum(len(hashes) for hashes, _, _ in plan.stored)
        if self._written is not None:  # (loads and saves: the blocks this step writes)
            moved = [*saves.values(), *(t for transfers in plan.loads.values() for t in transfers)]
            self._written.update(block for transfer in moved for block in transfer.block_ids)
            plan.held = written_since(plan.held, self._written)
        plan.drops, self.drops = self.drops, []  # removed after this step's saves
        return plan

    def _plan_checkpoints(
        self,
        req_id: str,
        state: _Request,
        step_start: int,
        step_end: int,
        offered: list[Checkpoint],
        saves: dict[int, GroupTransfer],
    ) -> None:
        """The state checkpoints the step leaves (``_vllm_checkpoints``): a prefill's under the
        block's key, a decode step's under the request's own."""
        tokens = len(state.request.all_token_ids)
        ids = partial(self._block_ids, req_id)
        for group_id, block_id, blocks in step_checkpoints(
            self.layout, step_start, step_end, tokens, state.save_from or 0, ids, offered
        ):
            key = self._hashes(state, blocks)[blocks - 1]
            key = state.checkpoint_key(
                blocks - 1, key, blocks * self.block_size > state.prefill_end, self.drops
            )
            target = saves.setdefault(group_id, GroupTransfer(group_id, [], []))
            target.hashes.append(key)
            target.block_ids.append(block_id)

    def _block_ids(self, req_id: str) -> tuple[list[int], ...] | None:
        if self.kv_cache_manager is None:
            return None
        try:
            return self.kv_cache_manager.get_block_ids(req_id)
        except (KeyError, AssertionError):
            return None

    def _load_transfers(
        self, req_id: str, state: _Request, first: int, end: int
    ) -> list[GroupTransfer] | None:
        """The transfers of a load, anchor first; None where vLLM holds no block to load into."""
        ids = self._block_ids(req_id)
        hashes = self._hashes(state, end)
        transfers = []
        # anchor first: a reader reads the commit marker before the components
        for group in self.layout.groups:
            wanted = [i for i in group.needed_blocks(end) if i >= first or group.kind == STATE]
            row = ids[group.group_id] if ids is not None else []  # (short where vLLM holds fewer)
            blocks = [row[i] for i in wanted if i < len(row)]
            if len(blocks) < len(wanted) or 0 in blocks:  # no block to load into (or a null one):
                return None  # the worker reports the load failed
            transfers.append(GroupTransfer(group.group_id, state.object_keys(group, hashes, wanted), blocks))
        return transfers

    def _plan_saves(
        self,
        req_id: str,
        state: _Request,
        computed: int,
        scheduled: int,
        saves: dict[int, GroupTransfer],
        stored: list[Stored],
    ) -> None:
        """Attention and window blocks this step completes (Mamba states: ``_plan_checkpoints``);
        the range goes to ``stored`` too (the workers announce it once stored)."""
        bs = self.block_size
        if state.save_from is None:  # what vLLM held itself (or loaded) when it first ran it
            state.save_from = computed // bs
        # a block whose last token id is not known yet (vLLM's async scheduling appends a sampled
        # token a step late) is saved in the next step: ``first`` is where saving stopped
        end_tokens = min(computed + scheduled, len(state.request.all_token_ids))
        end = end_tokens // bs
        first = max(state.save_from, state.stored_blocks)
        if end <= first:
            return
        ids = self._block_ids(req_id)
        if ids is None:
            return
        hashes = self._hashes(state, end)
        for group in self.layout.groups:
            if group.kind == STATE:
                continue
            row = ids[group.group_id]
            target = saves.setdefault(group.group_id, GroupTransfer(group.group_id, [], []))
            for i in range(first, end):
                if i < len(row) and row[i] != 0:
                    target.hashes.append(hashes[i])
                    target.block_ids.append(row[i])
        state.stored_blocks = end
        tokens = state.request.all_token_ids[first * bs : end * bs]
        stored.append((hashes[first:end], hashes[first - 1] if first else None, list(tokens)))

    def loads_failed(self, req_ids: set[str]) -> None:
        """The workers could not load these requests (damaged, foreign or missing objects; the
        workers announce the blocks they removed)."""
        live = [self.requests[req_id] for req_id in req_ids if req_id in self.requests]
        for state in live:
            state.load_failed, state.stored_blocks, state.hit_blocks = True, 0, 0
        # one that finished meanwhile (aborted while its load ran) recomputes nothing: apart
        for key, count in (("load_failures", len(live)), ("aborted_load_failures", len(req_ids) - len(live))):
            self.stats[key] = self.stats.get(key, 0) + count

    def finished(self, request: Any) -> None:
        state = self.requests.pop(request.request_id, None)
        if state is not None and self.may_save:  # its own checkpoints: never asked for again
            self.drops += state.own_keys()
