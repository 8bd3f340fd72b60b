"""Run a grid's cells on a Ray cluster (optional: ``pip install 'partialvfl[ray]'``).

Each cell is one Ray task (``num_cpus=threads``, torch threads set to match; with ``--device cuda`` also
``num_gpus = 1 / fits-per-gpu``, a fractional GPU: :func:`~partialvfl.bench.gpus.ray_resources`) running the same
:func:`~partialvfl.bench.cell.run_cell` as the local executors; results come back to this process, which alone
writes the store.  ``address`` is the cluster to join (``ray://host:10001`` or ``host:6379``); ``None`` starts or
joins a local instance.  Every node needs partialvfl, the grid's ``imports`` and the datasets (``data_dir``) at the
same paths.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from partialvfl.bench.cell import CellResult, run_cell
from partialvfl.bench.grid import Cell, Grid

__all__ = ["run_on_ray"]


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise RuntimeError(
            "the Ray executor needs ray: pip install 'partialvfl[ray]' (or pip install ray), "
            "or use --executor local"
        ) from None
    return ray


def _remote_cell(cell: Cell, grid_name: str, version: str, imports: Sequence[str], threads: int,
                 run: dict[str, Any] | None = None) -> Any:
    import torch

    torch.set_num_threads(threads)
    return run_cell(cell, grid_name, version, imports, run=run)


def run_on_ray(
    cells: Sequence[Cell],
    grid: Grid,
    version: str,
    *,
    address: str | None = None,
    threads: int = 1,
    status: Callable[[str, str], None] | None = None,  # Ray tasks report no epochs back
    shutdown: bool | None = None,
    run: dict[str, Any] | None = None,
    resources: dict[str, float] | None = None,
) -> Iterator[Any]:
    """Submit every cell as a Ray task and yield each :class:`~partialvfl.bench.cell.CellResult` as it lands.

    ``resources``: what each task asks for (:func:`~partialvfl.bench.gpus.ray_resources`; default ``threads``
    CPUs); a task given a GPU runs its fit on ``cuda`` (the GPU Ray picked), else on the CPU.
    """
    ray = _ray()
    started_here = not ray.is_initialized()
    if started_here:
        if address:  # join a cluster (Ray client addresses accept few options: pass none)
            ray.init(address=address)
        else:  # a local instance on this machine
            ray.init(include_dashboard=False, log_to_driver=False)
    asks = dict(resources or {"num_cpus": float(threads)})
    run = {**(run or {}), "device": "cuda" if asks.get("num_gpus") else "cpu"}
    remote = ray.remote(max_retries=0, **asks)(_remote_cell)
    try:
        refs = {remote.remote(c, grid.name, version, tuple(grid.imports), threads, run): c for c in cells}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=1.0)
            for ref in ready:
                cell = refs[ref]
                try:
                    yield ray.get(ref)
                except Exception as e:  # a lost task is a failed cell
                    yield CellResult(cell.key, cell.describe(), [], f"ray task failed: {e}")
            if not ready:
                time.sleep(0.05)
    finally:
        if shutdown if shutdown is not None else started_here:
            ray.shutdown()
