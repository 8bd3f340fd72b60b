"""Party contributions and party values (docs/explain.md), in process: the Shapley arithmetic against its definition,
explanations of every method that predicts from a subset of parties (the efficiency identity on every row, a party
the row lacks contributing exactly 0, the shared coalition path of the split-network methods equal to one masked
prediction per coalition), the methods that cannot refuse by name, a party's policy refusing explanations, the
charge to a party's lookup budget, and the known answers of the party value: a party of pure noise is worth 0 within
one standard error, a party holding a copy of the label-determining features is worth the most.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import tiny_test, tiny_train
from partialvfl import Task, VerticalDataset
from partialvfl.federation.runtime.coordinator import ExplanationRefused, LocalFederation
from partialvfl.federation.runtime.party import PartyRuntime
from partialvfl.federation.trust.lookups import LookupLedger
from partialvfl.federation.trust.policy import PartyPolicy
from partialvfl.federation.wire.messages import Request
from partialvfl.federation.wire.refusals import PolicyViolation
from partialvfl.methods import get_method
from partialvfl.methods.coalitions import SubsetPredictionRefused, masked_predictions
from partialvfl.methods.explain import PROBABILITY_FLOOR, log_odds
from partialvfl.methods.party_value import value_attached
from partialvfl.methods.shapley import exact_shapley, permutation_sample

#: the methods that explain, each with a short fit of the tiny data
EXPLAINING = {
    "laser-vfl": {"epochs": 2},
    "laser-vfl per-party heads": {"epochs": 2, "heads": "per-party"},
    "plug-vfl": {"epochs": 2},
    "false-vfl-1": {"pretrain_epochs": 1, "epochs": 1},
    "false-vfl-2": {"pretrain_epochs": 1, "epochs": 1},
    "local": {"epochs": 2},
    "ensemble": {"epochs": 2},
    "combinatorial": {"epochs": 2},
    "x-vfl": {"epochs": 2},
}


# ---------------------------------------------------------------------- the arithmetic
def brute_force_shapley(values: np.ndarray, k: int) -> np.ndarray:
    """The definition: each player's marginal contribution averaged over all K! orders."""
    out = np.zeros(k)
    for order in itertools.permutations(range(k)):
        coalition = 0
        for player in order:
            out[player] += values[coalition | (1 << player)] - values[coalition]
            coalition |= 1 << player
    return out / math.factorial(k)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5).flatmap(lambda k: st.tuples(st.just(k), st.lists(
    st.floats(-10, 10, allow_nan=False), min_size=2 ** k, max_size=2 ** k))))
def test_exact_shapley_is_the_average_marginal_contribution_and_adds_up(game: tuple[int, list[float]]) -> None:
    k, values = game
    v = np.array(values)
    phi = exact_shapley(v[:, None])[0]
    assert np.allclose(phi, brute_force_shapley(v, k), atol=1e-9)
    assert abs(phi.sum() - (v[-1] - v[0])) <= 1e-9  # efficiency


def test_a_null_player_gets_zero_and_symmetric_players_the_same() -> None:
    rng = np.random.default_rng(0)
    base = rng.normal(size=8)  # a game of players 0, 1, 2 (bits 0-2); player 3 (bit 3) changes nothing
    v = np.concatenate([base, base])
    phi = exact_shapley(v[:, None])[0]
    assert phi[3] == 0.0
    symmetric = np.array([0.0, 1.0, 1.0, 3.0])  # players 0 and 1 interchangeable
    assert exact_shapley(symmetric[:, None])[0].tolist() == [1.5, 1.5]


def test_the_permutation_estimate_adds_up_and_its_standard_error_covers_the_exact_value() -> None:
    rng = np.random.default_rng(1)
    k = 6
    values = rng.normal(size=(2 ** k, 40))
    exact = exact_shapley(values)
    sample = permutation_sample(k, 200, np.random.default_rng(2))
    estimate, error = sample.shapley(values[sample.coalitions])
    assert np.abs(estimate.sum(axis=1) - (values[-1] - values[0])).max() <= 1e-9  # every permutation adds up
    z = np.abs(estimate - exact) / error
    assert (z <= 1).mean() > 0.55 and (z <= 3).mean() > 0.97, (z <= 1).mean()  # ~68 % and ~99.7 % coverage
    with pytest.raises(ValueError, match="at least 2 permutations"):
        permutation_sample(k, 1, rng)


def test_log_odds_are_clipped_so_that_a_sure_prediction_has_a_finite_value() -> None:
    assert np.isfinite(log_odds(np.array([0.0, 1.0]))).all()
    assert log_odds(np.array([1.0]))[0] == pytest.approx(math.log((1 - PROBABILITY_FLOOR) / PROBABILITY_FLOOR))


