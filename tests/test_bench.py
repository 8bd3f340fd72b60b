"""The benchmark harness: grids, the results store, resumable parallel runs, reports in the paper's layout."""

from __future__ import annotations

import math
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from partialvfl.bench.aggregate import is_validation
from partialvfl.bench.cell import variant_of
from partialvfl.bench.grid import GridError
from partialvfl.bench.grid_file import load_grid, parse_grid, shipped_grids
from partialvfl.bench.paper_results import PAPER_RATIOS, PAPER_RESULTS, paper_accuracy, paper_ratio
from partialvfl.bench.report import (
    aggregate,
    gap_summary,
    paper_comparison,
    robustness_ratios,
    write_report,
)
from partialvfl.bench.runner import run_grid
from partialvfl.bench.store import ResultStore

REPO_SRC = Path(__file__).resolve().parents[1] / "src"

# A method that trains nothing (sleeps ``sleep`` seconds, optionally fails) and predicts seeded noise; it talks to
# party 0 once so the store has bytes to count.  Written to a file so a subprocess can import it too.  With
# BENCH_DUMMY_STALL set to "DIR:N", the fits after the first N (counted by files in DIR) block until the process is
# killed, so a test can kill a grid mid-way without racing the clock.
DUMMY_MODULE = textwrap.dedent('''
    import os
    import time
    import uuid
    from pathlib import Path

    import numpy as np
    import torch

    from partialvfl.federation import MessageSpec, PartyProgram, Reply, TensorSpec, register_program
    from partialvfl.methods.base import VFLMethod
    from partialvfl.methods.params import inferred_space
    from partialvfl.methods.registry import MethodSpec, register_spec
    from partialvfl.methods.training import Stage


    @register_program
    class _EchoParty(PartyProgram):
        program_name = "test/bench-echo"
        messages = {"echo": MessageSpec(request=[TensorSpec("x", "float32", ("N",))],
                                        reply=[TensorSpec("x", "float32", ("N",))])}

        def on_echo(self, request):
            return Reply({"x": request.tensors["x"] * 2})


    class BenchDummy(VFLMethod):
        name = "bench-dummy"
        party_program = "test/bench-echo"

        @classmethod
        def default_params(cls):
            return {"sleep": 0.0, "fail": False, "pretrain": True, "skill": 0.5}

        def _party_config(self, party):
            return {}

        def _fit(self, view, handle, loop):
            if self.params_["fail"]:
                raise RuntimeError("dummy failure on purpose")
            time.sleep(self.params_["sleep"])
            if os.environ.get("BENCH_DUMMY_STALL"):
                folder, n = os.environ["BENCH_DUMMY_STALL"].rsplit(":", 1)
                (Path(folder) / uuid.uuid4().hex).touch()
                if len(os.listdir(folder)) > int(n):
                    time.sleep(3600)  # until killed

            def step(item, rng):
                self.transport.call(0, "echo", {"x": torch.zeros(25)})
                return {"loss": (0.0, 1.0)}

            loop.run(Stage("train", 1, lambda epoch, rng: [0], step, np.random.default_rng(0)))

        def _predict(self, view, handle, rows):
            rng = np.random.default_rng(self.seed)
            c = self.index_.task.n_classes
            p = rng.random((len(rows), c))
            right = rng.random(len(rows)) < self.params_["skill"]
            p[right, view.y[rows][right].astype(int)] += 10.0
            return p / p.sum(1, keepdims=True)


    SPACE = inferred_space(BenchDummy.default_params(), {p: lambda ds: {} for p in ("fast", "paper")})
    register_spec(MethodSpec("bench-dummy", "a test method", f"{__name__}:BenchDummy", SPACE))
''')


@pytest.fixture(scope="session")
def dummy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("dummy")
    (d / "bench_dummy_method.py").write_text(DUMMY_MODULE)
    sys.path.insert(0, str(d))
    return d


def _grid_file(path: Path, *, sleep: float = 0.0, seeds: str = "[0, 1]", extra_methods: str = "",
               validation: bool = False) -> Path:
    path.write_text(textwrap.dedent(f'''
        name = "dummy"
        seeds = {seeds}
        validation = {str(validation).lower()}
        train_mechanisms = ["mcar2", "mcar5"]
        test_mechanisms = ["mcar0", "mcar5", "mar1"]
        imports = ["bench_dummy_method"]

        [[datasets]]
        name = "digits"
        parties = 4
        labels = 60
        aligned = 10
        max_train = 200
        max_test = 100

        [[methods]]
        name = "bench-dummy"
        overrides = {{ sleep = {sleep} }}
    ''') + extra_methods)
    return path


