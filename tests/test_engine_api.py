"""The engine-facing API driven as an engine would, through public calls only: ``kvstrata.open``,
lookup / admit / allocate / write_units / insert(close=False) / extend, fork_state, read_units,
engine-supplied device tensors."""

from __future__ import annotations

import zlib
from itertools import pairwise
from pathlib import Path

import pytest
import torch

import kvstrata
from controller_support import EXAMPLES, tokens
from kvstrata.core.buffers import torch_dtype

PAGE = 64
#: kv + mamba with room for 50-page requests and a checkpoint every 8 pages
HYBRID = [
    "tiers.device.capacity_tokens=8192",
    "tiers.host.capacity_tokens=16384",
    "model.pools.mamba.device_units=32",
    "model.pools.mamba.host_units=64",
]


def _open(example: str, overrides: list[str], l3: Path | None = None) -> kvstrata.CacheController:
    storage = [f"tiers.storage.l3.path={l3}"] if l3 is not None else ["tiers.storage={}"]
    return kvstrata.open(EXAMPLES[example], overrides=[*storage, *overrides], environ={})


def _content(cache: kvstrata.CacheController, pool: str, pages: list[str]) -> dict[str, torch.Tensor]:
    """What an engine would have computed for ``pages`` (one unit per page hash), typed."""
    spec = cache.pools.pool(pool).spec
    out = {}
    for buffer in spec.buffers:
        dtype = torch_dtype(buffer.dtype)
        nbytes = buffer.layers * torch.Size(buffer.unit_shape).numel() * dtype.itemsize
        rows = []
        for page_hash in pages:
            seed = zlib.crc32(f"{pool}/{buffer.name}/{page_hash}".encode())
            generator = torch.Generator().manual_seed(seed)
            rows.append(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator))
        raw = torch.stack(rows) if rows else torch.empty(0, nbytes, dtype=torch.uint8)
        out[buffer.name] = raw.view(dtype).reshape(len(pages), buffer.layers, *buffer.unit_shape)
    return out


def _pages_of(
    cache: kvstrata.CacheController, lease: kvstrata.Lease, pool: str, first: int, n: int
) -> list[str]:
    if cache.pool_kind(pool).value == "state":
        return [lease.page_hashes[first]]
    return lease.page_hashes[first : first + n]


def _compute(
    cache: kvstrata.CacheController,
    lease: kvstrata.Lease,
    units: dict[str, torch.Tensor],
    first_page: int | None = None,
) -> None:
    """The engine writes every new unit (state: the state after the last page to insert)."""
    for pool, value in units.items():
        if len(value):
            first = lease.allocated_first_page(pool) if first_page is None else first_page
            cache.write_units(
                pool, value, _content(cache, pool, _pages_of(cache, lease, pool, first, len(value)))
            )


def _bad_units(cache: kvstrata.CacheController, lease: kvstrata.Lease) -> int:
    """Units of the cached prefix whose bytes differ from what was computed for their pages."""
    bad = 0
    for pool in cache.pools.pools:
        units = lease.prefix_units(pool)
        if not len(units):
            continue
        pages = _pages_of(cache, lease, pool, lease.prefix_first_page(pool), len(units))
        got, want = cache.read_units(pool, units), _content(cache, pool, pages)
        for name in want:
            same = got[name].view(torch.uint8).flatten(1) == want[name].view(torch.uint8).flatten(1)
            bad += int((~same.all(dim=1)).sum())
    return bad


def chunked_prefill(cache: kvstrata.CacheController, request: torch.Tensor, chunk_pages: int) -> None:
    """One lease from the first chunk to the last: allocate, fork the state, compute, insert."""
    lease = cache.lookup(request[: chunk_pages * PAGE])
    cache.admit(lease)
    while True:
        units = cache.allocate(lease)
        cache.fork_state(lease)
        _compute(cache, lease, units)
        last = lease.pages * PAGE >= len(request)
        cache.insert(lease, close=last)
        if last:
            return
        lease.extend(request[lease.pages * PAGE : (lease.pages + chunk_pages) * PAGE])


