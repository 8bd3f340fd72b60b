"""FALSE-VFL's ``decode`` as an oracle on a party's rows (issue 23), run against a real party process.

A party's ``decode`` answers ``log p(x | h)`` for each of its rows ``x`` at latents ``h``; the decoder's variance is
one per feature, shared by all rows, so for two latents ``log p(x|h_s) - log p(x|h_0) = x . a_s + c_s`` is linear in
the raw row whatever the (secret, nonlinear) decoder.

* ``decode`` (``wire`` lean or samples): the issue's attack.  The coordinator sets up a FALSE-VFL program (it need
  not train it), sends the same ``latents`` latents for every row (lean: mean 0, scale 1, every row at position 0 of
  a batch of 1; samples: the latents themselves) and regresses the features on the log-likelihoods over
  ``n_known`` rows it knows: exact.  A party that refuses such a setup (``allow_likelihood_release``) is attacked
  through the ``bound`` wire instead, below.
* ``decode-bound``: the strongest use of the bound wire we found.  Every row's latents are drawn around one centre
  at the party's floor scale (the noise is a hash of what the coordinator sent, which it learns afterwards), over
  ``calls`` calls; per row the log-likelihoods are regressed on the latent offsets (a local linearisation of the
  decoder: ``log p(x|c + d) ~ const + d . J^T S^-1 (x - mu(c))``) and the features on those slopes over the known
  rows.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from partialvfl.bench.extraction import AttackOutcome, Extractor
from partialvfl.federation.grpc.transport import PartyError
from partialvfl.methods.false_vfl.formulas import bound_noise
from partialvfl.privacy.reconstruction import ALPHAS, relative_rmse, ridge
from partialvfl.utils.seeding import numpy_rng

__all__ = ["ATTACKS", "attack_decode", "attack_decode_bound", "false_vfl_config"]

PROGRAM = "false-vfl/party"
#: ridge penalties down to none: a relation that is exactly linear is fitted exactly
EXACT_ALPHAS = (1e-9, 1e-6, *ALPHAS)


def false_vfl_config(d: int, wire: str, *, d_h: int = 16, hidden: int = 64, floor: float = 0.0) -> dict[str, Any]:
    """A FALSE-VFL party program for a party of ``d`` features (within the default policy's widths)."""
    cfg = {"feature_dim": d, "feature_shape": [d], "d_h": d_h, "encoder": "mlp", "decoder": "mlp",
           "encoder_hidden": [hidden], "decoder_hidden": [hidden], "mask_hidden": [8], "resnet_width": 64,
           "pretrain_lr": 1e-3, "pretrain_weight_decay": 0.0, "encoder_logvar_range": [-8.0, 6.0],
           "decoder_logvar_range": [-5.0, 3.0], "variant": 1, "wire": wire, "wire_dtype": "float32"}
    if wire == "bound":
        cfg["latent_scale_floor"] = float(floor)
    return cfg


def _known(n: int, n_known: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    known = np.sort(numpy_rng(seed, "known rows").choice(n, size=n_known, replace=False))
    return known, np.setdiff1d(np.arange(n), known)


def _recover(features: np.ndarray, x: np.ndarray, n_known: int, seed: int) -> np.ndarray:
    """Per-feature error of the rows from ``features``: with ``n_known`` known rows, ridge regression scored on the
    others; with none, the best affine map over every row (what ``features`` determine up to an affine map: a bound
    on any linear decoding, the issue's "X up to an affine map")."""
    if n_known:
        known, unknown = _known(len(x), n_known, seed)
        return relative_rmse(x, ridge(features, x, known, EXACT_ALPHAS), unknown)
    design = np.c_[features, np.ones(len(features))]
    return relative_rmse(x, design @ np.linalg.lstsq(design, x, rcond=None)[0])


def _rows_known(n_known: int) -> str:
    return f"{n_known} known rows" if n_known else "no known row (best affine map)"


def _decode(ex: Extractor, tensors: dict[str, torch.Tensor], **meta: Any) -> np.ndarray:
    """``encode`` every row, then ``decode`` them: the log-likelihoods ``(S, n)``."""
    ex._call("encode", {"rows": torch.arange(ex.n)}, data="probe")
    ex.fed.transport.new_round()
    reply = ex.fed.call(ex.party, "decode", tensors, data="probe", **meta)
    return reply.tensors["loglik"].double().numpy()


def attack_decode(ex: Extractor, x: np.ndarray, *, wire: str = "lean", n_known: int = 25, latents: int = 64,
                  seed: int = 1234, **opts: Any) -> AttackOutcome:
    """Reconstruct a party's rows from FALSE-VFL's ``decode`` replies to the same latents for every row.

    Falls back to :func:`attack_decode_bound` when the party refuses the set-up.
    """
    name = f"decode, {wire} wire: the same {latents} latents for every row, {_rows_known(n_known)}"
    try:
        ex._call("setup", program=PROGRAM, config=false_vfl_config(ex.d, wire), seed=seed)
    except PartyError as e:
        bound = attack_decode_bound(ex, x, n_known=n_known, seed=seed, **opts)
        return AttackOutcome(name, [e.details.split(": ", 1)[-1], *bound.refusals], bound.accepted, bound.rmse_std)
    d_h, n = 16, ex.n
    if wire == "samples":
        h = torch.randn(latents, 1, d_h, generator=torch.Generator().manual_seed(seed)).expand(latents, n, d_h)
        ll = _decode(ex, {"h": h.contiguous()})
    else:
        ll = _decode(ex, {"mean": torch.zeros(n, d_h), "scale": torch.ones(n, d_h),
                          "pos": torch.zeros(n, dtype=torch.int64)}, noise_seed=seed, batch=1, samples=latents)
    differences = (ll[1:] - ll[0]).T  # x . a_s + c_s: linear in the row
    return AttackOutcome(name, [], f"{wire} wire, {latents} latents, one call",
                         _recover(differences, x, n_known, seed))


def attack_decode_bound(ex: Extractor, x: np.ndarray, *, n_known: int = 25, calls: int = 20, samples: int = 16,
                        centre: float = 0.0, floor: float | None = None, seed: int = 1234,
                        **_: Any) -> AttackOutcome:
    """The bound wire at ``floor`` (default: the party's own floor, as its ``hello`` says; at least 0.001): see the
    module docstring."""
    floor = floor if floor is not None else max(float(ex.announced().get("min_latent_scale") or 0.0), 1e-3)
    ex._call("setup", program=PROGRAM, config=false_vfl_config(ex.d, "bound", floor=floor), seed=seed)
    d_h, n = 16, ex.n
    mean, scale = torch.full((n, d_h), float(centre)), torch.full((n, d_h), floor)
    ys, offsets = [], []
    for c in range(calls):
        noise_seed = seed * 1000 + c
        ys.append(_decode(ex, {"mean": mean, "scale": scale, "pos": torch.arange(n)}, noise_seed=noise_seed,
                          batch=n, samples=samples))
        offsets.append(floor * bound_noise(noise_seed, torch.arange(n), mean, scale, samples).double().numpy())
    y, dl = np.concatenate(ys), np.concatenate(offsets)  # (S * calls, n), (S * calls, n, d_h)
    y, dl = y - y.mean(0), dl - dl.mean(0)
    slopes = np.stack([np.linalg.lstsq(dl[:, i], y[:, i], rcond=None)[0] for i in range(n)])
    accepted = f"bound wire at the floor scale {floor:g}, centre {centre:g}, {calls} calls of {samples} latents"
    return AttackOutcome(f"decode, bound wire (latents around centre {centre:g}), {_rows_known(n_known)}", [],
                         accepted, _recover(slopes, x, n_known, seed))


ATTACKS = {"decode": attack_decode, "decode-bound": attack_decode_bound}
