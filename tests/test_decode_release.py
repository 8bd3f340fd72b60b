"""FALSE-VFL's likelihood release under a party's policy (issue 23, item 4), in process (the same checks as a party
server; the attacks over the wire: tests/test_extraction.py).

The ``lean`` and ``samples`` wires let the coordinator choose the latents a party's decoder is evaluated at: an
exact linear oracle on the party's rows.  A party refuses them unless ``allow_likelihood_release = true``; the
``bound`` wire (each row's noise a hash of the exact mean and scale sent with it, a floor on the scale, distinct
positions) is what a fit under the default policy uses (``wire = auto``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from partialvfl import Task, VerticalDataset
from partialvfl.federation import LocalFederation, PartyRuntime, Request
from partialvfl.federation.trust.policy import PartyPolicy
from partialvfl.federation.wire.refusals import PolicyViolation
from partialvfl.methods import get_method, load_all
from partialvfl.methods.false_vfl.formulas import bound_noise
from partialvfl.methods.false_vfl.party import FalseVFLParty

D, D_H = 6, 4


def config(**change: Any) -> dict[str, Any]:
    cfg = {"feature_dim": D, "feature_shape": [D], "d_h": D_H, "encoder": "mlp", "decoder": "mlp",
           "encoder_hidden": [8], "decoder_hidden": [8], "mask_hidden": [8], "resnet_width": 64, "pretrain_lr": 1e-3,
           "pretrain_weight_decay": 0.0, "encoder_logvar_range": [-8, 6], "decoder_logvar_range": [-5, 3],
           "variant": 1, "wire": "bound", "wire_dtype": "float32", "latent_scale_floor": 0.3}
    cfg.update(change)
    return cfg


def data(n: int = 40, seed: int = 0) -> VerticalDataset:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    blocks = [rng.normal(size=(n, D)) + y[:, None], rng.normal(size=(n, D)) - y[:, None]]
    return VerticalDataset(blocks, np.ones((n, 2), bool), y=y, labeled=np.arange(n) % 2 == 0,
                           task=Task.classification([0, 1]), active_party=0)


def party(policy: PartyPolicy, **change: Any) -> tuple[PartyRuntime, torch.Tensor]:
    load_all()
    ds = data()
    rt = PartyRuntime(0, "bank", policy=policy, feature_shape=(D,))
    rt.attach("train", ds.party(0))
    rt.handle(Request("setup", {}, {"program": FalseVFLParty.program_name, "config": config(**change), "seed": 1}))
    return rt, torch.arange(len(ds.ids))


def decode(rt: PartyRuntime, rows: torch.Tensor, mean: torch.Tensor, scale: torch.Tensor, pos: torch.Tensor,
           samples: int = 3) -> Any:
    rt.handle(Request("encode", {"rows": rows}, {"data": "train"}))
    return rt.handle(Request("decode", {"mean": mean, "scale": scale, "pos": pos},
                             {"noise_seed": 5, "batch": len(rows), "samples": samples, "data": "train"}))


@pytest.mark.parametrize("wire", ["lean", "samples"])
def test_the_default_policy_refuses_latents_the_coordinator_chooses_freely(wire: str) -> None:
    with pytest.raises(PolicyViolation) as err:
        party(PartyPolicy.default(), wire=wire)
    assert err.value.rule == "allow_likelihood_release" and "exact linear oracle" in str(err.value)
    assert "allow_likelihood_release = true" in str(err.value)
    party(PartyPolicy.from_table({"allow_likelihood_release": True}), wire=wire)  # the party's own opt-in


def test_a_bound_decode_refuses_shared_positions_and_scales_under_the_floor() -> None:
    rt, rows = party(PartyPolicy.default())
    n = len(rows)
    ok = decode(rt, rows, torch.zeros(n, D_H), torch.full((n, D_H), 0.3), torch.arange(n))
    assert ok.tensors["loglik"].shape == (3, n)
    for mean, scale, pos, says in (
            (torch.zeros(n, D_H), torch.ones(n, D_H), torch.zeros(n, dtype=torch.int64), "must be distinct"),
            (torch.zeros(n, D_H), torch.full((n, D_H), 0.2), torch.arange(n), "at least 0.3"),
            (torch.full((n, D_H), float("nan")), torch.ones(n, D_H), torch.arange(n), "must be finite")):
        with pytest.raises(ValueError, match=says):
            decode(rt, rows, mean, scale, pos)
    with pytest.raises(PolicyViolation, match="scale 0.1, under this party's floor of 0.3"):  # the policy's floor
        party(PartyPolicy.default(), latent_scale_floor=0.1)


def test_bound_noise_is_fixed_by_the_exact_mean_and_scale_and_differs_between_rows() -> None:
    mean, scale = torch.zeros(3, D_H), torch.ones(3, D_H)
    a = bound_noise(7, torch.arange(3), mean, scale, 4)
    assert torch.equal(a, bound_noise(7, torch.arange(3), mean.clone(), scale.clone(), 4))  # both sides agree
    assert not torch.equal(a[:, 0], a[:, 1])  # two rows with the same mean and scale: different latents
    nudged = mean.clone()
    nudged[0, 0] = torch.nextafter(torch.tensor(0.0), torch.tensor(1.0))
    b = bound_noise(7, torch.arange(3), nudged, scale, 4)
    assert not torch.equal(a[:, 0], b[:, 0]) and torch.equal(a[:, 1:], b[:, 1:])  # one bit moves the draw


def test_the_batched_and_per_party_paths_answer_a_bound_decode_alike() -> None:
    fed = LocalFederation.for_dataset(data(), batched=True)
    for rt in fed.runtimes:
        rt.policy = PartyPolicy.default()
    handle = fed.attach(data(), "train")
    fed.setup(FalseVFLParty.program_name, [config(), config()], seed=1)
    rows = torch.arange(10)
    fed.transport.new_step()
    fed.transport.broadcast([0, 1], "encode", {"rows": rows}, data=handle)
    fed.transport.new_round()
    mean, scale = torch.randn(10, D_H), torch.full((10, D_H), 0.3)
    req = {"mean": mean, "scale": scale, "pos": torch.arange(10)}
    together = fed.transport.broadcast([0, 1], "decode", req, noise_seed=3, batch=10, samples=4)
    for k in (0, 1):
        program = fed.runtimes[k].program
        program.encode_rows(handle, rows, train=False)
        alone = program.on_decode(Request("decode", req, {"noise_seed": 3, "batch": 10, "samples": 4}))
        torch.testing.assert_close(together[k].tensors["loglik"], alone.tensors["loglik"])


def test_a_fit_under_the_default_policy_uses_the_bound_wire_and_predicts() -> None:
    train = data(80)
    fed = LocalFederation.for_dataset(train)
    for rt in fed.runtimes:
        rt.policy = PartyPolicy.from_table({"seed": 4, "min_latent_scale": 0.05})
    params = {"pretrain_epochs": 2, "epochs": 2, "d_h": D_H, "d_z": 2, "encoder_hidden": [8], "decoder_hidden": [8],
              "global_hidden": [8], "discriminator_hidden": [8], "importance_samples": 3,
              "predict_importance_samples": 4}
    model = get_method("false-vfl-1")("fast", seed=0, **params).fit(train, federation=fed)
    assert model.params_["wire"] == "bound" and model.params_["latent_scale_floor"] == 0.05
    proba = model.predict_proba(train)
    assert proba.shape == (80, 2) and np.allclose(proba.sum(1), 1.0)
    research = get_method("false-vfl-1")("fast", seed=0, **params).fit(train)
    assert research.params_["wire"] == "lean"  # the simulation's research policy releases likelihoods


@pytest.mark.slow
def test_a_federated_fit_with_parties_on_the_default_policy_runs_the_bound_wire(tmp_path) -> None:
    """Over gRPC: the parties announce their policy in their hello; wire = auto picks the bound wire at the largest
    floor they ask for, and the fit and its predictions go through every party's checks."""
    from helpers import make_data
    from partialvfl.federation.grpc.local import LocalDeployment
    from test_contract import TINY

    train = make_data(48, seed=0, prefix="tr")
    narrow = {"seed": 3, "max_width_ratio": 4}  # 2-4 columns per party: wide enough for d_h = 4
    with LocalDeployment(tmp_path, train, deadline=300.0, start_timeout=600.0,
                         policy={**narrow, "min_latent_scale": 0.05}) as dep:
        dep.policy[2] = {**narrow, "min_latent_scale": 0.1}  # one party asks for a higher floor
        dep.start()
        fed = dep.federation()
        try:
            assert fed.announced_policies()[0] == {"allow_likelihood_release": False, "min_latent_scale": 0.05,
                                                   "max_request_mb": 64.0, "max_width_ratio": 4.0,
                                                   "max_setup_width_ratio": 8.0,
                                                   "accept_coordinator_features": False,
                                                   "allow_explanations": True}
            model = get_method("false-vfl-1")("fast", seed=0, **TINY["false-vfl-1"]).fit(train, federation=fed)
            assert model.params_["wire"] == "bound" and model.params_["latent_scale_floor"] == 0.1
            proba = model.predict_proba(train)
        finally:
            fed.close()
    assert np.allclose(proba.sum(1), 1.0)
