"""Equal tuning in the harness (issue 28.2): every entry gets the same search, chosen on validation cells only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from partialvfl.bench.grid import GridError
from partialvfl.bench.grid_file import parse_grid
from partialvfl.bench.report import write_report
from partialvfl.bench.runner import run_grid
from partialvfl.bench.store import ResultStore
from partialvfl.bench.tuning import Tuning, candidate_overrides, choose


def raw_grid(tuning: dict | None = None, **extra: object) -> dict:
    g = {
        "name": "tuned", "seeds": [0, 1], "train_mechanisms": ["mcar2", "mcar5"], "test_mechanisms": ["mcar0"],
        "datasets": [{"name": "digits", "parties": 2, "labels": 100, "aligned": 20, "max_train": 300,
                      "max_test": 100}],
        "methods": [{"name": "local", "overrides": {"epochs": 3, "latent_dim": 8, "encoder_hidden": [16]}}],
        **extra,
    }
    if tuning is not None:
        g["tuning"] = tuning
    return g


def test_candidates_scale_the_resolved_learning_rate() -> None:
    t = Tuning(lr=(0.5, 1.0, 2.0), min_steps=(None, 300))
    cands = candidate_overrides(t, "laser-vfl", "fast", "digits", {"epochs": 5})
    assert len(cands) == t.size == 6
    assert cands[0] == {"epochs": 5, "lr": 0.0015} and cands[3] == {"epochs": 5, "min_steps": 300}  # fast: 3e-3
    assert cands[2] == {"epochs": 5}  # multiplier 1, the entry's own length: the entry itself
    fvl = candidate_overrides(t, "false-vfl-1", "paper", "fashion-mnist", {})
    assert fvl[0]["lr"] == 1e-4  # Table 10's stage-2 lr, 2e-4, halved


def test_choose_on_validation_and_share_with_untuned_mechanisms() -> None:
    t = Tuning(lr=(0.5, 1.0), tune_on=("mcar2",))
    rows = {"a": [{"accuracy": 0.5}], "b": [{"accuracy": 0.7}], "c": [{"accuracy": 0.9}]}
    chosen = choose({("d", 0, "mcar2"): ["a", "b"], ("d", 1, "mcar2"): ["c", "missing"]}, rows, t,
                    ["mcar2", "mcar5"])
    assert chosen == {("d", 0, "mcar2"): 1, ("d", 0, "mcar5"): 1, ("d", 1, "mcar2"): 0, ("d", 1, "mcar5"): 0}


def test_ties_go_to_the_entrys_own_settings_then_the_first_listed() -> None:
    t = Tuning(lr=(0.333, 1.0, 3.0))
    assert t.own_index == 1 and Tuning(lr=(0.5, 2.0)).own_index is None
    assert Tuning(lr=(0.5, 1.0), min_steps=(0, None)).own_index == 3
    rows = {"a": [{"accuracy": 0.5}], "b": [{"accuracy": 0.5}], "c": [{"accuracy": 0.5}], "d": [{"accuracy": 0.6}]}
    assert choose({("d", 0, "mcar2"): ["a", "b", "c"]}, rows, t, ["mcar2"]) == {("d", 0, "mcar2"): 1}
    assert choose({("d", 0, "mcar2"): ["a", "b", "d"]}, rows, t, ["mcar2"]) == {("d", 0, "mcar2"): 2}
    # without the entry's own candidate among the tied best: the first of them
    assert choose({("d", 0, "mcar2"): ["d", "a", "d"]}, rows, t, ["mcar2"]) == {("d", 0, "mcar2"): 0}
    # an untuned mechanism takes the best mean over the tuned ones, with the same rule for ties
    chosen = choose({("d", 0, "mcar2"): ["a", "b", "c"], ("d", 0, "mnar9"): ["c", "b", "a"]}, rows,
                    Tuning(lr=(0.333, 1.0, 3.0), tune_on=("mcar2", "mnar9")), ["mcar2", "mnar9", "mcar5"])
    assert chosen[("d", 0, "mcar5")] == 1


def test_bad_tuning_tables_fail_early() -> None:
    for tuning, message in (({"lr": [0]}, "lr must be a list of distinct positive"),
                            ({"lr": [1.0], "steps": [3]}, "unknown key"),
                            ({"min_steps": [-1]}, "min_steps must be"),
                            ({"tune_on": ["mnar9"]}, "does not train on")):
        with pytest.raises(GridError, match=message):
            parse_grid(raw_grid(tuning))
    with pytest.raises(GridError, match="needs validation = true"):
        parse_grid(raw_grid({"lr": [1.0]}, validation=False))


def test_a_tuned_grid_tests_only_the_candidate_chosen_on_validation(tmp_path: Path) -> None:
    grid = parse_grid(raw_grid({"lr": [0.01, 1.0], "min_steps": [None, 30], "tune_on": ["mcar2"]}))
    summary = run_grid(grid, tmp_path / "store", workers=1, progress=False)
    assert not summary.failed
    # 4 candidates x 1 tuned mechanism, then 2 seeds x 2 test fits (one entry: no variant to choose under mcar5)
    assert len(summary.done) == 4 + 4
    with ResultStore(tmp_path / "store") as s:
        rows = s.rows()
    scores = {json.dumps(r["tuning"]["values"], sort_keys=True): r["accuracy"] for r in rows
              if r["role"] == "validation" and r["train_mechanism"] == "mcar2"}
    assert len(scores) == 4
    best = json.loads(max(scores, key=lambda k: scores[k]))
    assert best["lr"] == 3e-3  # the entry's own lr; 3e-5 learns next to nothing in 3 epochs
    tests = [r for r in rows if r["role"] == "test"]
    assert len(tests) == 4 and {r["train_mechanism"] for r in tests} == {"mcar2", "mcar5"}
    assert all(r["tuning"] == {"entry": 0, "values": best} for r in tests)
    assert {r["params"]["lr"] for r in tests} == {best["lr"]}
    again = run_grid(grid, tmp_path / "store", workers=1, progress=False)
    assert not again.done and len(again.skipped) == 8  # both phases resume
    write_report(tmp_path / "store", tmp_path / "out")
    text = (tmp_path / "out" / "tuning.md").read_text()
    steps = "as entry" if best["min_steps"] is None else best["min_steps"]
    assert f"**lr 0.003, min_steps {steps}:" in text and "lr 3e-05" in text
