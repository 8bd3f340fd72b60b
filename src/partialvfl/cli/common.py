"""What several commands share: the protocol options (dataset, parties, labels, missingness), the own-tables options
(``--table PARTY=FILE``, ``--id-column``, ``--label``, ``--active``) and output.

The splitter and mechanism forms listed in ``--help`` are written here (importing the data layer would slow down
``--help``); ``tests/test_cli_tables.py`` checks them against :func:`~partialvfl.data.splitters.parse_splitter` and
:func:`~partialvfl.data.mechanisms.parse_mechanism`.
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

from partialvfl.methods.registry import DEFAULT_METHOD

__all__ = ["DEFAULT_METHOD", "DEFAULT_PRESET", "MECHANISMS", "MECHANISM_FORMS", "PRESET_HELP", "PROTOCOL_DEFAULTS",
           "SPLITTERS", "SPLITTER_FORMS", "THREADS_HELP", "add_device_options", "add_protocol_options",
           "add_table_options", "add_threads_option", "device_form", "device_options", "emit", "non_negative",
           "parse_tables", "preset_help", "protocol_config", "refuse_protocol_options", "seed_form", "threads_for"]

PROTOCOL_DEFAULTS = {"dataset": "digits", "parties": 4, "labels": 500, "aligned": 100}
#: the preset ``fit`` uses without ``--preset`` (also a grid entry's default); ``methods`` marks it
DEFAULT_PRESET = "fast"
#: ``fit --preset``'s help: :func:`preset_help` writes it from the method declarations and
#: ``tests/test_cli_vocabulary.py`` keeps the two equal (written out here: reading the declarations imports torch,
#: and ``--help`` stays light)
PRESET_HELP = ("the method's preset: fast (every method); paper (every method); laser-paper (combinatorial, ensemble, "
               "laser-vfl, local, plug-vfl, vanilla-vfl); default: fast (`partialvfl methods` lists each preset's "
               "values)")
#: every splitter form (see docs/data.md)
SPLITTERS = ("contiguous", "grid", "grid:RxC", "grid:near", "grid:near:RxC", "importance:alpha=A", "views",
             "columns:G1;G2;...")
#: every mechanism form (see docs/data.md): P a probability, K a party index, T/D/B/A numbers
MECHANISMS = ("none", "mcar:P", "mcar0", "mcar2", "mcar5", "mar1", "mar1:threshold=T,decrement=D", "mar2",
              "mar2:threshold=T,budget=B,decrement=D", "mnar:P", "mnar7", "mnar9", "beta", "beta:a=A,b=B", "absent:K",
              "absent:K1,K2")
SPLITTER_FORMS = " | ".join(SPLITTERS) + " (e.g. columns:0-76;77,80)"
MECHANISM_FORMS = " | ".join(MECHANISMS)


def preset_help() -> str:
    """``fit --preset``'s help, from the method declarations: each preset and the methods the package ships with it."""
    from partialvfl.methods.registry import load_specs, package_methods

    specs, methods = load_specs(), package_methods()
    by_preset: dict[str, list[str]] = {}
    for name in methods:
        for preset in specs[name].params.preset_names:
            by_preset.setdefault(preset, []).append(name)
    presets = [f"{p} ({'every method' if len(ms) == len(methods) else ', '.join(ms)})" for p, ms in by_preset.items()]
    return ("the method's preset: " + "; ".join(presets) + f"; default: {DEFAULT_PRESET} "
            "(`partialvfl methods` lists each preset's values)")


