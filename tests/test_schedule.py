"""Schedules that follow the data (issue 28): ``min_steps``, the pinning rule, early stopping and its resume."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from helpers import tiny_test, tiny_train
from partialvfl import Task, VerticalDataset
from partialvfl.federation.runtime.checkpoint import Checkpointer
from partialvfl.methods.base import get_method
from partialvfl.methods.registry import method_names
from partialvfl.methods.schedule import (
    MIN_VALIDATION_ROWS,
    check_interval,
    floor_steps,
    resolve_min_steps,
    schedule_rows,
    supervised_epochs,
    validation_score,
)
from test_contract import (
    SEED,
    Crash,
    CrashingCheckpointer,
    StepCounter,
    assert_same,
    tiny,
)

METHODS = method_names()
#: early stopping forced on, with enough epochs that it stops before the end on the tiny data
STOPPING = {"epochs": 12, "early_stopping": "on", "patience": 2}


@pytest.fixture(scope="module")
def train() -> VerticalDataset:
    return tiny_train()


@pytest.fixture(scope="module")
def test_data() -> VerticalDataset:
    return tiny_test()


def stopping_fit(name: str, data: VerticalDataset, **kw: Any) -> Any:
    return get_method(name)("fast", seed=SEED, **{**tiny(name), **STOPPING}).fit(data, **kw)


def val_rows(model: Any) -> dict[int, dict[str, float]]:
    """The history's validation checks: epoch -> {val_score, val_loss}."""
    return {h["epoch"]: {"val_score": h["val_score"], "val_loss": h["val_loss"]} for h in model.history_
            if "val_score" in h}


# ---------------------------------------------------------------------- the rules
def test_min_steps_resolves_to_the_floor_unless_epochs_is_given() -> None:
    # the same learning distance lr x steps = 0.2 for every method: 1,000 steps at FALSE-VFL's 2e-4, 67 at 3e-3
    assert (floor_steps(2e-4), floor_steps(3e-3), floor_steps(1e-4), floor_steps(None)) == (1000, 67, 2000, 0)
    assert resolve_min_steps({"min_steps": None, "lr": 2e-4, "epochs": 30}, {}) == \
        {"min_steps": 1000, "lr": 2e-4, "epochs": 30}
    assert resolve_min_steps({"min_steps": None, "lr": 2e-4}, {"epochs": 5})["min_steps"] == 0  # pinned
    assert resolve_min_steps({"min_steps": 200, "lr": 2e-4}, {"epochs": 5})["min_steps"] == 200  # both given
    for name in METHODS:
        cls = get_method(name)
        lr = cls("fast").resolve_params(None)["lr"]
        assert cls("fast").resolve_params(None)["min_steps"] == floor_steps(lr), name
        assert cls("fast", epochs=3).resolve_params(None)["min_steps"] == 0, name
        assert cls("fast", epochs=3, min_steps=40).resolve_params(None)["min_steps"] == 40, name
    assert get_method("false-vfl-1")("paper").resolve_params("fashion-mnist")["min_steps"] == 1000


def test_epochs_are_raised_to_min_steps() -> None:
    # the case: 100 labels, batch 128 -> one step per epoch; 100 epochs are 100 steps, the floor makes 1,000
    assert supervised_epochs(100, 1, 1000) == 1000
    assert supervised_epochs(100, 8, 1000) == 125
    assert supervised_epochs(100, 16, 1000) == 100  # already 1,600 steps
    assert supervised_epochs(100, 1, 0) == 100
    assert check_interval(1000) == 20 and check_interval(30) == 1


def test_a_fit_runs_min_steps_and_records_its_schedule(train, tmp_path) -> None:
    for name, stage in (("false-vfl-1", "train"), ("laser-vfl", "train"), ("fedhssl", "finetune"), ("x-vfl", "train")):
        params = {**tiny(name), "min_steps": 25, "early_stopping": "off"}
        counter = StepCounter(tmp_path)
        model = get_method(name)("fast", seed=SEED, **params).fit(train, checkpointer=counter)
        steps = [s for s, pos in counter.positions.items() if pos[0] == stage]
        plan = model.schedule_.stages[stage]
        epochs = max(params["epochs"], math.ceil(25 / plan["steps_per_epoch"]))
        assert plan["max_epochs"] == epochs, name
        assert len(steps) == epochs * plan["steps_per_epoch"] >= 25, name  # the counted steps per epoch are right
        assert max(h["epoch"] for h in model.history_ if h["stage"] == stage) == epochs, name


