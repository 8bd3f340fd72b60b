"""Layer 5: experiment grids, a resumable results store, parallel runs and paper-layout reports.

* :mod:`.grid`: a grid and its expansion into cells (one fit each); :mod:`.grid_file`: reading and checking grid
  files (TOML, YAML);
* :mod:`.store`: the SQLite results store;
* :mod:`.cell`: one fit of a grid and its evaluation on every test mechanism (what every executor runs);
* :mod:`.runner`: runs a grid, resumable and parallel (:mod:`.ray_executor` for Ray clusters);
* :mod:`.report`: tables in the FALSE-VFL paper's layout, gap summaries, robustness ratios, figures;
* :mod:`.paper_results`: the paper's Tables 12-18, for comparison.

The ``bench`` and ``report`` commands are in :mod:`partialvfl.cli.bench`.
"""

from partialvfl.bench.grid import Grid
from partialvfl.bench.grid_file import load_grid
from partialvfl.bench.store import ResultStore

__all__ = ["Grid", "ResultStore", "load_grid", "run_grid", "write_report"]


def __getattr__(name: str):  # lazy: keep `import partialvfl.bench` light
    if name == "run_grid":
        from partialvfl.bench.runner import run_grid

        return run_grid
    if name == "write_report":
        from partialvfl.bench.report import write_report

        return write_report
    raise AttributeError(name)
