"""Differential privacy (issue 25): the accountant against closed forms, randomized response, a party's ledger and
its refusal once its budget is spent, the released values, the policy keys and which methods refuse DP settings.

The attacks measured against these mechanisms are in ``tests/test_privacy_attacks.py``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import norm

from partialvfl import Task, VerticalDataset
from partialvfl.federation.dp.gaussian import (
    DPBudget,
    PartyPrivacy,
    PrivacyLedger,
    budget_mu,
    clip_rows,
    gaussian_epsilon,
    private_reply,
)
from partialvfl.federation.runtime.coordinator import LocalFederation
from partialvfl.federation.runtime.party import PartyRuntime
from partialvfl.federation.trust.policy import PartyPolicy
from partialvfl.federation.wire.messages import Request
from partialvfl.federation.wire.refusals import PolicyViolation
from partialvfl.federation.wire.schema import MessageSpec, TensorSpec
from partialvfl.methods import get_method
from partialvfl.methods.label_dp import debiased_frequencies, randomize_labels, rr_keep_probability, rr_with_prior


def analytic_delta(eps: float, mu: float) -> float:
    """Balle & Wang (2018), Theorem 8: delta(eps) of the Gaussian mechanism with sensitivity / sigma = mu."""
    return float(norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2))


# ---------------------------------------------------------------------- the accountant
@pytest.mark.parametrize("mu", [0.25, 1.0, 1.666, 3.0])
def test_the_accountants_epsilon_is_the_gaussian_mechanisms_closed_form(mu: float) -> None:
    eps = gaussian_epsilon(mu, 1e-5)
    assert analytic_delta(eps, mu) == pytest.approx(1e-5, rel=1e-6)
    assert analytic_delta(eps * 0.99, mu) > 1e-5  # and it is the smallest such epsilon


@pytest.mark.parametrize(("eps", "delta"), [(1.0, 1e-5), (8.0, 1e-5), (16.0, 1e-6)])
def test_a_budget_is_the_largest_gaussian_mechanism_within_it(eps: float, delta: float) -> None:
    mu = budget_mu(eps, delta)
    assert analytic_delta(eps, mu) == pytest.approx(delta, rel=1e-3)
    assert analytic_delta(eps, mu * 1.01) > delta


def test_a_ledger_composes_gaussian_mechanisms_by_their_mu_squared() -> None:
    """k mechanisms at noise multiplier z cost one Gaussian mechanism with mu = sqrt(k) / z: the epsilon reported
    is dp-accounting's PLD accountant's for the k-fold composition."""
    import dp_accounting as dpa
    from dp_accounting.pld import pld_privacy_accountant

    ledger = PrivacyLedger(DPBudget(100.0, 1e-5))
    z, k = 3.0, 12
    for _ in range(k):
        ledger.charge(["a", "b"], 1 / z**2, "a test")
    ledger.charge(["a"], 1 / z**2, "a test")  # row a: one more
    acc = pld_privacy_accountant.PLDAccountant()
    acc.compose(dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(z), k + 1))
    assert ledger.epsilon_spent() == pytest.approx(acc.get_epsilon(1e-5), rel=2e-3)


def test_randomized_response_has_exactly_its_epsilon() -> None:
    """dp-accounting's randomized-response event with the same output distribution has the stated epsilon."""
    import dp_accounting as dpa
    from dp_accounting.pld import pld_privacy_accountant

    for eps, k in ((1.0, 2), (0.5, 10), (4.0, 3)):
        q = rr_keep_probability(eps, k)
        assert q == pytest.approx(math.exp(eps) / (math.exp(eps) + k - 1))
        p_uniform = k * (1 - q) / (k - 1)  # the event answers uniformly over all k with this probability
        acc = pld_privacy_accountant.PLDAccountant(dpa.NeighboringRelation.REPLACE_ONE)
        acc.compose(dpa.RandomizedResponseDpEvent(noise_parameter=p_uniform, num_buckets=k))
        assert acc.get_epsilon(0.0) == pytest.approx(eps, abs=1e-3)