def test_validation_score_orders_accuracy_then_log_loss() -> None:
    y = np.array([0, 1])
    sure, unsure = np.array([[0.9, 0.1], [0.2, 0.8]]), np.array([[0.6, 0.4], [0.4, 0.6]])
    assert validation_score(sure, y, True)[0] == validation_score(unsure, y, True)[0] == 1.0
    assert validation_score(sure, y, True) > validation_score(unsure, y, True)
    assert validation_score(np.array([[0.1, 0.9], [0.2, 0.8]]), y, True) < validation_score(unsure, y, True)


def wide_data(n_labels: int) -> VerticalDataset:
    """Two parties, three classes, ``n_labels`` labelled rows of ``n_labels + 50``."""
    rng = np.random.default_rng(0)
    n = n_labels + 50
    y = rng.integers(0, 3, n)
    blocks = [rng.normal(size=(n, 3)) + y[:, None], rng.normal(size=(n, 2)) + y[:, None]]
    labeled = np.zeros(n, dtype=bool)
    labeled[:n_labels] = True
    return VerticalDataset(blocks, np.ones((n, 2), dtype=bool), y=y, labeled=labeled,
                           task=Task.classification([0, 1, 2]), active_party=0)


@pytest.mark.slow
def test_early_stopping_auto_needs_the_schedule_and_enough_labels() -> None:
    need = math.ceil(MIN_VALIDATION_ROWS / 0.2)
    small = dict(latent_dim=4, encoder_hidden=[8], min_steps=20)
    below = get_method("local")("fast", seed=0, **small).fit(wide_data(need - 5))
    assert not below.schedule_.early_stopping and not val_rows(below)
    above = get_method("local")("fast", seed=0, **small).fit(wide_data(need))
    assert above.schedule_.early_stopping and above.schedule_.validation_rows == MIN_VALIDATION_ROWS
    assert val_rows(above)
    pinned = get_method("local")("fast", seed=0, latent_dim=4, encoder_hidden=[8], epochs=2).fit(wide_data(need))
    assert not pinned.schedule_.early_stopping  # an explicit epoch count pins the schedule: no rows held out


def test_schedule_rows_say_what_the_defaults_do() -> None:
    row = schedule_rows("false-vfl-1", "paper", 100, dataset="fashion-mnist")  # the trap
    assert (row["batch_size"], row["steps_per_epoch"], row["epochs"]) == (128, 1, 200)
    assert row["max_steps"] == 1000 and not row["early_stopping"] and row["rows"] == 100
    assert schedule_rows("laser-vfl", "fast", 100)["max_epochs"] == 34  # 67 steps of 2 per epoch
    row = schedule_rows("false-vfl-1", "paper", 2000, dataset="fashion-mnist")
    assert row["early_stopping"] and row["validation_rows"] == 400 and row["rows"] == 1600
    big = schedule_rows("vanilla-vfl", "fast", 10000)
    assert big["early_stopping"] and big["validation_rows"] == 2000 and big["rows"] == 1600  # aligned share of 8,000
    assert schedule_rows("laser-vfl", "fast", 50, overrides={"epochs": 7})["max_epochs"] == 7  # pinned


# ---------------------------------------------------------------------- early stopping
@pytest.mark.parametrize("name", METHODS)
def test_early_stopping_restores_the_best_checked_state(name: str, train) -> None:
    model = stopping_fit(name, train)
    plan, result = model.schedule_, model.schedule_.result
    checks = val_rows(model)
    assert plan.early_stopping and result["checks"] == len(checks) >= 1
    best = result["best_epoch"]
    assert checks[best]["val_score"] == result["best_validation"] == max(c["val_score"] for c in checks.values())
    if result["stopped_epoch"] is not None:
        assert result["stopped_epoch"] - best == plan.patience * result["check_every"]
    # the restored model scores what the best check scored: coordinator and parties were rolled back
    model._validating = True  # FALSE-VFL: the validation's own draws (per batch), not a prediction's per-row ones
    probs = model.predict_proba(train.subset(plan.rows))
    model._validating = False
    acc, neg_loss = validation_score(probs, train.y[plan.rows], True)
    assert acc == pytest.approx(checks[best]["val_score"])
    assert -neg_loss == pytest.approx(checks[best]["val_loss"], rel=1e-5, abs=1e-6)


