"""FALSE-VFL's party program: one per party, its own encoder, decoder and (II) missing-indicator network."""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from partialvfl.federation.messages import Reply, Request
from partialvfl.federation.party import PartyProgram, register_program
from partialvfl.federation.schema import Messages, MessageSpec, TensorSpec, tensor_names
from partialvfl.methods.false_vfl.formulas import gaussian_log_density, reparameterize, split_gaussian
from partialvfl.nn.blocks import MLP, build_decoder, build_encoder
from partialvfl.utils.seeding import torch_generator, torch_seeded

__all__ = ["ALLOWED_TENSORS", "FalseVFLParty", "as_rows"]


class _PartyModules(nn.Module):
    """Party k's modules: encoder gamma_c^k, decoder theta_c^k (+ per-feature log-variance), II: indicator psi_k."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        shape = tuple(int(s) for s in config["feature_shape"])
        d = int(config["feature_dim"])
        d_h = int(config["d_h"])
        self.encoder = build_encoder(shape, 2 * d_h, arch=config["encoder"],
                                     hidden=tuple(config["encoder_hidden"]), width=int(config["resnet_width"]))
        self.decoder = build_decoder(d_h, shape, arch=config["decoder"], hidden=tuple(config["decoder_hidden"]))
        self.decoder_logvar = nn.Parameter(torch.zeros(d))
        self.indicator = MLP(d, tuple(config["mask_hidden"]), 1) if int(config["variant"]) == 2 else None


@register_program
class FalseVFLParty(PartyProgram):
    """The party-local half of FALSE-VFL I/II.  Message kinds (all driven by the coordinator):

    * ``encode``: ``rows`` (its own rows, shared order) -> ``mu``, ``logvar`` (its local posterior over ``h``);
    * ``decode``: ``h`` ``(S, B_k, d_h)`` for those rows (II: also ``h_mis`` for batch rows it lacks) ->
      ``loglik`` ``(S, B_k)`` (II: ``mask_loglik`` ``(S, B_k + M_k)``, held rows first);
    * ``decode_grad``: ``grad_loglik`` (II: ``grad_mask_loglik``) -> ``grad_h`` (II: ``grad_h_mis``);
    * ``update``: ``grad_mu``, ``grad_logvar`` (if it encoded) -> back-propagate, step its own optimiser.

    ``meta['train']`` selects training mode (graph kept, optimiser zeroed on ``encode``); ``meta['noise_seed']``
    seeds the decoder samples of missing blocks (II) so that predictions are reproducible.
    """

    program_name = "false-vfl/party"
    # B: rows it holds in the batch, M: rows it lacks (II), S: latent samples
    messages: ClassVar[Messages] = {
        "encode": MessageSpec(
            request=[TensorSpec("rows", "int64", ("B",))],
            reply=[TensorSpec("mu", "float32", ("B", "d_h")), TensorSpec("logvar", "float32", ("B", "d_h"))],
            meta=["data"], optional_meta=["train"]),
        "decode": MessageSpec(
            request=[TensorSpec("h", "float32", ("S", "B", "d_h"), optional=True),
                     TensorSpec("h_mis", "float32", ("S", "M", "d_h"), optional=True, when={"variant": 2})],
            reply=[TensorSpec("loglik", "float32", ("S", "B"), optional=True),
                   TensorSpec("mask_loglik", "float32", ("S", "B+M"), optional=True, when={"variant": 2})],
            optional_meta=["train", "noise_seed"]),
        "decode_grad": MessageSpec(
            request=[TensorSpec("grad_loglik", "float32", ("S", "B"), optional=True),
                     TensorSpec("grad_mask_loglik", "float32", ("S", "B+M"), optional=True, when={"variant": 2})],
            reply=[TensorSpec("grad_h", "float32", ("S", "B", "d_h"), optional=True),
                   TensorSpec("grad_h_mis", "float32", ("S", "M", "d_h"), optional=True, when={"variant": 2})]),
        "update": MessageSpec(
            request=[TensorSpec("grad_mu", "float32", ("B", "d_h"), optional=True),
                     TensorSpec("grad_logvar", "float32", ("B", "d_h"), optional=True)]),
    }

    def __init__(self, runtime: Any, config: dict[str, Any], seed: int) -> None:
        super().__init__(runtime, config, seed)
        self.variant = int(config["variant"])
        with torch_seeded(seed, "false-vfl", "party", runtime.index):
            self.net = _PartyModules(config)
        self.logvar_range = tuple(float(v) for v in config["encoder_logvar_range"])
        self.decoder_logvar_range = tuple(float(v) for v in config["decoder_logvar_range"])
        self.optimizer = torch.optim.Adam(self.net.parameters(), lr=float(config["pretrain_lr"]),
                                          weight_decay=float(config["pretrain_weight_decay"]))
        self._enc: dict[str, Any] = {}
        self._dec: dict[str, Any] = {}

    # -------------------------------------------------------------- helpers
    def _draw(self, gen: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randn(shape, generator=gen)

    def decoder_logvar(self) -> torch.Tensor:
        lo, hi = self.decoder_logvar_range
        return self.net.decoder_logvar.clamp(lo, hi)

    def log_missing_prob(self, x: torch.Tensor, missing: bool) -> torch.Tensor:
        """log p(m^k | x^k) with the paper's convention m = 1 for a missing block (psi gives the logit of m = 1)."""
        assert self.net.indicator is not None
        logit = self.net.indicator(x).squeeze(-1)
        return nn.functional.logsigmoid(logit if missing else -logit)

    # -------------------------------------------------------------- handlers
    def on_encode(self, req: Request) -> Reply:
        view = self.data(req.meta["data"])
        rows = req.tensors["rows"].numpy()
        x = torch.as_tensor(view.features[view.position_of_rows(rows)])
        train = bool(req.meta.get("train", False))
        self.net.train(train)
        if train:
            self.optimizer.zero_grad(set_to_none=True)
        with torch.set_grad_enabled(train):
            mu, logvar = split_gaussian(self.net.encoder(x), self.logvar_range)
        self._enc = {"step": req.meta.get("step"), "x": x, "mu": mu, "logvar": logvar, "train": train}
        return Reply({"mu": mu, "logvar": logvar})

    def on_decode(self, req: Request) -> Reply:
        train = bool(req.meta.get("train", False))
        same_step = bool(self._enc) and self._enc.get("step") == req.meta.get("step")
        self.net.train(train)
        if train and not same_step:
            self.optimizer.zero_grad(set_to_none=True)
        h = req.tensors.get("h")
        h_mis = req.tensors.get("h_mis")
        if h is not None and not same_step:
            raise RuntimeError(f"party {self.party}: decode of held rows without an encode in this step")
        if train:
            h = h.clone().requires_grad_() if h is not None else None
            h_mis = h_mis.clone().requires_grad_() if h_mis is not None else None
        out: dict[str, torch.Tensor] = {}
        graph: dict[str, torch.Tensor] = {}
        with torch.set_grad_enabled(train):
            logvar = self.decoder_logvar()
            if h is not None:
                x = self._enc["x"]
                out["loglik"] = gaussian_log_density(x, self.net.decoder(h), logvar)
            if self.variant == 2:
                parts = []
                if h is not None:
                    held = self.log_missing_prob(self._enc["x"], missing=False)
                    parts.append(held.unsqueeze(0).expand(h.shape[0], -1))
                if h_mis is not None:
                    gen = torch_generator(int(req.meta.get("noise_seed", 0)), "party", self.party)
                    mean = self.net.decoder(h_mis)
                    x_mis = reparameterize(mean, logvar, self._draw(gen, tuple(mean.shape)))
                    parts.append(self.log_missing_prob(x_mis, missing=True))
                if parts:
                    out["mask_loglik"] = torch.cat(parts, dim=1)
        if train:
            graph = {"h": h, "h_mis": h_mis, **out}
        self._dec = graph
        return Reply(out)

    def on_decode_grad(self, req: Request) -> Reply:
        outs, grads = [], []
        for name in ("loglik", "mask_loglik"):
            if f"grad_{name}" in req.tensors and self._dec.get(name) is not None:
                outs.append(self._dec[name])
                grads.append(req.tensors[f"grad_{name}"])
        if outs:
            torch.autograd.backward(outs, grads)
        reply = {}
        for name in ("h", "h_mis"):
            t = self._dec.get(name)
            if t is not None:
                reply[f"grad_{name}"] = t.grad if t.grad is not None else torch.zeros_like(t)
        return Reply(reply)

    def on_update(self, req: Request) -> Reply:
        if "grad_mu" in req.tensors:
            torch.autograd.backward([self._enc["mu"], self._enc["logvar"]],
                                    [req.tensors["grad_mu"], req.tensors["grad_logvar"]])
        self.optimizer.step()
        self._enc, self._dec = {}, {}
        return Reply({})

    # -------------------------------------------------------------- state
    def parameters_snapshot(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.net.state_dict().items()}

    def state_dict(self) -> dict[str, Any]:
        """Modules and optimiser (the optimiser so that a checkpointed stage 1 resumes exactly)."""
        return {"net": self.net.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.net.load_state_dict(state["net"])
        if "optimizer" in state:  # models saved before optimiser states were kept load without one
            self.optimizer.load_state_dict(state["optimizer"])


#: Every tensor name that may cross a party boundary, per variant (row indices, latent posterior parameters,
#: sampled latents, per-sample log-likelihood scalars and mask terms, and the gradients of those).
ALLOWED_TENSORS: dict[int, frozenset[str]] = {v: tensor_names(FalseVFLParty, {"variant": v}) for v in (1, 2)}


def as_rows(rows: np.ndarray) -> torch.Tensor:
    """Row positions as the int64 tensor that crosses in ``encode``."""
    return torch.as_tensor(np.ascontiguousarray(rows, dtype=np.int64))