# ---------------------------------------------------------------------- grids
def test_shipped_grids_load_and_expand() -> None:
    assert {"smoke", "cpu", "paper"} <= set(shipped_grids())
    smoke = load_grid("smoke")
    cells = smoke.cells()
    per_seed = len(smoke.datasets) * len(smoke.methods) * len(smoke.train_mechanisms)
    validation = [c for c in cells if c.role == "validation"]
    assert len(validation) == per_seed and all(c.test_mechanisms == ("validation",) for c in validation)
    assert cells[:per_seed] == validation  # selection fits first: a partial run can already choose variants
    assert len(cells) == per_seed * (len(smoke.seeds) + 1)
    assert len({c.key for c in cells}) == len(cells)
    row_keys = {c.row_key(t) for c in cells for t in c.test_mechanisms}
    assert len(row_keys) == smoke.n_rows
    paper = load_grid("paper")
    assert paper.train_mechanisms == ("mcar2", "mcar5", "mar1", "mar2", "mnar7", "mnar9")
    assert paper.test_mechanisms == ("mcar0", "mcar2", "mcar5", "mar1", "mar2", "mnar7", "mnar9")
    load_grid("cpu")


_BENCHMARK_GRIDS = sorted(str(p) for p in (Path(__file__).parent.parent / "benchmarks" / "grids").glob("*.toml"))


@pytest.mark.parametrize("name", ["smoke", "cpu", "paper", "ablation-k", "ablation-alpha", "fashion-mnist-full",
                                  *_BENCHMARK_GRIDS])
def test_shipped_grid_methods_accept_their_presets_and_overrides(name: str) -> None:
    from partialvfl.methods import get_method

    grid = load_grid(name)
    for method in grid.methods:
        for dataset in grid.datasets:
            get_method(method.name)(method.preset, **method.overrides_for(dataset.name))  # raises on a bad name


def _raw(**changes: object) -> dict:
    raw = {
        "seeds": [0], "train_mechanisms": ["mcar2"], "test_mechanisms": ["mcar0"],
        "datasets": [{"name": "digits", "parties": 4, "labels": 50, "aligned": 10}],
        "methods": [{"name": "local"}],
    }
    raw.update(changes)
    return raw


@pytest.mark.parametrize(("changes", "message"), [
    ({"test_mechanisms": ["mcar9x"]}, "test_mechanisms"),
    ({"seeds": [0, 0]}, "seeds"),
    ({"datasets": [{"name": "digits", "labels": 10, "aligned": 20}]}, "aligned (20) cannot exceed labels (10)"),
    ({"datasets": [{"name": "digits", "partys": 3}]}, "unknown key(s) partys"),
    ({"methods": [{"name": "local"}, {"name": "local", "label": "again"}]}, "same fit"),
    ({"method": []}, "unknown key(s) method"),
])
def test_bad_grids_fail_early_naming_the_fault(changes: dict, message: str) -> None:
    with pytest.raises(GridError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_grid(_raw(**changes), source="g.toml")


def test_yaml_grid_reads_like_toml(tmp_path: Path) -> None:
    yaml = pytest.importorskip("yaml")
    (tmp_path / "g.yaml").write_text(yaml.safe_dump(_raw(name="y")))
    grid = load_grid(tmp_path / "g.yaml")
    assert grid.name == "y" and [c.key for c in grid.cells()] == [c.key for c in parse_grid(_raw()).cells()]


def test_dataset_seeds_override_the_grid_seeds() -> None:
    datasets = [{"name": "digits", "labels": 50, "aligned": 10}, {"name": "optdigits", "seeds": [7], "labels": 50,
                                                                  "aligned": 10}]
    cells = parse_grid(_raw(seeds=[0, 1], datasets=datasets)).cells()
    assert sorted((c.dataset.name, c.seed) for c in cells if c.role == "test") == [("digits", 0), ("digits", 1),
                                                                                    ("optdigits", 7)]
    assert sorted((c.dataset.name, c.seed) for c in cells if c.role == "validation") == [("digits", 0),
                                                                                          ("optdigits", 7)]


def test_hash_ignores_key_order_and_label_but_not_overrides() -> None:
    a = parse_grid(_raw(methods=[{"name": "local", "overrides": {"epochs": 2, "lr": 0.1}}])).cells()[0]
    b = parse_grid(_raw(methods=[{"name": "local", "label": "L", "overrides": {"lr": 0.1, "epochs": 2}}])).cells()[0]
    c = parse_grid(_raw(methods=[{"name": "local", "overrides": {"epochs": 3, "lr": 0.1}}])).cells()[0]
    assert a.key == b.key and a.row_key("mcar0") == b.row_key("mcar0")
    assert a.key != c.key


def test_variant_flag() -> None:
    assert variant_of({"pretrain": False}) == "labelled-only"
    assert variant_of({"pretrain": "none"}) == "labelled-only"
    assert variant_of({"pretrain": True}) is None
    assert variant_of({"epochs": 3}) is None


# ---------------------------------------------------------------------- store
def _row(key: str, **kw: object) -> dict:
    base = dict(config_hash=key, cell_hash="c" + key, method="m", dataset="d", train_mechanism="mcar2",
                test_mechanism="mcar0", seed=0, status="done", metric="accuracy", accuracy=0.5,
                started_at="2026-01-01T00:00:00+00:00", finished_at="2026-01-01T00:09:00+00:00", hostname="box")
    base.update(kw)
    return base


def test_store_upserts_by_key_and_is_wal(tmp_path: Path) -> None:
    with ResultStore(tmp_path) as s:
        s.write([_row("a"), _row("b")])
        s.write([_row("a", accuracy=0.9)])
        assert s.count() == 2
        assert {r["config_hash"]: r["accuracy"] for r in s.rows()} == {"a": 0.9, "b": 0.5}
        with pytest.raises(ValueError, match="status"):
            s.write([_row("c", status="running")])
        with pytest.raises(ValueError, match="unknown result column"):
            s.write([_row("c", colour="red")])
    mode = sqlite3.connect(tmp_path / "results.sqlite").execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"


def _writer(directory: str, prefix: str, n: int) -> None:
    with ResultStore(directory) as s:
        for i in range(n):
            s.write([_row(f"{prefix}{i}"), _row(f"shared{i}", accuracy=0.1)])


def test_two_processes_writing_one_store(tmp_path: Path) -> None:
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), p, 40)) for p in ("x", "y")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    with ResultStore(tmp_path) as s:
        keys = [r["config_hash"] for r in s.rows()]
    assert len(keys) == len(set(keys)) == 120
    assert sqlite3.connect(tmp_path / "results.sqlite").execute("PRAGMA integrity_check").fetchone()[0] == "ok"


