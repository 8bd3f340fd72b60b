"""The ``partialvfl`` command: datasets, describe, methods, fit, evaluate, bench, report, party servers, certificates.

Run ``partialvfl COMMAND --help`` for each command's options.  This package is the top layer: nothing else in
``partialvfl`` imports it, and it imports the layers below only inside the commands, so ``--help`` stays light (no
torch, no gRPC).

* :mod:`.data_commands`: ``datasets``, ``describe``, ``methods``;
* :mod:`.fit`: ``fit`` (in process or ``--federation``), ``evaluate``, ``predict``;
* :mod:`.bench`: ``bench``, ``report``;
* :mod:`.deploy`: ``party serve``, ``certs init``; :mod:`.serve`: ``serve`` (the prediction service);
* :mod:`.privacy`: ``mechanisms`` (the declared privacy mechanisms), and ``fit``'s privacy options;
* :mod:`.explain`: ``explain``, ``value`` (party contributions and values); :mod:`.calibrate`: ``calibrate``;
* :mod:`.params`: ``--param`` and ``--epochs`` (one parser, one rule); :mod:`.common`: the protocol options;
* :mod:`.vocabulary`: old spellings of renamed options (they warn and work), ``--help`` by task, a closed pipe.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from partialvfl.cli import bench, calibrate, data_commands, deploy, explain, fit, privacy, serve
from partialvfl.cli.vocabulary import GroupedHelpParser, quiet_closed_pipe

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The ``partialvfl`` argument parser with every command."""
    parser = GroupedHelpParser(
        prog="partialvfl",
        description="Vertical federated learning on partially aligned, partially labelled data.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=argparse.ArgumentParser)
    data_commands.add_commands(sub)
    fit.add_commands(sub)
    bench.add_commands(sub)
    deploy.add_commands(sub)
    fit.add_predict_command(sub)
    serve.add_commands(sub)
    privacy.add_commands(sub)
    explain.add_commands(sub)
    calibrate.add_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``partialvfl`` command line on ``argv`` (default: ``sys.argv[1:]``); return the exit status."""
    from partialvfl.utils.threads import configure_openmp

    configure_openmp()  # before any command loads torch: idle OpenMP threads sleep instead of spinning
    try:
        return _run(build_parser(), argv)
    except BrokenPipeError:  # `partialvfl evaluate ... | head -1`: the reader has what it wanted
        return quiet_closed_pipe()


def _run(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> int:
    """Parse ``argv`` and run its command: its status, or 2 with one line for bad input."""
    args = parser.parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]  # what a resume command repeats
    try:
        status = int(args.func(args) or 0)
        sys.stdout.flush()  # a reader that has gone shows here, not in the interpreter's last flush
        return status
    except (ValueError, FileNotFoundError, KeyError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"error: {msg}", file=sys.stderr)
        return 2