# ---------------------------------------------------------------------- explanations of fitted methods
@pytest.fixture(scope="module")
def fitted() -> dict[str, object]:
    train = tiny_train()
    return {label: get_method(label.split()[0])("fast", seed=0, **kw).fit(train) for label, kw in EXPLAINING.items()}


@pytest.mark.parametrize("label", list(EXPLAINING))
def test_every_row_adds_up_and_a_party_the_row_lacks_contributes_nothing(label: str, fitted: dict) -> None:
    model = fitted[label]
    test = tiny_test()
    e = model.explain(test)
    assert e.estimate == "exact" and e.coalitions == 8
    assert e.efficiency_gap() <= 1e-5  # base + sum of contributions = prediction, on both scales
    lacking = ~test.observed
    assert (e.contributions[lacking] == 0).all() and (e.log_odds_contributions[lacking] == 0).all()
    assert (e.contributions[~e.parties] == 0).all()  # nor one the method does not use for the row (local)
    proba = model.predict_proba(test)
    picked = proba[np.arange(len(proba)), proba.argmax(axis=1)]
    assert np.abs(e.value - picked).max() <= 1e-6  # the explained prediction is the prediction
    assert np.allclose(e.base, model.label_prior_[proba.argmax(axis=1)])  # the empty coalition: the label prior
    assert list(e.predicted) == list(model.predict(test))
    nobody = ~test.observed.any(axis=1)
    assert nobody.any() and (e.value[nobody] == e.base[nobody]).all()
    frame = e.to_frame("customer")
    assert list(frame.columns[:4]) == ["customer", "prediction", "explained", "probability"]
    assert {f"probability_{p}" for p in test.party_names} <= set(frame.columns)


