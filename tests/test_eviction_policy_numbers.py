"""Built-in policies' numeric options: a value that would make a rank NaN (an infinity, or a
weight so large its products overflow) is a config error naming the option, and what the
options still allow never raises in an event or leaves the learned model NaN."""

from __future__ import annotations

import math
from typing import Any

import pytest
from pydantic import ValidationError

from kvstrata.core.policies import policy_config
from kvstrata.eviction_policies.learned import ReuseModel, features
from kvstrata.plugins import PluginHost
from kvstrata.testing.policy_kit import run_workload

HOST = PluginHost()
INF, NAN = float("inf"), float("nan")


@pytest.mark.parametrize(
    ("name", "option", "value"),
    [
        ("cost_aware", "alpha", INF),
        ("cost_aware", "attention_weight", INF),
        ("cost_aware", "attention_weight", 1e308),  # work per page overflowed: inf / inf
        ("reuse", "size_weight", INF),
        ("reuse", "size_weight", 1e308),  # the shift overflowed: inf x 0 log-odds
        ("reuse", "prior", INF),
        ("learned", "max_shift", INF),
        ("learned", "l2", INF),  # the first refit made every weight NaN
        ("learned", "horizon_lifetimes", INF),
        ("learned", "history_factor", NAN),
    ],
)
def test_an_option_making_ranks_nan_is_a_config_error_naming_it(name: str, option: str, value: float) -> None:
    with pytest.raises(ValidationError) as error:
        policy_config(HOST, {"type": name, option: value})
    assert [e["loc"] for e in error.value.errors()] == [(option,)]


def test_learned_hears_every_event_with_the_largest_horizon_and_history_it_accepts() -> None:
    # int(inf): the horizon of 1e308 lifetimes raised in every insert event (the history, at build)
    config: dict[str, Any] = {"type": "learned", "horizon_lifetimes": 1e308, "history_factor": 1e308}
    run_workload(HOST, config, [([1, i % 3, i], False, False) for i in range(30)])


def test_learned_keeps_its_last_fit_when_a_refit_is_singular_or_not_finite() -> None:
    # a tiny ridge over features with a constant column (turn 1: the intercept's twin) is singular:
    # the solve raised out of the event that learned the outcome, at every refit from then on
    model = ReuseModel(len(features(0, 0, 0)), window=64, refit_every=64, l2=1e-300)
    for i in range(256):
        model.learn(features(i % 7, 3, 1), i % 3 == 0)
    assert all(math.isfinite(w) for w in model._w)
