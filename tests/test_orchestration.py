"""The library's orchestration (``partialvfl.orchestration``) without the command line: options, a stop request, a
federated fit that survives a party killed and restarted mid-fit, prediction with whichever parties answer.

Faults are injected at exact points (an epoch's end, the n-th prediction request), never by timing; every wait has
a generous deadline.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from helpers import PATIENCE
from partialvfl import VerticalDataset
from partialvfl.federation.grpc.local import LocalDeployment
from partialvfl.federation.runtime.checkpoint import LATEST, FitInterrupted
from partialvfl.federation.wire.transport import PartyUnavailable
from partialvfl.methods import VFLMethod, get_method
from partialvfl.orchestration import (
    FitOptions,
    PredictOptions,
    PriorOnlyRows,
    StopRequest,
    make_checkpointer,
    run_fit,
    run_predict,
    stop_on_signals,
)
from test_party_failure import FIT, assert_same, binary_three_party_data, model_state, started_deployment

SEED = 3


def method() -> Any:
    return get_method("vanilla-vfl")("fast", seed=SEED, **FIT)


def coordinator_state(model: Any) -> dict[str, Any]:
    return model._coordinator_state()


def party_states(model: Any) -> list[dict[str, torch.Tensor]]:
    return [rt.program.state_dict() for rt in model.federation_.runtimes]


# ---------------------------------------------------------------------- options
@pytest.mark.parametrize(("kwargs", "match"), [
    ({"checkpoint_every": -1}, "checkpoint_every must be"),
    ({"resume": True}, "need checkpoint_dir"),
    ({"checkpoint_every": 5}, "need checkpoint_dir"),
    ({"party_timeout": -1.0}, "party_timeout must be"),
    ({"party_retries": -1}, "party_retries must be"),
    ({"threads": "many"}, "threads must be a positive integer or 'auto'"),
])
def test_fit_options_refuse_bad_values_when_made(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        FitOptions(**kwargs)


def test_predict_options_refuse_an_empty_chunk() -> None:
    with pytest.raises(ValueError, match="chunk must be"):
        PredictOptions(chunk=0)


def test_a_directory_holding_a_checkpoint_needs_resume(tmp_path: Path) -> None:
    (tmp_path / LATEST).write_text("{}")
    with pytest.raises(ValueError, match="holds a checkpoint of an earlier run: pass resume=True"):
        make_checkpointer(FitOptions(checkpoint_dir=tmp_path))
    assert make_checkpointer(FitOptions(checkpoint_dir=tmp_path, resume=True)) is not None
    assert make_checkpointer(FitOptions(checkpoint_dir=tmp_path / "new")) is None  # nothing asks for one
    with pytest.raises(ValueError, match="a stop request needs FitOptions.checkpoint_dir"):
        make_checkpointer(FitOptions(), StopRequest())


# ---------------------------------------------------------------------- in process
@pytest.fixture(scope="module")
def data() -> VerticalDataset:
    return binary_three_party_data()


def test_run_fit_in_process_is_the_methods_own_fit(data: VerticalDataset, tmp_path: Path) -> None:
    plain = method().fit(data)
    result = run_fit(method(), data, FitOptions(checkpoint_dir=tmp_path, checkpoint_every=4))
    assert result.saved_steps == (4, 8, 12) and result.resumed_step is None and result.party_failures == 0
    assert result.threads == 1  # a tiny step: one thread
    assert_same(coordinator_state(result.model), coordinator_state(plain))
    assert_same(party_states(result.model), party_states(plain))


def test_a_stop_request_checkpoints_and_a_resume_ends_as_uninterrupted(data: VerticalDataset, tmp_path: Path) -> None:
    stop = StopRequest()

    def on_epoch(stage: str, epoch: int, metrics: dict[str, float]) -> None:
        if epoch == 1:
            stop.request()

    options = FitOptions(checkpoint_dir=tmp_path)  # no interval: the checkpoint is taken because of the stop
    with pytest.raises(FitInterrupted) as stopped:
        run_fit(method(), data, options, stop=stop, on_epoch=on_epoch)
    assert stopped.value.step == 6 and stopped.value.signum is None  # the first step after epoch 1's 5
    with pytest.raises(ValueError, match="resume=True"):
        run_fit(method(), data, options)
    resumed = run_fit(method(), data, FitOptions(checkpoint_dir=tmp_path, resume=True))
    assert resumed.resumed_step == 6
    plain = method().fit(data)
    assert_same(coordinator_state(resumed.model), coordinator_state(plain))
    assert_same(party_states(resumed.model), party_states(plain))


def test_stop_on_signals_turns_sigint_into_a_stop_request_and_puts_the_handlers_back() -> None:
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with stop_on_signals() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested and stop.signum == signal.SIGINT
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # a second one stops at once
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_run_predict_in_process_names_the_parties_each_row_used(data: VerticalDataset) -> None:
    model = method().fit(data)
    pred = run_predict(model, data)
    np.testing.assert_array_equal(pred.output, model.predict_output(data))  # all at once: the model's own call
    np.testing.assert_array_equal(pred.parties, data.observed)
    assert list(pred.ids) == list(data.ids) and pred.party_names == ("bank", "shop", "telco") and not pred.failed
    chunked = run_predict(model, data, PredictOptions(chunk=7))  # other batch shapes: float rounding only
    np.testing.assert_allclose(chunked.output, pred.output, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(chunked.parties, data.observed)

    obs = data.observed.copy()
    obs[3] = False  # nobody holds row 3: its prediction would be the label prior alone
    blocks = [np.where(obs[:, [k]], b, np.nan) for k, b in enumerate(data.blocks)]
    nobody = VerticalDataset(blocks, obs, ids=data.ids, y=data.y, labeled=data.labeled, task=data.task,
                             active_party=0, party_names=data.party_names)
    with pytest.raises(PriorOnlyRows, match="1 of 60 IDs \\(first: 'c003'\\) are held by no party"):
        run_predict(model, nobody)
    pred = run_predict(model, nobody, PredictOptions(allow_prior_only=True))
    assert list(np.flatnonzero(pred.prior_only)) == [3]
    np.testing.assert_allclose(pred.output[3], model.label_prior_)


# ---------------------------------------------------------------------- across party processes
@pytest.fixture(scope="module")
def dep(tmp_path_factory, data):
    yield from started_deployment(tmp_path_factory.mktemp("orchestration"), data)


@pytest.fixture(scope="module")
def uninterrupted(dep, tmp_path_factory) -> Path:
    """A saved model of an uninterrupted federated fit."""
    out = tmp_path_factory.mktemp("uninterrupted") / "model"
    fed = dep.federation(connect=False)
    try:
        result = run_fit(method(), fed, FitOptions(), data_info={"source": "test"})
        assert result.party_failures == 0 and result.model.data_info_["source"] == "test"
        # the parties keep the alignment nonces under the fit's seed (a resumed fit gets the same sample order),
        # and the model records the session's salt (fit --table --order-of reproduces the order from it)
        assert fed.alignment_id == f"fit seed {SEED}"
        alignment = result.model.data_info_["alignment"]
        assert alignment["mode"] == "psu" and alignment["salt"] == fed.aligner.salt
        result.model.save(out)
    finally:
        fed.close()
    return out


def _running(dep: LocalDeployment, k: int) -> bool:
    return k in dep.procs and dep.procs[k].poll() is None


@pytest.mark.slow
def test_a_federated_fit_survives_a_party_killed_and_restarted_mid_fit(dep, uninterrupted, tmp_path) -> None:
    """Party 2 is killed at the end of epoch 2 (after the checkpoint of step 10); the fit notices, waits, and the
    party process is started again while it waits; the fit ends with the uninterrupted fit's parameters."""
    killed, lines, restarts = [], [], []

    def on_epoch(stage: str, epoch: int, metrics: dict[str, float]) -> None:
        if epoch == 2 and not killed:
            dep.kill(2, signal.SIGKILL)
            killed.append(epoch)

    def notify(line: str) -> None:
        lines.append(line)
        if "did not answer" in line:  # the fit waits for the party now: it comes back meanwhile
            restarts.append(threading.Thread(target=dep.start, args=([2],)))
            restarts[-1].start()

    fed = dep.federation(connect=False)
    options = FitOptions(checkpoint_dir=tmp_path / "model" / "checkpoints", checkpoint_every=5, party_timeout=PATIENCE)
    try:
        result = run_fit(method(), fed, options, on_epoch=on_epoch, notify=notify)
        result.model.save(tmp_path / "model")
    finally:
        fed.close()
        for t in restarts:
            t.join(timeout=PATIENCE)
        if not _running(dep, 2):
            dep.start([2])
    assert killed == [2] and len(restarts) == 1
    assert result.party_failures == 1 and result.resumed_step == 10 and result.saved_steps == (5, 10, 15)
    assert lines.pop(0).startswith("labels: not protected: vanilla-vfl")  # the fit's first line (issue 35)
    assert lines[0].startswith("party 2 ('telco') did not answer")
    assert lines[1] == "every party answers again: continuing from the checkpoint after step 10"
    assert_same(model_state(dep, tmp_path / "model"), model_state(dep, uninterrupted))


