"""The worker role of kvstrata's vLLM connector: block bytes between vLLM's paged tensors and L3.

vLLM's paged tensors are kvstrata's L1. A layer's block is one or two dense byte ranges (its
*planes*): block-first tensors ``(num_blocks, ...)`` (vLLM's CPU backend, FlashInfer, Mamba/GDN
byte pages) hold a block in one range at ``block * stride(0)``; FlashAttention's
``(2, num_blocks, ...)`` holds its K and V halves in two. A stored block is the concatenation of
every layer's planes in order (K before V), so both shapes store the same bytes. A CPU engine's
blocks are stored and restored in place, with no copy of ours (the backend's plan decides
zero-copy or staging). Blocks on an accelerator cross the bus once per batch through pinned
host staging, never a copy per layer or a pageable one: saved blocks are gathered by device
kernels straight into it (through its CUDA view, one kernel per layer), loaded ones cross in one
DMA and are scattered on the device.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kvstrata.adapters._vllm_layout import STATE, GroupLayout, StoreLayout
from kvstrata.adapters._vllm_plan import GroupTransfer, StepPlan
from kvstrata.engine_kit import BatchResult, StorageEngine, cuda_alias
from kvstrata.plugins import BufferRegion

log = logging.getLogger(__name__)

#: stored ranges kept for vLLM's events between two takes (a step saves one per request)
STORED_RANGES_KEPT = 4096


@dataclass(frozen=True)
class _Plane:
    """``(blocks, nbytes)`` uint8 view of one dense range per block of a layer's tensor."""

    rows: torch.Tensor
    nbytes: int

    @property
    def base(self) -> int:
        return self.rows.data_ptr()

    @property
    def stride(self) -> int:
        return self.rows.stride(0)


@dataclass(frozen=True)
class _Part:
    """Planes that one kernel moves: a plane's ``(blocks, width)`` rows, or ``(planes, blocks,
    width)`` where consecutive planes lie at one fixed distance in the same memory (the K and V
    halves of a FlashAttention layer), and their columns ``start:stop`` of a staging row."""

    source: torch.Tensor
    start: int
    stop: int
    planes: int

    @property
    def dim(self) -> int:
        """The block dimension of ``source``."""
        return 0 if self.planes == 1 else 1

    def columns(self, staging: torch.Tensor) -> torch.Tensor:
        """These planes' columns of ``staging`` rows, shaped like ``source`` indexed by block."""
        view = staging[:, self.start : self.stop]
        return view if self.planes == 1 else view.unflatten(1, (self.planes, -1)).transpose(0, 1)


def _runs(planes: Sequence[_Plane]) -> list[list[_Plane]]:
    """Consecutive planes grouped where one strided view covers them: same memory, rows and
    width, each one fixed positive distance after the one before."""
    runs: list[list[_Plane]] = []
    for plane in planes:
        run = runs[-1] if runs else None
        if run is not None and _extends(run, plane):
            run.append(plane)
        else:
            runs.append([plane])
    return runs


def _extends(run: list[_Plane], plane: _Plane) -> bool:
    first, last = run[0], run[-1]
    distance = plane.base - last.base
    return (
        plane.rows.untyped_storage().data_ptr() == first.rows.untyped_storage().data_ptr()
        and plane.rows.shape == first.rows.shape
        and plane.stride == first.stride
        and distance > 0
        and (len(run) == 1 or distance == last.base - run[-2].base)
    )


@dataclass(frozen=True)
class _Columns:
    """How a group's planes map onto staging rows (one row per block, the planes side by side),
    worked out once at registration, in 8-byte words where every plane and offset allows (index
    kernels move one element per thread, so bytes would take eight times the work), else bytes.
    A copy then costs one kernel per part -- a layer, where its K and V planes merge -- and no
    per-call view building: launches, not the bus, bound a batch of a few blocks."""

    words: bool
    parts: tuple[_Part, ...]

    @classmethod
    def of(cls, planes: Sequence[_Plane]) -> _Columns:
        aligned = all(
            p.nbytes % 8 == 0 and p.rows.storage_offset() % 8 == 0 and p.stride % 8 == 0 for p in planes
        )
        unit = 8 if aligned else 1
        parts, column = [], 0
        for run in _runs(planes):
            rows = run[0].rows.view(torch.int64) if unit == 8 else run[0].rows
            width = run[0].nbytes // unit
            if len(run) > 1:
                distance = (run[1].base - run[0].base) // unit
                shape, strides = (len(run), rows.shape[0], width), (distance, rows.stride(0), 1)
                rows = rows.as_strided(shape, strides, rows.storage_offset())
            parts.append(_Part(rows, column, column + width * len(run), len(run)))
            column += width * len(run)
        return cls(unit == 8, tuple(parts))

    def staging_view(self, staging: torch.Tensor) -> torch.Tensor:
        return staging.view(torch.int64) if self.words else staging


