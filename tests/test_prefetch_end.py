"""The prefetch end policies (``policy.prefetch.policy``) are strategy objects chosen by name."""

from __future__ import annotations

import typing

import pytest

from kvstrata.core.config import PrefetchPolicyConfig
from kvstrata.core.prefetch_end import PREFETCH_ENDS, BestEffort, Timeout, WaitComplete, prefetch_end


def test_every_name_the_config_accepts_has_a_policy() -> None:
    names = typing.get_args(PrefetchPolicyConfig.model_fields["policy"].annotation)
    assert sorted(names) == sorted(PREFETCH_ENDS)
    for name in names:
        end = prefetch_end(PrefetchPolicyConfig(policy=name))
        assert end.name == name and end.config.policy == name


def test_how_long_each_policy_waits_and_whether_it_makes_room() -> None:
    config = PrefetchPolicyConfig(timeout_base_s=1.0, timeout_per_ki_token_s=0.5, timeout_max_s=3.0)
    assert BestEffort(config).wait_s(4096) == 0.0 and not BestEffort.makes_room
    # the whole read, but no longer than the cap: a stuck backend must not hold admit forever
    assert WaitComplete(config).wait_s(1 << 20) == 3.0 and WaitComplete.makes_room
    assert WaitComplete(config.model_copy(update={"timeout_max_s": None})).wait_s(1 << 20) is None
    timeout = Timeout(config)
    assert timeout.makes_room
    assert timeout.wait_s(0) == 1.0
    assert timeout.wait_s(2048) == 2.0  # base + 0.5 s per Ki tokens
    assert timeout.wait_s(1 << 20) == 3.0  # capped
    uncapped = Timeout(config.model_copy(update={"timeout_max_s": None}))
    assert uncapped.wait_s(1 << 20) == pytest.approx(1.0 + 512.0)


def test_the_table_is_read_only() -> None:
    with pytest.raises(TypeError):
        PREFETCH_ENDS["never"] = BestEffort  # type: ignore[index]
