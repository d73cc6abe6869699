"""A request's hold on its cached prefix: what ``lookup`` found, ``admit`` settled, and the
units the engine reads. An engine reads its public fields and calls; the controller moves it
from state to state only through its transition methods (lock, settle, allocate, insert, close),
so every field of a lease is written here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NoReturn

import numpy as np
import torch

from kvstrata.core.keys import hash_pages
from kvstrata.core.stack import NO_UNITS, PoolKind, StackLayout, TreePool
from kvstrata.core.tokens import token_bytes
from kvstrata.core.tree import LockHandle, MatchResult, PrefixTree, Tier, TreeNode
from kvstrata.core.tree_bytes import UNIT, unit_tensor

if TYPE_CHECKING:
    from kvstrata.core.prefetch_op import PrefetchOp
    from kvstrata.core.retention import Pin, RetentionHint


# Enum member lookups (``PoolKind.PAGES``) go through a descriptor (~0.1 us each), and every
# chunk of a request reads a few: the per-chunk paths compare against these aliases instead.
_PAGES, _WINDOW, _STATE = PoolKind.PAGES, PoolKind.WINDOW, PoolKind.STATE
_DEVICE = Tier.DEVICE


class CacheFullError(RuntimeError):
    """The device tier cannot hold a request's new pages even after evicting everything unlocked.
    ``short``: units per pool still missing after the eviction (a pool's own ``device_units``, not
    the tier, may be what is short); ``too_long``: the request is longer than the tier (not tried)."""

    def __init__(self, message: str, short: Mapping[str, int] | None = None, too_long: bool = False) -> None:
        super().__init__(message)
        self.short: dict[str, int] = dict(short or {})
        self.too_long = too_long


class _NotCopyable:
    """A lease is one request's hold on units: a copy would insert or release them a second time
    (its pending units indexed twice, or freed while the tree holds them)."""

    def __reduce_ex__(self, protocol: object) -> NoReturn:  # copy.copy, copy.deepcopy, pickle
        raise TypeError(
            "a kvstrata Lease cannot be copied or pickled: it is one request's hold on the cache's "
            "units; pass the lease itself"
        )


@dataclass(eq=False)
class Lease(_NotCopyable):
    """A request's hold on its cached prefix, from ``lookup`` to ``insert`` or ``release``.

    A lease may grow (:meth:`extend`, chunked prefill and decode) and commit chunk by chunk
    (``insert(lease, close=False)``); it keeps its place in the tree and its page hashes, so each
    chunk costs only its new pages.
    """

    keys: list[bytes]
    _tail: bytes  # tokens after the last whole page, int64 bytes (as a page key holds them)
    namespace_root: str
    page_size: int
    device_pages: int = 0  # usable on device at lookup
    host_pages: int = 0  # usable on device + host at lookup
    cached_pages: int = 0  # usable on device after admit
    committed_pages: int = 0  # pages of this request in the tree: cached + inserted by it
    allocated_pages: int = 0  # end of the units handed out so far (>= committed_pages)
    hit_pages: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0, "storage": 0})
    record: bool = True  # count this request in the hit metrics
    #: pages the host tier or L3 held that this request could not use, by SkipReason
    skipped: dict[str, int] = field(default_factory=dict)
    admitted: bool = False
    closed: bool = False
    retention: RetentionHint | None = None  # priority / pin / TTL of the prefix (lookup's hint)
    _hashes: list[str] | None = None
    _prefix: dict[str, torch.Tensor] = field(default_factory=dict)  # tree pool -> device units
    _first: dict[str, int] = field(default_factory=dict)
    _owner_of: dict[str, str] = field(default_factory=dict)
    _device_lock: LockHandle | None = None
    _host_lock: LockHandle | None = None
    _node: TreeNode | None = None  # the tree node ending at committed_pages (None: the root)
    _prefetch: PrefetchOp | None = None
    _storage_pages: int = 0  # pages [host_pages, host_pages + this) came from L3
    _pin: Pin | None = None
    #: units handed out but not yet inserted, per tree pool (window pools: contiguous last pages),
    #: as int64 bytes: what the tree stores, so an insert hands them over with no conversion, and
    #: a copy, so an engine writing into the tensors ``allocate`` returned cannot change them
    _allocated: dict[str, bytes] | None = None
    #: per state pool, the tensor ``allocate`` handed out for its pending slot (``fork_state``
    #: hands it back: no tensor per chunk); ``_unforked``: new slots fork_state has not filled
    _slot_tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    _unforked: set[str] = field(default_factory=set)
    _allocated_first: dict[str, int] = field(default_factory=dict)  # page of each pool's first new unit
    #: page units it computed that an insert keeping it open found in the tree (another request's
    #: first): its engine still reads its own, so they are freed at close (see free_duplicates)
    _duplicates: list[dict[str, torch.Tensor]] | None = None
    #: the cache whose lookup made it: no other cache honours it
    _issuer: object = field(default=None, repr=False)
    origin: tuple[str, int, str] = field(default=("?", 0, "?"), repr=False)  # what called lookup

    def bind_issuer(self, issuer: object, owner_of: dict[str, str], origin: tuple[str, int, str]) -> None:
        """``lookup``: only ``issuer`` honours this lease; ``owner_of`` maps each pool to the tree
        pool whose units it shares; ``origin`` is where lookup was called (for the close warning)."""
        self._issuer, self._owner_of, self.origin = issuer, owner_of, origin

    @property
    def pages(self) -> int:
        """Whole pages of the request so far."""
        return len(self.keys)

    @property
    def tokens(self) -> torch.Tensor:
        """Every token of the request so far (whole pages and the partial one)."""
        return torch.from_numpy(np.frombuffer(b"".join([*self.keys, self._tail]), dtype=np.int64).copy())

    @property
    def page_hashes(self) -> list[str]:
        """Chained hashes (hex) of every whole page, computed once each, incrementally."""
        if self._hashes is None:
            self._hashes = []
        have = len(self._hashes)
        if have < len(self.keys):
            parent = self._hashes[-1] if self._hashes else self.namespace_root
            tokens = np.frombuffer(b"".join(self.keys[have:]), dtype=np.int64)
            self._hashes.extend(hash_pages(tokens, self.page_size, parent))
        return self._hashes

    def hashes_source(self) -> list[str]:
        """:attr:`page_hashes` as a call: asked for only to queue an L3 write (no L3, no hashing)."""
        return self.page_hashes

    @property
    def cached_tokens(self) -> int:
        """Tokens of the cached prefix the engine may skip: settled by ``admit`` (L3 prefetch and
        load-back add pages after ``lookup``), so reading it earlier is an error, never a 0."""
        if not self.admitted:
            raise RuntimeError(
                "lease.cached_tokens is settled by cache.admit(lease) (L3 and load-back may add pages); "
                "before it, lease.device_pages / lease.host_pages say what lookup matched"
            )
        return self.cached_pages * self.page_size

    def extend(self, tokens: Sequence[int] | torch.Tensor) -> int:
        """Append tokens (the next prefill chunk, or decoded tokens); returns the whole pages
        this completed. Units for them come from the next ``allocate``."""
        if self.closed:
            self._require_open()
        # each whole page's key straight from the token bytes (as ``page_keys`` makes them): one
        # copy of the chunk, no tensor to build, join or slice per chunk
        new = token_bytes(tokens)  # checked ids, int64 bytes
        flat = self._tail + new if self._tail else new
        step = self.page_size * 8
        end = len(flat) - len(flat) % step
        self.keys.extend([flat[at : at + step] for at in range(0, end, step)])
        self._tail = flat[end:] if end < len(flat) else b""
        return end // step

    def prefix_units(self, pool: str) -> torch.Tensor:
        """Device units holding the cached prefix of ``pool`` (see ``prefix_first_page``); only
        while the lease holds them (not after ``insert`` closed it or ``release``)."""
        self._require_open()
        self._require_admitted()
        return self._prefix[self._owner(pool)]

    def prefix_first_page(self, pool: str) -> int:
        """The page ``prefix_units(pool)[0]`` holds (0 for all-pages pools; for a node-state pool
        the slot holds the state after page ``cached_pages - 1``)."""
        self._require_open()
        self._require_admitted()
        return self._first[self._owner(pool)]

    def allocated_first_page(self, pool: str) -> int:
        """The page the first unit of the last ``allocate`` holds: its first new page for
        all-pages pools, the first page of the trailing window for window pools; a node-state
        pool's working slot is for the state after the last page allocated (a partial page
        included: the slot runs on into it)."""
        return _allocated_first(self._allocated_first, self._owner(pool), pool)

    # --- what the controller and its parts read -------------------------------------------------

    @property
    def node(self) -> TreeNode | None:
        """The tree node ending at ``committed_pages`` (None: the root)."""
        return self._node

    @property
    def locked_node(self) -> TreeNode | None:
        """The deepest node the lease holds locked (the host prefix first): what making room
        for its prefetch must keep."""
        lock = self._host_lock or self._device_lock
        return lock.node if lock is not None else None

    @property
    def prefetch(self) -> PrefetchOp | None:
        """The lease's L3 read in flight (an opaque handle: only the prefetcher reads it)."""
        return self._prefetch

    @property
    def pending(self) -> Mapping[str, torch.Tensor]:
        """Units handed out by ``allocate`` and not yet inserted, per tree pool (fresh tensors)."""
        return {name: unit_tensor(raw) for name, raw in (self._allocated or {}).items()}

    def slot_to_fork(self, pool: str) -> tuple[bytes, torch.Tensor, bool] | None:
        """``fork_state``: a state pool's pending slot as int64 bytes, as the tensor ``allocate``
        handed out, and whether it is new (not yet filled: it is not new after this call)."""
        raw = (self._allocated or {}).get(pool)
        new = pool in self._unforked
        self._unforked.discard(pool)
        return (raw, self._slot_tensors[pool], new) if raw else None

    @property
    def pin(self) -> Pin | None:
        """The retention pin the prefix holds (see ``pinned``)."""
        return self._pin

    @property
    def pinned(self) -> bool:
        """Whether the prefix holds a pin now (``cache.unpin`` releases it, as do its TTL and a
        late pool; it may outlive the lease)."""
        return self._pin is not None and self._pin.held

    # --- transitions (the controller's calls) ---------------------------------------------------

    def hold_match(self, tree: PrefixTree, match: MatchResult) -> None:
        """``lookup``: record what ``match`` found and lock it (the device prefix, and the host
        prefix beyond it) until ``admit`` settles the lease."""
        self.device_pages, self.host_pages = match.device_pages, match.host_pages
        if match.device_pages:
            self._device_lock = tree.lock(match.device_node, _DEVICE)
        if match.host_pages > match.device_pages:
            self._host_lock = tree.lock(match.host_node, Tier.HOST)

    def attach_prefetch(self, op: PrefetchOp | None) -> None:
        """``lookup``: hold the L3 read the prefetcher started (None: none started)."""
        self._prefetch = op

    def detach_prefetch(self) -> PrefetchOp | None:
        """``admit`` / ``release``: hand the L3 read back to be committed or dropped."""
        op, self._prefetch = self._prefetch, None
        return op

    def prefetched(self, pages: int) -> None:
        """``admit``: the L3 read committed ``pages`` pages after the host prefix."""
        self._storage_pages = pages

    def settle(self, tree: PrefixTree, layout: StackLayout, match: MatchResult) -> None:
        """``admit``: drop lookup's locks and fix the prefix at the device-usable length of
        ``match``: lock it, set the prefix units every pool hands the engine, and split the hit
        by tier."""
        self.unlock(tree)
        cached = match.device_pages
        if cached:
            self._device_lock = tree.lock(match.device_node, _DEVICE)
        self.cached_pages = self.committed_pages = self.allocated_pages = cached
        self._node = match.device_node if cached else None
        self._prefix, self._first = prefix_units(tree, layout, match)
        device = min(self.device_pages, cached)
        storage = max(0, min(cached, self.host_pages + self._storage_pages) - max(self.host_pages, device))
        self.hit_pages = {"device": device, "host": cached - device - storage, "storage": storage}
        self.admitted = True

    def add_allocation(
        self, layout: StackLayout, got: tuple[dict[str, torch.Tensor], dict[str, bytes]], end: int
    ) -> dict[str, np.ndarray]:
        """``allocate``: record ``got`` (per tree pool the tensors handed out and their int64
        bytes, :func:`allocate_units`) as the units of pages ``[allocated_pages, end)`` (window
        pools: of its last ones); returns pending window units no longer contiguous with the new
        ones that no new page attends over (the caller frees them; the window's stay to close)."""
        handed, got_raw = got
        pending = dict(self._allocated or {})
        dropped: dict[str, bytes] = {}
        for tp in layout.tree_pools.values():
            old, new = pending.get(tp.name, b""), got_raw[tp.name]
            if tp.kind is _PAGES:
                pending[tp.name] = old + new if old else new
                first = self.allocated_pages
            elif tp.kind is _WINDOW:
                # pending units: contiguous pages ending at ``end`` (a window-only allocation drops old)
                contiguous = old and len(new) == (end - self.allocated_pages) * UNIT
                pending[tp.name] = old + new if contiguous else new
                if old and not contiguous:
                    dropped[tp.name], self._duplicates = _leave(old, tp, self._duplicates)
                first = end - len(new) // UNIT
            else:
                if new:
                    pending[tp.name], self._slot_tensors[tp.name] = new, handed[tp.name]
                    self._unforked.add(tp.name)
                first = end - 1
                if pending.get(tp.name):  # the working slot now runs to the new end (see take_for_insert)
                    self._allocated_first[tp.name] = first
                continue
            if new:  # a pool that got nothing keeps saying where its last units start
                self._allocated_first[tp.name] = first
        self._allocated = pending
        self.allocated_pages = end
        return unit_arrays(dropped) if dropped else {}

    def mark_inserted(
        self, tree: PrefixTree, node: TreeNode, end: int, rest: dict[str, bytes], kept: dict | None = None
    ) -> None:
        """``insert``: pages through ``end`` are in the tree, ending at ``node``: move the device lock
        there, keep ``rest`` (:func:`take_for_insert`) for the next chunk and ``kept`` to close."""
        lock = self._device_lock  # (the units first: the tree holds them, whatever the lock does)
        self._node, self.committed_pages, self._allocated = node, end, rest
        if kept:
            self._duplicates = [*(self._duplicates or ()), kept]
        self._device_lock = tree.lock(node, _DEVICE) if lock is None else tree.move_lock(lock, node)

    def take_pending(self) -> list[Mapping[str, np.ndarray | torch.Tensor]]:
        """``insert`` (closing) / ``release``: the units it holds outside the tree (allocated and
        never inserted, duplicates kept), for the caller to free."""
        pending, held, self._allocated, self._duplicates = self._allocated, self._duplicates, None, None
        return [*(held or ()), *(() if pending is None else (unit_arrays(pending),))]

    def hold_pin(self, pin: Pin | None) -> None:
        """A retention pin the prefix holds now (None: none, or it was refused)."""
        self._pin = pin

    def take_pin(self) -> Pin | None:
        """``unpin``: the pin to release (None: none held)."""
        pin, self._pin = self._pin, None
        return pin

    def unlock(self, tree: PrefixTree) -> None:
        """Release the prefix locks, host first (a pin is no such lock: it outlives the lease)."""
        for handle in (self._host_lock, self._device_lock):
            if handle is not None:
                tree.unlock(handle)
        self._host_lock = self._device_lock = None

    def mark_closed(self, tree: PrefixTree) -> None:
        """``insert`` (closing) / ``release``: unlock; the lease holds nothing any more."""
        self.unlock(tree)
        self.closed = True

    # --- checks ---------------------------------------------------------------------------------

    def _owner(self, pool: str) -> str:
        try:
            return self._owner_of[pool]
        except KeyError:
            raise KeyError(f"no pool {pool!r}; pools: {sorted(self._owner_of)}") from None

    def _require_open(self) -> None:
        if self.closed:
            raise RuntimeError("lease is closed (inserted or released): its units are no longer held")

    def _require_admitted(self) -> None:
        if not self.admitted:
            raise RuntimeError("call cache.admit(lease) before reading its prefix")


