"""The SGLang backend's per-batch stats: SGLang drains them (``get_stats``) only with its storage
metrics on; without them every batch added an entry to four lists for the process's life."""

from __future__ import annotations

from kvstrata.adapters._sglang_support import Stats

KEPT = 4096  # ``_sglang_support.STATS_KEPT``


def test_batch_stats_nobody_drains_stay_bounded() -> None:
    stats = Stats()
    for n in range(3 * KEPT):
        stats.record(reading=n % 2 == 0, pages=n + 1, nbytes=1 << 20, seconds=0.001)
    prefetch, backup, prefetch_bw, backup_bw = stats.drain()
    assert len(prefetch) == len(backup) == len(prefetch_bw) == len(backup_bw) == KEPT
    assert prefetch[-1] == 3 * KEPT - 1 and backup[-1] == 3 * KEPT, "the newest are kept"
    assert stats.drain() == ([], [], [], []), "drained"


def test_drained_stats_are_every_batch_since_the_last_drain() -> None:
    stats = Stats()
    stats.record(reading=True, pages=3, nbytes=3 << 20, seconds=0.001)
    stats.record(reading=False, pages=2, nbytes=0, seconds=0.0)
    stats.record(reading=True, pages=0, nbytes=0, seconds=0.001)  # no pages: not a batch
    prefetch, backup, prefetch_bw, backup_bw = stats.drain()
    assert (prefetch, backup, backup_bw) == ([3], [2], [0.0]) and len(prefetch_bw) == 1