# ---------------------------------------------------------------------- runner
def test_run_records_results_failures_and_skips(tmp_path: Path, dummy_dir: Path) -> None:
    grid = _grid_file(tmp_path / "g.toml", seeds="[0]", extra_methods=textwrap.dedent('''
        [[methods]]
        name = "bench-dummy"
        label = "broken"
        overrides = { fail = true }
    '''))
    store = tmp_path / "store"
    first = run_grid(grid, store, workers=1, progress=False)
    assert len(first.done) == 2 and len(first.failed) == 2 and not first.skipped
    assert "dummy failure on purpose" in first.failed[0][1]
    assert "FAILED digits/broken/mcar2/seed0: RuntimeError: dummy failure on purpose" in first.text()
    with ResultStore(store) as s:
        done, failed = s.rows(status="done"), s.rows(status="failed")
    assert len(done) == 6 and len(failed) == 6
    r = done[0]
    assert r["bytes_communicated"] == 2 * 25 * 4  # the echo request and its reply (party 0 is not the coordinator)
    assert r["fit_seconds"] >= 0 and r["predict_seconds"] >= 0 and r["hostname"] and r["code_version"]
    assert set(r["by_observed"]) <= {"0", "1", "2", "3", "4"} and r["n_test"] == 100
    assert r["variant"] is None and r["params"]["pretrain"] is True
    # rerun: the done cells are skipped, the failed ones are retried (and fail again)
    second = run_grid(grid, store, workers=1, progress=False)
    assert len(second.skipped) == 2 and len(second.failed) == 2 and not second.done
    forced = run_grid(grid, store, workers=1, progress=False, force=True)
    assert len(forced.done) == 2
    with ResultStore(store) as s:
        assert s.count() == 12


