"""The ablation report over the number of labels: a store whose grid has not reached every cell yet."""

from __future__ import annotations

from pathlib import Path

from partialvfl.bench.report import write_report
from partialvfl.bench.store import ResultStore


def _labels_rows() -> list[dict]:
    """50 and 100 labels, one seed, two test mechanisms; FALSE-VFL-I has not run at 100 labels. The LASER-VFL run
    with FALSE-VFL's encoders as initialisation is a LASER-VFL entry (method ``laser-vfl``), whatever its label says."""
    acc = {  # (labels, method, label) -> accuracy under (mcar0, mnar9)
        (50, "laser-vfl", "LASER-VFL"): (0.60, 0.50), (50, "laser-vfl", "LASER-VFL + FALSE-VFL init"): (0.62, 0.48),
        (50, "false-vfl-1", "FALSE-VFL-I"): (0.61, 0.53),
        (100, "laser-vfl", "LASER-VFL"): (0.70, 0.56), (100, "laser-vfl", "LASER-VFL + FALSE-VFL init"): (0.66, 0.58),
    }
    rows = []
    for (n, method, label), values in acc.items():
        for test, v in zip(("mcar0", "mnar9"), values):
            key = f"{n}{label}{test}"
            rows.append(dict(config_hash=key, cell_hash=f"{n}{label}", method=method, label=label,
                             dataset=f"fm {n} labels", source="fashion-mnist",
                             dataset_config={"name": "fashion-mnist", "parties": 8, "labels": n},
                             train_mechanism="mcar2", test_mechanism=test, seed=0, status="done",
                             metric="accuracy", accuracy=v, started_at="2026-01-01T00:00:00+00:00",
                             finished_at="2026-01-01T00:09:00+00:00", hostname="box"))
    return rows


def test_labels_ablation_names_cells_without_false_vfl_and_keeps_laser_variants_apart(tmp_path: Path) -> None:
    with ResultStore(tmp_path / "store") as s:
        s.write(_labels_rows())
    written = write_report(tmp_path / "store", tmp_path / "out")
    assert {"ablation-labels.md", "ablation-labels-mcar2.png"} <= {p.name for p in written.paths}
    md = (tmp_path / "out" / "ablation-labels.md").read_text()
    assert "Ablation over labels (50, 100)" in md
    assert "| LASER-VFL | 55.0 | **63.0** |" in md
    assert "| LASER-VFL + FALSE-VFL init | 55.0 | 62.0 |" in md
    assert "| FALSE-VFL-I | **57.0** |  |" in md
    # the init variant counts as another method, not as FALSE-VFL: 57.0 - 55.0 at 50 labels, nothing at 100
    assert "| *FALSE-VFL minus the best other* | +2.0 |  |" in md
    assert "| 50 | LASER-VFL + FALSE-VFL init +1.0 (FALSE-VFL #2) | FALSE-VFL-I +3.0 (FALSE-VFL #1) |" in md
    assert "| 100 | LASER-VFL +4.0 (no FALSE-VFL) | LASER-VFL + FALSE-VFL init +2.0 (no FALSE-VFL) |" in md
    assert "#None" not in md
