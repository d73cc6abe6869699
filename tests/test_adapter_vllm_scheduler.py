"""The scheduler role of the vLLM connector, driven without vLLM: requests and vLLM's scheduler
output as plain objects with the fields the connector reads, the real storage engine and file
backend under it, and a worker saving real blocks from a paged tensor where a test needs objects.

What vLLM itself shows (tests/test_adapter_vllm.py, real engines) is not repeated here; these are
the paths a CPU engine does not take: vLLM's async scheduling (its GPU default), a prefix vLLM
keeps locally after L3 evicted it, a lookup asked again while a request waits for blocks, a load
vLLM accepts beyond what was found, and requests whose KV depends on more than token ids.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvstrata.adapters._shared import EngineStorage
from kvstrata.adapters._vllm_keys import private_key
from kvstrata.adapters._vllm_layout import StoreLayout, build_layout, identity_of
from kvstrata.adapters._vllm_scheduler import SchedulerSide, StepPlan
from kvstrata.adapters._vllm_worker import WorkerSide
from kvstrata.core.config import load
from kvstrata.core.storage_batch import BatchResult
from kvstrata.engine_kit import ParallelConfig

REPO = Path(__file__).resolve().parents[1]
BS, BLOCKS, HEADS, HEAD_DIM = 16, 16, 1, 8


class FullAttentionSpec(SimpleNamespace):
    pass


def _attention() -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=BS, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype="bfloat16",
        real_page_size_bytes=2 * BS * HEADS * HEAD_DIM * 2,
    )  # fmt: skip


def _layout(groups: dict[str, Any] | None = None) -> StoreLayout:
    """The store layout of KV cache groups ``{layer name: spec}`` (default: one attention group)."""
    groups = groups or {"layers.0.self_attn": _attention()}
    kv_cache_config = SimpleNamespace(
        kv_cache_groups=[
            SimpleNamespace(kv_cache_spec=spec, layer_names=[name]) for name, spec in groups.items()
        ],
        prefix_cacheable_group_ids=tuple(range(len(groups))),
        kv_cache_layout=None,
        num_blocks=BLOCKS,
    )
    return build_layout(_layout_config(), kv_cache_config, model_name="m", weights="w")


def _storage(layout: StoreLayout, l3: Path, *overrides: str) -> EngineStorage:
    """A file L3 at ``l3`` (``overrides``: more of its settings) with a pool per group of ``layout``."""
    settings = [f"tiers.storage.l3.path={l3}", *(f"tiers.storage.l3.{o}" for o in overrides)]
    config = load([REPO / "tests" / "stacks" / "kv.yaml"], overrides=settings)
    storage = EngineStorage(identity_of(layout, ParallelConfig()), "l3", config.tiers.storage["l3"])
    for group in layout.groups:
        assert storage.add_pool(group.pool, group.spec).enabled
    return storage


def _request(rid: str, tokens: list[int], **fields: Any) -> Any:
    """A request with the fields the connector reads, nothing computed yet."""
    return SimpleNamespace(
        request_id=rid, all_token_ids=list(tokens), num_tokens=len(tokens), num_computed_tokens=0,
        cache_salt=None, lora_request=None, mm_features=[],
        prompt_embeds=None, **fields,
    )  # fmt: skip


def _layout_config() -> Any:
    """The parts of vLLM's config the layout reads."""
    return SimpleNamespace(
        model_config=SimpleNamespace(model="m", served_model_name="m", revision=None, dtype="bfloat16"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        cache_config=SimpleNamespace(cache_dtype="auto"),
    )


class Engine:
    """One scheduler and one worker over a file L3, and a request's lifecycle as vLLM drives it."""

    def __init__(self, l3: Path, l3_settings: tuple[str, ...] = (), **scheduler: Any) -> None:
        self.layout = _layout()
        self.storage = _storage(self.layout, l3, *l3_settings)
        self.engine = self.storage.engine
        identity = identity_of(self.layout, ParallelConfig())
        self.scheduler = SchedulerSide(self.engine, self.layout, identity, **scheduler)
        self.block_ids: dict[str, list[int]] = {}
        self.planned_stores: list[tuple[list[str], str | None, list[int]]] = []  # every plan's
        self.scheduler.kv_cache_manager = SimpleNamespace(get_block_ids=lambda rid: (self.block_ids[rid],))
        self.worker = WorkerSide(self.engine, self.layout)
        cache = torch.randint(-100, 100, (BLOCKS, 2, BS, HEADS, HEAD_DIM)).to(torch.bfloat16)
        self.worker.register({"layers.0.self_attn": cache})
        self.exists_calls = 0
        real_exists, real_prefix = self.engine.exists, self.engine.exists_prefix

        def counted(real: Any) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                self.exists_calls += 1
                return real(*args, **kwargs)

            return call

        self.engine.exists, self.engine.exists_prefix = counted(real_exists), counted(real_prefix)

    def request(self, rid: str, tokens: list[int], **fields: Any) -> Any:
        self.block_ids[rid] = list(range(1, BLOCKS))  # block 0 is vLLM's null block
        return _request(rid, tokens, **fields)

    def step(self, scheduled: dict[str, int]) -> Any:
        """One engine step: the plan built after scheduling, the worker's saves and loads."""
        plan = self.scheduler.build_plan(SimpleNamespace(num_scheduled_tokens=scheduled))
        self.planned_stores += plan.stored
        self.worker.save(plan)
        for transfers in plan.loads.values():
            self.worker.load(SimpleNamespace(loads={"r": transfers}, saves=[]))
        return plan

    def saved_blocks(self, request: Any) -> list[int]:
        """Which blocks of ``request`` the scheduler planned to store (from its event log)."""
        hashes = self.scheduler._hashes(
            self.scheduler.requests[request.request_id], len(request.all_token_ids) // BS
        )
        return sorted({hashes.index(h) for logged, _, _ in self.planned_stores for h in logged})

    def close(self) -> None:
        self.storage.close()


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[Any]:
    made: list[Engine] = []

    def make(l3_settings: tuple[str, ...] = (), **scheduler: Any) -> Engine:
        made.append(Engine(tmp_path / "l3", l3_settings, **scheduler))
        return made[-1]

    yield make
    for engine in made:
        engine.close()


def _decode(engine: Engine, request: Any, steps: int, *, async_output: bool) -> None:
    """A prefill, then one token per step. vLLM advances ``num_computed_tokens`` when it schedules;
    a sampled token joins ``all_token_ids`` when its step's output is processed: before the next
    step is scheduled (sync), or after it (async scheduling, one step late)."""
    if request.request_id not in engine.scheduler.requests:  # vLLM looks every new request up
        engine.scheduler.matched_tokens(request, 0)
    late: list[int] = []
    scheduled = len(request.all_token_ids)
    for token in range(1000, 1000 + steps):
        engine.step({request.request_id: scheduled})
        request.num_computed_tokens += scheduled
        if async_output:
            request.all_token_ids.extend(late)
            late = [token]
        else:
            request.all_token_ids.append(token)
        request.num_tokens = len(request.all_token_ids)
        scheduled = 1


@pytest.mark.parametrize("async_output", [False, True], ids=["sync", "async"])
def test_blocks_completed_while_decoding_are_saved_with_async_scheduling_too(
    engines: Any, async_output: bool
) -> None:
    """A 20-token prompt decoding 30 tokens fills blocks 0-2: each is saved, also when the token
    that completes a block reaches the connector a step after the block's KV was computed."""
    engine = engines()
    request = engine.request("r", list(range(1, 21)))
    assert engine.scheduler.matched_tokens(request, 0) == (0, False)
    _decode(engine, request, 31, async_output=async_output)
    assert engine.saved_blocks(request) == [0, 1, 2]
    assert engine.worker.stats["saved_blocks"] == 3


def test_blocks_beyond_a_local_hit_are_found_when_l3_lost_the_prefix(engines: Any) -> None:
    """vLLM holds block 0 itself and L3 evicted it (a prefix served locally is never read from
    L3, so it is what an LRU drops first): block 1, still stored, is offered on top of the local
    hit -- keys are chained, so block 1's object stands for its whole prefix."""
    engine = engines()
    prompt = list(range(1, 3 * BS + 5))
    writer = engine.request("w", prompt)
    _decode(engine, writer, 1, async_output=False)
    assert engine.saved_blocks(writer) == [0, 1, 2]
    _lose_block_0(engine)
    reader = engines().request("r", prompt)
    other = engine.scheduler.__class__(engine.engine, engine.layout, engine.scheduler.identity)
    assert other.matched_tokens(reader, 0) == (0, False), "nothing from block 0 without it"
    local = engine.scheduler.__class__(engine.engine, engine.layout, engine.scheduler.identity)
    assert local.matched_tokens(reader, BS) == (2 * BS, True), "blocks 1 and 2 on top of vLLM's block 0"


def _lose_block_0(engine: Engine) -> list[str]:
    """L3 loses request ``w``'s block 0 (another process's LRU evicted it), vLLM keeps it; the
    hashes of ``w``'s three blocks."""
    hashes = engine.scheduler._hashes(engine.scheduler.requests["w"], 3)
    (keys,) = engine.engine.object_keys(engine.layout.anchor.pool, hashes[:1])
    assert engine.engine.backend.remove(keys) == [True]
    return hashes


def _serve_after_local_hit(engine: Engine, request: Any, local_blocks: int) -> None:
    """vLLM's path for a request whose first ``local_blocks`` blocks it holds itself: looked up
    on top of them, its prefill of the rest, one decode step."""
    assert engine.scheduler.matched_tokens(request, local_blocks * BS) == (0, False)
    request.num_computed_tokens = local_blocks * BS
    engine.step({request.request_id: len(request.all_token_ids) - local_blocks * BS})
    request.num_computed_tokens = len(request.all_token_ids)
    request.all_token_ids.append(999)
    request.num_tokens = len(request.all_token_ids)
    engine.step({request.request_id: 1})


def test_a_prefix_l3_lost_while_vllm_served_it_locally_is_stored_again(engines: Any) -> None:
    """L3 evicted block 0 while vLLM kept serving it from its own cache: the next request that
    gets it locally stores it again (from vLLM's block), so another engine's lookup, which
    starts at block 0, finds the whole prompt again (audit 36: it found nothing, for good)."""
    engine = engines()
    prompt = list(range(1, 3 * BS + 5))
    _decode(engine, engine.request("w", prompt), 1, async_output=False)
    hashes = _lose_block_0(engine)
    fresh = engine.scheduler.__class__(engine.engine, engine.layout, engine.scheduler.identity)
    assert fresh.matched_tokens(_request("probe", prompt), 0) == (0, False)
    saved = engine.worker.stats["saved_blocks"]
    _serve_after_local_hit(engine, engine.request("r", [*prompt[: 2 * BS], *range(700, 710)]), 2)
    assert fresh.matched_tokens(_request("probe2", prompt), 0) == (3 * BS, True)
    assert engine.worker.stats["resaved_blocks"] == 1
    assert engine.worker.stats["saved_blocks"] == saved + 1, "block 0 only: block 1 is still stored"
    announced = [logged for logged, _, _ in engine.planned_stores if hashes[0] in logged]
    assert len(announced) == 1, "announced when first stored, not again"


def test_a_hot_prefix_vllm_serves_locally_outlives_colder_blocks_in_a_bounded_l3(
    engines: Any, tmp_path: Path
) -> None:
    """Six chats share a two-block system prompt; the first stores it, the others hit it in
    vLLM's own cache. L3 holds ten objects (LRU): the system prompt's blocks, used by every
    chat, must not be the ones it evicts -- a fresh engine then finds the last chat whole."""
    probe = Engine(tmp_path / "probe")  # one object's size on disk
    _decode(probe, probe.request("p", list(range(1, BS + 2))), 1, async_output=False)
    (size,) = {f.stat().st_size for f in (tmp_path / "probe").rglob("*.blk")}
    probe.close()
    engine = engines((f"capacity_bytes={10 * size}",))
    system = list(range(1, 2 * BS + 1))
    chats = [[*system, *range(1000 * i, 1000 * i + 2 * BS + 5)] for i in range(1, 7)]
    _decode(engine, engine.request("c1", chats[0]), 1, async_output=False)
    for n, chat in enumerate(chats[1:], start=2):
        _serve_after_local_hit(engine, engine.request(f"c{n}", chat), 2)
    assert engine.worker.stats["saved_blocks"] == 4 + 5 * 2
    fresh = engine.scheduler.__class__(engine.engine, engine.layout, engine.scheduler.identity)
    assert fresh.matched_tokens(_request("again", chats[-1]), 0) == (4 * BS, True)
    assert fresh.matched_tokens(_request("first", chats[0]), 0) == (2 * BS, True), "its own blocks went"


def test_a_prompt_of_whole_blocks_found_stored_is_not_stored_again(engines: Any) -> None:
    """A prompt of exactly two blocks is offered one (vLLM computes at least its last token), but
    both are stored: its last block was put again at every repeat, since the lookup asked only
    about the blocks it could offer (audit 27: 2 puts of stored objects in 2 repeats)."""
    engine = engines()
    prompt = list(range(1, 2 * BS + 1))
    _decode(engine, engine.request("w", prompt), 1, async_output=False)
    saved = engine.worker.stats["saved_blocks"]
    assert saved == 2
    again = engine.request("again", prompt)
    assert engine.scheduler.matched_tokens(again, 0) == (BS, True), "one block offered"
    _decode(engine, again, 1, async_output=False)
    assert engine.worker.stats["saved_blocks"] == saved, "neither block is stored again"
    longer = engine.request("longer", [*prompt, *range(500, 500 + BS)])  # a third block: saved
    _decode(engine, longer, 1, async_output=False)
    assert engine.worker.stats["saved_blocks"] == saved + 1


def test_a_lookup_asked_again_is_answered_fresh_and_counted_once(engines: Any) -> None:
    """vLLM looks a request up at every step while it waits for blocks: each answer is fresh
    (blocks stored meanwhile count), the lookup and its offered blocks are counted once; a new
    local hit (after a preemption) is a new lookup."""
    engine = engines()
    prompt = list(range(1, 3 * BS + 5))
    writer = engine.request("w", prompt[: 2 * BS + 1])
    _decode(engine, writer, 1, async_output=False)  # stores blocks 0 and 1
    reader = engine.request("r", prompt)
    stats = dict(engine.scheduler.stats)
    assert engine.scheduler.matched_tokens(reader, 0) == (2 * BS, True)
    assert [engine.scheduler.matched_tokens(reader, 0) for _ in range(3)] == [(2 * BS, True)] * 3
    _decode(engine, engine.request("w2", prompt), 1, async_output=False)  # block 2 stored meanwhile
    assert engine.scheduler.matched_tokens(reader, 0) == (3 * BS, True), "answered fresh"
    assert engine.scheduler.stats["lookups"] - stats["lookups"] == 2  # the reader's, and w2's
    assert engine.scheduler.stats["offered_blocks"] - stats["offered_blocks"] == 2 + 2
    assert engine.scheduler.matched_tokens(reader, BS) == (2 * BS, True)
    assert engine.scheduler.stats["lookups"] - stats["lookups"] == 3


def test_a_load_accepted_beyond_what_was_found_fails_rather_than_hangs(engines: Any) -> None:
    """vLLM waits for a report of every load it accepted: one the connector cannot plan is sent
    to the worker as a load that fails (vLLM recomputes), never left unplanned."""
    engine = engines()
    prompt = list(range(1, 3 * BS + 5))
    _decode(engine, engine.request("w", prompt), 1, async_output=False)
    reader = engine.request("r", prompt)
    assert engine.scheduler.matched_tokens(reader, 0) == (3 * BS, True)
    engine.scheduler.after_alloc(reader, 4 * BS)  # more than the three blocks found
    plan = engine.step({})
    assert list(plan.loads) == ["r"]
    # the blocks vLLM holds for the request: for a vLLM that asks ``get_finished``, which reports
    # a failed load by its blocks (``get_block_ids_with_load_errors``)
    assert [t.block_ids for t in plan.loads["r"]] == [engine.block_ids["r"]]
    assert engine.worker.take_finished() == ({"r"}, {"r"})  # finished, and failed


@pytest.mark.parametrize("table", [[], [1]], ids=["no-blocks", "one-block-short"])
def test_a_load_with_no_block_to_load_into_fails_that_load_not_the_scheduler(
    engines: Any, table: list[int]
) -> None:
    """vLLM's ``get_block_ids`` answers a request it holds fewer blocks of than the load needs
    with a short row (empty lists for none, never a KeyError): that load fails (vLLM recomputes
    the request), and ``build_connector_meta`` -- inside vLLM's ``schedule()`` -- does not raise
    (audit s35: the row was indexed before its length was checked)."""
    engine = engines()
    prompt = list(range(1, 3 * BS + 5))
    _decode(engine, engine.request("w", prompt), 1, async_output=False)
    reader = engine.request("r", prompt)
    assert engine.scheduler.matched_tokens(reader, 0) == (3 * BS, True)
    engine.scheduler.after_alloc(reader, 3 * BS)
    engine.block_ids["r"] = table
    plan = engine.step({})
    assert list(plan.loads) == ["r"]
    assert [t.block_ids for t in plan.loads["r"]] == [table], "what vLLM holds (for get_finished)"
    assert engine.worker.take_finished() == ({"r"}, {"r"})  # finished, and failed


def test_extra_keys_separate_requests_of_the_same_tokens(engines: Any) -> None:
    """A block whose KV depends on more than its token ids (a LoRA adapter, images, prompt
    embeddings) hashes its extra keys in, as vLLM's own prefix cache does; where vLLM cannot say
    what they are, such a request is neither looked up nor saved."""

    def extra_keys(request: Any, start: int, end: int) -> tuple[Any, ...] | None:
        return ("lora", request.lora_request.lora_name) if request.lora_request else None

    engine = engines(extra_keys=extra_keys)
    prompt = list(range(1, 2 * BS + 5))
    base, adapted = (
        engine.request("base", prompt),
        engine.request(
            "lora",
            prompt,
        ),
    )
    adapted.lora_request = SimpleNamespace(lora_name="a", lora_path="/a")
    _decode(engine, base, 1, async_output=False)
    assert engine.scheduler.matched_tokens(adapted, 0) == (0, False), "never the base model's blocks"
    _decode(engine, adapted, 1, async_output=False)
    again = engine.request("again", prompt)
    again.lora_request = SimpleNamespace(lora_name="a", lora_path="/a")
    assert engine.scheduler.matched_tokens(again, 0) == (2 * BS, True), "its own blocks"
    other = engine.request("other", prompt)
    other.lora_request = SimpleNamespace(lora_name="b", lora_path="/b")
    assert engine.scheduler.matched_tokens(other, 0) == (0, False), "nor another adapter's"

    blind = engines()  # a vLLM without generate_block_hash_extra_keys
    refused = blind.request("x", prompt)
    refused.lora_request = SimpleNamespace(lora_name="a", lora_path="/a")
    assert blind.scheduler.matched_tokens(refused, 0) == (0, False)
    saved = blind.worker.stats["saved_blocks"]
    _decode(blind, refused, 1, async_output=False)
    assert blind.worker.stats["saved_blocks"] == saved and not blind.planned_stores


def test_a_reset_serves_nothing_stored_before_and_keys_anew(engines: Any) -> None:
    """vLLM resets the connector after a weight update: this instance neither finds what was
    stored before nor stores under those keys again (an instance still on the old weights keeps
    its objects); what it stores afterwards it finds."""
    engine = engines()
    prompt = list(range(1, 3 * BS + 5))
    _decode(engine, engine.request("before", prompt), 1, async_output=False)
    waiting = engine.request("waiting", prompt)
    assert engine.scheduler.matched_tokens(waiting, 0) == (3 * BS, True)
    old_hashes = list(engine.scheduler.requests["waiting"].hashes)
    engine.scheduler.reset()
    assert engine.scheduler.matched_tokens(waiting, 0) == (0, False), "a request known before too"
    assert not set(engine.scheduler.requests["waiting"].hashes) & set(old_hashes)
    assert engine.scheduler.matched_tokens(engine.request("after", prompt), 0) == (0, False)
    _decode(engine, engine.request("stores", prompt), 1, async_output=False)
    assert engine.scheduler.matched_tokens(engine.request("finds", prompt), 0) == (3 * BS, True)
    other = SchedulerSide(engine.engine, engine.layout, engine.scheduler.identity)  # old weights
    assert other.matched_tokens(engine.request("elsewhere", prompt), 0) == (3 * BS, True)
    assert other._hashes(other.requests["elsewhere"], 3) == old_hashes[:3]


class MambaSpec(SimpleNamespace):
    pass


def _mamba() -> MambaSpec:
    return MambaSpec(
        block_size=BS, shapes=((3, 50),), dtypes=("int8",), mamba_cache_mode="align", real_page_size_bytes=150
    )


def test_a_model_of_state_groups_only_is_offered_only_stored_checkpoints(tmp_path: Path) -> None:
    """With no attention group the anchor is a state group: its own rule (the checkpoint at the
    prefix end) decides what is offered -- nothing stored, nothing offered (a load that cannot
    succeed costs the request a failed load and a recompute)."""
    layout = _layout({"layers.0.mixer": _mamba()})
    storage = _storage(layout, tmp_path)
    try:
        scheduler = SchedulerSide(storage.engine, layout, identity_of(layout, ParallelConfig()))
        request = _request("r", list(range(1, 3 * BS + 5)))
        assert scheduler.matched_tokens(request, 0) == (0, False)
    finally:
        storage.close()


def test_the_workers_announce_only_the_blocks_they_stored(engines: Any) -> None:
    """vLLM's ``BlockStored`` events come from the workers after their saves: a range whose anchor
    objects were stored is announced (hashes, parent, tokens), one whose save failed is not, and a
    range stored only up to a failed block is announced up to it."""
    engine = engines()
    prompt = list(range(1, 3 * BS + 5))
    _decode(engine, engine.request("ok", prompt), 1, async_output=False)
    ((hashes, parent, tokens),) = engine.worker.stored_ranges
    assert len(hashes) == 3 and parent is None and tokens == prompt[: 3 * BS]
    assert engine.planned_stores == [(hashes, parent, tokens)]

    failing = engines()
    real_put = failing.engine.put

    def put(pool: str, keys: list[str], units: Any) -> Any:  # FAULT INJECTION: block 1 not stored
        result = real_put(pool, keys, units)
        result.ok[1:2] = [False] * len(result.ok[1:2])
        return result

    failing.engine.put = put
    _decode(failing, failing.request("partly", [t + 1000 for t in prompt]), 1, async_output=False)
    ((hashes, _, tokens),) = failing.worker.stored_ranges
    assert len(hashes) == 1 and tokens == [t + 1000 for t in prompt[:BS]]


@pytest.mark.parametrize("fault", ["block_1_damaged", "backend_outage"])
def test_a_failed_load_names_removed_only_the_blocks_l3_no_longer_serves(engines: Any, fault: str) -> None:
    # every block of a failed load was announced removed: a router dropped blocks still served
    # (those below the damaged one; all of them after an outage, which removes nothing). The
    # worker names what it refused and removed, and the blocks after it (keys are chained)
    engine = engines()
    prompt = list(range(1, 3 * BS + 5))
    _decode(engine, engine.request("w", prompt), 1, async_output=False)
    reader = engine.request("r", prompt)
    assert engine.scheduler.matched_tokens(reader, 0) == (3 * BS, True)
    hashes = engine.scheduler._hashes(engine.scheduler.requests["r"], 3)
    anchor = engine.layout.anchor.pool
    real_get = engine.engine.get
    if fault == "block_1_damaged":
        (keys,) = engine.engine.object_keys(anchor, hashes[1:2])
        path = engine.storage.backend.path_for(keys[0])
        path.write_bytes(path.read_bytes()[:-8] + b"damaged!")
    else:

        def get(*args: Any, **kwargs: Any) -> Any:  # FAULT INJECTION: the backend is down once
            engine.engine.get = real_get
            raise OSError("connection refused")

        engine.engine.get = get
    engine.scheduler.after_alloc(reader, 3 * BS)
    engine.step({})
    assert engine.worker.take_finished() == ({"r"}, {"r"})
    expected = [hashes[1:]] if fault == "block_1_damaged" else []  # a miss or a failed call: none
    assert engine.worker.take_removed_ranges() == expected
    assert engine.worker.take_removed_ranges() == []
    assert engine.engine.exists(anchor, hashes).ok == [True, fault != "block_1_damaged", True]


def test_a_store_that_cannot_take_saves_says_why_at_start_and_at_the_first_failed_save(
    engines: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An L3 directory that cannot be written was accepted in silence: every save failed, seen
    only in ``save_failures`` (audit 29). The engine's start asks the store (``write_problem``,
    what the connector logs as a warning) and the first failed save logs its reason."""
    engine = engines()
    assert engine.storage.write_problem() is None
    gone = tmp_path / "gone"
    storage = _storage(engine.layout, gone)
    try:  # the directory replaced by a file after the store opened (root passes permission bits)
        shutil.rmtree(gone)
        gone.write_text("not a directory")
        problem = storage.write_problem()
        assert problem is not None and str(gone) in problem
    finally:
        storage.close()

    real_put = engine.engine.put

    def put(pool: str, keys: list[str], units: Any) -> Any:  # FAULT INJECTION: nothing stored
        result = real_put(pool, keys, units)
        return BatchResult([False] * len(result.ok), "disk full (injected)", failed=len(result.ok))

    engine.engine.put = put
    with caplog.at_level("WARNING", logger="kvstrata"):
        _decode(engine, engine.request("r", list(range(1, 3 * BS + 5))), 1, async_output=False)
        _decode(engine, engine.request("s", list(range(100, 3 * BS + 104))), 1, async_output=False)
    warnings = [record.getMessage() for record in caplog.records if "saving blocks" in record.getMessage()]
    assert len(warnings) == 1 and "disk full (injected)" in warnings[0]
    assert engine.worker.stats["save_failures"] == 6


class _Hybrid:
    """A scheduler and a worker of an attention + Mamba (align mode) layout over a file L3, and
    request ``r`` of 40 tokens (2 full blocks and 8 more), looked up once."""

    def __init__(self, tmp_path: Path) -> None:
        self.layout = _layout({"layers.0.self_attn": _attention(), "layers.1.mixer": _mamba()})
        self.storage = _storage(self.layout, tmp_path / "l3")
        identity = identity_of(self.layout, ParallelConfig())
        self.scheduler = SchedulerSide(self.storage.engine, self.layout, identity)
        # the block table: attention blocks 1-7, state blocks 8-15 (a checkpoint's block sits at
        # the index of the block whose end it is)
        rows = (list(range(1, 8)), list(range(8, BLOCKS)))
        self.scheduler.kv_cache_manager = SimpleNamespace(get_block_ids=lambda rid: rows)
        self.worker = WorkerSide(self.storage.engine, self.layout)
        self.worker.register(
            {
                "layers.0.self_attn": torch.randint(-100, 100, (BLOCKS, 2, BS, HEADS, HEAD_DIM)).to(
                    torch.bfloat16
                ),
                "layers.1.mixer": torch.randint(-100, 100, (BLOCKS, 1, 1, 150)).to(torch.int8),
            }
        )
        self.state_group = self.layout.groups[1].group_id
        self.request = _request("r", list(range(1, 41)))
        self.scheduler.matched_tokens(self.request, 0)

    def step(self, scheduled: int, **output: Any) -> dict[str, list[tuple[int, int]]]:
        """One step of ``scheduled`` tokens, saved by the worker: ``{kind: [(block index, block
        id)]}`` ("own state": under the request's own key); vLLM advances the request once
        scheduled, and the token a step samples joins it."""
        plan = self.scheduler.build_plan(SimpleNamespace(num_scheduled_tokens={"r": scheduled}, **output))
        self.worker.save(plan)
        hashes = self.scheduler._hashes(self.scheduler.requests["r"], len(self.request.all_token_ids) // BS)
        own = [private_key(h, self.scheduler.requests["r"].owner) for h in hashes]
        kinds = {g.group_id: g.kind for g in self.layout.groups}
        saved: dict[str, list[tuple[int, int]]] = {}
        for transfer in plan.saves:
            for key, block in zip(transfer.hashes, transfer.block_ids, strict=True):
                kind, index = (
                    (kinds[transfer.group_id], hashes.index(key))
                    if key in hashes
                    else ("own state", own.index(key))
                )
                saved.setdefault(kind, []).append((index, block))
        saved = {kind: sorted(pairs) for kind, pairs in saved.items()}
        self.request.num_computed_tokens += scheduled
        if self.request.num_computed_tokens >= len(self.request.all_token_ids):
            self.request.all_token_ids.append(1000 + self.request.num_computed_tokens)
        self.request.num_tokens = len(self.request.all_token_ids)
        return saved

    def decode_to(self, tokens: int, **output: Any) -> list[dict[str, list[tuple[int, int]]]]:
        return [self.step(1, **output) for _ in range(self.request.num_computed_tokens, tokens)]

    def offered(self, request: Any) -> int:
        """Tokens the connector offers ``request`` with nothing computed (vLLM holds none)."""
        return self.scheduler.matched_tokens(request, 0)[0]

    def decode_past_a_boundary(self) -> list[str]:
        """Prefill the 40 tokens, decode to 50: the checkpoint of block 2 is the request's own
        (a decode step's); returns its key."""
        self.step(32)
        self.step(8)
        self.decode_to(50)
        assert self.own_state_stored(2)
        return self.scheduler.requests["r"].own_keys()

    def idle_step(self) -> StepPlan:
        """A step that schedules nothing, planned and run by the worker."""
        plan = self.scheduler.build_plan(SimpleNamespace(num_scheduled_tokens={}))
        self.worker.save(plan)
        return plan

    def own_state_stored(self, index: int) -> bool:
        """Whether L3 holds request ``r``'s own (decode-time) checkpoint of block ``index``."""
        block_hash = self.scheduler._hashes(self.scheduler.requests["r"], index + 1)[index]
        pool = self.layout.groups[1].pool
        own = private_key(block_hash, self.scheduler.requests["r"].owner)
        return self.storage.engine.exists(pool, [own]).ok == [True]


def _offer(*entries: tuple[int, int, int]) -> dict[str, Any]:
    """vLLM 0.32's hand-off of this step's Mamba checkpoints: ``(group id, block id, tokens)``."""
    return {"kv_connector_block_state": SimpleNamespace(boundary_state_offloads={"r": list(entries)})}


def test_a_state_checkpoint_a_decode_step_leaves_serves_only_its_own_request(tmp_path: Path) -> None:
    """A Mamba state at a block boundary a decode step crossed differs in its low bits from what
    a prefill of the same tokens computes, and vLLM serves none to another request: a next turn
    restored from one left vLLM's own tokens (audit 29). It is stored under the request's own key:
    a next turn is offered the prefill's checkpoint, the request resumed after a preemption its
    own (it goes on as if never preempted). Without vLLM's hand-off (older vLLMs) a checkpoint is
    the block at a step's end on a boundary."""
    hybrid = _Hybrid(tmp_path)
    try:
        assert hybrid.step(32) == {"full": [(0, 1), (1, 2)], "state": [(1, 9)]}
        assert hybrid.step(8) == {}  # 40: no boundary
        decoded = hybrid.decode_to(50)
        assert decoded[-3] == {"full": [(2, 3)], "own state": [(2, 10)]}  # computing token 47
        assert [saved for saved in decoded if "state" in saved] == []
        next_turn = _request("t", hybrid.request.all_token_ids + list(range(600, 650)))
        assert hybrid.offered(next_turn) == 2 * BS  # the prompt's checkpoint, not the decode's
        hybrid.request.num_computed_tokens = 0  # preempted: vLLM freed its blocks
        assert hybrid.offered(hybrid.request) == 3 * BS
    finally:
        hybrid.storage.close()


def test_vllms_handed_over_checkpoints_are_saved_from_their_own_blocks(tmp_path: Path) -> None:
    """vLLM 0.32 names each checkpoint's block (after a copy-on-write or a speculative block's
    move the table's position names another): those blocks are saved, a decode step's under the
    request's own key, and a partial block's (no key of ours) not at all."""
    hybrid = _Hybrid(tmp_path)
    try:
        group = hybrid.state_group
        assert hybrid.step(32, **_offer((group, 12, 16), (group, 13, 32))) == {
            "full": [(0, 1), (1, 2)],
            "state": [(0, 12), (1, 13)],
        }
        assert hybrid.step(8, **_offer()) == {}
        decoded = hybrid.decode_to(47, **_offer())
        decoded.append(hybrid.step(1, **_offer((group, 14, 48), (group, 15, 41))))
        assert decoded[-1] == {"full": [(2, 3)], "own state": [(2, 14)]}
        assert [saved for saved in decoded if "state" in saved] == []
    finally:
        hybrid.storage.close()


@pytest.mark.parametrize("handed_over", [False, True], ids=["positional", "vllm-offers"])
def test_a_resumed_requests_prefill_of_generated_tokens_leaves_checkpoints_for_everyone(
    tmp_path: Path, handed_over: bool
) -> None:
    """Resumed after a preemption, a request prefills its prompt and the tokens it had generated:
    those checkpoints are a prefill's (vLLM keeps them too), stored under the shared key, and the
    attention blocks stored before are not stored again."""
    hybrid = _Hybrid(tmp_path)
    try:
        offer = _offer() if handed_over else {}
        hybrid.step(32, **offer)
        hybrid.step(8, **offer)
        hybrid.decode_to(50, **offer)
        hybrid.request.num_computed_tokens = 0  # preempted: vLLM freed its blocks
        resumed = {"scheduled_cached_reqs": SimpleNamespace(req_ids=["r"], resumed_req_ids={"r"})}
        if handed_over:
            resumed |= _offer((hybrid.state_group, 14, 48))
        assert hybrid.own_state_stored(2)
        assert hybrid.step(48, **resumed) == {"state": [(2, 14 if handed_over else 10)]}
        assert not hybrid.own_state_stored(2), "replaced by the prefill's: removed"
        next_turn = _request("t", hybrid.request.all_token_ids + list(range(600, 650)))
        assert hybrid.offered(next_turn) == 3 * BS
    finally:
        hybrid.storage.close()


def test_a_finished_requests_own_checkpoints_are_removed_after_its_last_save(tmp_path: Path) -> None:
    """A decode step's checkpoint serves only its own request, resumed; once the request finished
    no lookup asks for it, yet it held L3 room (a Mamba/GDN state: megabytes per block) until
    capacity eviction dropped it. The workers remove it in the next step, after that step's
    saves; the prompt's shared checkpoint stays."""
    hybrid = _Hybrid(tmp_path)
    try:
        own = hybrid.decode_past_a_boundary()
        hybrid.scheduler.finished(hybrid.request)
        assert hybrid.idle_step().drops == own and len(own) == 1
        hybrid.scheduler.matched_tokens(hybrid.request, 0)  # (its hashes again, to look it up)
        assert not hybrid.own_state_stored(2)
        assert hybrid.worker.stats["own_states_removed"] == 1
        assert hybrid.idle_step().drops == []
        next_turn = _request("t", hybrid.request.all_token_ids + list(range(600, 650)))
        assert hybrid.offered(next_turn) == 2 * BS  # the prompt's checkpoint
    finally:
        hybrid.storage.close()


def test_a_held_prefix_asks_for_its_end_checkpoint_and_never_stores_it_again(tmp_path: Path) -> None:
    """A request starting on a prefix vLLM holds (two blocks) has the workers ask L3 for the
    state checkpoint at the prefix end too -- what a new question on a hot prompt needs in
    another engine, so its LRU must see it used -- but never store it from vLLM's block there,
    which may hold the running state by now: gone from L3, it stays gone."""
    hybrid = _Hybrid(tmp_path)
    try:
        hybrid.step(32)  # the prefill of two blocks: their checkpoint at block 1
        prompt = hybrid.scheduler._hashes(hybrid.scheduler.requests["r"], 2)
        state_pool = hybrid.layout.groups[1].pool
        assert hybrid.storage.engine.exists(state_pool, prompt[1:]).ok == [True]
        asked: list[tuple[str, list[str]]] = []
        real_exists = hybrid.storage.engine.exists

        def spy(pool: str, keys: Any, **kwargs: Any) -> Any:
            asked.append((pool, list(keys)))
            return real_exists(pool, keys, **kwargs)

        hybrid.storage.engine.exists = spy  # type: ignore[method-assign]
        question = _request("q", [*hybrid.request.all_token_ids[: 2 * BS], *range(700, 710)])
        hybrid.scheduler.matched_tokens(question, 2 * BS)  # vLLM's own hit: two blocks
        question.num_computed_tokens = 2 * BS
        plan = hybrid.scheduler.build_plan(SimpleNamespace(num_scheduled_tokens={"q": 10}))
        held = {t.group_id: (t.hashes, t.block_ids) for t in plan.held}
        assert held[hybrid.state_group] == (prompt[1:], [])
        assert held[hybrid.layout.anchor.group_id][0] == prompt
        hybrid.worker.save(plan)
        assert (state_pool, prompt[1:]) in asked
        assert hybrid.storage.engine.discard(state_pool, prompt[1:]).ok == [True]
        again = _request("q2", list(question.all_token_ids))
        hybrid.scheduler.matched_tokens(again, 2 * BS)
        again.num_computed_tokens = 2 * BS
        hybrid.worker.save(hybrid.scheduler.build_plan(SimpleNamespace(num_scheduled_tokens={"q2": 10})))
        assert hybrid.worker.stats["resaved_blocks"] == 0
        assert real_exists(state_pool, prompt[1:]).ok == [False], "never stored from a running slot"
    finally:
        hybrid.storage.close()


def test_a_reset_removes_the_own_checkpoints_of_requests_in_flight(tmp_path: Path) -> None:
    """After ``reset_prefix_cache`` a request's blocks are keyed under a fresh generation: its own
    checkpoints stored before are no one's, removed like a finished request's."""
    hybrid = _Hybrid(tmp_path)
    try:
        own = hybrid.decode_past_a_boundary()
        hybrid.scheduler.reset()
        assert hybrid.idle_step().drops == own
        pool = hybrid.layout.groups[1].pool
        assert hybrid.storage.engine.exists(pool, own).ok == [False]
    finally:
        hybrid.storage.close()


def test_another_processs_request_of_the_same_id_and_tokens_keeps_its_own_checkpoints_apart(
    tmp_path: Path,
) -> None:
    """vLLM's offline request ids are counters, the same in every process sharing an L3: a
    decode step's checkpoint is keyed by the scheduler instance too, so another process's
    request "r" of the same tokens neither overwrites this one's nor removes it when it ends."""
    hybrid, twin = _Hybrid(tmp_path), _Hybrid(tmp_path)  # two processes on one L3
    try:
        assert hybrid.decode_past_a_boundary() != twin.decode_past_a_boundary()
        twin.scheduler.finished(twin.request)
        twin.idle_step()
        assert hybrid.own_state_stored(2), "the twin's end removed this request's own state"
        hybrid.request.num_computed_tokens = 0  # preempted: its own state still serves it
        assert hybrid.offered(hybrid.request) == 3 * BS
    finally:
        hybrid.storage.close()
        twin.storage.close()


def _resume_with_load(hybrid: _Hybrid) -> str:
    """Decode past block 2 (its checkpoint is the request's own), get preempted, and be restored
    from L3 with a load of 3 blocks (the own checkpoint included). Returns the own key."""
    (own,) = hybrid.decode_past_a_boundary()
    hybrid.request.num_computed_tokens = 0  # preempted: vLLM freed its blocks
    assert hybrid.offered(hybrid.request) == 3 * BS  # its own decode-time checkpoint
    hybrid.scheduler.after_alloc(hybrid.request, 3 * BS)
    plan = hybrid.scheduler.build_plan(SimpleNamespace(num_scheduled_tokens={}))
    state_keys = [t.hashes for t in plan.loads["r"] if t.group_id == hybrid.state_group]
    assert state_keys == [[own]], "the load reads the request's own checkpoint"
    hybrid.worker.load(plan)
    assert hybrid.worker.take_finished() == ({"r"}, set())
    hybrid.request.num_computed_tokens = 3 * BS
    return own


def test_a_loaded_own_checkpoint_vllm_hands_back_is_not_republished_under_the_shared_key(
    tmp_path: Path,
) -> None:
    """vLLM 0.32 caches the blocks of a finished async load (``_update_waiting_for_remote_kv``
    -> ``cache_blocks``) and so hands the loaded Mamba checkpoint back as a boundary-state offer
    in the step the resumed request is scheduled. A state the step did not compute is not saved:
    counted as the resumed prefill's, the loaded *decode-time* state went out under the shared
    chain key (served to every next turn) and its own key was dropped."""
    hybrid = _Hybrid(tmp_path)
    try:
        _resume_with_load(hybrid)
        # the resumed request is scheduled: 48 tokens restored, 3 to compute; vLLM offers the
        # checkpoint block it just cached (the loaded one: index 2 -> block 10, 48 tokens)
        resumed: dict[str, Any] = {
            "scheduled_cached_reqs": SimpleNamespace(req_ids=["r"], resumed_req_ids={"r"})
        }
        resumed |= _offer((hybrid.state_group, 10, 3 * BS))
        saved = hybrid.step(len(hybrid.request.all_token_ids) - 3 * BS, **resumed)
        assert "state" not in saved, f"a loaded decode-time state re-saved under the shared key: {saved}"
        assert hybrid.own_state_stored(2), "its own checkpoint was dropped"
        next_turn = _request("t", hybrid.request.all_token_ids + list(range(600, 650)))
        assert hybrid.offered(next_turn) == 2 * BS, "a next turn is served the decode-time state"
    finally:
        hybrid.storage.close()


def test_a_loaded_shared_checkpoint_vllm_hands_back_is_not_written_again(tmp_path: Path) -> None:
    """The same hand-back for a plain next turn: the prompt checkpoint it just loaded from L3
    (a Mamba/GDN state: megabytes per block) is not put to L3 again in its first step."""
    hybrid = _Hybrid(tmp_path)
    try:
        hybrid.step(32)
        hybrid.step(8)  # the prompt's checkpoint of block 1 is stored (shared key)
        turn = _request("t", list(range(1, 41)))
        hybrid.scheduler.kv_cache_manager = SimpleNamespace(
            get_block_ids=lambda rid: (list(range(1, 8)), list(range(8, 16)))
        )
        assert hybrid.scheduler.matched_tokens(turn, 0) == (2 * BS, True)
        hybrid.scheduler.after_alloc(turn, 2 * BS)
        plan = hybrid.scheduler.build_plan(SimpleNamespace(num_scheduled_tokens={}))
        hybrid.worker.load(plan)
        assert hybrid.worker.take_finished() == ({"t"}, set())
        turn.num_computed_tokens = 2 * BS
        offer = SimpleNamespace(boundary_state_offloads={"t": [(hybrid.state_group, 9, 2 * BS)]})
        plan = hybrid.scheduler.build_plan(
            SimpleNamespace(
                num_scheduled_tokens={"t": 8}, scheduled_new_reqs=[SimpleNamespace(req_id="t")],
                kv_connector_block_state=offer,
            )
        )  # fmt: skip
        state_saves = [t.hashes for t in plan.saves if t.group_id == hybrid.state_group]
        assert state_saves == [], f"the loaded checkpoint is written back: {state_saves}"
    finally:
        hybrid.storage.close()


def _mm_extra_keys(request: Any, start: int, end: int) -> tuple[Any, ...] | None:
    """vLLM's multimodal extra keys of a block (``_gen_mm_extra_hash_keys``)."""
    keys = [
        ("mm", f.identifier, f.mm_position.offset - start)
        for f in request.mm_features
        if end > f.mm_position.offset and start < f.mm_position.offset + f.mm_position.length
    ]
    return tuple(keys) or None


def _image(identifier: str, offset: int, length: int) -> Any:
    return SimpleNamespace(identifier=identifier, mm_position=SimpleNamespace(offset=offset, length=length))


def test_a_streaming_session_that_adds_an_image_later_keys_its_blocks_by_the_image(engines: Any) -> None:
    """vLLM 0.32's streaming-input sessions keep one request id and extend it in place
    (``Scheduler._update_request_as_session``: new prompt tokens, and ``mm_features`` extended).
    Whether a request's blocks carry extra keys is asked again at every lookup and step: decided
    once, when the connector first saw the request, a session whose first chunk was text only
    kept hashing token ids alone after an image joined it, and session B of the same text and a
    same-sized image (alike placeholder ids), preempted, was offered session A's image blocks.
    Its text blocks stay found under their keys."""
    engine = engines(extra_keys=_mm_extra_keys)
    text = list(range(1, 2 * BS + 1))  # chunk 1: two blocks of text
    placeholders = [7] * BS  # chunk 2: one block of image placeholder ids
    tail = list(range(900, 900 + BS + 3))

    a = engine.request("a", text)
    _decode(engine, a, 1, async_output=False)  # chunk 1 prefilled (first seen: no extra keys)
    a.all_token_ids = [*text, *placeholders, *tail]  # the session update: an image, more text
    a.num_tokens = len(a.all_token_ids)
    a.mm_features = [_image("image-A", 2 * BS, BS)]
    engine.step({"a": a.num_tokens - a.num_computed_tokens})  # chunk 2 prefilled and saved
    assert engine.worker.stats["saved_blocks"] == 4

    b = engine.request("b", text)
    _decode(engine, b, 1, async_output=False)
    b.all_token_ids = [*text, *placeholders, *tail]
    b.num_tokens = len(b.all_token_ids)
    b.mm_features = [_image("image-B", 2 * BS, BS)]  # another image, same size
    b.num_computed_tokens = 0  # preempted: vLLM looks it up again (its text blocks stay local)
    offered, _ = engine.scheduler.matched_tokens(b, 2 * BS)
    assert offered == 0, f"session b is offered {offered // BS} blocks holding session a's image"
    offered, _ = engine.scheduler.matched_tokens(b, 0)  # b's text blocks: found, stored by a
    assert offered == 2 * BS


def test_a_connector_reset_never_stores_kv_computed_before_it(engines: Any) -> None:
    """vLLM's ``reset_prefix_cache(reset_connector=True)`` resets the connector even while
    requests run (scheduler.py: ``reset_connector_cache`` is called whatever the prefix cache
    reset answered). README: after it "nothing stored before is served here again (it is the old
    weights' KV)". A request running across the reset is "starting" again for the connector
    (``save_from`` None), so ``held_prefix`` names every block it computed BEFORE the reset,
    under the NEW generation's keys; none exists, so the workers store them all: a request after
    the reset is then served the pre-reset KV."""
    engine = engines()
    prompt = list(range(1, 3 * BS + 5))
    running = engine.request("r", prompt)
    assert engine.scheduler.matched_tokens(running, 0) == (0, False)
    engine.step({"r": len(prompt)})  # prefill: blocks 0-2 stored (old generation)
    running.num_computed_tokens = len(prompt)
    running.all_token_ids.append(999)
    running.num_tokens = len(running.all_token_ids)
    engine.scheduler.reset()  # weight update: r keeps running on its (old) KV
    plan = engine.step({"r": 1})  # its next decode step
    assert engine.worker.stats["resaved_blocks"] == 0, (
        f"{engine.worker.stats['resaved_blocks']} blocks computed before the reset stored under the "
        f"new generation (held: {[len(t.hashes) for t in plan.held]})"
    )
    after = engine.request("after", prompt)
    assert engine.scheduler.matched_tokens(after, 0) == (0, False), "pre-reset KV served after the reset"


def test_requests_sharing_a_prefix_in_one_step_count_nothing_lost_and_put_once(engines: Any) -> None:
    """vLLM caches a block when it allocates it (``allocate_slots`` -> ``cache_blocks`` up to the
    tokens scheduled), so a second new request sharing a system prompt hits it locally in the
    SAME step the first computes it. Its ``held`` blocks are asked of L3 before that step's saves:
    "lost", they are appended to the saves a second time -- counted as ``resaved_blocks`` (L3 had
    lost nothing) and put twice."""
    engine = engines()
    system = list(range(1, 2 * BS + 1))
    a = engine.request("a", [*system, *range(500, 500 + BS + 3)])
    b = engine.request("b", [*system, *range(700, 700 + BS + 3)])
    engine.block_ids["b"] = [1, 2, *range(8, BLOCKS)]  # b's first two blocks: a's (vLLM's hit)
    assert engine.scheduler.matched_tokens(a, 0) == (0, False)
    assert engine.scheduler.matched_tokens(b, 2 * BS) == (0, False)
    b.num_computed_tokens = 2 * BS
    puts: list[list[str]] = []
    real_put = engine.engine.put

    def spy(pool: str, keys: list[str], units: Any) -> Any:
        puts.append(list(keys))
        return real_put(pool, keys, units)

    engine.engine.put = spy
    engine.step({"a": len(a.all_token_ids), "b": len(b.all_token_ids) - 2 * BS})
    keys = [k for batch in puts for k in batch]
    assert engine.worker.stats["resaved_blocks"] == 0, "L3 lost nothing: a's blocks were being stored"
    assert len(keys) == len(set(keys)), f"{len(keys) - len(set(keys))} blocks put twice in one step"
    assert engine.worker.stats["saved_blocks"] == 3 + 1


def test_a_request_after_a_reset_never_stores_the_old_kv_vllm_still_caches(engines: Any) -> None:
    """``reset_prefix_cache(reset_connector=True)`` with a request running: vLLM's own prefix
    cache is NOT reset (block_pool: "Failed to reset prefix cache because some blocks are not
    freed yet") but the connector's is (``reset_connector_cache`` runs whatever that answered).
    A request arriving after it hits the old weights' blocks in vLLM's cache; they are its
    ``held`` prefix, absent under the new generation, so the workers stored them there: the
    next lookup here served the old weights' KV (``reset_while_running`` guards only the
    requests known at the reset)."""
    engine = engines()
    prompt = list(range(1, 3 * BS + 5))
    _decode(engine, engine.request("w", prompt), 1, async_output=False)  # w runs on, blocks 0-2 cached
    engine.scheduler.reset()  # vLLM kept w's (old) blocks: they were in use
    _serve_after_local_hit(engine, engine.request("n", [*prompt[: 2 * BS], *range(700, 710)]), 2)
    assert engine.worker.stats["resaved_blocks"] == 0, "old-weights blocks stored under the new generation"
    probe = engine.request("probe", prompt)
    assert engine.scheduler.matched_tokens(probe, 0) == (0, False), "pre-reset KV served after the reset"


def test_blocks_computed_after_a_reset_are_still_kept_in_a_bounded_l3(engines: Any) -> None:
    """The guard above drops only blocks not known written since the reset: a prefix computed
    after it that L3 lost is still stored again from vLLM's copy when another request hits it."""
    engine = engines()
    engine.scheduler.reset()
    prompt = list(range(1, 3 * BS + 5))
    _decode(engine, engine.request("w", prompt), 1, async_output=False)  # stored, new generation
    _lose_block_0(engine)
    _serve_after_local_hit(engine, engine.request("n", [*prompt[: 2 * BS], *range(700, 710)]), 2)
    assert engine.worker.stats["resaved_blocks"] == 1
    assert engine.scheduler.matched_tokens(engine.request("probe", prompt), 0) == (3 * BS, True)


def test_resaved_blocks_counts_only_blocks_stored_again(engines: Any) -> None:
    """``resaved_blocks`` is "blocks vLLM held whose objects L3 had lost, stored again": a put L3
    refuses (full, read-only, down) stores nothing again -- it is a save failure, as for any
    block -- yet the lost blocks were counted resaved before the put was even tried."""
    engine = engines()
    prompt = list(range(1, 3 * BS + 5))
    _decode(engine, engine.request("w", prompt), 1, async_output=False)
    _lose_block_0(engine)
    engine.engine.put = lambda pool, keys, units: BatchResult(
        [False] * len(keys), "refused", failed=len(keys)
    )
    _serve_after_local_hit(engine, engine.request("n", [*prompt[: 2 * BS], *range(700, 710)]), 2)
    assert engine.worker.stats["save_failures"] == 1, "block 0: held, lost, refused"
    assert engine.worker.stats["resaved_blocks"] == 0, "nothing was stored again"


def test_a_lookup_after_a_preemption_is_counted_though_asked_with_the_same_arguments(engines: Any) -> None:
    """A request preempted in its chunked prefill, before it sampled a token, whose blocks vLLM
    evicted (preemptions come with memory pressure), is looked up again with the same (0, prompt
    length): that lookup, and the blocks it offers (stored by the first chunk, then loaded), were
    not counted -- ``offered_blocks`` fell below the blocks loaded. Asked again while it waits,
    it is still counted once."""
    engine = engines()
    request = engine.request("r", list(range(1, 4 * BS + 3)), num_preemptions=0)
    assert engine.scheduler.matched_tokens(request, 0) == (0, False)
    engine.step({"r": 2 * BS})  # the first chunk: blocks 0 and 1 stored
    request.num_computed_tokens = 0  # preempted, its blocks evicted by vLLM
    request.num_preemptions = 1
    stats = dict(engine.scheduler.stats)
    assert [engine.scheduler.matched_tokens(request, 0) for _ in range(2)] == [(2 * BS, True)] * 2
    assert engine.scheduler.stats["lookups"] - stats["lookups"] == 1
    assert engine.scheduler.stats["offered_blocks"] - stats["offered_blocks"] == 2


def test_blocks_two_requests_compute_in_one_step_are_put_and_announced_once(engines: Any) -> None:
    """vLLM without its prefix cache (``enable_prefix_caching=False``): two requests of one prompt
    in one step compute the same blocks, neither hitting the other's. Each object was put twice
    in the same batch, counted twice in ``saved_blocks`` and ``save_blocks_planned``, and its
    ``BlockStored`` announced twice; a longer third request announces only its own block."""
    engine = engines()
    prompt = list(range(1, 3 * BS + 5))
    rows = {"a": range(1, 5), "b": range(5, 9), "c": range(9, 14)}
    requests = [engine.request("a", prompt), engine.request("b", prompt)]
    requests.append(engine.request("c", [*prompt[: 3 * BS], *range(900, 900 + BS + 1)]))
    for request in requests:
        engine.block_ids[request.request_id] = list(rows[request.request_id])
        assert engine.scheduler.matched_tokens(request, 0) == (0, False)
    puts: list[str] = []
    real_put = engine.engine.put

    def spy(pool: str, keys: list[str], units: Any) -> Any:
        puts.extend(keys)
        return real_put(pool, keys, units)

    engine.engine.put = spy
    plan = engine.step({r.request_id: len(r.all_token_ids) for r in requests})
    assert len(puts) == len(set(puts)) == 4
    assert engine.worker.stats["saved_blocks"] == 4
    assert engine.scheduler.stats["save_blocks_planned"] == 4
    hashes = engine.scheduler._hashes(engine.scheduler.requests["c"], 4)
    assert [(h, parent) for h, parent, _ in plan.stored] == [(hashes[:3], None), (hashes[3:], hashes[2])]
    assert plan.stored[1][2] == requests[2].all_token_ids[3 * BS : 4 * BS]


def test_a_hole_l3_lost_inside_a_resumed_requests_saved_range_is_stored_again(engines: Any) -> None:
    """A request stored blocks 0-3, then L3 lost block 1 (evicted, or a put that failed) and
    vLLM preempted the request, dropping its blocks: resumed, it loads block 0 and computes
    blocks 1-3 again. Its saves started where its own saves had stopped (block 4), so block 1
    stayed a hole and every lookup, here or in another engine, stopped at block 0 for good."""
    engine = engines()
    prompt = list(range(1, 4 * BS + 3))
    request = engine.request("r", prompt, num_preemptions=0)
    _decode(engine, request, 1, async_output=False)
    assert engine.saved_blocks(request) == [0, 1, 2, 3]
    hashes = engine.scheduler._hashes(engine.scheduler.requests["r"], 4)
    (keys,) = engine.engine.object_keys(engine.layout.anchor.pool, hashes[1:2])
    assert engine.engine.backend.remove(keys) == [True]
    request.num_computed_tokens, request.num_preemptions = 0, 1  # preempted, its blocks dropped
    assert engine.scheduler.matched_tokens(request, 0) == (BS, True), "block 0 only"
    engine.scheduler.after_alloc(request, BS)
    engine.step({})  # the load
    request.num_computed_tokens = BS
    engine.step({"r": len(request.all_token_ids) - BS})  # the rest, computed again
    fresh = engine.scheduler.__class__(engine.engine, engine.layout, engine.scheduler.identity)
    assert fresh.matched_tokens(_request("probe", prompt), 0) == (4 * BS, True), "the hole is filled"


def test_a_failed_load_of_a_request_aborted_meanwhile_is_not_counted_a_load_failure(engines: Any) -> None:
    """vLLM aborts a request while its load runs (``request_finished`` first, the workers'
    report after): no request recomputes anything, yet ``load_failures`` counted it like a load
    vLLM had to recompute. It is counted apart; a failed load of a live request still counts."""
    engine = engines()
    prompt = list(range(1, 3 * BS + 5))
    _decode(engine, engine.request("w", prompt), 1, async_output=False)
    engine.scheduler.finished(engine.scheduler.requests["w"].request)
    for rid in ("live", "aborted"):
        reader = engine.request(rid, prompt)
        assert engine.scheduler.matched_tokens(reader, 0) == (3 * BS, True)
        engine.scheduler.after_alloc(reader, 3 * BS)
    engine.scheduler.build_plan(SimpleNamespace(num_scheduled_tokens={}))
    engine.scheduler.finished(engine.scheduler.requests["aborted"].request)  # the abort
    engine.scheduler.loads_failed({"live", "aborted"})  # both loads failed (L3 went down)
    assert engine.scheduler.stats["load_failures"] == 1
    assert engine.scheduler.stats["aborted_load_failures"] == 1


def test_pipeline_stages_a_block_a_later_stage_lost_costs_one_recompute_then_serves(
    engines: Any, tmp_path: Path
) -> None:
    """Pipeline parallel (documented, not fixed): the scheduler knows stage 0's layers only, so a
    lookup asks for stage 0's objects. A block stage 1 lost is offered, stage 1's load fails and
    vLLM recomputes; that request's saves store stage 1's blocks again, and the next one loads."""
    engine = engines()
    layout1 = _layout({"layers.1.self_attn": _attention()})  # stage 1: other layers, other pools
    storage1 = _storage(layout1, tmp_path / "l3")
    stage1 = WorkerSide(storage1.engine, layout1)
    stage1.register(
        {"layers.1.self_attn": torch.zeros((BLOCKS, 2, BS, HEADS, HEAD_DIM), dtype=torch.bfloat16)}
    )
    prompt = list(range(1, 3 * BS + 5))

    def serve(rid: str) -> set[str]:
        """vLLM's path: lookup, the load on both stages (their failures), then the prefill."""
        request = engine.request(rid, prompt)
        found, _ = engine.scheduler.matched_tokens(request, 0)
        engine.scheduler.after_alloc(request, found)
        plan = engine.scheduler.build_plan(SimpleNamespace(num_scheduled_tokens={}))
        for worker in (engine.worker, stage1):
            worker.load(plan)
        failed = engine.worker.take_finished()[1] | stage1.take_finished()[1]
        if failed:
            engine.scheduler.loads_failed(failed)
            found = 0  # vLLM recomputes the request
        request.num_computed_tokens = found
        plan = engine.scheduler.build_plan(SimpleNamespace(num_scheduled_tokens={rid: len(prompt) - found}))
        for worker in (engine.worker, stage1):
            worker.save(plan)
        engine.scheduler.finished(request)
        return failed

    try:
        assert serve("w") == set()
        hashes = engine.scheduler._hashes(engine.scheduler._state(_request("x", prompt)), 3)
        (keys,) = storage1.engine.object_keys(layout1.anchor.pool, hashes[1:2])
        assert storage1.engine.backend.remove(keys) == [True]  # stage 1 lost block 1
        assert serve("r1") == {"r1"}, "offered from stage 0's objects, failed on stage 1"
        assert serve("r2") == set(), "stored again on stage 1 by the recompute"
        assert stage1.stats["loaded_blocks"] == 3
    finally:
        storage1.close()
