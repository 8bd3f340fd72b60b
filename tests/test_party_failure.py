"""A fit that cannot finish: a party killed (SIGKILL) mid-fit, SIGTERM/SIGINT to the fit, a party lost while
predicting.  Real party processes with their default policy (seed pinned in their files, so runs compare).

Faults are injected at exact points (right after a given checkpoint, in the waiting loop, at a given step), never
by timing; every call has a generous deadline.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch

from helpers import PATIENCE
from partialvfl import Task, VerticalDataset
from partialvfl.cli import main
from partialvfl.federation.grpc.federation import GrpcFederation
from partialvfl.federation.grpc.local import LocalDeployment
from partialvfl.federation.runtime.checkpoint import Checkpointer, PartyLost

FIT = {"latent_dim": 4, "encoder_hidden": [8], "epochs": 3, "batch_size": 8}  # 3 epochs x 5 steps


def binary_three_party_data(n: int = 60, seed: int = 1) -> VerticalDataset:
    """Three parties (widths 3, 4, 2), two classes, all held but party 1 for the last rows from 45; the first 40 rows
    labelled, party 0 holds the labels."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    dims = (3, 4, 2)
    blocks = [rng.normal(size=(n, d)) + y[:, None] for d in dims]
    obs = np.ones((n, 3), bool)
    obs[45:, 1] = False  # some users only two parties hold
    for k, b in enumerate(blocks):
        b[~obs[:, k]] = np.nan
    return VerticalDataset(blocks, obs, ids=[f"c{i:03d}" for i in range(n)], y=y, labeled=np.arange(n) < 40,
                           task=Task.classification(["no", "yes"]), active_party=0,
                           party_names=["bank", "shop", "telco"])


@pytest.fixture(scope="module")
def data() -> VerticalDataset:
    return binary_three_party_data()


def started_deployment(directory: Path, data: VerticalDataset) -> Iterator[LocalDeployment]:
    """Party processes for ``data`` in ``directory`` (their seed pinned, and a fit of the same seed aligned in the same
    order, so that separate fits can be compared), running until the generator closes."""
    d = LocalDeployment(directory, data, deadline=PATIENCE, start_timeout=600.0,
                        policy={"seed": 17, "resume_alignment_by_name": True})
    try:
        d.start()
        yield d
    finally:
        d.close()


@pytest.fixture(scope="module")
def dep(tmp_path_factory, data):
    yield from started_deployment(tmp_path_factory.mktemp("faults"), data)


def fit_argv(dep: LocalDeployment, out: Path, *extra: str) -> list[str]:
    params = [a for k, v in FIT.items() for a in ("--param", f"{k}={json.dumps(v)}")]
    return ["fit", "--federation", str(dep.federation_file), "--method", "vanilla-vfl", "--seed", "3", "--out",
            str(out), "--quiet", *params, *extra]


def model_state(dep: LocalDeployment, out: Path) -> dict[str, Any]:
    """The coordinator's and every party's saved state of the model in ``out``."""
    party_dir = json.loads((out / "party_states.json").read_text())["party_dir"]
    state = {"coordinator": torch.load(out / "coordinator.pt", weights_only=True)}
    for k, name in enumerate(dep.names):
        state[name] = torch.load(dep.dir / "state" / name / party_dir / f"party-{k}.pt", weights_only=True)["state"]
    return state


def assert_same(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=where)
    else:
        assert a == b, where


@pytest.fixture(scope="module")
def reference(dep, tmp_path_factory) -> dict[str, Any]:
    """An uninterrupted fit's final state."""
    out = tmp_path_factory.mktemp("ref") / "model"
    assert main(fit_argv(dep, out)) == 0
    return model_state(dep, out)


def kill_after_checkpoint(monkeypatch, dep: LocalDeployment, party: int, step: int) -> list[int]:
    """SIGKILL party ``party`` right after the checkpoint of ``step`` is complete (once)."""
    killed: list[int] = []
    original = Checkpointer.save

    def save(self: Checkpointer, at: int, state: dict[str, Any]) -> Path:
        d = original(self, at, state)
        if at == step and not killed:
            dep.kill(party, signal.SIGKILL)
            killed.append(at)
        return d

    monkeypatch.setattr(Checkpointer, "save", save)
    return killed


def record_restores(monkeypatch) -> list[int | None]:
    """The steps of the checkpoints fits restored (a fit without a checkpoint to resume restores none)."""
    restored: list[int | None] = []
    original = Checkpointer.restore

    def restore(self: Checkpointer) -> Any:
        ckpt = original(self)
        restored.append(None if ckpt is None else ckpt.step)
        return ckpt

    monkeypatch.setattr(Checkpointer, "restore", restore)
    return restored


