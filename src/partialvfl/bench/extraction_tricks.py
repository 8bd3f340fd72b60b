"""Coordinator tricks against a party's policy (issue 23), run against a real party process.

* ``width``: many models in one split-network setup, each within the per-model width cap (16 models of 2d: 32d
  values per row), their embeddings side by side in a known-rows regression;
* ``gradient-scale``: the learning-rate floor with gradients scaled up (lr 1e-6, each row's gradient 1e6 long): how
  far one step moves the party's embeddings;
* ``weight-decay``: a huge weight decay (1e6 at lr 1e-6 zeroes every weight in one step): the embeddings' spread
  after one step with zero gradients, relative to before;
* ``rewind``: save the party's state, then load it and train from it again and again: how many times it lets the
  coordinator do so.

Each reports what the party accepted and refused; under the default policy the refused setups are replaced by the
strongest one it accepts.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from partialvfl.bench.extraction import MODEL, AttackOutcome, Extractor, describe_config, relative_rmse, ridge
from partialvfl.federation.grpc.transport import PartyError
from partialvfl.utils.seeding import numpy_rng

__all__ = ["ATTACKS", "attack_gradient_scale", "attack_rewind", "attack_weight_decay", "attack_width"]


def _config(d: int, *, models: int = 1, latent: int | None = None, lr: float = 1e-3, weight_decay: float = 0.0,
            hidden: int = 64) -> dict[str, Any]:
    return {"feature_dim": d, "feature_shape": [d], "models": [f"m{i}" for i in range(models)] if models > 1
            else [MODEL], "latent_dim": int(latent or 2 * d), "encoder": "mlp", "encoder_hidden": [hidden],
            "resnet_width": 64, "optimizer": {"name": "sgd", "lr": float(lr), "weight_decay": float(weight_decay),
                                              "momentum": 0.0}}


def _embed_all(ex: Extractor, cfg: dict[str, Any], train: bool = False) -> dict[str, np.ndarray]:
    reply = ex._call("embed", {f"rows:{m}": torch.arange(ex.n) for m in cfg["models"]}, data="probe", train=train)
    return {m: reply.tensors[f"emb:{m}"].detach().double().numpy() for m in cfg["models"]}


def _step(ex: Extractor, cfg: dict[str, Any], grads: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """One training step: a training forward of every row, the coordinator's gradients; the embeddings before."""
    before = _embed_all(ex, cfg, train=True)
    ex.fed.transport.new_round()
    ex.fed.call(ex.party, "grad_embedding", {f"grad:{m}": g for m, g in grads.items()})
    return before


def attack_width(ex: Extractor, x: np.ndarray, *, models: int = 16, width: int = 2, n_known: int = 25,
                 seed: int = 1234, **_: Any) -> AttackOutcome:
    """``models`` models of ``width`` x d outputs each (fewer if refused), regressed side by side on known rows."""
    candidates = [_config(ex.d, models=m, latent=width * ex.d) for m in sorted({models, 8, 4, 2, 1}, reverse=True)
                  if m <= models]
    cfg, refused = ex.setup_first(candidates, seed)
    known = np.sort(numpy_rng(seed, "known rows").choice(len(x), size=n_known, replace=False))
    features = np.concatenate(list(_embed_all(ex, cfg).values()), axis=1)
    unknown = np.setdiff1d(np.arange(len(x)), known)
    accepted = f"{len(cfg['models'])} x ({describe_config(cfg)})"
    return AttackOutcome(f"{models} models of {width}d side by side, {n_known} known rows", refused, accepted,
                         relative_rmse(x, ridge(features, x, known), unknown))


def attack_gradient_scale(ex: Extractor, x: np.ndarray, *, scale: float = 1e6, lr: float = 1e-6, seed: int = 1234,
                          **_: Any) -> AttackOutcome:
    """One SGD step at ``lr`` with every row's gradient ``scale`` long: the relative change of the embeddings."""
    cfg, refused = ex.setup_first([_config(ex.d, lr=lr)], seed)
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(ex.n, cfg["latent_dim"], generator=gen)
    before = _step(ex, cfg, {MODEL: g / g.norm(dim=1, keepdim=True) * scale})[MODEL]
    after = _embed_all(ex, cfg)[MODEL]
    moved = float(np.linalg.norm(after - before) / np.linalg.norm(before))
    return AttackOutcome(f"gradients {scale:g} long per row at lr {lr:g}", refused, describe_config(cfg),
                         np.array([moved]), metric="embedding change / embedding norm")


def attack_weight_decay(ex: Extractor, x: np.ndarray, *, decay: float = 1e6, lr: float = 1e-6, seed: int = 1234,
                        **_: Any) -> AttackOutcome:
    """One SGD step with zero gradients and weight decay ``decay`` (refused: the largest the party accepts): the
    embeddings' spread after it, relative to before (0: every weight zeroed)."""
    candidates = [_config(ex.d, lr=lr, weight_decay=v) for v in (decay, 1e-2, 0.0)]
    cfg, refused = ex.setup_first(candidates, seed)
    before = _step(ex, cfg, {MODEL: torch.zeros(ex.n, cfg["latent_dim"])})[MODEL]
    after = _embed_all(ex, cfg)[MODEL]
    spread = float(after.std(axis=0).mean() / before.std(axis=0).mean())
    accepted = f"{describe_config(cfg)}, weight decay {cfg['optimizer']['weight_decay']:g}"
    return AttackOutcome(f"weight decay {decay:g} at lr {lr:g}", refused, accepted, np.array([spread]),
                         metric="embedding spread after / before")


def attack_rewind(ex: Extractor, x: np.ndarray, *, cycles: int = 10, seed: int = 1234, **_: Any) -> AttackOutcome:
    """Save the party's state, train a step, then ``cycles`` times: load the state and train from it again."""
    cfg, refused = ex.setup_first([_config(ex.d)], seed)
    ex._call("save", dir="attack-rewind")
    zeros = {MODEL: torch.zeros(ex.n, cfg["latent_dim"])}
    _step(ex, cfg, zeros)
    done = 0
    for _ in range(cycles):
        ex._call("load", dir="attack-rewind")
        try:
            _step(ex, cfg, zeros)
        except PartyError as e:
            refused.append(e.details.split(": ", 1)[-1])
            break
        done += 1
    return AttackOutcome(f"{cycles} rewinds to one saved state, training from it each time", refused,
                         describe_config(cfg), np.array([float(done)]), metric="rewinds allowed")


ATTACKS = {"width": attack_width, "gradient-scale": attack_gradient_scale, "weight-decay": attack_weight_decay,
           "rewind": attack_rewind}
