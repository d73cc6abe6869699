"""The vLLM connector's worker role on the paged tensor shapes vLLM hands it, without vLLM.

Block-first tensors (vLLM's CPU backend, FlashInfer, Mamba/GDN byte pages with a padded block
stride) and FlashAttention's K/V-split ``(2, num_blocks, ...)`` (also as a permuted HND view) are
saved to a real file-backend L3 and loaded into other blocks of fresh tensors, byte for byte.
``KVSTRATA_TEST_DEVICE=cuda`` runs the same tests on a GPU, where the staging path (kernels writing
into pinned memory through its device view; one DMA back) is the one vLLM uses; on the CPU both run.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import xxhash

from kvstrata.adapters import _vllm_worker
from kvstrata.adapters._shared import EngineStorage
from kvstrata.adapters._vllm_layout import build_layout, identity_of
from kvstrata.adapters._vllm_scheduler import GroupTransfer, StepPlan
from kvstrata.adapters._vllm_worker import WorkerSide
from kvstrata.core.config import load
from kvstrata.engine_kit import ParallelConfig

DEVICE = os.environ.get("KVSTRATA_TEST_DEVICE", "cpu")
REPO = Path(__file__).resolve().parents[1]
BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM, LAYERS = 12, 16, 2, 64, 2
GDN_BYTES, GDN_STRIDE = 3000, 4096  # a state page padded to a longer block stride


class FullAttentionSpec(SimpleNamespace):
    pass


class MambaSpec(SimpleNamespace):
    pass


def _kv_cache_config() -> Any:
    attention = FullAttentionSpec(
        block_size=BLOCK_SIZE,
        num_kv_heads=HEADS,
        head_size=HEAD_DIM,
        dtype="bfloat16",
        real_page_size_bytes=2 * BLOCK_SIZE * HEADS * HEAD_DIM * 2,
    )
    mamba = MambaSpec(
        block_size=BLOCK_SIZE, shapes=((3, 500),), dtypes=("int8",), mamba_cache_mode="align",
        real_page_size_bytes=GDN_BYTES,
    )  # fmt: skip
    attention_layers = [f"layers.{i}.self_attn" for i in range(LAYERS)]
    groups = [
        SimpleNamespace(kv_cache_spec=attention, layer_names=attention_layers),
        SimpleNamespace(kv_cache_spec=mamba, layer_names=["layers.9.linear_attn"]),
    ]
    return SimpleNamespace(
        kv_cache_groups=groups, prefix_cacheable_group_ids=(0, 1), kv_cache_layout=None, num_blocks=BLOCKS
    )


def _attention_tensor(shape: str) -> torch.Tensor:
    """One layer's paged K/V tensor as an attention backend lays it out."""
    dims = (BLOCK_SIZE, HEADS, HEAD_DIM)
    if shape == "block_first":  # (num_blocks, 2, block, heads, dim): CPU backend, FlashInfer
        return torch.empty((BLOCKS, 2, *dims), dtype=torch.bfloat16, device=DEVICE)
    if shape == "kv_split":  # (2, num_blocks, block, heads, dim): FlashAttention, NHD
        return torch.empty((2, BLOCKS, *dims), dtype=torch.bfloat16, device=DEVICE)
    # FlashAttention with HND: the same logical shape over (2, num_blocks, heads, block, dim) memory
    raw = torch.empty((2, BLOCKS, HEADS, BLOCK_SIZE, HEAD_DIM), dtype=torch.bfloat16, device=DEVICE)
    return raw.permute(0, 1, 3, 2, 4)


def _gdn_tensor() -> torch.Tensor:
    """(num_blocks, 1, 1, page) int8 state pages with a block stride longer than the page."""
    raw = torch.empty((BLOCKS, GDN_STRIDE), dtype=torch.int8, device=DEVICE)
    return raw[:, :GDN_BYTES].reshape(BLOCKS, 1, 1, GDN_BYTES)


