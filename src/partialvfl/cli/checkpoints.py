"""``fit --checkpoint-every N`` / ``--resume`` / ``--party-timeout`` / ``--threads``: the library's fit options of a
command, and what the command says about its checkpoints."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

__all__ = ["fit_options", "report_checkpoints"]


def fit_options(args: argparse.Namespace) -> Any:
    """The :class:`~partialvfl.orchestration.FitOptions` of a ``fit`` command (checkpoints in ``OUT/checkpoints``,
    written every ``--checkpoint-every`` steps and when stopped by a signal), its flags checked first."""
    from partialvfl.federation.runtime.checkpoint import LATEST
    from partialvfl.orchestration import FitOptions

    if args.checkpoint_every < 0:
        raise ValueError("--checkpoint-every must be a positive number of steps")
    ck_dir = Path(args.out) / "checkpoints"
    if not args.resume and (ck_dir / LATEST).exists():
        raise ValueError(f"{ck_dir} holds a checkpoint of an earlier run: pass --resume to continue from it, "
                         "or remove it")
    return FitOptions(checkpoint_dir=ck_dir, checkpoint_every=args.checkpoint_every, resume=args.resume,
                      party_timeout=getattr(args, "party_timeout", None),
                      party_retries=int(getattr(args, "party_retries", 0) or 0),
                      threads=getattr(args, "threads", "auto"))


def report_checkpoints(args: argparse.Namespace, result: Any, verbose: bool) -> None:
    """What a finished fit says about ``--resume`` and ``--checkpoint-every`` (``result``: its ``FitResult``)."""
    from partialvfl.utils.progress import report_line

    if args.resume:
        report_line(f"resumed from the checkpoint after step {result.resumed_step}" if result.resumed_step else
                    "no checkpoint to resume from: trained from the start", verbose)
    if args.checkpoint_every and not result.saved_steps:
        report_line(f"note: {args.method} trained fewer than {args.checkpoint_every} steps: no checkpoint was taken",
                    verbose)
