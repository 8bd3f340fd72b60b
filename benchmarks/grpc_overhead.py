"""What the gRPC wire costs: the same method trained and used in process and across real party processes.

``digits`` split over K parties (default 4), each party a separate ``partialvfl party serve`` process on
127.0.0.1 with mutual TLS, plus this process as the coordinator.  Reports, for training and for prediction:
wall time in process vs federated and their ratio (the fastest of interleaved repeats, after one warm-up fit on
each side, since the first use of an optimiser imports lazily for seconds in every process); the cost of one more
epoch on each side (the same fits with ``--extra-epochs`` more epochs per stage, minus the shorter ones: a whole
fit's ratio includes the set-up rounds and the first batches, which do not grow with the epochs); and bytes that crossed
a party boundary per sample per step (tensor bytes from the message log; on-the-wire frame bytes, which include the
coordinator's traffic with its own party and the safetensors/JSON headers, beside them).  It also reports how far
the two runs' predictions are apart: the largest difference of a predicted probability and the share of test rows
whose predicted class is the same (they are equal only where the method's federated path computes exactly as in
process; nothing here asserts it).  No accuracy is printed: a few epochs measure the wire, not the model.

    python benchmarks/grpc_overhead.py                   # false-vfl-1, 4 parties, 2+2 epochs
    python benchmarks/grpc_overhead.py --method vanilla-vfl --epochs 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from partialvfl.data.protocol import ProtocolConfig, make_protocol
from partialvfl.federation.grpc.local import LocalDeployment
from partialvfl.federation.wire.messages import MessageLog
from partialvfl.methods.base import get_method
from partialvfl.utils.progress import progress


def epoch_params(method: str, epochs: int) -> dict[str, Any]:
    """Override the epoch counts of the methods we know (FALSE-VFL has two stages)."""
    if method.startswith("false-vfl"):
        return {"pretrain_epochs": epochs, "epochs": epochs}
    cls = get_method(method)
    return {k: epochs for k in cls.default_params() if k == "epochs"}


def samples_per_fit(method: str, train: Any, epochs: int) -> int:
    """Sample-steps of training: every sample a stage trains on, once per epoch of each stage.  FALSE-VFL: stage 1
    on every sample with an observed block, stage 2 on the labelled ones; a split-network method: its own training
    rows (Vanilla VFL: the labelled rows every party observes; Local: those the active party observes)."""
    some = int(train.observed.any(axis=1).sum())
    labeled = int((train.labeled & train.observed.any(axis=1)).sum())
    if method.startswith("false-vfl"):
        return epochs * (some + labeled)
    rows = getattr(get_method(method)("fast"), "_training_rows", None)
    return epochs * (len(rows(train.coordinator_view())) if rows is not None else labeled)


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    cfg = ProtocolConfig("digits", parties=args.parties, n_labels=args.labels, n_aligned=args.aligned,
                         train_missing=args.train_missing, seed=args.seed)
    train, test = make_protocol(cfg)
    cls = get_method(args.method)
    params = epoch_params(args.method, args.epochs)
    warm = epoch_params(args.method, 1)
    # what fit(train) tells the method in process: the dataset (its presets) and that the protocol's data are
    # standardised already (without it each party would standardise them a second time: another model)
    dataset = train.info.get("dataset") or train.info.get("protocol", {}).get("dataset") or train.name or None
    same = {"dataset": dataset, "data_info": train.info}
    fit_local, fit_remote, pred_local, pred_remote = [], [], [], []
    long_local: list[float] = []  # extra seconds of the fits with --extra-epochs more epochs
    long_remote: list[float] = []

    with tempfile.TemporaryDirectory() as tmp, LocalDeployment(Path(tmp), train, extra=[test], deadline=120.0) as dep:
        t0 = time.perf_counter()
        dep.start()
        start_s = time.perf_counter() - t0
        log = MessageLog()
        fed = dep.federation(log=log)
        t = fed.grpc_transport
        try:
            handle = fed.attach(train, "train")
            # first use of an optimiser imports lazily for seconds, in every process: warm both sides up
            cls(args.preset, seed=args.seed, **warm).fit(train)
            cls(args.preset, seed=args.seed, **warm).fit_federated(fed, train.coordinator_view(), handle, **same)
            # interleave the runs: the machine is shared, so its load drifts; report the fastest of each
            for rep in progress(range(args.repeats), "repeats"):
                t0 = time.perf_counter()
                local = cls(args.preset, seed=args.seed, **params).fit(train)
                fit_local.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                p_local = local.predict_proba(test)
                pred_local.append(time.perf_counter() - t0)

                log.clear()
                wire0, party0 = t.bytes_sent + t.bytes_received, t.party_seconds
                remote = cls(args.preset, seed=args.seed, **params)
                t0 = time.perf_counter()
                remote.fit_federated(fed, train.coordinator_view(), handle, **same)
                fit_remote.append(time.perf_counter() - t0)
                if rep == 0:
                    train_bytes = log.total_bytes()
                    wire_train = t.bytes_sent + t.bytes_received - wire0
                    party_train = t.party_seconds - party0
                    n_messages = len(log.crossing())
                log.clear()
                wire0 = t.bytes_sent + t.bytes_received
                t0 = time.perf_counter()
                p_remote = remote.predict_proba(test)
                pred_remote.append(time.perf_counter() - t0)
                if rep == 0:
                    pred_bytes = log.total_bytes()
                    wire_pred = t.bytes_sent + t.bytes_received - wire0
                if args.extra_epochs:  # the same fits with more epochs: the difference is the cost of an epoch
                    longer = epoch_params(args.method, args.epochs + args.extra_epochs)
                    t0 = time.perf_counter()
                    cls(args.preset, seed=args.seed, **longer).fit(train)
                    long_local.append(time.perf_counter() - t0 - fit_local[-1])
                    t0 = time.perf_counter()
                    cls(args.preset, seed=args.seed, **longer).fit_federated(fed, train.coordinator_view(), handle,
                                                                             **same)
                    long_remote.append(time.perf_counter() - t0 - fit_remote[-1])
        finally:
            fed.close()
    n_fit = samples_per_fit(args.method, train, args.epochs)
    n_pred = int(test.observed.any(axis=1).sum())
    fl, fr, pl, pr = min(fit_local), min(fit_remote), min(pred_local), min(pred_remote)
    per_epoch: dict[str, Any] = {}
    if long_local:
        # epochs added per stage: FALSE-VFL trains two stages, so extra_epochs adds 2 x extra_epochs epochs
        added = args.extra_epochs * (2 if args.method.startswith("false-vfl") else 1)
        el, er = np.median(long_local) / added, np.median(long_remote) / added
        per_epoch = {"extra_epoch_seconds_in_process": round(float(el), 3),
                     "extra_epoch_seconds_federated": round(float(er), 3),
                     "extra_epoch_ratio": round(float(er / max(el, 1e-9)), 2)}
    return {
        "method": args.method, "preset": args.preset, "parties": args.parties, "epochs": args.epochs,
        "repeats": args.repeats, "train_samples": train.n_samples, "predict_samples": test.n_samples,
        "party_start_seconds": round(start_s, 2),
        "fit_seconds_per_epoch_in_process": round(fl / args.epochs, 3),
        "fit_seconds_per_epoch_federated": round(fr / args.epochs, 3),
        "fit_ratio": round(fr / fl, 2),
        "fit_ratio_median": round(float(np.median(fit_remote) / np.median(fit_local)), 2),
        "fit_seconds_all_in_process": [round(v, 2) for v in fit_local],
        "fit_seconds_all_federated": [round(v, 2) for v in fit_remote],
        **per_epoch,
        "fit_party_compute_seconds": round(party_train, 2),
        "fit_crossing_messages": n_messages,
        "fit_crossing_bytes_per_sample_step": round(train_bytes / max(n_fit, 1), 1),
        "fit_wire_bytes_per_sample_step": round(wire_train / max(n_fit, 1), 1),
        "predict_seconds_in_process": round(pl, 3), "predict_seconds_federated": round(pr, 3),
        "predict_ratio": round(pr / max(pl, 1e-9), 2),
        "predict_crossing_bytes_per_sample": round(pred_bytes / max(n_pred, 1), 1),
        "predict_wire_bytes_per_sample": round(wire_pred / max(n_pred, 1), 1),
        "max_abs_prediction_difference": float(np.abs(p_remote - p_local).max()),
        "same_predicted_class": round(float((p_remote.argmax(1) == p_local.argmax(1)).mean()), 4),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", default="false-vfl-1")
    ap.add_argument("--preset", default="fast")
    ap.add_argument("--parties", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=2, help="epochs (per stage for FALSE-VFL)")
    ap.add_argument("--labels", type=int, default=500)
    ap.add_argument("--aligned", type=int, default=100)
    ap.add_argument("--train-missing", default="mcar2")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved timing repeats (fastest reported)")
    ap.add_argument("--extra-epochs", type=int, default=2,
                    help="also fit with this many more epochs (per stage) and report the cost of one epoch as the "
                         "difference, without the fit's fixed costs (set-up, first rounds); 0 skips it")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args(argv)
    res = run(args)
    width = max(len(k) for k in res)
    for k, v in res.items():
        print(f"{k:<{width}}  {v}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
