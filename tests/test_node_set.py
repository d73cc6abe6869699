"""``NodeSet``: tree nodes the write path remembers across calls, swept of the ones it no longer
needs only when the set has doubled -- so a call costs O(1), not O(tree), however large the tree.
Each of its users swept at every call once past a fixed bound: 4.6 ms per drain (confirmed by L3)
and 5.9 ms per write (refused by the storage filter) with 20,000 live nodes; test_controller.py
checks the window ends on the real write path."""

from __future__ import annotations

from pathlib import Path

from controller_support import GoneNode, LiveNode, open_cache
from kvstrata.core.node_set import NodeSet


def test_a_set_of_live_nodes_is_swept_once_per_doubling_not_per_add() -> None:
    swept: list[int] = []
    nodes = NodeSet(lambda node: swept.append(1) or True)  # type: ignore[func-returns-value]
    first = NodeSet.FIRST_SWEEP
    for _ in range(4 * first):
        nodes.add(LiveNode())  # type: ignore[arg-type]
    # sweeps past first and past twice what that one kept (each keeps all): < 1x the adds in looks
    assert len(nodes) == 4 * first
    assert len(swept) == (first + 1) + (2 * (first + 1) + 1)


def test_a_sweep_drops_the_nodes_no_longer_kept_and_keeps_the_others() -> None:
    nodes = NodeSet()  # default: kept while in the tree
    live = [LiveNode() for _ in range(10)]
    gone = [GoneNode() for _ in range(NodeSet.FIRST_SWEEP)]
    nodes.update(live + gone)  # type: ignore[operator]
    assert len(nodes) == len(live)
    assert all(node in nodes for node in live) and not any(node in nodes for node in gone)
    nodes.difference_update(live[:3])  # type: ignore[arg-type]
    nodes.discard(live[3])  # type: ignore[arg-type]
    assert [node in nodes for node in live] == [False] * 4 + [True] * 6


def test_every_set_of_nodes_the_write_path_remembers_is_one(tmp_path: Path) -> None:
    """The nodes refused by a storage filter, the window ends stored, the hits L3 confirmed."""
    with open_cache("swa", tmp_path, ["policy.admission.storage.type=tinylfu"]) as cache:
        writer = cache.writer
        for remembered in (writer.refused, writer.window_ends, writer.hit_touch._confirmed):
            assert isinstance(remembered, NodeSet)
