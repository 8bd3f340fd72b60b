"""Your own tables from the command line, in one process (issue 12, items 2, 5 and 6): fit, predict new users,
evaluate; what the prediction file holds; exit codes; --help lists every splitter and mechanism; config files with
unknown keys or columns are refused, naming them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from example_tables import PARTIES, write_example
from partialvfl.cli import build_parser, main
from partialvfl.cli.common import MECHANISMS, SPLITTERS
from partialvfl.data.mechanisms import parse_mechanism
from partialvfl.data.splitters import parse_splitter
from partialvfl.federation.grpc.federation_file import LabelSource, load_federation_config, read_labels

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def example(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_example(tmp_path_factory.mktemp("example"), seed=2, n_train=400, n_new=80)


def tables(d: Path, folder: str, bank: str | None = None) -> list[str]:
    out = []
    for p in PARTIES:
        path = d / (bank if p == "bank" and bank else folder) / f"{p}.csv"
        out += ["--table", f"{p}={path}"]
    return out


@pytest.fixture(scope="module")
def model(example: Path) -> Path:
    out = example / "model"
    assert main(["fit", *tables(example, "train"), "--id-column", "customer_id", "--label", "defaulted", "--active",
                 "bank",
                 "--method", "laser-vfl", "--epochs", "3", "--seed", "0", "--out", str(out), "--quiet"]) == 0
    return out


def test_fit_on_tables_then_predict_new_users(example: Path, model: Path, capsys: pytest.CaptureFixture) -> None:
    out = example / "pred.csv"
    assert main(["predict", "--model", str(model), *tables(example, "new"), "--out", str(out)]) == 0
    assert "predictions written to" in capsys.readouterr().err
    df = pd.read_csv(out)
    assert list(df.columns) == ["customer_id", "prediction", "p_0", "p_1", "n_parties", "parties"]
    assert df["prediction"].dtype.kind == "i" and set(df["prediction"]) <= {0, 1}  # integers stay integers
    assert np.allclose(df[["p_0", "p_1"]].sum(axis=1), 1.0)
    assert list(df["customer_id"]) == sorted(df["customer_id"])
    new_ids = set().union(*(set(pd.read_csv(example / "new" / f"{p}.csv")["customer_id"]) for p in PARTIES))
    assert set(df["customer_id"]) == new_ids
    shop = set(pd.read_csv(example / "new" / "shop.csv")["customer_id"])
    for _, row in df.iterrows():
        used = row["parties"].split(";")
        assert len(used) == row["n_parties"] and ("shop" in used) == (row["customer_id"] in shop)


def test_evaluate_tables_that_carry_the_label(example: Path, model: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["evaluate", "--model", str(model), *tables(example, "new", bank="outcomes"), "--json"]) == 0
    import json

    res = json.loads(capsys.readouterr().out)
    n = len(pd.read_csv(example / "outcomes" / "bank.csv"))
    assert res["n_samples"] == n and 0.5 < res["accuracy"] <= 1.0 and res["unseen_classes"] == []


def test_predict_names_columns_it_ignores_and_refuses_missing_ones(example: Path, model: Path, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture) -> None:
    # the outcomes table has the label column: predict ignores it (and says so)
    assert main(["predict", "--model", str(model), *tables(example, "new", bank="outcomes"),
                 "--out", str(tmp_path / "p.csv")]) == 0
    assert "party 'bank': columns ['defaulted'] are not used by the model" in capsys.readouterr().err
    shop = pd.read_csv(example / "new" / "shop.csv").drop(columns=["share_discount"])
    shop.to_csv(tmp_path / "shop.csv", index=False)
    args = tables(example, "new")
    args[args.index(f"shop={example / 'new' / 'shop.csv'}")] = f"shop={tmp_path / 'shop.csv'}"
    assert main(["predict", "--model", str(model), *args, "--out", str(tmp_path / "p.csv")]) == 2
    assert "party 'shop': feature column 'share_discount' not found" in capsys.readouterr().err
    assert main(["predict", "--model", str(model), *args[:4], "--out", str(tmp_path / "p.csv")]) == 2
    assert "no --table for ['telco']" in capsys.readouterr().err


def test_predict_reads_each_table_once(example: Path, model: Path, tmp_path: Path, capsys: pytest.CaptureFixture,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The columns predict ignores are named from the one read of each table (a Parquet file is parsed once)."""
    pd.read_csv(example / "outcomes" / "bank.csv").to_parquet(tmp_path / "bank.parquet")
    args = tables(example, "new")
    args[args.index(f"bank={example / 'new' / 'bank.csv'}")] = f"bank={tmp_path / 'bank.parquet'}"
    paths = {str(Path(a.split("=", 1)[1])) for a in args[1::2]}
    reads: list[str] = []
    for reader in ("read_csv", "read_parquet"):
        def counted(path: object, *a: object, _real: object = getattr(pd, reader), **k: object) -> object:
            if str(path) in paths:
                reads.append(str(path))
            return _real(path, *a, **k)  # type: ignore[operator]
        monkeypatch.setattr(pd, reader, counted)
    assert main(["predict", "--model", str(model), *args, "--out", str(tmp_path / "p.csv")]) == 0
    assert "party 'bank': columns ['defaulted'] are not used by the model" in capsys.readouterr().err
    assert sorted(reads) == sorted(paths)