def test_chunked_prefill_checkpoints_serve_a_request_sharing_37_of_50_pages() -> None:
    request = tokens(51, 50)
    with _open("hybrid-mamba", HYBRID) as cache:
        chunked_prefill(cache, request, chunk_pages=8)  # checkpoints after 8, 16, ..., 48, 50
        sharing = torch.cat([request[: 37 * PAGE], tokens(52, 13)])
        lease = cache.lookup(sharing)
        cache.admit(lease)
        assert lease.cached_pages == 32, "the last checkpoint at or below page 37"
        assert _bad_units(cache, lease) == 0
        cache.release(lease)
        cache.tree.check()


def test_chunked_prefill_checkpoints_come_back_from_l3_in_a_fresh_cache(tmp_path: Path) -> None:
    request = tokens(53, 50)
    with _open("hybrid-mamba", HYBRID, tmp_path) as writer:
        chunked_prefill(writer, request, chunk_pages=8)
    wait = [*HYBRID, "policy.prefetch.policy=wait_complete"]
    with _open("hybrid-mamba", wait, tmp_path) as cold:
        lease = cold.lookup(torch.cat([request[: 37 * PAGE], tokens(54, 13)]))
        cold.admit(lease)
        assert lease.cached_pages == 32 and lease.hit_pages["storage"] == 32
        assert _bad_units(cold, lease) == 0
        cold.release(lease)


def test_fork_state_copies_the_checkpoint_and_leaves_it_untouched() -> None:
    request = tokens(55, 16)
    with _open("hybrid-mamba", HYBRID) as cache:
        chunked_prefill(cache, request, chunk_pages=8)
        lease = cache.lookup(torch.cat([request, tokens(56, 1)]))
        cache.admit(lease)
        checkpoint = lease.prefix_units("mamba")
        before = cache.read_units("mamba", checkpoint)
        working = cache.allocate(lease)["mamba"]
        forked = cache.fork_state(lease)
        assert torch.equal(forked["mamba"], working) and not torch.equal(working, checkpoint)
        after_fork = cache.read_units("mamba", working)
        for name, value in before.items():
            assert torch.equal(after_fork[name].view(torch.uint8), value.view(torch.uint8))
        cache.write_units("mamba", working, _content(cache, "mamba", ["engine moved on"]))
        for name, value in cache.read_units("mamba", checkpoint).items():
            assert torch.equal(value.view(torch.uint8), before[name].view(torch.uint8))
        cache.release(lease)


def test_the_units_allocate_returns_are_the_callers_the_lease_inserts_its_own() -> None:
    """An engine writing into the index tensors ``allocate`` returned (reusing them as scratch)
    changes neither ``lease.pending`` nor what ``insert`` indexes; ``pending`` hands out copies."""
    request = tokens(57, 8)
    with _open("hybrid-mamba", HYBRID) as cache:
        lease = cache.lookup(request)
        cache.admit(lease)
        units = cache.allocate(lease)
        given = {pool: value.clone() for pool, value in units.items()}
        assert {pool: value.tolist() for pool, value in lease.pending.items()} == {
            pool: value.tolist() for pool, value in given.items() if len(value)
        }
        cache.fork_state(lease)
        _compute(cache, lease, units)
        lease.pending["kv"].fill_(0)  # a copy: the lease's own units stay
        for value in units.values():
            value.fill_(0)  # the caller's tensors, reused
        cache.insert(lease)
        again = cache.lookup(request)
        cache.admit(again)
        assert again.cached_pages == 8
        assert again.prefix_units("kv").tolist() == given["kv"].tolist()
        assert again.prefix_units("mamba").tolist() == given["mamba"].tolist()
        assert _bad_units(cache, again) == 0
        cache.release(again)
        cache.tree.check()


