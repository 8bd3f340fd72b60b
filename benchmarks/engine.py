"""The simulation engine's figures, every ratio measured in one run on one machine (issue 14).

Prints, with the hardware, torch threads and load average beside every section:

* ``peak``: the fp32 matmul GFLOP/s of this process (square matmuls and the step's own layer shapes);
* ``fvl-step``: FALSE-VFL-I stage 1 on the cpu-grid configuration (FashionMNIST, 8 parties of 14 x 7 pixels, MLP
  width 128, batch 256, kappa 10, d_h 196, d_z 32): FLOPs per step (``FlopCounterMode``: matmuls only), time per
  step on the code's default path (repeats, min and median; every FALSE-VFL party answers by its own handler, as
  deployed: issue 21 removed the batched path, which was not measurably
  faster: docs/false-vfl.md), achieved GFLOP/s and % of the peak, per epoch;
* ``laser``: LASER-VFL at the official code's hyperparameters (4 parties of 196 pixels, per-party
  Linear(d,128)-ReLU-Linear(128,128)-ReLU-Linear(128,128), mean fusion, K linear heads, SGD lr 0.03 momentum 0.8
  weight decay 1e-4, batch 128): time per epoch batched and per party, FLOPs and GFLOP/s; with
  ``--laser-official PATH`` also the official code's time per epoch, side by side (see below), and ours with
  per-sample batching (batches mixing patterns, about as many per epoch as the official code's);
* ``bytes``: FALSE-VFL bytes per sample-step crossing party boundaries (message log; independent of the load):
  ``samples`` wire (kappa latent samples) vs ``lean`` (posterior mean and scale) vs ``lean`` + bfloat16;
* ``bf16``: the accuracy effect of bfloat16 on the wire: test accuracy of two FALSE-VFL-I fits on digits, float32 and
  bfloat16 on the wire, same seed (the fast preset; with ``--quick`` 5 + 5 epochs, far from converged);
* ``threads``: the stage-1 step with 1 thread, 2 threads with OpenMP spinning (``OMP_WAIT_POLICY=ACTIVE``) and 2
  threads sleeping (``PASSIVE``, the thread policy's), each in a fresh process; with ``--contention N`` also under N
  busy-loop processes;
* ``federated``: digits, false-vfl-1, 4 party processes over gRPC with mutual TLS vs in process, time per epoch
  (``benchmarks/grpc_overhead.py``);
* ``baseline`` (with ``--baseline-src SRC``): before/after, the FALSE-VFL step and the LASER-VFL epoch of an older
  checkout's ``src/`` (its default path) beside this code's, in fresh processes taking turns;
* ``ops`` (issue 36, ``engine_ops.py``): ATen operators dispatched per step (a ``TorchDispatchMode`` count: kernels,
  views, transfers and the blocking ones, readbacks, casts) of the cpu-grid stage-1 step (the engine's stepper and the
  step a fit runs) and of the paper configuration's stage-1 and stage-2 steps, their wall time, and on a GPU the
  profiler's kernels per step, kernel time and busy fraction;
* ``paper-step``, ``paper-epochs`` (``engine_paper.py``, only with ``--only``): the FashionMNIST paper configuration
  (ResNet-18 parties), single steps extrapolated, and a fit of whole epochs (``--paper-epochs 3 5``) timed epoch by
  epoch with the paper fit extrapolated from them.

    python benchmarks/engine.py --quick                      # smoke run, one to two minutes (small configurations)
    python benchmarks/engine.py --json engine.json           # the full run (quiet machine), a few minutes
    python benchmarks/engine.py --only threads --contention 2
    mkdir -p runs/base && git archive 86ddc4e src | tar -x -C runs/base     # the code before issue 14
    python benchmarks/engine.py --only baseline --baseline-src runs/base/src
    python benchmarks/engine.py --only ops                   # operators per step (the CPU proxy of GPU launches)
    PYTHONPATH=../old/src python benchmarks/engine.py --only ops   # the same count for an older checkout
    python benchmarks/engine.py --device cuda --only ops paper-epochs   # on a GPU: + profiler, whole epochs

The official LASER-VFL code (github.com/Valdeira/LASER-VFL) is not part of this repository, and its ``main.py`` only
runs its own tasks (hapt, credit, mimic4, cifar10, cifar100) on its own data files, with W&B and torchvision.  With
``--laser-official PATH`` (a checkout) the laser section times it through ``benchmarks/laser_official.py``, which
imports the checkout's modules at run time and trains its MLP path (its ``MLPLaserModel``, ``train_laser``,
``CustomDataset`` batching and SGD set-up; W&B, torchvision, ``decorator`` and imblearn stubbed when missing, none
of them on the timed path) on the section's training data, written to a temporary .npz::

    git clone https://github.com/Valdeira/LASER-VFL ../LASER-VFL
    python benchmarks/engine.py --only laser --laser-official ../LASER-VFL

"Same data" means the same rows (the labelled ones with at least one observed block) and the same standardised
features, complete, as 4 blocks side by side (196 FashionMNIST pixels each; with ``--quick``, 16 digits features
each), at the hyperparameters above.  It does not mean the same missingness: the official code draws its own with
its ``CustomDataset``, one block pattern per batch of 128 (each block observed with probability 1 - 0.1, drawn once
and reused every epoch; the rows are not reshuffled between epochs), where ours masks every row's blocks (MCAR 0.1)
and cuts batches from rows of one pattern (more, smaller batches).  The official time per epoch is the driver's own
timing of its ``train_laser`` calls (the epochs after the first; no imports, set-up or test pass), one fresh process
per repeat, the same torch thread count, its DataLoader in process (its hapt config has one worker process: a second
core ours does not get), interleaved with our fits (1 vs 1 + ``--laser-epochs`` epochs, the difference).  Its epoch
also pays for what the official loop does besides the step: a DataLoader over single rows (``__getitem__`` and a mask
tensor per row, ``collate_fn``) and per-subset training metrics (a ``.item()`` per head and subset per batch).  The
ratio is ours / theirs per epoch (the issue's target: <= 0.5).  ``--laser-official-cmd CMD`` runs CMD in PATH
instead, for 1 and 1 + epochs epochs (``{epochs}`` in it is replaced), and takes the wall-time difference.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

try:
    from partialvfl.utils.threads import configure_openmp
except ImportError:  # a baseline checkout (--baseline-src) from before the thread policy
    def configure_openmp() -> bool:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        return True

configure_openmp()  # before torch loads (the thread policy's default); the threads section overrides it per run
import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from partialvfl.data.protocol import ProtocolConfig, make_protocol  # noqa: E402
from partialvfl.federation import LocalFederation, MessageLog  # noqa: E402
from partialvfl.methods import get_method  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_ops import ops_section  # noqa: E402
from engine_paper import TRAIN_IMAGES, paper_epochs_section, paper_step_section  # noqa: E402

HERE = Path(__file__).resolve().parent
WIDTH = 128
CPU_GRID = dict(encoder="mlp", decoder="mlp", encoder_hidden=[WIDTH, WIDTH], decoder_hidden=[WIDTH, WIDTH],
                global_hidden=[WIDTH, WIDTH], discriminator_hidden=[WIDTH], mask_hidden=[WIDTH, WIDTH],
                pretrain_lr=3e-3, pretrain_batch_size=256, importance_samples=10, d_h=196, d_z=32)
LASER_OFFICIAL = dict(encoder="mlp", encoder_hidden=[128, 128], latent_dim=128, head_hidden=[], heads="per-party",
                      batching="pattern", optimizer="sgd", lr=0.03, momentum=0.8, weight_decay=1e-4, batch_size=128)


# ---------------------------------------------------------------------- machine and timing helpers
#: where the sections compute (``--device``; the CPU by default)
DEVICE = torch.device("cpu")
#: how methods run besides the device (``--compile``, ``--precision``): only what differs from the default
RUN: dict[str, Any] = {}
#: how the in-process parties answer (``--concurrent``): only what differs from the code's default
FEDERATION: dict[str, Any] = {}


def machine() -> dict[str, Any]:
    """CPU, cores, torch threads, OpenMP wait policy, load (and the GPU with ``--device cuda``): printed with every
    section."""
    model = platform.processor()
    with contextlib.suppress(OSError, StopIteration):
        model = next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                     if ln.startswith("model name"))
    out = {"cpu": model, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
           "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(default)"), "torch": torch.__version__,
           "load_average": [round(v, 2) for v in os.getloadavg()], "device": str(DEVICE)}
    if DEVICE.type == "cuda":
        props = torch.cuda.get_device_properties(DEVICE)
        out.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda,
                   tf32_matmul=torch.backends.cuda.matmul.allow_tf32)
    return out


def sync() -> None:
    """Wait for the device's queued work (a GPU runs asynchronously: timings must include it)."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def timed(fn: Any, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return out