def test_fit_with_tables_refuses_protocol_options(example: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture) -> None:
    assert main(["fit", *tables(example, "train"), "--id-column", "customer_id", "--label", "defaulted", "--active",
                 "bank",
                 "--labels", "200", "--out", str(tmp_path / "m")]) == 2
    assert "--labels belong to the benchmark protocol" in capsys.readouterr().err
    assert main(["fit", *tables(example, "train"), "--id-column", "customer_id", "--label", "defaulted", "--active",
                 "bank",
                 "--max-train", "10", "--splitter", "grid", "--train-missing", "mcar5", "--seed", "3",
                 "--out", str(tmp_path / "m")]) == 2  # --seed applies to tables too: not named
    assert "--train-missing, --splitter, --max-train belong to" in capsys.readouterr().err
    assert main(["fit", *tables(example, "train"), "--out", str(tmp_path / "m")]) == 2
    assert "fit --table needs --id-column COLUMN, --label COLUMN and --active PARTY" in capsys.readouterr().err


# ---------------------------------------------------------------------- the federation's labels: integers
def test_federation_label_reader_keeps_integer_labels(tmp_path: Path) -> None:
    (tmp_path / "labels.csv").write_text("id,y\na,0\nb,\nc,9\nd,3\n")  # a gap: pandas reads the column as floats
    ids, y, task = read_labels(LabelSource(tmp_path / "labels.csv", "id", "y"))
    assert task.classes == (0, 3, 9) and all(type(c) is int for c in task.classes)  # was (0.0, 3.0, 9.0)
    assert ids.tolist() == ["a", "c", "d"] and y.tolist() == [0, 2, 1]