def test_fork_state_into_engine_tensors_held_per_layer() -> None:
    """The fork's copy lands in the engine's own per-layer state tensors, every layer, and the
    checkpoint's bytes stay as they were (the copy is a row per buffer and layer)."""
    config = kvstrata.load(EXAMPLES["hybrid-mamba"], overrides=["tiers.storage={}", *HYBRID], environ={})
    with kvstrata.open(config) as probe:
        spec, units = probe.pools.pool("mamba").spec, probe.pools.pool("mamba").device.units
    engine = {
        b.name: [torch.zeros(units, *b.unit_shape, dtype=torch_dtype(b.dtype)) for _ in range(b.layers)]
        for b in spec.buffers
    }
    request = tokens(62, 8)
    with kvstrata.open(config, device_tensors={"mamba": engine}) as cache:
        chunked_prefill(cache, request, chunk_pages=4)
        lease = cache.lookup(torch.cat([request, tokens(63, 1)]))
        cache.admit(lease)
        checkpoint = lease.prefix_units("mamba")
        working = cache.allocate(lease)["mamba"]
        cache.fork_state(lease)
        for buffer in spec.buffers:
            assert len(engine[buffer.name]) == buffer.layers
            for layer in engine[buffer.name]:
                source, forked = layer[checkpoint], layer[working]
                assert torch.equal(forked.view(torch.uint8), source.view(torch.uint8))
                assert source.view(torch.uint8).any(), "the chunked prefill wrote this checkpoint"
        cache.release(lease)


def test_extend_in_uneven_pieces_keys_the_same_pages_as_the_whole_request() -> None:
    request = tokens(57, 6)
    # pieces that end inside a page, on a boundary, span several pages; a strided tensor and a list
    cuts = [1, PAGE - 1, PAGE, 3 * PAGE + 5, 4 * PAGE, 6 * PAGE]
    with _open("hybrid-mamba", HYBRID) as cache:
        whole = cache.lookup(request)
        lease = cache.lookup(request[:1])
        completed = []
        for start, end in pairwise(cuts):
            piece = request[start:end]
            if start == 3 * PAGE + 5:  # the same ids, every other element of a wider tensor
                piece = torch.stack([piece, torch.zeros_like(piece)], dim=1).flatten()[::2]
            completed.append(lease.extend(piece.tolist() if end == PAGE else piece))
        assert completed == [0, 1, 2, 1, 2]
        assert lease.pages == 6 and lease.keys == whole.keys and torch.equal(lease.tokens, request)
        assert lease.page_hashes == whole.page_hashes
        cache.release(whole)
        cache.release(lease)


def _prefill(cache: kvstrata.CacheController, request: torch.Tensor) -> kvstrata.Lease:
    lease = cache.lookup(request)
    units = cache.allocate(lease)
    _compute(cache, lease, units)
    cache.insert(lease)
    return lease


def test_a_window_pool_keeps_the_window_data_of_every_page_a_prefill_computes() -> None:
    """As in SGLang: with room in the window pool, every computed page keeps its window data, so
    a request sharing any prefix (here 5 of 8 pages, inside the first request's node) reuses it."""
    with _open("swa", []) as cache:
        window = cache.tree_pools["swa"].window
        lease = cache.lookup(tokens(57, 8))
        units = cache.allocate(lease)
        assert window < 8 and len(units["swa"]) == 8 and lease.allocated_first_page("swa") == 0
        _compute(cache, lease, units)
        cache.insert(lease)
        sharing = cache.lookup(torch.cat([tokens(57, 8)[: 5 * PAGE], tokens(58, 3)]))
        cache.admit(sharing)
        assert sharing.cached_pages == 5 and sharing.prefix_first_page("swa") <= 5 - window
        assert _bad_units(cache, sharing) == 0
        cache.release(sharing)
        cache.tree.check()


def test_window_only_allocation_for_an_engine_that_kept_only_the_window() -> None:
    with _open("swa", ["tiers.host.capacity_tokens=0"]) as cache:
        window = cache.tree_pools["swa"].window
        request = tokens(63, 8)
        lease = cache.lookup(request)
        units = cache.allocate(lease, window_only=True)
        assert len(units["swa"]) == window and lease.allocated_first_page("swa") == 8 - window
        _compute(cache, lease, units)
        cache.insert(lease)
        for shared, reusable in ((8, 8), (5, 0)):  # no window data inside the request
            again = cache.lookup(torch.cat([request[: shared * PAGE], tokens(64, 1)]))
            cache.admit(again)
            assert again.cached_pages == reusable and _bad_units(cache, again) == 0
            cache.release(again)
        assert cache.pools.pools["swa"].device_allocator.used == window


