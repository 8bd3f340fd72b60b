"""Train the official LASER-VFL code's MLP path (github.com/Valdeira/LASER-VFL) on our data and time its epochs.

The official ``main.py`` only runs its own tasks (hapt, credit, mimic4, cifar10, cifar100) on its own data files and
imports W&B and torchvision, so it cannot train on our data as it stands.  This driver imports the official modules
from a checkout at run time (nothing of them is copied here) and runs the pieces ``main.py`` runs for
``--task_name hapt --method laser``, on an ``.npz`` of ours instead of the HAPT files:

* the model: ``models.get_model("laser", "mlp", ...)``, i.e. its ``MLPLaserModel`` (per party
  Linear(d, 128)-ReLU-Linear(128, 128)-ReLU-Linear(128, 128), K mean-fusion linear heads).  Its sizes come from
  ``task_to_hyperparameters(dataset)``, which knows only the official tasks: the driver wraps that function (in
  ``models.mlp``) so that a task named ``npz`` gets our block width and class count and HAPT's cut and hidden
  widths (128, 128); every other task is passed through;
* the data: ``data.data_utils.create_data_loader``, i.e. its ``CustomDataset`` (one block-missingness pattern per
  batch, each block observed with probability ``1 - p_miss_train``, drawn once when the dataset is built and reused
  every epoch; a batch with no observed block is skipped) and ``collate_fn``; no shuffling per epoch (the rows are
  shuffled once at load, as its ``HAPTDataset`` does);
* the optimiser and loss: ``optimizers.get_optimizer("laser", "sgd", ...)`` and ``criterions.get_criterion``, at
  the ``laser / hapt / 4 clients / p_miss_train 0.1`` entry of its ``configs/task_config.yaml`` (SGD lr 0.03,
  momentum 0.8, weight decay 1e-4, batch 128; flags override it);
* the epoch: ``methods.laser.train_laser`` itself, once per epoch.  Only these calls are timed: imports, data
  loading, model and optimiser construction are not, and neither is the test pass ``main.py`` runs after every
  epoch (it is not run at all).  ``train_laser`` is called without its ``time_decorator`` (which only prints the
  wall time), and the progress lines it prints go to stderr.

The ``.npz`` holds ``x_train`` (float32, n x K*d, the K party blocks side by side, complete: the official code
draws its own missingness), ``y_train`` (int64 class indices), ``num_clients`` (K), ``p_miss_train`` and optionally
``num_classes``.  The official DataLoader runs in process (``--num-workers 0``) unless told otherwise: its HAPT
config uses one worker process, which would give it a second core that our code does not get.

    python benchmarks/laser_official.py --checkout ../LASER-VFL --data laser.npz --epochs 3 --threads 1

Prints one JSON line: the seconds of each ``train_laser`` call, their sum, the epochs, the hyperparameters, and the
training accuracy the official loop reports for its last epoch.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import sys
import time
import types
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch

#: The task name the wrapped ``task_to_hyperparameters`` answers for (sizes from the .npz).
TASK = "npz"
#: HAPT's LASER-VFL entry of the official config (the flags' defaults when PyYAML is missing).
HAPT = dict(batch_size=128, optimizer="sgd", lr=0.03, momentum=0.8, weight_decay=1e-4, criterion="cross_entropy")
#: Files the driver uses from a checkout.
NEEDED = ("utils.py", "methods/laser.py", "models/mlp.py", "models/model_utils.py", "data/custom_dataset.py",
          "data/data_utils.py", "optimizers/__init__.py", "criterions/__init__.py")


def fail(message: str) -> NoReturn:
    print(f"laser_official.py: error: {message}", file=sys.stderr)
    raise SystemExit(2)


# ---------------------------------------------------------------------- stubs for packages the driver never uses
def _importable(name: str) -> bool:
    """Whether ``name`` imports here (a failed import leaves nothing behind in ``sys.modules``)."""
    try:
        importlib.import_module(name)
        return True
    except Exception:  # any failure (e.g. a torchvision built for another torch) means "not usable"
        for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
            del sys.modules[key]
        return False


def _unavailable(what: str) -> Any:
    def use(*args: Any, **kwargs: Any) -> NoReturn:
        raise RuntimeError(f"{what} is a stub of laser_official.py (the package is not installed here)")
    return use


def _module(name: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs, __laser_official_stub__=True)
    sys.modules[name] = mod
    if "." in name:
        parent, _, child = name.rpartition(".")
        setattr(sys.modules[parent], child, mod)
    return mod


def _stub_decorator() -> None:
    # ``decorator.decorator(caller)`` turns caller(func, *args, **kwargs) into a decorator; only utils.time_decorator
    # uses it, and the driver calls train_laser undecorated (``__wrapped__``), so this never runs in a timed epoch.
    def decorator(caller: Any) -> Any:
        def decorate(func: Any) -> Any:
            @functools.wraps(func)  # sets __wrapped__, as the real package does
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                return caller(func, *args, **kwargs)
            return wrapper
        return decorate
    _module("decorator", decorator=decorator)


def _stub_torchvision() -> None:
    # models/__init__.py imports the ResNet-18 models (torchvision.models, .resnet.BasicBlock) and data/data_utils.py
    # the CIFAR datasets and transforms; the MLP path and create_data_loader use none of them.
    _module("torchvision")
    _module("torchvision.models", resnet18=_unavailable("torchvision.models.resnet18"))
    _module("torchvision.models.resnet", BasicBlock=_unavailable("torchvision.models.resnet.BasicBlock"))
    _module("torchvision.datasets", CIFAR10=_unavailable("torchvision.datasets.CIFAR10"),
            CIFAR100=_unavailable("torchvision.datasets.CIFAR100"))
    _module("torchvision.transforms", **{n: _unavailable(f"torchvision.transforms.{n}") for n in
                                         ("Compose", "Normalize", "RandomCrop", "RandomHorizontalFlip", "ToTensor")})


STUBS = {
    "wandb": lambda: _module("wandb", init=_unavailable("wandb.init"), log=_unavailable("wandb.log"),
                             finish=_unavailable("wandb.finish")),  # utils.py / main.py log to W&B; never called here
    "decorator": _stub_decorator,
    "torchvision": _stub_torchvision,
    "imblearn": lambda: (_module("imblearn"),  # data/data_utils.py: RandomOverSampler, for the MIMIC-IV split only
                         _module("imblearn.over_sampling", RandomOverSampler=_unavailable("RandomOverSampler"))),
    "yaml": lambda: _module("yaml", safe_load=_unavailable("yaml.safe_load")),  # utils.setup_task's config reader
}


def install_stubs() -> list[str]:
    """A minimal stand-in for each package the official modules import at top level but the MLP path never uses,
    only when the real one does not import here.  Returns the names stubbed."""
    stubbed = []
    for name, make in STUBS.items():
        if not _importable(name):
            make()
            stubbed.append(name)
    return stubbed


# ---------------------------------------------------------------------- inputs
def check_checkout(path: str) -> Path:
    root = Path(path).expanduser().resolve()
    if not root.is_dir():
        fail(f"no checkout of Valdeira/LASER-VFL at {path} (git clone https://github.com/Valdeira/LASER-VFL {path})")
    missing = [f for f in NEEDED if not (root / f).is_file()]
    if missing:
        fail(f"{path} is not a checkout of Valdeira/LASER-VFL: no {', '.join(missing)}")
    return root


def load_npz(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        fail(f"no such data file: {path}")
    try:
        z = np.load(p, allow_pickle=False)
    except Exception as e:
        fail(f"{path} is not a readable .npz ({e})")
    with z:
        lacking = [k for k in ("x_train", "y_train", "num_clients", "p_miss_train") if k not in z.files]
        if lacking:
            fail(f"{path} lacks {', '.join(lacking)} (it has {', '.join(z.files) or 'nothing'})")
        x, y = z["x_train"], z["y_train"]
        k, p = int(z["num_clients"]), float(z["p_miss_train"])
        n_classes = int(z["num_classes"]) if "num_classes" in z.files else None
    if x.ndim != 2 or not np.issubdtype(x.dtype, np.floating):
        fail(f"x_train must be a 2-D float array (n, K*d), got {x.dtype} {x.shape}")
    if y.ndim != 1 or y.shape[0] != x.shape[0] or not np.issubdtype(y.dtype, np.integer):
        fail(f"y_train must be a 1-D integer array of x_train's {x.shape[0]} rows, got {y.dtype} {y.shape}")
    if x.shape[0] == 0:
        fail("x_train has no rows")
    if k < 1 or x.shape[1] % k:
        fail(f"x_train's {x.shape[1]} columns do not split into num_clients={k} equal blocks "
             "(the official MLP slices columns [i*d, (i+1)*d) for party i)")
    if not 0.0 <= p < 1.0:
        fail(f"p_miss_train must be in [0, 1), got {p}")
    if not np.isfinite(x).all():
        fail("x_train has NaN or infinite values: give complete features (the official code draws the missingness)")
    n_classes = int(y.max()) + 1 if n_classes is None else n_classes
    if y.min() < 0 or y.max() >= n_classes:
        fail(f"y_train must hold class indices 0..{n_classes - 1}, got {y.min()}..{y.max()}")
    return dict(x=np.ascontiguousarray(x, np.float32), y=y.astype(np.int64), k=k, p=p, n_classes=n_classes)


class Rows(torch.utils.data.Dataset):
    """The .npz rows as the official ``CustomDataset`` expects its base dataset: ``(features, label)`` items (a float32
    row and a 0-d int64 tensor, like its HAPTDataset) and a ``classes`` list."""

    def __init__(self, x: np.ndarray, y: np.ndarray, n_classes: int) -> None:
        self.X, self.y = torch.from_numpy(x), torch.from_numpy(y)
        self.classes = [str(c) for c in range(n_classes)]

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.X[idx], self.y[idx]


def official_config(root: Path, stubbed: list[str]) -> tuple[dict[str, Any], str]:
    """The hapt LASER-VFL entry of the checkout's config (4 clients, p_miss_train 0.1), or HAPT when unreadable."""
    if "yaml" in stubbed:
        return dict(HAPT), "built-in hapt values (PyYAML missing)"
    import yaml

    try:
        entry = yaml.safe_load((root / "configs" / "task_config.yaml").read_text())["laser"]["hapt"][4][0.1]
        return {k: entry[k] for k in HAPT}, "configs/task_config.yaml: laser/hapt/4/0.1"
    except (OSError, KeyError, TypeError, yaml.YAMLError):
        return dict(HAPT), "built-in hapt values (configs/task_config.yaml unreadable)"


