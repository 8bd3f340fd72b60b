"""FALSE-VFL I and II: formulas, the bound's theory, exact distributed gradients, stage-2 freezing, the tensors on the
wire, prediction from any subset of parties, and robustness to a party that is down.

What every method must do (no raw feature crosses, save/load, seeds, wrong parameters, gRPC equals in process,
crash + resume) is tested for FALSE-VFL too, in tests/test_contract.py and tests/test_kill_resume.py."""

from __future__ import annotations

import copy
import itertools
import math

import numpy as np
import pytest
import torch
from torch import nn

from partialvfl import Task, VerticalDataset
from partialvfl.data.protocol import ProtocolConfig, make_protocol
from partialvfl.data.sources.synthetic import make_synthetic
from partialvfl.federation import LocalFederation, MessageLog, find_raw_feature_leaks
from partialvfl.methods import evaluate, get_method
from partialvfl.methods.false_vfl import (
    ALLOWED_TENSORS,
    allowed_tensors,
    fuse_posteriors,
    gaussian_log_density,
    latent_log_weights,
    predictive_log_probs,
    reparameterize,
    snis_weights,
    split_gaussian,
)
from partialvfl.methods.false_vfl.formulas import bound_noise, latent_noise
from partialvfl.methods.false_vfl.spec import paper_row
from partialvfl.methods.training import TrainingLoop
from partialvfl.nn.stats import log_mean_exp

TINY = dict(d_h=8, d_z=4, encoder_hidden=[32], decoder_hidden=[32], global_hidden=[32], discriminator_hidden=[32],
            mask_hidden=[16, 16], importance_samples=4, predict_importance_samples=20, pretrain_batch_size=64,
            batch_size=32)