# ---------------------------------------------------------------------- label DP
def test_randomized_labels_flip_at_the_rate_of_epsilon_and_leave_unlabeled_rows_alone() -> None:
    n, k = 20_000, 4
    y = np.arange(n) % k
    labeled = np.arange(n) % 5 != 0
    noisy = randomize_labels(y, labeled, k, 1.0, np.random.default_rng(0))
    np.testing.assert_array_equal(noisy[~labeled], y[~labeled])
    kept = (noisy == y)[labeled].mean()
    assert kept == pytest.approx(rr_keep_probability(1.0, k), abs=0.01)
    flips = noisy[labeled & (noisy != y)]
    assert set(np.unique(flips)) == set(range(k))  # every other class, uniformly
    again = randomize_labels(y, labeled, k, 1.0, np.random.default_rng(0))
    np.testing.assert_array_equal(noisy, again)
    freq = debiased_frequencies(noisy[labeled], k, 1.0)
    np.testing.assert_allclose(freq, np.full(k, 0.25), atol=0.02)


def test_rr_with_prior_is_epsilon_dp_for_every_label_and_uses_the_prior() -> None:
    """The output distribution for each true label, estimated by sampling, differs by at most e^eps."""
    eps, reps = 1.0, 40_000
    prior = np.array([[0.5, 0.4, 0.05, 0.05]])  # top-1: 0.5; top-2: 0.9 e / (e + 1) = 0.66; top-3: 0.55
    dist = []
    for true in range(4):
        out = rr_with_prior(np.full(reps, true), np.repeat(prior, reps, 0), eps, np.random.default_rng(true))
        dist.append(np.bincount(out, minlength=4) / reps)
    dist = np.array(dist)
    assert (dist[:, 2:] == 0).all()  # the top-2 set (k* = 2 for this prior at eps 1) is all it answers
    ratio = dist[:, :2].max(axis=0) / dist[:, :2].min(axis=0)
    assert (ratio <= math.exp(eps) * 1.05).all()
    assert dist[0, 0] == pytest.approx(math.exp(eps) / (math.exp(eps) + 1), abs=0.01)
    confident = rr_with_prior(np.array([0, 1, 2, 3]), np.tile([0.7, 0.2, 0.05, 0.05], (4, 1)), eps,
                              np.random.default_rng(0))
    np.testing.assert_array_equal(confident, [0, 0, 0, 0])  # top-1 is best: the prior's class, whatever the label


def test_label_dp_is_refused_for_regression_and_non_positive_epsilon() -> None:
    with pytest.raises(ValueError, match=r"laser-vfl: parameter label_dp must be number in \(0, inf\] or null, "
                                         r"got 0.0"):
        get_method("laser-vfl")("fast", label_dp=0.0)
    data = tiny(task=Task.regression())
    with pytest.raises(ValueError, match="label DP .* is for classification"):
        get_method("false-vfl-1")("fast", label_dp=1.0, pretrain_epochs=1, epochs=1).fit(data)


# ---------------------------------------------------------------------- a party's budget
def tiny(n: int = 60, task: Task | None = None, seed: int = 0) -> VerticalDataset:
    rng = np.random.default_rng(seed)
    blocks = [rng.normal(size=(n, 3)).astype(np.float32), rng.normal(size=(n, 4)).astype(np.float32)]
    task = task or Task.classification([0, 1])
    y = (blocks[0][:, 0] + blocks[1][:, 0] > 0).astype(np.int64) if task.is_classification else \
        rng.normal(size=n)
    return VerticalDataset(blocks, np.ones((n, 2), bool), ids=[f"u{i:03d}" for i in range(n)], y=y,
                           party_names=["bank", "shop"],
                           labeled=np.arange(n) % 2 == 0, task=task, active_party=0)


def test_a_ledger_refuses_once_a_row_would_exceed_the_budget_and_charges_nothing_then(tmp_path) -> None:
    budget = DPBudget(1.0, 1e-5)
    ledger = PrivacyLedger(budget, tmp_path / "ledger.npz")
    per = budget.mu ** 2 / 4
    for _ in range(4):
        ledger.charge(["a", "b"], per, "a test")
    assert ledger.epsilon_spent() == pytest.approx(1.0, rel=1e-6)
    before = ledger.max_mu2()
    with pytest.raises(PolicyViolation, match=r"policy rule 'dp_epsilon': this party: its differential-privacy budget "
                                              r"\(epsilon 1, delta 1e-05 per row\) is spent.*row 'a'") as e:
        ledger.charge(["c", "a"], per, "answering 'embed'")
    assert e.value.rule == "dp_epsilon" and ledger.max_mu2() == before
    reopened = PrivacyLedger(budget, tmp_path / "ledger.npz")  # a party restarted keeps what it spent
    assert reopened.max_mu2() == pytest.approx(before) and reopened.n_rows == 2