def summary(times: list[float]) -> dict[str, float]:
    return {"min_s": round(min(times), 4), "median_s": round(float(np.median(times)), 4), "n": len(times)}


def matmul_peak(repeats: int, shapes: list[tuple[int, int, int]] | None = None) -> dict[str, float]:
    """Best fp32 GFLOP/s of square matmuls and of the given (M, K, N) shapes, in this process and thread count (on
    ``--device``; a GPU also gets 8192^3, which it needs to approach its peak)."""
    out = {}
    big = [(8192, 8192, 8192)] if DEVICE.type == "cuda" else []
    for m, k, n in [(1024, 1024, 1024), (2048, 2048, 2048), *big, *(shapes or [])]:
        a, b = torch.randn(m, k, device=DEVICE), torch.randn(k, n, device=DEVICE)
        torch.mm(a, b)
        best = min(timed(lambda a=a, b=b: torch.mm(a, b), repeats))
        out[f"{m}x{k}x{n}"] = round(2 * m * k * n / best / 1e9, 1)
    out["peak"] = max(out.values())
    return out


def count_flops(fn: Any) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


# ---------------------------------------------------------------------- FALSE-VFL stage 1
def fvl_data(quick: bool) -> Any:
    if quick:
        return make_protocol(ProtocolConfig("digits", parties=4, n_labels=300, n_aligned=60, train_missing="mcar:0.2",
                                            seed=0))[0]
    return make_protocol(ProtocolConfig("fashion-mnist", parties=8, n_labels=1000, n_aligned=200,
                                        train_missing="mcar:0.2", seed=0, max_train=4000, max_test=100))[0]


