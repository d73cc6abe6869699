"""The worker role of kvstrata's vLLM connector: block bytes between vLLM's paged tensors and L3.

vLLM's paged tensors are kvstrata's L1: a block of a layer is addressed in place (its first
``layer_bytes`` bytes at ``data_ptr + block * stride(0)``), so a CPU engine's blocks are stored
and restored with no copy of ours (the backend's plan decides zero-copy or staging). Tensors on
an accelerator go through one host staging copy per batch.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kvstrata.adapters._vllm_layout import GroupLayout, StoreLayout
from kvstrata.adapters._vllm_scheduler import GroupTransfer, StepPlan
from kvstrata.engine_kit import StorageEngine
from kvstrata.plugins import BufferRegion

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _LayerBlocks:
    """One layer's paged tensor as (base address, block stride) of bytes."""

    tensor: torch.Tensor
    base: int
    stride: int
    blocks: int


def _layer_blocks(name: str, tensor: torch.Tensor, layer_bytes: int) -> _LayerBlocks:
    if tensor.dim() < 1 or tensor.shape[0] < 1:
        raise ValueError(
            f"vLLM layer {name!r}: expected (num_blocks, ...) paged tensor, got {tuple(tensor.shape)}"
        )
    block = tensor[0]
    block_bytes = block.numel() * block.element_size()
    if not block.is_contiguous() or block_bytes < layer_bytes:
        raise ValueError(
            f"vLLM layer {name!r}: a block is {block_bytes} bytes (contiguous: {block.is_contiguous()}), "
            f"the spec says {layer_bytes}: unsupported KV cache layout "
            f"{tuple(tensor.shape)} / {tensor.stride()}"
        )
    return _LayerBlocks(
        tensor, tensor.data_ptr(), tensor.stride(0) * tensor.element_size(), int(tensor.shape[0])
    )