@pytest.mark.parametrize("label", ["laser-vfl", "laser-vfl per-party heads", "plug-vfl"])
def test_the_shared_coalition_path_equals_one_masked_prediction_per_coalition(label: str, fitted: dict,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The split-network methods share each party's representation across the coalitions (one query per row);
    the default predicts every coalition alone.  Float rounding of the products of another batch aside, equal."""
    model = fitted[label]
    shared = model.explain(tiny_test())
    monkeypatch.setattr(type(model), "_coalition_predictions",
                        lambda self, view, handle, masks, wanted: masked_predictions(self, view, handle, masks, wanted))
    alone = model.explain(tiny_test())
    assert np.abs(shared.contributions - alone.contributions).max() <= 1e-6
    assert np.abs(shared.log_odds_contributions - alone.log_odds_contributions).max() <= 1e-4


def test_a_chosen_class_and_a_permutation_estimate(fitted: dict) -> None:
    model, test = fitted["false-vfl-1"], tiny_test()
    exact = model.explain(test, explained_class="b")
    assert set(exact.explained) == {"b"} and exact.efficiency_gap() <= 1e-5
    proba = model.predict_proba(test)
    assert np.abs(exact.value - proba[:, 1]).max() <= 1e-12  # FALSE-VFL computes each row alone: bit for bit
    sampled = model.explain(test, explained_class="b", permutations=300, seed=3)
    assert sampled.estimate == "permutation" and sampled.permutations == 300
    assert sampled.efficiency_gap() <= 1e-5
    z = np.abs(sampled.contributions - exact.contributions)[test.observed] / np.maximum(
        sampled.standard_errors[test.observed], 1e-12)
    assert (z <= 4).all(), z.max()
    forced = model.explain(test, max_exact_parties=2)  # above the limit: sampled (64 orders), never truncated
    assert forced.estimate == "permutation" and forced.permutations == 64
    with pytest.raises(ValueError, match=r"class 'z' is not one of the model's classes \['a', 'b', 'c'\]"):
        model.explain(test, explained_class="z")


@pytest.mark.parametrize("name", ["vanilla-vfl", "fedhssl"])
def test_methods_that_cannot_predict_from_a_subset_refuse_by_name(name: str) -> None:
    model = get_method(name)("fast", seed=0, epochs=1, **({"pretrain_epochs": 1} if name == "fedhssl" else {}))
    model.fit(tiny_train())
    with pytest.raises(SubsetPredictionRefused, match=rf"^{name} cannot explain its predictions: .*only on rows "
                                                       r"every party holds.*these methods make them: .*laser-vfl"):
        model.explain(tiny_test())


# ---------------------------------------------------------------------- the party's say
def test_a_partys_policy_refuses_explanations_before_anything_is_predicted() -> None:
    train = tiny_train()
    refusing = dataclasses.replace(PartyPolicy.research(), allow_explanations=False)
    fed = LocalFederation.for_dataset(train, policies={"shop": refusing})
    model = get_method("laser-vfl")("fast", seed=0, epochs=1).fit(train, federation=fed)
    model.predict_proba(tiny_test())  # predictions are not explanations
    before = fed.log.total_bytes()
    with pytest.raises(ExplanationRefused) as e:
        model.explain(tiny_test())
    assert str(e.value).startswith("1 of 3 parties refused the explanation; nothing was predicted:\n  party 1 "
                                   "('shop'): policy rule 'allow_explanations': party 1 ('shop') does not take part")
    assert "allow_explanations = true" in str(e.value)
    assert fed.log.total_bytes() == before  # the refusal came before any coalition was asked for


def test_the_extra_predictions_are_charged_to_the_partys_lookup_budget(tmp_path: Path) -> None:
    """A party server charges an explanation's extra predictions to the coordinator's lookup ledger (the same
    budget as its ID lookups) and refuses past it; the runtime asks its hook before answering."""
    ledger = LookupLedger({"max_lookups_per_day": 100}, tmp_path / "ledger.json", where="party 1 ('shop')")
    runtime = PartyRuntime(1, "shop")
    runtime.attach("h", tiny_test().party(1))
    def charge(n: int, check_only: bool) -> None:
        ledger.check("c" * 64, n)
        if not check_only:
            ledger.record("c" * 64, n)

    runtime.charge_explanation = charge
    assert runtime.handle(Request("explain", {}, {"data": "h", "rows": 10, "predictions": 60, "check": True})
                          ).meta["charged"] == 0 and ledger.counts("c" * 64)["max_lookups_per_day"] == 0
    reply = runtime.handle(Request("explain", {}, {"data": "h", "rows": 10, "predictions": 60}))
    assert reply.meta["charged"] == 60 and ledger.counts("c" * 64)["max_lookups_per_day"] == 60
    with pytest.raises(PolicyViolation, match="max_lookups_per_day"):
        runtime.handle(Request("explain", {}, {"data": "h", "rows": 10, "predictions": 41}))
    assert ledger.counts("c" * 64)["max_lookups_per_day"] == 60  # refused: nothing charged


def test_an_explanation_tells_each_party_its_extra_predictions(fitted: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """Exact: a row held by parties U costs each of them 2^(|U|-1) - 1 predictions beyond the row's own."""
    model = fitted["laser-vfl"]
    test = tiny_test()
    asked: list[dict] = []
    monkeypatch.setattr(model.federation_, "request_explanation", lambda handle, charges: asked.append(charges))
    model.explain(test)
    held = test.observed
    extra = np.where(held.any(axis=1), 2 ** np.maximum(held.sum(axis=1) - 1, 0) - 1, 0)
    want = {k: (int((held[:, k] & (extra > 0)).sum()), int(extra[held[:, k]].sum())) for k in range(3)}
    assert asked == [{k: v for k, v in want.items() if v[1]}]


# ---------------------------------------------------------------------- what a party is worth
def sanity_data(n: int, seed: int) -> VerticalDataset:
    """The bank (label holder) holds a noisy view of two label-determining features, ``copy`` holds a copy of all
    four, ``noise`` pure noise."""
    rng = np.random.default_rng(seed)
    z = rng.normal(size=(n, 4))
    y = (z @ np.array([1.0, -1.0, 0.5, 0.8]) > 0).astype(int)
    blocks = [z[:, :2] + rng.normal(scale=1.5, size=(n, 2)), z.copy(), rng.normal(size=(n, 4))]
    return VerticalDataset(blocks, np.ones((n, 3), bool), ids=[f"s{seed}-{i}" for i in range(n)], y=y,
                           labeled=np.ones(n, bool), task=Task.classification([0, 1]), active_party=0,
                           party_names=["bank", "copy", "noise"])


def test_a_noise_party_is_worth_nothing_and_a_copy_of_the_label_determining_features_the_most() -> None:
    model = get_method("laser-vfl")("fast", seed=0, epochs=10).fit(sanity_data(600, 0))
    test = sanity_data(600, 1)
    with model.attached(test) as (data, handle):
        for score in ("accuracy", "auc"):
            v = value_attached(model, data.coordinator_view(), handle, score=score, bootstrap=100)
            bank, copy, noise = v.values
            assert copy == v.values.max() and copy > bank + 3 * v.standard_errors[1], (score, v.values)
            assert abs(noise) <= v.standard_errors[2], (score, v.values, v.standard_errors)
            assert abs(v.values.sum() - (v.full - v.empty) * (1 if score != "log_loss" else -1)) <= 1e-9
        sampled = value_attached(model, data.coordinator_view(), handle, permutations=40)
        exact = value_attached(model, data.coordinator_view(), handle)
    assert sampled.estimate == "permutation" and exact.estimate == "exact"
    assert np.abs(sampled.values - exact.values).max() <= 3 * sampled.standard_errors.max()
