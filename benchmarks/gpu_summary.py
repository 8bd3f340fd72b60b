"""The headline figures of a ``benchmarks/gpu_check.sh`` run in one table, read from the JSON files it wrote.

    python benchmarks/gpu_summary.py JSON_DIR cuda

Per step (cpu-grid stage 1 as the engine and as a fit run it; the paper configuration's stage 1 and 2) and per code
measured (each older checkout, ``base NAME``; this code with the parties of a round one by one, ``1by1``, and
concurrently, ``conc``, the default on a GPU; ``conc bf16``): wall time, ATen operators, kernels and blocking copies
dispatched, the host's waits for the GPU, and from the profiler the GPU's kernels, kernel time and busy fraction;
then the whole paper epochs measured (fp32 and bf16, with the short fit's accuracy), the paper fit extrapolated from
them, LASER-VFL's epoch against the official code's, and the issue's targets met or not.  A file that is missing (its
step failed or was skipped) leaves its rows out.
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


def codes(out: Path, device: str) -> list[tuple[str, str]]:
    """(label, file) of every ``ops`` run, older code first."""
    found = [(f"base {p.name.removeprefix('ops-baseline-').removesuffix(f'-{device}.json')}", p.name)
             for p in sorted(out.glob(f"ops-baseline-*-{device}.json"))]
    return found + [("1by1", f"ops-seq-{device}.json"), ("conc", f"ops-{device}.json"),
                    ("conc bf16", f"ops-bf16-{device}.json")]


def _verdict(value: float, target: float, smaller: bool = True) -> str:
    if value != value:  # NaN: not measured
        return "not measured"
    return "met" if (value <= target if smaller else value >= target) else "NOT met"


def main(argv: list[str]) -> int:
    out, device = Path(argv[0]), argv[1]
    print(f"=== summary ({device}): per step; GPU figures from the PyTorch profiler (none on a CPU)")
    print(f"{'step':28} {'code':14} {'wall ms':>8} {'ops':>6} {'kernels':>8} {'blocking':>8} {'syncs':>6} "
          f"{'GPU kernels':>11} {'kernel ms':>9} {'busy %':>7}")
    table: dict[tuple[str, str], dict[str, Any]] = {}
    for code, name in codes(out, device):
        ops = _load(out, name).get("ops", {})
        for label, r in rows(ops):
            d = r.get("device", {})
            table[(label, code)] = r
            print(f"{label:28} {code:14} {r['wall_ms_per_step']:8.1f} {r['ops']:6.0f} {r['kernels']:8.0f} "
                  f"{r['blocking_transfers']:8.0f} {d.get('host_waits', {}).get('syncs_per_step', NAN):6.1f} "
                  f"{d.get('kernels_per_step', NAN):11.0f} {d.get('kernel_ms_per_step', NAN):9.1f} "
                  f"{d.get('busy_percent', NAN):7.1f}")
    epochs = {p: _load(out, f"paper-epochs{s}-{device}.json").get("paper-epochs", {})
              for p, s in (("fp32", ""), ("bf16", "-bf16"))}
    for precision, e in epochs.items():
        if e:
            print(f"paper configuration {precision}, whole epochs measured: stage 1 {e['stage1_epoch_seconds']} s, "
                  f"stage 2 {e['stage2_epoch_seconds']} s (the first of each stage apart: {e['first_epoch_seconds']});"
                  f" the paper fit extrapolated from them: {e['paper_fit_minutes_from_epochs']} min; test accuracy "
                  f"{e.get('test_accuracy', '-')} on {e.get('test_images', '-')} images after this short fit")
            print(f"  ({e['note']})")
    laser = _load(out, f"engine-{device}.json").get("laser", {})
    if "ours_over_official" in laser:
        print(f"LASER-VFL epoch, ours / the official code's: {laser['ours_over_official']} (per-sample batching "
              f"{laser.get('ours_per_sample_over_official')})")
    conc = {label: r for (label, code), r in table.items() if code == "conc"}
    paper1 = conc.get("paper stage1", {}).get("device", {}).get("busy_percent", NAN)
    grid = conc.get("cpu-grid stage 1 (fit_step)", {}).get("wall_ms_per_step", NAN)
    fit = epochs["fp32"].get("paper_fit_minutes_from_epochs", NAN)
    s1 = {p: min(e.get("stage1_epoch_seconds") or [NAN]) for p, e in epochs.items()}
    print("=== the issue's targets (this code, parties concurrent)")
    print(f"paper stage-1 GPU busy >= 70 %: {paper1} % ({_verdict(paper1, 70, smaller=False)})")
    print(f"paper fit <= 12 min from whole epochs: {fit} min ({_verdict(fit, 12)})")
    print(f"cpu-grid stage-1 step (as a fit runs it) <= 12 ms: {grid} ms ({_verdict(grid, 12)})")
    ratio = laser.get("ours_over_official", NAN)
    print(f"LASER-VFL epoch <= 0.5 x the official code's: {ratio} ({_verdict(ratio, 0.5)})")
    print(f"bf16 faster than fp32 (stage-1 epoch): {s1['bf16']} s against {s1['fp32']} s "
          f"({_verdict(s1['bf16'], s1['fp32'])})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
