"""Experiments: ``bench`` (run a grid into a results store) and ``report`` (tables and figures from a store)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from partialvfl.cli.common import add_device_options

__all__ = ["add_commands"]


def _bench(args: argparse.Namespace) -> int:
    from partialvfl.bench.grid import GridError
    from partialvfl.bench.runner import run_grid

    try:
        summary = run_grid(
            args.config, args.store, workers=args.workers, executor=args.executor, address=args.address,
            force=args.force, progress=not args.quiet, threads=args.threads, device=args.device,
            fits_per_gpu=args.fits_per_gpu, precision=args.precision, compile=args.compile,
        )
    except GridError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(summary.text())
    if summary.interrupted:
        return 130
    return 0 if summary.ok else 1


def _report(args: argparse.Namespace) -> int:
    from partialvfl.bench.report import write_report

    try:
        written = write_report(args.store, args.out, figures=not args.no_figures)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path in written.paths:
        print(path)
    print(written.headline)
    return 0


def add_commands(subparsers: Any) -> None:
    """Add ``bench`` and ``report`` to the ``partialvfl`` sub-parsers."""
    p = subparsers.add_parser(
        "bench", help="run an experiment grid into a results store (resumable, parallel)",
        description="Run a grid (datasets x methods x training mechanisms x seeds, each fit evaluated on every "
                    "test mechanism). Finished fits in the store are skipped; rerun to resume.",
    )
    p.add_argument("--config", required=True,
                   help="grid file (TOML, or YAML with PyYAML) or the name of a shipped grid: smoke, cpu, paper")
    p.add_argument("--store", required=True, help="results directory (holds results.sqlite)")
    p.add_argument("--workers", type=int, default=None,
                   help="parallel fits (default: the number of cores, or with --device cuda --fits-per-gpu x GPUs; "
                        "1 runs in this process)")
    p.add_argument("--executor", choices=("local", "ray"), default="local",
                   help="local process pool (default) or a Ray cluster")
    p.add_argument("--address", default=None, help="Ray cluster address (with --executor ray)")
    p.add_argument("--force", action="store_true", help="recompute fits that are already done")
    p.add_argument("--threads", default="auto", metavar="N|auto",
                   help="torch threads per fit: a number, or auto (default): each worker gets cores // workers "
                        "threads at most, and a fit uses one thread when its estimated work per step is small "
                        "(under 2 GFLOP); OpenMP's idle threads sleep instead of spinning")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    add_device_options(p)
    p.add_argument("--fits-per-gpu", type=int, default=None, metavar="N",
                   help="with --device cuda: N fits side by side on each GPU (N x GPUs workers unless --workers; "
                        "with --executor ray, tasks asking for 1/N GPU each)")
    p.set_defaults(func=_bench)

    r = subparsers.add_parser(
        "report", help="tables, gap summaries, robustness ratios and figures from a results store",
        description="Write the FALSE-VFL paper-layout tables (Markdown and CSV), gap summary, robustness ratios, "
                    "comparison with the paper's numbers and Figure 2-style plots; print the files written and a "
                    "headline (fits, FALSE-VFL wins, mean gap).",
    )
    r.add_argument("--store", required=True, help="results directory (holds results.sqlite)")
    r.add_argument("--out", required=True, help="directory to write the report to")
    r.add_argument("--no-figures", action="store_true", help="skip the plots (no matplotlib needed)")
    r.set_defaults(func=_report)