@pytest.mark.slow
def test_without_party_timeout_a_lost_party_stops_the_fit(dep, tmp_path) -> None:
    def on_epoch(stage: str, epoch: int, metrics: dict[str, float]) -> None:
        if epoch == 1:
            dep.kill(1, signal.SIGKILL)

    fed = dep.federation(connect=False)
    try:
        with pytest.raises(PartyUnavailable) as lost:
            run_fit(method(), fed, FitOptions(checkpoint_dir=tmp_path, checkpoint_every=5), on_epoch=on_epoch)
    finally:
        fed.close()
        dep.start([1])
    assert lost.value.party == 1 and lost.value.step == 6


@pytest.mark.slow
def test_run_predict_drops_a_party_lost_mid_prediction_from_the_rows_after_it(dep, data, uninterrupted
                                                                               ) -> None:
    """Party 1 is killed while the second chunk of 20 rows is predicted: that chunk is predicted again without it,
    the first chunk keeps it, and the prediction says so row by row."""
    fed = dep.federation(allow_absent=True)
    try:
        model = VFLMethod.load(uninterrupted, federation=fed)
        calls = {"n": 0}
        predict = model.predict_output_federated

        def predict_and_lose(view: Any, handle: str, **kwargs: Any) -> Any:
            calls["n"] += 1
            if calls["n"] == 2:
                dep.kill(1)
            return predict(view, handle, **kwargs)

        model.predict_output_federated = predict_and_lose
        pred = run_predict(model, list(data.ids), PredictOptions(chunk=20))
    finally:
        fed.close()
        dep.start([1])
    without = data.observed.copy()
    without[:, 1] = False
    np.testing.assert_array_equal(pred.held, data.observed)
    np.testing.assert_array_equal(pred.parties, np.concatenate([data.observed[:20], without[20:]]))
    assert pred.failed == (1,) and pred.absent == ()
    assert list(pred.ids) == list(data.ids) and pred.output.shape == (60, 2)