# ---------------------------------------------------------------------- help
def _help(argv: list[str]) -> str:
    proc = subprocess.run([sys.executable, "-m", "partialvfl", *argv, "--help"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return " ".join(proc.stdout.split())


@pytest.mark.slow
def test_help_lists_every_splitter_and_mechanism_the_parsers_know() -> None:
    text = _help(["describe"])
    fills = {"P": "0.5", "K": "1", "K1": "0", "K2": "1", "T": "0.5", "D": "0.1", "B": "0.5", "A": "2", "RxC": "2x2",
             "G1;G2;...": "0-1;2"}
    for form in MECHANISMS:
        assert form in text, form
        parse_mechanism(re.sub(r"\b(P|K1|K2|K|T|D|B|A)\b", lambda m: fills[m.group(1)], form))  # a real form
    for form in SPLITTERS:
        assert form in text, form
        parse_splitter(form.replace("RxC", fills["RxC"]).replace("G1;G2;...", fills["G1;G2;..."])
                       .replace("alpha=A", "alpha=2"))
    # and nothing the parsers know is missing: every short name and every parametrised family
    from partialvfl.data.mechanisms import _PARAMETRISED, _SHORT
    from partialvfl.data.splitters import _SPLITTER_FORMS

    assert set(_SHORT) | set(_PARAMETRISED) | {"mcar:P", "mnar:P", "absent:K"} <= set(MECHANISMS)
    known = re.findall(r"'([^']+)'", re.sub(r"\([^)]*\)", "", _SPLITTER_FORMS))  # the parser's list, no remarks
    assert {"columns:G1;G2;..." if f.startswith("columns:") else f for f in known} == set(SPLITTERS)
    assert "--table" in _help(["fit"]) and "--allow-prior-only" in _help(["predict"])


def test_every_command_is_in_the_parser_and_the_docs() -> None:
    sub = build_parser()._subparsers._group_actions[0]  # type: ignore[union-attr]
    commands = {a.dest for a in sub._choices_actions}  # each command under its name, not its aliases
    cli_page = (ROOT / "docs" / "cli.md").read_text()
    for c in commands:
        assert f"partialvfl {c}" in cli_page, c
    deployment = (ROOT / "docs" / "deployment.md").read_text()
    assert "not wired" not in deployment and "partialvfl fit --federation" in deployment


# ---------------------------------------------------------------------- configuration files
def test_federation_file_unknown_keys_are_errors(tmp_path: Path) -> None:
    base = ('[coordinator]\nactive_party = "a"\n[tls]\nca = "c"\ncert = "c"\nkey = "k"\n'
            '[[parties]]\nname = "a"\naddress = "x:1"\n')
    (tmp_path / "f.toml").write_text(base)
    assert load_federation_config(tmp_path / "f.toml").active_party == 0
    for extra, message in (('[coordinator]\ndeadline = 5\n', r"unknown key\(s\) \['deadline'\] in \[coordinator\]"),
                           ('[label]\npath = "x"\n', r"unknown section \[label\]"),
                           ('[[parties]]\nname = "b"\naddres = "y:1"\n',
                            r"unknown key\(s\) \['addres'\] in \[parties\]")):
        text = base.replace("[coordinator]\n", extra) if extra.startswith("[coordinator]") else base + extra
        (tmp_path / "f.toml").write_text(text)
        with pytest.raises(ValueError, match=message):
            load_federation_config(tmp_path / "f.toml")


def test_party_file_unknown_keys_are_errors(tmp_path: Path) -> None:
    from partialvfl.federation.grpc.party_config import load_party_config

    text = ('[party]\nname = "a"\nindex = 0\nhmac_key_file = "h"\n[data]\npath = "t.csv"\nid_column = "id"\n'
            'exclude_colums = ["label"]\n[tls]\nca = "c"\ncert = "c"\nkey = "k"\n')
    (tmp_path / "p.toml").write_text(text)
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['exclude_colums'\] in \[data\]"):
        load_party_config(tmp_path / "p.toml")


def test_fit_and_evaluate_on_tables_run_with_the_threads_given(example: Path, model: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from partialvfl.methods import VFLMethod
    from partialvfl.methods import evaluation as evaluation_module

    seen: list[tuple[str, int]] = []
    fit, evaluate = VFLMethod.fit, evaluation_module.evaluate

    def recording_fit(self, *a, **kw):
        seen.append(("fit", torch.get_num_threads()))
        return fit(self, *a, **kw)

    def recording_evaluate(*a, **kw):
        seen.append(("evaluate", torch.get_num_threads()))
        return evaluate(*a, **kw)

    monkeypatch.setattr(VFLMethod, "fit", recording_fit)
    monkeypatch.setattr(evaluation_module, "evaluate", recording_evaluate)
    before = torch.get_num_threads()
    want = 2 if before == 1 else 1  # a number the process does not already use
    assert main(["fit", *tables(example, "train"), "--id-column", "customer_id", "--label", "defaulted", "--active",
                 "bank",
                 "--method", "vanilla-vfl", "--epochs", "1", "--out", str(tmp_path / "m"), "--quiet",
                 "--threads", str(want)]) == 0
    assert main(["evaluate", "--model", str(model), *tables(example, "new", bank="outcomes"), "--threads",
                 str(want)]) == 0
    assert seen == [("fit", want), ("evaluate", want)] and torch.get_num_threads() == before
