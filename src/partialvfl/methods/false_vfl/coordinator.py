"""FALSE-VFL I (MAR) and II (MNAR): a deep latent variable model split across the parties of a vertical federation.

After "Deep Latent Variable Model based Vertical Federated Learning with Flexible Alignment and Labeling Scenarios"
(FALSE-VFL; sections 3-4 and Appendices A-C).  Latent chain ``z -> h -> x``: each party k holds an encoder
``x^k -> q_k(h)`` and a decoder ``h -> p(x^k|h)`` (II: also a missing-indicator network ``x^k -> p(m^k|x^k)``); the
active party (this coordinator) holds the global encoder ``q(z|h)``, the global decoder ``p(h|z)``, the
discriminator ``p(y|h)`` and the prior ``p(z) = N(0, I)``.

* Stage 1 maximises the kappa-sample IWAE bound on ``log p(x_obs)`` (II: ``log p(x_obs, m)``) over every sample
  with at least one observed party, labelled or not;
* stage 2 freezes every generative parameter (and psi) and maximises the label bound ``L'`` over the labelled
  samples, discriminator only;
* prediction is self-normalised importance sampling with ``L`` samples whose weights exclude the label.

Per mini-batch the coordinator runs these rounds through the transport (see ``docs/false-vfl.md``): ``encode``
(rows -> mu, logvar), ``decode`` (h [, h_mis] -> loglik [, mask_loglik]), and when training ``decode_grad``
(grad_loglik [, grad_mask_loglik] -> grad_h [, grad_h_mis]) and ``update`` (grad_mu, grad_logvar).  The
gradients the parties receive are exactly those of the centralised bound (tested).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from partialvfl.data.dataset import CoordinatorView
from partialvfl.federation.messages import Request
from partialvfl.methods.base import VFLMethod, register_method
from partialvfl.methods.false_vfl.formulas import (
    fuse_posteriors,
    latent_log_weights,
    predictive_log_probs,
    reparameterize,
    snis_weights,
)
from partialvfl.methods.false_vfl.party import FalseVFLParty, as_rows
from partialvfl.methods.false_vfl.spec import PARAMS
from partialvfl.methods.training import Metrics, Stage, TrainingLoop
from partialvfl.nn.blocks import MLP
from partialvfl.nn.stats import gaussian_log_prob, log_mean_exp
from partialvfl.utils.seeding import derive_seed, numpy_rng, torch_generator, torch_seeded

__all__ = ["FalseVFL1", "FalseVFL2"]


@dataclass
class _Pass:
    """One batch's forward pass: which parties answered, the latents, and the (S, B) log-weights."""

    rows: np.ndarray
    observed: np.ndarray  # (B, K) what the data says
    avail: np.ndarray  # (B, K) observed and answered
    h: torch.Tensor
    log_w: torch.Tensor
    mu: dict[int, torch.Tensor] = field(default_factory=dict)
    logvar: dict[int, torch.Tensor] = field(default_factory=dict)
    loglik: dict[int, torch.Tensor] = field(default_factory=dict)
    mask_loglik: dict[int, torch.Tensor] = field(default_factory=dict)
    held: dict[int, np.ndarray] = field(default_factory=dict)
    missing: dict[int, np.ndarray] = field(default_factory=dict)
    decoded: set[int] = field(default_factory=set)

    @property
    def keep(self) -> np.ndarray:
        """Samples with at least one answering party (the others are skipped / predicted from the prior)."""
        return self.avail.any(axis=1)


