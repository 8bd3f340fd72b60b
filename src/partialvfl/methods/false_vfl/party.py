"""FALSE-VFL's party program: one per party, its own encoder, decoder and (II) missing-indicator network.

The rounds of one mini-batch (``docs/false-vfl.md`` has the wire protocol and what a party learns from it):

* ``encode``: ``rows`` (its own rows, shared order) -> ``mu``, ``logvar`` (its local posterior over ``h``);
* ``decode``: the fused posterior of those rows -> ``loglik`` ``(S, B_k)`` = log p(x^k | h_j) (II: also
  ``mask_loglik`` ``(S, B_k + M_k)`` over the rows it holds, then the batch rows it lacks).  Under the ``lean`` wire
  the party gets the posterior's ``mean`` and ``scale`` per row and draws the batch's shared noise itself (seeded by
  ``meta['noise_seed']``; ``pos`` are the rows' positions in the batch of ``meta['batch']`` rows); under
  ``samples`` it gets the S latent samples ``h`` themselves.  At prediction each row also carries its own noise
  seed (``seed``, ``seed_mis``: the model's seed and the row's ID), from which the party draws that row's noise
  instead of the batch's, and ``meta['predict']`` has the party run its networks on fixed blocks of rows
  (:mod:`.rowwise`), so a row's prediction does not depend on its batch;
* ``decode_grad``: ``grad_loglik`` (II: ``grad_mask_loglik``) -> the gradient with respect to what it got
  (``grad_mean``/``grad_scale``, or ``grad_h``);
* ``update``: ``grad_mu``, ``grad_logvar`` (if it encoded) -> back-propagate, step its own optimiser.

``next_rows`` on ``update`` (and on ``decode`` when nothing is trained) asks for the next batch's ``encode`` in
the same message, which saves a round per step.  In process every party answers by this same handler, as it does
in a deployment, so a simulation and a federation with the same seeds compute the same floats (``docs/false-vfl.md``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from partialvfl.federation.wire.messages import Reply, Request
from partialvfl.federation.wire.meta_keys import FLAG, HANDLE, MetaKey
from partialvfl.federation.wire.program import PartyProgram, register_program
from partialvfl.federation.wire.schema import INFERS, Messages, MessageSpec, TensorSpec, tensor_names
from partialvfl.federation.wire.setup_config import FeatureSetup, setting
from partialvfl.federation.wire.setup_shape import Network, SetupShape
from partialvfl.methods.false_vfl.formulas import bound_noise, latent_noise, reparameterize, split_gaussian
from partialvfl.methods.false_vfl.private import clip_loglik, clip_posterior, private_refusal, private_update
from partialvfl.methods.false_vfl.rowwise import row_bound_noise, row_latent_noise, row_missing_noise
from partialvfl.methods.false_vfl.spec import DECODERS, ENCODERS, WIRE_DTYPES, WIRES
from partialvfl.nn.blocks import MLP, RowBlocks, build_decoder, build_encoder, decoder_arch, encoder_arch, for_device
from partialvfl.nn.optim import make_optimizer
from partialvfl.nn.stats import feature_gaussian_log_density
from partialvfl.utils.devices import to_device
from partialvfl.utils.seeding import derive_seed, torch_generator, torch_seeded

__all__ = ["ALLOWED_TENSORS", "FalseVFLParty", "FalseVFLSetup", "PartyModules", "allowed_tensors", "as_rows"]

_WIDE = ("float32", "bfloat16")  # d_h-wide tensors: float32, or bfloat16 with wire_dtype="bfloat16"
# the lean and bound wires carry the same tensors (posterior mean and scale, row positions)
_LEAN, _SAMPLES = {"wire": ("lean", "bound")}, {"wire": "samples"}
_LEAN_II, _SAMPLES_II = {"wire": ("lean", "bound"), "variant": 2}, {"wire": "samples", "variant": 2}
_II = {"variant": 2}
_FLOOR_SLACK = 0.01  # a scale at the floor may arrive rounded down by the wire dtype (bfloat16: 2^-8)


def _wide(name: str, shape: tuple, when: dict | None = None) -> TensorSpec:
    return TensorSpec(name, _WIDE, shape, optional=True, when=when or {})


@dataclass(frozen=True, kw_only=True)
class FalseVFLSetup(FeatureSetup):
    """The set-up config of ``false-vfl/party`` (the coordinator builds it from the method's parameters)."""

    variant: int = setting(choices=(1, 2), doc="FALSE-VFL I or II (II: the missing-indicator network)")
    d_h: int = setting(low=1, doc="width of the party-level latent h")
    encoder: str = setting(choices=ENCODERS, doc="encoder family (auto: mlp for a vector, cnn for an image piece)")
    decoder: str = setting(choices=DECODERS, doc="decoder family (auto: mlp for a vector, deconv for an image piece)")
    encoder_hidden: tuple[int, ...] = setting(low=1, doc="hidden widths of the encoder (MLP)")
    decoder_hidden: tuple[int, ...] = setting(low=1, doc="hidden widths of the decoder (MLP)")
    mask_hidden: tuple[int, ...] = setting(low=1, doc="hidden widths of the missing-indicator network (II)")
    resnet_width: int = setting(low=1, doc="base width of a resnet18 encoder")
    pretrain_lr: float = setting(low=0, doc="stage-1 learning rate of the party's Adam")
    pretrain_weight_decay: float = setting(low=0, doc="stage-1 weight decay")
    encoder_logvar_range: tuple[float, float] = setting(increasing=True, doc="clamp of the posterior log-variance")
    decoder_logvar_range: tuple[float, float] = setting(increasing=True, doc="clamp of the decoder log-variances")
    wire: str = setting("lean", choices=WIRES, doc="wire protocol (lean, samples or bound)")
    wire_dtype: str = setting("float32", choices=WIRE_DTYPES, doc="dtype of the d_h-wide tensors on the wire")
    latent_scale_floor: float = setting(0.0, low=0, doc="bound wire: the smallest posterior scale it evaluates")


class PartyModules(nn.Module):
    """Party k's modules: encoder gamma_c^k, decoder theta_c^k (+ per-feature log-variance), II: indicator psi_k."""

    def __init__(self, config: FalseVFLSetup) -> None:
        super().__init__()
        shape, d, d_h = config.feature_shape, config.feature_dim, config.d_h
        self.encoder = build_encoder(shape, 2 * d_h, arch=config.encoder, hidden=config.encoder_hidden,
                                     width=config.resnet_width)
        self.decoder = build_decoder(d_h, shape, arch=config.decoder, hidden=config.decoder_hidden)
        self.decoder_logvar = nn.Parameter(torch.zeros(d))
        self.indicator = MLP(d, config.mask_hidden, 1) if config.variant == 2 else None


@register_program
class FalseVFLParty(PartyProgram):
    """The party-local half of FALSE-VFL I/II; its message kinds are declared in ``messages`` (see the module)."""

    program_name = "false-vfl/party"
    supports_privacy = True
    answers_concurrently = True  # every draw from its own seeded generator; the shared noise memo is locked
    setup_config = FalseVFLSetup
    config: FalseVFLSetup
    # B: rows it holds in the batch, M: rows it lacks (II), S: latent samples, N: the next batch's rows it holds
    messages: ClassVar[Messages] = {
        "encode": MessageSpec(
            request=[TensorSpec("rows", "int64", ("B",))],
            reply=[TensorSpec("mu", _WIDE, ("B", "d_h")), TensorSpec("logvar", _WIDE, ("B", "d_h"))],
            meta={"data": HANDLE}, optional_meta={"train": FLAG, "predict": FLAG}, role=INFERS,
            releases=["mu", "logvar"]),
        "decode": MessageSpec(
            request=[_wide("h", ("S", "B", "d_h"), _SAMPLES), _wide("h_mis", ("S", "M", "d_h"), _SAMPLES_II),
                     _wide("mean", ("B", "d_h"), _LEAN), _wide("scale", ("B", "d_h"), _LEAN),
                     TensorSpec("pos", "int64", ("B",), optional=True, when=_LEAN),
                     _wide("mean_mis", ("M", "d_h"), _LEAN_II), _wide("scale_mis", ("M", "d_h"), _LEAN_II),
                     TensorSpec("pos_mis", "int64", ("M",), optional=True, when=_LEAN_II),
                     TensorSpec("seed", "int64", ("B",), optional=True, when=_LEAN),
                     TensorSpec("seed_mis", "int64", ("M",), optional=True, when=_II),
                     TensorSpec("next_rows", "int64", ("N",), optional=True)],
            reply=[TensorSpec("loglik", "float32", ("S", "B"), optional=True),
                   TensorSpec("mask_loglik", "float32", ("S", "B+M"), optional=True, when=_II),
                   _wide("mu", ("N", "d_h")), _wide("logvar", ("N", "d_h"))],
            optional_meta={"train": FLAG, "noise_seed": MetaKey(int, low=0, doc="the batch's noise seed"),
                           "batch": MetaKey(int, low=0, doc="the batch's row count"),
                           "samples": MetaKey(int, low=1, doc="latent samples per row"), "data": HANDLE,
                           "predict": FLAG}, role=INFERS,
            releases=["loglik", "mask_loglik", "mu", "logvar"]),
        "decode_grad": MessageSpec(
            request=[TensorSpec("grad_loglik", "float32", ("S", "B"), optional=True),
                     TensorSpec("grad_mask_loglik", "float32", ("S", "B+M"), optional=True, when=_II)],
            gradients={"grad_loglik": 1, "grad_mask_loglik": 1},
            reply=[_wide("grad_h", ("S", "B", "d_h"), _SAMPLES), _wide("grad_h_mis", ("S", "M", "d_h"), _SAMPLES_II),
                   _wide("grad_mean", ("B", "d_h"), _LEAN), _wide("grad_scale", ("B", "d_h"), _LEAN),
                   _wide("grad_mean_mis", ("M", "d_h"), _LEAN_II),
                   _wide("grad_scale_mis", ("M", "d_h"), _LEAN_II)],
            releases=["grad_h", "grad_h_mis", "grad_mean", "grad_scale", "grad_mean_mis", "grad_scale_mis"]),
        "update": MessageSpec(
            request=[_wide("grad_mu", ("B", "d_h")), _wide("grad_logvar", ("B", "d_h")),
                     TensorSpec("next_rows", "int64", ("N",), optional=True)],
            gradients=["grad_mu", "grad_logvar"],
            reply=[_wide("mu", ("N", "d_h")), _wide("logvar", ("N", "d_h"))],
            optional_meta={"data": HANDLE}, releases=["mu", "logvar"]),
    }

    @classmethod
    def describe_setup(cls, config: FalseVFLSetup) -> SetupShape:
        """The encoder (sends ``2 d_h`` per row: mean and log-variance), the decoder (its log-likelihood and the
        gradient through it, ``d_h`` per row, are sent) and, for II, the missing-indicator network."""
        shape, d_h = config.feature_shape, config.d_h
        nets = [Network("encoder", encoder_arch(config.encoder, shape), config.encoder_hidden, shape, 2 * d_h,
                        2 * d_h, resnet_width=config.resnet_width),
                Network("decoder", decoder_arch(config.decoder, shape), config.decoder_hidden, (d_h,),
                        math.prod(shape), d_h)]
        if config.variant == 2:
            nets.append(Network("missing indicator", "mlp", config.mask_hidden, shape, 1, 1))
        floor = config.latent_scale_floor if config.wire == "bound" else None
        return SetupShape(tuple(nets), {"pretrain_lr": config.pretrain_lr}, feature_shape=shape,
                          weight_decays={"pretrain_weight_decay": config.pretrain_weight_decay},
                          likelihood_oracle=config.wire != "bound", latent_scale_floor=floor)

    @classmethod
    def private_setup_refusal(cls, config: FalseVFLSetup) -> str | None:
        """Why this party refuses ``config`` when it keeps a privacy budget (``None``: it accepts it)."""
        return private_refusal(config)

    def released_rows(self, kind: str, request: Request, reply: Reply) -> dict[str, tuple[str, np.ndarray, int]]:
        """Recorded by the handlers as they compute: ``mu``/``logvar`` are about the rows they encoded, ``loglik``
        (axis 1) and the latent gradients about the rows of the pending encode."""
        return {name: self._rows_of[name] for name in reply.tensors if name in self._rows_of}

    def __init__(self, runtime: Any, config: FalseVFLSetup, seed: int) -> None:
        super().__init__(runtime, config, seed)
        self.variant = config.variant
        self.wire = config.wire
        self.wire_dtype = getattr(torch, config.wire_dtype)
        self.latent_scale_floor = config.latent_scale_floor
        with torch_seeded(seed, "false-vfl", "party", runtime.index):
            self.net = for_device(PartyModules(config).to(self.device), self.device)  # CUDA: channels last
        self.logvar_range = config.encoder_logvar_range
        self.decoder_logvar_range = config.decoder_logvar_range
        self.optimizer = make_optimizer(self.net.parameters(), "adam", config.pretrain_lr,
                                        config.pretrain_weight_decay)
        self._rows_of: dict[str, tuple[str, np.ndarray, int]] = {}  # reply tensor -> (handle, rows, axis)
        self._enc: dict[str, Any] = {}  # the pending encode: x, mu, logvar, train
        self._dec: dict[str, Any] = {}  # the pending decode's graph: leaves and outputs

    # -------------------------------------------------------------- helpers
    def _mode(self, train: bool) -> None:
        """The networks in training or evaluation mode (set only on a change: ``train()`` walks every submodule,
        a ResNet-18's 60, on every message otherwise; only the handlers set the mode, always of the whole net)."""
        if self.net.training != train:
            self.net.train(train)

    def _draw(self, gen: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
        """Seeded normal noise (drawn on the CPU: the same numbers on every device) on the party's device."""
        return to_device(torch.randn(shape, generator=gen), self.device)

    def decoder_logvar(self) -> torch.Tensor:
        """The decoder's per-feature log-variance, clamped to its declared range."""
        lo, hi = self.decoder_logvar_range
        return self.net.decoder_logvar.clamp(lo, hi)

    def log_missing_prob(self, x: torch.Tensor, missing: bool, predict: bool = False) -> torch.Tensor:
        """log p(m^k | x^k) with the paper's convention m = 1 for a missing block (psi gives the logit of m = 1);
        ``predict``: the network run on fixed blocks of rows (:class:`~partialvfl.nn.blocks.RowBlocks`)."""
        assert self.net.indicator is not None
        logit = (RowBlocks(self.net.indicator) if predict else self.net.indicator)(x).squeeze(-1)
        return nn.functional.logsigmoid(logit if missing else -logit)

    def features(self, handle: str, rows: torch.Tensor) -> torch.Tensor:
        """Its own features of ``rows`` (shared-order positions) in the dataset attached as ``handle``."""
        return self.rows_features(handle, rows)

    def to_wire(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` in the wire's floating-point type."""
        return t.to(self.wire_dtype)

    def shared_noise(self, meta: dict[str, Any], d_h: int) -> torch.Tensor:
        """The batch's reparameterisation noise ``eps_h`` ``(S, batch, d_h)``, the same draw as the coordinator's."""
        return latent_noise(meta["noise_seed"], (meta["samples"], meta["batch"], d_h), self.device)

    def latent_noise(self, req: Request, d_h: int) -> dict[str, torch.Tensor]:
        """The noise ``(S, rows, d_h)`` of the held (``""``) and lacked (``"_mis"``) rows a lean or bound decode
        names.  Lean: the batch's shared draw at the rows' positions, or at prediction each row's own draw from
        its ``seed``.  Bound: each row's own draw, a hash of the exact bytes of its mean and scale (and of the
        batch's seed and its position, :func:`~.formulas.bound_noise`, or at prediction of its ``seed``,
        :func:`~.rowwise.row_bound_noise`), after checking that no two rows share a position (a seed) and every
        scale is at least this program's floor, so that the coordinator cannot aim a latent."""
        t, meta = req.tensors, req.meta
        suffixes = [sfx for sfx in ("", "_mis") if f"mean{sfx}" in t]
        per_row = bool(suffixes) and all(f"seed{sfx}" in t for sfx in suffixes)
        if self.wire == "lean":
            if per_row:
                return {sfx: to_device(row_latent_noise(t[f"seed{sfx}"], meta["samples"], d_h)[0], self.device)
                        for sfx in suffixes}
            eps = self.shared_noise(meta, d_h) if suffixes else None
            # the positions arrive on the CPU: moved without blocking (indexing with CPU indices would copy them
            # from pageable memory, which synchronises a GPU's stream)
            return {sfx: eps[:, to_device(t[f"pos{sfx}"], self.device)] for sfx in suffixes} if eps is not None else {}
        batch, samples = meta["batch"], meta["samples"]
        pos = torch.cat([t[f"pos{sfx}"] for sfx in suffixes]) if suffixes else torch.zeros(0, dtype=torch.int64)
        if len(pos) and (int(pos.min()) < 0 or int(pos.max()) >= batch or len(torch.unique(pos)) != len(pos)):
            raise ValueError(f"party {self.party}: bound decode: row positions must be distinct, in [0, {batch})")
        seeds = torch.cat([t[f"seed{sfx}"] for sfx in suffixes]) if per_row else None
        if seeds is not None and len(torch.unique(seeds)) != len(seeds):
            raise ValueError(f"party {self.party}: bound decode: row seeds must be distinct")
        out = {}
        for sfx in suffixes:
            mean, scale = t[f"mean{sfx}"], t[f"scale{sfx}"]
            floor = self.latent_scale_floor * (1 - _FLOOR_SLACK)
            if not bool(torch.isfinite(mean).all()) or not bool((scale.float() >= floor).all()):
                raise ValueError(f"party {self.party}: bound decode: every mean must be finite and every scale at "
                                 f"least {self.latent_scale_floor:g} (latent_scale_floor)")
            out[sfx] = (row_bound_noise(t[f"seed{sfx}"], mean, scale, samples) if per_row
                        else bound_noise(meta["noise_seed"], t[f"pos{sfx}"], mean, scale, samples))
        return out

    def release(self, reply: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every ``decode`` reply passes here before it leaves (in process and batched alike): the one place where
        what the party releases per row (its log-likelihoods, II's mask terms) can be metered or noised."""
        return reply

    def missing_noise_seed(self, meta: dict[str, Any]) -> int:
        """Seed of II's decoder draws for the rows it lacks (lean: derived from the batch's seed, never sent)."""
        seed = meta.get("noise_seed", 0)
        return derive_seed(seed, "party", self.party) if self.wire == "lean" else seed

    # -------------------------------------------------------------- handlers
    def encode_rows(self, handle: str, rows: torch.Tensor, train: bool, predict: bool = False
                    ) -> dict[str, torch.Tensor]:
        """Encode its rows (training: zero its gradients and keep the graph until ``update``; ``predict``: on fixed
        blocks of rows, the same floats for a row in any batch, :func:`~partialvfl.nn.blocks.in_row_blocks`)."""
        x = self.features(handle, rows)
        self._mode(train)
        if train:
            self.optimizer.zero_grad(set_to_none=True)
        with torch.set_grad_enabled(train):
            encoded = (RowBlocks(self.net.encoder) if predict and not train else self.net.encoder)(x)
            mu, logvar = split_gaussian(encoded, self.logvar_range)
            if self.runtime.privacy is not None:
                mu, logvar = clip_posterior(self.runtime.privacy, mu, logvar)
        self._enc = {"x": x, "mu": mu, "logvar": logvar, "train": train, "handle": str(handle), "rows": rows.numpy()}
        self._rows_of.update({"mu": (str(handle), rows.numpy(), 0), "logvar": (str(handle), rows.numpy(), 0)})
        return {"mu": self.to_wire(mu), "logvar": self.to_wire(logvar)}

    def on_encode(self, req: Request) -> Reply:
        """``encode``: the posterior parameters (``mu``, ``logvar``) of the party's own ``rows`` of ``data``."""
        self._rows_of = {}
        return Reply(self.encode_rows(req.meta["data"], req.tensors["rows"], req.meta.get("train", False),
                                      predict=req.meta.get("predict", False)))

    def _latents(self, req: Request, train: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor | None,
                                                            torch.Tensor | None]:
        """The leaves it differentiates (what it got) and the latent samples of its held / lacked rows."""
        t = req.tensors
        if self.wire == "samples":
            leaves = {n: t[n].float() for n in ("h", "h_mis") if n in t}
        else:
            leaves = {n: t[n].float() for n in ("mean", "scale", "mean_mis", "scale_mis") if n in t}
        if train:  # leaves of its own graph (a view: the request is never written, so no copy is needed)
            leaves = {n: v.detach().requires_grad_() for n, v in leaves.items()}
        if self.wire == "samples":
            return leaves, leaves.get("h"), leaves.get("h_mis")
        eps = self.latent_noise(req, self.config.d_h)
        out = []
        for suffix in ("", "_mis"):
            mean = leaves.get(f"mean{suffix}")
            out.append(None if mean is None else mean + leaves[f"scale{suffix}"] * eps[suffix])
        return leaves, out[0], out[1]

    def on_decode(self, req: Request) -> Reply:
        """``decode``: the log-likelihoods of the party's own data under the latents the coordinator sends.

        The latents are samples, or a posterior the party samples itself.  The reply holds the log-likelihood of
        the party's own features of the rows it encoded (``loglik``, S per row) and, for FALSE-VFL-II, the
        log-probability of each row's missingness (``mask_loglik``; for the rows it lacks, of a block drawn from
        the decoder); clipped when the party keeps a privacy budget, with the next batch's encoding when
        ``next_rows`` rides with it.
        """
        self._rows_of = {}
        train = req.meta.get("train", False)
        predict = req.meta.get("predict", False) and not train
        self._mode(train)
        leaves, h, h_mis = self._latents(req, train)
        if h is not None and len(self._enc.get("x", ())) != h.shape[1]:
            raise RuntimeError(f"party {self.party}: decode of {h.shape[1]} held rows without their encode")
        if train and h is None:  # II: a party that lacks every row of the batch decodes without encoding
            self.optimizer.zero_grad(set_to_none=True)
        out: dict[str, torch.Tensor] = {}
        decoder = RowBlocks(self.net.decoder) if predict else self.net.decoder
        with torch.set_grad_enabled(train):
            logvar = self.decoder_logvar()
            if h is not None:
                out["loglik"] = feature_gaussian_log_density(self._enc["x"], decoder(h), logvar, rowwise=predict)
                if self.runtime.privacy is not None:
                    out["loglik"] = clip_loglik(self.runtime.privacy, out["loglik"])
                    self._rows_of["loglik"] = (self._enc["handle"], self._enc["rows"], 1)
            if self.variant == 2:
                parts = []
                if h is not None:
                    held = self.log_missing_prob(self._enc["x"], missing=False, predict=predict)
                    parts.append(held.unsqueeze(0).expand(h.shape[0], -1))
                if h_mis is not None:
                    mean = decoder(h_mis)
                    if "seed_mis" in req.tensors:  # prediction: each lacked row's draws from its own seed
                        noise = row_missing_noise(req.tensors["seed_mis"], self.party, tuple(mean.shape))
                    else:
                        gen = torch_generator(self.missing_noise_seed(req.meta), "party", self.party)
                        noise = self._draw(gen, tuple(mean.shape))
                    x_mis = reparameterize(mean, logvar, noise.to(self.device))
                    parts.append(self.log_missing_prob(x_mis, missing=True, predict=predict))
                if parts:
                    out["mask_loglik"] = torch.cat(parts, dim=1)
        self._dec = {"leaves": leaves, "outs": dict(out)} if train else {}
        if train and h is not None and self.runtime.privacy is not None:
            self._dec.update(h=h.detach(), handle=self._enc["handle"], rows=self._enc["rows"])
        out = self.release(out)
        if "next_rows" in req.tensors:
            out.update(self.encode_rows(req.meta["data"], req.tensors["next_rows"], train=False, predict=predict))
        return Reply(out)

    def on_decode_grad(self, req: Request) -> Reply:
        """``decode_grad``: back-propagate the log-likelihoods' gradients; reply the gradients of the latents it was
        sent.
        """
        self._rows_of = {}
        if self.runtime.privacy is not None and "grad_loglik" in req.tensors:
            self._dec["grad_loglik"] = req.tensors["grad_loglik"]
        outs, grads = [], []
        for name in ("loglik", "mask_loglik"):
            if f"grad_{name}" in req.tensors and name in self._dec.get("outs", {}):
                outs.append(self._dec["outs"][name])
                grads.append(req.tensors[f"grad_{name}"])
        if outs:
            torch.autograd.backward(outs, grads)
        reply = {}
        for name, leaf in self._dec.get("leaves", {}).items():
            reply[f"grad_{name}"] = self.to_wire(leaf.grad if leaf.grad is not None else torch.zeros_like(leaf))
            if "rows" in self._dec:  # the gradients of the held rows' latents (axis of B)
                self._rows_of[f"grad_{name}"] = (self._dec["handle"], self._dec["rows"], 1 if name == "h" else 0)
        return Reply(reply)

    def on_update(self, req: Request) -> Reply:
        """``update``: back-propagate the encoder's gradients (privately when the party keeps a budget) and step its
        optimiser; encodes ``next_rows`` when they ride with it.
        """
        self._rows_of = {}
        if self.runtime.privacy is not None and "grad_mu" in req.tensors:
            private_update(self, req.tensors["grad_mu"], req.tensors["grad_logvar"])
        elif "grad_mu" in req.tensors:
            torch.autograd.backward([self._enc["mu"], self._enc["logvar"]],
                                    [req.tensors["grad_mu"].float(), req.tensors["grad_logvar"].float()])
        self.optimizer.step()
        self._enc, self._dec = {}, {}
        if "next_rows" in req.tensors:
            return Reply(self.encode_rows(req.meta["data"], req.tensors["next_rows"], train=True))
        return Reply({})

    # -------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Modules and optimiser (the optimiser so that a checkpointed stage 1 resumes exactly)."""
        return {"net": self.net.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the state saved by :meth:`state_dict`."""
        self.net.load_state_dict(state["net"])
        if "optimizer" in state:  # models saved before optimiser states were kept load without one
            self.optimizer.load_state_dict(state["optimizer"])
        self._enc, self._dec = {}, {}


def allowed_tensors(variant: int, wire: str = "lean") -> frozenset[str]:
    """Every tensor name that may cross a party boundary for this variant and wire protocol."""
    return tensor_names(FalseVFLParty, {"variant": variant, "wire": wire})


#: Every tensor name that may cross a party boundary, per variant, under either wire protocol (row indices,
#: posterior parameters or latent samples, per-sample log-likelihood scalars and mask terms, and the gradients).
ALLOWED_TENSORS: dict[int, frozenset[str]] = {v: allowed_tensors(v, "lean") | allowed_tensors(v, "samples")
                                              for v in (1, 2)}


def as_rows(rows: np.ndarray) -> torch.Tensor:
    """Row positions as the int64 tensor that crosses in ``encode``."""
    return torch.as_tensor(np.ascontiguousarray(rows, dtype=np.int64))