def add_protocol_options(p: argparse.ArgumentParser, *, test: bool, train: bool = True) -> None:
    """The options of :func:`protocol_config` (``--train-missing`` if ``train``, ``--test-missing`` if ``test``).

    Records their names (all but ``--seed``) as the parser default ``protocol_options``: the options that
    :func:`refuse_protocol_options` refuses beside ``--table``.
    """
    g = p.add_argument_group("protocol (the FALSE-VFL paper's: labels, aligned reserve, missingness)")
    options = [
        g.add_argument("--dataset", default=PROTOCOL_DEFAULTS["dataset"],
                       help="dataset name (see `partialvfl datasets`); default: %(default)s"),
        g.add_argument("--data-dir", default=None, help="directory holding the dataset's original files, if needed"),
        g.add_argument("--parties", type=int, default=PROTOCOL_DEFAULTS["parties"],
                       help="number of parties K; default: %(default)s"),
        g.add_argument("--labels", type=int, default=PROTOCOL_DEFAULTS["labels"],
                       help="labelled training samples (paper: 500 tabular, 1000 images); default: %(default)s"),
        g.add_argument("--aligned", type=int, default=PROTOCOL_DEFAULTS["aligned"],
                       help="labelled samples kept fully aligned (paper: 100 / 200); default: %(default)s"),
    ]
    if train:
        options.append(g.add_argument(
            "--train-missing", default="mcar:0.2",
            help=f"mechanism for all other training samples: {MECHANISM_FORMS}; default: %(default)s"))
    if test:
        options.append(g.add_argument(
            "--test-missing", default="none",
            help=f"mechanism for every test sample: {MECHANISM_FORMS}; default: %(default)s"))
    options += [
        g.add_argument("--splitter", default=None, help=f"party split: {SPLITTER_FORMS}; default: grid for images, "
                                                        "views for multi-view sources, contiguous otherwise"),
        g.add_argument("--max-train", type=int, default=None, help="cap the training set (quick runs)"),
        g.add_argument("--max-test", type=int, default=None, help="cap the test set (quick runs)"),
    ]
    g.add_argument("--seed", type=seed_form, default=0, metavar="N",
                   help="seed for split, labels, mechanisms, model (an integer >= 0); default: 0")
    p.set_defaults(protocol_options=tuple(a.dest for a in options))


THREADS_HELP = ("torch threads for the fit: a number, or auto (default): one thread when the method's estimated "
                "work per training step is small (under 2 GFLOP), else all cores; OpenMP's idle threads sleep "
                "instead of spinning either way, so a shared machine slows down in proportion (see "
                "docs/benchmarks.md)")


def add_threads_option(p: argparse.ArgumentParser, help_text: str = THREADS_HELP) -> None:
    """``--threads N|auto``."""
    p.add_argument("--threads", default="auto", metavar="N|auto", help=help_text)


def seed_form(text: str) -> int:
    """An argparse ``type`` for ``--seed``: read by the declared parameter (:data:`~partialvfl.methods.params.SEED`),
    as the constructor checks it."""
    from partialvfl.methods.params import parse_seed  # torch-free; imported when a --seed is read

    try:
        return parse_seed(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


_DEVICE = re.compile(r"^(auto|cpu|cuda|cuda:\d+|mps)$")


def device_form(text: str) -> str:
    """An argparse ``type`` for ``--device`` (its form; whether the machine has it is checked when it runs)."""
    value = text.strip().lower()
    if not _DEVICE.match(value):
        raise argparse.ArgumentTypeError(f"{text!r}: choose one of auto, cpu, cuda, cuda:N, mps")
    return value


def add_device_options(p: argparse.ArgumentParser, *, compile_option: bool = True) -> None:
    """``--device``, ``--precision`` (and ``--compile``): where and how the fit or prediction computes."""
    g = p.add_argument_group("devices (docs/benchmarks.md, Devices)")
    g.add_argument("--device", default="auto", type=device_form, metavar="auto|cpu|cuda|cuda:N|mps",
                   help="where the coordinator and the in-process parties compute: auto (default) is the first CUDA "
                        "GPU if torch sees one, else the CPU; a federation's parties choose their own (party.toml)")
    g.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="fp32 (default), or bf16: autocast of the modules' matmuls and convolutions to bfloat16 "
                        "(likelihoods, losses and predicted probabilities stay float32)")
    if compile_option:
        g.add_argument("--compile", action="store_true",
                       help="compile FALSE-VFL's and the split-network methods' hot steps with torch.compile "
                            "(inductor, on-disk cache; needs a C++ compiler, falls back to eager with a message)")


def device_options(args: argparse.Namespace) -> dict[str, Any]:
    """``device``, ``precision`` (and ``compile``) for a method or a loaded model; a device this machine lacks is
    refused here, naming ``--device``."""
    from partialvfl.utils.devices import resolve_device

    device = getattr(args, "device", "cpu")
    resolve_device(device, what="--device")
    out = {"device": device, "precision": getattr(args, "precision", "fp32")}
    if getattr(args, "compile", False):
        out["compile"] = True
    return out


