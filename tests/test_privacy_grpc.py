"""A party's own differential-privacy budget behind a real ``party serve`` process (issue 25): set in its
``party.toml`` ([policy] dp_epsilon, dp_delta), told to the coordinator in ``hello``, enforced by the party whatever
the coordinator sends (PERMISSION_DENIED naming the budget once it is spent), recorded in its access log, kept on its
disk across a restart, and printed with ``fit --federation``; label DP from the federation file's ``[labels]``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from partialvfl import Task, VerticalDataset
from partialvfl.cli import main
from partialvfl.federation.grpc.local import LocalDeployment
from partialvfl.federation.grpc.transport import PartyError
from partialvfl.federation.runtime.coordinator import SetupRefused
from partialvfl.federation.trust.access_log import read_access_log
from partialvfl.methods import get_method

BUDGET = {"preset": "research", "dp_epsilon": 4.0, "dp_delta": 1e-5}


def two_party_half_labeled_data(n: int = 120) -> VerticalDataset:
    """Two fully observed float32 parties (widths 3, 4), a linear binary label, every second row labelled."""
    rng = np.random.default_rng(0)
    blocks = [rng.normal(size=(n, 3)).astype(np.float32), rng.normal(size=(n, 4)).astype(np.float32)]
    y = (blocks[0][:, 0] + blocks[1][:, 0] > 0).astype(np.int64)
    return VerticalDataset(blocks, np.ones((n, 2), bool), ids=[f"u{i:03d}" for i in range(n)], y=y,
                           labeled=np.arange(n) % 2 == 0, task=Task.classification([0, 1]), active_party=0,
                           party_names=["bank", "shop"])


@pytest.fixture(scope="module")
def dep(tmp_path_factory):
    d = LocalDeployment(tmp_path_factory.mktemp("dp"), two_party_half_labeled_data(), deadline=600.0,
                        start_timeout=600.0)
    d.policy[1] = dict(BUDGET)
    try:
        d.start()
        yield d
    finally:
        d.close()


@pytest.mark.slow
def test_a_deployed_partys_budget_is_kept_logged_and_refused_beyond(dep, capsys, tmp_path) -> None:
    torch.set_num_threads(1)
    fed = dep.federation()
    try:
        assert fed.private_parties() == {1: {"epsilon": 4.0, "delta": 1e-5}}  # said in its hello
        view, handle = fed.align(handle="train")
        model = get_method("laser-vfl")("fast", seed=0, epochs=3, dp_predictions=1)
        model.fit_federated(fed, view, handle)
        spent = model.privacy_["parties"]["shop"]
        assert 0 < spent["epsilon_spent"] <= 4.0 and spent["rows_charged"] == int(view.labeled.sum())
        rows = np.flatnonzero(view.labeled)
        refused = None
        for _ in range(3):  # the plan kept one release per row after the fit: the second is refused
            try:
                fed.transport.new_step()
                fed.call(1, "embed", {"rows:f": torch.as_tensor(rows)}, data=handle)
            except PartyError as e:
                refused = e
                break
        assert refused is not None and refused.code.name == "PERMISSION_DENIED"
        assert "policy rule 'dp_epsilon'" in refused.details and "budget (epsilon 4, delta 1e-05 per row) is spent" \
            in refused.details
    finally:
        fed.close()
    log = read_access_log(dep.dir / "state" / "shop" / "access.log")
    spent_log = [e["dp_epsilon_spent"] for e in log if e.get("kind") == "embed" and e["outcome"] == "served"]
    assert spent_log and spent_log == sorted(spent_log) and spent_log[-1] == pytest.approx(4.0, rel=1e-6)
    assert any(e["outcome"] == "refused" and "dp_epsilon" in e.get("reason", "") for e in log)

    dep.kill(1)
    dep.start([1])  # restarted: its ledger is on its own disk, the budget stays spent
    out = tmp_path / "model"
    argv = ["fit", "--federation", str(dep.federation_file), "--method", "laser-vfl", "--epochs", "2", "--out",
            str(out), "--quiet"]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 3 and "refused to set up 'splitnn/party'" in err and "budget" in err and "is spent" in err


@pytest.mark.slow
def test_fit_federation_prints_what_each_mechanism_spent(tmp_path, capsys) -> None:
    torch.set_num_threads(1)
    with LocalDeployment(tmp_path / "dep", two_party_half_labeled_data(), deadline=600.0, start_timeout=600.0) as d:
        d.policy[1] = dict(BUDGET)
        d.start()
        text = Path(d.federation_file).read_text()
        Path(d.federation_file).write_text(text.replace("[labels]\n", "[labels]\nlabel_dp = 2.0\n", 1))
        out = tmp_path / "model"
        assert main(["fit", "--federation", str(d.federation_file), "--method", "vanilla-vfl", "--epochs", "2",
                     "--out", str(out), "--quiet"]) == 0
        err = capsys.readouterr().err
        assert "label DP: epsilon 2 (randomized response" in err
        assert "party 'shop': differential-privacy budget epsilon 4, delta 1e-05 per row; spent epsilon" in err
        assert (out / "checkpoints" / "label-dp-seed").exists()  # the coordinator's secret, for --resume
        assert (d.dir / "state" / "shop" / "privacy-ledger.npz").exists()
        # FALSE-VFL-I over the wire: the party calibrates to what is left of its budget, and stays within it
        assert main(["fit", "--federation", str(d.federation_file), "--method", "false-vfl-1", "--epochs", "1",
                     "--out", str(tmp_path / "false"), "--quiet"]) == 0
        err = capsys.readouterr().err
        spent = float(err.split("spent epsilon ")[1].split(" ")[0])
        assert 0 < spent <= 4.0
        with pytest.raises(SetupRefused, match="x-vfl/party' cannot keep a differential-privacy budget"):
            fed = d.federation()
            try:
                view, handle = fed.align(handle="t")
                fed.setup("x-vfl/party", [{}, {}], 0)
            finally:
                fed.close()
