"""FALSE-VFL I and II: declared parameters and presets (torch-free; the implementation is this package).

Naming follows one rule across methods: ``pretrain_*`` is the unsupervised stage (FALSE-VFL's stage 1, the
marginal likelihood on all samples), unprefixed names the supervised stage (stage 2, the label model), ``predict_*``
prediction.  The importance samples are ``importance_samples`` (kappa, both training stages) and
``predict_importance_samples`` (L).
"""

from __future__ import annotations

from typing import Any

from partialvfl.methods.params import Param, ParamSpace
from partialvfl.methods.registry import MethodSpec, register_spec
from partialvfl.methods.schedule import SCHEDULE_PARAMS

__all__ = ["ENCODERS", "DECODERS", "ESTIMATORS", "FUSION_RULES", "PAPER_ROWS", "PARAMS", "WIRES", "WIRE_DTYPES",
           "paper_row"]

FUSION_RULES = ("mean-precision", "poe")
WIRES = ("lean", "samples", "bound")
WIRE_DTYPES = ("float32", "bfloat16")
ENCODERS = ("auto", "mlp", "cnn", "resnet18")
DECODERS = ("auto", "mlp", "deconv")
#: prediction estimators: adaptive multiple importance sampling (:mod:`.adaptive`) and the paper's SNIS
ESTIMATORS = ("adaptive", "paper")

#: Table 10 of the paper (pretraining = stage 1, training = stage 2); kappa = 10, L = 50 everywhere.
PAPER_ROWS: dict[str, dict[str, Any]] = {
    "isolet": dict(lr=2e-4, pretrain_lr=5e-4, batch_size=128, pretrain_batch_size=512, epochs=300,
                   pretrain_epochs=300, d_h=128, d_z=64),
    "hapt": dict(lr=2e-4, pretrain_lr=2e-3, batch_size=128, pretrain_batch_size=512, epochs=300,
                 pretrain_epochs=500, d_h=128, d_z=64),
    "fashion-mnist": dict(lr=2e-4, pretrain_lr=5e-5, batch_size=128, pretrain_batch_size=1024, epochs=200,
                          pretrain_epochs=150, d_h=196, d_z=32),
    "modelnet10": dict(lr=2e-4, pretrain_lr=1e-4, batch_size=128, pretrain_batch_size=1024, epochs=200,
                       pretrain_epochs=300, d_h=256, d_z=64),
}
#: Our datasets without a Table 10 row use the closest one: image sources the FashionMNIST row, tabular ones the
#: Isolet row (8 parties, 500 labels, the smaller of the two tabular rows).
PAPER_ROW_OF = {"mnist-5k": "fashion-mnist"}


def paper_row(dataset: str | None) -> str:
    """The Table 10 row the ``paper`` preset uses for ``dataset`` (a source name, possibly ``name:train``)."""
    key = (dataset or "").split(":")[0].strip().lower()
    key = PAPER_ROW_OF.get(key, key)
    return key if key in PAPER_ROWS else "isolet"


def _fast(dataset: str) -> dict[str, Any]:
    return {"d_h": 16, "d_z": 8, "pretrain_epochs": 80, "epochs": 40, "pretrain_lr": 2e-3, "lr": 2e-3,
            "pretrain_batch_size": 128, "batch_size": 64, "importance_samples": 10,
            "predict_importance_samples": 50}


def _paper(dataset: str) -> dict[str, Any]:
    row = dict(PAPER_ROWS[paper_row(dataset)])
    width = 256  # the paper gives no MLP widths; 256 throughout (docs/false-vfl.md)
    row.update(encoder_hidden=[width, width], decoder_hidden=[width, width], global_hidden=[width, width],
               discriminator_hidden=[width], mask_hidden=[width, width], pretrain_weight_decay=1e-4,
               weight_decay=1e-4, importance_samples=10, predict_importance_samples=50)
    return row