def _caches(shape: str, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    caches = {f"layers.{i}.self_attn": _attention_tensor(shape) for i in range(LAYERS)}
    caches["layers.9.linear_attn"] = _gdn_tensor()
    for tensor in caches.values():
        values = torch.randint(-100, 100, tensor.shape, generator=generator)
        tensor.copy_(values.to(tensor.dtype))
    return caches


def _block(tensor: torch.Tensor, block: int) -> torch.Tensor:
    """A block's logical content (K and V of a K/V-split tensor side by side)."""
    if tensor.dim() == 5 and tensor.shape[0] == 2 and tensor.shape[1] == BLOCKS:
        return torch.stack([tensor[0, block], tensor[1, block]]).cpu()
    return tensor[block].cpu()


@pytest.fixture
def open_worker(tmp_path: Path) -> Iterator[Callable[[], WorkerSide]]:
    config = load(
        [REPO / "tests" / "stacks" / "kv.yaml"], overrides=[f"tiers.storage.l3.path={tmp_path / 'l3'}"]
    )
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(model="m", served_model_name="m", revision=None, dtype="bfloat16"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        cache_config=SimpleNamespace(cache_dtype="auto"),
    )
    layout = build_layout(vllm_config, _kv_cache_config(), model_name="m", weights="w")
    storages: list[EngineStorage] = []

    def make() -> WorkerSide:
        storage = EngineStorage(identity_of(layout, ParallelConfig()), "l3", config.tiers.storage["l3"])
        for group in layout.groups:
            assert storage.add_pool(group.pool, group.spec).enabled
        storages.append(storage)
        return WorkerSide(storage.engine, layout)

    yield make
    for storage in storages:
        storage.close()


def _plan(worker: WorkerSide, blocks: list[int], *, load: bool) -> StepPlan:
    transfers = [
        GroupTransfer(
            group.group_id, [xxhash.xxh3_128_hexdigest(b"p%d" % i) for i in range(len(blocks))], blocks
        )
        for group in worker.layout.groups
    ]
    return StepPlan(loads={"req": transfers}) if load else StepPlan(saves=transfers)


PATHS = ["in_place", "staged"] if DEVICE == "cpu" else ["staged"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    ("saved_as", "loaded_as"),
    [("block_first", "block_first"), ("kv_split", "kv_split"), ("kv_split_hnd", "kv_split_hnd"),
     ("kv_split", "block_first")],
)  # fmt: skip
def test_blocks_come_back_byte_exact_into_other_blocks(
    open_worker: Callable[[], WorkerSide], path: str, saved_as: str, loaded_as: str
) -> None:
    saver, loader = open_worker(), open_worker()  # two workers over one L3: two engines' view
    source, target = _caches(saved_as, seed=1), _caches(loaded_as, seed=2)
    saver.register(source)
    loader.register(target)
    saver.in_place = loader.in_place = path == "in_place"
    saved, loaded = [3, 7, 1, 5], [2, 11, 4, 6]
    untouched = {name: _block(t, 8).clone() for name, t in target.items()}
    saver.save(_plan(saver, saved, load=False))
    assert saver.stats == {
        "loaded_blocks": 0,
        "saved_blocks": 8,
        "save_failures": 0,
        "own_states_removed": 0,
        "resaved_blocks": 0,
    }
    loader.load(_plan(loader, loaded, load=True))
    assert loader.take_finished() == ({"req"}, set())
    for name in source:
        for src_block, dst_block in zip(saved, loaded, strict=True):
            assert torch.equal(_block(source[name], src_block), _block(target[name], dst_block)), name
        assert torch.equal(_block(target[name], 8), untouched[name])  # a block nobody asked for


def test_padding_between_state_pages_is_neither_stored_nor_written(open_worker) -> None:
    worker = open_worker()
    caches = _caches("block_first", seed=3)
    worker.register(caches)
    gdn = caches["layers.9.linear_attn"]
    padding = gdn.reshape(BLOCKS, GDN_BYTES).as_strided(
        (BLOCKS, GDN_STRIDE - GDN_BYTES), (GDN_STRIDE, 1), GDN_BYTES
    )
    padding.fill_(77)
    worker.save(_plan(worker, [1, 2], load=False))
    gdn.fill_(0)
    worker.load(_plan(worker, [1, 2], load=True))
    assert worker.take_finished() == ({"req"}, set())
    assert bool((padding == 77).all())  # the load wrote only the page bytes


@pytest.mark.parametrize("block", [0, BLOCKS, -1])
def test_a_block_id_out_of_range_fails_that_request_and_touches_nothing(open_worker, block: int) -> None:
    worker = open_worker()
    caches = _caches("kv_split", seed=4)
    worker.register(caches)
    worker.save(_plan(worker, [1, 2], load=False))
    before = {name: t.clone() for name, t in caches.items()}
    worker.load(_plan(worker, [1, block], load=True))
    assert worker.take_finished() == ({"req"}, {"req"})
    assert all(torch.equal(before[name], t) for name, t in caches.items())
    worker.save(_plan(worker, [block], load=False))
    assert worker.stats["save_failures"] == 2


def test_an_unaddressable_layout_is_refused_by_name(open_worker) -> None:
    worker = open_worker()
    caches = _caches("block_first", seed=5)
    wide = torch.zeros((BLOCKS, 2, BLOCK_SIZE, HEADS, 2 * HEAD_DIM), dtype=torch.bfloat16, device=DEVICE)
    caches["layers.1.self_attn"] = wide[..., :HEAD_DIM]  # a block with gaps between its rows
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn"):
        worker.register(caches)


@pytest.mark.parametrize("path", PATHS)
def test_a_request_with_a_missing_block_fails_and_writes_nothing(open_worker, path: str) -> None:
    worker = open_worker()
    caches = _caches("kv_split", seed=6)
    worker.register(caches)
    worker.in_place = path == "in_place"
    worker.save(_plan(worker, [1, 2], load=False))  # objects p0, p1
    before = {name: t.clone() for name, t in caches.items()}
    worker.load(_plan(worker, [3, 4, 5], load=True))  # p2 was never stored
    assert worker.take_finished() == ({"req"}, {"req"})
    if path == "staged":  # in place, hits land before the miss is known; vLLM recomputes them
        assert all(torch.equal(before[name], t) for name, t in caches.items())


@pytest.mark.parametrize("one_storage", [False, True])
def test_planes_at_a_fixed_distance_move_in_one_kernel_and_byte_exact(open_worker, one_storage: bool) -> None:
    """K and V halves of a FlashAttention layer are one part of the staging copy (one kernel
    per layer, not per half); layers cut from one allocation at a fixed distance merge into a
    single part. Either way the staged bytes are the in-place ones."""
    saver, loader = open_worker(), open_worker()
    source = _caches("kv_split", seed=6)
    if one_storage:  # every attention layer a view of one (layers, 2, num_blocks, ...) tensor
        whole = torch.empty(
            (LAYERS, 2, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM), dtype=torch.bfloat16, device=DEVICE
        )
        for i in range(LAYERS):
            whole[i].copy_(source[f"layers.{i}.self_attn"])
            source[f"layers.{i}.self_attn"] = whole[i]
    saver.register(source)
    attention = saver.layout.groups[0].group_id
    parts = saver.columns[attention].parts
    assert [part.planes for part in parts] == ([2 * LAYERS] if one_storage else [2] * LAYERS)
    target = _caches("block_first", seed=7)
    loader.register(target)
    saver.in_place = loader.in_place = False
    saver.save(_plan(saver, [3, 9], load=False))
    loader.load(_plan(loader, [5, 1], load=True))
    assert loader.take_finished() == ({"req"}, set())
    for name in source:
        for src_block, dst_block in ((3, 5), (9, 1)):
            assert torch.equal(_block(source[name], src_block), _block(target[name], dst_block)), name


@pytest.mark.parametrize("fault", ["one_block_refused", "group_raises"])
def test_a_block_whose_state_was_not_stored_gets_no_anchor_object_or_event(open_worker, fault: str) -> None:
    # the anchor object commits a block: it was written (and BlockStored announced) though the
    # block's Mamba state had failed to store, so routers were told of blocks no lookup serves
    worker = open_worker()
    worker.register(_caches("block_first", seed=8))
    plan = _plan(worker, [1, 2, 3], load=False)
    hashes = plan.saves[0].hashes
    plan.stored.append((hashes, None, list(range(3 * BLOCK_SIZE))))
    state_pool, put = worker.layout.groups[1].pool, worker.engine.put

    def failing_put(pool: str, keys: list[str], units: Any) -> Any:  # fault injection
        if pool != state_pool:
            return put(pool, keys, units)
        if fault == "group_raises":
            raise OSError("disk full")
        result = put(pool, keys, units)
        result.ok[1] = False  # block 1's state refused (its object stays: no anchor makes it a hit)
        return result

    worker.engine.put = failing_put  # type: ignore[method-assign]
    worker.save(plan)
    anchor = worker.layout.anchor.pool
    written = worker.engine.exists(anchor, hashes).ok
    expected = [True, False, True] if fault == "one_block_refused" else [False, False, False]
    assert written == expected
    leading = [ranged[0] for ranged in worker.stored_ranges]
    assert leading == ([hashes[:1]] if fault == "one_block_refused" else [])
    assert worker.stats["saved_blocks"] == (4 if fault == "one_block_refused" else 0)


def test_stored_ranges_nobody_takes_are_bounded(open_worker, monkeypatch: pytest.MonkeyPatch) -> None:
    # vLLM's MultiConnector never asks its connectors for KV events: the ranges grew for the life
    # of the engine; the newest are kept, and a take empties them
    monkeypatch.setattr(_vllm_worker, "STORED_RANGES_KEPT", 3)
    worker = open_worker()
    worker.register(_caches("block_first", seed=9))
    for step in range(5):
        plan = _plan(worker, [1 + step], load=False)
        plan.stored.append((plan.saves[0].hashes, None, [step] * BLOCK_SIZE))
        worker.save(plan)
    taken = worker.take_stored_ranges()
    assert [tokens[0] for _, _, tokens in taken] == [2, 3, 4]
    assert worker.take_stored_ranges() == []


def test_a_kv_split_tensor_of_smaller_kernel_blocks_is_refused_not_read_as_two_blocks(open_worker) -> None:
    """FlashAttention's ``(2, num_blocks * k, block / k, ...)`` -- vLLM's block split into k kernel
    blocks -- matched neither shape check: it was taken as a block-first cache of two blocks,
    "block 1" being the V half (audit s41: the first kernel blocks' V saved under block 1's key,
    and loaded over them). Refused by name."""
    worker = open_worker()
    caches = _caches("block_first", seed=10)
    kernel = torch.zeros(
        (2, 2 * BLOCKS, BLOCK_SIZE // 2, HEADS, HEAD_DIM), dtype=torch.bfloat16, device=DEVICE
    )
    caches["layers.1.self_attn"] = kernel
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn.*unsupported KV cache layout"):
        worker.register(caches)


def test_a_refused_registration_keeps_no_group_registered(open_worker) -> None:
    """A layer refused in the second group left the first group's planes registered (over the
    refused dict's tensors) next to the block count of an earlier registration: nothing is kept."""
    worker = open_worker()
    caches = _caches("block_first", seed=11)
    del caches["layers.9.linear_attn"]
    with pytest.raises(ValueError, match=r"layers\.9\.linear_attn"):
        worker.register(caches)
    assert worker.planes == {} and worker.columns == {} and worker.blocks == 0


@pytest.mark.skipif(DEVICE != "cpu", reason="fault injection of the CUDA path, on a CPU-only machine")
def test_a_save_gather_that_raises_part_way_waits_for_the_kernels_it_issued(
    open_worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fault injection (a worker that takes its CPU tensors for ``cuda:0``; the pinned staging's
    device view is the staging itself; the current stream and the second layer's gather kernel
    are stand-ins, the gather raising): on a GPU, the layers gathered before the fault were
    kernels still writing into the pinned staging through its device view, and the staging went
    back to torch's pinned allocator (which records no event for such kernels) un-waited: the
    next staging handed out, a load's rows written by the backend, could be overwritten by them.
    The stream is now synchronized on the way out."""
    worker = open_worker()
    worker.register(_caches("block_first", seed=12))
    worker.device = torch.device("cuda", 0)
    waits: list[str] = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(
        synchronize=lambda: waits.append("synchronize")
    ))  # fmt: skip
    monkeypatch.setattr(_vllm_worker, "cuda_alias", lambda view, device: view)
    monkeypatch.setattr(worker, "_index", lambda block_ids: torch.tensor(list(block_ids)))
    group = worker.groups[0]
    width = group.layer_bytes * len(group.layer_names)
    monkeypatch.setattr(
        worker, "_staging", lambda group_id, count: torch.empty((count, width), dtype=torch.uint8)
    )
    real = torch.index_select
    gathers: list[int] = []

    def fails_second(*args: Any, **kwargs: Any) -> torch.Tensor:
        if gathers:
            raise RuntimeError("injected kernel fault")
        gathers.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "index_select", fails_second)
    with pytest.raises(RuntimeError, match="injected kernel fault"):
        worker._staged(0, [1, 2])
    assert gathers and waits == ["synchronize"]
