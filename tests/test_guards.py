"""The default policy's new bounds (issue 23, item 3), in process (the same checks a party server runs): gradient
rows clipped to ``max_grad_norm``, optimiser settings that reset or freeze weights refused, rewinds to one saved
state capped, the width of a whole setup capped."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from partialvfl.federation import PartyRuntime, Request
from partialvfl.federation.trust.guards import clip_gradient_rows
from partialvfl.federation.trust.policy import PartyPolicy
from partialvfl.federation.wire.refusals import PolicyViolation
from partialvfl.methods import load_all
from partialvfl.methods.false_vfl.party import FalseVFLParty
from partialvfl.methods.splitnn.party import SplitParty
from test_policy import D, runtime, setup, split_config


def test_gradient_rows_over_the_bound_are_clipped_and_the_others_untouched() -> None:
    spec = SplitParty.messages["grad_embedding"]
    g = torch.zeros(3, 4)
    g[0, 0], g[1, 1], g[2] = 3.0, 500.0, 60.0  # row norms 3, 500, 120
    out, n = clip_gradient_rows(spec, {"grad:f": g, "grad:g": g.clone()}, 100.0, "grad_embedding")
    assert n == 4  # two rows in each model's gradient
    for name in ("grad:f", "grad:g"):
        torch.testing.assert_close(out[name].norm(dim=1), torch.tensor([3.0, 100.0, 100.0]))
        assert torch.equal(out[name][0], g[0])  # direction kept, small rows untouched
    loglik = FalseVFLParty.messages["decode_grad"]  # (S, B): rows on dimension 1
    out, n = clip_gradient_rows(loglik, {"grad_loglik": torch.full((10, 2), 50.0)}, 100.0, "decode_grad")
    assert n == 2 and torch.allclose(out["grad_loglik"].norm(dim=0), torch.tensor([100.0, 100.0]))
    with pytest.raises(PolicyViolation, match="holds a NaN or an infinity"):
        clip_gradient_rows(spec, {"grad:f": torch.tensor([[float("nan")]])}, 100.0, "grad_embedding")
    same, n = clip_gradient_rows(spec, {"grad:f": g}, None, "grad_embedding")  # research: as they came
    assert n == 0 and same["grad:f"] is g


def test_a_party_clips_what_the_coordinator_sends_as_a_gradient() -> None:
    rt = runtime()
    load_all()
    data = torch.randn(8, D)
    from partialvfl import Task, VerticalDataset

    ds = VerticalDataset([data.numpy()], torch.ones(8, 1, dtype=torch.bool).numpy(), y=[0, 1] * 4,
                         task=Task.classification([0, 1]))
    rt.attach("train", ds.party(0))
    setup(rt, **split_config(optimizer={"name": "sgd", "lr": 1e-6, "weight_decay": 0.0, "momentum": 0.0}))
    before = {k: v.clone() for k, v in rt.program.models["f"].state_dict().items()}
    rt.handle(Request("embed", {"rows:f": torch.arange(8)}, {"data": "train", "train": True}))
    g = torch.randn(8, 2 * D)
    rt.handle(Request("grad_embedding", {"grad:f": g / g.norm(dim=1, keepdim=True) * 1e6}))
    assert rt.clipped_rows == 8
    moved = max(float((rt.program.models["f"].state_dict()[k] - v).abs().max()) for k, v in before.items())
    assert moved < 1e-2  # lr 1e-6 x 8 rows x 100: what one step can do, whatever the coordinator's scale


@pytest.mark.parametrize(("change", "rule"), [
    ({"optimizer": {"name": "sgd", "lr": 1e-3, "weight_decay": 1e6, "momentum": 0.0}}, "max_weight_decay"),
    ({"optimizer": {"name": "sgd", "lr": 1e-3, "weight_decay": 0.0, "momentum": 1.0}}, "max_momentum"),
    ({"optimizer": {"name": "sgd", "lr": 10.0, "weight_decay": 0.0, "momentum": 0.0}}, "max_lr"),
    ({"models": [f"m{i}" for i in range(16)]}, "max_setup_width_ratio"),
])
def test_optimiser_settings_that_reset_or_freeze_weights_and_wide_setups_are_refused(change: dict[str, Any],
                                                                                     rule: str) -> None:
    rt = runtime()
    with pytest.raises(PolicyViolation) as err:
        setup(rt, **split_config(**change))
    assert err.value.rule == rule, err.value
    if change.get("optimizer", {}).get("weight_decay", 0) >= 0:  # (torch itself refuses a negative one)
        setup(runtime(PartyPolicy.research()), **split_config(**change))  # the research policy takes them


def test_request_metadata_is_held_to_the_same_bounds() -> None:
    rt = runtime()
    setup(rt, **split_config())
    for simsiam, rule in (({"lr": 0.02, "weight_decay": 1e3}, "max_weight_decay"),
                          ({"lr": 0.02, "momentum": 1.5}, "max_momentum"), ({"lr": 50.0}, "max_lr")):
        with pytest.raises(PolicyViolation) as err:
            rt.handle(Request("pretrain", {}, {"data": "x", "simsiam": simsiam, "epoch": 0}))
        assert err.value.rule == rule
    with pytest.raises(PolicyViolation, match="set_lr lr 5 is over this party's ceiling of 1"):
        rt.handle(Request("set_lr", {}, {"lr": 5.0}))


def _train_step(rt: PartyRuntime) -> None:
    rt.handle(Request("embed", {"rows:f": torch.arange(4)}, {"data": "train", "train": True}))
    rt.handle(Request("grad_embedding", {"grad:f": torch.zeros(4, 2 * D)}))


def test_training_again_and_again_from_one_saved_state_is_capped(tmp_path: Path) -> None:
    from partialvfl import Task, VerticalDataset

    ds = VerticalDataset([torch.randn(4, D).numpy()], torch.ones(4, 1, dtype=torch.bool).numpy(), y=[0, 1, 0, 1],
                         task=Task.classification([0, 1]))
    rt = runtime(PartyPolicy.from_table({"max_rewinds": 2}))
    rt.attach("train", ds.party(0))
    setup(rt, **split_config())
    rt.handle(Request("save", {}, {"dir": str(tmp_path / "s")}))
    rt.handle(Request("save", {}, {"dir": str(tmp_path / "copy")}))  # the same state saved twice is one state
    _train_step(rt)  # training goes on from it: not a rewind
    for source in ("s", "copy"):  # rewinds 1 and 2, through either file
        rt.handle(Request("load", {}, {"dir": str(tmp_path / source)}))
        _train_step(rt)
    setup(rt, **split_config())  # a new setup does not start the count again
    rt.handle(Request("load", {}, {"dir": str(tmp_path / "s")}))
    with pytest.raises(PolicyViolation, match="would be rewind 3 to that state"):
        _train_step(rt)
    rt.handle(Request("load", {}, {"dir": str(tmp_path / "s")}))
    rt.handle(Request("embed", {"rows:f": torch.arange(4)}, {"data": "train"}))  # inference from it: fine
