"""The floor of a chunk: the steps ``engine_calls.py`` times, done with no cache around them.

Each 8-page chunk of the engine loop must at least check and key the new tokens (``extend``),
take a slot of kv units and one state slot (``allocate``), copy the last checkpoint into the new
slot (``fork_state``), and record a node holding the chunk's units and its checkpoint, moving
the request's lock onto it, with its share of a write-through backup every 64 pages
(``insert``). This loop does exactly that on the same buffers (kv and Mamba, tiny, CPU) with
numpy free lists and plain objects: no argument or lease checks, no recency, no metrics, no
admission, no eviction, no error handling. What a cache pays above it is its bookkeeping; what
this costs no design in Python can avoid. Timed like the cache (thread CPU per call).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import torch

#: the write-through batch of an open lease (the cache's default ``write_through_batch_pages``)
BATCH_PAGES = 64


class _Node:
    __slots__ = ("children", "device", "edge", "host", "locks", "parent")

    def __init__(self, parent: _Node | None, edge: list[bytes], device: tuple[bytes, bytes]) -> None:
        self.parent, self.edge, self.device = parent, edge, device
        self.children: dict[bytes, _Node] | None = None
        self.host: tuple[bytes, bytes] | None = None
        self.locks = 0


class _FreeList:
    """Ascending unit indices handed out from the front (what a fresh allocator does)."""

    def __init__(self, units: int) -> None:
        self.free = np.arange(units, dtype=np.int64)
        self.in_use = np.zeros(units, dtype=np.bool_)
        self.lock = threading.Lock()

    def take(self, count: int) -> np.ndarray:
        with self.lock:
            taken, self.free = self.free[:count], self.free[count:]
            self.in_use[taken] = True
        return taken


def floor_calls(request: torch.Tensor, chunk: int, page: int) -> dict[str, float]:
    """Seconds per call of each kind (thread CPU time) for the bare loop over ``request``."""
    pages = len(request) // page
    units = pages + 8
    # the cache's pool buffers, viewed as numpy rows (as its CPU copies use them)
    kv = np.zeros((2, units, page * 8), np.uint16)  # k and v: one layer, one head, head_dim 8, bf16
    conv, ssm = np.zeros((units, 3 * 8), np.uint16), np.zeros((units, 2 * 4 * 4), np.float32)
    host_kv, host_conv, host_ssm = np.zeros_like(kv), np.zeros_like(conv), np.zeros_like(ssm)
    kv_free, state_free, host_kv_free, host_state_free = (_FreeList(units) for _ in range(4))
    guard = threading.RLock()
    clock = time.thread_time
    spent = {"allocate": 0.0, "fork_state": 0.0, "insert": 0.0, "extend": 0.0}
    step = page * 8
    keys: list[bytes] = []
    node = _Node(None, [], (b"", b""))
    node.locks = 1
    units_out: dict[str, torch.Tensor] = {}
    last_slot = -1
    unbacked: list[_Node] = []
    chunks = 0
    piece = request[: chunk * page]
    while True:
        start = clock()  # extend: the token check (high halves zero) and one key per whole page
        words = piece.numpy()
        if np.count_nonzero(words.view(np.uint32)[1::2]):
            raise ValueError("token ids must lie in [0, 2**32)")
        flat = words.tobytes()
        keys.extend([flat[at : at + step] for at in range(0, len(flat), step)])
        extended = clock()
        with guard:  # allocate: the chunk's kv units and a state slot, as tensors for the engine
            kv_units, slot = kv_free.take(chunk), state_free.take(1)
            units_out = {"kv": torch.from_numpy(kv_units), "mamba": torch.from_numpy(slot)}
        allocated = clock()
        with guard:  # fork_state: the last checkpoint into the new slot (one row per buffer)
            new_slot = int(slot[0])
            if last_slot >= 0:
                conv[new_slot] = conv[last_slot]
                ssm[new_slot] = ssm[last_slot]
        forked = clock()
        with guard:  # insert: a node of the chunk's pages, the lock moved onto it
            child = _Node(node, keys[-chunk:], (kv_units.tobytes(), slot.tobytes()))
            if node.children is None:
                node.children = {}
            node.children[keys[-chunk]] = child
            node.locks -= 1
            child.locks += 1
            node, last_slot = child, new_slot
            unbacked.append(child)
            if len(unbacked) * chunk >= BATCH_PAGES or len(keys) >= pages:
                _back_up(unbacked, kv, conv, ssm, host_kv, host_conv, host_ssm, host_kv_free, host_state_free)
                unbacked = []
        inserted = clock()
        spent["extend"] += extended - start
        spent["allocate"] += allocated - extended
        spent["fork_state"] += forked - allocated
        spent["insert"] += inserted - forked
        chunks += 1
        if len(keys) >= pages:
            break
        piece = request[len(keys) * page : (len(keys) + chunk) * page]
    assert units_out["kv"].shape[0] == chunk  # the engine's view of the last allocation
    return {call: seconds / chunks for call, seconds in spent.items()}


def _back_up(
    nodes: list[_Node],
    kv: np.ndarray,
    conv: np.ndarray,
    ssm: np.ndarray,
    host_kv: np.ndarray,
    host_conv: np.ndarray,
    host_ssm: np.ndarray,
    kv_free: _FreeList,
    state_free: _FreeList,
) -> None:
    """Copy a batch of nodes to host units and record each node's share of them."""
    device_kv = np.frombuffer(b"".join(n.device[0] for n in nodes), np.int64)
    device_state = np.frombuffer(b"".join(n.device[1] for n in nodes), np.int64)
    kv_to, state_to = kv_free.take(len(device_kv)), state_free.take(len(device_state))
    host_kv[:, _rows(kv_to)] = kv[:, _rows(device_kv)]
    host_conv[_rows(state_to)] = conv[_rows(device_state)]
    host_ssm[_rows(state_to)] = ssm[_rows(device_state)]
    kv_raw, state_raw = kv_to.tobytes(), state_to.tobytes()
    at = 0
    for k, node in enumerate(nodes):
        width = len(node.device[0])
        node.host = (kv_raw[at : at + width], state_raw[k * 8 : k * 8 + 8])
        at += width


def _rows(indices: np.ndarray) -> slice | np.ndarray:
    """``indices`` as a slice where they are a run (what these free lists hand out: ascending
    runs, so the ends say it), as the cache's copies take runs: one memcpy per buffer."""
    first = int(indices[0])
    return slice(first, first + len(indices)) if int(indices[-1]) - first == len(indices) - 1 else indices
