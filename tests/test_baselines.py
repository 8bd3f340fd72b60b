"""LASER-VFL and the classic baselines: the estimators, each baseline's defining behaviour, SimSiam pretraining.

What every method must do (no raw feature crosses, save/load, seeds, wrong parameters, gRPC equals in process,
crash + resume) is tested for these methods too, in tests/test_contract.py and tests/test_kill_resume.py."""

from __future__ import annotations

from itertools import combinations
from math import comb

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from partialvfl import Task, VerticalDataset
from partialvfl.federation import MessageLog
from partialvfl.methods import VFLMethod, evaluate, get_method
from partialvfl.methods.splitnn import fit_best_of_pretraining
from partialvfl.methods.splitnn.combinatorial import subset_name
from partialvfl.methods.splitnn.ensemble import majority_vote
from partialvfl.methods.splitnn.laser_vfl import (
    client_averaged_accuracy,
    laser_estimate,
    laser_objective,
    laser_weight,
    sample_task_sets,
)
from partialvfl.methods.splitnn.plug_vfl import plug_dropout
from partialvfl.methods.splitnn.simsiam import SimSiamConfig, SimSiamTrainer, image_augmenter, tabular_augmenter
from partialvfl.nn import MLP

TINY = {"latent_dim": 4, "encoder_hidden": [8], "epochs": 2, "batch_size": 32, "pretrain_epochs": 1,
        "pretrain_batch_size": 64}