def _dense(block: torch.Tensor) -> bool:
    """Whether a block's elements fill one gap-free byte range (in any dimension order, so a
    permuted HND/NHD view of a dense block counts: bytes are moved as they lie)."""
    expected = 1
    for size, stride in sorted(zip(block.shape, block.stride(), strict=True), key=lambda d: d[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def _planes(name: str, tensor: torch.Tensor, layer_bytes: int, num_blocks: int | None) -> list[_Plane]:
    """The planes of one layer. ``num_blocks`` (vLLM's ``kv_cache_config.num_blocks``) tells a
    K/V-split ``(2, num_blocks, ...)`` tensor from a block-first one; unknown means block-first."""
    split = tensor.dim() >= 3 and num_blocks not in (None, 2) and tuple(tensor.shape[:2]) == (2, num_blocks)
    if tensor.dim() < 1 or tensor.shape[0] < 1:
        raise ValueError(
            f"vLLM layer {name!r}: expected a (num_blocks, ...) or (2, num_blocks, ...) paged tensor, "
            f"got {tuple(tensor.shape)}"
        )
    if not split and num_blocks is not None and tensor.shape[0] < num_blocks:
        # e.g. FlashAttention's (2, num_blocks * k, ...) where vLLM's block is k kernel blocks:
        # read as two blocks, block 1 was the V half (other blocks' bytes under a block's key)
        raise ValueError(
            f"vLLM layer {name!r}: a {tuple(tensor.shape)} tensor holds neither vLLM's {num_blocks} "
            f"blocks (num_blocks, ...) nor (2, {num_blocks}, ...): unsupported KV cache layout (a "
            "kernel block size other than vLLM's block size?)"
        )
    halves = [tensor[0], tensor[1]] if split else [tensor]
    nbytes = layer_bytes // len(halves)
    try:
        raw = tensor.view(torch.uint8) if tensor.dtype != torch.uint8 else tensor
    except RuntimeError as exc:
        raise ValueError(f"vLLM layer {name!r}: cannot address its bytes ({exc})") from None
    planes = []
    for half in halves:
        block = half[0]
        block_bytes = block.numel() * block.element_size()
        if not _dense(block) or block_bytes < nbytes or half.stride(0) < 0:
            raise ValueError(
                f"vLLM layer {name!r}: a block{' half' if split else ''} is {block_bytes} bytes "
                f"(dense: {_dense(block)}), the spec says {nbytes}: unsupported KV cache layout "
                f"{tuple(tensor.shape)} / {tensor.stride()}"
            )
        offset = (half.data_ptr() - raw.data_ptr()) + raw.storage_offset()
        stride = half.stride(0) * half.element_size()
        rows = raw.as_strided((int(half.shape[0]), nbytes), (stride, 1), offset)
        planes.append(_Plane(rows, nbytes))
    return planes


class WorkerSide:
    """Loads and saves blocks for one worker (one TP rank)."""

    def __init__(self, engine: StorageEngine, layout: StoreLayout) -> None:
        self.engine = engine
        self.layout = layout
        self.groups: dict[int, GroupLayout] = {g.group_id: g for g in layout.groups}
        self.planes: dict[int, list[_Plane]] = {}  # per group: every layer's planes, in order
        self.columns: dict[int, _Columns] = {}  # per group: the planes' places in a staging row
        self.blocks = 0
        self.device = torch.device("cpu")
        #: blocks in host memory are read and written where they lie; else through pinned staging
        self.in_place = True
        self.finished_loads: set[str] = set()
        self.failed_loads: set[str] = set()
        #: the blocks of the failed loads since the last ``take_finished`` (the anchor's), for a
        #: vLLM that asks ``get_finished``: it learns of a failed load only by its blocks
        self.failed_blocks: set[int] = set()
        # a failed load is counted once, by the scheduler (vLLM sums the roles' and ranks' stats)
        #: (``resaved_blocks``: blocks vLLM held whose objects L3 had lost, stored again)
        counters = ("loaded_blocks", "saved_blocks", "save_failures", "own_states_removed", "resaved_blocks")
        self.stats = dict.fromkeys(counters, 0)
        self._save_failure_logged = False  # the first failed save says why; the rest are counted
        #: (hashes, parent hash, token ids) of block ranges whose anchor objects this rank stored:
        #: vLLM's ``BlockStored`` events (kept where every rank stored its shard). vLLM takes them
        #: every step; the oldest go where nothing does (under ``MultiConnector``, which never
        #: asks its connectors for events: the list grew for the life of the engine)
        self.stored_ranges: deque[tuple[list[str], str | None, list[int]]] = deque(maxlen=STORED_RANGES_KEPT)
        #: hashes of loaded blocks whose objects were refused as damaged or foreign (removed),
        #: and the blocks after them: vLLM's ``BlockRemoved`` events (a miss or a failed call
        #: removes nothing: those blocks were announced and may still be served)
        self.removed_ranges: deque[list[str]] = deque(maxlen=STORED_RANGES_KEPT)

    def register(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """vLLM's tensors per layer become the groups' L1 (checked against the spec once)."""
        devices = {t.device for t in kv_caches.values()}
        if len(devices) > 1:
            raise ValueError(f"vLLM registered KV caches on several devices {sorted(map(str, devices))}")
        counts = set()
        planes_of: dict[int, list[_Plane]] = {}  # kept only once every group checks out
        for group in self.layout.groups:
            missing = [name for name in group.layer_names if name not in kv_caches]
            if missing:
                raise ValueError(
                    f"vLLM registered no KV cache for layers {missing} of group {group.group_id}"
                )
            planes_of[group.group_id] = [
                plane
                for name in group.layer_names
                for plane in _planes(name, kv_caches[name], group.layer_bytes, self.layout.num_blocks)
            ]
            counts.update(plane.rows.shape[0] for plane in planes_of[group.group_id])
        self.columns = {group_id: _Columns.of(planes) for group_id, planes in planes_of.items()}
        self.planes = planes_of
        self.blocks = min(counts, default=0)
        self.device = next(iter(devices), torch.device("cpu"))
        self.in_place = self.device.type == "cpu"

    # --- regions and staging ----------------------------------------------------------------------

    def _check(self, block_ids: Sequence[int]) -> None:
        """Each block id checked here: one out of range must fail this transfer, not trip a
        device-side assert that ends the engine."""
        bad = [block for block in block_ids if not 0 < block < self.blocks]
        if bad:
            raise ValueError(f"block ids {bad[:8]} outside vLLM's {self.blocks} blocks (0 is the null block)")

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        """The checked block ids as an index on the blocks' device."""
        self._check(block_ids)
        return torch.tensor(list(block_ids), dtype=torch.long).to(self.device, non_blocking=True)

    def _regions(self, group_id: int, block_ids: Sequence[int]) -> list[list[tuple[BufferRegion, ...]]]:
        self._check(block_ids)
        planes = self.planes[group_id]
        return [
            [tuple(BufferRegion(plane.base + block * plane.stride, plane.nbytes) for plane in planes)]
            for block in block_ids
        ]

    def _staging(self, group_id: int, count: int) -> torch.Tensor:
        """Pinned ``(blocks, bytes per block)`` host memory: one DMA per batch each way."""
        width = self.groups[group_id].layer_bytes * len(self.groups[group_id].layer_names)
        return torch.empty((count, width), dtype=torch.uint8, pin_memory=self.device.type == "cuda")

    def _staged(self, group_id: int, block_ids: Sequence[int]) -> torch.Tensor:
        """Host copy of device blocks in pinned memory. On a GPU, one kernel per part (a layer)
        gathers its blocks straight into their columns of the staging rows through the staging's
        device view (:func:`cuda_alias`), so the bytes cross the bus once (measured on an H200:
        0.81-0.83 of a contiguous copy for 64 blocks, against 0.71-0.77 with a gather and a
        scatter kernel per plane); elsewhere the blocks are gathered on the device and copied
        over in one piece."""
        index = self._index(block_ids)
        staging = self._staging(group_id, len(block_ids))
        alias = cuda_alias(staging, self.device) if self.device.type == "cuda" else None
        gathered = (
            alias if alias is not None else torch.empty(staging.shape, dtype=torch.uint8, device=self.device)
        )
        columns = self.columns[group_id]
        target = columns.staging_view(gathered)
        try:
            for part in columns.parts:
                torch.index_select(part.source, part.dim, index, out=part.columns(target))
            if alias is None:
                staging.copy_(gathered, non_blocking=True)
        finally:  # the backend reads it next; and where a kernel raised, the staging goes back to
            # torch's pinned allocator, which knows nothing of kernels writing through its device
            # view: none may still write into it when the allocator hands it out again
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
        return staging

    def _scatter(self, group_id: int, index: torch.Tensor, staging: torch.Tensor) -> None:
        """Host rows to their device blocks: one copy to the device, a scatter per plane there,
        queued on the current stream (the forward that follows sees the bytes). Measured on an
        H200, this beat kernels reading the pinned rows through their device view (0.78-0.87
        of a contiguous copy against 0.72-0.78): those must gather the rows first anyway."""
        columns = self.columns[group_id]
        rows = columns.staging_view(staging.to(self.device, non_blocking=True))
        for part in columns.parts:
            part.source.index_copy_(part.dim, index, part.columns(rows))

    @staticmethod
    def _rows(staging: torch.Tensor) -> list[list[tuple[BufferRegion, ...]]]:
        base, row = staging.data_ptr(), staging[0].numel() if staging.shape[0] else 0
        return [[(BufferRegion(base + i * row, row),)] for i in range(staging.shape[0])]

    # --- loads and saves ------------------------------------------------------------------------

    def _get(self, transfer: GroupTransfer) -> BatchResult:
        pool = self.groups[transfer.group_id].pool
        if self.in_place:
            return self.engine.get(
                pool, transfer.hashes, self._regions(transfer.group_id, transfer.block_ids)
            )
        index = self._index(transfer.block_ids)  # checked before anything is read
        staging = self._staging(transfer.group_id, len(transfer.block_ids))
        result = self.engine.get(pool, transfer.hashes, self._rows(staging))
        if all(result.ok):  # a request restores all of its blocks or none (vLLM recomputes)
            self._scatter(transfer.group_id, index, staging)
        return result

    def load(self, plan: StepPlan) -> None:
        """Every load of the step, request by request, all groups or the request fails; the
        blocks whose objects were refused (and removed) are kept for vLLM's ``BlockRemoved``."""
        for req_id, transfers in plan.loads.items():
            ok = True
            refused: set[str] = set()
            try:
                for transfer in transfers:  # anchor first; on a failure every group is still
                    # read, so each damaged object is found (and removed) now, not on a later try
                    result = self._get(transfer) if transfer.hashes else None
                    if result is None or not all(result.ok):
                        ok = False
                    else:
                        self.stats["loaded_blocks"] += len(transfer.hashes)
                    if result is not None:
                        refused.update(transfer.hashes[i] for i in result.rejected)
            except Exception:  # a failing backend fails this load, never the engine
                log.exception("kvstrata: loading %s failed; vLLM recomputes it", req_id)
                ok = False
            self.finished_loads.add(req_id)
            if not ok:
                self.failed_loads.add(req_id)
                self.failed_blocks.update(transfers[0].block_ids if transfers else ())
            anchor = transfers[0].hashes if transfers else []
            first = next((k for k, h in enumerate(anchor) if h in refused), len(anchor))
            if first < len(anchor):  # no lookup finds the blocks from there on (keys are chained)
                self.removed_ranges.append(anchor[first:])

    def save(self, plan: StepPlan) -> None:
        """The blocks this step completed, components before the anchor (its object commits, so
        a block some component did not store gets none); then the ranges whose anchor objects
        are stored, for vLLM's KV events."""
        lost: dict[int, set[str]] = {}  # per group: held blocks L3 lost, stored again here
        by_group = self._with_lost_held(plan, {t.group_id: t for t in plan.saves}, lost)
        anchor_stored: set[str] = set()
        missing: set[str] = set()  # blocks some component did not store: their anchor must not commit
        for group in self.layout.save_order():
            transfer = by_group.get(group.group_id)
            if transfer is None or not transfer.hashes:
                continue
            if group is self.layout.anchor and missing:
                kept = [i for i, h in enumerate(transfer.hashes) if h not in missing]
                self.stats["save_failures"] += len(transfer.hashes) - len(kept)
                hashes, block_ids = [transfer.hashes[i] for i in kept], [transfer.block_ids[i] for i in kept]
                transfer = GroupTransfer(transfer.group_id, hashes, block_ids)
                if not kept:
                    continue
            try:
                if self.in_place:
                    units = self._regions(group.group_id, transfer.block_ids)
                    result = self.engine.put(group.pool, transfer.hashes, units)
                else:
                    staging = self._staged(group.group_id, transfer.block_ids)
                    result = self.engine.put(group.pool, transfer.hashes, self._rows(staging))
                stored = sum(result.ok)
                again = lost.get(group.group_id, set())
                self.stats["resaved_blocks"] += sum(
                    h in again for h, ok in zip(transfer.hashes, result.ok, strict=True) if ok
                )
                if result.error is not None and not self._save_failure_logged:
                    self._save_failure_logged = True
                    log.warning(
                        "kvstrata: saving blocks of group %d failed: %s (later failures are counted in "
                        "the connector's save_failures, not logged)",
                        group.group_id,
                        result.error,
                    )
                if group is self.layout.anchor:
                    anchor_stored.update(h for h, ok in zip(transfer.hashes, result.ok, strict=True) if ok)
                else:
                    missing.update(h for h, ok in zip(transfer.hashes, result.ok, strict=True) if not ok)
            except Exception:
                log.exception(
                    "kvstrata: saving %d blocks of group %d failed", len(transfer.hashes), group.group_id
                )
                stored = 0
                missing.update(transfer.hashes)
            self.stats["saved_blocks"] += stored
            self.stats["save_failures"] += len(transfer.hashes) - stored
        block = self.layout.block_size
        for hashes, parent, tokens in plan.stored:
            done = next((i for i, h in enumerate(hashes) if h not in anchor_stored), len(hashes))
            if done:  # the leading run stored: a chain from ``parent`` a router can follow
                self.stored_ranges.append((hashes[:done], parent, tokens[: done * block]))
        if plan.drops:
            self._drop(plan.drops)

    def _with_lost_held(
        self, plan: StepPlan, saves: dict[int, GroupTransfer], lost_hashes: dict[int, set[str]]
    ) -> dict[int, GroupTransfer]:
        """``saves`` plus the blocks of ``plan.held`` L3 lost (asking refreshes the rest where the
        store keeps an LRU): vLLM's own copies are stored again (their hashes: ``lost_hashes``,
        counted in ``resaved_blocks`` once stored)."""
        for held in plan.held:
            result = self.engine.exists(self.groups[held.group_id].pool, held.hashes)
            if result.error is not None or not held.block_ids:  # (unreachable; a state: asked only)
                continue
            before = saves.get(held.group_id, GroupTransfer(held.group_id, [], []))
            # a block this step saves anyway (another request's, or an earlier held's) is not lost
            planned = set(before.hashes)
            lost = [k for k, present in enumerate(result.ok) if not present and held.hashes[k] not in planned]
            if not lost:
                continue
            lost_hashes.setdefault(held.group_id, set()).update(held.hashes[k] for k in lost)
            saves[held.group_id] = GroupTransfer(
                held.group_id,
                before.hashes + [held.hashes[k] for k in lost],
                before.block_ids + [held.block_ids[k] for k in lost],
            )
        return saves

    def _drop(self, keys: list[str]) -> None:
        """Remove requests' own state checkpoints no lookup asks for again (``StepPlan.drops``)
        from every state group's pool, after this step's saves; where the store cannot remove,
        its capacity bound drops them like any cold object."""
        for group in self.layout.groups:
            if group.kind == STATE:
                self.stats["own_states_removed"] += sum(self.engine.discard(group.pool, keys).ok)

    def take_stored_ranges(self) -> list[tuple[list[str], str | None, list[int]]]:
        """The ranges stored since the last call (the worker's ``BlockStored`` events)."""
        ranges = list(self.stored_ranges)
        self.stored_ranges.clear()
        return ranges

    def take_removed_ranges(self) -> list[list[str]]:
        """The blocks found unusable since the last call (the worker's ``BlockRemoved`` events)."""
        ranges = list(self.removed_ranges)
        self.removed_ranges.clear()
        return ranges

    def take_finished(self) -> tuple[set[str], set[str]]:
        done, failed = self.finished_loads, self.failed_loads
        self.finished_loads, self.failed_loads, self.failed_blocks = set(), set(), set()
        return done, failed