SPEC = MessageSpec(request=[TensorSpec("rows", "int64", ("B",))],
                   reply=[TensorSpec("a", "float32", ("B", 3)), TensorSpec("b", "float32", ("S", "B")),
                          TensorSpec("c", "float32", ("B",), optional=True)], releases=["a", "b"])


def test_a_released_row_is_clipped_jointly_and_noised_with_the_calibrated_scale() -> None:
    privacy = PartyPrivacy(DPBudget(8.0, 1e-5), "party 0 ('p')")
    privacy.configure({"charges": 10, "clip": {"a": 2.0, "b": 1.0}}, seed=0)
    z = privacy.z
    assert z == pytest.approx(math.sqrt(10) / budget_mu(8.0, 1e-5))
    n = 4000
    a = torch.zeros(n, 3)
    a[:, 0] = 100.0  # far beyond its clip
    b = torch.zeros(5, n)
    out = private_reply(privacy, SPEC, "k", {"a": a, "b": b}, {}, {"a": ([f"r{i}" for i in range(n)], 0),
                                                                    "b": ([f"r{i}" for i in range(n)], 1)})
    # row norm of a / 2 is 50 -> scaled to 1: a's first column becomes 2 before noise; noise std 2 z C per tensor
    assert out["a"][:, 0].mean().item() == pytest.approx(2.0, abs=0.6)
    assert out["a"][:, 1].std().item() == pytest.approx(2 * z * 2.0, rel=0.05)
    assert out["b"].std().item() == pytest.approx(2 * z * 1.0, rel=0.05)
    assert privacy.ledger.max_mu2() == pytest.approx(1 / z**2)  # one mechanism per row and reply
    with pytest.raises(PolicyViolation, match="'c' is not declared as released per row"):
        private_reply(privacy, SPEC, "k", {"c": torch.zeros(2)}, {}, {"c": (["x", "y"], 0)})
    with pytest.raises(PolicyViolation, match="carries metadata"):
        private_reply(privacy, SPEC, "k", {}, {"loss": 1.0}, {})
    h = torch.randn(7, 5) * 10
    assert clip_rows(h, 1.5).norm(dim=1).max().item() == pytest.approx(1.5, rel=1e-5)


def test_a_party_with_a_budget_refuses_a_setup_without_a_plan_and_a_program_without_dp() -> None:
    import partialvfl.methods.splitnn.party  # registers the programs it sets up (also when run alone)
    import partialvfl.methods.x_vfl.party  # noqa: F401

    data = tiny()
    rt = PartyRuntime(1, "shop", policy=PartyPolicy.research().with_dp(8.0, 1e-5))
    rt.attach("train", data.party(1))
    cfg = {"feature_dim": 4, "feature_shape": [4], "models": ["f"], "latent_dim": 4, "encoder": "mlp",
           "encoder_hidden": [8], "optimizer": {"name": "adam", "lr": 1e-3, "weight_decay": 0.0}}
    with pytest.raises(PolicyViolation, match="must carry a privacy plan"):
        rt.handle(Request("setup", {}, {"program": "splitnn/party", "config": cfg, "seed": 0}))
    xcfg = {"feature_dim": 4, "feature_shape": [4]}
    with pytest.raises(PolicyViolation, match="program 'x-vfl/party' cannot keep a differential-privacy budget"):
        rt.handle(Request("setup", {}, {"program": "x-vfl/party", "config": xcfg, "seed": 0,
                                        "privacy": {"charges": 3}}))
    reply = rt.handle(Request("setup", {}, {"program": "splitnn/party", "config": cfg, "seed": 0,
                                            "privacy": {"charges": 3}}))
    assert reply.meta["privacy"]["epsilon"] == 8.0 and reply.meta["privacy"]["charges"] == 3
    rows = torch.arange(0, 10)
    for _ in range(3):
        rt.handle(Request("embed", {"rows:f": rows}, {"data": "train"}))
    with pytest.raises(PolicyViolation, match="budget .* is spent: answering 'embed'"):
        rt.handle(Request("embed", {"rows:f": rows}, {"data": "train"}))
    rt.handle(Request("embed", {"rows:f": torch.arange(10, 20)}, {"data": "train"}))  # other rows: budget left
    assert rt.handle(Request("privacy")).meta["epsilon_spent"] == pytest.approx(8.0, rel=1e-6)