def on_device() -> dict[str, Any]:
    """``device=`` (and ``compile``/``precision``) for a method or a federation: only what differs from the default
    (a baseline checkout predates the options)."""
    return ({} if DEVICE.type == "cpu" else {"device": DEVICE}) | RUN


def federation(train: Any, batched: bool | None, log: MessageLog | None = None) -> Any:
    """In-process parties, batched or per party (``None``: the code's default, also in a baseline checkout), their
    rounds concurrent or not as ``--concurrent`` says (where the code has the option)."""
    known = inspect.signature(LocalFederation.for_dataset).parameters
    extra = {k: v for k, v in FEDERATION.items() if k in known}
    for k in sorted(set(FEDERATION) - set(extra)):
        if ("federation", k) not in _DROPPED:
            _DROPPED.add(("federation", k))
            print(f"note: LocalFederation in this code has no option {k!r}; running without it", file=sys.stderr)
    if batched is None:
        return LocalFederation.for_dataset(train, log=log, **on_device(), **extra)
    return LocalFederation.for_dataset(train, log=log, batched=batched, **on_device(), **extra)


_DROPPED: set[tuple[str, str]] = set()


def method(name: str, preset: str, **params: Any) -> Any:
    """``name`` with the parameters its code knows (a baseline checkout has no ``wire``); says once what it drops."""
    cls = get_method(name)
    known = cls.param_space().names
    for k in sorted(set(params) - set(known)):
        if (name, k) not in _DROPPED:
            _DROPPED.add((name, k))
            print(f"note: {name} in this code has no parameter {k!r}; running without it", file=sys.stderr)
    return cls(preset, seed=0, **on_device(), **{k: v for k, v in params.items() if k in known})


def fvl_stepper(train: Any, batched: bool | None, params: dict[str, Any], variant: int = 1, wire: str = "lean",
                log: MessageLog | None = None) -> Any:
    """A function running one stage-1 step on the next of a fixed sequence of batches; returns rows processed."""
    fed = federation(train, batched, log)
    model = method(f"false-vfl-{variant}", "paper", **dict(params, pretrain_epochs=0, epochs=0, wire=wire))
    model.fit(train, federation=fed)
    view, handle = train.coordinator_view(), fed.attach(train, "engine")
    opt = torch.optim.Adam(list(model.global_encoder_.parameters()) + list(model.global_decoder_.parameters()),
                           lr=float(params["pretrain_lr"]))
    rows_all = np.flatnonzero(train.observed.any(1))
    rng = np.random.default_rng(0)
    bs = int(params["pretrain_batch_size"])

    def step() -> int:
        rows = np.sort(rng.choice(rows_all, size=min(bs, len(rows_all)), replace=False))
        fed.transport.new_step()
        model._pretrain_step(view, handle, rows, int(rng.integers(1 << 30)), opt)
        return len(rows)

    step.steps_per_epoch = int(np.ceil(len(rows_all) / bs))  # type: ignore[attr-defined]
    step.transport = fed.transport  # type: ignore[attr-defined]
    return step


def fit_stepper(train: Any, params: dict[str, Any], variant: int = 1) -> Any:
    """A function running the next stage-1 step as a fit runs it (the stage's own optimiser, the next batch's encode
    riding with ``update``), cycling over epoch 0's batches; returns rows processed."""
    fed = federation(train, None)
    model = method(f"false-vfl-{variant}", "paper", **dict(params, pretrain_epochs=0, epochs=0))
    model.fit(train, federation=fed)
    view, handle = train.coordinator_view(), fed.attach(train, "engine")
    with model._computing():
        stage = model._pretrain_stage(view, handle)
    items = list(stage.items(0, stage.rng))
    at = [0]

    def step() -> int:
        item = items[at[0] % len(items)]
        at[0] += 1
        fed.transport.new_step()
        with model._computing():
            stage.step(item, stage.rng)
        return len(item[0])

    step.steps_per_epoch = len(items)  # type: ignore[attr-defined]
    step.transport = fed.transport  # type: ignore[attr-defined]
    return step


