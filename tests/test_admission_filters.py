"""Admission filters are strategy objects chosen from ``policy.admission.<tier>`` by ``type``."""

from __future__ import annotations

import typing

import pytest

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
