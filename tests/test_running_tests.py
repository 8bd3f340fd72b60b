"""How the suite is run (issue 37, item 5): README's two test commands, the fast tier and the whole suite, are the
ones CI and the project's configuration agree with."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

from conftest import COSTLIEST_MODULES

ROOT = Path(__file__).resolve().parents[1]
PYTEST = ".venv/bin/python -m pytest"


def readme_test_commands() -> dict[str, str]:
    """README's "Running the tests" block as ``{"fast": command, "full": command}`` (comments stripped)."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Running the tests"):]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.startswith(PYTEST)]
    assert len(commands) == 2, f"two test commands expected, found {commands}"
    fast = [c for c in commands if '-m "not slow"' in c]
    assert len(fast) == 1, f"exactly one command is the fast tier (-m \"not slow\"): {commands}"
    return {"fast": fast[0], "full": next(c for c in commands if c != fast[0])}


def test_ci_runs_the_readmes_whole_suite_and_the_quick_start_names_the_same_command() -> None:
    full = readme_test_commands()["full"]
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith(PYTEST)]
    assert ci == [full], f".ci/run runs {ci}, README's whole suite is {full!r}"
    quick_start = (ROOT / "README.md").read_text().split("```")[1]
    assert full in quick_start.splitlines(), "the README's first block runs another test command"
    assert "-m" not in shlex.split(full)[3:], "the whole suite deselects nothing"


def test_the_slow_marker_is_registered_and_the_fast_tier_deselects_it() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    markers = {m.split(":")[0] for m in meta["tool"]["pytest"]["ini_options"]["markers"]}
    assert "slow" in markers
    assert "-n" not in shlex.split(readme_test_commands()["fast"])[3:], "the fast tier runs as one process"


def test_the_parallel_plugin_the_whole_suite_needs_is_in_the_dev_extra() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    dev = [re.split(r"[<>=!~ ]", r)[0] for r in meta["project"]["optional-dependencies"]["dev"]]
    if "-n" in shlex.split(readme_test_commands()["full"])[3:]:
        assert "pytest-xdist" in dev, "the whole suite runs with -n: pytest-xdist belongs in the dev extra"


def test_the_costliest_modules_named_in_conftest_exist() -> None:
    missing = [name for name in COSTLIEST_MODULES if not (ROOT / "tests" / f"{name}.py").is_file()]
    assert not missing, f"COSTLIEST_MODULES in tests/conftest.py names modules that are gone: {missing}"
