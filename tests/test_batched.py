"""Batched parties in the in-process simulation (the split-network methods): the same parameters, optimiser states,
messages, predictions and saved states as the per-party path (to float tolerance), heterogeneous parties answered
alone, faults handled.  FALSE-VFL parties are never batched: in process they answer by their own handlers, as in a
deployment, bit for bit (issue 21)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from partialvfl import Task, VerticalDataset
from partialvfl.data.protocol import ProtocolConfig, make_protocol
from partialvfl.data.sources.synthetic import make_synthetic
from partialvfl.federation import LocalFederation, MessageLog
from partialvfl.methods import get_method
from partialvfl.methods.splitnn import batched as splitnn_batched
from partialvfl.nn.blocks import MLP
from partialvfl.nn.stacked import mlp_signature, pad_rows, stacked_mlp

FALSE_VFL = dict(d_h=8, d_z=4, encoder_hidden=[16], decoder_hidden=[16], global_hidden=[16], discriminator_hidden=[16],
                 mask_hidden=[8], importance_samples=3, predict_importance_samples=5, pretrain_batch_size=32,
                 batch_size=16, pretrain_epochs=2, epochs=2)
SPLIT = dict(latent_dim=8, encoder_hidden=[16], head_hidden=[16], batch_size=16, epochs=3)


@pytest.fixture(scope="module")
def data():
    source = make_synthetic(n_samples=160, n_test=60, n_parties=4, n_features=5, n_classes=3, noise=0.6, seed=0)
    cfg = ProtocolConfig("synthetic", parties=4, n_labels=80, n_aligned=30, train_missing="mcar:0.3",
                         test_missing="mcar:0.3", seed=0)
    return make_protocol(cfg, source=source)


def _fit(name: str, params: dict, train: VerticalDataset, batched: bool):
    log = MessageLog()
    fed = LocalFederation.for_dataset(train, log=log, batched=batched)
    return get_method(name)("fast", seed=2, **params).fit(train, federation=fed), log


def _programs_state(model) -> list[dict]:
    return [rt.program.state_dict() for rt in model.federation_.runtimes]


def _assert_close_nested(a, b, where: str = "") -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_close_nested(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=where)
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_close_nested(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


CASES = [
    ("laser-vfl", SPLIT),
    ("laser-vfl", dict(SPLIT, heads="per-party", batching="per-sample")),
    ("vanilla-vfl", SPLIT),
    ("combinatorial", dict(SPLIT, epochs=2)),
]


@pytest.mark.parametrize(("name", "params"), CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
@pytest.mark.float_sensitive
def test_batched_parties_end_in_the_per_party_parameters_messages_and_predictions(name, params, data) -> None:
    train, test = data
    alone, log_alone = _fit(name, params, train, batched=False)
    together, log_together = _fit(name, params, train, batched=True)
    # every party's modules and optimiser state, and the coordinator's modules
    _assert_close_nested(_programs_state(together), _programs_state(alone), "parties")
    _assert_close_nested(together._coordinator_state(), alone._coordinator_state(), "coordinator")
    # the same messages, party by party, in the same order
    assert log_together.entries == log_alone.entries
    np.testing.assert_allclose(together.predict_proba(test), alone.predict_proba(test), rtol=1e-4, atol=1e-5)


def test_the_batched_path_really_stacks_the_parties(data, monkeypatch) -> None:
    train, _ = data
    calls = []
    original = splitnn_batched.stacked_mlp

    def counting(modules, x, **options):
        calls.append(len(modules))
        return original(modules, x, **options)

    monkeypatch.setattr(splitnn_batched, "stacked_mlp", counting)
    _fit("laser-vfl", SPLIT, train, batched=True)
    assert calls and max(calls) == train.n_parties
    calls.clear()
    _fit("laser-vfl", SPLIT, train, batched=False)
    assert calls == []


@pytest.mark.parametrize("name", ["false-vfl-1", "false-vfl-2"])
@pytest.mark.float_sensitive
def test_false_vfl_parties_answer_alone_in_process_bit_for_bit(name, data) -> None:
    """Issue 21: a stacked pass over rows padded to the round's largest count sums in another float order than a
    party's own handler (the handler a deployed party runs); Adam and FALSE-VFL's training amplified that into a
    different model.  In process every FALSE-VFL party now answers alone: the default federation is the per-party
    path, to the last bit."""
    train, test = data
    default, log_default = _fit(name, FALSE_VFL, train, batched=True)
    alone, log_alone = _fit(name, FALSE_VFL, train, batched=False)
    for a, b in zip(_programs_state(default), _programs_state(alone)):
        for key, t in a["net"].items():
            assert torch.equal(t, b["net"][key]), key
    assert default.history_ == alone.history_
    assert log_default.entries == log_alone.entries
    np.testing.assert_array_equal(default.predict_proba(test), alone.predict_proba(test))


def test_a_batched_fit_saves_party_files_the_per_party_path_loads(data, tmp_path) -> None:
    train, test = data
    model, _ = _fit("laser-vfl", SPLIT, train, batched=True)
    model.save(tmp_path)
    assert sorted(p.name for p in tmp_path.glob("party-*.pt")) == [f"party-{k}.pt" for k in range(train.n_parties)]
    fed = LocalFederation(train.party_names, train.active_party, batched=False)
    loaded = get_method("laser-vfl").load(tmp_path, federation=fed)
    np.testing.assert_allclose(loaded.predict_proba(test), model.predict_proba(test), rtol=1e-4, atol=1e-6)


def test_heterogeneous_parties_are_answered_alone_with_the_same_result() -> None:
    train = _dataset((4, 4, 6))  # parties 0 and 1 share a stacked pass, party 2 is answered alone
    alone, _ = _fit("laser-vfl", SPLIT, train, batched=False)
    together, _ = _fit("laser-vfl", SPLIT, train, batched=True)
    _assert_close_nested(_programs_state(together), _programs_state(alone), "laser-vfl")


def _dataset(dims, n: int = 120, shapes=None, seed: int = 0) -> VerticalDataset:
    rng = np.random.default_rng(seed)
    blocks = [rng.normal(size=(n, d)).astype(np.float32) for d in dims]
    obs = rng.random((n, len(dims))) > 0.2
    obs[~obs.any(1), 0] = True
    y = np.where(obs[:, 0], blocks[0][:, 0] > 0, True).astype(np.int64)
    for k in range(len(dims)):
        blocks[k][~obs[:, k]] = np.nan
    return VerticalDataset(blocks, obs, y=y, task=Task.classification([0, 1]), feature_shapes=shapes)


def test_a_party_down_for_one_round_fails_alone_in_a_batched_round(data) -> None:
    """A party marked down misses its messages; the others are answered together; the round fails naming it."""
    train, _ = data
    results = []
    for batched in (False, True):
        fed = LocalFederation.for_dataset(train, batched=batched)
        model = get_method("laser-vfl")("fast", seed=2, **dict(SPLIT, epochs=0)).fit(train, federation=fed)
        handle = fed.attach(train, "again")
        rows = np.flatnonzero(train.observed.all(1))[:12]
        fed.transport.new_step()
        embs = model._embed_observed(handle, rows, train.observed[rows], train=True)
        emb = model._stack(rows, train.observed[rows], embs)
        fed.transport.down.add(1)
        with pytest.raises(Exception, match="party 1"):  # split-NN rounds do not tolerate a missing party
            model._step_heads(model.heads_["g"](emb.mean(1)).sum(), embs)
        fed.transport.down.clear()
        results.append(_programs_state(model))
    _assert_close_nested(results[1], results[0], "laser-vfl")


# ---------------------------------------------------------------------- the stacked MLP itself
@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 7), min_size=1, max_size=4), st.lists(st.integers(1, 6), min_size=0, max_size=2),
       st.integers(1, 5), st.integers(1, 4), st.integers(0, 10_000))
@pytest.mark.float_sensitive
def test_stacked_mlp_equals_each_party_s_own_mlp_and_gradients(rows, hidden, d_in, d_out, seed) -> None:
    torch.manual_seed(seed)
    mlps = [MLP(d_in, hidden, d_out) for _ in rows]
    assert len({mlp_signature(m) for m in mlps}) == 1
    xs = [torch.randn(n, d_in) for n in rows]
    out = stacked_mlp(mlps, pad_rows(xs))
    weights = [torch.randn(n, d_out) for n in rows]
    sum((out[k, :n] * w).sum() for k, (n, w) in enumerate(zip(rows, weights))).backward()
    stacked_grads = [[p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in m.parameters()]
                     for m in mlps]
    for m in mlps:
        m.zero_grad(set_to_none=True)
    for k, (m, x, w) in enumerate(zip(mlps, xs, weights)):
        alone = m(x)
        torch.testing.assert_close(out[k, :len(x)], alone, rtol=1e-5, atol=1e-6)
        (alone * w).sum().backward()
        for p, g in zip(m.parameters(), stacked_grads[k]):
            torch.testing.assert_close(p.grad if p.grad is not None else torch.zeros_like(p), g, rtol=1e-5,
                                       atol=1e-6)


def test_only_plain_mlps_have_a_signature() -> None:
    assert mlp_signature(MLP(3, [4], 2)) == (("linear", 3, 4), ("relu", 0, 0), ("linear", 4, 2))
    assert mlp_signature(MLP(3, [4], 2, batch_norm=True)) is None
    assert mlp_signature(MLP(3, [4], 2, dropout=0.1)) is None
    assert mlp_signature(nn.Conv2d(1, 2, 3)) is None
