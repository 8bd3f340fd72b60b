"""``partialvfl fit --federation ... --checkpoint-every N``, a SIGKILL of the coordinator mid-fit, then ``--resume``:
the parameters of an uninterrupted fit, for every method family (issue 11).

The coordinator runs in a process of its own (forked from the preloaded interpreter) whose
``Checkpointer.maybe_save`` kills the process right after the checkpoint of a given step, so the kill lands at a known
point whatever the machine's speed.  The party processes stay up across the coordinator's death and accept the next
coordinator's session.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers import make_data
from partialvfl.cli import main
from partialvfl.federation.grpc.launcher import forkserver_context, redirect_output
from partialvfl.federation.grpc.local import LocalDeployment
from partialvfl.federation.runtime.checkpoint import LATEST
from test_contract import TINY, assert_same, running_parties, saved_states


def _killed_after(kill_after: int, args: list[str], log: str) -> None:
    """A coordinator process that dies by SIGKILL right after the checkpoint of step ``kill_after`` of
    ``partialvfl ARGS`` (its output in ``log``)."""
    import os

    from partialvfl.federation.runtime.checkpoint import Checkpointer

    redirect_output(log)
    save = Checkpointer.maybe_save

    def maybe_save(self, step, state):
        saved = save(self, step, state)
        if saved and step == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
        return saved

    Checkpointer.maybe_save = maybe_save
    os._exit(main(args))


#: family -> (method, parameters, checkpoint interval, kills: (step, the stage that step belongs to)); every
#: ``--resume`` but the last is killed again
FAMILIES: dict[str, tuple[str, dict[str, Any], int, list[tuple[int, str]]]] = {
    # 6 stage-1 steps (3 per epoch), then 4 stage-2 steps: mid-epoch in stage 1, at an epoch's end in stage 2
    "false-vfl": ("false-vfl-2", TINY["false-vfl-2"], 2, [(4, "pretrain"), (8, "train")]),
    # 2 SimSiam steps (one per epoch), then 14 training steps: after SimSiam's first epoch, mid-training
    "split-nn with simsiam": ("laser-vfl", TINY["laser-vfl"], 1, [(1, "pretrain"), (12, "train")]),
    # 12 steps, fresh batches and PAGE corrections mixed: mid-epoch 2
    "x-vfl page": ("x-vfl", {**TINY["x-vfl"], "estimator": "page", "page_prob": 0.5, "epochs": 3, "batch_size": 8},
                   2, [(6, "train")]),
    # 12 pretraining steps (5 cross-party batches and the local step, per epoch), then 6 fine-tuning steps
    "fedhssl": ("fedhssl", TINY["fedhssl"], 3, [(9, "pretrain"), (12, "finetune")]),
}


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    with running_parties(tmp_path_factory.mktemp("kill"), make_data(48, seed=0, prefix="tr")) as dep:
        yield dep


def fit_args(deployment: LocalDeployment, method: str, params: dict[str, Any], out: Path) -> list[str]:
    pairs = [a for k, v in params.items() for a in ("--param", f"{k}={json.dumps(v)}")]
    return ["fit", "--federation", str(deployment.federation_file), "--method", method, "--seed", "5", "--out",
            str(out), *pairs]


def killed_run(kill_after: int, args: list[str], log: Path) -> tuple[int | None, str]:
    """``partialvfl ARGS`` in a coordinator process that SIGKILLs itself after the checkpoint of ``kill_after``: its
    exit status and output.  The process is forked from the suite's preloaded interpreter (conftest.py; the same code
    as a fresh ``python``, without its second of imports)."""
    process = forkserver_context().Process(target=_killed_after, args=(kill_after, args, str(log)))
    process.start()
    process.join(1800)
    if process.exitcode is None:
        process.kill()
        process.join(30)
    return process.exitcode, log.read_text() if log.exists() else ""


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.slow
def test_coordinator_killed_mid_fit_resumes_to_the_uninterrupted_parameters(family: str, deployment, tmp_path,
                                                                            capsys) -> None:
    method, params, every, kills = FAMILIES[family]
    straight = tmp_path / "uninterrupted"
    assert main([*fit_args(deployment, method, params, straight), "--quiet"]) == 0

    out = tmp_path / "killed"
    args = [*fit_args(deployment, method, params, out), "--checkpoint-every", str(every)]
    for i, (step, stage) in enumerate(kills):
        code, output = killed_run(step, [*args, "--resume"] if i else args, tmp_path / f"killed-{i}.log")
        assert code == -signal.SIGKILL, f"not killed after step {step}: exit {code}\n{output[-3000:]}"
        latest = json.loads((out / "checkpoints" / LATEST).read_text())
        assert latest["step"] == step
        saved = torch.load(out / "checkpoints" / latest["dir"] / "coordinator.pt", weights_only=True)
        assert saved["state"]["stage"] == stage, f"step {step} is in stage {saved['state']['stage']!r}"
        assert all(p.poll() is None for p in deployment.procs.values()), "a party died with the coordinator"

    capsys.readouterr()
    assert main([*args, "--resume"]) == 0  # a new coordinator: the parties accept its session
    err = capsys.readouterr().err
    assert f"resumed from the checkpoint after step {kills[-1][0]}" in err, err[-3000:]
    assert_same(saved_states(out, deployment), saved_states(straight, deployment))
