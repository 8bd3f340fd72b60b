"""The headline figures of a ``benchmarks/gpu_check.sh`` run in one table, read from the JSON files it wrote.

    python benchmarks/gpu_summary.py OUT_DIR cuda

Per step (cpu-grid stage 1 as the engine and as a fit run it; the paper configuration's stage 1 and 2), fp32 and
bf16, and ``base`` (fp32, an older checkout's code on the same machine, where the check ran one): wall time, ATen
operators, kernels and blocking copies dispatched, and from the profiler the GPU's kernels, kernel time and busy
fraction; then the whole paper epochs measured, the paper fit extrapolated from them and from single steps, and
LASER-VFL's epoch against the official code's.  A file that is missing (its step failed or was skipped) leaves its
rows out.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

NAN = float("nan")


def _load(out: Path, name: str) -> dict[str, Any]:
    path = out / name
    return json.loads(path.read_text()) if path.exists() else {}


def rows(ops: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(label, figures) of every stepper in an ``ops`` section."""
    out = [(f"cpu-grid stage 1 ({k})", v) for k, v in ops.get("cpu_grid_stage1", {}).items()]
    return out + [(f"paper {k.removeprefix('paper_')}", v) for k, v in ops.items()
                  if k in ("paper_stage1", "paper_stage2")]


def main(argv: list[str]) -> int:
    out, device = Path(argv[0]), argv[1]
    print(f"=== summary ({device}): per step; GPU figures from the PyTorch profiler (none on a CPU)")
    print(f"{'step':30} {'prec':5} {'wall ms':>8} {'ops':>6} {'kernels':>8} {'blocking':>8} {'GPU kernels':>11} "
          f"{'kernel ms':>9} {'busy %':>7}")
    paper_steps: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}
    for name, precision in ((f"ops-baseline-{device}.json", "base"), (f"ops-{device}.json", "fp32"),
                            (f"ops-bf16-{device}.json", "bf16")):
        ops = _load(out, name).get("ops", {})
        for label, r in rows(ops):
            d = r.get("device", {})
            print(f"{label:30} {precision:5} {r['wall_ms_per_step']:8.1f} {r['ops']:6.0f} {r['kernels']:8.0f} "
                  f"{r['blocking_transfers']:8.0f} {d.get('kernels_per_step', NAN):11.0f} "
                  f"{d.get('kernel_ms_per_step', NAN):9.1f} {d.get('busy_percent', NAN):7.1f}")
            if label.startswith("paper") and r.get("steps_per_epoch"):
                paper_steps[f"{label} {precision}"] = (r, ops.get("paper_configuration", {}))
    for label, (r, config) in paper_steps.items():
        shape = (f"{config.get('train_images', '?')} images, batch {config.get('pretrain_batch_size', '?')} / "
                 f"{config.get('batch_size', '?')}")
        print(f"{label}: {r['wall_ms_per_step']:.1f} ms x {r['steps_per_epoch']} steps = "
              f"{r['wall_ms_per_step'] * r['steps_per_epoch'] / 1e3:.1f} s per epoch, extrapolated from single steps "
              f"({shape})")
    epochs = _load(out, f"paper-epochs-{device}.json").get("paper-epochs", {})
    if epochs:
        print(f"paper configuration, whole epochs measured: stage 1 {epochs['stage1_epoch_seconds']} s, stage 2 "
              f"{epochs['stage2_epoch_seconds']} s (the first of each stage apart: {epochs['first_epoch_seconds']});"
              f" the paper fit extrapolated from them: {epochs['paper_fit_minutes_from_epochs']} min")
        print(f"  ({epochs['note']})")
    laser = _load(out, f"engine-{device}.json").get("laser", {})
    if "ours_over_official" in laser:
        print(f"LASER-VFL epoch, ours / the official code's: {laser['ours_over_official']} (per-sample batching "
              f"{laser['ours_per_sample_over_official']}; target <= 0.5)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
