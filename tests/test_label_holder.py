"""``certs init``'s label-holder rule and the docs agree (issue 34, item 3).

``certs init`` made the last party named the label holder (its templates gave every other party the alignment key and
named it ``active_party``), while docs/own-data.md and docs/serving.md named the bank, their label holder, first:
their templates made the telco the label holder and gave the bank the key the label holder must never hold.  Now
``--active PARTY`` names the label holder (default: the last party named, as docs/deployment.md's insurer), the docs
say which, and the templates their ``certs init`` line writes are their own party and federation files' rule."""

from __future__ import annotations

import shlex
import tomllib
from pathlib import Path

import pytest

from partialvfl.cli import main
from test_own_data_doc import blocks

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("doc", ["own-data.md", "serving.md", "deployment.md"])
def test_the_docs_certs_init_makes_the_docs_label_holder(doc: str, tmp_path: Path) -> None:
    text = (ROOT / "docs" / doc).read_text()
    line = next(line for line in text.splitlines() if line.startswith("partialvfl certs init"))
    argv = shlex.split(line.split("#")[0])[1:]
    argv[2] = str(tmp_path / "pki")
    assert main(argv) == 0
    parties = argv[argv.index("--parties") + 1:]
    parties = parties[:next((i for i, a in enumerate(parties) if a.startswith("--")), len(parties))]
    template = tomllib.loads((tmp_path / "pki" / "federation.toml").read_text())
    holder = template["coordinator"]["active_party"]
    assert [p["name"] for p in template["parties"]] == parties
    for name in parties:  # the alignment key goes to the passive parties only
        party = tomllib.loads((tmp_path / "pki" / f"{name}.party.toml").read_text())["party"]
        assert ("alignment_key_file" in party) == (name != holder), name
    files = {info.split("=", 1)[1]: body for info, body in blocks(ROOT / "docs" / doc) if info.startswith("toml file=")}
    if doc == "deployment.md":  # its templates' reader: the insurer, named last, holds the labels
        assert holder == "insurer" and "never to\nthe label holder (the insurer" in text
        return
    federation = tomllib.loads(files["example/federation.toml"])
    assert holder == federation["coordinator"]["active_party"] == "bank"
    assert [p["name"] for p in federation["parties"]] == parties
    for name in parties:
        party = tomllib.loads(files[f"example/{name}.toml"])["party"]
        assert ("alignment_key_file" in party) == (name != holder), name


def test_certs_init_refuses_a_label_holder_it_does_not_name(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["certs", "init", str(tmp_path), "--parties", "bank", "shop", "--active", "telco"]) == 2
    assert capsys.readouterr().err.strip() == "error: --active 'telco' is not one of --parties ['bank', 'shop']"
    assert not (tmp_path / "ca.pem").exists()  # refused before anything is written
