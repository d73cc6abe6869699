"""The eviction-policy plugin contract: which cached prefix leaves a tier first.

A policy never decides *whether* a node may leave a tier: the tree's rules do (closed device
prefixes, locks and pins, a node with children in the tier stays, write-back keeps an only copy).
It decides *which of the nodes that may leave goes first*: the core collects them and asks
:meth:`EvictionPolicy.ranked` for one ``(rank, id, entry)`` per node, lowest first. So a policy
cannot break an invariant, and one implementation serves every tier of the controller and
``kvstrata simulate`` (which drives the same tree with trace blocks as pages).

An *entry* is a node of the prefix tree: an edge of whole pages of one prefix, read through
:class:`CacheEntry`. Only leaves of a tier are ever ranked (a node with children in the tier
stays), so every policy evicts tails before heads; a ``chain_aware`` policy also lets the tree
trim a leaf, evicting exactly the tail pages it needs and keeping the head.

Policies that keep their own state (queues, clocks, ghosts) declare ``events`` and hear about the
tier: ``inserted`` (nodes new to it: an insert's, or a load-back's or backup's from the other
tier), ``accessed`` (one event per request per prefix: the matched path,
never one per page or per decoded token), ``split`` (a node was cut in two) and ``removed`` (nodes
that left the tier, after each eviction). Events are plain method calls on the owner thread,
per request or per eviction, never per page; a policy without ``events`` is never called for them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict

from kvstrata.plugins.user_config import UserConfig

#: Plugin API generation this core implements.
EVICTION_API_VERSION = 1

#: ``FutureAccesses.next_use`` of a key that is never used again.
NEVER = 1 << 62


class PolicyCapabilities(BaseModel):
    """What a policy needs from the core; read by the core and shown by ``kvstrata plugins``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    api: int = EVICTION_API_VERSION
    events: bool = False  # hears inserted / accessed / split / removed (queues, own clocks, ghosts)
    needs_frequency: bool = False  # ranks by how often a prefix was reused (hit counts)
    chain_aware: bool = False  # the tree may trim a leaf: evict exactly the tail pages needed
    needs_future: bool = False  # the offline optimum: needs every future access (simulate only)
    cost_aware: bool = False  # weighs recompute saved against bytes held (reads PolicyContext costs)
    #: ranks exactly as the tree's recency stamps do, ``(last_access, id)``: the core keeps its own
    #: LRU heaps (O(log n) per eviction) and never calls ``ranked`` (ranking the tier is O(tier))
    recency_order: bool = False


class EvictionPolicyConfig(UserConfig):
    """Base of every policy's ``Config``; a plugin narrows ``type`` to ``Literal[name]``."""

    model_config = ConfigDict(extra="forbid")

    type: str


class CacheEntry(Protocol):
    """What a policy may read of a node: its pages, place in the tree and the tree's stamps.

    ``last_access`` is the tree's recency clock (stamped per request on the matched path and on
    insert, deepest node first, so a parent is never older than its children); ``hit_count``
    counts the requests whose prefix ran through the node. ``keys[0]`` identifies the node's first
    page (a page key), ``depth_end`` is the page count of the prefix ending at the node.
    """

    id: int
    keys: list[Hashable]
    depth_end: int
    last_access: int
    hit_count: int
    parent: CacheEntry | None
    children: Mapping[Hashable, CacheEntry]

    @property
    def pages(self) -> int: ...


E = TypeVar("E", bound=CacheEntry)


@dataclass(frozen=True)
class PolicyContext:
    """Where a policy instance works: its tier and what the tier's pages cost.

    ``capacity_pages``: pages the tier holds (the anchor's units). ``page_bytes``: bytes one page
    holds in this tier over every token-page pool; ``state_bytes``: bytes of the node-state slots
    (Mamba-style) a node holds at its end, 0 for stacks without state pools.
    """

    tier: str
    capacity_pages: int
    page_size: int
    page_bytes: int = 0
    state_bytes: int = 0


class FutureAccesses(Protocol):
    """The future, for offline policies: ``now`` is the request being served; ``next_use(key)``
    the first later request whose prefix holds page ``key`` (``NEVER`` if none)."""

    @property
    def now(self) -> int: ...

    def next_use(self, key: Hashable) -> int: ...


class EvictionPolicy(ABC):
    """Base class of eviction-policy plugins. Subclasses set ``name``, ``Config``, ``capabilities``."""

    name: ClassVar[str]
    Config: ClassVar[type[EvictionPolicyConfig]]
    capabilities: ClassVar[PolicyCapabilities] = PolicyCapabilities()
    api_version: ClassVar[int] = EVICTION_API_VERSION
    #: ``{importable module: install command}`` the policy needs beyond kvstrata's own deps.
    requires: ClassVar[dict[str, str]] = {}

    def __init__(self, config: EvictionPolicyConfig, context: PolicyContext) -> None:
        self.config = config
        self.context = context

    @abstractmethod
    def ranked(self, entries: list[E]) -> list[tuple[float, int, E]]:
        """One ``(rank, entry.id, entry)`` per entry; the lowest rank leaves first (the id breaks
        ties). Called with every candidate at the start of an eviction and with single entries
        that became candidates during it; ranks from one eviction must compare with each other."""

    # --- events (called only when ``capabilities.events``) ---------------------------------------

    def inserted(self, entries: Sequence[E]) -> None:  # noqa: B027 - optional event
        """Nodes entered this tier (root-most first): created by an insert, or brought from the other
        tier by a load-back or a backup (then one call per node), so ghosts see a prefix return."""

    def accessed(self, entries: Sequence[E]) -> None:  # noqa: B027 - optional event
        """One request's matched prefix, deepest node first (the order the tree stamps)."""

    def split(self, upper: E, lower: E) -> None:  # noqa: B027 - optional event
        """``upper`` is a new node holding the first pages of ``lower``: it inherits its state."""

    def removed(self, entries: Sequence[E]) -> None:  # noqa: B027 - optional event
        """Nodes that left this tier in the eviction that just ended."""

    # --- offline policies ---------------------------------------------------------------------

    def bind_future(self, future: FutureAccesses) -> None:
        """Hand a ``needs_future`` policy the future accesses (``kvstrata simulate`` does)."""
        raise TypeError(f"eviction policy {self.name!r} does not use future accesses")


__all__ = [
    "EVICTION_API_VERSION",
    "NEVER",
    "CacheEntry",
    "EvictionPolicy",
    "EvictionPolicyConfig",
    "FutureAccesses",
    "PolicyCapabilities",
    "PolicyContext",
]