def _synthetic(n: int = 800, n_test: int = 400, train_missing: str = "mcar:0.2", seed: int = 0):
    source = make_synthetic(n_samples=n, n_test=n_test, n_parties=4, n_features=5, n_classes=3, noise=0.6, seed=seed)
    n_labels = min(300, n // 2)
    cfg = ProtocolConfig("synthetic", parties=4, n_labels=n_labels, n_aligned=n_labels // 5,
                         train_missing=train_missing, test_missing="mcar:0", seed=seed)
    return make_protocol(cfg, source=source)


@pytest.fixture(scope="module")
def data():
    return _synthetic()


@pytest.fixture(scope="module")
def fitted(data):
    train, _ = data
    params = dict(TINY, pretrain_epochs=25, epochs=25, pretrain_lr=3e-3, lr=3e-3)
    return get_method("false-vfl-1")("fast", seed=1, **params).fit(train)


# ---------------------------------------------------------------------- formulas
def test_fusion_matches_hand_computation() -> None:
    mu = torch.tensor([[[1.0, -2.0], [0.5, 0.0]], [[3.0, 2.0], [9.0, 9.0]], [[-1.0, 4.0], [2.0, 1.0]]])
    logvar = torch.log(torch.tensor([[[1.0, 0.5], [2.0, 1.0]], [[4.0, 0.25], [1.0, 1.0]], [[0.5, 2.0], [1.0, 4.0]]]))
    observed = torch.tensor([[True, True], [True, False], [True, True]])
    mean, lv = fuse_posteriors(mu, logvar, observed, "mean-precision")
    # sample 0: all three parties; sample 1: parties 0 and 2 (party 1's values must be ignored)
    prec0 = 1 / np.array([1.0, 0.5]) + 1 / np.array([4.0, 0.25]) + 1 / np.array([0.5, 2.0])
    prec1 = 1 / np.array([2.0, 1.0]) + 1 / np.array([1.0, 4.0])
    np.testing.assert_allclose(mean[0].numpy(), [(1 + 3 - 1) / 3, (-2 + 2 + 4) / 3], rtol=1e-6)
    np.testing.assert_allclose(mean[1].numpy(), [(0.5 + 2) / 2, (0 + 1) / 2], rtol=1e-6)
    np.testing.assert_allclose(torch.exp(-lv).numpy(), np.stack([prec0, prec1]), rtol=1e-5)

    mean_poe, lv_poe = fuse_posteriors(mu, logvar, observed, "poe")
    w0 = np.stack([1 / np.array([1.0, 0.5]), 1 / np.array([4.0, 0.25]), 1 / np.array([0.5, 2.0])]) / prec0
    np.testing.assert_allclose(mean_poe[0].numpy(), (w0 * np.array([[1, -2], [3, 2], [-1, 4]])).sum(0), rtol=1e-5)
    w1 = np.stack([1 / np.array([2.0, 1.0]), 1 / np.array([1.0, 4.0])]) / prec1
    np.testing.assert_allclose(mean_poe[1].numpy(), (w1 * np.array([[0.5, 0.0], [2.0, 1.0]])).sum(0), rtol=1e-5)
    torch.testing.assert_close(lv_poe, lv)

    # one party alone gives back its own posterior; a sample with no party gets N(0, I)
    m1, l1 = fuse_posteriors(mu, logvar, torch.tensor([[False, False], [True, False], [False, False]]))
    torch.testing.assert_close(m1[0], mu[1, 0])
    torch.testing.assert_close(l1[0], logvar[1, 0])
    assert torch.all(m1[1] == 0) and torch.all(l1[1] == 0)
    with pytest.raises(ValueError, match="fusion rule"):
        fuse_posteriors(mu, logvar, observed, "average")


def test_snis_weights_are_normalised_and_predictive_is_a_distribution() -> None:
    g = torch.Generator().manual_seed(0)
    log_w = 300 * torch.randn(50, 7, generator=g)  # extreme log-weights: must stay finite in log space
    w = snis_weights(log_w)
    torch.testing.assert_close(w.sum(0), torch.ones(7))
    log_py = torch.log_softmax(torch.randn(50, 7, 3, generator=g), dim=-1)
    lp = predictive_log_probs(log_w, log_py)
    assert torch.isfinite(lp).all()
    torch.testing.assert_close(lp.exp().sum(-1), torch.ones(7))
    torch.testing.assert_close(lp.exp(), (w.unsqueeze(-1) * log_py.exp()).sum(0))


@pytest.mark.slow
def test_predictions_do_not_depend_on_the_labels(fitted, data) -> None:
    _, test = data
    blind = test.with_labels(np.zeros(test.n_samples, bool))
    np.testing.assert_array_equal(fitted.predict_proba(test), fitted.predict_proba(blind))


# ---------------------------------------------------------------------- the bound (Theorem C.1)
def _linear_gaussian_model(seed: int = 0):
    """Linear encoders/decoders with constant variances: p(x_obs) is Gaussian with a closed form."""
    g = torch.Generator().manual_seed(seed)
    d_h, d_z, dims = 3, 2, (2, 3)

    def lin(i: int, o: int, scale: float = 0.7) -> nn.Linear:
        m = nn.Linear(i, o).double()
        with torch.no_grad():
            m.weight.copy_(scale * torch.randn(o, i, generator=g, dtype=torch.float64))
            m.bias.copy_(0.3 * torch.randn(o, generator=g, dtype=torch.float64))
        return m

    encoders = [lin(d, 2 * d_h) for d in dims]
    decoders = [lin(d_h, d) for d in dims]
    dec_logvar = [torch.log(torch.full((d,), 0.3, dtype=torch.float64)) for d in dims]
    genc, gdec = lin(d_h, 2 * d_z), lin(d_z, 2 * d_h)
    with torch.no_grad():  # constant log-variance halves keep the model linear-Gaussian
        for m, d in ((genc, d_z), (gdec, d_h)):
            m.weight[d:] = 0.0
            m.bias[d:] = math.log(0.5)
    return d_h, d_z, dims, encoders, decoders, dec_logvar, genc, gdec


def _exact_log_marginal(x_obs: list[torch.Tensor], obs: list[int], model) -> torch.Tensor:
    d_h, d_z, dims, _, decoders, dec_logvar, _, gdec = model
    a, a0 = gdec.weight[:d_h], gdec.bias[:d_h]
    cov_h = a @ a.T + torch.diag(torch.exp(gdec.bias[d_h:]))
    bs = torch.cat([decoders[k].weight for k in obs])
    mean = bs @ a0 + torch.cat([decoders[k].bias for k in obs])
    cov = bs @ cov_h @ bs.T + torch.diag(torch.exp(torch.cat([dec_logvar[k] for k in obs])))
    dist = torch.distributions.MultivariateNormal(mean, covariance_matrix=cov)
    return dist.log_prob(torch.cat(x_obs, dim=-1))


def _iwae_bound(x: list[torch.Tensor], obs: list[int], model, kappa: int, reps: int, g: torch.Generator):
    d_h, d_z, dims, encoders, decoders, dec_logvar, genc, gdec = model
    n_k = len(dims)
    b = x[0].shape[0]
    mu = torch.zeros(n_k, b, d_h, dtype=torch.float64)
    lv = torch.zeros(n_k, b, d_h, dtype=torch.float64)
    for k in obs:
        m, v = split_gaussian(encoders[k](x[k]), (-8.0, 6.0))
        mu[k], lv[k] = m, v
    observed = torch.zeros(n_k, b, dtype=torch.bool)
    observed[obs] = True
    mean, logvar = fuse_posteriors(mu, lv, observed)
    eps = torch.randn(kappa, reps, b, d_h, generator=g, dtype=torch.float64).reshape(kappa, reps * b, d_h)
    h = reparameterize(mean.repeat(reps, 1), logvar.repeat(reps, 1), eps)
    eps_z = torch.randn(kappa, reps * b, d_z, generator=g, dtype=torch.float64)
    log_w = latent_log_weights(h, mean.repeat(reps, 1), logvar.repeat(reps, 1), genc, gdec, eps_z)
    for k in obs:
        log_w = log_w + gaussian_log_density(x[k].repeat(reps, 1), decoders[k](h), dec_logvar[k])
    per = log_mean_exp(log_w, dim=0).reshape(reps, b)
    return per.mean(0), per.std(0) / math.sqrt(reps)


@pytest.mark.parametrize("obs", [[0, 1], [1]])
def test_bound_increases_with_kappa_and_stays_below_exact_log_likelihood(obs) -> None:
    model = _linear_gaussian_model()
    g = torch.Generator().manual_seed(1)
    x = [torch.randn(4, d, generator=g, dtype=torch.float64) for d in model[2]]
    exact = _exact_log_marginal([x[k] for k in obs], obs, model)
    with torch.no_grad():
        bounds = {kappa: _iwae_bound(x, obs, model, kappa, 3000, g) for kappa in (1, 10, 100)}
    # Monte Carlo tolerance: 4 standard errors of the difference (per data point)
    for lo, hi in ((1, 10), (10, 100)):
        (m_lo, s_lo), (m_hi, s_hi) = bounds[lo], bounds[hi]
        assert torch.all(m_hi - m_lo > -4 * torch.sqrt(s_lo**2 + s_hi**2)), (lo, hi)
    m1, s1 = bounds[1]
    m100, s100 = bounds[100]
    assert torch.all(m100 - m1 > 4 * torch.sqrt(s1**2 + s100**2))  # strictly better with many samples
    assert torch.all(m100 < exact + 4 * s100)  # a lower bound...
    assert torch.all(exact - m100 < exact - m1)  # ...that tightens towards log p(x_obs)


# ---------------------------------------------------------------------- distributed gradients
def _record_draws(obj, store: list) -> None:
    original = obj._draw

    def recorder(gen, shape):
        t = original(gen, shape)
        store.append(t.clone())
        return t

    obj._draw = recorder


@pytest.mark.parametrize("wire", ["lean", "samples", "bound"])
@pytest.mark.parametrize("variant", [1, 2])
@pytest.mark.float_sensitive
def test_distributed_gradients_equal_centralised_gradients(variant, wire) -> None:
    """Every wire protocol: every gradient equals the centralised bound's."""
    train, _ = _synthetic(n=200, n_test=20)
    params = dict(TINY, pretrain_epochs=0, epochs=0, pretrain_lr=0.0, pretrain_weight_decay=0.0, wire=wire)
    fed = LocalFederation.for_dataset(train)
    method = get_method(f"false-vfl-{variant}")("fast", seed=3, **params).fit(train, federation=fed)
    handle = fed.attach(train, "grad")
    view = train.coordinator_view()
    coord_draws: list = []
    party_draws = {k: [] for k in range(train.n_parties)}
    _record_draws(method, coord_draws)
    for k in range(train.n_parties):
        _record_draws(fed.runtimes[k].program, party_draws[k])
    rows = np.flatnonzero(train.observed.any(1))[:40]
    assert len({tuple(r) for r in train.observed[rows]}) > 2  # mixed masks inside the batch
    nets = [fed.runtimes[k].program.net for k in range(train.n_parties)]
    ref_nets = [copy.deepcopy(n) for n in nets]
    ref_genc, ref_gdec = copy.deepcopy(method.global_encoder_), copy.deepcopy(method.global_decoder_)
    opt = torch.optim.SGD(list(method.global_encoder_.parameters()) + list(method.global_decoder_.parameters()), lr=0)
    method._pretrain_step(view, handle, rows, noise_seed=11, optimizer=opt)

    # centralised reference: one autograd graph over everything, same noise
    p = method.params_
    obs = train.observed[rows]
    n_k, b = train.n_parties, len(rows)
    mus, lvs = torch.zeros(n_k, b, p["d_h"]), torch.zeros(n_k, b, p["d_h"])
    mus, lvs = list(mus), list(lvs)
    xs = [torch.as_tensor(np.nan_to_num(blk[rows])) for blk in train.blocks]
    for k in range(n_k):
        idx = torch.as_tensor(np.flatnonzero(obs[:, k]))
        m, v = split_gaussian(ref_nets[k].encoder(xs[k][idx]), p["encoder_logvar_range"])
        mus[k] = mus[k].index_copy(0, idx, m)
        lvs[k] = lvs[k].index_copy(0, idx, v)
    mean, logvar = fuse_posteriors(torch.stack(mus), torch.stack(lvs), torch.as_tensor(obs.T), p["fusion"])
    # the batch's shared eps_h (drawn once in this process for the coordinator and the parties), then the
    # coordinator's own eps_z draw
    shared = latent_noise(11, (p["importance_samples"], b, p["d_h"]), torch.device("cpu"))
    eps = shared if wire != "bound" else bound_noise(  # bound: each row's noise hashes its mean and scale
        11, torch.arange(b), mean.detach(), torch.exp(0.5 * logvar.detach()), shared.shape[0])
    h = reparameterize(mean, logvar, eps)
    log_w = latent_log_weights(h, mean, logvar, ref_genc, ref_gdec, coord_draws[-1], p["encoder_logvar_range"])
    for k in range(n_k):
        held, mis = np.flatnonzero(obs[:, k]), np.flatnonzero(~obs[:, k])
        net = ref_nets[k]
        dec_lv = net.decoder_logvar.clamp(*p["decoder_logvar_range"])
        ll = gaussian_log_density(xs[k][held], net.decoder(h[:, held]), dec_lv)
        log_w = log_w.index_add(1, torch.as_tensor(held), ll)
        if variant == 2:
            logit = net.indicator(xs[k][held]).squeeze(-1)
            log_w = log_w.index_add(1, torch.as_tensor(held), nn.functional.logsigmoid(-logit).expand(h.shape[0], -1))
            if mis.size:
                x_mis = reparameterize(net.decoder(h[:, mis]), dec_lv, party_draws[k][-1])  # its last draw
                logit = net.indicator(x_mis).squeeze(-1)
                log_w = log_w.index_add(1, torch.as_tensor(mis), nn.functional.logsigmoid(logit))
    (-log_mean_exp(log_w, 0).mean()).backward()

    for net, ref in zip(nets, ref_nets):
        for (name, a), (_, r) in zip(net.named_parameters(), ref.named_parameters()):
            assert a.grad is not None, name
            torch.testing.assert_close(a.grad, r.grad, rtol=1e-4, atol=1e-6, msg=name)
    for mod, ref in ((method.global_encoder_, ref_genc), (method.global_decoder_, ref_gdec)):
        for a, r in zip(mod.parameters(), ref.parameters()):
            torch.testing.assert_close(a.grad, r.grad, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------- stage 2 freezes Theta_g (and psi)
@pytest.mark.parametrize("variant", [1, 2])
@pytest.mark.float_sensitive
def test_stage_two_leaves_every_generative_parameter_bit_identical(variant) -> None:
    train, _ = _synthetic(n=300, n_test=20)
    method = get_method(f"false-vfl-{variant}")("fast", seed=0, **dict(TINY, pretrain_epochs=1, epochs=0))
    method.fit(train)
    fed = method.federation_

    def snapshot():
        parties = [{k: v.clone() for k, v in fed.runtimes[k].program.net.state_dict().items()}
                   for k in range(train.n_parties)]
        coord = {f"{m}.{k}": v.clone() for m in ("global_encoder_", "global_decoder_")
                 for k, v in getattr(method, m).state_dict().items()}
        return parties, coord

    before = snapshot()
    disc_before = [t.clone() for t in method.discriminator_.parameters()]
    handle = fed.attach(train, "stage2")
    loop = TrainingLoop(fed.transport, name="stage 2 alone", history=[], report=lambda *_: None,
                        save_coordinator=dict, load_coordinator=lambda _: None)
    method.params_ = {**method.params_, "epochs": 2}
    loop.run(method._train_stage(train.coordinator_view(), handle))
    after = snapshot()
    for sb, sa in zip(before[0] + [before[1]], after[0] + [after[1]]):
        assert sb.keys() == sa.keys()
        for key in sb:
            assert torch.equal(sb[key], sa[key]), key
    assert any(not torch.equal(a, b) for a, b in zip(disc_before, method.discriminator_.parameters()))


# ---------------------------------------------------------------------- what crosses the boundary
@pytest.mark.parametrize("wire", ["lean", "samples"])
@pytest.mark.parametrize("variant", [1, 2])
def test_message_audit_only_allowed_tensors_cross_and_no_raw_block(variant, wire) -> None:
    """Every wire protocol: the declared tensors and no raw block (all methods: tests/test_contract.py)."""
    train, test = _synthetic(n=120, n_test=30)
    log = MessageLog(keep_payloads=True)
    method = get_method(f"false-vfl-{variant}")("fast", seed=0, **dict(TINY, pretrain_epochs=1, epochs=1, wire=wire))
    method.fit(train, log=log)
    method.predict_proba(test)
    method.predict_proba(train)  # rows with missing blocks: II's prediction sends each lacked row's seed_mis too
    assert log.tensor_names(crossing_only=True) == allowed_tensors(variant, wire)
    assert allowed_tensors(variant, wire) <= ALLOWED_TENSORS[variant]
    assert find_raw_feature_leaks(log, train, test) == []
    kinds = {e.kind for e in log.crossing()}
    assert kinds >= {"encode", "decode", "decode_grad", "update"}
    wide = {"h", "h_mis", "grad_h", "grad_h_mis", "mean", "scale", "mean_mis", "scale_mis", "grad_mean",
            "grad_scale", "grad_mean_mis", "grad_scale_mis", "mu", "logvar", "grad_mu", "grad_logvar"}
    for e in log.crossing():  # latents, posteriors and their gradients are (..., d_h): never a feature row
        for name, shape in zip(e.names, e.shapes):
            if name in wide:
                assert shape[-1] == method.params_["d_h"]


@pytest.mark.parametrize("variant", [1, 2])
@pytest.mark.float_sensitive
def test_lean_and_samples_wires_train_the_same_model(variant) -> None:
    """Same seed, same steps: the lean protocol ends in the samples protocol's parameters and predictions."""
    train, test = _synthetic(n=200, n_test=60)
    fitted = {}
    for wire in ("samples", "lean"):
        params = dict(TINY, pretrain_epochs=2, epochs=2, wire=wire)
        fitted[wire] = get_method(f"false-vfl-{variant}")("fast", seed=4, **params).fit(train)
    runtimes = [fitted[w].federation_.runtimes for w in ("samples", "lean")]
    for a, b in zip(*runtimes):
        for (name, x), (_, y) in zip(a.program.net.state_dict().items(), b.program.net.state_dict().items()):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5, msg=name)
    np.testing.assert_allclose(fitted["lean"].predict_proba(test), fitted["samples"].predict_proba(test),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("variant", "estimator"), [(1, "paper"), (2, "paper"), (1, "adaptive"), (2, "adaptive")])
def test_the_next_batch_encode_rides_with_the_last_round_of_a_step(variant, estimator) -> None:
    """Training steps take 3 rounds (not 4) and stage-2 / prediction steps 1 (not 2), but for a stage's first; the
    adaptive estimator's prediction steps take one decode round per estimator round, the next encode riding with the
    last."""
    train, test = _synthetic(n=200, n_test=100)
    log = MessageLog()
    params = dict(TINY, pretrain_epochs=2, epochs=2, predict_batch_size=40, predict_estimator=estimator,
                  predict_rounds=3, early_stopping="off")
    method = get_method(f"false-vfl-{variant}")("fast", seed=0, **params).fit(train, log=log)
    fit_steps = {e.step for e in log}
    method.predict_proba(test)
    per_row = 1 if estimator == "paper" else 3
    predicted: dict[int, set[int]] = {}
    for e in log:
        if e.step not in fit_steps:
            predicted.setdefault(e.step, set()).add(e.round)
    assert [len(r) for _, r in sorted(predicted.items())] == [1 + per_row, per_row, per_row]  # 100 rows, batches of 40
    rounds: dict[int, set[int]] = {}
    kinds: dict[int, set[str]] = {}
    for e in log:
        rounds.setdefault(e.step, set()).add(e.round)
        kinds.setdefault(e.step, set()).add(e.kind)
    training = [s for s in sorted(kinds) if "update" in kinds[s]]
    inference = [s for s in sorted(kinds) if "decode" in kinds[s] and "update" not in kinds[s]]
    assert len(training) > 4 and len(inference) > 4
    assert [len(rounds[s]) for s in training] == [4] + [3] * (len(training) - 1)  # stage 1 is one run of steps
    several = [len(rounds[s]) for s in inference if s in fit_steps]
    assert several.count(2) == 1 and set(several) == {1, 2}  # stage 2's first step encodes alone


def test_lean_wire_moves_over_four_times_fewer_bytes_at_kappa_ten_with_bfloat16() -> None:
    """Bytes per sample-step from the message log: samples vs lean (float32) vs lean (bfloat16), same fit."""
    train, _ = _synthetic(n=200, n_test=10)
    totals = {}
    for wire, dtype in (("samples", "float32"), ("lean", "float32"), ("lean", "bfloat16")):
        log = MessageLog(keep_entries=False)
        params = dict(TINY, d_h=64, importance_samples=10, pretrain_epochs=1, epochs=0, wire=wire, wire_dtype=dtype)
        get_method("false-vfl-1")("fast", seed=0, **params).fit(train, log=log)
        totals[(wire, dtype)] = log.total_bytes()
    # per held row and step: samples 16 + 8 d_h (encode/update) + 8 S d_h + 8 S; lean 16 + 16 d_h + 8 S + 8
    assert totals[("samples", "float32")] / totals[("lean", "float32")] > 2.5
    assert totals[("samples", "float32")] / totals[("lean", "bfloat16")] > 4.0


# ---------------------------------------------------------------------- persistence and subsets of parties
def test_prediction_from_every_single_party_and_every_pair(fitted, data) -> None:
    _, test = data
    k = test.n_parties
    for size in (1, 2):
        for subset in itertools.combinations(range(k), size):
            obs = np.zeros_like(test.observed)
            obs[:, list(subset)] = test.observed[:, list(subset)]
            proba = fitted.predict_proba(test.with_observed(obs))
            assert np.isfinite(proba).all()
            np.testing.assert_allclose(proba.sum(1), 1.0, rtol=1e-6)
            chance = 1.0 / test.task.n_classes
            assert (proba.argmax(1) == test.y).mean() > (1.0 if size == 1 else 1.6) * chance, subset


def test_accuracy_rises_with_the_number_of_observed_parties(fitted, data) -> None:
    _, test = data
    acc = {}
    for size in range(1, test.n_parties + 1):
        accs = []
        for subset in itertools.combinations(range(test.n_parties), size):
            obs = np.zeros_like(test.observed)
            obs[:, list(subset)] = True
            accs.append(fitted.score(test.with_observed(obs)))
        acc[size] = float(np.mean(accs))
    assert acc[1] < acc[2] < acc[3] < acc[4] + 0.01, acc
    assert acc[4] - acc[1] > 0.05, acc


def test_a_down_party_at_prediction_is_treated_as_missing(fitted, data) -> None:
    _, test = data
    transport = fitted.federation_.transport
    transport.down.add(0)
    try:
        proba = fitted.predict_proba(test)
    finally:
        transport.down.discard(0)
    assert np.isfinite(proba).all()
    assert any(p == 0 for _, p, _ in transport.failures)
    only0 = test.observed[:, 0] & ~test.observed[:, 1:].any(1)
    np.testing.assert_allclose(proba[only0], np.tile(fitted.label_prior_, (only0.sum(), 1)))
    without0 = test.observed.copy()
    without0[:, 0] = False
    ref = fitted.predict_proba(test.with_observed(without0))
    assert abs((proba.argmax(1) == test.y).mean() - (ref.argmax(1) == test.y).mean()) < 0.05


# ---------------------------------------------------------------------- regression, options, presets
@pytest.mark.slow
def test_regression_with_a_gaussian_discriminator() -> None:
    rng = np.random.default_rng(0)
    n = 400
    z = rng.normal(size=(n, 2))
    blocks = [z @ rng.normal(size=(2, 3)) + 0.3 * rng.normal(size=(n, 3)) for _ in range(3)]
    y = 5.0 + 3.0 * z[:, 0] - 2.0 * z[:, 1]
    obs = rng.random((n, 3)) > 0.25
    obs[~obs.any(1), 0] = True
    for k in range(3):
        blocks[k][~obs[:, k]] = np.nan
    data = VerticalDataset(blocks, obs, y=y, task=Task.regression())
    train, test = data.subset(np.arange(300)), data.subset(np.arange(300, n))
    method = get_method("false-vfl-1")("fast", seed=0, **dict(TINY, pretrain_epochs=30, epochs=40,
                                                               pretrain_lr=3e-3, lr=5e-3, fusion="poe"))
    method.fit(train)
    rmse = evaluate(method, test)["rmse"]
    assert rmse < 0.6 * float(np.std(test.y)), rmse
    assert method.score(test) > 1 - 0.6**2  # R^2, higher is better: the same bound


def test_paper_rows_map_our_datasets() -> None:
    assert paper_row("fashion-mnist:train") == "fashion-mnist"
    assert paper_row("isolet") == "isolet" and paper_row("hapt") == "hapt" and paper_row("digits") == "isolet"
    params = get_method("false-vfl-1")("paper").resolve_params("fashion-mnist")
    assert (params["d_h"], params["d_z"], params["pretrain_lr"], params["pretrain_batch_size"]) == (196, 32, 5e-5,
                                                                                                     1024)
    assert (params["importance_samples"], params["predict_importance_samples"], params["pretrain_epochs"]) == (
        10, 50, 150)


def test_variant_two_predicts_from_any_single_party() -> None:
    train, test = _synthetic(n=300, n_test=100, train_missing="mnar:0.7")
    method = get_method("false-vfl-2")("fast", seed=0, **dict(TINY, pretrain_epochs=5, epochs=5))
    method.fit(train)
    for k in range(test.n_parties):
        obs = np.zeros_like(test.observed)
        obs[:, k] = True
        p = method.predict_proba(test.with_observed(obs))
        assert np.isfinite(p).all()
        np.testing.assert_allclose(p.sum(1), 1.0, rtol=1e-6)


@pytest.mark.parametrize(("estimator", "rounds"), [("paper", 1), ("adaptive", 3)])
def test_importance_ess_lies_between_one_and_all_samples_and_is_nan_without_parties(fitted, data, estimator,
                                                                                      rounds) -> None:
    _, test = data
    test = test.with_observed(np.vstack([np.zeros((1, test.n_parties), bool), test.observed[1:]]))
    model = copy.deepcopy(fitted)
    for n in (1, 16):
        model.params_ = {**model.params_, "predict_importance_samples": n, "predict_estimator": estimator,
                         "predict_rounds": rounds}
        ess = model.importance_ess(test)
        assert np.isnan(ess[0]) and np.isfinite(ess[1:]).all()
        assert (ess[1:] >= 1 - 1e-9).all() and (ess[1:] <= n * rounds + 1e-6).all()
        if n * rounds == 1:
            np.testing.assert_allclose(ess[1:], 1.0)
        else:
            assert ess[1:].max() > 1.5  # the weights are not all on one sample