# ---------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkout", required=True, help="a checkout of github.com/Valdeira/LASER-VFL")
    ap.add_argument("--data", required=True, help=".npz with x_train, y_train, num_clients, p_miss_train")
    ap.add_argument("--epochs", type=int, required=True, help="training epochs (each one timed)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--seed", type=int, default=0, help="the official set_seed (numpy, torch, random)")
    ap.add_argument("--device", default="cpu", help="the official code's args.device: cpu (default), cuda, cuda:N")
    ap.add_argument("--num-workers", type=int, default=0,
                    help="DataLoader worker processes (default 0, in process; the official hapt config has 1)")
    for name in ("lr", "momentum", "weight-decay"):
        ap.add_argument(f"--{name}", type=float, help="override the official config's value")
    ap.add_argument("--batch-size", type=int, help="override the official config's value")
    a = ap.parse_args(argv)
    if a.epochs < 1:
        fail(f"--epochs must be at least 1, got {a.epochs}")
    if a.threads < 1:
        fail(f"--threads must be at least 1, got {a.threads}")
    root = check_checkout(a.checkout)
    data = load_npz(a.data)
    torch.set_num_threads(a.threads)

    stubbed = install_stubs()
    config, source = official_config(root, stubbed)
    for key in ("lr", "momentum", "weight_decay", "batch_size"):  # flags: noted only where they change a value
        if getattr(a, key) is not None and getattr(a, key) != config[key]:
            source += f", --{key.replace('_', '-')} {getattr(a, key)} (not {config[key]})"
            config[key] = getattr(a, key)

    sys.path.insert(0, str(root))
    log = sys.stderr  # the official modules' prints (progress, timings) stay off our one JSON line
    with contextlib.redirect_stdout(log):
        try:
            import models.mlp as mlp
            from criterions import get_criterion
            from data.data_utils import create_data_loader
            from methods.laser import train_laser
            from models import get_model
            from optimizers import get_optimizer
            from utils import set_seed
        except Exception as e:
            fail(f"importing the official code from {root} failed: {type(e).__name__}: {e}")

        official_sizes = mlp.task_to_hyperparameters
        d = data["x"].shape[1] // data["k"]

        @functools.wraps(official_sizes)
        def sizes(dataset: str) -> tuple[Any, ...]:
            if dataset != TASK:
                return official_sizes(dataset)
            _, _, cut_dim, hidden_dim = official_sizes("hapt")  # 128, 128: the hapt MLP
            return data["n_classes"], d, cut_dim, hidden_dim

        mlp.task_to_hyperparameters = sizes

        args = argparse.Namespace(device=torch.device(a.device), num_clients=data["k"], method="laser",
                                  method_type="laser", task_name=TASK, p_miss_train=data["p"], seed=a.seed)
        set_seed(a.seed)
        models = get_model("laser", "mlp", TASK, args, dict(config, dataset=TASK, model="mlp"))
        optimizers = get_optimizer("laser", config["optimizer"], models, config)
        criterion = get_criterion(config["criterion"])
        order = np.random.permutation(len(data["y"]))  # shuffled once at load, as its HAPTDataset does
        rows = Rows(data["x"][order], data["y"][order], data["n_classes"])
        loader = create_data_loader(rows, int(config["batch_size"]), data["k"], data["p"], a.num_workers)
        patterns = loader.dataset.batch_patterns
        train = getattr(train_laser, "__wrapped__", train_laser)  # without time_decorator (a print)

        seconds, metrics = [], {}
        def sync() -> None:  # a GPU's queued work belongs to the epoch that queued it
            if args.device.type == "cuda":
                torch.cuda.synchronize(args.device)

        for _ in range(a.epochs):
            sync()
            t0 = time.perf_counter()
            metrics = train(loader, models, optimizers, criterion, args, compute_f1=False)
            sync()
            seconds.append(time.perf_counter() - t0)

    powerset = models[0].powerset
    acc = metrics.get("train_acc")
    out = {
        "epochs": a.epochs, "train_seconds": round(sum(seconds), 4), "epoch_seconds": [round(s, 4) for s in seconds],
        "seconds_per_epoch_after_first": round(float(np.mean(seconds[1:])), 4) if len(seconds) > 1 else None,
        "train_acc_all_blocks": round(acc[powerset.index(tuple(range(data["k"])))], 2) if acc else None,
        "train_acc_mean_over_block_sets": round(float(np.mean(acc)), 2) if acc else None,
        "rows": len(rows), "num_clients": data["k"], "block_width": d, "num_classes": data["n_classes"],
        "p_miss_train": data["p"], "batches_per_epoch": len(loader),
        "batches_skipped_no_block_observed": int(sum(not np.any(m) for m in patterns)),
        "mean_blocks_observed_per_batch": round(float(np.mean([np.sum(m) for m in patterns])), 3),
        "hyperparameters": {k: config[k] for k in ("optimizer", "lr", "momentum", "weight_decay", "batch_size")},
        "hyperparameters_from": source, "num_workers": a.num_workers, "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__, "stubbed": stubbed, "checkout": str(root), "device": a.device,
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
