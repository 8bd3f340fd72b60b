"""Issue 21, items 3 and 9, in process: the prediction file names the parties each prediction used (``local``: the
label holder's alone, the label prior for users it does not hold), and ``evaluate --truth FILE`` scores tables of new
users against outcomes keyed by ID, refusing a mismatch of IDs either way; CLI messages name CLI flags."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from example_tables import PARTIES, write_example
from partialvfl.cli import main

FIT = ["--id-column", "customer_id", "--label", "defaulted", "--active", "bank", "--epochs", "3", "--seed", "0",
       "--quiet"]


@pytest.fixture(scope="module")
def example(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_example(tmp_path_factory.mktemp("example"), seed=4, n_train=300, n_new=80)


def tables(d: Path, folder: str) -> list[str]:
    return [a for p in PARTIES for a in ("--table", f"{p}={d / folder / f'{p}.csv'}")]


@pytest.fixture(scope="module")
def models(example: Path) -> dict[str, Path]:
    out = {}
    for method in ("laser-vfl", "local"):
        out[method] = example / f"model-{method}"
        assert main(["fit", *tables(example, "train"), *FIT, "--method", method, "--out", str(out[method])]) == 0
    return out


def held(d: Path, folder: str = "new") -> dict[str, set[int]]:
    return {p: set(pd.read_csv(d / folder / f"{p}.csv")["customer_id"]) for p in PARTIES}


def test_local_names_only_the_label_holder_and_says_when_it_used_no_party(example: Path, models: dict[str, Path],
                                                                          tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "pred.csv"
    assert main(["predict", "--model", str(models["local"]), *tables(example, "new"), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    df = pd.read_csv(out, keep_default_na=False)
    bank = held(example)["bank"]
    at_bank = df["customer_id"].isin(bank)
    assert (~at_bank).any() and at_bank.any()
    assert df.loc[at_bank, "parties"].eq("bank").all() and df.loc[at_bank, "n_parties"].eq(1).all()
    assert df.loc[~at_bank, "parties"].eq("").all() and df.loc[~at_bank, "n_parties"].eq(0).all()
    # users the bank does not hold get the training label prior: one probability vector for all of them
    assert df.loc[~at_bank, ["p_0", "p_1"]].drop_duplicates().shape[0] == 1
    assert (f"note: local: {int((~at_bank).sum())} of {len(df)} rows" in err
            and "are predicted from the training label prior (local predicts from the active party alone" in err)
    # a method that uses every holder still names every holder
    assert main(["predict", "--model", str(models["laser-vfl"]), *tables(example, "new"), "--out", str(out)]) == 0
    laser = pd.read_csv(out, keep_default_na=False)
    places = held(example)
    for _, row in laser.iterrows():
        assert row["parties"].split(";") == [p for p in PARTIES if row["customer_id"] in places[p]]


def test_evaluate_truth_scores_new_users_against_outcomes_keyed_by_id(example: Path, models: dict[str, Path],
                                                                     tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture) -> None:
    model = str(models["laser-vfl"])
    truth = example / "outcomes" / "defaulted.csv"
    assert main(["evaluate", "--model", model, *tables(example, "new"), "--truth", str(truth), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    outcomes = pd.read_csv(truth)
    assert res["n_samples"] == len(outcomes) and res["unseen_classes"] == []
    # the same number from the prediction file and the outcomes, joined by ID by hand
    assert main(["predict", "--model", model, *tables(example, "new"), "--out", str(tmp_path / "p.csv")]) == 0
    joined = pd.read_csv(tmp_path / "p.csv").merge(outcomes, on="customer_id")
    assert len(joined) == len(outcomes)
    assert res["accuracy"] == pytest.approx(float((joined["prediction"] == joined["defaulted"]).mean()))
    by = {int(k): v["n"] for k, v in res["by_observed_parties"].items()}
    assert by == joined["n_parties"].value_counts().to_dict()
    # the outcomes in another order, under other column names, one of them an unseen class: matched by value
    other = outcomes.sample(frac=1.0, random_state=0).rename(columns={"customer_id": "cid", "defaulted": "y"})
    other.loc[other.index[0], "y"] = 7
    other.to_csv(tmp_path / "other.csv", index=False)
    capsys.readouterr()
    assert main(["evaluate", "--model", model, *tables(example, "new"), "--truth", str(tmp_path / "other.csv"),
                 "--id-column", "cid", "--label", "y"]) == 2  # --id-column applies to the tables as well:
                 # they have customer_id
    assert "ID column 'cid' not found" in capsys.readouterr().err
    other = other.rename(columns={"cid": "customer_id"})
    other.to_csv(tmp_path / "other.csv", index=False)
    assert main(["evaluate", "--model", model, *tables(example, "new"), "--truth", str(tmp_path / "other.csv"),
                 "--label", "y", "--json"]) == 0
    res7 = json.loads(capsys.readouterr().out)
    assert res7["unseen_classes"] == [7] and res7["n_samples"] == len(outcomes)
    row = joined.set_index("customer_id").loc[int(other["customer_id"].iloc[0])]
    assert res7["accuracy"] == pytest.approx(res["accuracy"] - float(row["prediction"] == row["defaulted"])
                                             / len(outcomes))


def test_evaluate_truth_refuses_ids_missing_either_way_with_counts_and_examples(example: Path,
                                                                              models: dict[str, Path],
                                                                              tmp_path: Path,
                                                                              capsys: pytest.CaptureFixture) -> None:
    model = str(models["laser-vfl"])
    bank_only = example / "outcomes" / "bank.csv"  # the bank's new customers: the shop's and telco's others lack one
    assert main(["evaluate", "--model", model, *tables(example, "new"), "--truth", str(bank_only)]) == 2
    err = capsys.readouterr().err.strip()
    users = set().union(*held(example).values())
    lacking = sorted(str(i) for i in users - held(example)["bank"])
    assert err == (f"error: {len(lacking)} of {len(users)} users of the --table files have no outcome in --truth "
                   f"{bank_only} (first: {lacking[:3]}); give an outcome for every user (an empty cell is not scored) "
                   "or tables of only the users to score")
    outcomes = pd.read_csv(example / "outcomes" / "defaulted.csv")
    extra = pd.concat([outcomes, pd.DataFrame({"customer_id": [5, 6], "defaulted": [0, 1]})])
    extra.to_csv(tmp_path / "extra.csv", index=False)
    assert main(["evaluate", "--model", model, *tables(example, "new"), "--truth", str(tmp_path / "extra.csv")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: 2 of {len(extra)} IDs of --truth {tmp_path / 'extra.csv'} are not among the users of the --table "
        "files (first: ['5', '6']); check that both use the same IDs (--id-column COLUMN)")
    assert main(["evaluate", "--model", model, "--truth", str(tmp_path / "extra.csv")]) == 2
    assert "evaluate --truth needs the users' features: --table PARTY=FILE" in capsys.readouterr().err


def test_evaluate_on_tables_without_the_label_names_the_flags(example: Path, models: dict[str, Path],
                                                             capsys: pytest.CaptureFixture) -> None:
    assert main(["evaluate", "--model", str(models["laser-vfl"]), *tables(example, "new")]) == 2
    err = capsys.readouterr().err
    assert "active party 'bank': its --table has no label column 'defaulted'" in err
    assert "--label COLUMN" in err and "--truth FILE" in err and "label_column" not in err


def test_vanilla_random_names_no_party_for_the_rows_it_guesses(example: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture) -> None:
    model = tmp_path / "vanilla"
    assert main(["fit", *tables(example, "train"), *FIT, "--method", "vanilla-vfl", "--param", "missing=random",
                 "--out", str(model)]) == 0
    assert main(["predict", "--model", str(model), *tables(example, "new"), "--out", str(tmp_path / "p.csv")]) == 0
    assert "a uniformly random class where some party does not hold the row" in capsys.readouterr().err
    df = pd.read_csv(tmp_path / "p.csv", keep_default_na=False)
    places = held(example)
    everywhere = np.array([all(i in places[p] for p in PARTIES) for i in df["customer_id"]])
    assert df["n_parties"].to_numpy().tolist() == [3 if e else 0 for e in everywhere]


def test_fit_messages_name_flags_not_python_arguments(example: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture) -> None:
    base = ["fit", *tables(example, "train"), "--id-column", "customer_id", "--out", str(tmp_path / "m"), "--quiet"]
    cases = {
        ("--label", "default", "--active", "bank"): "active party 'bank': its --table has no label column 'default'",
        ("--label", "defaulted", "--active", "insurer"): "--active 'insurer' is not one of the --table parties",
    }
    for extra, message in cases.items():
        assert main([*base, *extra]) == 2
        err = capsys.readouterr().err
        assert message in err and "label_column" not in err and "active_party" not in err, err
    (tmp_path / "bank.txt").write_text("customer_id,age\n1,2\n")
    argv = [*base, "--label", "defaulted", "--active", "bank"]
    argv[argv.index(f"bank={example / 'train' / 'bank.csv'}")] = f"bank={tmp_path / 'bank.txt'}"
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "cannot tell the format from the file's name; name it .csv" in err and "from_csv" not in err
