"""The split-network methods (LASER-VFL, Vanilla VFL, PlugVFL, Local, Ensemble, Combinatorial): declared
parameters and presets (torch-free; the shared machinery and each method's module are this package).

``pretrain_*`` parameters are the optional SimSiam pretraining of the party encoders on all their rows (the
FALSE-VFL paper's protocol); unprefixed ones the supervised split learning; ``predict_*`` prediction.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from partialvfl.methods.params import Param, ParamSpace
from partialvfl.methods.registry import MethodSpec, register_spec
from partialvfl.methods.schedule import SCHEDULE_PARAMS

__all__ = ["LASER_CODE", "PAPER_LATENT", "PAPER_PRETRAIN", "PAPER_TABLES", "ROUNDS", "SPACES", "SPLIT_PARAMS",
           "split_space"]

#: The FALSE-VFL paper's Tables 6 (Vanilla VFL), 7 (LASER-VFL) and 8 (PlugVFL): fine-tuning optimiser Adam,
#: pretraining (SimSiam) optimiser SGD; weight decay 1e-4 (fine-tuning) and 3e-5 (pretraining) everywhere.
#: (lr, batch, epochs) per dataset; pretraining (lr, batch, epochs) is shared by the three methods.
PAPER_TABLES: dict[str, dict[str, tuple[float, int, int]]] = {
    "vanilla-vfl": {"isolet": (5e-4, 32, 500), "hapt": (5e-3, 64, 100), "fashion-mnist": (1e-4, 128, 150),
                    "modelnet10": (1e-4, 128, 100)},
    "laser-vfl": {"isolet": (5e-5, 64, 200), "hapt": (1e-3, 128, 100), "fashion-mnist": (1e-4, 128, 100),
                  "modelnet10": (5e-4, 128, 10)},
    "plug-vfl": {"isolet": (5e-5, 32, 100), "hapt": (5e-4, 64, 100), "fashion-mnist": (1e-4, 128, 150),
                 "modelnet10": (1e-4, 128, 50)},
}
PAPER_PRETRAIN: dict[str, tuple[float, int, int]] = {
    "isolet": (0.025, 512, 100), "hapt": (0.02, 512, 150), "fashion-mnist": (0.02, 1024, 100),
    "modelnet10": (0.025, 1024, 50),
}
PAPER_LATENT = {"isolet": 128, "hapt": 128, "fashion-mnist": 196, "modelnet10": 256}
PAPER_IMAGE = {"fashion-mnist", "modelnet10"}

#: LASER-VFL's released code (configs/task_config.yaml, spec/laser-vfl.md section 4.3) for the datasets we have:
#: (optimizer, lr, weight decay, momentum, epochs, batch, cosine schedule) by method family and dataset.  HAPT's
#: LASER values are those for training p_miss 0.0/0.1.
LASER_CODE: dict[str, dict[str, tuple[str, float, float, float, int, int, bool]]] = {
    "laser": {"hapt": ("sgd", 0.03, 1e-4, 0.8, 100, 128, False),
              "cifar10": ("sgd", 0.1, 0.008, 0.5, 100, 1024, True),
              "cifar100": ("sgd", 0.15, 0.007, 0.5, 150, 1024, True)},
    "decoupled": {"hapt": ("sgd", 0.05, 1e-4, 0.8, 100, 128, False),
                  "cifar10": ("sgd", 0.1, 0.01, 0.5, 100, 1024, True),
                  "cifar100": ("sgd", 0.15, 0.004, 0.5, 150, 1024, True)},
    "plug": {"hapt": ("sgd", 0.05, 1e-4, 0.8, 100, 128, False),
             "cifar10": ("sgd", 0.1, 0.008, 0.5, 100, 1024, True),
             "cifar100": ("sgd", 0.15, 0.004, 0.5, 150, 1024, True)},
}

ENCODERS = ("auto", "mlp", "cnn", "resnet18")
#: the training schedules of the ``rounds`` parameter (:mod:`partialvfl.methods.splitnn.rounds`)
ROUNDS = ("piggyback", "sequential", "stale")
OPTIMIZERS = ("adam", "sgd")

SPLIT_PARAMS = ParamSpace((
    Param("latent_dim", 64, "int", "width of each party's representation f_k(x_k)", low=1, width=True),
    Param("encoder", "auto", "str", "party encoders: auto (mlp for tabular blocks, cnn for image pieces), mlp, cnn "
          "or resnet18", choices=ENCODERS),
    Param("encoder_hidden", [128, 128], "ints", "hidden widths of MLP party encoders"),
    Param("resnet_width", 64, "int", "base width of resnet18 encoders", low=1),
    Param("head_hidden", [], "ints", "hidden widths of the fusion head(s) at the active party ([] = linear)"),
    Param("optimizer", "adam", "str", "optimiser of encoders and heads", choices=OPTIMIZERS),
    Param("lr", 1e-3, "float", "learning rate", low=0),
    Param("weight_decay", 1e-4, "float", "weight decay", low=0),
    Param("momentum", 0.9, "float", "SGD momentum", low=0, high=1),
    Param("epochs", 50, "int", "supervised epochs", low=0, epochs=True),
    Param("batch_size", 64, "int", "supervised batch size", low=1),
    Param("lr_schedule", "none", "str", "none or cosine (annealed to eta_min_ratio * lr)",
          choices=("none", "cosine")),
    Param("eta_min_ratio", 0.02, "float", "final learning rate of the cosine schedule, relative to lr", low=0,
          high=1),
    Param("pretrain", False, "bool", "SimSiam pretraining of each party's encoder on all its own rows first"),
    Param("pretrain_epochs", 50, "int", "SimSiam epochs", low=0, epochs=True),
    Param("pretrain_batch_size", 512, "int", "SimSiam batch size", low=2),
    Param("pretrain_lr", 0.02, "float", "SimSiam learning rate", low=0),
    Param("pretrain_weight_decay", 3e-5, "float", "SimSiam weight decay", low=0),
    Param("pretrain_momentum", 0.9, "float", "SimSiam SGD momentum", low=0, high=1),
    Param("pretrain_optimizer", "sgd", "str", "SimSiam optimiser", choices=OPTIMIZERS),
    Param("pretrain_corruption", 0.3, "float", "SimSiam tabular augmentation: share of entries replaced from the "
          "party's own marginals", low=0, high=1),
    Param("pretrain_noise", 0.05, "float", "SimSiam augmentation: Gaussian noise scale", low=0),
    Param("pretrain_kind", "simsiam", "str", "what pretrain runs: simsiam (each party alone on its own rows) or "
          "false-vfl (FALSE-VFL-I's stage 1, the generative model over every row, federated; each party then "
          "initialises its encoder from its own stage-1 encoder's mean half: d_h = latent_dim)",
          choices=("simsiam", "false-vfl")),
    Param("generative", None, "any", "pretrain_kind false-vfl: FALSE-VFL-I parameters of that stage 1 on top of its "
          "fast preset (e.g. {pretrain_lr = 3e-3, decoder_hidden = [128, 128]}); d_h, encoder, encoder_hidden, "
          "resnet_width and pretrain_epochs are this method's latent_dim, encoder, encoder_hidden, resnet_width and "
          "pretrain_epochs", optional=True),
    Param("predict_batch_size", 4096, "int", "rows per prediction batch", low=1),
    Param("rounds", "piggyback", "str", "round trips of training: piggyback (the next step's representations ride "
          "with this step's gradients: one per step, the weights of sequential to the bit), sequential "
          "(representations out, gradients back: two per step) or stale (FedBCD-style local updates: one per "
          "stale_steps steps, from representations up to stale_steps - 1 of the party's own updates old)",
          choices=ROUNDS),
    Param("stale_steps", 4, "int", "rounds = stale: training steps per round trip", low=1),
    *SCHEDULE_PARAMS,
), groups={
    # the arguments of make_optimizer, and the SimSiam pretraining each party runs (SimSiamConfig's fields)
    "optim": {"name": "optimizer", "lr": "lr", "weight_decay": "weight_decay", "momentum": "momentum"},
    "simsiam": {"epochs": "pretrain_epochs", "batch_size": "pretrain_batch_size", "lr": "pretrain_lr",
                "weight_decay": "pretrain_weight_decay", "momentum": "pretrain_momentum",
                "optimizer": "pretrain_optimizer", "corruption": "pretrain_corruption", "noise": "pretrain_noise"},
})


def _fast(dataset: str) -> dict[str, Any]:
    return {"latent_dim": 32, "encoder_hidden": [64], "lr": 3e-3, "epochs": 30, "batch_size": 64,
            "pretrain_epochs": 15, "pretrain_batch_size": 256, "pretrain_lr": 0.05}


def _paper(method: str, pretrains: bool) -> Callable[[str], dict[str, Any]]:
    def preset(ds: str) -> dict[str, Any]:
        table = PAPER_TABLES.get(method, PAPER_TABLES["vanilla-vfl"])
        key = ds if ds in table else "hapt"
        lr, bs, ep = table[key]
        plr, pbs, pep = PAPER_PRETRAIN[key]
        return {
            "optimizer": "adam", "lr": lr, "batch_size": bs, "epochs": ep, "weight_decay": 1e-4,
            "latent_dim": PAPER_LATENT[key], "encoder": "resnet18" if ds in PAPER_IMAGE else "auto",
            "encoder_hidden": [256, 256], "pretrain": pretrains, "pretrain_optimizer": "sgd", "pretrain_lr": plr,
            "pretrain_batch_size": pbs, "pretrain_epochs": pep, "pretrain_weight_decay": 3e-5,
        }

    return preset


def _laser_paper(family: str, extra: dict[str, Any]) -> Callable[[str], dict[str, Any]]:
    def preset(ds: str) -> dict[str, Any]:
        table = LASER_CODE[family]
        key = ds if ds in table else "hapt"
        opt, lr, wd, mom, ep, bs, cosine = table[key]
        out: dict[str, Any] = {
            "optimizer": opt, "lr": lr, "weight_decay": wd, "momentum": mom, "epochs": ep, "batch_size": bs,
            "lr_schedule": "cosine" if cosine else "none", "eta_min_ratio": 0.02, "pretrain": False,
            "head_hidden": [],
        }
        if key == "hapt":
            out.update(latent_dim=128, encoder="mlp", encoder_hidden=[128, 128])
        else:
            out.update(latent_dim=1024, encoder="resnet18", resnet_width=32 if key == "cifar10" else 64)
        out.update(extra)
        return out

    return preset


def split_space(method: str, *extra: Param, laser_family: str = "decoupled", paper_pretrains: bool = False,
                laser_paper: dict[str, Any] | None = None) -> ParamSpace:
    """The split-network parameters plus ``extra``, with the three presets of ``method``.

    ``laser_family`` picks LASER-VFL's code row (laser, decoupled, plug) for the ``laser-paper`` preset;
    ``paper_pretrains`` whether the FALSE-VFL paper pretrains this method with SimSiam (Appendix D.1).
    """
    return SPLIT_PARAMS.extend(*extra, presets={
        "fast": _fast, "paper": _paper(method, paper_pretrains),
        "laser-paper": _laser_paper(laser_family, dict(laser_paper or {})),
    }, dataset_presets=("paper", "laser-paper"))


_FUSION = Param("fusion", "concat", "str", "fusion of the parties' representations: concat (zeros for absent "
                "parties) or mean (over the present ones, as LASER-VFL's code)", choices=("concat", "mean"))
DEFAULT_MAX_PARTIES = 6

_SPECS = [
    ("laser-vfl", "LASER-VFL: mean-aggregated representations, task sampling, a predictor for every subset",
     "laser_vfl:LaserVFL",
     split_space("laser-vfl",
                 Param("heads", "single", "str", "one fusion head at the active party, or one per party "
                       "(LASER's original)", choices=("single", "per-party")),
                 Param("batching", "pattern", "str", "pattern (batches share one observed pattern, Algorithm 1) or "
                       "per-sample (mixed batches, per-sample task draws)", choices=("pattern", "per-sample")),
                 laser_family="laser", paper_pretrains=True)),
    ("vanilla-vfl", "Vanilla VFL: split network on fully aligned labelled samples; absent parties zero-imputed",
     "vanilla_vfl:VanillaVFL",
     split_space("vanilla-vfl", _FUSION,
                 Param("missing", "zero", "str", "at prediction, absent parties' representations are zeros, or the "
                       "sample gets a random class (LASER-VFL's variant)", choices=("zero", "random")),
                 paper_pretrains=True, laser_paper={"fusion": "mean", "missing": "random"})),
    ("plug-vfl", "PlugVFL: concatenation fusion, passive parties dropped in training",
     "plug_vfl:PlugVFL",
     split_space("plug-vfl",
                 Param("p_drop", 0.5, "float", "probability of dropping each passive party in a training step",
                       low=0, high=1),
                 Param("dropout_unit", "batch", "str", "one dropout draw per party per batch, or per sample",
                       choices=("batch", "sample")),
                 _FUSION, laser_family="plug", paper_pretrains=True, laser_paper={"p_drop": 0.0})),
    ("local", "Local: the active party alone", "local:Local", split_space("local")),
    ("ensemble", "Ensemble: majority vote of one model per party", "ensemble:Ensemble", split_space("ensemble")),
    ("combinatorial", "Combinatorial: one predictor per subset of parties (2^K - 1)",
     "combinatorial:Combinatorial",
     split_space("combinatorial", _FUSION,
                 Param("max_parties", DEFAULT_MAX_PARTIES, "int", "refuse more parties than this (2^K - 1 "
                       "predictors)", low=1),
                 laser_paper={"fusion": "mean"})),
]
#: what reports and schedules need to know of each (every one runs with differential privacy: private.py)
_FACTS: dict[str, dict[str, Any]] = {
    "vanilla-vfl": {"paper_name": "Vanilla VFL", "report_order": 10, "aligned_only": True},
    "laser-vfl": {"paper_name": "LASER-VFL", "report_order": 20},
    "plug-vfl": {"paper_name": "PlugVFL", "report_order": 30},
    "local": {"title": "Local", "report_order": 60},
    "ensemble": {"title": "Ensemble", "report_order": 70},
    "combinatorial": {"title": "Combinatorial", "report_order": 80},
}
#: each split-network method's declared parameters, by registry name
SPACES: dict[str, ParamSpace] = {}
for _name, _summary, _impl, _space in _SPECS:
    SPACES[_name] = _space
    register_spec(MethodSpec(_name, _summary, f"partialvfl.methods.splitnn.{_impl}", _space, private=True,
                             docs="docs/baselines.md", **_FACTS[_name]))
