"""FALSE-VFL-I's party program at a party that keeps a differential-privacy budget.

What it releases per row (each reply's slices of one row form one Gaussian mechanism, see
:func:`~partialvfl.federation.dp.gaussian.private_reply`): its posterior parameters ``mu``/``logvar`` (``encode``,
and the next
batch's riding with ``decode``/``update``), the log-likelihoods ``loglik`` of the latents it was sent (``decode``) and
their gradients with respect to those latents (``decode_grad``).  The program clips the first two inside its graph
(as the release will) so that its gradients are those of what it released.  Its update (``update``) is DP-SGD: each
held row's gradient of the encoder, decoder and decoder variance, from the posterior gradients and the
log-likelihood gradients the coordinator sent for that row, is clipped and summed with Gaussian noise
(:meth:`~partialvfl.federation.dp.gaussian.PartyPrivacy.private_sum`).

Only variant I (II's missing-indicator terms mix the rows a party lacks into its update) and the float32 wire.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.func import functional_call

from partialvfl.federation.dp.gaussian import clip_together
from partialvfl.methods.false_vfl.formulas import split_gaussian
from partialvfl.nn.per_sample import flat_per_row, per_row_gradients
from partialvfl.nn.stats import gaussian_log_prob

__all__ = ["clip_loglik", "clip_posterior", "private_refusal", "private_update"]


def private_refusal(config: Any) -> str | None:
    """Why a FALSE-VFL config (a :class:`~partialvfl.methods.false_vfl.party.FalseVFLSetup`) cannot run under a
    budget (``None``: it can)."""
    if config.variant != 1:
        return ("FALSE-VFL-II cannot be trained under it (its missing-indicator terms mix the rows the party lacks "
                "into its update): use false-vfl-1")
    if config.wire_dtype != "float32":
        return "only the float32 wire is supported under it (wire_dtype=float32)"
    if config.encoder == "resnet18":
        return "a resnet18 encoder (batch normalisation mixes the rows of a batch) cannot be trained under it"
    return None


def clip_posterior(privacy: Any, mu: torch.Tensor, logvar: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``mu``, ``logvar`` ``(B, d_h)`` clipped per row, jointly, as the party releases them."""
    mu, logvar = clip_together([(mu, privacy.clip_for("mu")), (logvar, privacy.clip_for("logvar"))])
    return mu, logvar


def clip_loglik(privacy: Any, loglik: torch.Tensor) -> torch.Tensor:
    """``loglik`` ``(S, B)`` with every row's S values clipped as the party releases them."""
    return clip_together([(loglik, privacy.clip_for("loglik"))], axis=1)[0]


def _row_objective(program: Any) -> Any:
    """``fn(params, x, h, g_loglik, g_mu, g_logvar)``: one row's part of the party's backward pass."""
    net, privacy = program.net, program.runtime.privacy
    lo, hi = program.decoder_logvar_range

    def fn(params: dict[str, torch.Tensor], x: torch.Tensor, h: torch.Tensor, g_ll: torch.Tensor,
           g_mu: torch.Tensor, g_lv: torch.Tensor) -> torch.Tensor:
        enc = {k.removeprefix("encoder."): v for k, v in params.items() if k.startswith("encoder.")}
        dec = {k.removeprefix("decoder."): v for k, v in params.items() if k.startswith("decoder.")}
        mu, logvar = split_gaussian(functional_call(net.encoder, enc, (x.unsqueeze(0),)), program.logvar_range)
        mu, logvar = clip_posterior(privacy, mu, logvar)
        mean = functional_call(net.decoder, dec, (h,))  # (S, d)
        ll = gaussian_log_prob(x.unsqueeze(0), mean, params["decoder_logvar"].clamp(lo, hi)).sum(-1)  # (S,)
        ll = clip_loglik(privacy, ll.unsqueeze(1)).squeeze(1)
        return (mu.squeeze(0) * g_mu).sum() + (logvar.squeeze(0) * g_lv).sum() + (ll * g_ll).sum()

    return fn


def private_update(program: Any, grad_mu: torch.Tensor, grad_logvar: torch.Tensor) -> None:
    """One DP-SGD step of the party's modules from the batch it encoded and decoded (then ``optimizer.step``)."""
    enc, dec = program._enc, program._dec
    handle, rows, x = enc["handle"], enc["rows"], enc["x"]
    n = len(rows)
    h = dec.get("h")
    g_ll = dec.get("grad_loglik")
    if h is None or g_ll is None or h.shape[1] != n:
        raise RuntimeError(f"party {program.party}: an update under a privacy budget needs this batch's decode and "
                           "decode_grad first")
    named = {k: v for k, v in program.net.named_parameters() if not k.startswith("indicator")}
    per_row = per_row_gradients(_row_objective(program), named, x.float(), h.transpose(0, 1).float(),
                                g_ll.transpose(0, 1).float(), grad_mu.float(), grad_logvar.float())
    flat = flat_per_row(per_row, list(named)) * n
    total = program.runtime.privacy.private_sum(program.runtime.row_keys(handle, rows), flat,
                                                "a training update") / n
    program.optimizer.zero_grad(set_to_none=True)
    start = 0
    for p in named.values():
        p.grad = total[start:start + p.numel()].view_as(p).to(p.dtype).clone()
        start += p.numel()
