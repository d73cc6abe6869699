"""A get's rejected objects, read once more before they count as damage or are removed.

Why: a rejected object is removed by its key, not by what was read, and a name can change what it
holds between a read and that removal. Seen with the ``file`` backend (``recycle_evicted``, the
default, under verified reads, which take no lock): reader A opens K1's file; process B evicts K1
and rewrites that very file as K2; process C stores K1 afresh; A reads K2's bytes
(``key_mismatch``; a mix of the two: ``checksum_mismatch``), and removing K1 by key deleted C's
valid object while a false corruption was counted. Read again at once, the key yields the fresh
object (a hit) or nothing (a miss): only an object rejected twice in a row is damage. Any store
gains where an object can be replaced between a read and the removal (another reader removed a
damaged or foreign object and a writer stored the key again): what the second read verifies is
served and kept. The window narrows to the second read, it does not close: a key replaced again
between it and the removal is still removed.

Cost: nothing on the normal path (nothing rejected); one more read of each rejected object,
once, in one backend call (a store full of another layout's objects reads each of them twice
before removing it). Objects of a verdict the reader keeps (``keep``: a reader that keeps
foreign objects) are not read again: nothing removes them, and read twice at every get they
doubled that reader's reads of another writer's objects for as long as they stayed.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence

from kvstrata.core.integrity import ChecksumPolicy, Verdict
from kvstrata.core.storage_batch import ObjectBatch, ReadChecks, verify_batch

#: reads a batch through the backend: bytes per object (None: the call failed), why it failed,
#: and the checks its I/O threads ran (None: unverified reads)
Reader = Callable[[ObjectBatch], tuple[list[int] | None, str | None, ReadChecks | None]]


def verify_read(
    batch: ObjectBatch,
    read: list[int],
    checksum: ChecksumPolicy,
    checks: ReadChecks | None,
    reread: Reader,
    keep: Container[Verdict] = (),
) -> tuple[list[bool], dict[Verdict, list[str]], int]:
    """:func:`~kvstrata.core.storage_batch.verify_batch`, with the rejected objects read again
        (``reread``) and verified once more: per object whether it is good, the keys rejected both
        times by their second verdict, and how many first rejections the second read cleared (a hit
        or a miss); those of a verdict in ``keep`` keep their first one, unread. ``read`` is updated in
    place with the second read's byte counts."""
    good, rejected = verify_batch(batch, read, checksum, checks)
    kept = {verdict: keys for verdict, keys in rejected.items() if verdict in keep}
    if len(kept) == len(rejected):  # (nothing rejected, or nothing that would be removed)
        return good, rejected, 0
    skip = {key for keys in kept.values() for key in keys}
    rows = [
        row
        for row, (ok, nbytes) in enumerate(zip(good, read, strict=True))
        if not ok and nbytes >= 0 and batch.objects[row].key not in skip
    ]
    again = _subset(batch, rows)
    second, _error, second_checks = reread(again)
    if second is None:  # the backend failed this time: the first verdicts stand
        return good, rejected, 0
    again.headers[...] = batch.headers[rows]  # the headers as read again (into the batch's rows)
    second_good, again_rejected = verify_batch(again, second, checksum, second_checks)
    for position, row in enumerate(rows):
        read[row] = second[position]
        good[row] = second_good[position]
    cleared = len(rows) - sum(len(keys) for keys in again_rejected.values())
    for verdict, keys in kept.items():
        again_rejected.setdefault(verdict, []).extend(keys)
    return good, again_rejected, cleared


def _subset(batch: ObjectBatch, rows: Sequence[int]) -> ObjectBatch:
    """The objects at ``rows`` as a batch of their own, one object per unit. They read into the
    same regions (header and payload) as in ``batch``; the new batch's ``headers`` is a copy,
    refreshed by the caller once they have been read."""
    return ObjectBatch(
        [batch.objects[row] for row in rows],
        [batch.payloads[row] for row in rows],
        batch.headers[rows],
        1,
        payload_nbytes=batch.payload_nbytes[rows],
        fingerprints=batch.fingerprints[rows],
        digests=batch.digests[rows],
    )
