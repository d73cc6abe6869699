"""``NodeSet``: tree nodes the write path remembers across calls, swept of the ones it no longer
needs only when the set has doubled -- so a call costs O(1), not O(tree), however large the tree.
Each of its users swept at every call once past a fixed bound: 4.6 ms per drain (confirmed by L3)
and 5.9 ms per write (refused by the storage filter) with 20,000 live nodes; test_controller.py
checks the window ends on the real write path."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller_support import GoneNode, LiveNode, open_cache, serve, tokens
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


def _remembered(cache: object) -> dict[str, NodeSet]:
    writer = cache.writer  # type: ignore[attr-defined]
    return {
        "refused": writer.refused,
        "retry": writer.retry._nodes,
        "waits": writer.waits._nodes,
        "window_ends": writer.window_ends,
        "confirmed": writer.hit_touch._confirmed,
        "new_end": writer.hit_touch._new_end,
    }


@pytest.mark.parametrize(
    "overrides",
    [["policy.admission.storage.type=tinylfu"], ["policy.write=write_back"]],
    ids=["write_through_tinylfu", "write_back"],
)
def test_a_node_eviction_deletes_leaves_every_write_path_set(tmp_path: Path, overrides: list[str]) -> None:
    """A deleted node (and its page keys: 8 bytes per token) leaves every set at once. The sweep
    waits for 8192 nodes, and a deleted node can be any size: each set held up to 8192 dead
    nodes' keys (34 MiB after 1,500 short requests on 512-token pages; a 32k-token prompt's node
    alone is 256 KiB) long after the tree let them go."""
    with open_cache("swa", tmp_path, overrides) as cache:
        for i in range(120):  # three times the host tier's pages: eviction deletes all the time
            for _ in range(2):  # the second time a hit (L3 asked, the reuse admitted)
                serve(cache, tokens(i, 3))
            cache.flush()
        sets = _remembered(cache)
        held = {name: len(nodes) for name, nodes in sets.items()}
        dead = {name: sum(node.parent is None for node in nodes) for name, nodes in sets.items()}
        assert sum(held.values()) > 0  # (the sets were used)
        assert dead == dict.fromkeys(dead, 0), held