@pytest.mark.slow
def test_resume_after_kill_loses_and_duplicates_nothing(tmp_path: Path, dummy_dir: Path) -> None:
    grid = _grid_file(tmp_path / "g.toml", seeds="[0, 1, 2]")  # 6 fits
    store = tmp_path / "store"
    (tmp_path / "fits").mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(dummy_dir), str(REPO_SRC)]), "OMP_NUM_THREADS": "1",
           "BENCH_DUMMY_STALL": f"{tmp_path / 'fits'}:2"}  # the third fit blocks: the kill comes mid-grid
    proc = subprocess.Popen(
        [sys.executable, "-m", "partialvfl", "bench", "--config", str(grid), "--store", str(store),
         "--workers", "1", "--quiet"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    db = store / "results.sqlite"
    deadline = time.time() + 600  # patience for a loaded machine; the stalled third fit makes it no race
    n_before = 0
    while time.time() < deadline and proc.poll() is None:
        if db.exists():
            try:
                n_before = sqlite3.connect(db).execute("SELECT COUNT(*) FROM results").fetchone()[0]
            except sqlite3.OperationalError:
                n_before = 0
            if n_before >= 6:  # at least two fits (3 test mechanisms each) are in
                break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    with ResultStore(store) as s:
        before = {r["config_hash"]: r["finished_at"] for r in s.rows()}
    assert 6 <= len(before) < 18 and len(before) % 3 == 0  # whole fits only, and the kill came mid-grid

    summary = run_grid(grid, store, workers=1, progress=False)
    assert len(summary.skipped) == len(before) // 3
    assert len(summary.done) == 6 - len(before) // 3 and not summary.failed
    with ResultStore(store) as s:
        rows = s.rows(status=None)
    keys = [r["config_hash"] for r in rows]
    assert len(keys) == len(set(keys)) == 18
    assert all(r["status"] == "done" for r in rows)
    after = {r["config_hash"]: r["finished_at"] for r in rows}
    assert all(after[k] == v for k, v in before.items())  # nothing finished before the kill was recomputed
    cells = {(r["train_mechanism"], r["seed"]) for r in rows}
    assert cells == {(t, s) for t in ("mcar2", "mcar5") for s in (0, 1, 2)}


# ---------------------------------------------------------------------- report on a hand-made store
# (train, test) -> entry -> accuracies (%) of seeds 0, 1, 2; vanilla has a pretrained and a labelled-only variant.
HAND = {
    ("mcar2", "mcar0"): {"f1": [80, 82, 84], "f2": [70, 70, 70], "van": [60, 62, 64], "van-lab": [65, 66, 67],
                         "plug": [50, 55, 60]},
    ("mcar2", "mnar7"): {"f1": [60, 60, 60], "f2": [61, 62, 63], "van": [50, 50, 50], "van-lab": [40, 40, 40],
                         "plug": [70, 71, 72]},
    ("mcar5", "mcar0"): {"f1": [78, 78, 78], "f2": [70, 71, 72], "van": [55, 55, 55], "van-lab": [33, 33, 33],
                         "plug": [44, 44, 44]},
    ("mcar5", "mnar7"): {"f1": [66, 66, 66], "f2": [62, 62, 62], "van": [45, 45, 45], "van-lab": [48, 48, 48],
                         "plug": [71, 71, 71]},
}
ENTRIES = {
    "f1": ("false-vfl-1", {}, None), "f2": ("false-vfl-2", {}, None),
    "van": ("vanilla-vfl", {"pretrain": True}, None), "van-lab": ("vanilla-vfl", {"pretrain": False}, "labelled-only"),
    "plug": ("plug-vfl", {}, None),
}


def _hand_store(directory: Path) -> None:
    rows = []
    for (train, test), entries in HAND.items():
        for entry, values in entries.items():
            method, overrides, variant = ENTRIES[entry]
            for seed, v in enumerate(values):
                key = f"{train}-{test}-{entry}-{seed}"
                rows.append(_row(key, cell_hash=f"{train}-{entry}-{seed}", method=method, label=method,
                                 overrides=overrides, variant=variant, dataset="isolet", train_mechanism=train,
                                 test_mechanism=test, seed=seed, accuracy=v / 100))
    rows.append(_row("broken", method="plug-vfl", dataset="isolet", status="failed", accuracy=None, error="boom"))
    with ResultStore(directory) as s:
        s.write(rows)


def test_report_numbers_match_hand_computation(tmp_path: Path) -> None:
    _hand_store(tmp_path / "store")
    with ResultStore(tmp_path / "store") as s:
        aggs = aggregate(s.rows(status=None))
    at = {(a.train, a.test, a.method): a for a in aggs}
    a = at[("mcar2", "mcar0", "false-vfl-1")]
    assert a.mean == pytest.approx(82.0) and a.std == pytest.approx(2.0) and a.n == 3 and not a.starred
    a = at[("mcar2", "mcar0", "plug-vfl")]
    assert a.mean == pytest.approx(55.0) and a.std == pytest.approx(5.0)
    v = at[("mcar2", "mcar0", "vanilla-vfl")]  # labelled-only (66) beat pretrained (62): shown with *
    assert v.mean == pytest.approx(66.0) and v.std == pytest.approx(1.0) and v.starred and v.variants == 2
    v = at[("mcar2", "mnar7", "vanilla-vfl")]  # pretrained (50) beat labelled-only (40): no *
    assert v.mean == pytest.approx(50.0) and not v.starred

    g = gap_summary(aggs)
    gaps = {(c["train"], c["test"]): c["gap"] for c in g.configs}
    assert gaps == pytest.approx({("mcar2", "mcar0"): 16.0, ("mcar2", "mnar7"): -9.0,
                                  ("mcar5", "mcar0"): 23.0, ("mcar5", "mnar7"): -5.0})
    assert (g.wins, g.total) == (2, 4)
    assert g.mean_gap() == pytest.approx(6.25) and g.mean_gap(wins_only=True) == pytest.approx(19.5)
    assert g.by("train") == pytest.approx({"mcar2": 3.5, "mcar5": 9.0})
    assert g.by("test") == pytest.approx({"mcar0": 19.5, "mnar7": -7.0})
    assert g.by("dataset") == pytest.approx({"isolet": 6.25})

    ratios = {(r["method"], r["test"]): r["ratio"] for r in robustness_ratios(aggs)}
    assert ratios[("false-vfl-1", "mcar0")] == pytest.approx(100 * 78 / 82)
    assert ratios[("vanilla-vfl", "mcar0")] == pytest.approx(100 * 55 / 66)  # best variants on both sides
    assert ratios[("plug-vfl", "mnar7")] == pytest.approx(100 * 71 / 71)

    comparison = paper_comparison(aggs, robustness_ratios(aggs))
    comp = {(c["table"], c["train"], c["method"], c["test"]): c for c in comparison}
    c = comp[("accuracy", "mcar2", "FALSE-VFL-I", "mcar0")]
    assert c["paper"] == 86.3 and c["diff"] == pytest.approx(82.0 - 86.3)
    c = comp[("ratio", "mcar5/mcar2", "FALSE-VFL-I", "mcar0")]
    assert c["paper"] == 96.6 and c["diff"] == pytest.approx(100 * 78 / 82 - 96.6)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0, 1), min_size=1, max_size=5), st.lists(st.floats(0, 1), min_size=1, max_size=5))
