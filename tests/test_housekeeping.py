"""The repository's housekeeping: one spelling of "labeled" in identifiers, the license and the citation file."""

from __future__ import annotations

import io
import tokenize
import tomllib
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_identifiers_spell_labeled_one_way() -> None:
    """Names in code say ``labeled`` (as ``VerticalDataset.labeled``); prose, and the names files and stores already
    carry (a report's ``labelled_only`` column, a stored ``labelled-only`` variant), keep theirs."""
    found = []
    for folder in ("src", "tests", "benchmarks", "scripts"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            text = path.read_text()
            found += [f"{path.relative_to(ROOT)}:{t.start[0]} {t.string}"
                      for t in tokenize.generate_tokens(io.StringIO(text).readline)
                      if t.type == tokenize.NAME and "labelled" in t.string.lower()]
    assert found == []


def test_a_renamed_function_keeps_its_old_name_for_one_release_with_a_warning() -> None:
    import partialvfl.privacy as privacy

    with pytest.warns(DeprecationWarning, match="labelled_rows_attack is now labeled_rows_attack"):
        old = getattr(privacy, "labelled_rows_attack")  # noqa: B009 - the old spelling, by name
    assert old is privacy.labeled_rows_attack
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert privacy.labeled_rows_attack  # the new name does not warn
    with pytest.raises(AttributeError):
        _ = privacy.no_such_attack


def test_license_and_citation_agree_with_the_package() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "MIT"
    license_text = (ROOT / "LICENSE").read_text()
    assert license_text.startswith("MIT License") and "Permission is hereby granted" in license_text
    citation = (ROOT / "CITATION.cff").read_text()
    assert "cff-version: 1.2.0" in citation and "license: MIT" in citation
    assert f'version: "{project["version"]}"' in citation and f"title: {project['name']}" in citation
