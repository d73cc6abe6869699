"""Admission filters are strategy objects chosen from ``policy.admission.<tier>`` by ``type``."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
import torch

from controller_support import fill, open_cache, serve, tokens, verify
from kvstrata.core.admission import ADMISSION_FILTERS, FrequencyFilter, ReuseFilter, make_admission
from kvstrata.core.policy_config import AdmissionConfig, AdmissionTiers


def _config_models() -> list[type]:
    union = typing.get_args(AdmissionConfig)[0]  # Annotated[union, discriminator]
    return list(typing.get_args(union))


def test_every_config_type_has_its_filter() -> None:
    models = _config_models()
    types = [typing.get_args(model.model_fields["type"].annotation)[0] for model in models]
    assert sorted(types) == sorted(ADMISSION_FILTERS)
    for name, cls in ADMISSION_FILTERS.items():
        assert cls.name == name and cls.Config in models
        assert cls.Config.model_fields["type"].default == name
    with pytest.raises(TypeError):
        ADMISSION_FILTERS["never"] = ReuseFilter  # type: ignore[index]


def test_a_tier_gets_the_filter_and_options_its_config_names() -> None:
    tiers = AdmissionTiers.model_validate(
        {
            "host": {"type": "reuse", "min_hits": 3},
            "storage": {"type": "tinylfu", "min_count": 4, "width": 128},
        }
    )
    host, storage = make_admission(tiers.host), make_admission(tiers.storage)
    assert isinstance(host, ReuseFilter) and host.min_hits == 3 and host.selective
    assert isinstance(storage, FrequencyFilter) and (storage.min_count, storage.width) == (4, 128)
    default = make_admission(AdmissionTiers().host)
    assert type(default) is ADMISSION_FILTERS["always"] and not default.selective
    assert make_admission(tiers.host) is not host  # one filter per tier: filters keep state


# --- a filter hears inserts under every write policy ---------------------------------------


def _evict_to_host(cache, first_seed: int) -> None:
    """Fill the 16-page device tier with other requests so the first one leaves it."""
    for i in range(5):
        _, bad = serve(cache, tokens(first_seed + i, 4))
        assert bad == 0


def _storage_hits_after_restart(tmp_path: Path, sets: list[str], request: torch.Tensor) -> int:
    """Pages of ``request`` a fresh cache on the same L3 restores from storage (bit-exact)."""
    cache = open_cache("kv", tmp_path, sets)
    try:
        lease = cache.lookup(request, prefetch="wait")
        cache.admit(lease)
        assert verify(cache, lease) == 0
        cache.release(lease)
        return lease.hit_pages["storage"]
    finally:
        cache.close()


@pytest.mark.parametrize("write", ["write_through", "write_back"])
def test_tinylfu_min_count_1_storage_counts_the_insert_under_every_write_policy(
    tmp_path: Path, write: str
) -> None:
    """docs/eviction.md: tinylfu takes a prefix once the sketch has seen it min_count times,
    counting reuses and inserts. With min_count=1, a prefix inserted once must be written to L3
    whatever the write policy."""
    sets = [
        f"policy.write={write}",
        "policy.admission.storage.type=tinylfu",
        "policy.admission.storage.min_count=1",
        "policy.prefetch.policy=wait_complete",
    ]
    request = tokens(1, 4)
    cache = open_cache("kv", tmp_path, sets)
    _, bad = serve(cache, request)
    assert bad == 0
    _evict_to_host(cache, 100)  # write-back backs it up (and offers it to L3) as it leaves
    snap = cache.metrics.snapshot()["operations"]
    cache.close()
    assert _storage_hits_after_restart(tmp_path, sets, request) == 4, (
        f"{write}: a prefix inserted once was refused by tinylfu min_count=1 "
        f"(storage_admitted {snap['storage_admitted']}, storage_rejected {snap['storage_rejected']})"
    )


@pytest.mark.parametrize("write", ["write_through", "write_through_selective"])
def test_tinylfu_min_count_2_storage_takes_a_prefix_inserted_then_reused(tmp_path: Path, write: str) -> None:
    """Inserted once and reused once is two sightings (docs/eviction.md: the sketch hears a
    request's matched path or its insert): with min_count=2 the prefix must reach L3 under
    either write-through policy (selective with threshold 1: the reuse makes it hot)."""
    sets = [
        f"policy.write={write}",
        "policy.write_through_threshold=1",
        "policy.admission.storage.type=tinylfu",
        "policy.admission.storage.min_count=2",
        "policy.prefetch.policy=wait_complete",
    ]
    request = tokens(1, 4)
    cache = open_cache("kv", tmp_path, sets)
    for _ in range(2):  # the insert, then a reuse of the whole prefix
        _, bad = serve(cache, request)
        assert bad == 0
    cache.flush()
    snap = cache.metrics.snapshot()["operations"]
    cache.close()
    assert _storage_hits_after_restart(tmp_path, sets, request) == 4, (
        f"{write}: inserted + reused prefix not in L3 "
        f"(storage_admitted {snap['storage_admitted']}, storage_rejected {snap['storage_rejected']})"
    )


@pytest.mark.parametrize("host", [False, True])
def test_tinylfu_does_not_count_a_requests_own_later_chunk_as_a_reuse(tmp_path: Path, host: bool) -> None:
    """A chunked prefill looks its later chunks up with ``record=False``: their "hits" are the
    request's own earlier chunks. The sketch counted them as sightings, so with min_count=2 a
    prefix used by one request only reached L3 (its first chunk, re-offered at the second
    chunk's lookup) or, for the host filter, the host tier."""
    tier = "host" if host else "storage"
    sets = [f"policy.admission.{tier}={{type: tinylfu, min_count: 2}}"]
    request = tokens(7, 4)
    with open_cache("kv", tmp_path, sets) as cache:
        for pages, record in ((2, True), (4, False)):
            lease = cache.lookup(request[: pages * cache.page_size], record=record)
            cache.admit(lease)
            fill(cache, lease, cache.allocate(lease))
            cache.insert(lease)
        cache.flush()
        operations = cache.metrics.snapshot()["operations"]
        assert operations[f"{tier}_admitted"] == 0 and operations[f"{tier}_rejected"] > 0