def test_aggregate_keeps_the_better_variant(pretrained: list[float], labeled: list[float]) -> None:
    rows = [_row(f"p{s}", method="laser-vfl", overrides={"pretrain": True}, seed=s, accuracy=v)
            for s, v in enumerate(pretrained)]
    rows += [_row(f"l{s}", method="laser-vfl", overrides={"pretrain": False}, variant="labelled-only", seed=s,
                  accuracy=v) for s, v in enumerate(labeled)]
    (a,) = aggregate(rows)
    means = {False: 100 * np.mean(pretrained), True: 100 * np.mean(labeled)}
    # two means a rounding apart (the same values summed in another order) are a tie: its rule has its own test
    assume(abs(means[True] - means[False]) > 1e-9)
    assert a.mean == pytest.approx(max(means.values()))
    assert a.starred == (means[True] > means[False]) and a.variants == 2
    chosen = labeled if a.starred else pretrained
    assert a.n == len(chosen)
    if len(chosen) > 1:
        assert a.std == pytest.approx(100 * np.std(chosen, ddof=1), abs=1e-9)
    else:
        assert math.isnan(a.std)


def test_regression_rows_report_rmse_with_lower_better() -> None:
    rows = [_row(f"{m}{s}", method=m, label=m, dataset="reg", metric="rmse", accuracy=None, rmse=v, seed=s)
            for m, values in (("false-vfl-1", [1.0, 1.2]), ("laser-vfl", [1.5, 1.7])) for s, v in enumerate(values)]
    aggs = aggregate(rows)
    assert {a.method: round(a.mean, 6) for a in aggs} == {"false-vfl-1": 1.1, "laser-vfl": 1.6}
    g = gap_summary(aggs)
    assert g.configs[0]["gap"] == pytest.approx(0.5) and g.wins == 1  # lower RMSE wins: a positive gap


def test_written_report_has_paper_layout(tmp_path: Path) -> None:
    _hand_store(tmp_path / "store")
    written = write_report(tmp_path / "store", tmp_path / "out")
    names = {p.name for p in written.paths}
    assert {"report.md", "table-mcar2.md", "table-mcar5.md", "tables.csv", "gaps.md", "gaps.csv", "ratios.md",
            "ratios.csv", "paper_comparison.md", "paper_comparison.csv", "figure-mcar2.png", "figure-mcar2.svg",
            "figure-mcar5.png", "figure-mcar5.svg"} <= names
    table = (tmp_path / "out" / "table-mcar2.md").read_text()
    assert "| isolet | Vanilla VFL | 66.0 (1.0)* | 50.0 (0.0) |" in table
    assert "| **82.0 (2.0)** |" in table and "| **71.0 (1.0)** |" in table  # column bests in bold
    assert table.index("Vanilla VFL") < table.index("PlugVFL") < table.index("FALSE-VFL-I")
    gaps = (tmp_path / "out" / "gaps.md").read_text()
    assert "**2 of 4**" in gaps and "mean gap 6.2 points over all, 19.5 over the wins" in gaps
    report = (tmp_path / "out" / "report.md").read_text()
    assert "## Failed fits" in report and "boom" in report
    assert "82.0 vs 86.3 [-4.3]" in report
    assert "0.15 h from the first start to the last finish, on host(s) box" in report
    n_fits = len({r["cell_hash"] for r in ResultStore(tmp_path / "store").rows(status="done")})
    assert written.headline == (
        f"{n_fits} fits; FALSE-VFL beats the other method (chosen on TEST data (no validation rows)) in 2 of 4 "
        "configurations (mean gap 6.2 points); beats the best other method per test column in 2 (mean gap 6.2)")
    assert (tmp_path / "out" / "figure-mcar2.png").read_bytes()[:4] == b"\x89PNG"
    assert b"<svg" in (tmp_path / "out" / "figure-mcar2.svg").read_bytes()[:400]