def test_a_full_window_pool_tombstones_out_of_window_data_first_and_keeps_every_window() -> None:
    """A window pool of 12 device units under 8-page requests (window 2 pages, no host tier: a
    host copy would serve the tombstoned pages again): each request's earlier
    pages take the out-of-window data of the requests before it (counted), never a request's last
    window or its full KV; once only last windows are left, a request keeps what fits down to its
    own window. Every request stays reusable whole, with exact bytes."""
    with _open("swa", ["model.pools.swa.device_units=12", "tiers.host.capacity_tokens=0"]) as cache:
        assert cache.tree_pools["swa"].window == 2
        requests = [tokens(59 + i, 8) for i in range(4)]
        got = []
        for request in requests:
            lease = cache.lookup(request)
            units = cache.allocate(lease)
            got.append((len(units["swa"]), lease.allocated_first_page("swa")))
            _compute(cache, lease, units)
            cache.insert(lease)
        # 12 free; 4 free + 6 out of the first's window; 6 out of the second's; 2 + 4 of the third's
        assert got == [(8, 0), (8, 0), (8, 0), (6, 2)]
        assert cache.metrics.snapshot()["operations"]["out_of_window_device"] == 6 + 6 + 6
        for request in requests:
            again = cache.lookup(request)
            cache.admit(again)
            assert again.cached_pages == 8 and _bad_units(cache, again) == 0
            cache.release(again)
        # inside the first request only its last window is left; the last keeps pages [2, 8)
        for request, reusable in ((requests[0], 0), (requests[3], 5)):
            partial = cache.lookup(torch.cat([request[: 5 * PAGE], tokens(70, 3)]))
            cache.admit(partial)
            assert partial.cached_pages == reusable and _bad_units(cache, partial) == 0
            cache.release(partial)
        assert cache.pools.pools["full"].device_allocator.used == 32, "no full KV page was evicted"
        cache.tree.check()


def test_decode_extends_one_lease_token_by_token() -> None:
    with _open("kv", []) as cache:
        prompt = tokens(58, 3)[: 2 * PAGE + 10]  # 2 whole pages and 10 tokens
        lease = cache.lookup(prompt)
        cache.admit(lease)
        first = cache.allocate(lease, partial_page=True)
        assert len(first["kv"]) == 3 and lease.allocated_pages == 3
        _compute(cache, lease, {"kv": first["kv"][:2]}, first_page=0)
        cache.insert(lease, close=False)
        assert lease.committed_pages == 2
        completed = 0
        for token in range(PAGE - 10):  # decode until the third page is whole
            completed += lease.extend([token])
            assert not len(cache.allocate(lease, partial_page=lease.pages < 3)["kv"])
        assert completed == 1 and lease.pages == 3
        _compute(cache, lease, {"kv": first["kv"][2:]}, first_page=2)
        cache.insert(lease, close=False)
        more = cache.allocate(lease, partial_page=True)
        assert len(more["kv"]) == 1 and lease.allocated_first_page("kv") == 3
        cache.insert(lease)  # closes; the unit of the unfinished page goes back
        assert cache.pools.pools["kv"].device_allocator.used == 3
        again = cache.lookup(lease.tokens[: 3 * PAGE])
        cache.admit(again)
        assert again.cached_pages == 3 and _bad_units(cache, again) == 0
        cache.release(again)


@pytest.mark.parametrize("stack", sorted(EXAMPLES))
def test_units_round_trip_through_the_controller_for_every_pool(stack: str) -> None:
    with _open(stack, []) as cache:
        lease = cache.lookup(tokens(59, 4))
        units = cache.allocate(lease)
        for pool, value in units.items():
            if not cache.pools.pool(pool).spec.buffers or not len(value):
                continue
            want = _content(cache, pool, [f"u{i}" for i in range(len(value))])
            cache.write_units(pool, value, want)
            got = cache.read_units(pool, value)
            for name in want:
                assert torch.equal(got[name].view(torch.uint8), want[name].view(torch.uint8)), (pool, name)
            view = cache.device_view(pool, next(iter(want)))
            assert torch.equal(view[value].view(torch.uint8), want[next(iter(want))].view(torch.uint8))
        cache.release(lease)