def test_policy_keys_come_together_and_are_described() -> None:
    with pytest.raises(ValueError, match="needs both dp_epsilon and dp_delta; dp_delta is missing"):
        PartyPolicy.from_table({"dp_epsilon": 8})
    with pytest.raises(ValueError, match="dp_delta must lie strictly between 0 and 1"):
        PartyPolicy.from_table({"dp_epsilon": 8, "dp_delta": 1.5})
    p = PartyPolicy.from_table({"dp_epsilon": 8, "dp_delta": 1e-5})
    assert p.dp_epsilon == 8.0 and "differential privacy: epsilon 8, delta 1e-05 per row" in p.describe()
    assert PartyPolicy.default().dp_epsilon is None  # no budget unless the party sets one


# ---------------------------------------------------------------------- methods
@pytest.mark.parametrize("method", ["x-vfl", "fedhssl", "false-vfl-2"])
def test_methods_without_differential_privacy_refuse_it_naming_themselves(method: str) -> None:
    data = tiny()
    with pytest.raises(ValueError, match=f"{method} does not support differential privacy \\(label DP"):
        get_method(method)("fast", label_dp=1.0).fit(data)
    with pytest.raises(ValueError, match=f"{method} does not support differential privacy \\(a differential-privacy "
                                         "budget at party 1"):
        get_method(method)("fast").fit(data, party_dp={1: (8.0, 1e-5)})


def test_settings_a_budget_cannot_cover_are_refused_before_anything_is_sent() -> None:
    data = tiny()
    with pytest.raises(ValueError, match=r"pretrain=true\) is not covered"):
        get_method("laser-vfl")("fast", pretrain=True).fit(data, party_dp={1: (8.0, 1e-5)})
    fed = LocalFederation.for_dataset(data, party_dp={1: (8.0, 1e-5)})
    with pytest.raises(Exception, match="resnet18 encoder"):
        get_method("laser-vfl")("fast", encoder="resnet18").fit(data, federation=fed)


@pytest.mark.parametrize("method", ["laser-vfl", "vanilla-vfl", "plug-vfl", "local", "ensemble", "combinatorial",
                                    "false-vfl-1"])
def test_every_supported_method_fits_within_a_partys_budget_and_reports_it(method: str) -> None:
    data = tiny(n=80)
    epochs = {"pretrain_epochs": 2, "epochs": 2} if method == "false-vfl-1" else {"epochs": 5}
    model = get_method(method)("fast", seed=0, label_dp=2.0, **epochs).fit(data, party_dp={1: (4.0, 1e-5)})
    report = model.privacy_
    assert report["labels"] == {"epsilon": 2.0, "mechanism": "randomized response", "name": "randomized-response",
                                "params": {}, "accounted_epsilon": pytest.approx(2.0, abs=1e-3)}
    party = report["parties"]["shop"]
    assert party["epsilon"] == 4.0 and party["epsilon_spent"] <= 4.0 + 1e-9
    if method != "local":  # local sends nothing from the passive party
        assert party["epsilon_spent"] > 0.5 and party["rows_charged"] > 0
    assert model.predict_proba(data).shape == (80, 2)  # a prediction within the plan's reserve


def test_predictions_beyond_the_plans_reserve_are_refused_by_the_party() -> None:
    data = tiny(n=40)
    model = get_method("vanilla-vfl")("fast", seed=0, epochs=2, dp_predictions=1).fit(
        data, party_dp={1: (2.0, 1e-5)})
    model.predict_proba(data)
    with pytest.raises(PolicyViolation, match=r"party 1 \('shop'\): its differential-privacy budget \(epsilon 2, "
                                              r"delta 1e-05 per row\) is spent"):
        model.predict_proba(data)


def test_dp_off_leaves_a_fit_unchanged_and_label_dp_is_seeded() -> None:
    data = tiny(n=80)
    a = get_method("laser-vfl")("fast", seed=0, epochs=2).fit(data).predict_proba(data)
    b = get_method("laser-vfl")("fast", seed=0, epochs=2).fit(data, party_dp={}).predict_proba(data)
    np.testing.assert_array_equal(a, b)
    c = get_method("laser-vfl")("fast", seed=0, epochs=2, label_dp=1.0).fit(data).predict_proba(data)
    d = get_method("laser-vfl")("fast", seed=0, epochs=2, label_dp=1.0).fit(data).predict_proba(data)
    np.testing.assert_array_equal(c, d)
    assert not np.array_equal(a, c)