def found_pages(lease: Lease) -> int:
    """Pages of ``lease`` some tier held before it ran: the device prefix it reuses and the host
    and L3 pages its lookup and prefetch found, used or not (a host-only prompt it did not load
    back and computed again is other requests' prefix all the same, not pages it added)."""
    return max(lease.cached_pages, lease.host_pages + lease._storage_pages)


def require_lease(lease: Lease, cache: object) -> None:
    """Refuse anything but a lease ``cache`` issued: another cache's units are not this one's
    (indexing them would hand them out twice and serve the other model's bytes)."""
    if type(lease) is Lease and lease._issuer is cache:  # every call of every chunk: one test
        return
    if not isinstance(lease, Lease):
        raise TypeError(f"expected a Lease from this cache's lookup, got {type(lease).__name__}")
    if lease._issuer is not cache:
        raise ValueError(
            "this lease was issued by another cache (namespace root "
            f"{lease.namespace_root[:12]}...): a lease is valid only on the cache whose lookup made it"
        )


def prefix_units(
    tree: PrefixTree, layout: StackLayout, match: MatchResult
) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """Per tree pool, the device units of ``match``'s device prefix and the page the first holds:
    every page for all-pages pools, the last window for window pools, one slot for state pools."""
    units: dict[str, torch.Tensor] = {}
    first: dict[str, int] = {}
    cached = match.device_pages
    for tp in layout.tree_pools.values():
        if cached == 0:
            units[tp.name], first[tp.name] = NO_UNITS, 0
        elif tp.kind is _STATE:
            units[tp.name], first[tp.name] = match.device_state[tp.name], cached - 1
        elif tp.kind is _WINDOW:  # the lease's lock holds the last window only (not a node's head)
            nodes = list(reversed(tree.window_nodes(match.device_node, tp.name)))
            cut = max(0, cached - tp.window - nodes[0].depth_start)
            units[tp.name], first[tp.name] = tree.values(nodes, tp.name)[cut:], nodes[0].depth_start + cut
        else:
            units[tp.name], first[tp.name] = tree.values(match.device_path, tp.name), 0
    return units, first


def _allocated_first(first: Mapping[str, int], owner: str, pool: str) -> int:
    """``Lease.allocated_first_page``: a clear error before any ``allocate`` handed ``pool`` units."""
    if owner not in first:
        raise RuntimeError(
            f"no allocate has handed pool {pool!r} units yet: call cache.allocate(lease) first"
        )
    return first[owner]


def _leave(old: bytes, pool: TreePool, kept: list | None) -> tuple[bytes, list | None]:
    """A window pool's pending units (contiguous pages ending where a new allocation starts)
    that allocation left behind: those of pages before the pool's last window, to free now (no
    new page attends over them), and ``kept`` (a lease's units freed at close) with the last
    window's added (the new pages attend over them)."""
    cut = max(0, len(old) - pool.window * UNIT)
    if cut < len(old):
        kept = [*(kept or ()), {pool.name: np.frombuffer(old[cut:], dtype=np.int64)}]
    return old[:cut], kept


def unit_arrays(raw: Mapping[str, bytes]) -> dict[str, np.ndarray]:
    """Per pool, int64 bytes as (read-only) arrays, pools with none left out: what the
    allocators' ``free`` takes."""
    return {name: np.frombuffer(units, dtype=np.int64) for name, units in raw.items() if units}
