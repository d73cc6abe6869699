"""Config models of the eviction, admission and retention policies (``policy.*``).

Kept apart from ``core/config.py`` so the root model only names them, and free of torch so
``kvstrata config validate`` stays light. ``policy.eviction`` itself is resolved through the
plugin registry in ``config.py`` (like pool and backend configs).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from kvstrata.plugins.user_config import UserConfig


class AdmissionFilterConfig(UserConfig):
    """Base of every admission filter's config; each narrows ``type`` to its filter's name."""

    type: str


class AlwaysAdmission(AdmissionFilterConfig):
    """Every page that reaches the tier is taken (the default)."""

    type: Literal["always"] = "always"


class ReuseAdmission(AdmissionFilterConfig):
    """Only prefixes reused ``min_hits`` times are taken; the others are offered again each
    time a request reuses them while they are still cached a tier above."""

    type: Literal["reuse"] = "reuse"
    min_hits: int = Field(1, ge=1, description="requests that must have reused the prefix")


class FrequencyAdmission(AdmissionFilterConfig):
    """TinyLFU-style: a prefix is taken once a small count-min sketch has seen it ``min_count``
    times (reuses and inserts, remembered after the prefix left the cache); the counts halve
    every ``sample`` updates so old popularity fades."""

    type: Literal["tinylfu"] = "tinylfu"
    min_count: int = Field(2, ge=1, description="sightings before a prefix is taken")
    width: int = Field(1 << 14, ge=64, description="counters per sketch row (4 rows)")
    sample: int = Field(1 << 16, ge=16, description="updates between halvings")


AdmissionConfig = Annotated[
    AlwaysAdmission | ReuseAdmission | FrequencyAdmission, Field(discriminator="type")
]


class AdmissionTiers(UserConfig):
    """Admission per tier: ``host`` gates device -> host backups (write-through policies),
    ``storage`` gates host -> L3 writes (the SSD write budget). Counted as ``<tier>_admitted`` /
    ``<tier>_rejected`` pages in the metrics' operations."""

    host: AdmissionConfig = AlwaysAdmission()
    storage: AdmissionConfig = AlwaysAdmission()


class RetentionConfig(UserConfig):
    """Limits on the retention hints requests may carry."""

    max_pinned_fraction: float = Field(
        0.5, ge=0.0, le=1.0, description="share of the device tier pins may hold; more is refused"
    )
