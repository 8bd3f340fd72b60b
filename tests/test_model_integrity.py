"""A fitted model knows what it was trained on and refuses what disagrees; numbers and files it cannot trust are
errors (issue 13, items 4 and 5).

* parties mapped by name, features by name, labels scored by value (missing classes, unseen classes, reordered
  parties: the accuracies below were 0.0 and ~0.5 instead of 1.0 before);
* non-finite losses and predictions stop with an error naming the step; statistics in float64;
* saving is atomic; corrupted, truncated, foreign or swapped model files are one clear error (CLI exit 2);
* models saved in format 1 (before all this) still load and predict the same.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from partialvfl import DataValidationError
from partialvfl.cli import main
from partialvfl.data.builders import from_tables
from partialvfl.methods import VFLMethod, get_method
from partialvfl.methods.model_files import ModelFileError
from partialvfl.methods.training import NonFiniteError

HERE = Path(__file__).resolve().parent
FAST = {"epochs": 40, "latent_dim": 8, "encoder_hidden": [16], "lr": 0.01}


def tables(labels: list, *, seed: int = 0, scale: float = 1.0, first_id: int = 0) -> dict[str, pd.DataFrame]:
    """Party 'sig' sees the class (one column per class, one-hot plus noise), party 'noise' sees nothing useful."""
    rng = np.random.default_rng(seed)
    n = len(labels)
    onehot = np.array([[float(v == c) for c in (0, 1, 2)] for v in labels]) + rng.normal(0, 0.05, (n, 3))
    ids = np.arange(first_id, first_id + n)
    sig = pd.DataFrame({"uid": ids, **{f"s{j}": onehot[:, j] * scale for j in range(3)}, "y": labels})
    noise = pd.DataFrame({"uid": ids, "n0": rng.normal(0, 1, n), "n1": rng.normal(0, 1, n), "n2": rng.normal(0, 1, n)})
    return {"sig": sig, "noise": noise}


def fitted(labels: list | None = None, **params: object) -> VFLMethod:
    labels = labels if labels is not None else [0, 1, 2] * 40
    data = from_tables(tables(labels), id_column="uid", label_column="y", active_party="sig")
    return get_method("vanilla-vfl")("fast", seed=0, **{**FAST, **params}).fit(data)


@pytest.fixture(scope="module")
def model() -> VFLMethod:
    m = fitted()
    train = from_tables(tables([0, 1, 2] * 40), id_column="uid", label_column="y", active_party="sig")
    assert m.score(train) == 1.0  # the task is trivially separable: any scoring error below is the scoring's
    return m


# ---------------------------------------------------------------------- 13.4: parties, features, labels
def test_model_remembers_parties_features_and_classes(model: VFLMethod) -> None:
    assert model.index_.party_names == ("sig", "noise")
    assert model.index_.feature_names == (("sig:s0", "sig:s1", "sig:s2"), ("noise:n0", "noise:n1", "noise:n2"))
    assert model.classes_.tolist() == [0, 1, 2] and model.classes_.dtype.kind == "i"


def test_a_test_set_lacking_a_class_is_scored_by_value(model: VFLMethod) -> None:
    test = from_tables(tables([1, 2] * 20, seed=1), id_column="uid", label_column="y", active_party="sig")
    assert test.task.classes == (1, 2)  # its own class list: index 0 is class 1 here, not class 0
    assert model.score(test) == 1.0  # was 0.0: indices compared instead of labels
    assert set(model.predict(test).tolist()) == {1, 2}  # predict gives labels, not indices


def test_test_tables_in_another_party_order_are_mapped_by_name(model: VFLMethod) -> None:
    t = tables([0, 1, 2] * 20, seed=2)
    swapped = from_tables({"noise": t["noise"], "sig": t["sig"]}, id_column="uid", label_column="y",
                          active_party="sig")
    assert swapped.party_names == ("noise", "sig")
    assert model.score(swapped) == 1.0  # was ~0.5: each party's block went to the other party's encoder
    np.testing.assert_array_equal(model.predict(swapped), np.asarray(swapped.task.classes)[swapped.y])


def test_columns_in_another_order_are_mapped_by_name(model: VFLMethod) -> None:
    t = tables([0, 1, 2] * 20, seed=3)
    t["sig"] = t["sig"][["uid", "y", "s2", "s0", "s1"]]
    data = from_tables(t, id_column="uid", label_column="y", active_party="sig")
    assert model.score(data) == 1.0


def test_a_class_never_seen_in_training_counts_as_an_error(model: VFLMethod) -> None:
    from partialvfl.methods.evaluation import evaluate

    labels = [0, 1, 2] * 10 + [7] * 10
    t = tables([v if v != 7 else 0 for v in labels], seed=4)
    t["sig"]["y"] = labels
    test = from_tables(t, id_column="uid", label_column="y", active_party="sig")
    res = evaluate(model, test)
    assert res["accuracy"] == pytest.approx(30 / 40) and res["unseen_classes"] == [7]


@pytest.mark.parametrize(("change", "message"), [
    (lambda t: t["noise"].rename(columns={"n1": "n_one"}),
     r"party 'noise': the model's column 'noise:n1' is missing from the data \(the first mismatching column, "
     r"position 1; the data has 'noise:n_one' there\)"),
    (lambda t: t["noise"].assign(n3=1.0), r"party 'noise': column 'noise:n3' \(position 3\) is not one the model"),
])
def test_data_whose_features_disagree_is_refused_naming_the_column(model: VFLMethod, change, message) -> None:
    t = tables([0, 1, 2] * 5, seed=5)
    t["noise"] = change(t)
    with pytest.raises(DataValidationError, match=message):
        model.predict(from_tables(t, id_column="uid", label_column="y", active_party="sig"))


def test_data_whose_parties_disagree_is_refused_naming_them(model: VFLMethod) -> None:
    t = tables([0, 1, 2] * 5, seed=6)
    with pytest.raises(DataValidationError, match=r"the data's parties \['sig', 'other'\] are not the model's "
                                                  r"\['sig', 'noise'\]: missing \['noise'\]; "
                                                  r"not in the model \['other'\]"):
        model.predict(from_tables({"sig": t["sig"], "other": t["noise"]}, id_column="uid", label_column="y",
                                  active_party="sig"))


def test_new_users_tables_need_no_label_column(model: VFLMethod) -> None:
    t = tables([0, 1, 2] * 5, seed=7)
    new = from_tables({"sig": t["sig"].drop(columns=["y"]), "noise": t["noise"]}, id_column="uid")
    assert new.task is None and new.n_labeled == 0
    proba = model.predict_proba(new)
    assert proba.shape == (15, 3) and np.allclose(proba.sum(axis=1), 1.0)


# ---------------------------------------------------------------------- 13.5: numbers that cannot be trusted
def test_statistics_in_float64_features_around_1e30_train() -> None:
    labels = [0, 1, 2] * 30
    t = tables(labels, scale=1e30)
    data = from_tables(t, id_column="uid", label_column="y", active_party="sig")
    m = get_method("vanilla-vfl")("fast", seed=0, **FAST).fit(data)
    assert m.score(data) == 1.0


def test_a_non_finite_loss_stops_training_naming_the_step() -> None:
    data = from_tables(tables([0, 1, 2] * 30), id_column="uid", label_column="y", active_party="sig")
    with pytest.raises(NonFiniteError, match=r"vanilla-vfl: the loss is (nan|inf) at step \d+ \(stage 'train', "
                                             r"epoch \d+\); training stopped. "
                                             r"Likely cause: .*a learning rate too high"):
        get_method("vanilla-vfl")("fast", seed=0, **{**FAST, "lr": 1e30}).fit(data)  # diverges at once


def test_non_finite_probabilities_stop_prediction(model: VFLMethod) -> None:
    t = tables([0, 1, 2] * 5, seed=8)
    t["sig"]["s0"] = 3e38  # finite in float32, beyond it once standardised: the network's output overflows
    with pytest.raises(NonFiniteError, match=r"the prediction for \d+ sample\(s\) \(first: ID \d+\) is not finite"):
        model.predict_proba(from_tables(t, id_column="uid", label_column="y", active_party="sig"))


# ---------------------------------------------------------------------- 13.5: model files
def test_save_is_atomic_a_failed_save_leaves_the_previous_model(model: VFLMethod, tmp_path: Path) -> None:
    d = tmp_path / "m"
    model.save(d)
    (d / "checkpoints").mkdir()  # other entries of the directory are kept across saves
    before = (d / "model.json").read_text()
    model.federation_.transport.down = {1}  # party 1 cannot save
    try:
        with pytest.raises(Exception, match="unavailable"):
            model.save(d)
        with pytest.raises(Exception, match="unavailable"):
            model.save(tmp_path / "fresh")
    finally:
        model.federation_.transport.down = set()
    assert (d / "model.json").read_text() == before and (d / "checkpoints").is_dir()
    assert not (tmp_path / "fresh").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no half-written or temporary directory
    model.save(d)
    assert (d / "checkpoints").is_dir() and sorted(p.name for p in tmp_path.iterdir()) == ["m"]
    VFLMethod.load(d)


def _corrupt(d: Path, name: str, how: str) -> None:
    path = d / name
    if how == "truncate":
        path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
    elif how == "foreign-json":
        path.write_text(json.dumps({"hello": "world"}))
    elif how == "foreign-torch":
        import torch

        torch.save(torch.zeros(3), path)
    elif how == "garbage":
        path.write_bytes(b"\x00not a model\xff" * 10)


@pytest.mark.parametrize(("name", "how", "message"), [
    ("model.json", "truncate", r"model.json is corrupted or truncated \(not valid JSON"),
    ("model.json", "foreign-json", r"model.json is not a partialvfl model description \(missing \['method'"),
    ("coordinator.pt", "truncate", r"coordinator.pt does not match .*model.json: the file is corrupted, truncated"),
    ("coordinator.pt", "garbage", r"coordinator.pt does not match"),
    ("party-1.pt", "truncate", r"party 1 \('noise'\): .*party-1.pt is not a readable partialvfl party state"),
    ("party-0.pt", "foreign-torch", r"party 0 \('sig'\): .*party-0.pt is not a partialvfl party state"),
    ("party-0.pt", "garbage", r"party-0.pt is not a readable partialvfl party state"),
])
def test_broken_model_files_are_one_clear_error(model: VFLMethod, tmp_path: Path, name: str, how: str,
                                                message: str, capsys: pytest.CaptureFixture) -> None:
    d = tmp_path / "m"
    model.save(d)
    _corrupt(d, name, how)
    with pytest.raises(ModelFileError, match=message):
        VFLMethod.load(d)
    assert main(["predict", "--model", str(d), "--table", "sig=x.csv", "--table", "noise=y.csv",
                 "--out", str(tmp_path / "p.csv")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err


def test_a_swapped_party_file_is_refused(tmp_path: Path) -> None:
    a, b = fitted(), fitted(epochs=3)
    a.save(tmp_path / "a")
    b.save(tmp_path / "b")
    shutil.copy(tmp_path / "b" / "party-1.pt", tmp_path / "a" / "party-1.pt")
    with pytest.raises(ModelFileError, match=r"party 1 \('noise'\): .*party-1.pt belongs to another model"):
        VFLMethod.load(tmp_path / "a")


@pytest.mark.slow
def test_cli_exit_code_2_without_traceback_for_a_missing_model(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "partialvfl", "evaluate", "--model", str(tmp_path / "nothing")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [f"error: {tmp_path / 'nothing'} is not a model directory (it does not "
                                                "exist)"]


def _as_format1(directory: Path) -> None:
    """Rewrite a saved model into format 1 (commit 86ddc4e): no digests, no feature names, no party preprocessing,
    party files holding only their program and state, parameters without ``standardize``."""
    meta = json.loads((directory / "model.json").read_text())
    meta = {k: v for k, v in meta.items() if k not in ("preprocessing", "coordinator_sha256", "digest")}
    meta["format"] = 1
    meta["index"].pop("feature_names", None)
    for key in ("params", "overrides"):
        meta[key].pop("standardize", None)
    (directory / "model.json").write_text(json.dumps(meta, indent=2))
    for f in directory.glob("party-*.pt"):
        saved = torch.load(f, weights_only=True)
        torch.save({"program": saved["program"], "state": saved["state"]}, f)


def test_a_format1_model_still_loads_and_predicts_the_same(tmp_path: Path) -> None:
    """A model directory in the format before digests, feature names and party preprocessing (format 1) loads and
    predicts as the model did (no weights are committed: the old layout is rewritten from a fresh save)."""
    rng = np.random.default_rng(5)
    y = rng.integers(0, 3, 60)
    tables = {"a": pd.DataFrame({"uid": np.arange(60), "x": y + rng.normal(0, 0.3, 60), "label": y}),
              "b": pd.DataFrame({"uid": np.arange(0, 60, 2), "z": y[::2] * 0.5 + rng.normal(0, 0.3, 30)})}
    data = from_tables(tables, id_column="uid", label_column="label", active_party="a")
    fitted = get_method("vanilla-vfl")("fast", seed=1, epochs=3, latent_dim=4, encoder_hidden=[8],
                                       standardize=False).fit(data)
    fitted.save(tmp_path / "m")
    _as_format1(tmp_path / "m")
    m = VFLMethod.load(tmp_path / "m")
    assert m.params_["standardize"] is False and m.index_.feature_names is None
    np.testing.assert_array_equal(m.predict_proba(data), fitted.predict_proba(data))

