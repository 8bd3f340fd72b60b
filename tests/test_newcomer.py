"""What a new institution meets first (issue 21, items 5 to 8): the smoke grid's report, the figures, the README's
commands, no path of a developer's machine in the project, the packaging metadata, and what ``fit`` and
``methods`` print."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from partialvfl.cli import main

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```$", re.S | re.M)


# ---------------------------------------------------------------------- item 7: no path of a developer's machine
#: an absolute path into a home, scratch or work directory of one machine (not /usr/share/..., /proc/..., URLs)
MACHINE_PATH = re.compile(r"(?<![\w.~/:-])/(?:work|root|home|tmp|Users|mnt|scratch)/")
SCANNED = ("docs", "benchmarks", "src", "scripts")
TEXT_SUFFIXES = {".md", ".py", ".toml", ".sh", ".txt", ".yaml", ".yml", ".cfg", ".json", ".csv"}


def _scanned_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "pyproject.toml"]
    for top in SCANNED:
        files += [p for p in sorted((ROOT / top).rglob("*")) if p.is_file() and p.suffix in TEXT_SUFFIXES
                  and "__pycache__" not in p.parts]
    return files


def test_the_pattern_flags_machine_paths_and_leaves_system_paths_alone() -> None:
    for bad in ("/work/venv/bin/python x.py", "git -C /work/main archive", "tar -x -C /tmp/base", "/root/.cache",
                "cd /home/ana/partialvfl", "`/tmp/grid`"):
        assert MACHINE_PATH.search(bad), bad
    for fine in ("/usr/share/datasets/fashion-mnist", "/proc/cpuinfo", "https://github.com/a/home/b", "runs/tmp/x",
                 "~/data/", "a/work/b", "/path/to/store", "/dev/null"):
        assert not MACHINE_PATH.search(fine), fine


def test_no_absolute_path_of_a_development_machine_in_the_project() -> None:
    found = []
    for path in _scanned_files():
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if MACHINE_PATH.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}")
    assert not found, "absolute paths of a development machine:\n" + "\n".join(found)


# ---------------------------------------------------------------------- item 6: the README's commands
def test_readme_says_how_to_reach_the_installed_command_before_using_it_bare() -> None:
    text = (ROOT / "README.md").read_text()
    blocks = [(m.start(), m.group(2)) for m in FENCE.finditer(text) if m.group(1).strip() == "bash"]
    first_at, first = blocks[0]
    assert "bash scripts/install.sh" in first
    commands = [ln for ln in first.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert len(commands) == 2  # install + the main job; the test suite
    for command in commands:  # the first block names the environment's programs explicitly
        for program in re.findall(r"(?:^|&& )(\S+)", command):
            assert program in ("bash", ".venv/bin/partialvfl", ".venv/bin/python"), program
    bare = [at for at, body in blocks[1:] if re.search(r"^(partialvfl|python) ", body, re.M)]
    assert bare, "the README uses the bare command somewhere"
    said = text.find("source .venv/bin/activate")
    assert first_at < said < min(bare), "say how to activate .venv after the install and before a bare command"


# ---------------------------------------------------------------------- item 8: packaging metadata
def test_the_license_is_an_spdx_expression_and_setuptools_is_recent_enough_for_it() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["license"] == "MIT"
    needed = [r for r in meta["build-system"]["requires"] if r.startswith("setuptools")]
    assert needed and tuple(int(v) for v in needed[0].split(">=")[1].split(".")) >= (77,)


def test_building_the_metadata_warns_about_nothing(tmp_path: Path) -> None:
    """setuptools (the version the venv has) reads pyproject.toml without a deprecation warning."""
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / "src", tmp_path / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    proc = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c",
                           "from setuptools import setup; setup()", "egg_info", "-e", str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "Deprecat" not in proc.stderr, proc.stderr[-3000:]
    assert "License-Expression: MIT" in next(tmp_path.glob("*.egg-info/PKG-INFO")).read_text()


# ---------------------------------------------------------------------- item 8: what fit and methods print
FIT = ["fit", "--dataset", "digits", "--parties", "4", "--labels", "100", "--aligned", "20", "--max-train", "200",
       "--max-test", "50", "--method", "local", "--epochs", "3"]


def test_fit_says_what_its_test_line_is(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main([*FIT, "--out", str(tmp_path / "m"), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("test set, no test mechanism (no block removed): accuracy ") and "(none)" not in out


def test_fit_shows_either_a_bar_or_epoch_lines_never_both(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from partialvfl.utils import progress

    assert main([*FIT, "--out", str(tmp_path / "a")]) == 0  # stderr is not a terminal here: nothing per epoch
    err = capsys.readouterr().err
    assert "epoch 1:" not in err and "\r" not in err and "it/s" not in err
    assert "[local] train 3 epochs, last: loss=" in err  # one summary line instead
    assert main([*FIT, "--out", str(tmp_path / "b"), "--log-epochs"]) == 0  # asked for: a line per epoch, no bar
    err = capsys.readouterr().err
    assert [ln for ln in err.splitlines() if " epoch " in ln] == [
        ln for ln in err.splitlines() if ln.startswith("[local] train epoch ")] and err.count("train epoch ") == 3
    assert "it/s" not in err and "last: loss=" not in err
    monkeypatch.setattr(progress, "stderr_is_terminal", lambda: True)  # a terminal: the bar, no epoch lines
    assert main([*FIT, "--out", str(tmp_path / "c")]) == 0
    err = capsys.readouterr().err
    assert "local train:" in err and "/3 [" in err and "epoch 1:" not in err


def test_methods_says_which_preset_is_the_default(capsys: pytest.CaptureFixture) -> None:
    assert main(["methods", "--method", "laser-vfl"]) == 0
    out = capsys.readouterr().out
    assert "'fast' is the default" in out and re.search(r"^  parameter +fast \(default\) +paper", out, re.M)
    assert main(["methods", "--json"]) == 0
    import json

    assert {r["default_preset"] for r in json.loads(capsys.readouterr().out)} == {"fast"}


# ---------------------------------------------------------------------- item 5: the smoke grid, figures, counts
def test_a_smoke_report_says_first_that_its_numbers_are_not_results(tmp_path: Path) -> None:
    from partialvfl.bench.report import pipeline_check_notice, write_report
    from partialvfl.bench.store import ResultStore

    rows = [{"grid": "smoke"}, {"grid": "cpu"}]
    assert "not results" in (pipeline_check_notice(rows) or "") and pipeline_check_notice(rows[1:]) is None
    store = _tiny_store(tmp_path / "store", grid="smoke")
    with ResultStore(store) as s:
        assert s.count("done") > 0
    written = write_report(store, tmp_path / "report", figures=False)
    assert written.headline.startswith("smoke run, not results")
    report = (tmp_path / "report" / "report.md").read_text().splitlines()
    assert report[2].startswith("**Smoke run: these numbers are not results.**")
    assert (tmp_path / "report" / "gaps.md").read_text().startswith("**Smoke run")


def _tiny_store(store: Path, grid: str) -> Path:
    """A store holding the rows of a few fake fits of ``grid`` (two methods, FALSE-VFL among them)."""
    from partialvfl.bench.store import ResultStore

    rows = []
    for method, acc in (("false-vfl-1", 0.3), ("vanilla-vfl", 0.6)):
        for seed in (0, 1):
            rows.append({"config_hash": f"{method}{seed}", "cell_hash": f"c{method}{seed}", "grid": grid,
                         "code_version": "t", "method": method, "label": method, "preset": "fast", "overrides": "{}",
                         "params": "{}", "dataset": "digits", "source": "digits", "dataset_config": "{}",
                         "parties": 4, "labels": 100, "aligned": 20, "train_mechanism": "mcar2",
                         "test_mechanism": "mcar0", "seed": seed, "role": "test", "metric": "accuracy",
                         "accuracy": acc + 0.01 * seed, "by_observed": "{}", "n_test": 10, "fit_seconds": 1.0,
                         "predict_seconds": 0.1, "bytes_communicated": 1, "status": "done"})
    with ResultStore(store) as s:
        s.write(rows)
    return store


def test_coinciding_lines_stay_visible_in_the_figures() -> None:
    pytest.importorskip("matplotlib")
    from partialvfl.bench.aggregate import Aggregate
    from partialvfl.bench.figures import figure_for

    def agg(method: str, label: str, test: str) -> Aggregate:
        return Aggregate(dataset="digits", train="mcar2", test=test, label=label, method=method, metric="accuracy",
                         mean=50.0, std=float("nan"), n=1, labeled_only=False, seeds=(0,))

    same = [agg(m, label, t) for m, label in (("false-vfl-1", "FALSE-VFL-I"), ("false-vfl-2", "FALSE-VFL-II"))
            for t in ("mcar0", "mcar5")]  # the two FALSE-VFL lines have exactly the same values
    lines = [ln for ln in figure_for(same, "mcar2").axes[0].get_lines() if ln.get_label() in
             ("FALSE-VFL-I", "FALSE-VFL-II")]
    assert len(lines) == 2
    a, b = lines
    assert list(a.get_xdata()) != list(b.get_xdata())  # shifted apart
    assert (a.get_marker(), a.get_linestyle()) != (b.get_marker(), b.get_linestyle())
    assert a.get_marker() != b.get_marker() and a.get_color() != b.get_color()


def test_docs_state_the_smoke_grids_true_counts() -> None:
    from partialvfl.bench.grid_file import load_grid

    grid = load_grid("smoke")
    fits, rows = len(grid.cells()), grid.n_rows
    docs = (ROOT / "docs" / "benchmarks.md").read_text()
    shipped = next(ln for ln in docs.splitlines() if ln.startswith("| `smoke` |"))
    assert f"{fits} fits" in shipped and f"{rows} rows" in shipped, shipped
    comment = (ROOT / "src" / "partialvfl" / "bench" / "grids" / "smoke.toml").read_text()
    assert f": {fits} fits" in comment and f"\n# {rows} rows" in comment
    assert f"grid 'smoke': {fits} fits; {fits} done" in docs


# ---------------------------------------------------------------------- item 10: benchmarks' figures
#: a predicted label or class index compared with a dataset's integer codes (``data.y``): labels are values
#: (``predict`` returns the model's class labels, ``'9'`` for digits), so such an accuracy can read 0.0
INDEX_VS_CODES = re.compile(r"(?:\.predict\(|\.argmax\().*==\s*\w+\.y\b")


def test_the_pattern_finds_labels_compared_with_integer_codes() -> None:
    for bad in ("(model.predict(test) == test.y).mean()", "float((m.predict_output_local(t, p).argmax(1) == t.y))"):
        assert INDEX_VS_CODES.search(bad), bad
    for fine in ("model.score(test)", "(p_remote.argmax(1) == p_local.argmax(1)).mean()", "y = test.y"):
        assert not INDEX_VS_CODES.search(fine), fine


def test_benchmarks_score_labels_by_value() -> None:
    found = [f"{path.name}:{n}: {line.strip()}" for path in sorted((ROOT / "benchmarks").glob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if INDEX_VS_CODES.search(line)]
    assert not found, "compare labels by value (score, evaluate, metrics_from_predictions):\n" + "\n".join(found)
