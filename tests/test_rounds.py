"""Round trips of training: the next step's representations ride with this step's gradients (``rounds =
"piggyback"``, the default of the split-network methods) and the weights are those of two round trips per step
(``"sequential"``) to the bit; the opt-in ``"stale"`` schedule takes several steps per round trip; the training
loop's look ahead keeps every draw, checkpoint and resume as they were; the delay proxy closes cleanly."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest
import torch

from helpers import PATIENCE, tiny_test, tiny_train
from partialvfl import VerticalDataset
from partialvfl.federation import MessageLog
from partialvfl.federation.runtime.checkpoint import Checkpointer
from partialvfl.methods.base import get_method

SPLIT = ("laser-vfl", "vanilla-vfl", "plug-vfl", "local", "ensemble", "combinatorial")
#: small fits with several epochs (an epoch's end is crossed by the look ahead), a cosine schedule (a round between
#: epochs) and PlugVFL's per-sample dropout (a step's own draws, made ahead with its batch)
PARAMS = {"latent_dim": 4, "encoder_hidden": [8], "epochs": 3, "batch_size": 8, "lr_schedule": "cosine"}


@pytest.fixture(scope="module")
def train() -> VerticalDataset:
    return tiny_train()


def fit(name: str, data: VerticalDataset, **params: Any) -> tuple[Any, MessageLog]:
    log = MessageLog()
    extra = {"dropout_unit": "sample"} if name == "plug-vfl" else {}
    model = get_method(name)("fast", seed=3, **{**PARAMS, **extra, **params}).fit(data, log=log)
    return model, log


def states(model: Any) -> list[dict[str, torch.Tensor]]:
    """Every party's models and optimisers, and the heads, as flat name -> tensor maps."""
    out = [{f"heads.{k}": v for k, v in model.heads_.state_dict().items()}]
    for rt in model.federation_.runtimes:
        st = rt.program.state_dict()
        flat = {f"{m}.{k}": v for m, sd in st["models"].items() for k, v in sd.items()}
        for m, opt in st["optimizers"].items():
            for i, s in opt["state"].items():
                flat.update({f"opt.{m}.{i}.{k}": v for k, v in s.items() if isinstance(v, torch.Tensor)})
        out.append(flat)
    return out