def threads_for(args: argparse.Namespace, model: Any, data: Any) -> int:
    """The torch threads ``--threads`` gives a fit of ``model`` on ``data`` (a dataset or a coordinator's view; see
    :mod:`partialvfl.utils.threads`)."""
    from partialvfl.orchestration import fit_threads

    return fit_threads(getattr(args, "threads", "auto"), model, data)


def protocol_config(args: argparse.Namespace, test_missing: str | None = None) -> Any:
    """The :class:`~partialvfl.data.protocol.ProtocolConfig` the options describe."""
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


def add_table_options(p: argparse.ArgumentParser, *, fit: bool, ids: bool = False) -> None:
    """``--table PARTY=FILE`` (repeatable), ``--id-column``, ``--label`` (and for ``fit`` ``--active``,
    ``--hmac-key``); ``ids``: the command also reads ``--ids FILE`` across a federation, whose ID column
    ``--id-column`` names too.  ``--id`` is the old spelling of ``--id-column`` (it warns)."""
    from partialvfl.cli.vocabulary import add_old_spelling

    g = p.add_argument_group("your own tables (one per party, joined on an ID column; docs/own-data.md)")
    g.add_argument("--table", action="append", default=[], metavar="PARTY=FILE",
                   help="one party's table (CSV or Parquet), repeatable: one per party"
                        + ("" if fit else "; default columns: the model's"))
    g.add_argument("--id-column", dest="id_column", default=None, metavar="COLUMN",
                   help="the ID column of every table" + ("" if fit else " (default: the one the model was fitted on)")
                        + ("; with --federation, the ID column of --ids (default: its first column)" if ids else ""))
    add_old_spelling(g, "--id", dest="id_column", new="--id-column COLUMN")
    g.add_argument("--label", dest="label_column", default=None, metavar="COLUMN",
                   help="the label column, in the active party's table" + (
                       "" if fit else " (default: the model's; tables of new users need none)"))
    if fit:
        g.add_argument("--active", default=None, metavar="PARTY", help="the party that holds the labels")
        g.add_argument("--hmac-key", default=None, metavar="FILE",
                       help="order samples by the federation's HMAC key (the order a federated fit uses; default: "
                            "the public default key, see docs/own-data.md)")
        g.add_argument("--order-of", default=None, metavar="MODEL",
                       help="order parties and samples as the federated fit saved in MODEL did (its federation "
                            "file's party order, whatever order the --table flags come in; its alignment session's "
                            "tokens, with --alignment-key, or --hmac-key for a fit aligned by HMAC): to compare an "
                            "in-process fit with a federated one")
        g.add_argument("--alignment-key", default=None, metavar="FILE",
                       help="the passive parties' alignment key, for --order-of")


def parse_tables(items: list[str]) -> dict[str, str]:
    """``PARTY=FILE`` items as ``{party: file}``; a malformed or repeated party, or a file named as neither CSV nor
    Parquet, is an error."""
    from partialvfl.data.tables import table_format

    out: dict[str, str] = {}
    for item in items:
        party, eq, path = item.partition("=")
        if not eq or not party.strip() or not path.strip():
            raise ValueError(f"--table takes PARTY=FILE, got {item!r}")
        if party.strip() in out:
            raise ValueError(f"--table names party {party.strip()!r} twice")
        if table_format(path.strip()) is None:
            raise ValueError(f"--table {item}: cannot tell the format from the file's name; name it .csv (or .csv.gz, "
                             "...) or .parquet (or .pq)")
        out[party.strip()] = path.strip()
    return out


def refuse_protocol_options(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """With ``--table`` the protocol options (but ``--seed``) do not apply: refuse any given a non-default value."""
    given = [f"--{dest.replace('_', '-')}" for dest in getattr(args, "protocol_options", ())
             if getattr(args, dest) != p.get_default(dest)]
    if given:
        raise ValueError(f"{', '.join(given)} belong to the benchmark protocol (--dataset); they do not apply to "
                         "--table")


def non_negative(kind: type[int] | type[float]) -> Any:
    """An argparse ``type`` for a number >= 0 (refused while parsing, before anything connects or loads)."""
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if value < 0:
            raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
        return value
    return parse


def emit(obj: Any, as_json: bool, text: str) -> None:
    """Print ``obj`` as JSON (``--json``) or ``text``."""
    if as_json:
        print(json.dumps(obj, indent=2, default=str))
    else:
        print(text)
