"""FedHSSL: declared parameters and presets (torch-free; the implementation is this package)."""

from __future__ import annotations

from typing import Any

from partialvfl.methods.params import Param, ParamSpace
from partialvfl.methods.registry import MethodSpec, register_spec
from partialvfl.methods.schedule import SCHEDULE_PARAMS

ENCODERS = ("auto", "mlp", "cnn", "resnet18")
OPTIMIZERS = ("adam", "sgd")

__all__ = ["FEDHSSL_PARAMS", "PAPER_TABLE9"]

#: The FALSE-VFL paper's Table 9 (FedHSSL): fine-tuning (optimizer, lr, batch, epochs, weight decay), pretraining
#: (optimizer, lr, batch, epochs, weight decay), latent dimension, per dataset.
PAPER_TABLE9: dict[str, dict[str, Any]] = {
    "isolet": {"ft": ("adam", 2e-3, 64, 300, 1e-4), "pt": ("sgd", 0.025, 512, 150, 3e-5), "latent": 128},
    "hapt": {"ft": ("adam", 5e-4, 64, 500, 1e-4), "pt": ("adam", 0.025, 512, 100, 1e-5), "latent": 128},
    "fashion-mnist": {"ft": ("adam", 1e-4, 128, 100, 1e-4), "pt": ("sgd", 0.02, 1024, 150, 3e-5), "latent": 196},
    "modelnet10": {"ft": ("adam", 5e-4, 128, 100, 1e-4), "pt": ("sgd", 0.025, 1024, 150, 3e-5), "latent": 256},
}
FEDHSSL_IMAGE = {"fashion-mnist", "modelnet10"}


def _fedhssl_fast(dataset: str) -> dict[str, Any]:
    return {"latent_dim": 32, "encoder_hidden": [64, 64], "pretrain_epochs": 8, "pretrain_batch_size": 256,
            "pretrain_lr": 0.05, "proj_dim": 32, "proj_hidden": 64, "pred_hidden": 16, "lr": 3e-3, "epochs": 30,
            "batch_size": 32}


def _fedhssl_paper(dataset: str) -> dict[str, Any]:
    t = PAPER_TABLE9[dataset if dataset in PAPER_TABLE9 else "hapt"]
    fo, flr, fbs, fep, fwd = t["ft"]
    po, plr, pbs, pep, pwd = t["pt"]
    return {
        "latent_dim": t["latent"], "encoder": "resnet18" if dataset in FEDHSSL_IMAGE else "mlp",
        "encoder_hidden": [256, 256], "optimizer": fo, "lr": flr, "batch_size": fbs, "epochs": fep,
        "weight_decay": fwd, "pretrain": True, "pretrain_optimizer": po, "pretrain_lr": plr,
        "pretrain_batch_size": pbs, "pretrain_epochs": pep, "pretrain_weight_decay": pwd,
    }


FEDHSSL_PARAMS = ParamSpace((
    Param("latent_dim", 64, "int", "width of each party's encoders' output", low=1, width=True),
    Param("encoder", "auto", "str", "party encoders: auto (mlp for tabular blocks, cnn for image pieces), mlp, cnn "
          "or resnet18", choices=ENCODERS),
    Param("encoder_hidden", [128, 128], "ints", "hidden widths of MLP encoders (the local model splits after the "
          "first)"),
    Param("resnet_width", 64, "int", "base width of resnet18 encoders", low=1),
    Param("pool", "mean", "str", "party representation: weighted mean or concatenation of the cross-party and "
          "local encoders", choices=("mean", "concat")),
    Param("pool_ratio", 0.5, "float", "weight of the cross-party encoder in the mean pool", low=0, high=1),
    Param("head_hidden", [], "ints", "hidden widths of the classifier at the active party ([] = linear)"),
    Param("pretrain", True, "bool", "hybrid self-supervised pretraining before fine-tuning (false: labelled data "
          "only)"),
    Param("pretrain_epochs", 20, "int", "pretraining epochs (cross-party SSL, local SSL, aggregation)", low=0,
          epochs=True),
    Param("local_epochs", 1, "int", "local SimSiam epochs per pretraining epoch", low=0),
    Param("pretrain_batch_size", 512, "int", "pretraining batch size", low=2),
    Param("pretrain_optimizer", "sgd", "str", "pretraining optimiser", choices=OPTIMIZERS),
    Param("pretrain_lr", 0.025, "float", "pretraining learning rate", low=0),
    Param("pretrain_weight_decay", 3e-5, "float", "pretraining weight decay", low=0),
    Param("pretrain_momentum", 0.9, "float", "pretraining SGD momentum", low=0, high=1),
    Param("cross_pairs", "active", "str", "cross-party SSL pairs: active (each party with the active party) or all",
          choices=("active", "all")),
    Param("local_weight", 1.0, "float", "weight of the local SimSiam loss", low=0),
    Param("guidance_weight", 0.5, "float", "weight of the cross-party guidance of local SSL", low=0),
    Param("aggregate", "top+head", "str", "what partial model aggregation averages: the local top encoders, or "
          "those with their SimSiam heads", choices=("top", "top+head")),
    Param("proj_dim", 128, "int", "SimSiam projection width", low=1, width=True),
    Param("proj_hidden", 128, "int", "SimSiam projector hidden width", low=1),
    Param("pred_hidden", 32, "int", "SimSiam predictor hidden width", low=1),
    Param("pretrain_corruption", 0.3, "float", "tabular augmentation: share of entries replaced from the party's "
          "own marginals", low=0, high=1, aliases=("corruption",)),
    Param("pretrain_noise", 0.05, "float", "augmentation: Gaussian noise scale", low=0, aliases=("noise",)),
    Param("optimizer", "adam", "str", "fine-tuning optimiser", choices=OPTIMIZERS),
    Param("lr", 1e-3, "float", "fine-tuning learning rate", low=0),
    Param("weight_decay", 1e-4, "float", "fine-tuning weight decay", low=0),
    Param("momentum", 0.9, "float", "fine-tuning SGD momentum", low=0, high=1),
    Param("epochs", 50, "int", "fine-tuning epochs", low=0, epochs=True),
    Param("batch_size", 64, "int", "fine-tuning batch size", low=1),
    Param("predict_batch_size", 4096, "int", "rows per prediction batch", low=1),
    *SCHEDULE_PARAMS,
), presets={"fast": _fedhssl_fast, "paper": _fedhssl_paper}, dataset_presets=("paper",), groups={
    # the arguments of make_optimizer for each stage, the SimSiam heads and the local SSL augmentation
    "optim": {"name": "optimizer", "lr": "lr", "weight_decay": "weight_decay", "momentum": "momentum"},
    "pretrain_optim": {"name": "pretrain_optimizer", "lr": "pretrain_lr", "weight_decay": "pretrain_weight_decay",
                       "momentum": "pretrain_momentum"},
    "simsiam": {"proj_dim": "proj_dim", "proj_hidden": "proj_hidden", "pred_hidden": "pred_hidden"},
    "augment": {"corruption": "pretrain_corruption", "noise": "pretrain_noise"},
})

register_spec(MethodSpec("fedhssl", "FedHSSL: cross-party and local SimSiam, aggregation of local top encoders, "
                         "fine-tuning on aligned labels", "partialvfl.methods.fedhssl.coordinator:FedHSSL",
                         FEDHSSL_PARAMS, paper_name="FedHSSL", report_order=40, aligned_only=True,
                         docs="docs/x-vfl.md"))