def assert_identical(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> None:
    assert [sorted(x) for x in a] == [sorted(x) for x in b]
    for x, y in zip(a, b):
        for key in x:
            assert torch.equal(x[key], y[key]), key


@pytest.mark.parametrize("name", SPLIT)
def test_piggybacked_rounds_give_the_sequential_weights_in_about_one_round_trip_per_step(name: str, train) -> None:
    """Bit-identical parties and heads, half the round trips (plus one per epoch for the cosine schedule's set_lr and
    one to start the stage)."""
    sequential, slog = fit(name, train, rounds="sequential")
    piggyback, plog = fit(name, train)
    assert piggyback.settings_.rounds == "piggyback"
    assert_identical(states(piggyback), states(sequential))
    steps = len({e.step for e in slog if e.kind == "grad_embedding"})
    assert steps > 6
    assert slog.round_trips() == 2 * steps + PARAMS["epochs"] + 2  # + set_lr per epoch, setup, preprocess
    assert plog.round_trips() == steps + 1 + PARAMS["epochs"] + 2
    forward = {(e.step, e.round) for e in plog if e.direction == "request"
               and (e.kind == "embed" or any(n.startswith("next:") for n in e.names))}
    backward = {(e.step, e.round) for e in plog if e.kind == "grad_embedding"}
    assert len(forward) == steps and len(forward - backward) == 1  # only the stage's first step has its own round


def test_a_resumed_piggybacked_fit_equals_an_uninterrupted_one(train, tmp_path) -> None:
    """A checkpoint after every step (the look ahead has drawn the next batch, across an epoch's end too): a fit
    resumed from any of them ends in the uninterrupted fit's weights."""
    ref, _ = fit("plug-vfl", train)

    class Crash(Exception):
        pass

    class CrashAt(Checkpointer):
        def __init__(self, directory: Any, crash_at: int) -> None:
            super().__init__(directory, every=1)
            self.crash_at = crash_at

        def after_step(self, step: int, state: Any) -> None:
            super().after_step(step, state)
            if step == self.crash_at:
                raise Crash

    steps_per_epoch = len({e.step for e in fit("plug-vfl", train, epochs=1)[1] if e.kind == "grad_embedding"})
    for crash_at in (steps_per_epoch, steps_per_epoch + 2):  # an epoch's last step, then one inside an epoch
        directory = tmp_path / f"ck-{crash_at}"
        with pytest.raises(Crash):
            get_method("plug-vfl")("fast", seed=3, **PARAMS, dropout_unit="sample").fit(
                train, checkpointer=CrashAt(directory, crash_at))
        resumed = get_method("plug-vfl")("fast", seed=3, **PARAMS, dropout_unit="sample").fit(
            train, checkpointer=Checkpointer(directory, every=1))
        assert resumed.resumed_step_ == crash_at
        assert_identical(states(resumed), states(ref))


def _images(n: int = 40, seed: int = 0) -> VerticalDataset:
    """Three parties of 1 x 4 x 4 image pieces (resnet18 encoders: batch normalisation), all labelled."""
    from partialvfl import Task

    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    blocks = [rng.normal(size=(n, 16)) + y[:, None] for _ in range(3)]
    return VerticalDataset(blocks, np.ones((n, 3), bool), ids=[f"i{i}" for i in range(n)], y=y,
                           labeled=np.ones(n, bool), task=Task.classification(["a", "b"]), active_party=0,
                           feature_shapes=[(1, 4, 4)] * 3)


def test_a_checkpoint_while_a_ridden_forward_is_pending_keeps_the_buffers_before_it(tmp_path) -> None:
    """Batch normalisation: a training forward changes the running statistics.  A checkpoint taken after a step
    whose message carried the next step's forward saves the buffers before that forward, so the resumed fit (which
    runs it again) ends as the uninterrupted one."""
    data = _images()
    params = {"latent_dim": 4, "encoder": "resnet18", "resnet_width": 4, "epochs": 2, "batch_size": 8}
    ref = get_method("vanilla-vfl")("fast", seed=3, **params).fit(data)

    class Crash(Exception):
        pass

    class CrashAt(Checkpointer):
        def after_step(self, step: int, state: Any) -> None:
            super().after_step(step, state)
            if step == 3:
                raise Crash

    with pytest.raises(Crash):
        get_method("vanilla-vfl")("fast", seed=3, **params).fit(data, checkpointer=CrashAt(tmp_path, every=1))
    resumed = get_method("vanilla-vfl")("fast", seed=3, **params).fit(data, checkpointer=Checkpointer(tmp_path,
                                                                                                      every=1))
    assert resumed.resumed_step_ == 3
    assert any("running_mean" in k for k in states(ref)[1])
    assert_identical(states(resumed), states(ref))


@pytest.mark.parametrize("name", ["laser-vfl", "plug-vfl"])
def test_the_stale_schedule_takes_stale_steps_per_round_trip(name: str, train) -> None:
    exact, elog = fit(name, train)
    stale, slog = fit(name, train, rounds="stale", stale_steps=3)
    steps = len({e.step for e in elog if e.kind == "grad_embedding"})
    groups = len({e.step for e in slog if e.kind == "grad_embedding"})
    assert groups == pytest.approx(steps / 3, abs=PARAMS["epochs"])  # each epoch's last group may be shorter
    assert slog.round_trips() == groups + 1 + PARAMS["epochs"] + 2  # one per group, + the first's, set_lr...
    sections = [e for e in slog if e.kind == "grad_embedding" and any(n.startswith("sections:") for n in e.names)]
    assert sections
    assert np.isfinite(stale.predict_proba(tiny_test())).all()
    assert not all(torch.equal(a, b) for a, b in zip(states(stale)[1].values(), states(exact)[1].values()))


def test_the_stale_schedule_is_refused_under_a_party_budget(train) -> None:
    with pytest.raises(ValueError, match="stale"):
        get_method("laser-vfl")("fast", seed=3, **PARAMS, rounds="stale").fit(train, party_dp={0: (8.0, 1e-5)})


@pytest.mark.slow
def test_piggybacked_rounds_over_grpc_give_the_sequential_predictions(tiny_deployment, train) -> None:
    """Real party processes: the same predictions as two round trips per step, about half the round trips."""
    out = {}
    for rounds in ("sequential", "piggyback"):
        log = MessageLog()
        fed = tiny_deployment.federation(log=log)
        try:
            model = get_method("laser-vfl")("fast", seed=3, **PARAMS, rounds=rounds).fit(train, federation=fed)
            steps = len({e.step for e in log if e.kind == "grad_embedding"})
            out[rounds] = (model.predict_proba(tiny_test()), log.round_trips(), steps)
        finally:
            fed.close()
    np.testing.assert_array_equal(out["piggyback"][0], out["sequential"][0])
    steps = out["sequential"][2]
    assert steps > 6 and out["piggyback"][2] == steps
    assert out["sequential"][1] - out["piggyback"][1] == steps - 1  # every step's embed round but the first


def test_the_delay_proxy_closes_without_leaving_tasks_behind() -> None:
    """A connection with bytes still held back when the proxy closes: no "Task was destroyed but it is pending!",
    no "Event loop is closed" at exit."""
    script = textwrap.dedent("""
        import gc, socket, threading, time
        from partialvfl.federation.grpc.delay_proxy import DelayProxy
        server = socket.socket()
        server.bind(("127.0.0.1", 0))
        server.listen()
        threading.Thread(target=lambda: [server.accept() for _ in range(2)], daemon=True).start()
        with DelayProxy("127.0.0.1:%d" % server.getsockname()[1], delay=0.5) as proxy:
            client = socket.create_connection(("127.0.0.1", proxy.port))
            client.sendall(b"held back")
            time.sleep(0.05)
        del proxy
        gc.collect()
        print("closed")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=PATIENCE)
    assert done.returncode == 0 and "closed" in done.stdout, done.stderr
    assert "Task was destroyed" not in done.stderr and "Event loop is closed" not in done.stderr, done.stderr
