"""One command-line vocabulary: each renamed option's old spelling still works and warns, ``evaluate --party`` takes a
party's name, ``--help`` groups the commands by task, ``--preset``'s help comes from the registry, and output into a
closed pipe ends quietly with status 141."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from partialvfl.cli import build_parser, main
from partialvfl.cli.common import PRESET_HELP, preset_help
from partialvfl.cli.fit import party_index
from partialvfl.cli.vocabulary import CLOSED_PIPE_STATUS, COMMAND_GROUPS
from partialvfl.methods.registry import load_specs, package_methods

ROOT = Path(__file__).resolve().parents[1]
TABLES = ["--table", "bank=b.csv", "--table", "shop=s.csv"]


# ---------------------------------------------------------------------- old spellings warn and work
@pytest.mark.parametrize(("old", "new", "dest", "value"), [
    (["fit", *TABLES, "--id", "cid", "--out", "m"], ["fit", *TABLES, "--id-column", "cid", "--out", "m"],
     "id_column", "cid"),
    (["predict", "--model", "m", "--out", "o.csv", "--id", "cid"],
     ["predict", "--model", "m", "--out", "o.csv", "--id-column", "cid"], "id_column", "cid"),
    (["evaluate", "--model", "m", *TABLES, "--id", "cid"], ["evaluate", "--model", "m", *TABLES, "--id-column", "cid"],
     "id_column", "cid"),
    (["explain", "--model", "m", "--out", "e.csv", "--id", "cid"],
     ["explain", "--model", "m", "--out", "e.csv", "--id-column", "cid"], "id_column", "cid"),
    (["serve", "--model", "m", "--id", "cid"], ["serve", "--model", "m", "--id-column", "cid"], "id_column", "cid"),
    (["serve", "--model", "m", "--deadline-ms", "50"], ["serve", "--model", "m", "--deadline", "0.05"], "deadline",
     0.05),
    (["serve", "--model", "m", "--min-round-ms", "20"], ["serve", "--model", "m", "--min-round", "0.02"], "min_round",
     0.02),
    (["serve", "--model", "m", "--batch-window-ms", "2"], ["serve", "--model", "m", "--batch-window", "0.002"],
     "batch_window", 0.002),
    (["certs", "init", "d", "--parties", "a", "b", "--hmac-key"],
     ["certs", "init", "d", "--parties", "a", "b", "--write-hmac-key"], "hmac_key", True),
])
def test_an_old_spelling_sets_what_the_new_one_sets_and_warns(old: list[str], new: list[str], dest: str, value: object,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    new_args = vars(parser.parse_args(new))
    assert capsys.readouterr().err == "", "the new spelling warns about nothing"
    old_args = vars(parser.parse_args(old))
    err = capsys.readouterr().err
    assert old_args == new_args and old_args[dest] == value
    old_flag = next(a for a in old if a.startswith("--") and a not in new)
    assert f"warning: {old_flag} is deprecated" in err and new[new.index(next(
        a for a in new if a.startswith("--") and a not in old))] in err


def test_no_hmac_key_is_the_default_now_and_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    base = ["certs", "init", "d", "--parties", "a", "b"]
    assert vars(parser.parse_args([*base, "--no-hmac-key"])) == vars(parser.parse_args(base))
    assert parser.parse_args(base).hmac_key is False
    assert "--no-hmac-key is deprecated" in capsys.readouterr().err


def test_the_old_spellings_are_hidden_from_help(capsys: pytest.CaptureFixture[str]) -> None:
    for command, old in (("serve", "--deadline-ms"), ("fit", "--id "), ("predict", "--id "), ("certs init",
        "--hmac-key")):
        with pytest.raises(SystemExit):
            main([*command.split(), "--help"])
        assert old not in capsys.readouterr().out.replace("\n", " ") + " ", (command, old)


def test_serve_http_is_the_http_service_and_party_serve_the_grpc_server(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    assert parser.parse_args(["serve-http", "--model", "m"]).func is parser.parse_args(["serve", "--model", "m"]).func
    with pytest.raises(SystemExit):
        main(["party", "serve", "--help"])
    assert "partialvfl serve" in capsys.readouterr().out.replace("\n", " ")


# ---------------------------------------------------------------------- parties by name
def test_party_index_takes_a_name_and_an_index_with_a_warning(capsys: pytest.CaptureFixture[str]) -> None:
    names = ["bank", "shop", "telco"]
    assert party_index("shop", names) == 1 and capsys.readouterr().err == ""
    assert party_index("2", names) == 2
    assert "--party telco" in capsys.readouterr().err
    for bad in ("3", "insurer", "-1"):
        with pytest.raises(ValueError, match="none of the model's parties: bank, shop, telco"):
            party_index(bad, names)


def test_evaluate_local_mode_takes_the_party_by_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "m"
    assert main(["fit", "--dataset", "digits", "--parties", "2", "--labels", "100", "--aligned", "50", "--method",
                 "x-vfl", "--epochs", "1", "--quiet", "--out", str(model)]) == 0
    capsys.readouterr()
    assert main(["evaluate", "--model", str(model), "--mode", "local", "--party", "party0", "--json"]) == 0
    by_name = json.loads(capsys.readouterr().out)
    assert main(["evaluate", "--model", str(model), "--mode", "local", "--party", "0", "--json"]) == 0
    captured = capsys.readouterr()
    by_index = json.loads(captured.out)
    assert "write --party party0" in captured.err
    assert (by_name["party"], by_name["party_name"]) == (0, "party0")
    assert by_index["accuracy"] == by_name["accuracy"] and by_index["party_name"] == "party0"
    assert main(["evaluate", "--model", str(model), "--mode", "local", "--party", "party7"]) == 2
    assert "none of the model's parties: party0, party1" in capsys.readouterr().err


# ---------------------------------------------------------------------- --help by task
def test_help_lists_every_command_once_under_its_task(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    headings = [line[:-1] for line in out.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert headings == [*COMMAND_GROUPS, "options"]
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    listed = [line.split()[0] for line in out.splitlines() if line.startswith("  ") and not line.startswith("  -")]
    assert sorted(listed) == sorted(sub._name_parser_map.keys() - {"serve-http"})
    assert len(listed) == len(set(listed))
    section = out[out.index("deploy across institutions:"):out.index("serve predictions:")]
    assert "certs" in section and "party" in section


def test_preset_help_names_every_preset_the_registry_declares(capsys: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "1000")  # no line wrapped inside a preset's name
    specs = load_specs()
    presets = {p for name in package_methods() for p in specs[name].params.preset_names}
    text = preset_help()
    assert all(f"{p} (" in text for p in presets) and "default: fast" in text
    assert text == PRESET_HELP, "a preset changed: copy preset_help() into PRESET_HELP (partialvfl/cli/common.py)"
    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    out = capsys.readouterr().out
    assert all(f"{p} (" in out for p in presets)


# ---------------------------------------------------------------------- a closed pipe
def _run_into_closed_pipe(*args: str) -> subprocess.CompletedProcess[bytes]:
    read, write = os.pipe()
    os.close(read)  # the reader has gone before the command writes anything: every write fails, deterministically
    try:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
        return subprocess.run([sys.executable, "-m", "partialvfl", *args], stdout=write, stderr=subprocess.PIPE,
                              env=env, timeout=120, check=False)
    finally:
        os.close(write)


@pytest.mark.parametrize("args", [("methods",), ("datasets",), ("--help",)])
def test_output_into_a_closed_pipe_ends_quietly_with_status_141(args: tuple[str, ...]) -> None:
    done = _run_into_closed_pipe(*args)
    assert b"Traceback" not in done.stderr and b"BrokenPipeError" not in done.stderr, done.stderr.decode()
    # argparse writes --help itself and ignores a failed write, then exits 0; a command's output ends with 141
    assert done.returncode == (0 if args == ("--help",) else CLOSED_PIPE_STATUS)


def test_evaluate_into_head_ends_quietly(tmp_path: Path) -> None:
    model = tmp_path / "m"
    assert main(["fit", "--dataset", "digits", "--parties", "2", "--labels", "100", "--aligned", "50", "--method",
                 "local", "--epochs", "1", "--quiet", "--out", str(model)]) == 0
    done = _run_into_closed_pipe("evaluate", "--model", str(model))
    assert done.returncode == CLOSED_PIPE_STATUS and b"Traceback" not in done.stderr, done.stderr.decode()
