"""Admission per tier: which prefixes a tier takes at all, counted so a write budget holds.

An eviction policy decides what leaves a full tier; admission decides what enters. For the
storage tier (an SSD) that is the write budget: writing every page once is what wears it out,
while most prefixes of a chat trace are never read again. A filter sees every lookup's matched
path and insert (one call per request, never per page) and answers per node.

Each filter is a small strategy object chosen from its config by ``type`` through
:data:`ADMISSION_FILTERS`, as an eviction policy is chosen by its ``type``; its options are its
``Config`` (the models in :mod:`kvstrata.core.policy_config`, which stays torch-free).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from types import MappingProxyType
from typing import ClassVar

import xxhash

from kvstrata.core.policy_config import (
    AdmissionConfig,
    AdmissionFilterConfig,
    AlwaysAdmission,
    FrequencyAdmission,
    ReuseAdmission,
)
from kvstrata.core.tree import TreeNode

_ROWS = 4


class Admission:
    """Admits every node (``always``); subclasses narrow it. ``name`` is the config's ``type``."""

    name: ClassVar[str] = "always"
    Config: ClassVar[type[AdmissionFilterConfig]] = AlwaysAdmission
    #: whether the filter ever says no (the writer skips its bookkeeping when it does not)
    selective: ClassVar[bool] = False

    def __init__(self, config: AdmissionFilterConfig) -> None:
        self.config = config

    def admit(self, node: TreeNode) -> bool:
        return True

    def seen(self, nodes: Sequence[TreeNode]) -> None:
        """A request reused ``nodes`` (its matched path) or inserted them."""


class ReuseFilter(Admission):
    """Admits nodes whose prefix ``min_hits`` requests have reused (the tree's hit count)."""

    name = "reuse"
    Config = ReuseAdmission
    selective = True

    def __init__(self, config: ReuseAdmission) -> None:
        super().__init__(config)
        self.min_hits = config.min_hits

    def admit(self, node: TreeNode) -> bool:
        return node.hit_count >= self.min_hits


class FrequencyFilter(Admission):
    """A count-min sketch of how often each prefix (its last page key) was seen, with aging."""

    name = "tinylfu"
    Config = FrequencyAdmission
    selective = True

    def __init__(self, config: FrequencyAdmission) -> None:
        super().__init__(config)
        self.min_count = config.min_count
        self.width = config.width
        self.sample = config.sample
        self._rows = [[0] * self.width for _ in range(_ROWS)]
        self._updates = 0

    def _slots(self, key: Hashable) -> list[int]:
        data = key if isinstance(key, bytes) else repr(key).encode()
        digest = xxhash.xxh64_intdigest(data)
        return [((digest >> (16 * r)) ^ (digest >> (16 * r + 7))) % self.width for r in range(_ROWS)]

    def estimate(self, node: TreeNode) -> int:
        return min(row[i] for row, i in zip(self._rows, self._slots(node.keys[-1]), strict=True))

    def admit(self, node: TreeNode) -> bool:
        return self.estimate(node) >= self.min_count

    def seen(self, nodes: Sequence[TreeNode]) -> None:
        for node in nodes:
            for row, i in zip(self._rows, self._slots(node.keys[-1]), strict=True):
                row[i] += 1
            self._updates += 1
        if self._updates >= self.sample:
            self._updates = 0
            for row in self._rows:
                row[:] = [c >> 1 for c in row]


#: every admission filter by its config ``type`` (read-only)
ADMISSION_FILTERS: Mapping[str, type[Admission]] = MappingProxyType(
    {cls.name: cls for cls in (Admission, ReuseFilter, FrequencyFilter)}
)


def make_admission(config: AdmissionConfig) -> Admission:
    """A fresh filter for one tier (filters keep per-tier state), the one ``config.type`` names."""
    return ADMISSION_FILTERS[config.type](config)