def test_model_layer_ids_select_a_pool_layer() -> None:
    with _open("hybrid-mamba", ["model.pools.kv.layer_ids=[3, 7]"]) as cache:
        lease = cache.lookup(tokens(60, 2))
        units = cache.allocate(lease)["kv"]
        cache.write_units("kv", units, _content(cache, "kv", ["a", "b"]))
        whole = cache.read_units("kv", units)
        layer = cache.read_units("kv", units, layer=7)
        assert torch.equal(layer["k"].view(torch.uint8), whole["k"][:, 1].view(torch.uint8))
        with pytest.raises(KeyError, match="kv"):
            cache.read_units("kv", units, layer=4)
        cache.release(lease)


def test_engine_device_tensors_are_the_device_tier_and_are_validated() -> None:
    config = kvstrata.load(EXAMPLES["kv"], overrides=["tiers.storage={}"], environ={})
    spec_probe = kvstrata.open(config)
    spec = spec_probe.pools.pool("kv").spec
    units = spec_probe.pools.device_pages
    spec_probe.close()
    engine = {
        b.name: torch.zeros(b.layers, units, *b.unit_shape, dtype=torch_dtype(b.dtype)) for b in spec.buffers
    }
    with kvstrata.open(config, device_tensors={"kv": engine}) as cache:
        lease = cache.lookup(tokens(61, 2))
        got = cache.allocate(lease)["kv"]
        want = _content(cache, "kv", ["x", "y"])
        cache.write_units("kv", got, want)
        landed = engine["k"][:, got].transpose(0, 1).contiguous()
        assert torch.equal(landed.view(torch.uint8), want["k"].view(torch.uint8)), "in the engine's tensor"
        cache.release(lease)
    wrong = dict(engine, k=engine["k"][..., :-1])
    with pytest.raises(ValueError, match=r"pool 'kv'.*buffer 'k'.*expected"):
        kvstrata.open(config, device_tensors={"kv": wrong})
    with pytest.raises(ValueError, match=r"buffer 'v'.*expected"):
        kvstrata.open(config, device_tensors={"kv": dict(engine, v=engine["v"].float())})


def test_state_slots_are_sized_for_the_engine_checkpoint_interval() -> None:
    sets = ["tiers.device.capacity_tokens=8192", "model.pools.mamba.device_units=null"]
    with _open("hybrid-mamba", [*sets, "model.pools.mamba.state_every_pages=4"]) as every_4:
        assert every_4.pools.pool("mamba").device.units == 128 // 4
    with _open("hybrid-mamba", sets) as default:
        assert default.pools.pool("mamba").device.units == 128 // 16
    with pytest.raises(ValueError, match="state_every_pages sizes node-state pools"):
        _open("hybrid-mamba", ["model.pools.kv.state_every_pages=4"])


def test_a_small_device_tier_still_gives_a_state_pool_a_slot_to_resume_a_cached_checkpoint_in() -> None:
    """At 16 device pages or fewer the default was one state slot: a request whose prefix hit a
    cached checkpoint (locked, it is the request's state) needed a second slot to fork it into,
    and ``allocate`` raised CacheFullError instead of serving the hit."""
    config = {
        "model": {
            "name": "tiny-hybrid",
            "page_size": 4,
            "pools": {
                "kv": {"type": "kv", "layers": 1, "kv_heads": 1, "head_dim": 4, "dtype": "float32"},
                "mamba": {"type": "mamba", "layers": 1, "states": {"conv": {"shape": [2, 2]}}},
            },
        },
        "tiers": {"device": {"capacity_tokens": 64}, "host": {"capacity_tokens": 128}},
    }
    with kvstrata.open(config, environ={}) as cache:
        assert cache.pools.pool("mamba").device.units == 2
        prompt = torch.arange(16)
        first = cache.lookup(prompt)
        cache.allocate(first)
        cache.insert(first)
        resumed = cache.lookup(torch.cat([prompt, torch.arange(100, 108)]))
        got = cache.allocate(resumed)  # (admits: the hit is settled there)
        assert resumed.hit_pages["device"] == 4, "the prompt's checkpoint is a hit"
        assert got["kv"].numel() == 2 and got["mamba"].numel() == 1
        cache.fork_state(resumed)
        cache.insert(resumed)


def test_a_request_shorter_than_a_page_has_no_pages_and_no_hashes() -> None:
    with _open("kv", []) as cache:
        lease = cache.lookup(tokens(64, 1)[:10])
        assert lease.pages == 0 and lease.page_hashes == []
        cache.admit(lease)
        assert cache.allocate(lease)["kv"].numel() == 0
        cache.insert(lease)


