"""Differential privacy from the command line (issue 25): ``fit --label-dp EPS``, ``fit/predict --party-dp
PARTY=EPS[:DELTA]`` in process; what the fit prints and saves; bad input exits 2 with a message naming the flag."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from example_tables import PARTIES, write_example
from partialvfl.cli import main


@pytest.fixture(scope="module")
def example(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_example(tmp_path_factory.mktemp("example"), seed=4, n_train=300, n_new=40)


def tables(d: Path, folder: str) -> list[str]:
    return [a for p in PARTIES for a in ("--table", f"{p}={d / folder / f'{p}.csv'}")]


def fit_args(d: Path, *extra: str, method: str = "laser-vfl") -> list[str]:
    return ["fit", *tables(d, "train"), "--id-column", "customer_id", "--label", "defaulted", "--active", "bank",
            "--method", method, "--epochs", "1", "--seed", "0", "--quiet", "--out", str(d / "model"), *extra]


@pytest.fixture(scope="module")
def private_model(example: Path) -> Path:
    assert main(fit_args(example, "--label-dp", "2", "--party-dp", "shop=4", "--party-dp", "telco=6:1e-6")) == 0
    return example / "model"


def test_fit_prints_and_saves_what_each_mechanism_spent(private_model: Path, capsys: pytest.CaptureFixture) -> None:
    meta = json.loads((private_model / "model.json").read_text())["privacy"]
    assert meta["labels"] == {"epsilon": 2.0, "mechanism": "randomized response", "name": "randomized-response",
                              "params": {}, "accounted_epsilon": pytest.approx(2.0, abs=1e-3)}
    shop, telco = meta["parties"]["shop"], meta["parties"]["telco"]
    assert (shop["epsilon"], shop["delta"], telco["epsilon"], telco["delta"]) == (4.0, 1e-5, 6.0, 1e-6)
    assert 0 < shop["epsilon_spent"] <= 4.0 and 0 < telco["epsilon_spent"] <= 6.0
    assert "bank" not in meta["parties"]  # no budget asked for: none kept


def test_fit_output_names_the_spend(example: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(fit_args(example, "--label-dp", "1", "--party-dp", "shop=8")) == 0
    err = capsys.readouterr().err
    assert "label DP: epsilon 1 (randomized response" in err
    assert "party 'shop': differential-privacy budget epsilon 8, delta 1e-05 per row; spent epsilon" in err
    assert main(fit_args(example)) == 0
    err = capsys.readouterr().err
    assert "differential-privacy" not in err and "label DP" not in err


def test_predict_keeps_a_partys_budget_in_process(example: Path, private_model: Path,
                                                  capsys: pytest.CaptureFixture) -> None:
    out = example / "pred.csv"
    assert main(["predict", "--model", str(private_model), *tables(example, "new"), "--party-dp", "shop=4",
                 "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "party 'shop': differential-privacy budget epsilon 4" in err and "spent epsilon" in err
    noisy = pd.read_csv(out)
    assert main(["predict", "--model", str(private_model), *tables(example, "new"), "--out", str(out)]) == 0
    plain = pd.read_csv(out)
    assert "differential-privacy" not in capsys.readouterr().err
    assert list(noisy["customer_id"]) == list(plain["customer_id"])
    assert not noisy["p_1"].equals(plain["p_1"])  # the shop's releases were noised


@pytest.mark.parametrize(("extra", "method", "needles"), [
    (("--label-dp", "1"), "x-vfl", ("--label-dp: x-vfl does not support differential privacy", "laser-vfl")),
    (("--party-dp", "shop=8", "--label-dp", "1"), "fedhssl", ("--label-dp and --party-dp: fedhssl",)),
    (("--party-dp", "shop=8"), "false-vfl-2", ("--party-dp: false-vfl-2 does not support",)),
    (("--party-dp", "nobody=8"), "laser-vfl", ("--party-dp: no party 'nobody'", "'shop'")),
    (("--party-dp", "shop"), "laser-vfl", ("--party-dp takes PARTY=EPS or PARTY=EPS:DELTA, got 'shop'",)),
    (("--party-dp", "shop=x"), "laser-vfl", ("--party-dp 'shop=x': not a number",)),
    (("--party-dp", "shop=8:-1"), "laser-vfl", ("--party-dp 'shop=8:-1': must be a positive number",)),
    (("--party-dp", "shop=8", "--party-dp", "shop=4"), "laser-vfl", ("--party-dp names party 'shop' twice",)),
    (("--param", "label_dp_prior=true"), "laser-vfl", ("--param label_dp_prior=true needs --label-dp EPS",)),
])
def test_bad_privacy_options_exit_2_naming_the_flag(example: Path, capsys: pytest.CaptureFixture,
                                                    extra: tuple[str, ...], method: str,
                                                    needles: tuple[str, ...]) -> None:
    assert main(fit_args(example, *extra, method=method)) == 2
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err
    assert "label_dp (" not in err and "party_dp:" not in err  # Python names stay out of CLI messages


def test_label_dp_must_be_positive_and_party_dp_is_refused_with_a_federation(
        example: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:
        main(fit_args(example, "--label-dp", "0"))
    assert e.value.code == 2 and "--label-dp: must be a positive number" in capsys.readouterr().err
    assert main(["fit", "--federation", str(example / "federation.toml"), "--party-dp", "shop=8", "--method",
                 "laser-vfl", "--out", str(example / "m2")]) == 2
    assert "a deployed party sets its own budget ([policy] dp_epsilon, dp_delta" in capsys.readouterr().err
    assert main(["predict", "--model", str(example / "model"), "--federation", str(example / "f.toml"), "--ids",
                 str(example / "ids.txt"), "--party-dp", "shop=8", "--out", str(example / "p.csv")]) == 2
    assert "--party-dp is for parties in this process" in capsys.readouterr().err


def test_a_federated_fits_label_dp_names_where_it_was_asked_and_keeps_its_secret_seed(tmp_path: Path) -> None:
    import argparse

    from partialvfl.cli.privacy import federated_label_dp
    from partialvfl.methods import get_method

    args = argparse.Namespace(label_dp=None, federation="fed.toml", out=str(tmp_path))
    with pytest.raises(ValueError, match=r"\[labels\] label_dp in fed.toml: x-vfl does not support"):
        federated_label_dp(args, get_method("x-vfl")("fast"), 1.0)
    args.label_dp = 2.0
    with pytest.raises(ValueError, match=r"--label-dp 2 disagrees with \[labels\] label_dp = 1 in fed.toml"):
        federated_label_dp(args, get_method("laser-vfl")("fast"), 1.0)
    first, again = get_method("laser-vfl")("fast"), get_method("laser-vfl")("fast")
    federated_label_dp(args, first, None)
    federated_label_dp(args, again, 2.0)  # a resume: the same seed, read back from OUT/checkpoints
    assert first.label_dp == again.label_dp == 2.0 and first.label_dp_seed == again.label_dp_seed
    assert (tmp_path / "checkpoints" / "label-dp-seed").read_text().strip() == str(first.label_dp_seed)