MODES = {"batched": True, "per_party": False}
DEFAULT = {"default": None}  # the code's own path (FALSE-VFL: each party alone, in this code and before batching)


def fvl_step_section(train: Any, params: dict[str, Any], repeats: int, peak: float,
                     modes: dict[str, bool | None] = DEFAULT) -> dict[str, Any]:
    steps = {name: fvl_stepper(train, b, params) for name, b in modes.items()}
    for s in steps.values():
        s()  # warm-up: lazy imports, allocator
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):  # interleaved: a drifting load hits both the same
        for name, s in steps.items():
            times[name] += timed(s, 1)
    first = next(iter(steps.values()))
    flops, per_epoch = count_flops(first), first.steps_per_epoch
    out: dict[str, Any] = {"flops_per_step": flops, "gflop_per_epoch": round(flops * per_epoch / 1e9, 1),
                           "steps_per_epoch": per_epoch}
    for name, t in times.items():
        best = min(t)
        out[name] = {**summary(t), "gflops": round(flops / best / 1e9, 1),
                     "percent_of_peak": round(100 * flops / best / 1e9 / peak, 1),
                     "seconds_per_epoch": round(best * per_epoch, 2)}
    return out


# ---------------------------------------------------------------------- LASER-VFL
def laser_config(quick: bool) -> ProtocolConfig:
    if quick:
        return ProtocolConfig("digits", parties=4, n_labels=1000, n_aligned=0, train_missing="mcar:0.1", seed=0)
    return ProtocolConfig("fashion-mnist", parties=4, n_labels=4000, n_aligned=0, train_missing="mcar:0.1", seed=0,
                          max_train=4000, max_test=100, splitter="grid")


def laser_data(quick: bool) -> Any:
    return make_protocol(laser_config(quick))[0]


def laser_section(train: Any, repeats: int, epochs: int, official: dict[str, Any] | None,
                  modes: dict[str, bool | None] = MODES, config: ProtocolConfig | None = None) -> dict[str, Any]:
    """Seconds per epoch.  Ours (and the official code under ``--laser-official-cmd``): each run trains 1 and
    1 + ``epochs`` epochs; the difference cancels start-up and setup.  The official code through
    ``laser_official.py`` (the default): one run of 1 + ``epochs`` epochs, its own timing of the epochs after the
    first.  ``config`` (the protocol of ``train``) is needed for the latter, to write the data it trains on."""

    def ours(batched: bool | None, **more: Any) -> Any:
        def fit(n: int) -> None:
            method("laser-vfl", "fast", **dict(LASER_OFFICIAL, epochs=n, **more)).fit(
                train, federation=federation(train, batched))
        return fit

    def difference(fit: Any) -> Any:
        def per_epoch() -> float:
            short, long = timed(lambda: fit(1), 1)[0], timed(lambda: fit(1 + epochs), 1)[0]
            return max(long - short, 1e-9) / epochs
        return per_epoch

    fits = {name: ours(b) for name, b in modes.items()}
    if official is not None:  # batches mixing patterns, about as many per epoch as the official code's
        fits["per_sample"] = ours(next(iter(modes.values())), batching="per-sample")
    driver = official is not None and not official.get("cmd")
    if official is not None and not driver:
        fits["official"] = lambda n: run_official(official, n)
    official_run: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        samplers = {k: difference(f) for k, f in fits.items()}
        if driver:
            if config is None:
                raise ValueError("timing the official code through laser_official.py needs the protocol config")
            npz = Path(tmp) / "laser.npz"
            official_npz(config, train, npz)

            def driven() -> float:
                official_run.clear()
                official_run.update(run_official_driver(dict(official, data=str(npz)), 1 + epochs))
                return float(official_run["seconds_per_epoch_after_first"])

            samplers["official"] = driven
        for f in fits.values():
            f(1)  # warm-up (the driver's runs time only their epochs, after the first)
        per_epoch: dict[str, list[float]] = {k: [] for k in samplers}
        for _ in range(repeats):  # interleaved
            for k, sample in samplers.items():
                per_epoch[k].append(sample())
    flops, steps = laser_step_flops(train)
    out: dict[str, Any] = {"flops_per_step": flops, "steps_per_epoch": steps}
    for k, t in per_epoch.items():
        out[k] = summary(t)
        if k not in ("official", "per_sample"):  # pattern batching's FLOPs and steps (the others batch otherwise)
            out[k]["gflops"] = round(flops * steps / min(t) / 1e9, 2)
    if official is not None:
        out["official"]["timing"] = (
            "laser_official.py's own timing of its train_laser calls, mean of the epochs after the first, "
            f"1 + {epochs} epochs per run" if driver else
            f"wall time of --laser-official-cmd for 1 + {epochs} epochs minus that for 1 epoch, over {epochs}")
        if driver:
            keep = ("rows", "batches_per_epoch", "mean_blocks_observed_per_batch", "batches_skipped_no_block_observed",
                    "train_acc_all_blocks", "train_acc_mean_over_block_sets", "hyperparameters",
                    "hyperparameters_from", "num_workers", "torch_threads", "stubbed", "epoch_seconds")
            out["official"]["last_run"] = {k: official_run.get(k) for k in keep}
        out["ours_over_official"] = round(min(per_epoch[next(iter(modes))]) / min(per_epoch["official"]), 2)
        out["ours_per_sample_over_official"] = round(min(per_epoch["per_sample"]) / min(per_epoch["official"]), 2)
    out["timing"] = f"ours: wall time of a fit of 1 + {epochs} epochs minus that of a 1-epoch fit, over {epochs}"
    if set(modes) == set(MODES):
        out["per_party_over_batched"] = round(min(per_epoch["per_party"]) / min(per_epoch["batched"]), 2)
    return out


