"""X-VFL: loss terms per sample type, DS-Align, the XCom routing on the wire, local inference, the audit and
save/load with features missing inside blocks.

What every method must do (no raw feature crosses, save/load, seeds, wrong parameters, gRPC equals in process,
crash + resume) is tested for X-VFL too, in tests/test_contract.py and tests/test_kill_resume.py (PAGE)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from partialvfl import Task, VerticalDataset
from partialvfl.data.dataset import DataValidationError
from partialvfl.federation import MessageLog, find_raw_feature_leaks
from partialvfl.federation.wire.setup_config import OptimiserSetup
from partialvfl.methods import get_method
from partialvfl.methods.model_files import IndexInfo
from partialvfl.methods.x_vfl import (
    XVFL,
    _TrainContext,
    _Updater,
    incomplete_matrix,
    with_within_block_missing,
    within_block_mask,
    x_vfl_partial_setting,
)

TINY = dict(latent_dim=8, encoder_hidden=[8], xcom_hidden=[8], top_hidden=[8], epochs=2, batch_size=16)


def _data(n: int = 48, seed: int = 0, missing: bool = True) -> VerticalDataset:
    """Three parties, three classes; each block carries the class signal plus noise."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n)
    dims = (4, 3, 5)
    centres = [rng.normal(size=(3, d)) * 2 for d in dims]
    blocks = [c[y] + rng.normal(size=(n, c.shape[1])) * 0.5 for c in centres]
    obs = np.ones((n, 3), bool)
    if missing:
        obs[1::4, 0] = False
        obs[2::4, 1] = False
        obs[3::8, 2] = False
    for k in range(3):
        blocks[k][~obs[:, k]] = np.nan
    return VerticalDataset(blocks, obs, y=y, task=Task.classification(["a", "b", "c"]), active_party=2)


def _method(**kw: object) -> XVFL:
    return get_method("x-vfl")("fast", seed=1, **{**TINY, **kw})


# ---------------------------------------------------------------------- loss terms against a hand-built batch
def _bare(n_classes: int = 3, K: int = 3, **params: object) -> XVFL:
    m = XVFL("fast", **params)
    m.index_ = IndexInfo(Task.classification(list(range(n_classes))), tuple(f"p{k}" for k in range(K)),
                         (2,) * K, ((2,),) * K, K - 1)
    m.params_ = m.resolve_params(None)
    return m


def _hand_batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    D = 4
    comp = np.array([[1, 1, 1], [1, 0, 1], [0, 1, 0]], bool)  # aligned; party 1 missing; only party 1 complete
    E = torch.randn(3, 3, D, generator=g)
    E[~torch.as_tensor(comp)] = 1e3  # garbage where a block is not complete: must never be used
    al = np.array([0])
    plan, tilde = {}, {}
    for k in range(3):
        na = np.flatnonzero(~comp.all(1) & ~comp[:, k])
        plan[k] = (al, na, None)
        tilde[k] = torch.randn(len(al) + len(na), D, generator=g)
    y = torch.tensor([0, 2, 1])
    top = nn.Linear(D, 3)
    with torch.no_grad():
        top.weight.copy_(torch.randn(3, D, generator=g))
    return E, comp, tilde, plan, y, top


def _ce(top: nn.Module, z: torch.Tensor, y: int) -> torch.Tensor:
    return F.cross_entropy(top(z)[None], torch.tensor([y]))


