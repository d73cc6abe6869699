"""The host state slots that checkpoints their node keeps on the device hold: a state pool's
last room in the host tier.

A component's host copy leaves the host tier only once the device holds none (``_may_lose`` in
``core/tree_eviction.py``): the node's pages are served from L1 meanwhile. The anchor has a
second pass for such copies (``_drop_copies`` there), a state pool had none: with few host state
slots (``host_units: 3``) the first nodes a request backed up kept every slot while they stayed
on the device, and each later backup was skipped -- a chunked prompt's checkpoints past the third
page, and the next requests' whole nodes, reached neither the host tier nor L3, although
``room_by_evicting`` counted those slots as room.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvstrata.core.tree_node import _HOST, UNIT, EvictionResult, SetValue, TreeNode


def drop_state_copies(
    holders: Iterable[TreeNode], set_value: SetValue, p: int, name: str, want: int, result: EvictionResult
) -> None:
    """Drop the host copies of state pool ``p`` (``name``) whose node keeps the state on the
    device, unlocked (an L3 write's source is locked until written), the longest held first (the
    order ``holders`` joined), until ``result`` holds ``want`` units. The node stays backed up;
    its checkpoint is on the device, and in L3 under write-through."""
    have = result.units.get(name, 0)
    victims: list[TreeNode] = []
    for node in holders:
        if have >= want:
            break
        value = node.host_raw[p]
        if value is not None and node.device_raw[p] is not None and not node.host_lock[p]:
            victims.append(node)
            have += len(value) // UNIT
    for node in victims:  # (setting a value changes ``holders``: after the walk)
        value = node.host_raw[p]
        assert value is not None
        result._add_raw(name, value)
        set_value(node, _HOST, p, None)
        result.tombstoned += 1
