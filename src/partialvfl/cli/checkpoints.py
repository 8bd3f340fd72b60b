"""``fit --checkpoint-every N`` / ``--resume``: the checkpointer of a fit and what the command says about it."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

__all__ = ["checkpointer", "report_checkpoints"]


def checkpointer(args: argparse.Namespace) -> Any:
    """The checkpointer of ``--checkpoint-every N`` / ``--resume`` (in ``OUT/checkpoints``), or ``None``."""
    from partialvfl.federation.checkpoint import LATEST, Checkpointer

    if args.checkpoint_every < 0:
        raise ValueError("--checkpoint-every must be a positive number of steps")
    ck_dir = Path(args.out) / "checkpoints"
    if not args.resume and (ck_dir / LATEST).exists():
        raise ValueError(f"{ck_dir} holds a checkpoint of an earlier run: pass --resume to continue from it, "
                         "or remove it")
    if not (args.checkpoint_every or args.resume):
        return None
    return Checkpointer(ck_dir, every=args.checkpoint_every or 10**12)


def report_checkpoints(args: argparse.Namespace, ck: Any, verbose: bool) -> None:
    from partialvfl.utils.progress import report_line

    if ck is None:
        return
    if args.resume:
        report_line(f"resumed from the checkpoint after step {ck.restored_step}" if ck.restored_step else
                    "no checkpoint to resume from: trained from the start", verbose)
    if args.checkpoint_every and not ck.saved_steps:
        report_line(f"note: {args.method} trained fewer than {args.checkpoint_every} steps: no checkpoint was taken",
                    verbose)