@pytest.mark.slow
def test_killed_party_stops_the_fit_and_the_printed_resume_ends_where_an_uninterrupted_fit_ends(
        dep, reference, tmp_path, monkeypatch, capsys) -> None:
    out = tmp_path / "model"
    killed = kill_after_checkpoint(monkeypatch, dep, party=1, step=5)
    try:
        assert main(fit_argv(dep, out, "--checkpoint-every", "5")) == 3
    finally:
        dep.start([1])  # the party comes back: same configuration, same state directory
    assert killed == [5]
    err = capsys.readouterr().err.strip().splitlines()
    line = err[-1]
    assert line.startswith("error: party 1 ('shop') did not answer") and "training step 6" in line, err
    assert "the last checkpoint is after step 5" in line and "resume with: partialvfl fit " in line, line
    assert not (out / "model.json").exists()  # no model: the fit did not finish
    assert json.loads((out / "checkpoints" / "LATEST").read_text())["step"] == 5
    command = shlex.split(line.split("resume with: ", 1)[1])
    assert command[0] == "partialvfl" and command[-1] == "--resume"
    monkeypatch.undo()
    restored = record_restores(monkeypatch)
    assert main(command[1:]) == 0  # the exact command printed
    assert restored == [5]
    assert_same(model_state(dep, out), reference)


@pytest.mark.slow
def test_with_party_timeout_the_fit_waits_for_the_restarted_party_and_ends_as_uninterrupted(
        dep, reference, tmp_path, monkeypatch, capsys) -> None:
    out = tmp_path / "model"
    killed = kill_after_checkpoint(monkeypatch, dep, party=2, step=10)
    waited: list[int] = []
    original = GrpcFederation.rejoin

    def rejoin(self: GrpcFederation, timeout: float, poll: float = 1.0) -> Any:
        if killed and not waited:  # the fit noticed the loss and waits: the party restarts now
            waited.append(1)
            dep.start([2])
        return original(self, timeout, poll=0.2)

    monkeypatch.setattr(GrpcFederation, "rejoin", rejoin)
    # a party that cannot continue its session (restarted without it on disk: tests/test_party_resume.py has the
    # one that can): every party says hello again and the fit goes on from the last checkpoint
    monkeypatch.setattr(GrpcFederation, "continue_party", lambda *args, **kw: False)
    restored = record_restores(monkeypatch)
    assert main(fit_argv(dep, out, "--checkpoint-every", "5", "--party-timeout", str(PATIENCE))) == 0
    assert killed == [10] and waited == [1] and restored == [10]  # the first attempt had nothing to restore
    err = capsys.readouterr().err
    assert "party 2 ('telco') did not answer" in err and "continuing from the checkpoint after step 10" in err
    assert_same(model_state(dep, out), reference)
    # the restarted party's older checkpoint (step 5) was deleted on its disk too; the kept ones are there
    for name in dep.names:
        for step, kept in ((5, False), (10, True), (15, True)):
            assert _at_party(dep, name, out / "checkpoints" / f"step-{step:09d}") == kept, (name, step)


def _toy_setup(fed: GrpcFederation, data: VerticalDataset) -> None:
    fed.setup("splitnn/party", [{"feature_dim": d, "feature_shape": [d], "models": ["f"], "latent_dim": 4,
                                 "encoder": "mlp", "encoder_hidden": [8],
                                 "optimizer": {"name": "sgd", "lr": 0.1, "weight_decay": 0.0}}
                                for d in data.feature_dims], seed=0)


def _at_party(dep: LocalDeployment, name: str, step_dir: Path) -> bool:
    return (dep.dir / "state" / name / GrpcFederation.party_dir_for(step_dir)).is_dir()


@pytest.mark.slow
def test_a_checkpoint_a_party_could_not_save_is_removed_everywhere_once_the_party_is_back(dep, data,
                                                                                         tmp_path) -> None:
    """Party 1 is down when step 2 is checkpointed: the fit stops (PartyLost), step 1 stays the last checkpoint,
    the other parties delete their half of step 2 at once, and party 1 is asked again once it is back."""
    fed = dep.federation()
    ck = Checkpointer(tmp_path / "ck", fed, every=1, keep=1)
    try:
        _toy_setup(fed, data)
        ck.save(1, {})
        dep.kill(1)
        with pytest.raises(PartyLost, match="party 1 unavailable"):
            ck.save(2, {})
        assert ck.latest().step == 1
        incomplete = ck._step_dir(2)
        assert not (incomplete / "coordinator.pt").exists() and (incomplete / "party_states.json").exists()
        assert not _at_party(dep, "bank", incomplete) and not _at_party(dep, "telco", incomplete)
    finally:
        dep.start([1])
        fed.close()
    fed = dep.federation()
    try:
        _toy_setup(fed, data)
        ck = Checkpointer(tmp_path / "ck", fed, every=1, keep=1)
        ck.save(3, {})
        assert sorted(p.name for p in (tmp_path / "ck").glob("step-*")) == ["step-000000003"]
        for name in dep.names:
            assert not _at_party(dep, name, ck._step_dir(1)) and not _at_party(dep, name, incomplete)
            assert _at_party(dep, name, ck._step_dir(3))
    finally:
        fed.close()