def test_paper_results_transcription() -> None:
    assert len(PAPER_RESULTS) == 4 * 6 * 6 * 7 and len(PAPER_RATIOS) == 4 * 6 * 7
    cell = paper_accuracy("hapt", "mcar2", "vanilla-vfl", "mcar2")
    assert (cell.mean, cell.std, cell.labeled_only) == (76.3, 0.8, True)
    assert paper_accuracy("modelnet10", "mnar9", "false-vfl-2", "mnar9").mean == 81.5
    assert paper_ratio("isolet", "false-vfl-1", "mcar0") == 96.6
    # FALSE-VFL-I, Isolet: Table 18's ratio is Table 13 over Table 12 (to the printed rounding)
    for test in ("mcar0", "mcar2", "mar1", "mnar9"):
        r = 100 * paper_accuracy("isolet", "mcar5", "false-vfl-1", test).mean / paper_accuracy(
            "isolet", "mcar2", "false-vfl-1", test).mean
        assert math.isclose(r, paper_ratio("isolet", "false-vfl-1", test), abs_tol=0.2)


# ---------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_smoke_grid_end_to_end_in_parallel(tmp_path: Path) -> None:
    store, out = tmp_path / "store", tmp_path / "report"
    summary = run_grid("smoke", store, workers=2, progress=False)
    grid = load_grid("smoke")
    assert summary.ok, summary.text()
    assert len(summary.done) == len(grid.cells())
    with ResultStore(store) as s:
        rows = s.rows()
    assert len(rows) == grid.n_rows
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in rows)
    assert {r["method"] for r in rows} == {m.name for m in grid.methods}
    assert any(r["bytes_communicated"] > 0 for r in rows if r["method"].startswith("false-vfl"))
    write_report(store, out)
    assert (out / "figure-mcar5.png").exists() and "Gap summary" in (out / "report.md").read_text()
    again = run_grid("smoke", store, workers=2, progress=False)
    assert len(again.skipped) == len(grid.cells()) and not again.done


def test_cli_bench_and_report(tmp_path: Path, dummy_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from partialvfl.cli import main

    grid = _grid_file(tmp_path / "g.toml", seeds="[0]")
    assert main(["bench", "--config", str(grid), "--store", str(tmp_path / "s"), "--workers", "1", "--quiet"]) == 0
    assert "2 done, 0 failed, 0 skipped" in capsys.readouterr().out
    assert main(["report", "--store", str(tmp_path / "s"), "--out", str(tmp_path / "r"), "--no-figures"]) == 0
    assert (tmp_path / "r" / "report.md").exists() and not (tmp_path / "r" / "figure-mcar2.png").exists()
    assert main(["bench", "--config", "no-such-grid", "--store", str(tmp_path / "s")]) == 2
    assert "shipped: " in capsys.readouterr().err


@pytest.mark.slow
def test_ray_executor_on_a_local_instance(tmp_path: Path, dummy_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'partialvfl[ray]')")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(dummy_dir), str(REPO_SRC)]))  # the workers' imports
    grid = _grid_file(tmp_path / "g.toml", seeds="[0]")
    # Ray runs its workers at niceness 15 (its `worker_niceness`): beside two CPU-bound processes they got a few
    # percent of a core and this test ran past pytest's 600 s timeout.  Here: normal priority, one CPU (one worker,
    # one torch import, the two fits in turn), no dashboard.  run_on_ray joins this instance and leaves it running.
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, _system_config={"worker_niceness": 0})
    try:
        summary = run_grid(grid, tmp_path / "store", executor="ray", progress=False)
    finally:
        ray.shutdown()
    assert summary.ok and len(summary.done) == 2, summary.text()
    with ResultStore(tmp_path / "store") as s:
        assert s.count("done") == 6


