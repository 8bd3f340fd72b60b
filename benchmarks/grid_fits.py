"""CPU-seconds of the cpu grid's fits, old code against new and eager against ``--compile``, in one run (issue 27).

Each fit is one cell of the shipped ``cpu`` grid (FashionMNIST, 8 parties, 4,000 training / 2,000 test images,
MCAR 2 training, seed 0; the grid's own preset and overrides for the entry), run in a fresh process that measures
the CPU time of the fit alone (``time.process_time``: every thread of the process, so a shared machine's load
does not inflate it as it does wall time) and the test accuracy under MCAR 0 and MCAR 5 (the results must agree
within noise).  Variants, interleaved so that a drifting load hits them alike:

* ``base``: an older checkout's ``src/`` (``--baseline-src``), eager;
* ``now``: this code, eager;
* ``compiled-cold``: this code with ``--compile`` and an empty inductor cache (the first fit of a grid pays this);
* ``compiled-warm``: the same again, the cache filled by the cold run (every later fit of the grid);
* ``bf16`` (with ``--bf16``): this code, eager, ``precision="bf16"`` (autocast): its effect on the accuracy.

    mkdir -p ../base && git archive main src | tar -x -C ../base          # the code before this change
    python benchmarks/grid_fits.py --entries false-vfl-1 laser-vfl --baseline-src ../base/src --json fits.json

Prints per entry and variant the CPU-seconds, the wall seconds and the accuracies, and the ratios to ``base``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def child(entry: str, compile_: bool, threads: int, device: str, precision: str = "fp32",
          sets: dict[str, Any] | None = None) -> dict[str, Any]:
    """One fit of the cpu grid's first ``entry`` (a method name or label), in this process; ``sets`` replace some
    of the entry's overrides (``--set``: a shortened fit)."""
    import torch

    torch.set_num_threads(threads)
    from partialvfl.bench.grid_file import load_grid
    from partialvfl.data.protocol import ProtocolConfig, make_protocol, with_test_mechanism
    from partialvfl.methods import evaluate, get_method

    grid = load_grid("cpu")
    cell = next(c for c in grid.cells() if c.dataset.name == "fashion-mnist" and c.train_mechanism == "mcar2"
                and c.seed == 0 and c.role == "test" and entry in (c.method.name, c.method.display))
    config = ProtocolConfig(**cell.dataset.protocol_kwargs(), train_missing=cell.train_mechanism,
                            test_missing="mcar0", seed=cell.seed)
    train, test0 = make_protocol(config)
    run = {"compile": True} if compile_ else {}
    if device != "cpu":
        run["device"] = device
    if precision != "fp32":
        run["precision"] = precision
    overrides = {**cell.overrides, **(sets or {})}
    model = get_method(cell.method.name)(cell.method.preset, seed=cell.seed, **run, **overrides)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    model.fit(train)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    acc = {"mcar0": evaluate(model, test0)["accuracy"],
           "mcar5": evaluate(model, with_test_mechanism(config, "mcar5"))["accuracy"]}
    out = {"entry": entry, "method": cell.method.name, "overrides": overrides, "cpu_seconds": round(cpu, 2),
           "wall_seconds": round(wall, 2), "accuracy": {k: round(v, 4) for k, v in acc.items()},
           "threads": threads, "load_average": [round(v, 2) for v in os.getloadavg()]}
    if compile_:
        from partialvfl.nn.compiled import compile_failures

        out["compile_failures"] = compile_failures()
    return out


def run_child(entry: str, *, src: str, compile_: bool, cache: str | None, threads: int, device: str,
              precision: str = "fp32", sets: list[str] | None = None) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=src, OMP_NUM_THREADS=str(threads))
    if cache is not None:
        env["TORCHINDUCTOR_CACHE_DIR"] = cache
    cmd = [sys.executable, __file__, "--child", entry, "--threads", str(threads), "--device", device,
           "--precision", precision, *(x for kv in sets or [] for x in ("--set", kv))]
    res = subprocess.run(cmd + (["--compile"] if compile_ else []), env=env, capture_output=True, text=True,
                         check=False)
    if res.returncode != 0:
        raise RuntimeError(f"the fit of {entry} failed ({src}): {res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--entries", nargs="+", default=["false-vfl-1", "laser-vfl"],
                    help="cpu-grid entries (method names or labels; the first matching entry)")
    ap.add_argument("--baseline-src", help="an older checkout's src/ (variant base)")
    ap.add_argument("--no-compile", action="store_true", help="leave out the compiled variants")
    ap.add_argument("--bf16", action="store_true", help="add the bf16 variant (this code, eager, autocast)")
    ap.add_argument("--precision", default="fp32", help=argparse.SUPPRESS)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="replace one of the entry's overrides (a JSON value), e.g. --set epochs=10: a shortened fit")
    ap.add_argument("--json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        sets = {k: json.loads(v) for k, v in (kv.split("=", 1) for kv in a.set)}
        print(json.dumps(child(a.child, a.compile, a.threads, a.device, a.precision, sets)))
        return 0
    here = str(HERE.parent / "src")
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for _ in range(a.repeats):
        for entry in a.entries:
            runs = results.setdefault(entry, {})
            if a.baseline_src:
                runs.setdefault("base", []).append(run_child(entry, src=a.baseline_src, compile_=False, cache=None,
                                                             threads=a.threads, device="cpu", sets=a.set))
            runs.setdefault("now", []).append(run_child(entry, src=here, compile_=False, cache=None,
                                                        threads=a.threads, device=a.device, sets=a.set))
            if not a.no_compile:
                with tempfile.TemporaryDirectory() as cache:
                    for variant in ("compiled-cold", "compiled-warm"):
                        runs.setdefault(variant, []).append(run_child(entry, src=here, compile_=True, cache=cache,
                                                                      threads=a.threads, device=a.device, sets=a.set))
            if a.bf16:
                runs.setdefault("bf16", []).append(run_child(entry, src=here, compile_=False, cache=None,
                                                             threads=a.threads, device=a.device, precision="bf16",
                                                             sets=a.set))
            print(json.dumps({entry: {k: v[-1] for k, v in runs.items()}}), flush=True)
    summary: dict[str, Any] = {}
    for entry, runs in results.items():
        best = {k: min(r["cpu_seconds"] for r in v) for k, v in runs.items()}
        ref = best.get("base", best["now"])
        summary[entry] = {"cpu_seconds_min": best, "over_base": {k: round(v / ref, 3) for k, v in best.items()},
                          "accuracy": {k: v[-1]["accuracy"] for k, v in runs.items()}}
    print(json.dumps(summary, indent=2))
    if a.json:
        Path(a.json).write_text(json.dumps({"runs": results, "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