PARAMS = ParamSpace(
    (
        Param("d_h", 32, "int", "width of the party-level latent h (each party's posterior q_k(h|x^k))", low=1,
              width=True),
        Param("d_z", 16, "int", "width of the global latent z", low=1),
        Param("encoder", "auto", "str", "party encoders gamma_c^k: auto (mlp for tabular blocks, cnn for image "
              "pieces), mlp, cnn or resnet18", choices=ENCODERS, aliases=("encoder_arch",)),
        Param("decoder", "auto", "str", "party decoders theta_c^k: auto (mlp for tabular blocks, deconv for image "
              "pieces), mlp or deconv (transposed CNN)", choices=DECODERS, aliases=("decoder_arch",)),
        Param("encoder_hidden", [128, 128], "ints", "hidden widths of the party encoders (MLP)"),
        Param("decoder_hidden", [128, 128], "ints", "hidden widths of the party decoders (MLP)"),
        Param("global_hidden", [128, 128], "ints", "hidden widths of the global encoder and decoder (Table 5)"),
        Param("discriminator_hidden", [128], "ints", "hidden widths of the label model p(y|h) (Table 5)"),
        Param("mask_hidden", [64, 64], "ints", "hidden widths of the missing-indicator networks psi_k (II only)"),
        Param("resnet_width", 64, "int", "base width of resnet18 encoders", low=1),
        Param("pretrain_epochs", 30, "int", "stage-1 epochs (marginal likelihood on every sample)", low=0,
              aliases=("epochs_pretrain",), epochs=True),
        Param("epochs", 30, "int", "stage-2 epochs (label model on labelled samples)", low=0,
              aliases=("epochs_train",), epochs=True),
        Param("pretrain_lr", 1e-3, "float", "stage-1 learning rate (Adam)", low=0, aliases=("lr_pretrain",)),
        Param("lr", 1e-3, "float", "stage-2 learning rate (Adam)", low=0, aliases=("lr_train",)),
        Param("pretrain_batch_size", 128, "int", "stage-1 batch size", low=1, aliases=("batch_pretrain",)),
        Param("batch_size", 64, "int", "stage-2 batch size", low=1, aliases=("batch_train",)),
        Param("pretrain_weight_decay", 1e-4, "float", "stage-1 weight decay", low=0,
              aliases=("weight_decay_pretrain",)),
        Param("weight_decay", 1e-4, "float", "stage-2 weight decay", low=0, aliases=("weight_decay_train",)),
        Param("importance_samples", 10, "int", "importance samples per row in training, both stages (kappa)",
              low=1, aliases=("kappa",)),
        Param("predict_importance_samples", 50, "int", "importance samples per row at prediction (L)", low=1,
              aliases=("n_predict_samples",)),
        Param("predict_batch_size", 256, "int", "rows per prediction batch", low=1, aliases=("predict_batch",)),
        Param("predict_estimator", "adaptive", "str", "prediction estimator of p(y|x_obs): adaptive (adaptive multiple "
              "importance sampling: predict_rounds rounds of L samples per row, each round's proposal fitted to the "
              "row's weighted samples so far) or paper (self-normalised importance sampling with L samples from "
              "q(h|x_obs), the paper's)", choices=ESTIMATORS),
        Param("predict_rounds", 6, "int", "adaptive estimator: rounds of predict_importance_samples samples per row "
              "(1 is the paper's estimator)", low=1),
        Param("predict_low_ess", 10.0, "float", "a prediction whose importance weights' effective sample size is "
              "below this is counted and reported as resting on few samples", low=0),
        Param("fusion", "mean-precision", "str", "fusion of the parties' posteriors over h: mean-precision "
              "(eq. 1) or poe (product of experts)", choices=FUSION_RULES),
        Param("encoder_logvar_range", [-8.0, 6.0], "range", "clamp of every latent log-variance (h and z)"),
        Param("decoder_logvar_range", [-5.0, 3.0], "range",
              "clamp of the decoders' learned per-feature log-variances"),
        Param("wire", "auto", "str", "wire protocol: lean (each party gets the fused posterior's mean and scale of "
              "its rows and draws the shared noise itself; returns gradients w.r.t. mean and scale), samples (the "
              "kappa latent samples and their gradients cross), bound (as lean, but each row's noise is a hash of "
              "the exact mean and scale sent for it and the scale has a floor: the coordinator cannot choose the "
              "latents a party evaluates its likelihood at); auto: lean where every party releases likelihoods at "
              "the coordinator's latents ([policy] allow_likelihood_release, the simulation's research policy), "
              "else bound (a deployed party's default)", choices=("auto", *WIRES)),
        Param("latent_scale_floor", 0.0, "float", "bound wire: the smallest scale of the fused posterior q(h|x_obs) "
              "(smaller scales are raised to it, in training and prediction); raised to the largest floor the "
              "parties ask for ([policy] min_latent_scale)", low=0),
        Param("wire_dtype", "float32", "str", "dtype of the d_h-wide tensors on the wire (posterior parameters, "
              "latents and their gradients); bfloat16 halves their bytes, both sides use the rounded values",
              choices=WIRE_DTYPES),
        *SCHEDULE_PARAMS,
    ),
    presets={"fast": _fast, "paper": _paper},
    dataset_presets=("paper",),
)

register_spec(MethodSpec("false-vfl-1", "FALSE-VFL I (MAR): deep latent variable model, two-stage training, "
                         "prediction from any subset of parties",
                         "partialvfl.methods.false_vfl.coordinator:FalseVFL1", PARAMS, paper_name="FALSE-VFL-I",
                         report_order=90, private=True, proposed=True, docs="docs/false-vfl.md"))
register_spec(MethodSpec("false-vfl-2", "FALSE-VFL II (MNAR): FALSE-VFL I plus per-party missing-indicator "
                         "networks", "partialvfl.methods.false_vfl.coordinator:FalseVFL2", PARAMS,
                         paper_name="FALSE-VFL-II", report_order=91, proposed=True, docs="docs/false-vfl.md"))
