"""The partialvfl command: describe, datasets, methods, fit and evaluate end to end."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

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


def test_fit_then_evaluate_remembers_the_protocol(tmp_path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "model"
    assert main(["fit", "--dataset", "digits", "--parties", "4", "--labels", "200", "--aligned", "50",
                 "--train-missing", "mcar:0.2", "--method", "false-vfl-1", "--epochs", "1", "--seed", "3",
                 "--max-train", "400", "--max-test", "150", "--out", str(out), "--quiet"]) == 0
    assert "test set, no test mechanism (no block removed): accuracy" in capsys.readouterr().out
    assert main(["evaluate", "--model", str(out), "--test-missing", "mcar:0.5", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert 0.0 <= res["accuracy"] <= 1.0 and res["n_samples"] == 150 and res["method"] == "false-vfl-1"
    assert sum(v["n"] for v in res["by_observed_parties"].values()) == 150
    assert main(["evaluate", "--model", str(out), "--test-missing", "mcar:0.5", "--seed", "4"]) == 2
    assert "seed 3" in capsys.readouterr().err


# ---------------------------------------------------------------------- light help
HEAVY = ("torch", "grpc")


def _help_argvs() -> list[list[str]]:
    """``[]`` and every command and sub-command of the parser (``party serve``, ``certs init``...)."""
    import argparse

    from partialvfl.cli import build_parser

    def walk(parser: argparse.ArgumentParser, prefix: list[str]) -> list[list[str]]:
        out = [prefix]
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    out += walk(sub, [*prefix, name])
        return out

    return walk(build_parser(), [])


def test_partialvfl_help_imports_neither_torch_nor_grpc() -> None:
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "partialvfl", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "fit" in proc.stdout and "party" in proc.stdout
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "partialvfl.cli" in imported  # the timing lines are there
    heavy = sorted(m for m in imported if m.split(".")[0] in HEAVY)
    assert not heavy, f"partialvfl --help imported {heavy[:5]}"


def test_every_command_help_imports_neither_torch_nor_grpc() -> None:
    argvs = _help_argvs()
    assert ["party", "serve"] in argvs and ["certs", "init"] in argvs and ["fit"] in argvs
    code = textwrap.dedent(f"""
        import contextlib, io, sys
        from partialvfl.cli import main
        for argv in {argvs!r}:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
                main([*argv, "--help"])
        print(sorted({{m.split(".")[0] for m in sys.modules}} & {set(HEAVY)!r}))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]", f"a command's --help imported {proc.stdout.strip()}"


# ---------------------------------------------------------------------- --param and --epochs
def test_one_param_parser_dashes_read_as_underscores() -> None:
    from partialvfl.cli.params import parse_params

    got = parse_params(["batch-train=16", " d_h = 4 ", "fusion=poe", 'encoder_arch="mlp"', "hidden=[8, 8]",
                        "pretrain=false"])
    assert got == {"batch_train": 16, "d_h": 4, "fusion": "poe", "encoder_arch": "mlp", "hidden": [8, 8],
                   "pretrain": False}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_params(["epochs"])


def test_epochs_sets_every_epoch_count_pretraining_included() -> None:
    import argparse

    from partialvfl.cli.params import epoch_params, method_from_args

    args = argparse.Namespace(method="fedhssl", preset="fast", seed=1, quiet=True, epochs=2,
                              param=["pretrain-epochs=7", "lr=0.5"])
    model = method_from_args(args)  # what fit runs, in process and with --federation
    assert model.overrides == {"pretrain_epochs": 2, "epochs": 2, "lr": 0.5} and model.seed == 1
    assert model.resolve_params(None)["local_epochs"] == 1  # local passes per pretraining epoch: left alone

    class NoEpochs:
        name = "no-epochs"

        @classmethod
        def epoch_param_names(cls) -> list[str]:
            return []

    with pytest.raises(ValueError, match="no epoch parameter"):
        epoch_params(NoEpochs, 3)


@pytest.mark.parametrize("option, value, message", [("--party-timeout", "-1", "must be >= 0"),
                                                    ("--party-retries", "-2", "must be >= 0"),
                                                    ("--party-timeout", "soon", "not a number")])
def test_bad_party_timeout_or_retries_are_refused_before_anything_connects(
        tmp_path, capsys: pytest.CaptureFixture, option: str, value: str, message: str) -> None:
    missing = tmp_path / "no-such-federation.toml"  # never read: the parser refuses first
    with pytest.raises(SystemExit) as stop:
        main(["fit", "--federation", str(missing), "--method", "vanilla-vfl", "--out", str(tmp_path / "m"),
              option, value])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert option in err and message in err and "no-such-federation" not in err