SIGNAL_WRAPPER = """
import os, signal, sys
from partialvfl.federation.runtime import checkpoint
original = checkpoint.Checkpointer.maybe_save
def maybe_save(self, step, state):
    if step == int(os.environ["STOP_AT"]):
        os.kill(os.getpid(), signal.SIGTERM)
    return original(self, step, state)
checkpoint.Checkpointer.maybe_save = maybe_save
from partialvfl.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_sigterm_to_a_federated_fit_checkpoints_says_how_to_resume_and_exits_143(dep, reference, tmp_path,
                                                                                 monkeypatch) -> None:
    out = tmp_path / "model"
    env = {**dep.env(), "STOP_AT": "7"}
    done = subprocess.run([sys.executable, "-c", SIGNAL_WRAPPER, *fit_argv(dep, out)], env=env, capture_output=True,
                          text=True, timeout=1200)
    assert done.returncode == 143, done.stderr[-3000:]
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("stopped by SIGTERM after training step 7") and "resume with: partialvfl fit" in line
    assert json.loads((out / "checkpoints" / "LATEST").read_text())["step"] == 7
    assert not (out / "model.json").exists()
    restored = record_restores(monkeypatch)
    assert main(shlex.split(line.split("resume with: ", 1)[1])[1:]) == 0
    assert restored == [7]
    assert_same(model_state(dep, out), reference)


def test_sigint_to_an_in_process_fit_checkpoints_and_exits_130(tmp_path, monkeypatch, capsys) -> None:
    original = Checkpointer.maybe_save
    before = signal.getsignal(signal.SIGINT)  # Python's default, or SIG_IGN when pytest runs as a background job

    def maybe_save(self: Checkpointer, step: int, state: Any) -> bool:
        if step == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return original(self, step, state)

    monkeypatch.setattr(Checkpointer, "maybe_save", maybe_save)
    out = tmp_path / "model"
    argv = ["fit", "--dataset", "digits", "--parties", "4", "--labels", "200", "--aligned", "50", "--method",
            "vanilla-vfl", "--epochs", "1", "--max-train", "300", "--max-test", "50", "--out", str(out), "--quiet"]
    assert main(argv) == 130
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("stopped by SIGINT after training step 2") and line.endswith("--resume"), line
    assert json.loads((out / "checkpoints" / "LATEST").read_text())["step"] == 2
    monkeypatch.undo()
    assert signal.getsignal(signal.SIGINT) is before  # the handler was put back
    restored = record_restores(monkeypatch)
    assert main([*argv, "--resume"]) == 0
    assert restored == [2]


@pytest.mark.parametrize(("chunk", "kept"), [(None, 0), (20, 20)])
@pytest.mark.slow
def test_rows_predicted_after_a_party_was_lost_name_the_parties_actually_used(dep, data, tmp_path, monkeypatch,
                                                                             chunk, kept) -> None:
    """Party 1 crashes while rows are predicted: the whole request (default) or the chunk being predicted (chunks of
    20 rows) is predicted again without it; no row predicted after the loss claims it."""
    out = tmp_path / "model"
    assert main(fit_argv(dep, out)) == 0
    ids = tmp_path / "ids.csv"
    ids.write_text("id\n" + "\n".join(data.ids) + "\n")
    from partialvfl.orchestration import predict

    original = predict.predict_reporting_parties

    def losing_party(model: Any, fed: Any, view: Any, handle: str, chunk: int | None = None,
                     size: int | None = chunk, **kwargs: Any) -> Any:
        calls = {"n": 0}
        predict = model.predict_output_federated

        def predict_and_lose(v: Any, h: str, **inner: Any) -> Any:
            calls["n"] += 1
            if calls["n"] == (2 if size else 1):  # after the first 20 rows / before any row
                dep.kill(1)
            return predict(v, h, **inner)

        monkeypatch.setattr(model, "predict_output_federated", predict_and_lose)
        return original(model, fed, view, handle, chunk=size, **kwargs)

    monkeypatch.setattr(predict, "predict_reporting_parties", losing_party)
    try:
        pred_file = tmp_path / "pred.csv"
        assert main(["predict", "--federation", str(dep.federation_file), "--model", str(out), "--ids", str(ids),
                     "--out", str(pred_file)]) == 0
    finally:
        dep.start([1])
    pred = pd.read_csv(pred_file, dtype={"id": str}, keep_default_na=False)
    held = [";".join(n for k, n in enumerate(data.party_names) if data.observed[i, k]) for i in range(len(data.ids))]
    without = [";".join(n for n in h.split(";") if n != "shop") for h in held]
    assert list(pred["parties"]) == held[:kept] + without[kept:]
    assert list(pred["n_parties"]) == [len(p.split(";")) if p else 0 for p in pred["parties"]]
