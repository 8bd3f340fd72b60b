"""The ``partialvfl`` command: datasets, describe, fit, evaluate (and bench, report, party servers, certificates).

Run ``partialvfl COMMAND --help`` for each command's options.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["main"]

PROTOCOL_DEFAULTS = {"dataset": "digits", "parties": 4, "labels": 500, "aligned": 100}


# ---------------------------------------------------------------------------------------------- shared options
def _add_protocol_options(p: argparse.ArgumentParser, *, test: bool, train: bool = True) -> None:
    g = p.add_argument_group("protocol (the FALSE-VFL paper's: labels, aligned reserve, missingness)")
    g.add_argument("--dataset", default=PROTOCOL_DEFAULTS["dataset"],
                   help="dataset name (see `partialvfl datasets`); default: %(default)s")
    g.add_argument("--data-dir", default=None, help="directory holding the dataset's original files, if needed")
    g.add_argument("--parties", type=int, default=PROTOCOL_DEFAULTS["parties"],
                   help="number of parties K; default: %(default)s")
    g.add_argument("--labels", type=int, default=PROTOCOL_DEFAULTS["labels"],
                   help="labelled training samples (paper: 500 tabular, 1000 images); default: %(default)s")
    g.add_argument("--aligned", type=int, default=PROTOCOL_DEFAULTS["aligned"],
                   help="labelled samples kept fully aligned (paper: 100 / 200); default: %(default)s")
    if train:
        g.add_argument("--train-missing", default="mcar:0.2",
                       help="mechanism for all other training samples (none, mcar:P, mar1, mar2, mnar:P, beta, "
                            "absent:K); default: %(default)s")
    if test:
        g.add_argument("--test-missing", default="none", help="mechanism for every test sample; default: %(default)s")
    g.add_argument("--splitter", default=None, help="party split: contiguous, grid, grid:RxC, columns:...")
    g.add_argument("--max-train", type=int, default=None, help="cap the training set (quick runs)")
    g.add_argument("--max-test", type=int, default=None, help="cap the test set (quick runs)")
    g.add_argument("--seed", type=int, default=0, help="seed for split, labels, mechanisms, model; default: 0")


def _protocol_config(args: argparse.Namespace, test_missing: str | None = None) -> Any:
    from partialvfl.data.protocol import ProtocolConfig

    return ProtocolConfig(
        dataset=args.dataset,
        parties=args.parties,
        n_labels=args.labels,
        n_aligned=args.aligned,
        train_missing=getattr(args, "train_missing", "none"),
        test_missing=test_missing if test_missing is not None else getattr(args, "test_missing", "none"),
        seed=args.seed,
        splitter=args.splitter,
        max_train=args.max_train,
        max_test=args.max_test,
        data_dir=args.data_dir,
    )


def _emit(obj: Any, as_json: bool, text: str) -> None:
    if as_json:
        print(json.dumps(obj, indent=2, default=str))
    else:
        print(text)


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _parse_params(items: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"--param takes KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        out[k.strip().replace("-", "_")] = _parse_value(v.strip())
    return out


# ---------------------------------------------------------------------------------------------- datasets
def cmd_datasets(args: argparse.Namespace) -> int:
    from partialvfl.data.sources import list_sources

    rows = list_sources()
    if args.json:
        _emit(rows, True, "")
        return 0
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        mark = "yes" if r.get("available") else "no "
        shape = r.get("shape") or ""
        classes = r.get("n_classes") or ""
        print(f"{r['name']:<{width}}  available: {mark}  {shape!s:<28} classes: {classes!s:<4} {r.get('where', '')}")
    return 0


# ---------------------------------------------------------------------------------------------- describe
def _summary_table(name: str, s: dict[str, Any]) -> str:
    lines = [f"{name}: {s['n_samples']} samples, {s['n_labeled']} labelled, {s['all_missing']} with no observed party"]
    lines.append("  observed fraction per party: " + ", ".join(f"{v:.3f}" for v in s["observed_fraction"]))
    hist = s["observed_parties_histogram"]
    lines.append("  samples by number of observed parties: " + ", ".join(f"{k}: {v}" for k, v in enumerate(hist)))
    return "\n".join(lines)


def cmd_describe(args: argparse.Namespace) -> int:
    from partialvfl.data.protocol import describe, make_protocol

    train, test = make_protocol(_protocol_config(args))
    out = describe(train, test)
    _emit(out, args.json, _summary_table("train", out["train"]) + "\n" + _summary_table("test", out["test"]))
    return 0


# ---------------------------------------------------------------------------------------------- fit / evaluate
def _epoch_params(method_cls: Any, epochs: int) -> dict[str, Any]:
    keys = [k for k in method_cls.default_params() if k.startswith("epochs")]
    if not keys:
        raise ValueError(f"method {method_cls.name!r} has no epoch parameter; use --param")
    return {k: epochs for k in keys}


def cmd_fit(args: argparse.Namespace) -> int:
    from partialvfl.data.protocol import make_protocol
    from partialvfl.federation.messages import MessageLog
    from partialvfl.methods import get_method
    from partialvfl.methods.evaluation import evaluate

    method_cls = get_method(args.method)
    params = _parse_params(args.param)
    if args.epochs is not None:
        params.update(_epoch_params(method_cls, args.epochs))
    config = _protocol_config(args, test_missing="none")
    train, test = make_protocol(config)
    print(f"data: {train!r}", file=sys.stderr)
    model = method_cls(args.preset, seed=args.seed, progress=not args.quiet, **params)
    log = MessageLog(keep_entries=False)
    t0 = time.perf_counter()
    model.fit(train, log=log)
    fit_s = time.perf_counter() - t0
    out = model.save(args.out)
    res = evaluate(model, test)
    print(f"fit {args.method} in {fit_s:.1f} s; {log.total_bytes() / 1e6:.1f} MB crossed between parties; "
          f"saved to {out}", file=sys.stderr)
    metric = "accuracy" if "accuracy" in res else "rmse"
    print(f"test ({config.test_missing}): {metric} {res[metric]:.4f}")
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    from partialvfl.data.protocol import ProtocolConfig, make_protocol
    from partialvfl.methods import VFLMethod
    from partialvfl.methods.evaluation import metrics_from_predictions

    model = VFLMethod.load(args.model)
    info = model.data_info_.get("protocol")
    if not info:
        raise ValueError(f"the model in {args.model} does not record the protocol it was trained under")
    cfg = dict(info)
    cfg["test_missing"] = args.test_missing
    if args.seed is not None and args.seed != cfg.get("seed"):
        raise ValueError(
            f"the model was trained with seed {cfg.get('seed')}; its test split is tied to that seed "
            "(pass the same --seed or leave it out)"
        )
    if args.data_dir:
        cfg["data_dir"] = args.data_dir
    _, test = make_protocol(ProtocolConfig(**cfg))
    t0 = time.perf_counter()
    if args.mode == "local":
        if args.party is None:
            raise ValueError("--mode local needs --party K")
        if not hasattr(model, "predict_output_local"):
            raise ValueError(f"method {model.name!r} has no locally independent inference")
        output = model.predict_output_local(test, args.party)
    else:
        output = model.predict_output(test)
    res = metrics_from_predictions(output, test)
    res.update({
        "method": model.name, "test_missing": args.test_missing, "mode": args.mode, "party": args.party,
        "predict_seconds": time.perf_counter() - t0, "params": model.params_,
        "pretrained": model.params_.get("pretrain"),
    })
    metric = "accuracy" if "accuracy" in res else "rmse"
    alone = f", party {args.party} predicting alone" if args.mode == "local" else ""
    lines = [f"{model.name} on {cfg.get('dataset')} under test mechanism {args.test_missing}{alone}: "
             f"{metric} {res[metric]:.4f} over {res['n_samples']} samples"]
    if res["pretrained"] is not None:
        how = "pretrained with SimSiam" if res["pretrained"] else "trained on labelled data only"
        lines.append(f"  local encoders {how}")
    for k, v in res["by_observed_parties"].items():
        lines.append(f"  {k} observed parties: {metric} {v[metric]:.4f} (n={v['n']})")
    if res["all_missing"]:
        lines.append(f"  ({res['all_missing']} samples with no observed party were predicted from the label prior)")
    _emit(res, args.json, "\n".join(lines))
    return 0


def cmd_methods(args: argparse.Namespace) -> int:
    from partialvfl.methods import get_method, method_names

    rows = []
    for name in method_names():
        cls = get_method(name)
        rows.append({"name": name, "presets": list(cls.presets), "params": cls.default_params()})
    if args.json:
        _emit(rows, True, "")
    else:
        for r in rows:
            print(f"{r['name']:<14} presets: {', '.join(r['presets'])}")
            print("    " + ", ".join(f"{k}={v}" for k, v in r["params"].items()))
    return 0


# ---------------------------------------------------------------------------------------------- parser
_PLUGINS = ("partialvfl.bench.cli", "partialvfl.federation.grpc_cli")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="partialvfl",
        description="Vertical federated learning on partially aligned, partially labelled data.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("datasets", help="list datasets, whether they are available here and where they read from")
    p.add_argument("--json", action="store_true", help="one JSON list")
    p.set_defaults(func=cmd_datasets)

    p = sub.add_parser("describe", help="build the paper's protocol on a dataset and describe the missingness")
    _add_protocol_options(p, test=True)
    p.add_argument("--json", action="store_true", help="one JSON object with keys train and test")
    p.set_defaults(func=cmd_describe)

    p = sub.add_parser("methods", help="list methods, presets and parameters")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_methods)

    p = sub.add_parser("fit", help="fit a method under the paper's protocol and save it")
    _add_protocol_options(p, test=False)
    p.add_argument("--method", default="false-vfl-1", help="method name (see `partialvfl methods`)")
    p.add_argument("--preset", default="fast", help="fast (CPU) or paper; default: %(default)s")
    p.add_argument("--epochs", type=int, default=None, help="set every epoch count of the method")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="override one method parameter (JSON value), repeatable")
    p.add_argument("--out", required=True, help="directory to save the model in")
    p.add_argument("--quiet", action="store_true", help="no per-epoch progress")
    p.set_defaults(func=cmd_fit)

    p = sub.add_parser("evaluate", help="evaluate a saved model under a test mechanism")
    p.add_argument("--model", required=True, help="directory of a saved model")
    p.add_argument("--test-missing", default="none", help="mechanism applied to every test sample")
    p.add_argument("--seed", type=int, default=None, help="must equal the training seed (the default)")
    p.add_argument("--data-dir", default=None, help="where the dataset's files are, if not where they were")
    p.add_argument("--mode", choices=("collaborative", "local"), default="collaborative",
                   help="collaborative (any observed parties) or local (one party alone, methods that support it)")
    p.add_argument("--party", type=int, default=None, help="the party predicting alone in --mode local")
    p.add_argument("--json", action="store_true", help="one JSON object (with at least `accuracy` or `rmse`)")
    p.set_defaults(func=cmd_evaluate)

    for mod in _PLUGINS:
        try:
            plugin = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if not (e.name and (mod == e.name or mod.startswith(e.name + "."))):
                raise  # a real missing dependency, not an absent plugin
            continue
        plugin.add_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, KeyError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