def test_variants_and_the_gap_are_chosen_on_validation_rows_never_on_test() -> None:
    """The variant that wins on test but loses on validation is not shown; the gap compares the validation choices
    and the oracle gap the best other method of each test column."""
    def val(entry: str, label: str, method: str, acc: float, **kw: Any) -> dict[str, Any]:
        return _row(f"val-{entry}", method=method, label=label, test_mechanism="validation", role="validation",
                    accuracy=acc, **kw)

    rows = [  # laser: with SimSiam better on validation (0.70 vs 0.60), worse on test (0.50 vs 0.90)
        val("lp", "LASER", "laser-vfl", 0.70, overrides={"pretrain": True}),
        val("ll", "LASER", "laser-vfl", 0.60, overrides={"pretrain": False}, variant="labelled-only"),
        _row("lp", method="laser-vfl", label="LASER", overrides={"pretrain": True}, accuracy=0.50),
        _row("ll", method="laser-vfl", label="LASER", overrides={"pretrain": False}, variant="labelled-only",
             accuracy=0.90),
        # FALSE-VFL I better on validation, II better on test; plug the best other method on test only
        val("f1", "false-vfl-1", "false-vfl-1", 0.80), val("f2", "false-vfl-2", "false-vfl-2", 0.75),
        _row("f1", method="false-vfl-1", label="false-vfl-1", accuracy=0.60),
        _row("f2", method="false-vfl-2", label="false-vfl-2", accuracy=0.95),
        val("pl", "plug-vfl", "plug-vfl", 0.20), _row("pl", method="plug-vfl", label="plug-vfl", accuracy=0.97),
    ]
    aggs = aggregate(rows)
    laser = next(a for a in aggs if a.label == "LASER")
    assert laser.mean == pytest.approx(50.0) and not laser.starred and laser.selected_on == "validation"
    assert laser.validation == pytest.approx(70.0) and laser.variants == 2
    (c,) = gap_summary(aggs).configs
    assert c["false_vfl"] == "FALSE-VFL-I" and c["best_other"] == "LASER"  # both chosen on validation
    assert c["gap"] == pytest.approx(60.0 - 50.0) and c["selected_on"] == "validation"
    assert c["oracle_other"] == "PlugVFL" and c["oracle_gap"] == pytest.approx(60.0 - 97.0)
    assert {a.test for a in aggs} == {"mcar0"}  # validation rows are never a table column
    assert sum(is_validation(r) for r in rows) == 5


def test_a_gap_chosen_partly_on_test_means_is_not_labeled_validation() -> None:
    """A partly finished store: FALSE-VFL-II has no validation score, so the FALSE-VFL side is chosen on test means
    even though the chosen FALSE-VFL-I has one; the gap must say ``test``."""
    rows = [
        _row("f1", method="false-vfl-1", label="false-vfl-1", accuracy=0.60),
        _row("val-f1", method="false-vfl-1", label="false-vfl-1", test_mechanism="validation", role="validation",
             accuracy=0.8),
        _row("f2", method="false-vfl-2", label="false-vfl-2", accuracy=0.50),  # no validation row yet
        _row("pl", method="plug-vfl", label="plug-vfl", accuracy=0.70),
        _row("val-pl", method="plug-vfl", label="plug-vfl", test_mechanism="validation", role="validation",
             accuracy=0.6),
    ]
    (c,) = gap_summary(aggregate(rows)).configs
    assert c["false_vfl"] == "FALSE-VFL-I" and c["selected_on"] == "test"


@pytest.mark.parametrize("validated", [True, False])
def test_a_tie_between_variants_goes_to_the_one_that_used_the_unlabeled_data(validated: bool) -> None:
    """Equal validation scores (or, without validation rows, equal test means): the variant shown is the one that
    used the unlabelled data (no *), whichever entry the store lists first."""
    rows = []
    for entry, variant in (("ll", "labelled-only"), ("lp", None)):  # the labelled-only entry first
        kw: dict[str, Any] = dict(method="laser-vfl", label="LASER", overrides={"pretrain": variant is None},
                                  variant=variant)
        rows.append(_row(entry, accuracy=0.5, **kw))
        if validated:
            rows.append(_row(f"val-{entry}", test_mechanism="validation", role="validation", accuracy=0.7, **kw))
    (laser,) = aggregate(rows)
    assert laser.variants == 2 and not laser.labeled_only and not laser.starred
    assert laser.selected_on == ("validation" if validated else "test")


def test_validation_cells_fit_on_part_of_the_labels_and_score_the_rest(tmp_path: Path, dummy_dir: Path) -> None:
    grid = _grid_file(tmp_path / "g.toml", seeds="[0, 1]", validation=True)
    summary = run_grid(grid, tmp_path / "store", workers=1, progress=False)
    assert not summary.failed and len(summary.done) == 2 + 4  # 2 selection fits (seed 0), then 2 x 2
    with ResultStore(tmp_path / "store") as s:
        rows = s.rows()
    vals = [r for r in rows if r["role"] == "validation"]
    assert len(vals) == 2 and {r["test_mechanism"] for r in vals} == {"validation"}
    assert {r["seed"] for r in vals} == {0} and all(r["n_test"] == 12 for r in vals)  # 20 % of the 60 labels
    tests = {r["train_mechanism"]: r for r in rows if r["role"] == "test" and r["seed"] == 0}
    for r in vals:  # the selection fit trained on the other 80 % (rows no party observes are never trained on)
        full = tests[r["train_mechanism"]]["data_stats"]["labelled_rows"]
        assert 48 - 12 <= r["data_stats"]["labelled_rows"] <= 48 and r["data_stats"]["labelled_rows"] < full <= 60
    assert all(r["source"] == "digits" for r in rows)