def official_npz(config: ProtocolConfig, train: Any, path: Path) -> None:
    """The laser section's training data in ``laser_official.py``'s layout: our training rows (labelled, at least one
    block observed) with complete features (the same protocol without training missingness: the same rows and
    standardised values; the official code draws its own missingness), the K blocks side by side."""
    from partialvfl.data.mechanisms import MCAR, parse_mechanism

    mech = parse_mechanism(config.train_missing)
    if not isinstance(mech, MCAR):
        raise ValueError(f"the official code draws MCAR missingness per batch; {config.train_missing!r} is not MCAR")
    full = make_protocol(dataclasses.replace(config, train_missing="mcar0"))[0]
    if not np.array_equal(full.ids, train.ids) or any(
            not np.array_equal(f[train.observed[:, j]], b[train.observed[:, j]])
            for j, (f, b) in enumerate(zip(full.blocks, train.blocks))):
        raise RuntimeError("the protocol without training missingness gave other rows or values")
    if len(set(full.feature_dims)) != 1:
        raise ValueError(f"the official MLP needs equal party blocks, got widths {full.feature_dims}")
    rows = np.flatnonzero(train.labeled & train.observed.any(axis=1))  # LASER-VFL's training rows (ours)
    np.savez(path, x_train=np.concatenate(full.blocks, axis=1)[rows].astype(np.float32),
             y_train=np.asarray(full.y)[rows].astype(np.int64), num_clients=full.n_parties,
             p_miss_train=float(mech.p), num_classes=full.task.n_classes)


def laser_step_flops(train: Any) -> tuple[int, int]:
    """Matmul FLOPs of one LASER-VFL training step (counted), and steps per epoch."""
    model = method("laser-vfl", "fast", **dict(LASER_OFFICIAL, epochs=0)).fit(train)
    view, fed = train.coordinator_view(), model.federation_
    handle = fed.attach(train, "engine")
    rows = model._training_rows(view)
    batches = list(model._batches(view, rows, np.random.default_rng(0)))
    biggest = max(batches, key=len)

    def one_step() -> None:
        fed.transport.new_step()
        model._train_step(view, handle, biggest, np.random.default_rng(1))

    return count_flops(one_step), len(batches)


def _official_env() -> dict[str, str]:
    """W&B off, the same thread count."""
    threads = str(torch.get_num_threads())
    return dict(os.environ, WANDB_MODE="disabled", WANDB_DISABLED="true", OMP_NUM_THREADS=threads,
                MKL_NUM_THREADS=threads)


def run_official(spec: dict[str, Any], epochs: int) -> None:
    """``--laser-official-cmd`` (``{epochs}`` in it is replaced), run in the checkout."""
    cmd = shlex.split(spec["cmd"].replace("{epochs}", str(epochs)))
    res = subprocess.run(cmd, cwd=spec["path"], env=_official_env(), capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"the official LASER-VFL command failed ({res.returncode}): {res.stderr[-2000:]}")