def test_rr_with_prior_fits_in_two_stages_each_label_randomized_once() -> None:
    data = tiny(n=120)
    model = get_method("laser-vfl")("fast", seed=0, epochs=3, label_dp=1.0, label_dp_prior=True).fit(data)
    assert model.privacy_["labels"]["mechanism"] == "randomized response with a prior (two stages)"
    again = get_method("laser-vfl")("fast", seed=0, epochs=3, label_dp=1.0, label_dp_prior=True).fit(data)
    np.testing.assert_array_equal(model.predict_proba(data), again.predict_proba(data))
    assert model.label_dp_rr_rows_.sum() == data.labeled.sum() // 2 + data.labeled.sum() % 2


def test_a_saved_model_predicts_within_the_partys_budget_after_loading(tmp_path) -> None:
    from partialvfl.methods import VFLMethod

    data = tiny(n=60)
    model = get_method("laser-vfl")("fast", seed=0, epochs=2, label_dp=2.0).fit(data, party_dp={1: (4.0, 1e-5)})
    model.save(tmp_path / "m")
    fed = LocalFederation.for_dataset(data, party_dp={1: (4.0, 1e-5)})  # a fresh party: a fresh ledger
    loaded = VFLMethod.load(tmp_path / "m", federation=fed)
    assert loaded.label_dp == 2.0 and loaded.privacy_["parties"]["shop"]["epsilon"] == 4.0
    params = loaded.get_params()  # what the model was fitted with, not the defaults
    assert (params["label_dp"], params["label_dp_mechanism"]) == (2.0, "randomized-response")
    loaded.predict_proba(data)
    spent = fed.privacy_reports([1])[1]
    assert spent["charges"] == 2 and 0 < spent["epsilon_spent"] <= 4.0  # the plan of a loaded model: predictions


@pytest.mark.parametrize("arch", ["mlp", "cnn"])
def test_per_row_gradients_sum_to_the_batch_gradient(arch: str) -> None:
    """What DP-SGD clips: every row's own gradient; unclipped, they add up to the ordinary backward pass."""
    from partialvfl.nn.blocks import build_encoder
    from partialvfl.nn.per_sample import flat_per_row, per_row_gradients, row_objective

    torch.manual_seed(0)
    model = build_encoder((4, 4), 5, arch, hidden=(8,))
    x, g = torch.randn(6, 16), torch.randn(6, 5)
    named = dict(model.named_parameters())
    per_row = flat_per_row(per_row_gradients(row_objective(model, lambda y: clip_rows(y, 0.5)), named, x, g),
                           list(named))
    model.zero_grad()
    (clip_rows(model(x), 0.5) * g).sum().backward()
    batch = torch.cat([p.grad.reshape(-1) for p in named.values()])
    torch.testing.assert_close(per_row.sum(0), batch, rtol=1e-4, atol=1e-6)


def test_false_vfl_per_row_gradients_sum_to_its_ordinary_update() -> None:
    """FALSE-VFL-I's DP-SGD objective per row (encoder through mu/logvar, decoder through the log-likelihoods of the
    latents it was sent) adds up to the gradient its ordinary decode_grad + update would apply."""
    from partialvfl.methods.false_vfl.private import _row_objective
    from partialvfl.nn.per_sample import flat_per_row, per_row_gradients

    data = tiny(n=20)
    fed = LocalFederation.for_dataset(data, party_dp={1: (50.0, 1e-5)})
    h = fed.attach(data, "train")
    model = get_method("false-vfl-1")("fast", seed=0, pretrain_epochs=0, epochs=0, wire="samples", d_h=4)
    model.fit_federated(fed, data.coordinator_view(), h)
    party = fed.runtimes[1].program
    rows = torch.arange(0, 8)
    party.encode_rows(h, rows, train=True)
    lat = torch.randn(3, 8, 4)
    party.on_decode(Request("decode", {"h": lat}, {"train": True}))
    g_ll, g_mu, g_lv = torch.randn(3, 8), torch.randn(8, 4), torch.randn(8, 4)
    party.on_decode_grad(Request("decode_grad", {"grad_loglik": g_ll}))
    torch.autograd.backward([party._enc["mu"], party._enc["logvar"]], [g_mu, g_lv])
    named = {k: v for k, v in party.net.named_parameters() if not k.startswith("indicator")}
    reference = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                           for p in named.values()])
    per_row = per_row_gradients(_row_objective(party), named, party._enc["x"].float(), lat.transpose(0, 1),
                                g_ll.transpose(0, 1), g_mu, g_lv)
    torch.testing.assert_close(flat_per_row(per_row, list(named)).sum(0), reference, rtol=1e-4, atol=1e-5)
