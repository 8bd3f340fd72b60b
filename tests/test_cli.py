"""The partialvfl command: describe, datasets, methods, fit and evaluate end to end."""

from __future__ import annotations

import json

import pytest

from partialvfl.cli import main

DESCRIBE = ["describe", "--dataset", "digits", "--parties", "4", "--labels", "500", "--aligned", "100",
            "--train-missing", "mcar:0.5", "--test-missing", "mnar:0.9", "--seed", "0", "--json"]


def test_describe_json_matches_mcar_expectation_and_is_deterministic(capsys: pytest.CaptureFixture) -> None:
    assert main(DESCRIBE) == 0
    first = capsys.readouterr().out
    assert main(DESCRIBE) == 0
    assert capsys.readouterr().out == first
    out = json.loads(first)
    tr, te = out["train"], out["test"]
    assert set(tr) >= {"n_samples", "n_labeled", "observed_fraction", "observed_parties_histogram", "all_missing"}
    assert tr["n_labeled"] == 500 and te["n_labeled"] == te["n_samples"]
    n = tr["n_samples"]
    expected = (100 + 0.5 * (n - 100)) / n  # aligned reserve fully observed, MCAR 0.5 on the rest
    se = (0.25 / (n - 100)) ** 0.5 * (n - 100) / n
    for frac in tr["observed_fraction"]:
        assert abs(frac - expected) < 4 * se
    assert tr["observed_parties_histogram"][4] >= 100
    assert sum(tr["observed_parties_histogram"]) == n and tr["all_missing"] == tr["observed_parties_histogram"][0]


def test_describe_text_and_bad_mechanism(capsys: pytest.CaptureFixture) -> None:
    assert main(DESCRIBE[:-1]) == 0
    assert "observed fraction per party" in capsys.readouterr().out
    bad = [*DESCRIBE[:-1]]
    bad[bad.index("mcar:0.5")] = "mcar:1.5"
    assert main(bad) == 2
    assert "mcar" in capsys.readouterr().err


def test_datasets_lists_digits_as_available(capsys: pytest.CaptureFixture) -> None:
    assert main(["datasets", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["digits"]["available"] is True
    assert {"isolet", "hapt", "fashion-mnist", "synthetic"} <= set(rows)


def test_fit_then_evaluate_remembers_the_protocol(tmp_path, capsys: pytest.CaptureFixture) -> None:  # noqa: ANN001
    out = tmp_path / "model"
    assert main(["fit", "--dataset", "digits", "--parties", "4", "--labels", "200", "--aligned", "50",
                 "--train-missing", "mcar:0.2", "--method", "false-vfl-1", "--epochs", "1", "--seed", "3",
                 "--max-train", "400", "--max-test", "150", "--out", str(out), "--quiet"]) == 0
    assert "test (none): accuracy" in capsys.readouterr().out
    assert main(["evaluate", "--model", str(out), "--test-missing", "mcar:0.5", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert 0.0 <= res["accuracy"] <= 1.0 and res["n_samples"] == 150 and res["method"] == "false-vfl-1"
    assert sum(v["n"] for v in res["by_observed_parties"].values()) == 150
    assert main(["evaluate", "--model", str(out), "--test-missing", "mcar:0.5", "--seed", "4"]) == 2
    assert "seed 3" in capsys.readouterr().err
