"""FedHSSL: partial model aggregation, cross-party pairing, fine-tuning set, zero-imputation.

What every method must do (no raw feature crosses, save/load, seeds, wrong parameters, gRPC equals in process,
crash + resume) is tested for FedHSSL too, in tests/test_contract.py and tests/test_kill_resume.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from partialvfl import Task, VerticalDataset
from partialvfl.federation import MessageLog
from partialvfl.methods import get_method
from partialvfl.methods.fedhssl import FedHSSL, average_state_dicts, split_encoder

TINY = dict(latent_dim=8, encoder_hidden=[8, 8], proj_dim=8, proj_hidden=8, pred_hidden=4, pretrain_epochs=1,
            pretrain_batch_size=16, epochs=2, batch_size=8)


def _data(n: int = 40, seed: int = 0) -> VerticalDataset:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n)
    dims = (4, 3, 5)
    blocks = [rng.normal(size=(3, d))[y] * 2 + rng.normal(size=(n, d)) * 0.5 for d in dims]
    obs = np.ones((n, 3), bool)
    obs[1::4, 0] = False
    obs[2::4, 1] = False
    for k in range(3):
        blocks[k][~obs[:, k]] = np.nan
    labeled = np.arange(n) % 3 != 0
    return VerticalDataset(blocks, obs, y=y, labeled=labeled, task=Task.classification(["a", "b", "c"]),
                           active_party=0)


def _method(**kw: object) -> FedHSSL:
    return get_method("fedhssl")("fast", seed=2, **{**TINY, **kw})


def _states(m: FedHSSL, name: str) -> list[dict[str, torch.Tensor]]:
    return [{k: v.clone() for k, v in m.federation_.runtimes[p].program.net[name].state_dict().items()}
            for p in range(3)]


@pytest.mark.parametrize("aggregate", ["top", "top+head"])
def test_partial_model_aggregation_averages_exactly_the_top_encoders(aggregate: str) -> None:
    data = _data()
    m = _method(pretrain=False, epochs=0, aggregate=aggregate).fit(data)
    g = torch.Generator().manual_seed(0)
    for p in range(3):  # make the parties' models differ
        with torch.no_grad():
            for prm in m.federation_.runtimes[p].program.net.parameters():
                prm.add_(torch.randn(prm.shape, generator=g))
    before = {name: _states(m, name) for name in ("top", "local_head", "bottom", "cross", "cross_head")}
    m.aggregate_tops()
    after = {name: _states(m, name) for name in before}
    averaged = ["top", "local_head"] if aggregate == "top+head" else ["top"]
    for name in before:
        for p in range(3):
            for key, v in after[name][p].items():
                if name in averaged:
                    if v.is_floating_point():
                        want = torch.stack([before[name][q][key] for q in range(3)]).mean(0)
                        torch.testing.assert_close(v, want)
                else:
                    torch.testing.assert_close(v, before[name][p][key], rtol=0, atol=0)


def test_average_state_dicts_checks_keys() -> None:
    a = {"w": torch.ones(2)}
    torch.testing.assert_close(average_state_dicts([a, {"w": torch.zeros(2)}])["w"], torch.full((2,), 0.5))
    # keys match by name in any order (the wire does not keep a party's order)
    mixed = average_state_dicts([{"w": torch.ones(2), "b": torch.ones(1)}, {"b": torch.zeros(1), "w": torch.zeros(2)}])
    assert mixed.keys() == {"w", "b"} and float(mixed["b"]) == 0.5
    with pytest.raises(ValueError, match="same parameters"):
        average_state_dicts([a, {"v": torch.ones(2)}])


def test_split_encoder_tops_have_one_shape_for_different_pieces() -> None:
    for arch, shapes in (("mlp", [(4,), (7,)]), ("cnn", [(4, 3), (5, 6)])):
        tops = [split_encoder(s, 6, arch, hidden=(8,))[1] for s in shapes]
        assert [tuple(t.shape) for t in tops[0].state_dict().values()] == \
            [tuple(t.shape) for t in tops[1].state_dict().values()]
        bottom, top = split_encoder(shapes[1], 6, arch, hidden=(8,))
        assert top(bottom(torch.zeros(2, int(np.prod(shapes[1]))))).shape == (2, 6)


def test_cross_party_pairs_and_finetuning_rows() -> None:
    data = _data()
    log = MessageLog(keep_payloads=True)
    m = _method().fit(data, log=log)
    m.predict_proba(data)
    kinds = {e.kind for e in log.crossing()}
    assert {"cross_project", "cross_update", "local_ssl", "get_top", "set_top", "embed", "grad_embedding"} <= kinds
    aligned_labeled = set(np.flatnonzero(data.observed.all(1) & data.labeled).tolist())
    entries = list(zip(log.entries, log.payloads))
    fit_end = max(i for i, (e, _) in enumerate(entries) if e.kind == "grad_embedding")
    ft_rows = set()
    for e, p in entries[:fit_end]:
        if e.kind == "embed" and e.direction == "request":
            ft_rows |= set(p["rows"].numpy().tolist())
        if e.kind == "cross_project" and e.direction == "request":
            assert data.observed[p["rows"].numpy()].all()  # cross-party SSL only on aligned samples
    assert ft_rows == aligned_labeled  # fine-tuning on aligned labelled samples, all of them
    # FedHSSL's "first" mode: a passive party is paired with the active party only, the active one with all
    step = next(e.step for e, _ in entries if e.kind == "cross_update")
    z = {e.sender: p["z"] for e, p in entries
         if e.step == step and e.kind == "cross_project" and e.direction == "reply"}
    for e, p in entries:
        if e.step == step and e.kind == "cross_update" and e.direction == "request":
            partners = [1, 2] if e.receiver == 0 else [0]
            torch.testing.assert_close(p["targets"], torch.stack([z[j] for j in partners], 1))


def test_zero_imputation_equals_feeding_a_zero_block() -> None:
    data = _data()
    m = _method(pretrain=False).fit(data)
    missing = np.flatnonzero(~data.observed[:, 0])
    blocks = [np.array(b) for b in data.blocks]
    blocks[0][missing] = m.federation_.runtimes[0].scaler.mean  # a zero block once the party standardised it
    filled = VerticalDataset(blocks, np.ones_like(data.observed) & (data.observed | (np.arange(3) == 0)),
                             y=data.y, labeled=data.labeled, task=data.task, active_party=0)
    np.testing.assert_allclose(m.predict_proba(data)[missing], m.predict_proba(filled)[missing], rtol=1e-5,
                               atol=1e-7)


def test_needs_aligned_labeled_samples() -> None:
    data = _data()
    obs = data.observed.copy()
    obs[::2, 2] = False
    obs[1::2, 1] = False
    with pytest.raises(ValueError, match="every party observes"):
        _method().fit(data.with_observed(obs & data.observed))


def test_paper_preset_is_table_9() -> None:
    p = get_method("fedhssl").preset_params("paper", "isolet:train")
    assert (p["optimizer"], p["lr"], p["batch_size"], p["epochs"], p["latent_dim"]) == ("adam", 2e-3, 64, 300, 128)
    assert (p["pretrain_optimizer"], p["pretrain_lr"], p["pretrain_batch_size"], p["pretrain_epochs"]) == \
        ("sgd", 0.025, 512, 150)
    m = get_method("fedhssl")("paper", seed=0, pretrain_epochs=1, epochs=1).fit(_data())
    assert np.isfinite(m.predict_proba(_data())).all()