def run_official_driver(spec: dict[str, Any], epochs: int) -> dict[str, Any]:
    """``laser_official.py`` on ``spec["data"]`` for ``epochs`` epochs at LASER_OFFICIAL's hyperparameters; its JSON."""
    p = LASER_OFFICIAL
    cmd = [sys.executable, str(HERE / "laser_official.py"), "--checkout", spec["path"], "--data", spec["data"],
           "--epochs", str(epochs), "--threads", str(torch.get_num_threads()), "--lr", str(p["lr"]),
           "--momentum", str(p["momentum"]), "--weight-decay", str(p["weight_decay"]),
           "--batch-size", str(p["batch_size"])] + (["--device", str(DEVICE)] if DEVICE.type != "cpu" else [])
    res = subprocess.run(cmd, env=_official_env(), capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"laser_official.py failed ({res.returncode}): {res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------- bytes on the wire
def bytes_section(train: Any, params: dict[str, Any], steps: int) -> dict[str, Any]:
    """Bytes crossing party boundaries per sample-step of stage 1, stage 2 and prediction, per wire protocol."""
    out: dict[str, Any] = {}
    for wire, dtype in (("samples", "float32"), ("lean", "float32"), ("lean", "bfloat16")):
        log = MessageLog(keep_entries=False)
        step = fvl_stepper(train, True, dict(params, wire_dtype=dtype), wire=wire, log=log)
        log.clear()
        rows = sum(step() for _ in range(steps))
        stage1 = log.total_bytes() / rows
        kinds: dict[str, float] = {}
        for key, n in log.bytes_by_kind().items():  # per round, requests and replies together
            kinds[key.split(":")[0]] = kinds.get(key.split(":")[0], 0) + round(n / rows)
        log.clear()
        fed = LocalFederation.for_dataset(train, log=log)
        model = get_method("false-vfl-1")("paper", seed=0, **dict(params, pretrain_epochs=0, epochs=1, wire=wire,
                                                                   wire_dtype=dtype, predict_importance_samples=20))
        model.fit(train, federation=fed)
        labeled = int((train.labeled & train.observed.any(1)).sum())
        stage2 = log.total_bytes() / labeled
        log.clear()
        sample = train.subset(np.arange(min(500, train.n_samples)))
        model.predict_proba(sample)
        predict = log.total_bytes() / int(sample.observed.any(axis=1).sum())  # rows no party holds send nothing
        out[f"{wire}/{dtype}"] = {"stage1_bytes_per_sample_step": round(stage1), "stage1_by_round": kinds,
                                  "stage2": round(stage2), "predict_L20": round(predict)}
    base = out["samples/float32"]
    for key in ("lean/float32", "lean/bfloat16"):
        out[key]["stage1_reduction"] = round(base["stage1_bytes_per_sample_step"]
                                             / out[key]["stage1_bytes_per_sample_step"], 2)
        out[key]["predict_reduction"] = round(base["predict_L20"] / out[key]["predict_L20"], 2)
        latent = ("decode", "decode_grad")  # the rounds the lean protocol changes
        out[key]["latent_rounds_reduction"] = round(sum(base["stage1_by_round"][k] for k in latent)
                                                    / sum(out[key]["stage1_by_round"][k] for k in latent), 2)
    return out


def bf16_section(quick: bool) -> dict[str, Any]:
    """Test accuracy of FALSE-VFL-I with float32 vs bfloat16 on the wire (same data, seed and everything else)."""
    train, test = make_protocol(ProtocolConfig("digits", parties=4, n_labels=500, n_aligned=100,
                                               train_missing="mcar:0.2", test_missing="mcar:0.5", seed=0))
    epochs = dict(pretrain_epochs=5, epochs=5) if quick else {}
    out: dict[str, Any] = {"epochs": epochs or "the fast preset's"}
    for dtype in ("float32", "bfloat16"):
        model = get_method("false-vfl-1")("fast", seed=0, wire_dtype=dtype, **epochs).fit(train)
        out[dtype] = round(float(model.score(test)), 4)  # labels matched by value (predict returns class labels)
    out["difference_points"] = round(100 * (out["bfloat16"] - out["float32"]), 2)
    return out


# ---------------------------------------------------------------------- threads, in fresh processes
def threads_section(quick: bool, repeats: int, contention: int) -> dict[str, Any]:
    """The stage-1 step with 1 and 2 threads, OpenMP spinning vs sleeping, optionally beside busy loops."""
    runs = {"1 thread": (1, "PASSIVE"), "2 threads, spinning": (2, "ACTIVE"), "2 threads, sleeping": (2, "PASSIVE")}
    out: dict[str, Any] = {}
    for busy in sorted({0, contention}):
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
        try:
            for name, (threads, policy) in runs.items():
                res = _child(["--only", "fvl-step", "--threads", str(threads), "--repeats", str(repeats)]
                             + (["--quick"] if quick else []), {"OMP_WAIT_POLICY": policy})
                out[f"{name}, {busy} busy"] = res["fvl-step"]["default"]
        finally:
            for h in hogs:
                h.kill()
    return out


def _child(args: list[str], env: dict[str, str]) -> dict[str, Any]:
    """This script's figures from a fresh process (OpenMP reads its wait policy when torch loads)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "child.json"
        subprocess.run([sys.executable, __file__, *args, "--json", str(out), "--no-print"],
                       env=dict(os.environ, **env), check=True)
        return json.loads(out.read_text())


def baseline_section(src: str, quick: bool, repeats: int, threads: int) -> dict[str, Any]:
    """Before/after: the FALSE-VFL step and the LASER-VFL epoch of a baseline checkout (its default path) and of
    this code (LASER-VFL batched; FALSE-VFL's default path), in fresh processes alternating ``repeats`` times; the
    fastest of each."""
    here = str(HERE.parent / "src")
    args = ["--only", "fvl-step", "laser", "--repeats", "3", "--threads", str(threads)] + (["--quick"] if quick else [])
    runs: dict[str, list[dict[str, Any]]] = {"baseline": [], "now": []}
    for _ in range(repeats):
        for name, path in (("baseline", src), ("now", here)):
            extra = ["--compat"] if name == "baseline" else []
            runs[name].append(_child(args + extra, {"PYTHONPATH": path}))
    mode = {"baseline": "default", "now": "batched"}
    step = {k: min(r["fvl-step"]["default"]["min_s"] for r in v) for k, v in runs.items()}
    epoch = {k: min(r["laser"][mode[k]]["min_s"] for r in v) for k, v in runs.items()}
    return {"baseline_src": src, "fvl_step_seconds": step, "fvl_step_speedup": round(step["baseline"] / step["now"], 2),
            "laser_epoch_seconds": epoch, "laser_epoch_speedup": round(epoch["baseline"] / epoch["now"], 2)}


def _modes(compat: bool) -> dict[str, bool | None]:
    return {"default": None} if compat else MODES


def federated_section(quick: bool, repeats: int) -> dict[str, Any]:
    sys.path.insert(0, str(HERE))
    from grpc_overhead import run  # the gRPC benchmark, reused

    ns = argparse.Namespace(method="false-vfl-1", preset="fast", parties=4, epochs=1 if quick else 2, labels=500,
                            aligned=100, train_missing="mcar2", seed=0, repeats=repeats, extra_epochs=1 if quick else 2)
    res = run(ns)
    keep = ("fit_seconds_per_epoch_in_process", "fit_seconds_per_epoch_federated", "fit_ratio", "fit_ratio_median",
            "extra_epoch_seconds_in_process", "extra_epoch_seconds_federated", "extra_epoch_ratio",
            "fit_crossing_bytes_per_sample_step", "predict_ratio", "max_abs_prediction_difference")
    return {k: res[k] for k in keep}


# ---------------------------------------------------------------------- main
SECTIONS = ("peak", "fvl-step", "laser", "bytes", "bf16", "threads", "federated", "baseline", "ops", "paper-step",
            "paper-epochs")
#: sections run only when asked for (--only)
ON_REQUEST = ("baseline", "paper-step", "paper-epochs")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small configurations, few repeats: a smoke run")
    ap.add_argument("--only", nargs="+", choices=SECTIONS, help="run only these sections")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--device", default="cpu",
                    help="where peak, fvl-step, laser and paper-step compute: cpu (default), cuda, cuda:N")
    ap.add_argument("--compile", action="store_true", help="fvl-step, laser, paper-step: methods with --compile")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16"),
                    help="fvl-step, laser, paper-step: methods at this precision")
    ap.add_argument("--concurrent", default="auto", choices=("auto", "on", "off"),
                    help="in-process parties answer each round at the same time (a thread and a CUDA stream each): "
                         "auto (the code's default: on CUDA devices), on, off")
    ap.add_argument("--paper-test", type=int, default=0, metavar="N",
                    help="paper-epochs: after the timed fit, its test accuracy on N test images (0: none)")
    ap.add_argument("--paper-steps", type=int, default=3,
                    help="paper-step: timed steps per stage (after one warm-up step)")
    ap.add_argument("--paper-batch", type=int, default=None,
                    help="paper-step, paper-epochs, ops: both stages' batch size instead of the paper's (a dry run of "
                         "the code path; ops on a CPU: 32 unless given)")
    ap.add_argument("--paper-train", type=int, default=None, metavar="N",
                    help="paper-step, paper-epochs, ops: N training images instead of 60,000 (quick: 4,000; a dry run)")
    ap.add_argument("--paper-epochs", type=int, nargs=2, default=(3, 5), metavar=("E1", "E2"),
                    help="paper-epochs: whole stage-1 and stage-2 epochs of the timed fit (default 3 and 5)")
    ap.add_argument("--ops-steps", type=int, default=None,
                    help="ops: timed (and on a GPU profiled) steps per stepper (default 5, quick 2)")
    ap.add_argument("--repeats", type=int, default=None, help="interleaved timing repeats (default 10, quick 2)")
    ap.add_argument("--contention", type=int, default=0, help="threads section: also beside N busy loops")
    ap.add_argument("--laser-official", metavar="PATH", help="a checkout of Valdeira/LASER-VFL to time beside ours")
    ap.add_argument("--laser-official-cmd", metavar="CMD",
                    help="instead of benchmarks/laser_official.py: a command (run in PATH) training the official MLP "
                         "path for {epochs} epochs on the same data; timed by wall-time difference")
    ap.add_argument("--laser-epochs", type=int, default=2, help="LASER-VFL epochs timed per run")
    ap.add_argument("--baseline-src", metavar="SRC",
                    help="the src/ directory of an older checkout: time its FALSE-VFL step and LASER-VFL epoch "
                         "beside this code's (section baseline)")
    ap.add_argument("--json", help="write every figure to this file")
    ap.add_argument("--no-print", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--compat", action="store_true", help=argparse.SUPPRESS)  # running a baseline checkout
    a = ap.parse_args(argv)
    global DEVICE
    if a.device != "cpu":  # a baseline checkout (--compat) predates partialvfl.utils.devices
        from partialvfl.utils.devices import resolve_device

        DEVICE = resolve_device(a.device, what="--device")
    torch.set_num_threads(a.threads)
    repeats = a.repeats or (2 if a.quick else 10)
    wanted = a.only or [s for s in SECTIONS if (s != "threads" or not a.quick)
                        and (s not in ON_REQUEST or (s == "baseline" and a.baseline_src))]
    TRAIN_IMAGES["max_train"] = a.paper_train
    if a.compile:
        RUN["compile"] = True
    if a.precision != "fp32":
        RUN["precision"] = a.precision
    if a.concurrent != "auto":
        FEDERATION["concurrent"] = a.concurrent == "on"
    if a.laser_official_cmd and not a.laser_official:
        ap.error("--laser-official-cmd needs --laser-official PATH (the directory it runs in)")
    if a.laser_official and not a.laser_official_cmd and not Path(a.laser_official, "methods", "laser.py").is_file():
        ap.error(f"--laser-official {a.laser_official}: not a checkout of Valdeira/LASER-VFL (no methods/laser.py); "
                 f"git clone https://github.com/Valdeira/LASER-VFL {a.laser_official}")
    official = {"path": a.laser_official, "cmd": a.laser_official_cmd} if a.laser_official else None
    res: dict[str, Any] = {"machine": machine(), "quick": a.quick, "repeats": repeats,
                           "concurrent": a.concurrent, "precision": a.precision}
    peak = matmul_peak(repeats, [(2560, 196, 128), (2560, 128, 98)])
    if "peak" in wanted:
        res["peak"] = peak
    runners = {
        "fvl-step": lambda: fvl_step_section(fvl_data(a.quick), _fvl_params(a.quick), repeats, peak["peak"]),
        "laser": lambda: laser_section(laser_data(a.quick), repeats, 1 if a.quick else a.laser_epochs, official,
                                       _modes(a.compat), laser_config(a.quick)),
        "bytes": lambda: bytes_section(fvl_data(a.quick), _fvl_params(a.quick), 3),
        "bf16": lambda: bf16_section(a.quick),
        "threads": lambda: threads_section(a.quick, repeats, a.contention),
        "federated": lambda: federated_section(a.quick, max(1, repeats // 3)),
        "baseline": lambda: baseline_section(a.baseline_src, a.quick, max(1, repeats // 3), a.threads),
        "paper-step": lambda: paper_step_section(a.paper_steps, a.quick, method, federation, timed,
                                                         a.paper_batch),
        "paper-epochs": lambda: paper_epochs_section(a.paper_epochs, a.quick, method, sync, a.paper_batch,
                                                     federation=federation, test_images=a.paper_test),
        "ops": lambda: ops_section(sys.modules[__name__], a.quick, a.ops_steps or (2 if a.quick else 5),
                                   a.paper_batch),
    }
    for name in wanted:
        if name in runners:
            load = os.getloadavg()[0]
            res[name] = {**runners[name](), "load_average_before_after": [round(load, 2),
                                                                          round(os.getloadavg()[0], 2)]}
            if not a.no_print:
                where = res["machine"].get("gpu", res["machine"]["cpu"])
                print(f"== {name} ({where}, {torch.get_num_threads()} thread(s), {DEVICE})")
                print(json.dumps(res[name], indent=2))
    if not a.no_print:
        print("== machine", json.dumps(res["machine"]), "\n== peak", json.dumps(peak))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))
    return 0


def _fvl_params(quick: bool) -> dict[str, Any]:
    if quick:  # digits: 4 parties of 16 features, smaller latents
        return dict(CPU_GRID, d_h=32, d_z=8, pretrain_batch_size=128)
    return dict(CPU_GRID)


if __name__ == "__main__":
    sys.exit(main())