def _data(n: int = 120, k: int = 3, p_miss: float = 0.3, seed: int = 0, n_labeled: int = 70) -> VerticalDataset:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n)
    blocks = [rng.normal(size=(n, 3)) + y[:, None] * 0.7 for _ in range(k)]
    obs = rng.random((n, k)) >= p_miss
    obs[: n // 4] = True  # a fully aligned core (Vanilla VFL needs one)
    for j in range(k):
        blocks[j][~obs[:, j]] = np.nan
    labeled = np.zeros(n, bool)
    labeled[rng.permutation(n)[:n_labeled]] = True
    labeled[: n // 8] = True
    return VerticalDataset(blocks, obs, y=y, labeled=labeled, task=Task.classification([0, 1, 2]),
                           name="toy")


def _fit(name: str, data: VerticalDataset, log: MessageLog | None = None, **params) -> VFLMethod:
    return get_method(name)("fast", seed=1, **{**TINY, **params}).fit(data, log=log)


def _embed_requests(log: MessageLog, start: int = 0) -> list[tuple[int, str, np.ndarray]]:
    """(party, model, rows) of every embed request in the log from entry ``start`` on, also those riding with a
    ``grad_embedding`` (its ``next:<model>`` rows)."""
    out = []
    for e, payload in zip(log.entries[start:], log.payloads[start:]):
        if e.kind in ("embed", "grad_embedding") and e.direction == "request":
            prefix = "rows:" if e.kind == "embed" else "next:"
            for name, t in payload.items():
                if name.startswith(prefix):
                    out.append((e.receiver, name.removeprefix(prefix), t.numpy()))
    return out


# ---------------------------------------------------------------------- LASER-VFL's estimator
def test_laser_weights_for_four_observed_blocks() -> None:
    assert [laser_weight(4, i) for i in range(1, 5)] == [1.0, 1.5, 1.0, 0.25]
    with pytest.raises(ValueError, match="1..4"):
        laser_weight(4, 5)


@given(st.integers(1, 9), st.data())
def test_laser_weight_times_size_is_the_subset_count(k_o: int, data: st.DataObject) -> None:
    i = data.draw(st.integers(1, k_o))
    assert laser_weight(k_o, i) * i == pytest.approx(comb(k_o - 1, i - 1))


@pytest.mark.parametrize("shared", [False, True])
def test_sampled_task_sets_are_valid(shared: bool) -> None:
    rng = np.random.default_rng(0)
    obs = np.tile([True, False, True, True], (5, 1)) if shared else rng.random((40, 4)) < 0.6
    sets, weights = sample_task_sets(obs, rng, shared=shared)
    for k in range(4):
        for i in range(1, 5):
            for n in range(len(obs)):
                s = sets[k, i - 1, n]
                if weights[k, i - 1, n] > 0:
                    assert s[k] and s.sum() == i and not (s & ~obs[n]).any()
                    assert weights[k, i - 1, n] == laser_weight(int(obs[n].sum()), i)
                else:
                    assert not obs[n, k] or i > obs[n].sum()
    if shared:
        assert (sets == sets[:, :, :1]).all()


def _estimate_task_by_task(emb, y, sets, weights, head):
    """eq. 8 one (head, size) task at a time, the plain loop the batched estimate must equal."""
    total = emb.new_zeros(())
    for k in range(emb.shape[1]):
        for i in range(emb.shape[1]):
            for n in np.flatnonzero(weights[k, i] > 0):
                members = list(np.flatnonzero(sets[k, i, n]))
                logits = head(k)(emb[n, members].mean(0, keepdim=True))
                total = total + weights[k, i, n] * torch.nn.functional.cross_entropy(logits, y[n:n + 1])
    return total / emb.shape[0]


@pytest.mark.parametrize("per_party_heads", [False, True])
@pytest.mark.parametrize("shared", [False, True])
def test_batched_task_sampled_loss_equals_the_task_by_task_loop(per_party_heads: bool, shared: bool) -> None:
    torch.manual_seed(3)
    k, b, d = 4, 7, 5
    rng = np.random.default_rng(2)
    obs = np.tile([True, False, True, True], (b, 1)) if shared else rng.random((b, k)) < 0.6
    obs[~obs.any(axis=1), 0] = True
    emb, y = torch.randn(b, k, d, requires_grad=True), torch.as_tensor(rng.integers(0, 3, b))
    heads = [torch.nn.Linear(d, 3) for _ in range(k if per_party_heads else 1)]

    def head(j: int) -> torch.nn.Module:
        return heads[j if per_party_heads else 0]

    sets, weights = sample_task_sets(obs, rng, shared=shared)
    fast, slow = laser_estimate(emb, y, sets, weights, head), _estimate_task_by_task(emb, y, sets, weights, head)
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-6)
    (g_fast,) = torch.autograd.grad(fast, emb)
    (g_slow,) = torch.autograd.grad(slow, emb)
    torch.testing.assert_close(g_fast, g_slow, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("per_party_heads,shared", [(False, False), (True, False), (False, True), (True, True)])
def test_task_sampled_loss_is_unbiased(per_party_heads: bool, shared: bool) -> None:
    torch.manual_seed(0)
    k, b, d, draws = 4, 6, 3, 800
    rng = np.random.default_rng(1)
    obs = np.tile([True, True, False, True], (b, 1)) if shared else rng.random((b, k)) < 0.7
    obs[~obs.any(axis=1), 0] = True
    emb = torch.randn(b, k, d)
    y = torch.as_tensor(rng.integers(0, 3, b))
    heads = [torch.nn.Linear(d, 3) for _ in range(k if per_party_heads else 1)]

    def head(j: int) -> torch.nn.Module:
        return heads[j if per_party_heads else 0]

    with torch.no_grad():
        exact = float(laser_objective(emb, y, obs, head))
        est = np.array([float(laser_estimate(emb, y, *sample_task_sets(obs, rng, shared=shared), head))
                        for _ in range(draws)])
    se = est.std(ddof=1) / np.sqrt(draws)
    assert se > 0  # the estimate is random (otherwise the test proves nothing)
    assert abs(est.mean() - exact) < 4.5 * se, (est.mean(), exact, se)


def test_single_head_objective_is_the_plain_sum_over_subsets() -> None:
    torch.manual_seed(0)
    emb, y = torch.randn(1, 3, 2), torch.tensor([1])
    g = torch.nn.Linear(2, 3)
    obs = np.array([[True, True, True]])
    with torch.no_grad():
        total = sum(float(torch.nn.functional.cross_entropy(g(emb[0, list(s)].mean(0, keepdim=True)), y))
                    for r in range(1, 4) for s in combinations(range(3), r))
        assert float(laser_objective(emb, y, obs, lambda _k: g)) == pytest.approx(total, rel=1e-5)


# ---------------------------------------------------------------------- the baselines' defining behaviours
def test_combinatorial_predicts_with_the_exact_observed_set_predictor() -> None:
    train, test = _data(seed=0), _data(seed=1, p_miss=0.5)
    model = _fit("combinatorial", train)
    log = MessageLog(keep_payloads=True)
    model.federation_.transport.log = log
    model.predict_proba(test)
    requests = _embed_requests(log)
    assert requests
    seen_rows = 0
    for party, name, rows in requests:
        pattern = test.observed[rows]
        expected = np.zeros(3, bool)
        expected[[int(v) for v in name[1:].split("-")]] = True
        assert party in np.flatnonzero(expected)
        assert (pattern == expected).all(), f"model {name} was asked for rows of another pattern"
        seen_rows += len(rows) if party == int(name[1:].split("-")[0]) else 0
    assert seen_rows == int(test.observed.any(axis=1).sum())


def test_combinatorial_refuses_too_many_parties() -> None:
    data = _data(k=7, p_miss=0.0)
    with pytest.raises(ValueError, match="max_parties=6"):
        _fit("combinatorial", data)
    assert subset_name((0, 2)) == "S0-2"


def test_majority_vote_tie_break_is_seeded_and_uniform() -> None:
    votes = np.ones((6000, 3))
    a = majority_vote(votes, np.random.default_rng(5))
    assert np.array_equal(a, majority_vote(votes, np.random.default_rng(5)))
    assert not np.array_equal(a, majority_vote(votes, np.random.default_rng(6)))
    counts = np.bincount(a, minlength=3)
    chi2 = float((((counts - 2000) ** 2) / 2000).sum())
    assert chi2 < 13.8  # chi-square, 2 degrees of freedom, p = 0.001
    partial = np.array([[2, 2, 0]] * 4000 + [[0, 1, 3]])
    b = majority_vote(partial, np.random.default_rng(0))
    assert set(b[:-1]) == {0, 1} and b[-1] == 2 and abs((b[:-1] == 0).mean() - 0.5) < 0.04


@pytest.mark.parametrize("pretrain", [False, True])
def test_vanilla_vfl_trains_only_on_fully_aligned_labeled_samples(pretrain: bool) -> None:
    data = _data()
    log = MessageLog(keep_payloads=True)
    _fit("vanilla-vfl", data, log=log, pretrain=pretrain)
    allowed = set(np.flatnonzero(data.labeled & data.observed.all(axis=1)).tolist())
    requests = _embed_requests(log)
    crossed = {int(r) for _, _, rows in requests for r in rows}
    assert crossed and crossed <= allowed
    assert crossed == allowed  # and it does use all of them
    if pretrain:
        assert any(e.kind == "pretrain" for e in log.entries)
        assert all(not e.names for e in log.entries if e.kind == "pretrain")  # nothing but metadata


def test_plug_dropout_never_drops_the_active_party() -> None:
    rng = np.random.default_rng(0)
    obs = rng.random((500, 4)) < 0.8
    for unit in ("batch", "sample"):
        all_dropped = plug_dropout(obs, active=2, p_drop=1.0, rng=rng, unit=unit)
        assert np.array_equal(all_dropped[:, 2], obs[:, 2]) and not all_dropped[:, [0, 1, 3]].any()
    kept = plug_dropout(obs, active=2, p_drop=0.5, rng=rng, unit="sample")
    assert np.array_equal(kept[:, 2], obs[:, 2])
    assert abs(kept[:, 0].sum() / obs[:, 0].sum() - 0.5) < 0.1


def test_plug_vfl_training_always_asks_the_active_party() -> None:
    data = _data()
    active = data.active_party
    log = MessageLog(keep_payloads=True)
    _fit("plug-vfl", data, log=log, p_drop=1.0, epochs=3)
    requests = _embed_requests(log)
    assert requests and all(party == active for party, _, _ in requests)
    got = np.sort(np.concatenate([rows for _, _, rows in requests]))
    want = np.flatnonzero(data.labeled & data.observed[:, active])
    assert np.array_equal(got, np.sort(np.tile(want, 3)))


def test_local_uses_only_the_active_party_and_prior_elsewhere() -> None:
    data, test = _data(), _data(seed=3, p_miss=0.5)
    log = MessageLog(keep_payloads=True)
    model = _fit("local", data, log=log)
    assert {e.receiver for e in log.entries if e.kind == "embed"} == {data.active_party}
    out = model.predict_proba(test)
    blind = ~test.observed[:, test.active_party]
    assert np.allclose(out[blind], model.label_prior_)


def test_laser_per_party_heads_and_client_averaged_accuracy() -> None:
    train, test = _data(), _data(seed=4, p_miss=0.4)
    model = _fit("laser-vfl", train, heads="per-party", batching="per-sample")
    per_head = model.predict_heads(test)
    assert per_head.shape == (test.n_samples, 3, 3)
    assert np.array_equal(~np.isnan(per_head[:, :, 0]), test.observed)
    acc = client_averaged_accuracy(model, test)
    assert 0.0 <= acc <= 1.0
    single = _fit("laser-vfl", train)
    keep = test.labeled & test.observed.any(axis=1)
    plain = float((single.predict(test)[keep] == test.y[keep]).mean())
    assert client_averaged_accuracy(single, test) == pytest.approx(plain)


def test_laser_pattern_batches_share_one_pattern() -> None:
    data = _data()
    model = get_method("laser-vfl")("fast", seed=0, **TINY)
    model.params_ = model.resolve_params(None)
    view = data.coordinator_view()
    rows = np.flatnonzero(view.labeled & view.observed.any(axis=1))
    batches = list(model._batches(view, rows, np.random.default_rng(0)))
    assert np.array_equal(np.sort(np.concatenate(batches)), rows)
    for b in batches:
        assert (view.observed[b] == view.observed[b[0]]).all()


# ---------------------------------------------------------------------- SimSiam and the pretraining protocol
def test_tabular_corruption_draws_from_the_column_marginals() -> None:
    data = np.arange(40, dtype=np.float32).reshape(10, 4)
    aug = tabular_augmenter(data, corruption=0.5, noise=0.0)
    x = torch.full((200, 4), -1.0)
    out = aug(x, torch.Generator().manual_seed(0))
    replaced = out != -1.0
    assert 0.35 < replaced.float().mean() < 0.65
    for c in range(4):
        assert set(out[replaced[:, c], c].tolist()) <= set(data[:, c].tolist())


def test_image_augmenter_keeps_shape_and_is_seeded() -> None:
    aug = image_augmenter((4, 7), crop_pad=1, flip=True, noise=0.0)
    x = torch.randn(5, 28)
    a = aug(x, torch.Generator().manual_seed(3))
    assert a.shape == x.shape
    assert torch.equal(a, aug(x, torch.Generator().manual_seed(3)))


def test_simsiam_pretraining_lowers_its_loss() -> None:
    rng = np.random.default_rng(0)
    data = (rng.normal(size=(256, 6)) + rng.integers(0, 3, (256, 1))).astype(np.float32)
    torch.manual_seed(0)
    enc = MLP(6, [16], 8)
    cfg = SimSiamConfig(epochs=30, batch_size=64, lr=0.05, proj_dim=16, proj_hidden=16, pred_hidden=8)
    trainer = SimSiamTrainer(enc, data, (6,), cfg, torch.Generator().manual_seed(0), out_dim=8)
    losses = [trainer.run_epoch() for _ in range(cfg.epochs)]
    assert losses[-1] < losses[0] - 0.05


def test_simsiam_resumes_exactly_between_epochs() -> None:
    """A trainer rebuilt from a fresh generator and loaded from a saved state continues as if never stopped."""
    rng = np.random.default_rng(1)
    data = rng.normal(size=(100, 5)).astype(np.float32)
    cfg = SimSiamConfig(epochs=4, batch_size=32, lr=0.05, proj_dim=8, proj_hidden=8, pred_hidden=4)

    def trainer(seed: int) -> SimSiamTrainer:
        torch.manual_seed(seed)
        return SimSiamTrainer(MLP(5, [8], 4), data, (5,), cfg, torch.Generator().manual_seed(seed), out_dim=4)

    straight = trainer(0)
    losses = [straight.run_epoch() for _ in range(4)]
    first = trainer(0)
    first.run_epoch(), first.run_epoch()
    saved, enc = first.state_dict(), first.encoder.state_dict()
    again = trainer(7)  # other initial weights and generator: everything must come from the saved state
    again.encoder.load_state_dict(enc)
    again.load_state_dict(saved)
    assert [again.run_epoch(), again.run_epoch()] == losses[2:]


def test_pretraining_is_recorded_and_survives_save_load(tmp_path) -> None:
    model = _fit("laser-vfl", _data(), pretrain=True)
    assert model.pretrained_ and model.params_["pretrain"]
    model.save(tmp_path)
    assert VFLMethod.load(tmp_path).pretrained_


def test_fit_best_of_pretraining_chooses_on_held_out_labels() -> None:
    train, test = _data(), _data(seed=8)
    model = fit_best_of_pretraining("plug-vfl", train, select_on=0.25, **TINY)
    sel = model.selection_
    assert set(sel["val_accuracy"]) == {"pretrained", "labelled_only"}
    assert sel["pretrain"] == (sel["val_accuracy"]["pretrained"] >= sel["val_accuracy"]["labelled_only"])
    assert sel["marker"] == ("" if sel["pretrain"] else "*") and model.pretrained_ == sel["pretrain"]
    assert sel["n_val"] == round(0.25 * train.n_labeled)
    assert 0.0 <= evaluate(model, test)["accuracy"] <= 1.0
    with pytest.raises(ValueError, match="select_on"):
        fit_best_of_pretraining("laser-vfl", train, select_on=1.5)


def test_image_pieces_use_a_cnn_and_image_augmentations() -> None:
    rng = np.random.default_rng(0)
    n = 80
    y = rng.integers(0, 3, n)
    blocks = [rng.normal(size=(n, 16)) + y[:, None] for _ in range(2)]
    obs = np.ones((n, 2), bool)
    obs[::4, 0] = False
    blocks[0][~obs[:, 0]] = np.nan
    data = VerticalDataset(blocks, obs, y=y, task=Task.classification([0, 1, 2]), feature_shapes=[(4, 4), (4, 4)])
    model = _fit("laser-vfl", data, pretrain=True)
    assert type(model.federation_.runtimes[0].program.models["f"]).__name__ == "CNNEncoder"
    assert model.predict_proba(data).shape == (n, 3)


def test_cosine_schedule_reaches_the_parties() -> None:
    log = MessageLog()
    model = _fit("plug-vfl", _data(), log=log, lr_schedule="cosine", epochs=3, optimizer="sgd")
    lrs = [g["lr"] for g in model.federation_.runtimes[0].program.optimizers["f"].param_groups]
    assert sum(e.kind == "set_lr" for e in log.entries) == 3 * 3 * 2  # 3 epochs x 3 parties x request + reply
    assert lrs[0] < model.params_["lr"]


# ---------------------------------------------------------------------- presets and options
def test_paper_presets_follow_tables_6_to_8() -> None:
    v = get_method("vanilla-vfl").preset_params("paper", "hapt:train")
    assert (v["lr"], v["batch_size"], v["epochs"], v["optimizer"]) == (5e-3, 64, 100, "adam")
    assert (v["pretrain_lr"], v["pretrain_batch_size"], v["pretrain_epochs"]) == (0.02, 512, 150) and v["pretrain"]
    las = get_method("laser-vfl").preset_params("paper", "fashion-mnist")
    assert (las["lr"], las["latent_dim"], las["encoder"], las["epochs"]) == (1e-4, 196, "resnet18", 100)
    plug = get_method("plug-vfl").preset_params("paper", "modelnet10")
    assert (plug["lr"], plug["epochs"], plug["pretrain_lr"]) == (1e-4, 50, 0.025)
    code = get_method("laser-vfl").preset_params("laser-paper", "cifar10")
    assert (code["optimizer"], code["lr"], code["weight_decay"], code["lr_schedule"]) == ("sgd", 0.1, 0.008, "cosine")


@settings(max_examples=15, deadline=None)
@given(st.lists(st.lists(st.booleans(), min_size=4, max_size=4), min_size=1, max_size=12), st.integers(0, 99))
def test_task_sets_always_contain_their_head(rows: list[list[bool]], seed: int) -> None:
    obs = np.array(rows, bool)
    sets, weights = sample_task_sets(obs, np.random.default_rng(seed))
    live = weights > 0
    for k in range(4):
        assert sets[k][:, :, k][live[k]].all()
    assert (live.sum(axis=(0, 1)) == obs.sum(axis=1) ** 2).all()


def test_benchmark_table_and_claim_check() -> None:
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "laser_table1.py"
    spec = importlib.util.spec_from_file_location("laser_table1", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = [{"method": m, "train": "0.0", "seed": s, "fit_seconds": 1.0, "accuracy": {"0.0": a + 0.01 * s}}
            for m, a in [("laser-vfl", 0.90), ("plug-vfl", 0.95), ("false-vfl-1", 0.80)] for s in (0, 1)]
    text, stats = bench.table(rows, ["0.0"], ["0.0"])
    assert "| LASER-VFL | 90.5 ± 0.5 |" in text
    lines = bench.claims(stats, ["0.0"], ["0.0"])
    assert "PlugVFL 95.5 vs LASER-VFL 90.5" in lines[1] and lines[-1].endswith("mean rank 3.00")
    assert bench.parse_spec("laser-vfl@pretrain=true,batching=per-sample") == (
        "laser-vfl", {"pretrain": True, "batching": "per-sample"})
