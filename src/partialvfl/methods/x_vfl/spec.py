"""X-VFL: declared parameters and presets (torch-free; the implementation is this package)."""

from __future__ import annotations

from typing import Any

from partialvfl.methods.params import Param, ParamSpace
from partialvfl.methods.registry import MethodSpec, register_spec
from partialvfl.methods.schedule import SCHEDULE_PARAMS

ENCODERS = ("auto", "mlp", "cnn", "resnet18")
OPTIMIZERS = ("adam", "sgd")

__all__ = ["XVFL_PARAMS", "X_VFL_IMAGE"]

#: Datasets the paper preset treats as images (ResNet bottom models, 2048-dim embeddings, six-layer top model).
X_VFL_IMAGE = {"fashion-mnist", "modelnet10", "cifar10", "cifar100", "tinyimagenet", "utkface"}


def _xvfl_fast(dataset: str) -> dict[str, Any]:
    return {"latent_dim": 32, "encoder_hidden": [64], "xcom_hidden": [64], "top_hidden": [32], "lr": 3e-3,
            "epochs": 30, "batch_size": 64}


def _xvfl_paper(dataset: str) -> dict[str, Any]:
    # Appendix B: tabular: three-layer FCNN bottom and top models, 512-dim embeddings; images: ResNet bottom models,
    # 2048-dim embeddings, six-layer FCNN top model; batch 50 (2 parties) / 100 (4 parties); lambda1 = lambda2 =
    # 0.01 (the values fixed for k = 4, Appendix D.2).  Optimiser, learning rate and epochs are not given: SGD with
    # momentum 0.9, lr 0.01, 100 epochs.
    image = dataset in X_VFL_IMAGE
    return {
        "latent_dim": 2048 if image else 512, "encoder": "resnet18" if image else "mlp",
        "encoder_hidden": [512, 512], "xcom_hidden": [512, 512], "top_hidden": [512] * 5 if image else [512, 512],
        "lambda1": 0.01, "lambda2": 0.01, "optimizer": "sgd", "lr": 0.01, "momentum": 0.9, "weight_decay": 0.0,
        "epochs": 100, "batch_size": None,
    }


XVFL_PARAMS = ParamSpace((
    Param("latent_dim", 64, "int", "width of each party's embedding E_k = f_k(x_k)", low=1, width=True,
          aliases=("embed_dim",)),
    Param("encoder", "auto", "str", "bottom models f_k: auto (mlp for tabular blocks, cnn for image pieces), mlp, "
          "cnn or resnet18", choices=ENCODERS),
    Param("encoder_hidden", [128], "ints", "hidden widths of MLP bottom models"),
    Param("resnet_width", 64, "int", "base width of resnet18 bottom models", low=1),
    Param("xcom", "auto", "str", "completers XCom_k: auto (mlp for tabular blocks, deconv for image pieces), mlp "
          "or deconv", choices=("auto", "mlp", "deconv")),
    Param("xcom_hidden", [128], "ints", "hidden widths of MLP completers"),
    Param("top_hidden", [64], "ints", "hidden widths of the top model h"),
    Param("lambda1", 0.01, "float", "weight of DS-Align 1 (completed vs own embedding, Eq. 30)", low=0),
    Param("lambda2", 0.01, "float", "weight of DS-Align 2 (single vs joint decision, Eq. 31)", low=0),
    Param("ds_align_space", "probs", "str", "DS-Align compares softmax probabilities or logits",
          choices=("probs", "logits")),
    Param("ds_align_detach", False, "bool", "stop the DS-Align gradient on the target side"),
    Param("xcom_input_grad", True, "bool", "the loss gradient reaches the parties whose embeddings fed an XCom "
          "input (the exact gradient)"),
    Param("use_unaligned", True, "bool", "train on non-aligned labelled samples too (not only fully aligned)"),
    Param("optimizer", "adam", "str", "optimiser of every holder", choices=OPTIMIZERS),
    Param("lr", 1e-3, "float", "learning rate", low=0),
    Param("weight_decay", 0.0, "float", "weight decay", low=0),
    Param("momentum", 0.9, "float", "SGD momentum", low=0, high=1),
    Param("epochs", 40, "int", "training epochs", low=0, epochs=True),
    Param("batch_size", 64, "int", "batch size (null: the paper's 50 with two parties, 100 with more)", low=1,
          optional=True),
    Param("estimator", "sgd", "str", "sgd (a step per mini-batch) or page (the PAGE-type estimator, Eq. 10)",
          choices=("sgd", "page")),
    Param("page_prob", None, "float", "PAGE: probability of a fresh batch (null: b'/(b + b'))", low=1e-9, high=1,
          optional=True),
    Param("page_small_batch", None, "int", "PAGE: size b' of the correction batches (null: floor(sqrt(b)))", low=1,
          optional=True),
    Param("inference", "complete", "str", "collaborative prediction completes missing blocks with XCom, or uses "
          "the available parties only", choices=("complete", "available")),
    Param("local_completion", "self", "str", "a party predicting alone completes features missing inside its "
          "block from its own embedding, or not", choices=("self", "none")),
    Param("predict_batch_size", 4096, "int", "rows per prediction batch", low=1),
    *SCHEDULE_PARAMS,
), presets={"fast": _xvfl_fast, "paper": _xvfl_paper}, dataset_presets=("paper",), groups={
    # the arguments of make_optimizer (every holder's optimiser)
    "optim": {"name": "optimizer", "lr": "lr", "weight_decay": "weight_decay", "momentum": "momentum"},
})

register_spec(MethodSpec("x-vfl", "X-VFL: cross completion of missing blocks, decision-subspace alignment, "
                         "locally independent inference", "partialvfl.methods.x_vfl.coordinator:XVFL", XVFL_PARAMS,
                         title="X-VFL", report_order=50, unset_batch_size=100, docs="docs/x-vfl.md"))
