"""Bad input files (issue 23, item 6): one line naming the file, exit code 2, bounded memory.

A binary file, a Parquet file named ``.csv``, a zero-byte file and a gzip bomb given to ``fit --table``; a table
with no rows given to ``fit --table`` and to ``party serve``; a truncated checkpoint given to ``fit --resume``.
"""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pandas as pd
import pytest

from partialvfl.cli import main
from partialvfl.data.tables import check_table_file
from partialvfl.federation.grpc.certs import init_dev_pki


def fit_tables(tmp_path: Path, bad: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    good = tmp_path / "good.csv"
    pd.DataFrame({"id": ["a", "b", "c", "d"], "x": [1.0, 2.0, 3.0, 4.0]}).to_csv(good, index=False)
    capsys.readouterr()
    code = main(["fit", "--table", f"bank={bad}", "--table", f"shop={good}", "--id-column", "id", "--label", "label",
                 "--active", "bank", "--method", "local", "--out", str(tmp_path / "model"), "--quiet"])
    return code, [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]


def write_bomb(path: Path, mb: int) -> None:
    """A small gzip file of a valid CSV that decompresses to ``mb`` MB."""
    with gzip.open(path, "wb", compresslevel=9) as f:
        f.write(b"id,x,label\n")
        block = b"1,0,0\n" * (1 << 17)
        for _ in range(mb * (1 << 20) // len(block)):
            f.write(block)


@pytest.mark.parametrize("case", ["binary", "parquet named csv", "zero bytes", "gzip bomb", "no rows"])
def test_a_bad_table_is_one_line_naming_the_file_and_exit_code_2(case: str, tmp_path, capsys) -> None:
    bad = tmp_path / ("bank.csv.gz" if case == "gzip bomb" else "bank.csv")
    says = {"binary": "cannot read", "parquet named csv": "is a Parquet file: name it .parquet",
            "zero bytes": "is empty (0 bytes)", "gzip bomb": "refused as a compression bomb",
            "no rows": "has no rows"}[case]
    if case == "binary":
        bad.write_bytes(os.urandom(2000))
    elif case == "parquet named csv":
        pd.DataFrame({"id": ["a"], "x": [1.0], "label": [0]}).to_parquet(bad)
    elif case == "zero bytes":
        bad.write_bytes(b"")
    elif case == "gzip bomb":
        write_bomb(bad, 80)
        assert bad.stat().st_size < 400_000
    else:
        bad.write_text("id,x,label\n")
    code, errors = fit_tables(tmp_path, bad, capsys)
    assert code == 2 and len(errors) == 1, errors
    assert str(bad) in errors[0] and says in errors[0], errors[0]


def test_a_compression_bomb_is_refused_in_bounded_memory(tmp_path) -> None:
    bomb = tmp_path / "t.csv.gz"
    write_bomb(bomb, 200)  # 200 MB of valid rows in a few hundred KB
    tracemalloc.start()
    with pytest.raises(ValueError, match="decompresses to more than 64 MB"):
        check_table_file("party 'bank'", bomb, "csv")
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 8 * 2**20, peak  # reads it in 1 MB blocks, counting
    small = tmp_path / "ok.csv.gz"
    with gzip.open(small, "wb") as f:
        f.write(b"id,x\n" + b"".join(f"{i},{i}\n".encode() for i in range(1000)))
    check_table_file("party 'bank'", small, "csv")  # an ordinary compressed table passes


@pytest.mark.slow
def test_party_serve_refuses_a_training_table_without_rows(tmp_path) -> None:
    init_dev_pki(tmp_path, ["bank", "coordinator"])
    (tmp_path / "hmac.key").write_bytes(b"k" * 32)
    (tmp_path / "bank.csv").write_text("id,x\n")
    cfg = tmp_path / "bank.toml"
    cfg.write_text('[party]\nname = "bank"\nindex = 0\nhmac_key_file = "hmac.key"\naddress = "127.0.0.1:0"\n'
                   '[data]\npath = "bank.csv"\nid_column = "id"\n'
                   '[tls]\nca = "ca.pem"\ncert = "bank.pem"\nkey = "bank.key"\n')
    done = subprocess.run([sys.executable, "-m", "partialvfl", "party", "serve", "--config", str(cfg)],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and f"the training table {tmp_path / 'bank.csv'} has no rows" in last


@pytest.mark.parametrize("damage", ["truncated", "empty", "marker"])
def test_a_damaged_checkpoint_with_resume_is_one_line_naming_the_file(damage: str, tmp_path, capsys) -> None:
    out = tmp_path / "model"
    args = ["fit", "--dataset", "digits", "--parties", "2", "--labels", "100", "--method", "vanilla-vfl", "--seed",
            "0", "--out", str(out), "--checkpoint-every", "1", "--param", "epochs=1", "--quiet"]
    assert main(args) == 0
    ck = out / "checkpoints"
    last = sorted(ck.glob("step-*"))[-1] / "coordinator.pt"
    if damage == "marker":
        (ck / "LATEST").write_text("{not json")
        named = ck / "LATEST"
    else:
        last.write_bytes(last.read_bytes()[:1000] if damage == "truncated" else b"")
        named = last
    capsys.readouterr()
    assert main([*args, "--resume"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and str(named) in errors[0], errors