class WorkerSide:
    """Loads and saves blocks for one worker (one TP rank)."""

    def __init__(self, engine: StorageEngine, layout: StoreLayout) -> None:
        self.engine = engine
        self.layout = layout
        self.groups: dict[int, GroupLayout] = {g.group_id: g for g in layout.groups}
        self.layers: dict[int, list[_LayerBlocks]] = {}
        self.on_host = True
        self.finished_loads: set[str] = set()
        self.failed_loads: set[str] = set()
        self.stats = {"loaded_blocks": 0, "load_failures": 0, "saved_blocks": 0, "save_failures": 0}

    def register(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """vLLM's tensors per layer become the groups' L1 (checked against the spec once)."""
        for group in self.layout.groups:
            missing = [name for name in group.layer_names if name not in kv_caches]
            if missing:
                raise ValueError(
                    f"vLLM registered no KV cache for layers {missing} of group {group.group_id}"
                )
            self.layers[group.group_id] = [
                _layer_blocks(name, kv_caches[name], group.layer_bytes) for name in group.layer_names
            ]
        devices = {t.device.type for t in kv_caches.values()}
        self.on_host = devices <= {"cpu"}

    # --- regions --------------------------------------------------------------------------------

    def _regions(self, group_id: int, block_ids: Sequence[int]) -> list[list[tuple[BufferRegion, ...]]]:
        layers = self.layers[group_id]
        nbytes = self.groups[group_id].layer_bytes
        units = []
        for block in block_ids:
            if not 0 < block < layers[0].blocks:
                raise ValueError(f"block id {block} outside vLLM's {layers[0].blocks} blocks")
            units.append([tuple(BufferRegion(layer.base + block * layer.stride, nbytes) for layer in layers)])
        return units

    def _staged(self, group_id: int, block_ids: Sequence[int]) -> torch.Tensor:
        """(blocks, layers, layer_bytes) host copy of device blocks."""
        nbytes = self.groups[group_id].layer_bytes
        index = torch.tensor(list(block_ids), dtype=torch.long)
        rows = []
        for layer in self.layers[group_id]:
            flat = layer.tensor.view(layer.blocks, -1).view(torch.uint8)[:, :nbytes]
            rows.append(flat.index_select(0, index.to(flat.device)).cpu())
        return torch.stack(rows, dim=1).contiguous()

    def _scatter(
        self, group_id: int, block_ids: Sequence[int], staging: torch.Tensor, ok: Sequence[bool]
    ) -> None:
        nbytes = self.groups[group_id].layer_bytes
        keep = [i for i, hit in enumerate(ok) if hit]
        if not keep:
            return
        rows = torch.tensor(keep, dtype=torch.long)
        for j, layer in enumerate(self.layers[group_id]):
            flat = layer.tensor.view(layer.blocks, -1).view(torch.uint8)
            index = torch.tensor([block_ids[i] for i in keep], dtype=torch.long, device=flat.device)
            flat[:, :nbytes].index_copy_(0, index, staging[rows, j].to(flat.device))

    @staticmethod
    def _rows(staging: torch.Tensor) -> list[list[tuple[BufferRegion, ...]]]:
        base, row = staging.data_ptr(), staging[0].numel() if staging.shape[0] else 0
        return [[(BufferRegion(base + i * row, row),)] for i in range(staging.shape[0])]

    # --- loads and saves ------------------------------------------------------------------------

    def _get(self, transfer: GroupTransfer) -> bool:
        pool = self.groups[transfer.group_id].pool
        if self.on_host:
            result = self.engine.get(
                pool, transfer.hashes, self._regions(transfer.group_id, transfer.block_ids)
            )
            return all(result.ok)
        nbytes = self.groups[transfer.group_id].layer_bytes
        layers = len(self.layers[transfer.group_id])
        staging = torch.empty((len(transfer.block_ids), layers, nbytes), dtype=torch.uint8)
        result = self.engine.get(pool, transfer.hashes, self._rows(staging))
        if all(result.ok):
            self._scatter(transfer.group_id, transfer.block_ids, staging, result.ok)
        return all(result.ok)

    def load(self, plan: StepPlan) -> None:
        """Every load of the step, request by request, all groups or the request fails."""
        for req_id, transfers in plan.loads.items():
            ok = True
            try:
                for transfer in transfers:  # anchor first; on a failure every group is still
                    # read, so each damaged object is found (and removed) now, not on a later try
                    if not transfer.hashes or not self._get(transfer):
                        ok = False
                    else:
                        self.stats["loaded_blocks"] += len(transfer.hashes)
            except Exception:  # a failing backend fails this load, never the engine
                log.exception("kvstrata: loading %s failed; vLLM recomputes it", req_id)
                ok = False
            self.finished_loads.add(req_id)
            if not ok:
                self.failed_loads.add(req_id)
                self.stats["load_failures"] += 1

    def save(self, plan: StepPlan) -> None:
        """The blocks this step completed, components before the anchor (its object commits)."""
        by_group = {t.group_id: t for t in plan.saves}
        for group in self.layout.save_order():
            transfer = by_group.get(group.group_id)
            if transfer is None or not transfer.hashes:
                continue
            try:
                if self.on_host:
                    units = self._regions(group.group_id, transfer.block_ids)
                    result = self.engine.put(group.pool, transfer.hashes, units)
                else:
                    staging = self._staged(group.group_id, transfer.block_ids)
                    result = self.engine.put(group.pool, transfer.hashes, self._rows(staging))
                stored = sum(result.ok)
            except Exception:
                log.exception(
                    "kvstrata: saving %d blocks of group %d failed", len(transfer.hashes), group.group_id
                )
                stored = 0
            self.stats["saved_blocks"] += stored
            self.stats["save_failures"] += len(transfer.hashes) - stored

    def take_finished(self) -> tuple[set[str], set[str]]:
        done, failed = self.finished_loads, self.failed_loads
        self.finished_loads, self.failed_loads = set(), set()
        return done, failed
