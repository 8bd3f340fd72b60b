"""Labels say when they are exposed (issue 35): the line a federated fit without label protection starts with, and
a party that requires label protection for every fit it takes part in (``[policy] require_label_dp``).

The rule is checked in process on the party's runtime, then against real ``party serve`` processes: the label
holder's party requires label DP at epsilon 1, a fit without it is refused at setup naming the key (nothing is
trained), a fit with ``--label-dp 1`` runs, and the protected model still predicts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from helpers import PATIENCE
from partialvfl import Task, VerticalDataset
from partialvfl.cli import main
from partialvfl.federation import PartyRuntime, Request
from partialvfl.federation.grpc.local import LocalDeployment
from partialvfl.federation.trust.access_log import read_access_log
from partialvfl.federation.trust.policy import PartyPolicy
from partialvfl.federation.wire.refusals import PolicyViolation
from partialvfl.methods import get_method, method_names
from partialvfl.orchestration import FitOptions, run_fit

SMALL = {"latent_dim": 4, "encoder_hidden": [8], "epochs": 2}


def test_a_fit_without_label_protection_says_what_a_passive_party_can_infer() -> None:
    from partialvfl.orchestration.fit import label_exposure

    lines = {name: label_exposure(get_method(name)("fast", seed=0)) for name in method_names()}
    for name in ("vanilla-vfl", "laser-vfl", "plug-vfl", "x-vfl", "fedhssl", "ensemble", "combinatorial"):
        assert lines[name] == (
            f"labels: not protected: {name} sends the passive parties gradients computed from the labels of the rows "
            "they hold, from which a passive party infers those labels (100 % of them by the gradients' direction, "
            "docs/privacy.md) and which rows are labelled; fit with --label-dp EPS to bound the labels by label DP "
            "(randomized response)")
    for name in ("false-vfl-1", "false-vfl-2"):
        assert "sends the passive parties nothing computed from the labels, but they learn which of their rows are " \
               "labelled" in lines[name]
    assert lines["local"] is None  # the passive parties are sent nothing
    assert label_exposure(get_method("vanilla-vfl")("fast", seed=0, label_dp=1.0)) is None


def test_a_party_requiring_label_dp_refuses_an_unprotected_fit_and_trains_nothing_after_a_setup_that_is_none() -> None:
    policy = PartyPolicy.from_table({"preset": "research", "require_label_dp": 1})
    assert "fits only with label DP at epsilon <= 1" in policy.describe()
    assert policy.check_labels(True, 0.5) and policy.check_labels(True, 1) and not policy.check_labels(None, None)
    for label_dp, says in ((None, "this fit has no label DP"), (4.0, "this fit has label DP at epsilon 4.0")):
        with pytest.raises(PolicyViolation) as e:
            policy.check_labels(True, label_dp)
        assert e.value.rule == "require_label_dp" and says in str(e.value)
        assert "--label-dp 1 or less" in str(e.value)
    with pytest.raises(ValueError, match="require_label_dp must be a positive epsilon"):
        PartyPolicy.from_table({"require_label_dp": 0})

    view = VerticalDataset([np.ones((4, 2))], np.ones((4, 1), bool), ids=["a", "b", "c", "d"], y=[0, 1, 0, 1],
                           task=Task.classification([0, 1]), active_party=0).party(0)
    runtime = PartyRuntime(0, "bank", policy=policy)
    runtime.attach("train", view)
    cfg = {"feature_dim": 2, "feature_shape": [2], "models": ["f"], "latent_dim": 2, "encoder": "mlp",
           "encoder_hidden": [4], "optimizer": {"name": "sgd", "lr": 0.1, "weight_decay": 0.0}}
    with pytest.raises(PolicyViolation, match="'require_label_dp'"):
        runtime.handle(Request("setup", {}, {"program": "splitnn/party", "config": cfg, "seed": 0, "fit": True}))
    # a setup that does not say it is a protected fit (e.g. to predict) is built, but trains nothing
    runtime.handle(Request("setup", {}, {"program": "splitnn/party", "config": cfg, "seed": 0}))
    rows = {"rows:f": torch.arange(4)}
    assert runtime.handle(Request("embed", rows, {"data": "train"})).tensors["emb:f"].shape == (4, 2)
    runtime.handle(Request("embed", rows, {"data": "train", "train": True}))
    with pytest.raises(PolicyViolation, match="'require_label_dp': 'grad_embedding' trains"):
        runtime.handle(Request("grad_embedding", {"grad:f": torch.zeros(4, 2)}, {}))
    runtime.handle(Request("setup", {}, {"program": "splitnn/party", "config": cfg, "seed": 0, "fit": True,
                                         "label_dp": 1.0}))
    runtime.handle(Request("embed", rows, {"data": "train", "train": True}))
    runtime.handle(Request("grad_embedding", {"grad:f": torch.zeros(4, 2)}, {}))


# ---------------------------------------------------------------------- real party processes
def _data(n: int = 60, seed: int = 3) -> VerticalDataset:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    blocks = [rng.normal(size=(n, d)) + y[:, None] for d in (3, 4)]
    return VerticalDataset(blocks, np.ones((n, 2), bool), ids=[f"u{i:03d}" for i in range(n)], y=y,
                           task=Task.classification([0, 1]), active_party=0, party_names=["insurer", "shop"])


@pytest.fixture(scope="module")
def dep(tmp_path_factory: pytest.TempPathFactory) -> Any:
    d = LocalDeployment(tmp_path_factory.mktemp("labels"), _data(), deadline=PATIENCE, start_timeout=600.0)
    d.policy[0] = {"preset": "research", "require_label_dp": 1}  # the label holder's own party.toml
    try:
        d.start()
        yield d
    finally:
        d.close()


@pytest.mark.slow
def test_the_label_holders_party_refuses_a_fit_without_label_dp_naming_the_key(dep: LocalDeployment,
                                                                              tmp_path: Path) -> None:
    lines: list[str] = []
    fed = dep.federation(connect=False)
    try:
        with pytest.raises(Exception) as e:
            run_fit(get_method("vanilla-vfl")("fast", seed=0, **SMALL), fed, FitOptions(), notify=lines.append)
    finally:
        fed.close()
    assert lines[0].startswith("labels: not protected: vanilla-vfl sends the passive parties gradients")
    assert type(e.value).__name__ == "SetupRefused"
    assert "party 0 ('insurer'): policy rule 'require_label_dp': this party takes part only in fits whose labels " \
           "are protected by label DP at epsilon at most 1; this fit has no label DP" in str(e.value)
    setups = [x for x in read_access_log(dep.dir / "state" / "insurer" / "access.log") if x["kind"] == "setup"]
    assert setups[-1]["outcome"] == "refused" and "'require_label_dp'" in setups[-1]["reason"]

    # with --label-dp 1 the fit runs, and the protected model predicts (a setup that does not train)
    model = tmp_path / "model"
    fit = ["fit", "--federation", str(dep.federation_file), "--method", "vanilla-vfl", "--seed", "1", "--out",
           str(model), "--quiet", *[a for k, v in SMALL.items() for a in ("--param", f"{k}={v}")]]
    assert main([*fit, "--label-dp", "1"]) == 0
    ids = tmp_path / "ids.txt"
    ids.write_text("u001\nu002\n")
    assert main(["predict", "--federation", str(dep.federation_file), "--model", str(model), "--ids", str(ids),
                 "--out", str(tmp_path / "pred.csv")]) == 0


@pytest.mark.slow
def test_the_exposure_line_and_the_refusal_on_the_command_line(dep: LocalDeployment, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    fit = ["fit", "--federation", str(dep.federation_file), "--method", "vanilla-vfl", "--seed", "2", "--out",
           str(tmp_path / "m"), "--quiet", *[a for k, v in SMALL.items() for a in ("--param", f"{k}={v}")]]
    assert main(fit) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("labels: not protected: vanilla-vfl sends the passive parties gradients")
    assert any("policy rule 'require_label_dp'" in line for line in err)
    assert "Traceback" not in "\n".join(err)