class _FalseVFL(VFLMethod):
    """FALSE-VFL coordinator (the active party's label side); subclasses fix the variant (1: MAR, 2: MNAR)."""

    party_program: ClassVar[str] = FalseVFLParty.program_name
    variant: ClassVar[int] = 1
    params: ClassVar = PARAMS

    def _party_config(self, party: int) -> dict[str, Any]:
        p = self.params_
        keys = ("d_h", "encoder", "decoder", "encoder_hidden", "decoder_hidden", "mask_hidden",
                "resnet_width", "pretrain_lr", "pretrain_weight_decay", "encoder_logvar_range",
                "decoder_logvar_range")
        cfg = {k: p[k] for k in keys}
        cfg.update(variant=self.variant, feature_dim=int(self.index_.feature_dims[party]),
                   feature_shape=[int(s) for s in self.index_.feature_shapes[party]])
        return cfg

    # ------------------------------------------------------------------ coordinator modules
    def _build_coordinator(self) -> None:
        p = self.params_
        d_h, d_z = int(p["d_h"]), int(p["d_z"])
        out = self.index_.task.n_classes if self.index_.task.is_classification else 2
        with torch_seeded(self.seed, "false-vfl", "coordinator"):
            self.global_encoder_ = MLP(d_h, tuple(p["global_hidden"]), 2 * d_z)
            self.global_decoder_ = MLP(d_z, tuple(p["global_hidden"]), 2 * d_h)
            self.discriminator_ = MLP(d_h, tuple(p["discriminator_hidden"]), out)
        if not hasattr(self, "y_mean_"):
            self.y_mean_, self.y_std_ = 0.0, 1.0

    def _coordinator_modules(self) -> dict[str, torch.nn.Module]:
        return {"global_encoder": self.global_encoder_, "global_decoder": self.global_decoder_,
                "discriminator": self.discriminator_}

    def _coordinator_extra_state(self) -> dict[str, Any]:
        return {"y_mean": float(self.y_mean_), "y_std": float(self.y_std_)}

    def _load_coordinator_extra_state(self, state: dict[str, Any]) -> None:
        self.y_mean_, self.y_std_ = float(state["y_mean"]), float(state["y_std"])

    # ------------------------------------------------------------------ one batch
    def _draw(self, gen: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randn(shape, generator=gen)

    def _forward(self, view: CoordinatorView, handle: str, rows: np.ndarray, n_samples: int, *, train: bool,
                 noise_seed: int, new_step: bool = True) -> _Pass:
        """Rounds ``encode`` and ``decode`` for one batch; returns the (S, B) importance log-weights (label-free).

        ``new_step=False`` when the caller (the training loop) has started the transport step already.
        """
        p = self.params_
        transport = self.transport
        n_parties = view.n_parties
        rows = np.asarray(rows, dtype=np.int64)
        observed = view.observed[rows]
        b, d_h, d_z = len(rows), int(p["d_h"]), int(p["d_z"])

        if new_step:
            transport.new_step()
        requests = {k: Request("encode", {"rows": as_rows(rows[observed[:, k]])}, {"data": handle, "train": train})
                    for k in range(n_parties) if observed[:, k].any()}
        replies = transport.call_many(requests, tolerate=True)
        avail = observed.copy()
        for k in range(n_parties):
            if k not in replies:
                avail[:, k] = False
        st = _Pass(rows=rows, observed=observed, avail=avail, h=torch.empty(0), log_w=torch.empty(0))
        mus, lvs = [], []
        zeros = torch.zeros(b, d_h)
        for k in range(n_parties):
            st.held[k] = np.flatnonzero(observed[:, k])
            st.missing[k] = np.flatnonzero(~observed[:, k])
            if k in replies:
                mu, lv = replies[k].tensors["mu"], replies[k].tensors["logvar"]
                if train:
                    mu, lv = mu.requires_grad_(), lv.requires_grad_()
                st.mu[k], st.logvar[k] = mu, lv
                idx = torch.as_tensor(st.held[k])
                mus.append(zeros.index_copy(0, idx, mu))
                lvs.append(zeros.index_copy(0, idx, lv))
            else:
                mus.append(zeros)
                lvs.append(zeros)
        mean_h, logvar_h = fuse_posteriors(torch.stack(mus), torch.stack(lvs), torch.as_tensor(avail.T),
                                           p["fusion"])
        gen = torch_generator(noise_seed, "coordinator")
        h = reparameterize(mean_h, logvar_h, self._draw(gen, (n_samples, b, d_h)))
        eps_z = self._draw(gen, (n_samples, b, d_z))
        st.h = h

        transport.new_round()
        requests = {}
        for k in range(n_parties):
            tensors = {}
            if k in replies:
                tensors["h"] = h[:, st.held[k]]
            if self.variant == 2 and (k in replies or not observed[:, k].any()) and st.missing[k].size:
                tensors["h_mis"] = h[:, st.missing[k]]
            if tensors:
                requests[k] = Request("decode", tensors, {"train": train,
                                                          "noise_seed": derive_seed(noise_seed, "party", k)})
        replies = transport.call_many(requests, tolerate=True)
        loglik = torch.zeros(n_samples, b)
        mask = torch.zeros(n_samples, b)
        for k, r in replies.items():
            st.decoded.add(k)
            if "loglik" in r.tensors:
                ll = r.tensors["loglik"].requires_grad_() if train else r.tensors["loglik"]
                st.loglik[k] = ll
                loglik = loglik.index_add(1, torch.as_tensor(st.held[k]), ll)
            if "mask_loglik" in r.tensors:
                ml = r.tensors["mask_loglik"].requires_grad_() if train else r.tensors["mask_loglik"]
                st.mask_loglik[k] = ml
                idx = np.concatenate([st.held[k] if "h" in requests[k].tensors else st.held[k][:0],
                                      st.missing[k] if "h_mis" in requests[k].tensors else st.missing[k][:0]])
                mask = mask.index_add(1, torch.as_tensor(idx), ml)
        latent = latent_log_weights(h, mean_h, logvar_h, self.global_encoder_, self.global_decoder_, eps_z,
                                    p["encoder_logvar_range"])
        st.log_w = loglik + mask + latent
        return st

    def _pretrain_step(self, view: CoordinatorView, handle: str, rows: np.ndarray, noise_seed: int,
                       optimizer: torch.optim.Optimizer) -> tuple[float, int]:
        """One stage-1 step: maximise the IWAE bound of the batch; returns (sum of per-sample bounds, count)."""
        p = self.params_
        transport = self.transport
        st = self._forward(view, handle, rows, int(p["importance_samples"]), train=True, noise_seed=noise_seed,
                           new_step=False)
        keep = torch.as_tensor(st.keep)
        n_keep = int(keep.sum())
        if n_keep == 0:
            return 0.0, 0
        bound = log_mean_exp(st.log_w, dim=0)[keep]
        loss = -bound.mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward(retain_graph=True)

        # the parties back-propagate their log-likelihood terms and return the gradient w.r.t. the latents
        transport.new_round()
        requests = {}
        for k in st.decoded:
            tensors = {}
            if k in st.loglik:
                tensors["grad_loglik"] = _grad_or_zeros(st.loglik[k])
            if k in st.mask_loglik:
                tensors["grad_mask_loglik"] = _grad_or_zeros(st.mask_loglik[k])
            requests[k] = Request("decode_grad", tensors)
        replies = transport.call_many(requests, tolerate=True)
        grad_h = torch.zeros_like(st.h)
        for k, r in replies.items():
            if "grad_h" in r.tensors:
                grad_h.index_add_(1, torch.as_tensor(st.held[k]), r.tensors["grad_h"])
            if "grad_h_mis" in r.tensors:
                grad_h.index_add_(1, torch.as_tensor(st.missing[k]), r.tensors["grad_h_mis"])
        st.h.backward(grad_h)

        # the parties back-propagate into their encoders and step their own optimisers
        transport.new_round()
        requests = {}
        for k in set(st.mu) | st.decoded:
            tensors = {}
            if k in st.mu:
                tensors = {"grad_mu": _grad_or_zeros(st.mu[k]), "grad_logvar": _grad_or_zeros(st.logvar[k])}
            requests[k] = Request("update", tensors)
        transport.call_many(requests, tolerate=True)
        optimizer.step()
        return float(bound.detach().sum()), n_keep

    def _label_log_probs(self, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """log p(y|h) for samples ``h`` (S, B, d_h) and labels ``y`` (B,) (regression: standardised targets)."""
        out = self.discriminator_(h)
        if self.index_.task.is_classification:
            logp = torch.log_softmax(out, dim=-1)
            return logp.gather(-1, y.view(1, -1, 1).expand(h.shape[0], -1, 1)).squeeze(-1)
        mean, logvar = out[..., 0], out[..., 1].clamp(*(float(v) for v in self.params_["encoder_logvar_range"]))
        return gaussian_log_prob(y.view(1, -1), mean, logvar)

    # ------------------------------------------------------------------ stages
    def _fit(self, view: CoordinatorView, handle: str, loop: TrainingLoop) -> None:
        if not self.index_.task.is_classification:
            y = view.y[view.labeled].astype(np.float64)
            self.y_mean_, self.y_std_ = float(y.mean()), float(y.std() or 1.0)
        self._build_coordinator()
        t0 = time.perf_counter()
        loop.run(self._pretrain_stage(view, handle))
        t1 = time.perf_counter()
        loop.run(self._train_stage(view, handle))
        self.discriminator_.eval()
        self.stage_seconds_ = {"pretrain": t1 - t0, "train": time.perf_counter() - t1}

    def _epoch_batches(self, stage: str, rows_all: np.ndarray, batch_size: int
                       ) -> Callable[[int, np.random.Generator], Iterator[tuple[np.ndarray, int]]]:
        """Batches of one epoch and their noise seeds: pure functions of (seed, stage, epoch, batch index)."""

        def batches(epoch: int, rng: np.random.Generator) -> Iterator[tuple[np.ndarray, int]]:
            order = numpy_rng(self.seed, stage, epoch).permutation(rows_all)
            for i, start in enumerate(range(0, len(order), batch_size)):
                yield order[start:start + batch_size], derive_seed(self.seed, stage, epoch, i)

        return batches

    def _pretrain_stage(self, view: CoordinatorView, handle: str) -> Stage:
        """Stage 1: IWAE bound over every sample with an observed party, labelled or not (Theta_g, II: psi)."""
        p = self.params_
        optimizer = torch.optim.Adam(
            list(self.global_encoder_.parameters()) + list(self.global_decoder_.parameters()),
            lr=float(p["pretrain_lr"]), weight_decay=float(p["pretrain_weight_decay"]),
        )

        def step(item: tuple[np.ndarray, int], rng: np.random.Generator) -> Metrics:
            self.global_encoder_.train()
            self.global_decoder_.train()
            s, n = self._pretrain_step(view, handle, item[0], item[1], optimizer)
            return {"bound": (s, n), "loss": (-s, n)}

        return Stage("pretrain", int(p["pretrain_epochs"]),
                     self._epoch_batches("pretrain", np.flatnonzero(view.observed.any(axis=1)),
                                         int(p["pretrain_batch_size"])),
                     step, numpy_rng(self.seed, "false-vfl", "pretrain"),
                     state=lambda: {"optimizer": optimizer.state_dict()},
                     load_state=lambda st: optimizer.load_state_dict(st["optimizer"]))

    def _train_stage(self, view: CoordinatorView, handle: str) -> Stage:
        """Stage 2: Theta_g and psi frozen; maximise the label bound L' over labelled samples, phi only."""
        p = self.params_
        optimizer = torch.optim.Adam(self.discriminator_.parameters(), lr=float(p["lr"]),
                                     weight_decay=float(p["weight_decay"]))
        y_all = self._target_tensor(view)

        def step(item: tuple[np.ndarray, int], rng: np.random.Generator) -> Metrics | None:
            rows, noise_seed = item
            self.global_encoder_.eval()
            self.global_decoder_.eval()
            self.discriminator_.train()
            with torch.no_grad():
                st = self._forward(view, handle, rows, int(p["importance_samples"]), train=False, noise_seed=noise_seed,
                                   new_step=False)
            keep = torch.as_tensor(st.keep)
            if not keep.any():
                return None
            log_py = self._label_log_probs(st.h, y_all[torch.as_tensor(rows)])
            bound_y = log_mean_exp(log_py + st.log_w, dim=0)[keep]
            bound_x = log_mean_exp(st.log_w, dim=0)[keep]
            loss = -bound_y.mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            n = int(keep.sum())
            return {"bound": (float(bound_y.detach().sum()), n), "loss": (float((bound_x - bound_y).detach().sum()), n)}

        return Stage("train", int(p["epochs"]),
                     self._epoch_batches("train", np.flatnonzero(view.labeled & view.observed.any(axis=1)),
                                         int(p["batch_size"])),
                     step, numpy_rng(self.seed, "false-vfl", "train"),
                     state=lambda: {"optimizer": optimizer.state_dict()},
                     load_state=lambda st: optimizer.load_state_dict(st["optimizer"]))

    def _target_tensor(self, view: CoordinatorView) -> torch.Tensor:
        if self.index_.task.is_classification:
            return torch.as_tensor(np.where(view.labeled, view.y, 0).astype(np.int64))
        y = np.where(view.labeled, view.y, self.y_mean_).astype(np.float64)
        return torch.as_tensor((y - self.y_mean_) / self.y_std_, dtype=torch.float32)

    # ------------------------------------------------------------------ prediction
    def _predict(self, view: CoordinatorView, handle: str, rows: np.ndarray) -> np.ndarray:
        p = self.params_
        n_samples, bs = int(p["predict_importance_samples"]), int(p["predict_batch_size"])
        classification = self.index_.task.is_classification
        out = []
        self.discriminator_.eval()
        self.global_encoder_.eval()
        self.global_decoder_.eval()
        with torch.no_grad():
            for i, start in enumerate(range(0, len(rows), bs)):
                batch = rows[start:start + bs]
                st = self._forward(view, handle, batch, n_samples, train=False,
                                   noise_seed=derive_seed(self.seed, "predict", i))
                disc = self.discriminator_(st.h)
                keep = st.keep
                if classification:
                    probs = predictive_log_probs(st.log_w, torch.log_softmax(disc, dim=-1)).exp().double().numpy()
                    probs /= probs.sum(axis=1, keepdims=True)
                    probs[~keep] = self.label_prior_
                else:
                    w = snis_weights(st.log_w)
                    probs = ((w * disc[..., 0]).sum(0).double().numpy() * self.y_std_ + self.y_mean_)
                    probs[~keep] = self.label_prior_[0]
                out.append(probs)
        return np.concatenate(out, axis=0)


def _grad_or_zeros(t: torch.Tensor) -> torch.Tensor:
    return t.grad if t.grad is not None else torch.zeros_like(t)


@register_method
class FalseVFL1(_FalseVFL):
    """FALSE-VFL-I: missingness assumed MAR, so the mask model cancels (Appendix A.1)."""

    name = "false-vfl-1"
    variant = 1


@register_method
class FalseVFL2(_FalseVFL):
    """FALSE-VFL-II: a per-party missing-indicator network psi_k models MNAR alignment gaps (Appendix A.2)."""

    name = "false-vfl-2"
    variant = 2