# --- a state pool's working slot and partial pages ------------------------------------------------

_STATE_STACK = {
    "model": {
        "name": "partial-state",
        "page_size": 16,
        "pools": {
            "kv": {"type": "kv", "layers": 1, "kv_heads": 1, "head_dim": 8},
            "mamba": {"type": "mamba", "layers": 1, "states": {"ssm": {"shape": [1], "dtype": "float32"}}},
        },
    },
    "tiers": {"device": {"capacity_tokens": 2048}, "host": {"capacity_tokens": 4096}, "storage": {}},
}


class _RecurrentEngine:
    """A model whose state after ``n`` tokens is ``n``, advanced in place in the working slot
    ``fork_state`` handed out (what engines do: they have no other slot while decoding)."""

    def __init__(self, cache: kvstrata.CacheController) -> None:
        self.cache, self.slot = cache, None

    def fork(self, lease: kvstrata.Lease) -> None:
        self.slot = self.cache.fork_state(lease)["mamba"]

    def run_to(self, tokens: int) -> None:
        self.cache.write_units("mamba", self.slot, {"ssm": torch.full((1, 1, 1), float(tokens))})

    def restored_state(self, prompt: torch.Tensor) -> tuple[int, float]:
        """(cached tokens, the state restored with them) of a later request for ``prompt``."""
        again = self.cache.lookup(prompt)
        self.cache.admit(again)
        state = self.cache.read_units("mamba", again.prefix_units("mamba"))["ssm"].item()
        self.cache.release(again)
        return again.cached_tokens, state


def _prefill(engine: _RecurrentEngine, prompt: torch.Tensor, *, insert_last: bool) -> kvstrata.Lease:
    """Two-page chunks, each inserted as a checkpoint (the last one too with ``insert_last``)."""
    cache = engine.cache
    lease = cache.lookup(prompt[:32])
    cache.admit(lease)
    while True:
        cache.allocate(lease)
        engine.fork(lease)
        engine.run_to(lease.pages * 16)
        last = lease.pages * 16 >= len(prompt)
        if last and not insert_last:
            return lease
        cache.insert(lease, close=False)
        if last:
            return lease
        lease.extend(prompt[lease.pages * 16 : lease.pages * 16 + 32])


@pytest.mark.parametrize("insert_last", [False, True], ids=["decode-right-away", "checkpoint-first"])
def test_a_working_slot_run_past_a_page_is_never_its_checkpoint(insert_last: bool) -> None:
    """Once a partial page is allocated the engine's state runs on into it, in the one working
    slot: the closing insert must not record that slot as the state after the last whole page
    (a later request would resume from tokens it never had). Inserting before decoding keeps
    that checkpoint; decoding right away leaves the prompt's end without one (the chunk before
    it serves)."""
    with kvstrata.open(_STATE_STACK, environ={}) as cache:
        engine = _RecurrentEngine(cache)
        prompt = torch.arange(96)  # 6 pages
        lease = _prefill(engine, prompt, insert_last=insert_last)
        processed = len(prompt)
        for token in range(5):  # decode into page 7, the state advanced in place
            lease.extend([token])
            units = cache.allocate(lease, partial_page=True)
            if len(units["mamba"]):  # a new working slot: continue from the checkpoint
                engine.fork(lease)
            processed += 1
            engine.run_to(processed)
        cache.insert(lease)
        cached, state = engine.restored_state(torch.cat([prompt, torch.tensor([7, 7, 7])]))
        assert state == cached, f"{cached} tokens restored with the state after {state:.0f}"
        assert cached == (96 if insert_last else 64)


def test_a_page_completed_while_decoding_is_checkpointed_when_inserted_at_its_end() -> None:
    """Decoding fills the partial page; inserted as it completes (the allocation ends there),
    the working slot holds exactly the state after it: a checkpoint a later request resumes from."""
    with kvstrata.open(_STATE_STACK, environ={}) as cache:
        engine = _RecurrentEngine(cache)
        prompt = torch.arange(96)
        lease = _prefill(engine, prompt, insert_last=True)
        decoded = list(range(16))
        for count, token in enumerate(decoded, start=1):
            lease.extend([token])
            units = cache.allocate(lease, partial_page=lease.pages * 16 < len(prompt) + count)
            if len(units["mamba"]):
                engine.fork(lease)
            engine.run_to(len(prompt) + count)
        assert lease.pages == 7 and lease.allocated_pages == 7  # page 7 whole, nothing beyond
        cache.insert(lease)
        cached, state = engine.restored_state(torch.cat([prompt, torch.tensor(decoded), torch.tensor([9])]))
        assert (cached, state) == (112, 112.0)