def test_held_out_labels_never_reach_training(train, monkeypatch) -> None:
    cls = get_method("vanilla-vfl")
    seen = {}
    original = cls._fit

    def spy(self, view, handle, loop):
        seen["labeled"] = view.labeled.copy()
        return original(self, view, handle, loop)

    monkeypatch.setattr(cls, "_fit", spy)
    model = cls("fast", seed=SEED, **{**tiny("vanilla-vfl"), **STOPPING}).fit(train)
    rows = model.schedule_.rows
    assert rows.size and train.labeled[rows].all() and not seen["labeled"][rows].any()
    assert (seen["labeled"] | np.isin(np.arange(train.n_samples), rows) == train.labeled).all()


def crash_points(positions: dict[int, tuple[str, int, int]], stage: str) -> list[int]:
    """Inside the supervised stage: its first step, a step in the middle, its last step (never the fit's last)."""
    steps = sorted(s for s, pos in positions.items() if pos[0] == stage)
    return sorted({steps[0], steps[len(steps) // 2], steps[-2] if len(steps) > 1 else steps[0]})


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.slow
def test_a_resumed_fit_with_early_stopping_equals_an_uninterrupted_one(name: str, train, test_data,
                                                                      tmp_path) -> None:
    counter = StepCounter(tmp_path / "count")
    ref = stopping_fit(name, train, checkpointer=counter)
    proba = ref.predict_proba(test_data)
    stage = next(iter(ref.schedule_.stages))
    for n in crash_points(counter.positions, stage):
        directory = tmp_path / f"ck-{n}"
        with pytest.raises(Crash):
            stopping_fit(name, train, checkpointer=CrashingCheckpointer(directory, every=1, crash_at=n))
        resumed = stopping_fit(name, train, checkpointer=Checkpointer(directory, every=1))
        assert resumed.resumed_step_ == n
        assert resumed.history_ == ref.history_, counter.positions[n]
        assert resumed.schedule_.result == ref.schedule_.result
        np.testing.assert_array_equal(resumed.predict_proba(test_data), proba, err_msg=str(counter.positions[n]))


# ---------------------------------------------------------------------- over gRPC
GRPC_METHODS = ("laser-vfl", "false-vfl-1")  # parties trained in the stage (their best state kept) and not


@pytest.fixture(scope="module")
def deployment(tiny_deployment):
    return tiny_deployment  # test_contract's parties (conftest.py): the same tiny tables


@pytest.mark.parametrize("name", GRPC_METHODS)
@pytest.mark.slow
def test_early_stopping_over_grpc_equals_in_process_and_resumes(name: str, deployment, train, test_data,
                                                                tmp_path) -> None:
    counter = StepCounter(tmp_path / "count")
    ref = stopping_fit(name, train, checkpointer=counter)
    proba = ref.predict_proba(test_data)
    fed = deployment.federation()
    try:
        remote = stopping_fit(name, train, federation=fed)
        np.testing.assert_allclose(remote.predict_proba(test_data), proba, rtol=1e-5, atol=1e-6)
    finally:
        fed.close()
    assert_same(remote.history_, ref.history_, exact=False)
    assert remote.schedule_.result == ref.schedule_.result
    n = crash_points(counter.positions, next(iter(ref.schedule_.stages)))[1]
    fed = deployment.federation()
    try:
        with pytest.raises(Crash):
            stopping_fit(name, train, federation=fed, checkpointer=CrashingCheckpointer(tmp_path / "ck", every=1,
                                                                                      crash_at=n))
    finally:
        fed.close()
    fed = deployment.federation()  # a new coordinator; the parties kept running (and kept their best states)
    try:
        resumed = stopping_fit(name, train, federation=fed, checkpointer=Checkpointer(tmp_path / "ck", every=1))
        np.testing.assert_allclose(resumed.predict_proba(test_data), proba, rtol=1e-5, atol=1e-6)
    finally:
        fed.close()
    assert resumed.resumed_step_ == n and resumed.schedule_.result == ref.schedule_.result


# ---------------------------------------------------------------------- generative initialisation (issue 28.4)
GENERATIVE = {"pretrain": True, "pretrain_kind": "false-vfl", "pretrain_epochs": 2,
              "generative": {"pretrain_batch_size": 16, "decoder_hidden": [8]}}


def generative_fit(name: str, data: VerticalDataset, **kw: Any) -> Any:
    params = {**tiny(name), **GENERATIVE, **kw.pop("params", {})}
    return get_method(name)("fast", seed=SEED, **params).fit(data, **kw)


@pytest.mark.parametrize("name", ["laser-vfl", "vanilla-vfl"])
@pytest.mark.float_sensitive
def test_each_party_starts_from_its_own_stage1_encoder_mean(name: str, train) -> None:
    import torch

    model = generative_fit(name, train, params={"epochs": 0})  # no supervised step: the initialised encoders
    p = model.settings_
    same = {**GENERATIVE["generative"], "d_h": p.latent_dim, "encoder": p.encoder,
            "encoder_hidden": list(p.encoder_hidden), "pretrain_epochs": 2, "epochs": 0}
    gen = get_method("false-vfl-1")("fast", seed=SEED, **same).fit(train)
    for k in range(train.n_parties):
        x = torch.as_tensor(np.nan_to_num(train.blocks[k][:5]), dtype=torch.float32)
        split = model.federation_.runtimes[k].program.models["f"]
        enc = gen.federation_.runtimes[k].program.net.encoder
        # the initialisation itself is exact: every weight is the stage-1 encoder's (its mean half in the last layer)
        gen_state, split_state = enc.state_dict(), split.state_dict()
        for key, w in split_state.items():
            assert torch.equal(w, gen_state[key][:w.shape[0]]), key  # [:n] is the whole weight where shapes agree
        with torch.no_grad():
            # Outputs to float32 rounding only: the last layer is a product of latent_dim outputs on one side and
            # of 2 * latent_dim on the other, which some CPUs round alike (AMD AVX2) and some not (Intel AVX-512).
            torch.testing.assert_close(split(x), enc(x)[:, :p.latent_dim], rtol=1e-5, atol=1e-6)
    assert model.history_[0]["stage"] == "generative-pretrain" and len(model.history_) == 2


def test_a_generative_encoder_of_another_shape_is_refused() -> None:
    import torch

    from partialvfl.methods.splitnn.party import encoder_init
    from partialvfl.nn.blocks import MLP

    gen, split = MLP(4, [8], 2 * 3), MLP(4, [8], 3)
    out = encoder_init(gen.state_dict(), split.state_dict(), "party 0")
    assert torch.equal(out["2.weight"], gen.state_dict()["2.weight"][:3])
    with pytest.raises(ValueError, match="party 0: the generative encoder's '0.weight' .* architectures differ"):
        encoder_init(MLP(4, [16], 6).state_dict(), split.state_dict(), "party 0")


@pytest.mark.slow
def test_generative_init_resumes_and_runs_over_grpc_as_in_process(deployment, train, test_data,
                                                                 tmp_path) -> None:
    from partialvfl.federation import MessageLog, find_raw_feature_leaks

    counter = StepCounter(tmp_path / "count")
    ref = generative_fit("laser-vfl", train, checkpointer=counter)
    proba = ref.predict_proba(test_data)
    n = sorted(counter.positions)[len(counter.positions) // 2]
    with pytest.raises(Crash):
        generative_fit("laser-vfl", train, checkpointer=CrashingCheckpointer(tmp_path / "ck", every=1, crash_at=n))
    resumed = generative_fit("laser-vfl", train, checkpointer=Checkpointer(tmp_path / "ck", every=1))
    assert resumed.history_ == ref.history_
    np.testing.assert_array_equal(resumed.predict_proba(test_data), proba)
    log = MessageLog(keep_payloads=True)
    fed = deployment.federation(log=log)
    try:
        remote = generative_fit("laser-vfl", train, federation=fed)
        np.testing.assert_allclose(remote.predict_proba(test_data), proba, rtol=1e-5, atol=1e-6)
    finally:
        fed.close()
    assert find_raw_feature_leaks(log, train, test_data) == []
    assert any(e.kind == "init_encoder" for e in log.crossing())


def test_docs_schedule_table_is_generated_by_the_rule() -> None:
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("schedule_table", root / "scripts" / "schedule_table.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    doc = (root / "docs" / "schedules.md").read_text()
    assert mod.render(doc) == doc, "run: python scripts/schedule_table.py"
    assert "| false-vfl-1 (paper, fashion-mnist) | 50 | 50 labelled | 128 | 1 | 200 | 1,000 | 1,000 epochs" in doc


def test_the_step_floor_of_a_vanishing_learning_rate_is_a_finite_count() -> None:
    """ceil(0.2 / lr) overflowed for a positive lr near the smallest float (a value the declaration admits)."""
    from partialvfl.methods.schedule import MAX_FLOOR_STEPS, floor_steps

    assert floor_steps(2e-4) == 1000 and floor_steps(3e-3) == 67
    assert floor_steps(5e-324) == floor_steps(1e-300) == floor_steps(1e-10) == MAX_FLOOR_STEPS
