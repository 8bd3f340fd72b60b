"""The README is the front door: short, and its first result (the command line and the Python) runs as written."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from partialvfl.cli import main

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else None]


def _blocks(section: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", section, re.S)


def test_the_readme_is_at_most_130_lines_and_links_the_docs_index_license_and_citation() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 130
    for target in ("docs/index.md", "LICENSE", "CITATION.cff", "CONTRIBUTING.md", "docs/deployment.md"):
        assert f"]({target})" in text, target


def test_the_readmes_install_line_names_extras_the_package_declares() -> None:
    import tomllib

    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    (install,) = [line for line in _blocks(_section("Install"), "bash")[1].splitlines() if "pip install" in line]
    named = set(re.search(r'\.\[([^\]]+)\]', install).group(1).split(","))
    assert named and named <= extras


def test_the_methods_table_lists_every_method_the_package_ships() -> None:
    from partialvfl.methods.registry import package_methods

    table = README.read_text().split("| method | what | docs |")[1].split("\n\n")[0]
    for name in package_methods():
        assert f"`{name}`" in table, name


@pytest.mark.slow
def test_the_first_result_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """The README's "A first result": its two commands, then its Python, in a fresh directory."""
    monkeypatch.chdir(tmp_path)
    section = _section("A first result")
    commands = [shlex.split(line) for line in _blocks(section, "bash")[0].splitlines() if line.strip()]
    assert [c[:2] for c in commands] == [["partialvfl", "fit"], ["partialvfl", "evaluate"]]
    for command in commands:
        assert main(command[1:]) == 0, command
    out = capsys.readouterr().out
    assert re.search(r"accuracy 0\.\d+", out), out
    python = _blocks(section, "python")[0]
    exec(compile(python, "README.md", "exec"), {})  # the README's code, as a reader pastes it
    assert re.fullmatch(r"accuracy 0\.\d{3} with half of each test row's parties missing\n", capsys.readouterr().out)