def _mse_probs(top: nn.Module, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return ((torch.softmax(top(a), -1) - torch.softmax(top(b), -1)) ** 2).mean()


@pytest.mark.float_sensitive
def test_active_loss_terms_per_sample_type_match_the_paper() -> None:
    E, comp, tilde, plan, y, top = _hand_batch()
    m = _bare()
    t = m.loss_terms(top, E, comp, tilde, plan, y)
    K = 3
    # aligned sample 0: all K single terms, the joint term, K completion terms (Eq. 27 with m = k), DS-Align 1, 2
    e0 = E[0]
    single0 = sum(_ce(top, e0[i], 0) for i in range(K))
    joint0 = _ce(top, e0.mean(0), 0)
    comp0 = sum(_ce(top, (tilde[i][0] + e0.sum(0) - e0[i]) / K, 0) for i in range(K))
    ds1_0 = sum(_mse_probs(top, tilde[i][0], e0[i]) for i in range(K))
    ds2_0 = sum(_mse_probs(top, e0[i], e0.mean(0)) for i in range(K))
    # non-aligned sample 1 (party 1 missing): M = {0, 2}; one completion term with Et'_1 from E'/m
    e1 = E[1]
    single1 = _ce(top, e1[0], 2) + _ce(top, e1[2], 2)
    joint1 = _ce(top, (e1[0] + e1[2]) / 2, 2)
    comp1 = _ce(top, (tilde[1][1] + e1[0] + e1[2]) / K, 2)
    # non-aligned sample 2 (only party 1 complete, m = 1): the joint term repeats the single one (as written)
    e2 = E[2]
    single2 = _ce(top, e2[1], 1)
    comp2 = _ce(top, (tilde[0][1] + tilde[2][1] + e2[1]) / K, 1)
    torch.testing.assert_close(t["single"], torch.stack([single0, single1, single2]))
    torch.testing.assert_close(t["joint"], torch.stack([joint0, joint1, single2]))
    torch.testing.assert_close(t["completed"], torch.stack([comp0, comp1, comp2]))
    torch.testing.assert_close(t["ds_align1"], torch.stack([ds1_0, torch.tensor(0.0), torch.tensor(0.0)]))
    torch.testing.assert_close(t["ds_align2"], torch.stack([ds2_0, torch.tensor(0.0), torch.tensor(0.0)]))
    torch.testing.assert_close(t["decision"], t["single"] + t["joint"] + t["completed"])
    # the objective weights DS-Align by lambda1, lambda2 and averages over the batch
    m.params_ = {**m.params_, "lambda1": 0.3, "lambda2": 0.7}
    total = m._objective(top, E, comp, tilde, plan, y)
    want = (t["decision"].sum() + 0.3 * t["ds_align1"].sum() + 0.7 * t["ds_align2"].sum()) / 3
    torch.testing.assert_close(total, want)


@pytest.mark.float_sensitive
def test_ds_align_is_zero_when_completed_and_true_embeddings_agree() -> None:
    E, comp, tilde, plan, y, top = _hand_batch(seed=3)
    m = _bare()
    assert float(m.loss_terms(top, E, comp, tilde, plan, y)["ds_align1"][0].detach()) > 1e-3
    for k in range(3):
        tilde[k] = tilde[k].clone()
        tilde[k][0] = E[0, k]  # aligned row: the completion equals the true embedding
    for space in ("probs", "logits"):
        m.params_ = {**m.params_, "ds_align_space": space}
        ds1 = m.loss_terms(top, E, comp, tilde, plan, y)["ds_align1"].detach()
        # Bound 1e-10: the two sides pass through `top` in products of 1 and of 9 rows, which some CPUs round
        # alike and others not (an AVX-512 Xeon gave 1.85e-17): a few float32 ulps of logits ~1, squared, ~1e-13.
        assert float(ds1[0]) <= 1e-10
        assert torch.count_nonzero(ds1[1:]) == 0  # non-aligned rows: no DS-Align 1 term at all
    # DS-Align 2 vanishes when every party's embedding equals the joint one
    E2 = E.clone()
    E2[0] = E[0, 0]
    ds2 = m.loss_terms(top, E2, comp, tilde, plan, y)["ds_align2"].detach()
    assert float(ds2[0]) <= 1e-10  # the same bound: products of 9 rows (single) and 3 rows (joint)
    assert torch.count_nonzero(ds2[1:]) == 0


def test_ds_align_detach_stops_the_gradient_of_the_target_side() -> None:
    E, comp, tilde, plan, y, top = _hand_batch(seed=4)
    E = E.clone().requires_grad_()
    m = _bare(ds_align_detach=True)
    m.loss_terms(top, E, comp, tilde, plan, y)["ds_align2"].sum().backward()
    g_detached = E.grad.clone()
    E.grad = None
    m.params_ = {**m.params_, "ds_align_detach": False}
    m.loss_terms(top, E, comp, tilde, plan, y)["ds_align2"].sum().backward()
    assert not torch.allclose(g_detached, E.grad)


# ---------------------------------------------------------------------- the wire
def test_xcom_inputs_are_the_mean_of_the_other_observed_parties_embeddings() -> None:
    data = _data(n=24)
    log = MessageLog(keep_payloads=True)
    _method(epochs=1, batch_size=24).fit(data, log=log)
    step1 = list(zip(log.entries, log.payloads))
    first = min(e.step for e, _ in step1 if e.kind == "embed")  # the first training step
    emb: dict[int, dict[int, torch.Tensor]] = {}
    rows_sent: dict[int, np.ndarray] = {}
    for e, p in step1:
        if e.step != first:
            continue
        if e.kind == "embed" and e.direction == "request":
            rows_sent[e.receiver] = p["rows"].numpy()
        if e.kind == "embed" and e.direction == "reply":
            emb[e.sender] = dict(zip(rows_sent[e.sender].tolist(), p["emb"]))
    completes = [(e, p) for e, p in step1 if e.step == first and e.kind == "complete" and e.direction == "request"]
    assert len(completes) == 3
    obs = data.observed
    for e, p in completes:
        k = e.receiver
        for r, inp in zip(p["rows"].numpy().tolist(), p["inputs"]):
            if obs[r].all():
                want = torch.stack([emb[j][r] for j in range(3) if j != k]).mean(0)
            else:
                assert not obs[r, k]  # non-aligned rows go only to the parties whose block is missing
                want = torch.stack([emb[j][r] for j in range(3) if obs[r, j]]).mean(0)
            torch.testing.assert_close(inp, want)
    # what comes back from a completion is an embedding, never a block in the party's feature space
    for e in log.entries:
        if e.kind == "complete" and e.direction == "reply":
            assert e.names == ("emb_tilde",) and e.shapes[0][1] == TINY["latent_dim"]


@pytest.mark.parametrize("input_grad", [True, False])
def test_federated_gradients_equal_the_centralised_gradient_of_the_objective(input_grad: bool) -> None:
    data = _data(n=24)
    m = _method(epochs=1, xcom_input_grad=input_grad).fit(data)
    fed = m.federation_
    fed.attach(data, "again")
    view = data.coordinator_view()
    ctx = _TrainContext(view, "again", np.zeros(view.observed.shape, dtype=bool), None,
                        torch.as_tensor(view.y, dtype=torch.long))
    rows = np.arange(24)
    progs = [fed.runtimes[k].program for k in range(3)]
    holders = [p.net for p in progs] + [m.top_]
    for h in holders:
        h.zero_grad(set_to_none=True)
    m._pass(ctx, rows, "cur")
    got = [[p.grad.clone() for p in h.parameters()] for h in holders]
    for h in holders:
        h.zero_grad(set_to_none=True)
    # the same objective in one process, every module at hand
    comp = np.array(data.observed)
    cols = []
    for k, p in enumerate(progs):
        x = torch.tensor(np.nan_to_num(fed.runtimes[k].scaler.transform(data.blocks[k])), dtype=torch.float32)
        cols.append(p.net["bottom"](x) * torch.tensor(comp[:, k], dtype=torch.float32)[:, None])
    E = torch.stack(cols, 1)
    cf = torch.as_tensor(comp, dtype=torch.float32)
    esum = (E * cf[..., None]).sum(1)
    esum_in = esum if input_grad else esum.detach()
    E_in = E if input_grad else E.detach()
    al = np.flatnonzero(comp.all(1))
    plan, tilde = {}, {}
    for k, p in enumerate(progs):
        na = np.flatnonzero(~comp.all(1) & ~comp[:, k])
        inp = torch.cat([(esum_in[al] - E_in[al, k]) / 2, esum_in[na] / cf.sum(1, keepdim=True)[na]])
        plan[k] = (al, na, None)
        tilde[k] = p.net["bottom"](p.net["xcom"](inp))
    loss = m._objective(m.top_, E, comp, tilde, plan, torch.tensor(data.y))
    loss.backward()
    want = [[p.grad for p in h.parameters()] for h in holders]
    for g_h, w_h in zip(got, want):
        for g, w in zip(g_h, w_h):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


def test_no_raw_features_cross_with_features_missing_inside_blocks() -> None:
    data = _data()
    rng = np.random.default_rng(5)
    inc = data.observed & (rng.random(data.observed.shape) < 0.3)
    inc[data.observed.sum(1) == 1] = False
    part = with_within_block_missing(data, inc, 0.5, seed=2)
    log = MessageLog(keep_payloads=True)
    m = _method().fit(part, log=log)
    m.predict_proba(part)
    kinds = {e.kind for e in log.crossing()}
    assert {"embed", "complete", "backward_complete", "backward", "step", "share_top"} <= kinds
    assert log.crossing() and find_raw_feature_leaks(log, part, data) == []


def test_locally_independent_inference_asks_only_that_party_and_is_h_of_f_k() -> None:
    data = _data()
    log = MessageLog()
    m = _method().fit(data, log=log)
    for k in range(3):
        n0 = len(log)
        out = m.predict_output_local(data, k)
        assert out.shape == (data.n_samples, 3)
        np.testing.assert_allclose(out.sum(1), 1.0, rtol=1e-6)
        new = log.entries[n0:]  # one request to party k and its reply, nothing to or from any other party
        assert [(e.kind, e.direction, e.receiver if e.direction == "request" else e.sender) for e in new] == [
            ("predict_local", "request", k), ("predict_local", "reply", k)]
        assert new[1].names == ("probs",)
    # party 0's prediction is h(f_0(x_0)) with the shared top model; rows it lacks get the label prior
    prog = m.federation_.runtimes[0].program
    view = data.party(0)
    with torch.no_grad():
        x = m.federation_.runtimes[0].scaler.transform(view.features)  # the party's own standardisation
        want = torch.softmax(m.top_(prog.net["bottom"](torch.tensor(x))), -1).numpy()
    out = m.predict_output_local(data, 0)
    np.testing.assert_allclose(out[view.rows], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out[~data.observed[:, 0]], np.tile(m.label_prior_, (int((~data.observed[:, 0]).sum()),
                                                                                   1)))
    with pytest.raises(ValueError, match="no party 3"):
        m.predict_output_local(data, 3)


def test_collaborative_inference_works_with_any_subset_of_parties() -> None:
    data = _data(missing=False)
    m = _method().fit(data)
    for drop in ([0], [1], [0, 2], [1, 2]):
        obs = np.ones_like(data.observed)
        obs[:, drop] = False
        out = m.predict_proba(data.with_observed(obs))
        assert np.isfinite(out).all() and np.allclose(out.sum(1), 1.0)
    avail = _method(inference="available").fit(data).predict_proba(data.with_observed(obs))
    assert not np.allclose(avail, m.predict_proba(data.with_observed(obs)))


def test_save_load_keeps_local_predictions_and_missing_inside_blocks(tmp_path) -> None:
    data = _data()
    part = with_within_block_missing(data, data.observed & (np.arange(data.n_samples) % 3 == 0)[:, None], 0.5)
    m = _method().fit(part)
    m.save(tmp_path / "m")
    loaded = get_method("x-vfl").load(tmp_path / "m")
    np.testing.assert_array_equal(loaded.predict_proba(part), m.predict_proba(part))
    for k in range(3):
        np.testing.assert_array_equal(loaded.predict_output_local(part, k), m.predict_output_local(part, k))


def test_training_learns_and_page_estimator_runs() -> None:
    data = _data(n=90, seed=2)
    sgd = _method(epochs=15).fit(data)
    assert sgd.score(data) > 0.8
    page = _method(epochs=3, estimator="page", page_prob=0.5).fit(data)
    fresh = [h["fresh_steps"] for h in page.history_]
    assert sum(fresh) < 3 * int(np.ceil(90 / 16))  # some steps were PAGE corrections
    assert np.isfinite(page.predict_proba(data)).all()


def test_page_update_rule() -> None:
    lin = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        lin.weight.fill_(1.0)
    up = _Updater(lin, OptimiserSetup(name="sgd", lr=0.1, weight_decay=0.0, momentum=0.0), page=True)
    lin.weight.grad = torch.tensor([[1.0, 2.0]])
    up.step("page-fresh")  # g0 = [1, 2]; w = 1 - 0.1 g0
    torch.testing.assert_close(lin.weight, torch.tensor([[0.9, 0.8]]))
    torch.testing.assert_close(up.prev.weight, torch.tensor([[1.0, 1.0]]))
    lin.weight.grad = torch.tensor([[3.0, 3.0]])
    up.prev.weight.grad = torch.tensor([[1.0, 0.0]])
    up.step("page-correct")  # g1 = g0 + [3, 3] - [1, 0] = [3, 5]
    torch.testing.assert_close(lin.weight, torch.tensor([[0.6, 0.3]]))
    torch.testing.assert_close(up.g_prev[0], torch.tensor([[3.0, 5.0]]))


# ---------------------------------------------------------------------- the partial setting
def test_within_block_mask_is_exact_and_seeded_per_id() -> None:
    a = within_block_mask(np.array([5, 7, 9]), 1, 10, 0.3, seed=4)
    assert (a.sum(1) == 7).all()
    b = within_block_mask(np.array([9, 5]), 1, 10, 0.3, seed=4)
    np.testing.assert_array_equal(b, a[[2, 0]])
    assert within_block_mask(np.array([1]), 0, 10, 0.0, 0).all()
    with pytest.raises(ValueError, match="feature_missing_rate"):
        within_block_mask(np.array([1]), 0, 10, 1.5, 0)


@settings(max_examples=40, deadline=None)
@given(ids=st.lists(st.integers(0, 10**6), min_size=1, max_size=8, unique=True), d=st.integers(1, 12),
       rate=st.floats(0, 1), party=st.integers(0, 5), seed=st.integers(0, 2**31))
def test_within_block_mask_loses_exactly_the_rate_and_depends_only_on_the_id(ids, d, rate, party, seed) -> None:
    mask = within_block_mask(np.array(ids), party, d, rate, seed)
    assert (mask.shape == (len(ids), d)) and ((~mask).sum(1) == int(round(rate * d))).all()
    rev = within_block_mask(np.array(ids[::-1]), party, d, rate, seed)
    np.testing.assert_array_equal(rev, mask[::-1])


def test_x_vfl_partial_setting_touches_only_non_aligned_samples() -> None:
    data = _data(n=40, missing=False)
    data.info["aligned_ids"] = [0, 1, 2, 3]
    part = x_vfl_partial_setting(data, 0.4, seed=1)
    inc = incomplete_matrix(part.ids, 3, part.info)
    assert not inc[:4].any()
    counts = inc[4:].sum(1)
    assert counts.min() >= 1 and counts.max() <= 2  # 1..K-1 incomplete parties per non-aligned sample
    two = VerticalDataset(data.blocks[:2], data.observed[:, :2], y=data.y, task=data.task)
    assert (incomplete_matrix(two.ids, 2, x_vfl_partial_setting(two, 0.5).info).sum(1) == 1).all()
    whole = x_vfl_partial_setting(data, 1.0, seed=1)
    np.testing.assert_array_equal(whole.observed, ~inc)


def test_with_within_block_missing_zero_fills_records_or_drops() -> None:
    data = _data(missing=False)
    inc = np.zeros_like(data.observed)
    inc[:10, 1] = True
    part = with_within_block_missing(data, inc, 0.5, seed=3)
    lost = part.blocks[1][:10] == 0
    assert (lost.sum(1) == 2).all() and np.array_equal(part.blocks[1][10:], data.blocks[1][10:])
    np.testing.assert_array_equal(incomplete_matrix(part.ids, 3, part.info), inc)
    np.testing.assert_array_equal(incomplete_matrix(part.subset(np.arange(5, 20)).ids, 3, part.info), inc[5:20])
    whole = with_within_block_missing(data, inc, 1.0)
    assert not whole.observed[:10, 1].any() and whole.observed[10:].all()
    bad = inc.copy()
    holey = data.with_observed(np.where(np.arange(3) == 1, np.arange(data.n_samples)[:, None] > 0, True))
    with pytest.raises(DataValidationError, match="does not hold ID 0"):
        with_within_block_missing(holey, bad, 0.5)


def test_rejects_regression_and_a_single_party() -> None:
    rng = np.random.default_rng(0)
    reg = VerticalDataset([rng.normal(size=(10, 2)), rng.normal(size=(10, 2))], np.ones((10, 2), bool),
                          y=rng.normal(size=10), task=Task.regression())
    with pytest.raises(ValueError, match="only classification"):
        _method().fit(reg)
    one = VerticalDataset([rng.normal(size=(10, 2))], np.ones((10, 1), bool), y=rng.integers(0, 2, 10),
                          task=Task.classification([0, 1]))
    with pytest.raises(ValueError, match="at least 2 parties"):
        _method().fit(one)


def test_paper_preset_builds_the_papers_sizes() -> None:
    m = get_method("x-vfl")("paper", seed=0, epochs=1).fit(_data(n=24))
    assert m.params_["batch_size"] == 100  # K > 2: the paper's k = 4 batch size
    assert m.params_["latent_dim"] == 512 and m.params_["lambda1"] == m.params_["lambda2"] == 0.01
    assert len([x for x in m.top_ if isinstance(x, nn.Linear)]) == 3  # three-layer FCNN top model (tabular)
    assert get_method("x-vfl").preset_params("paper", "fashion-mnist")["encoder"] == "resnet18"
