"""Calibration (docs/explain.md): the metrics against their definitions, temperature scaling recovering a known
temperature, and the commands on the own-data example's tables: ``evaluate`` reports the calibration per availability
pattern and draws the reliability diagram, ``calibrate`` saves temperatures with the model that ``predict``,
``evaluate``, ``explain`` and the service then apply (the predicted class never changes), ``explain`` and ``value``
write their files, and ``POST /v1/explain`` answers what the library explains."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from example_tables import table_paths, write_example
from partialvfl.cli import main
from partialvfl.data.builders import from_tables
from partialvfl.methods import VFLMethod
from partialvfl.methods.calibration import (
    Calibration,
    brier_score,
    calibration_metrics,
    expected_calibration_error,
    fit_temperature,
    log_loss,
)

KW = {"id_column": "customer_id", "label_column": "defaulted", "active_party": "bank"}


# ---------------------------------------------------------------------- the metrics
def test_the_metrics_follow_their_definitions() -> None:
    probs = np.array([[0.9, 0.1], [0.8, 0.2], [0.3, 0.7], [0.45, 0.55]])
    true = np.array([0, 1, 1, -1])  # the last: a class the model never saw, not scored
    # bins of width 1/15: 0.9 and 0.8 fall in different bins, accuracy 1 and 0; 0.7 accuracy 1
    assert expected_calibration_error(probs, true) == pytest.approx((0.1 + 0.8 + 0.3) / 3)
    assert brier_score(probs, true) == pytest.approx((0.02 + 1.28 + 0.18) / 3)
    assert log_loss(probs, true) == pytest.approx(-(np.log(0.9) + np.log(0.2) + np.log(0.7)) / 3)
    m = calibration_metrics(probs, true, np.array([[1, 1], [1, 0], [1, 1], [0, 1]], bool), ["bank", "shop"])
    assert m["n"] == 3 and set(m["by_pattern"]) == {"bank+shop", "bank"}
    assert m["by_pattern"]["bank+shop"]["n"] == 2 and m["by_pattern"]["bank"]["accuracy"] == 0.0


def test_temperature_scaling_recovers_a_known_overconfidence_and_keeps_every_class() -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(scale=2.0, size=(6000, 3))
    honest = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    true = np.array([rng.choice(3, p=p) for p in honest])
    over = np.exp(2.0 * logits) / np.exp(2.0 * logits).sum(axis=1, keepdims=True)  # twice too confident
    assert fit_temperature(over, true) == pytest.approx(2.0, rel=0.08)
    used = np.ones((len(true), 2), bool)
    used[:3000, 1] = False
    half = over.copy()
    half[3000:] = honest[3000:]  # one pattern overconfident, the other honest
    cal = Calibration.fit(half, true, used, ["bank", "shop"], per_pattern=True)
    assert cal.by_pattern["bank"] == pytest.approx(2.0, rel=0.1) and cal.by_pattern["bank+shop"] == pytest.approx(
        1.0, rel=0.1)
    rare = used.copy()  # a pattern of too few rows takes its number of parties' temperature
    rare[:40] = [False, True]
    fallback = Calibration.fit(half, true, rare, ["bank", "shop"], per_pattern=True, min_rows=100)
    assert "shop" not in fallback.by_pattern and fallback.temperatures(rare[:1])[0] == fallback.by_count[1]
    after = cal.apply(half, used)
    assert (after.argmax(axis=1) == half.argmax(axis=1)).all()
    assert cal.fitted_on["after"]["ece"] < cal.fitted_on["before"]["ece"]
    assert Calibration.from_dict(json.loads(json.dumps(cal.to_dict()))) == cal


# ---------------------------------------------------------------------- the commands
@pytest.fixture(scope="module")
def example(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = write_example(tmp_path_factory.mktemp("example"), seed=3, n_train=400, n_new=120)
    flags = [a for p in ("bank", "shop", "telco") for a in ("--table", f"{p}={d / 'train' / f'{p}.csv'}")]
    assert main(["fit", *flags, "--id-column", "customer_id", "--label", "defaulted", "--active", "bank", "--method",
                 "laser-vfl", "--seed", "0", "--epochs", "5", "--out", str(d / "model"), "--quiet"]) == 0
    return d


def tables(d: Path, folder: str = "new", bank: str | None = None) -> list[str]:
    return [a for p in ("bank", "shop", "telco")
            for a in ("--table", f"{p}={d / (bank if p == 'bank' and bank else folder) / f'{p}.csv'}")]


def evaluated(d: Path, model: Path, capsys: pytest.CaptureFixture, *extra: str) -> dict:
    assert main(["evaluate", "--model", str(model), *tables(d, bank="outcomes"), "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_evaluate_reports_calibration_per_pattern_and_draws_the_reliability_diagram(
        example: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    res = evaluated(example, example / "model", capsys, "--reliability", str(tmp_path / "r.svg"))
    cal = res["calibration"]
    assert cal["n"] == res["n_samples"] and {"ece", "brier", "log_loss", "by_pattern"} <= set(cal)
    assert sum(p["n"] for p in cal["by_pattern"].values()) == cal["n"] and "bank+shop+telco" in cal["by_pattern"]
    assert (tmp_path / "r.svg").read_text().lstrip().startswith("<?xml")
    assert main(["evaluate", "--model", str(example / "model"), *tables(example, bank="outcomes")]) == 0
    assert "  calibration: ECE " in capsys.readouterr().out
    assert main(["evaluate", "--model", str(example / "model"), *tables(example, bank="outcomes"),
                 "--reliability", str(tmp_path / "r.pdf")]) == 2
    assert "a figure is written as .png or .svg, not .pdf" in capsys.readouterr().err


def test_calibrate_saves_temperatures_that_every_prediction_then_applies(example: Path, tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture) -> None:
    calibrated = tmp_path / "calibrated"
    assert main(["calibrate", "--model", str(example / "model"), *tables(example, "train"), "--out",
                 str(calibrated), "--per-pattern", "--min-rows", "50"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("laser-vfl: temperature ") and "\n  fitted on " in out and "  after  ECE " in out
    meta = json.loads((calibrated / "model.json").read_text())["calibration"]
    assert meta["method"] == "temperature" and meta["fitted_on"]["per_pattern"]
    assert meta["fitted_on"]["after"]["log_loss"] <= meta["fitted_on"]["before"]["log_loss"]
    new = from_tables(table_paths(example, "new"), id_column="customer_id", active_party="bank")
    plain, scaled = VFLMethod.load(example / "model"), VFLMethod.load(calibrated)
    p0, p1 = plain.predict_proba(new), scaled.predict_proba(new)
    assert (p0.argmax(1) == p1.argmax(1)).all() and np.abs(p0 - p1).max() > 1e-3
    want = scaled.calibration_.apply(p0, scaled.parties_used(new))
    assert np.abs(p1 - want).max() <= 1e-12
    e = scaled.explain(new)  # explanations explain the calibrated probabilities
    assert np.abs(e.value - p1[np.arange(len(p1)), p1.argmax(1)]).max() <= 1e-6 and e.efficiency_gap() <= 1e-5
    before, after = evaluated(example, example / "model", capsys), evaluated(example, calibrated, capsys)
    assert after["accuracy"] == before["accuracy"] and after["calibration"]["ece"] != before["calibration"]["ece"]
    assert main(["calibrate", "--model", str(calibrated), "--remove"]) == 0
    assert "calibration" not in json.loads((calibrated / "model.json").read_text())
    assert np.abs(VFLMethod.load(calibrated).predict_proba(new) - p0).max() <= 1e-12


def test_explain_and_value_write_their_files(example: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["explain", "--model", str(example / "model"), *tables(example), "--out",
                 str(tmp_path / "e.csv")]) == 0
    printed = capsys.readouterr()
    assert "predictions explained (exact Shapley values over the 8 coalitions of 3 parties)" in printed.err
    frame = pd.read_csv(tmp_path / "e.csv")
    assert list(frame.columns[:3]) == ["customer_id", "prediction", "explained"]
    parts = frame[["probability_base", "probability_bank", "probability_shop", "probability_telco"]].sum(axis=1)
    assert np.abs(parts - frame["probability"]).max() <= 1e-5
    assert frame["customer_id"].is_monotonic_increasing
    assert main(["value", "--model", str(example / "model"), *tables(example, bank="outcomes"), "--score", "auc",
                 "--out", str(tmp_path / "v"), "--bootstrap", "50"]) == 0
    text = capsys.readouterr().out
    assert "each party's value (AUC gained; exact over 8 coalitions" in text
    assert {f.name for f in (tmp_path / "v").iterdir()} == {"values.csv", "coalitions.csv", "values.json",
                                                             "values.png", "values.svg"}
    assert len(pd.read_csv(tmp_path / "v" / "coalitions.csv")) == 8
    assert main(["value", "--model", str(example / "model"), *tables(example)]) == 2  # no outcomes
    assert "label column" in capsys.readouterr().err


def test_the_service_explains_what_the_library_explains(example: Path) -> None:
    pytest.importorskip("fastapi")
    from partialvfl.serving.app import ServiceConfig, create_app
    from partialvfl.serving.predictors import TablePredictor
    from test_serving import Service

    new = from_tables(table_paths(example, "new"), id_column="customer_id", active_party="bank")
    want = VFLMethod.load(example / "model").explain(new)
    row = {str(i): r for r, i in enumerate(want.ids)}
    ids = [str(i) for i in new.ids[:5]]
    service = Service(create_app(TablePredictor(example / "model", table_paths(example, "new")), ServiceConfig()))
    try:
        code, body = service.call("/v1/explain", {"ids": [*ids, "no-such-user"]}, token=None)
        assert code == 200, body
        assert body["estimate"] == "exact" and body["method"] == "laser-vfl"
        for r in body["results"][:5]:
            e = want.row(row[r["id"]])
            assert r["status"] == "ok" and r["probability"]["contributions"] == pytest.approx(
                e["probability"]["contributions"], abs=1e-6)
            p = r["probability"]
            assert abs(p["base"] + sum(p["contributions"].values()) - p["value"]) <= 1e-5
        assert body["results"][5]["status"] == "unknown_id"
        code, body = service.call("/v1/explain", {"ids": ids[:1], "class": 7}, token=None)
        assert code == 422 and "class 7 is not one of the model's classes [0, 1]" in body["error"]
        code, body = service.call("/v1/explain", {"ids": ids[:1], "permutations": 1}, token=None)
        assert code == 422 and body["error"].startswith("permutations:")
    finally:
        service.stop()