class _InPlaceEngine:
    """A model that advances its state in place from what the slot holds (state after n tokens
    is n), forking after every ``allocate`` as the README's chunk loop does."""

    def __init__(self, cache: kvstrata.CacheController, lease: kvstrata.Lease) -> None:
        self.cache, self.lease, self.ran = cache, lease, lease.cached_tokens

    def step(self, to: int, *, partial: bool = False) -> None:
        self.cache.allocate(self.lease, partial_page=partial)
        slot = self.cache.fork_state(self.lease)["mamba"]
        if not len(slot):  # nothing to compute: the cache held the chunk whole
            return
        state = self.cache.read_units("mamba", slot)["ssm"] if self.ran else torch.zeros(1, 1, 1)
        self.cache.write_units("mamba", slot, {"ssm": state + (to - self.ran)})
        self.ran = to


@pytest.mark.parametrize("checkpoint_beside", [False, True])
def test_fork_state_never_resets_a_slot_the_engine_already_runs_in(checkpoint_beside: bool) -> None:
    # fork_state copied the checkpoint over whatever slot was pending: a second fork of one slot
    # (two chunks, one insert; or a slot kept past a partial page, with another request's
    # checkpoint where the insert landed) reset the running state, stored as a checkpoint
    with kvstrata.open(_STATE_STACK, environ={}) as cache:
        prompt = torch.arange(100, 196)  # 6 pages
        first = cache.lookup(prompt[:32])
        cache.admit(first)
        _InPlaceEngine(cache, first).step(32)
        cache.insert(first)  # a checkpoint at page 2
        lease = cache.lookup(prompt[:64])
        cache.admit(lease)
        engine = _InPlaceEngine(cache, lease)
        engine.step(64)  # a new slot, forked from page 2
        lease.extend(prompt[64:69])
        if checkpoint_beside:  # another request checkpoints page 4, where the next insert lands
            other = cache.lookup(prompt[:64])
            cache.admit(other)
            _InPlaceEngine(cache, other).step(64)
            cache.insert(other)
        engine.step(69, partial=True)  # no new slot: the same one runs on
        cache.insert(lease, close=False)
        lease.extend(prompt[69:80])
        engine.step(80)
        cache.insert(lease)
        again = cache.lookup(torch.cat([prompt[:80], torch.tensor([1])]))
        cache.admit(again)
        state = cache.read_units("mamba", again.prefix_units("mamba"))["ssm"].item()
        assert (again.cached_tokens, state) == (80, 80.0)
        cache.release(again)


def test_the_chunk_loop_serves_a_prompt_the_cache_holds_whole() -> None:
    # a chunk the cache held whole gets no state slot: fork_state raised "call allocate first"
    with kvstrata.open(_STATE_STACK, environ={}) as cache:
        prompt = torch.arange(100, 196)
        for attempt in range(2):
            lease = cache.lookup(prompt[:32])
            cache.admit(lease)
            engine = _InPlaceEngine(cache, lease)
            while True:
                engine.step(lease.pages * 16)
                cache.insert(lease, close=False)
                if lease.pages * 16 >= len(prompt):
                    break
                lease.extend(prompt[lease.pages * 16 : lease.pages * 16 + 32])
            cache.insert(lease)
            assert lease.cached_pages == 2 * attempt
        again = cache.lookup(torch.cat([prompt, torch.tensor([1])]))
        cache.admit(again)
        assert cache.read_units("mamba", again.prefix_units("mamba"))["ssm"].item() == 96.0
        cache.release(again)
        fresh = cache.lookup(torch.arange(500, 532))
        with pytest.raises(RuntimeError, match="allocate first"):
            cache.fork_state(fresh)  # pages to compute and no slot: still an error
        cache.release(fresh)
