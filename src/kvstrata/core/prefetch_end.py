"""How a prefetch ends at admit: the end policies of ``policy.prefetch.policy`` as strategy objects.

At ``admit`` the owner thread decides how long to wait for an L3 -> L2 read still in flight, and
whether, when the worker found the host tier full, it evicts to make room and reads now. Each
policy answers both in one small object, chosen once from the config by its name (as an eviction
policy is chosen by its ``type``), so :meth:`~kvstrata.core.prefetcher.Prefetcher.finish`
compares no names. A read the caller asked to wait for (``prefetch="wait"``) always ends as
``wait_complete``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from types import MappingProxyType
from typing import ClassVar

from kvstrata.core.config import PrefetchPolicyConfig


class PrefetchEnd(ABC):
    """One end policy. ``name`` is its value of ``policy.prefetch.policy``."""

    name: ClassVar[str]
    #: when the worker left a read to the owner (host tier full) and no call since made room
    #: for it: make room and read at admit
    makes_room: ClassVar[bool] = True

    def __init__(self, config: PrefetchPolicyConfig) -> None:
        self.config = config

    @abstractmethod
    def wait_s(self, tokens: int) -> float | None:
        """How long admit waits for a read of ``tokens`` tokens: ``None`` until it is done, ``0``
        not at all (what is done by then is used; the rest is counted as ``timeout``)."""


class BestEffort(PrefetchEnd):
    """Take what is done at admit; never wait there, nor evict there for a read it would not
    wait for (a read that found the host tier full gets its room at the owner's next call before
    ``admit``: ``Prefetcher.drain``)."""

    name = "best_effort"
    makes_room = False

    def wait_s(self, tokens: int) -> float | None:
        return 0.0


class WaitComplete(PrefetchEnd):
    """Wait for the whole read (an engine that would rather wait than recompute), at most
    ``timeout_max_s``: a backend call that never returns must not hold the scheduler forever."""

    name = "wait_complete"

    def wait_s(self, tokens: int) -> float | None:
        return self.config.timeout_max_s


class Timeout(PrefetchEnd):
    """Wait a base plus a per-Ki-token time, capped at ``timeout_max_s``."""

    name = "timeout"

    def wait_s(self, tokens: int) -> float | None:
        config = self.config
        limit = config.timeout_base_s + config.timeout_per_ki_token_s * tokens / 1024
        return limit if config.timeout_max_s is None else min(limit, config.timeout_max_s)


#: every end policy by its ``policy.prefetch.policy`` name (read-only)
PREFETCH_ENDS: Mapping[str, type[PrefetchEnd]] = MappingProxyType(
    {cls.name: cls for cls in (BestEffort, WaitComplete, Timeout)}
)


def prefetch_end(config: PrefetchPolicyConfig) -> PrefetchEnd:
    """The end policy ``config.policy`` names."""
    return PREFETCH_ENDS[config.policy](config)