def test_ablation_report_over_k_averages_tests_and_maps_the_winners(tmp_path: Path) -> None:
    """A hand-made K ablation: per-seed averages over test mechanisms, the winners, the pattern statistics."""
    rows = []
    acc = {  # (K, method) -> accuracy per test mechanism (mcar0, mnar7), the same for both seeds but a +-1 offset
        (4, "laser-vfl"): (0.80, 0.60), (4, "false-vfl-1"): (0.70, 0.66),
        (8, "laser-vfl"): (0.70, 0.50), (8, "false-vfl-1"): (0.72, 0.62),
    }
    for (k, method), values in acc.items():
        for seed, offset in ((0, -0.01), (1, 0.01)):
            for test, v in zip(("mcar0", "mnar7"), values):
                rows.append(_row(f"{k}{method}{seed}{test}", cell_hash=f"{k}{method}{seed}", method=method,
                                 label=method, dataset=f"fm K={k}", source="fashion-mnist",
                                 dataset_config={"name": "fashion-mnist", "parties": k, "splitter": "grid:near"},
                                 test_mechanism=test, seed=seed, accuracy=v + offset, params={"batching": "pattern"},
                                 data_stats={"patterns": 3 * k, "labelled_rows": 900, "mean_pattern_batch": 40.0 / k,
                                             "mixed_batches": 15}))
    with ResultStore(tmp_path / "store") as s:
        s.write(rows)
    written = write_report(tmp_path / "store", tmp_path / "out")
    names = {p.name for p in written.paths}
    assert {"ablation-K.md", "ablation-K-mcar2.png"} <= names
    md = (tmp_path / "out" / "ablation-K.md").read_text()
    # laser at K=4: per seed mean of (0.79, 0.59) and (0.81, 0.61) -> 69.0 and 71.0 -> 70.0 (1.4)
    assert "| LASER-VFL | **70.0 (1.4)** | 60.0 (1.4) |" in md
    assert "| FALSE-VFL-I | 68.0 (1.4) | **67.0 (1.4)** |" in md
    assert "| 4 | LASER-VFL +10.0 (FALSE-VFL #2) | FALSE-VFL-I +6.0 (FALSE-VFL #1) |" in md
    assert "| 8 | FALSE-VFL-I +2.0 (FALSE-VFL #1) | FALSE-VFL-I +12.0 (FALSE-VFL #1) |" in md
    assert "| 4 | 12 | 900 | 10.0 | 60.0 |" in md  # patterns, rows, pattern-batch vs mixed batch size


def test_datasets_are_reported_in_natural_order() -> None:
    from partialvfl.bench.naming import dataset_key

    labels = ["fm K=12", "hapt-raw", "fm K=4", "fm alpha=inf", "fm K=8", "fm alpha=0.1", "fm alpha=1", "fm", "info"]
    assert sorted(labels, key=dataset_key) == ["fm", "fm K=4", "fm K=8", "fm K=12", "fm alpha=0.1", "fm alpha=1",
                                               "fm alpha=inf", "hapt-raw", "info"]


def test_a_fit_is_refused_once_the_package_source_changed_under_the_grid(tmp_path: Path, dummy_dir: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A grid worker that has imported the old code must not import edited modules lazily and record the mix."""
    from partialvfl.bench import cell as cell_module
    from partialvfl.bench.store import source_fingerprint

    now = source_fingerprint()
    assert "bench/cell.py" in now and all(k.endswith(".py") for k in now)
    edited = dict(now, **{"nn/stats.py": (0, 0)})  # as if nn/stats.py had another size and time at the start
    monkeypatch.setattr(cell_module, "_SOURCE_AT_START", edited)
    summary = run_grid(_grid_file(tmp_path / "g.toml", seeds="[0]"), tmp_path / "store", workers=1, progress=False)
    assert not summary.done and len(summary.failed) == 2
    assert "SourceChanged: the partialvfl source changed while this grid ran (nn/stats.py)" in summary.failed[0][1]
    monkeypatch.setattr(cell_module, "_SOURCE_AT_START", now)  # unchanged: the rerun fits them
    assert len(run_grid(_grid_file(tmp_path / "g.toml", seeds="[0]"), tmp_path / "store", workers=1,
                        progress=False).done) == 2
