"""The per-step plan kvstrata's vLLM connector sends from its scheduler role to its workers
(inside the connector metadata): which blocks to load, save, ask for and drop."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class GroupTransfer:
    """Blocks of one group to move: object ``hashes[i]`` <-> vLLM block ``block_ids[i]``."""

    group_id: int
    hashes: list[str]
    block_ids: list[int]


Stored = tuple[list[str], str | None, list[int]]  # blocks stored: hashes, parent hash, tokens


@dataclass
class StepPlan:
    """What the workers do in one step (sent inside the connector metadata)."""

    loads: dict[str, list[GroupTransfer]] = field(default_factory=dict)  # req id -> transfers
    saves: list[GroupTransfer] = field(default_factory=list)
    #: per request range saved: (its block hashes, the parent hash, its token ids), for the
    #: ``BlockStored`` events the workers publish once the anchor objects are stored
    stored: list[Stored] = field(default_factory=list)
    #: blocks of a prefix vLLM served from its own cache to a request starting now: the workers
    #: ask L3 for them, which keeps them recent in an LRU bound (the file backend's index), and
    #: store the ones L3 lost again -- else a hot prefix vLLM keeps serving locally was what L3
    #: evicted first, stranding every block keyed under it (keys are chained: a lookup in another
    #: engine starts at block 0)
    held: list[GroupTransfer] = field(default_factory=list)
    #: finished requests' own state checkpoints (and ones a prefill replaced): no lookup asks
    #: for them again, so the workers remove them from every state group's pool
    drops: list[str] = field(default_factory=list)

    def for_workers(self) -> bool:
        """Whether the workers have anything to do after the step's forward pass."""
        return bool(self.saves or self.drops or self.held)


def once_each(
    saves: Iterable[GroupTransfer], stored: list[Stored], block_size: int
) -> tuple[list[GroupTransfer], list[Stored]]:
    """A step's saves, each block once per group, and stored ranges less the blocks an earlier
    one has (a chain: its head): requests computing the same blocks in one step (vLLM without its
    prefix cache) put and announce each object once."""
    unique = []
    for transfer in saves:
        pairs = dict(zip(transfer.hashes, transfer.block_ids, strict=True))
        unique.append(GroupTransfer(transfer.group_id, list(pairs), list(pairs.values())))
    announced: set[str] = set()
    ranges = []
    for hashes, parent, tokens in stored:
        skip = next((i for i, h in enumerate(hashes) if h not in announced), len(hashes))
        if skip < len(hashes):
            ranges.append((hashes[skip:], hashes[skip - 1] if skip else parent, tokens[skip * block_size :]))
        announced.update(hashes)
    return unique, ranges


def written_since(held: list[GroupTransfer], written: set[int]) -> list[GroupTransfer]:
    """``held`` less the blocks not known written since the connector's reset (``written``):
    vLLM's own prefix cache outlives a reset issued while requests run (its block pool refuses
    to reset with blocks in use; the connector is reset anyway), so a request arriving later
    hits blocks of the old weights -- never to be stored under the new generation's keys."""
    kept = []
    for transfer in held:
        if not transfer.block_ids:  # (a state checkpoint: asked for only, no bytes stored)
            kept.append(transfer)
            continue
        pairs = [(h, b) for h, b in zip(transfer.hashes, transfer.block_ids, strict=True) if b in written]
        if pairs:
            kept.append(GroupTransfer(transfer.group_id, [h for h, _ in pairs], [b for _, b in pairs]))
    return kept
