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
* prediction is self-normalised importance sampling with ``L`` samples whose weights exclude the label; each row's
  samples are drawn from its own seed (the model's seed and the row's ID, :mod:`.rowwise`), so a row's prediction
  does not depend on the other rows of its batch.

Per mini-batch the coordinator runs these rounds through the transport (see ``docs/false-vfl.md``): ``encode``
(rows -> mu, logvar), ``decode`` (h [, h_mis] -> loglik [, mask_loglik]), and when training ``decode_grad``
(grad_loglik [, grad_mask_loglik] -> grad_h [, grad_h_mis]) and ``update`` (grad_mu, grad_logvar).  The
gradients the parties receive are exactly those of the centralised bound (tested).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import numpy as np
import torch

from partialvfl.data.dataset import CoordinatorView, VerticalDataset
from partialvfl.methods.base import VFLMethod
from partialvfl.methods.false_vfl.adaptive import Estimate, MixtureSamples, Proposal, fit_proposal, round_seeds
from partialvfl.methods.false_vfl.formulas import effective_sample_size, predictive_log_probs, predictive_mean
from partialvfl.methods.false_vfl.party import FalseVFLParty, FalseVFLSetup
from partialvfl.methods.false_vfl.rounds import Pass, Rounds
from partialvfl.methods.false_vfl.spec import PARAMS
from partialvfl.methods.training import Metrics, Stage, TrainingLoop
from partialvfl.nn.blocks import MLP, RowBlocks
from partialvfl.nn.optim import make_optimizer
from partialvfl.nn.stats import gaussian_log_prob, log_mean_exp
from partialvfl.utils.devices import scalar, to_device, to_numpy
from partialvfl.utils.seeding import derive_seed, numpy_rng, torch_seeded
from partialvfl.utils.threads import mlp_flops

__all__ = ["FalseVFL1", "FalseVFL2"]


class _FalseVFL(VFLMethod):
    """FALSE-VFL coordinator (the active party's label side); subclasses fix the variant (1: MAR, 2: MNAR)."""

    party_program: ClassVar[str] = FalseVFLParty.program_name
    variant: ClassVar[int] = 1
    params: ClassVar = PARAMS
    label_exposure = "labelled rows"  # the parties' gradients are those of the label-free bound (docs/privacy.md)
    #: each row's effective sample size of its importance weights (:meth:`importance_ess`)
    prediction_diagnostics: ClassVar[tuple[str, ...]] = ("importance_ess",)

    @classmethod
    def estimated_step_flops(cls, params: dict[str, Any], feature_shapes: list[tuple[int, ...]]) -> float | None:
        """FLOPs of one stage-1 step (forward and backward, every row held by every party: an upper bound), or
        ``None`` for convolutional party modules (for the thread policy, :mod:`partialvfl.utils.threads`)."""
        p = cls.settings_of(params)
        d_h, d_z, s, b = p.d_h, p.d_z, p.importance_samples, p.pretrain_batch_size
        total = 0.0
        for shape in feature_shapes:
            if {p.encoder, p.decoder} - {"mlp", "auto"} or (len(shape) != 1 and "auto" in (p.encoder, p.decoder)):
                return None
            d = math.prod(shape)
            total += mlp_flops([d, *p.encoder_hidden, 2 * d_h], b)
            total += mlp_flops([d_h, *p.decoder_hidden, d], s * b)
            if cls.variant == 2:
                total += mlp_flops([d, *p.mask_hidden, 1], s * b + b)
        total += mlp_flops([d_h, *p.global_hidden, 2 * d_z], s * b) + mlp_flops([d_z, *p.global_hidden, 2 * d_h], s * b)
        return 3.0 * total

    # ------------------------------------------------------------------ differential privacy (variant I)
    def _privacy_charges(self, party: int, purpose: str) -> int:
        """Per row: stage 1, its posterior, log-likelihoods, their latent gradients and a DP-SGD update per epoch;
        stage 2, posterior and log-likelihoods per epoch (labelled rows); each prediction, its posterior and one set
        of log-likelihoods per estimator round."""
        p = self.settings_
        predictions = (1 + self._prediction_rounds()) * int(self.dp_options["predictions"])
        return (4 * p.pretrain_epochs + 2 * p.epochs if purpose == "fit" else 0) + predictions

    def _privacy_clips(self, party: int) -> dict[str, float]:
        """Clip norms of the released tensors, about the size of their values on standardised features."""
        p = self.settings_
        d = float(self.index_.feature_dims[party])
        root = math.sqrt(p.d_h)
        return {"mu": root, "logvar": 2.0 * root, "loglik": 2.0 * d * math.sqrt(p.importance_samples),
                "grad_mean": root / p.pretrain_batch_size, "grad_scale": root / p.pretrain_batch_size,
                "grad_h": root / p.pretrain_batch_size}

    def _party_config(self, party: int) -> dict[str, Any]:
        """The party's set-up config, built as its program declares it (:class:`FalseVFLSetup`: checked here)."""
        s = self.settings_
        return FalseVFLSetup(
            feature_dim=int(self.index_.feature_dims[party]), feature_shape=tuple(self.index_.feature_shapes[party]),
            variant=self.variant, **s._pick("d_h", "encoder", "decoder", "encoder_hidden", "decoder_hidden",
                                            "mask_hidden", "resnet_width", "pretrain_lr", "pretrain_weight_decay",
                                            "encoder_logvar_range", "decoder_logvar_range", "wire", "wire_dtype"),
            latent_scale_floor=s.latent_scale_floor if s.wire == "bound" else 0.0).to_wire()

    def _plan(self, federation: Any) -> None:
        """``wire = auto``: lean if every party releases likelihoods at latents the coordinator chooses (as its
        ``hello`` says: ``[policy] allow_likelihood_release``, the research policy), else bound, whose floor on the
        posterior scale is the largest the parties ask for (``[policy] min_latent_scale``)."""
        params = dict(self.params_)
        announced = federation.announced_policies()
        if params["wire"] == "auto":
            free = all(a.get("allow_likelihood_release", True) for a in announced)
            params["wire"] = "lean" if free else "bound"
        if params["wire"] == "bound":
            floors = [float(a.get("min_latent_scale") or 0.0) for a in announced]
            params["latent_scale_floor"] = max([float(params["latent_scale_floor"]), *floors])
        self.params_ = params

    # ------------------------------------------------------------------ coordinator modules
    def _build_coordinator(self) -> None:
        p = self.settings_
        out = self.index_.task.n_classes if self.index_.task.is_classification else 2
        with torch_seeded(self.seed, "false-vfl", "coordinator"):
            self.global_encoder_ = self._on_device(MLP(p.d_h, p.global_hidden, 2 * p.d_z))
            self.global_decoder_ = self._on_device(MLP(p.d_z, p.global_hidden, 2 * p.d_h))
            self.discriminator_ = self._on_device(MLP(p.d_h, p.discriminator_hidden, out))
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
        """Seeded normal noise (drawn on the CPU: the same numbers on every device) on the coordinator's device."""
        return to_device(torch.randn(shape, generator=gen), self.torch_device)

    def draw_noise(self, gen: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
        """The coordinator's reparameterisation noise (:class:`~.rounds.LatentSide`)."""
        return self._draw(gen, shape)

    def latent_modules(self) -> tuple[torch.nn.Module, torch.nn.Module]:
        """The global encoder and decoder of the latent chain (:class:`~.rounds.LatentSide`)."""
        return self.global_encoder_, self.global_decoder_

    def _new_rounds(self) -> Rounds:
        """Fresh rounds (no prefetch) over this model's transport: one per stage and per prediction pass."""
        self._rounds = Rounds(self.transport, self.settings_, self.variant, self)
        return self._rounds

    def _forward(self, view: CoordinatorView, handle: str, rows: np.ndarray, n_samples: int, *, train: bool,
                 noise_seed: int, new_step: bool = True, next_rows: np.ndarray | None = None,
                 row_seeds: np.ndarray | None = None) -> Pass:
        """Rounds ``encode`` and ``decode`` for one batch; returns the (S, B) importance log-weights (label-free).

        ``new_step=False`` when the caller (the training loop) has started the transport step already;
        ``next_rows`` (nothing trained): the next batch, whose encode rides with this batch's ``decode``;
        ``row_seeds`` (prediction): each row's own noise seed, in place of the batch's ``noise_seed``.
        """
        if new_step:
            self.transport.new_step()
        rounds = getattr(self, "_rounds", None) or self._new_rounds()
        return rounds.forward(view, handle, rows, n_samples, train=train, noise_seed=noise_seed,
                              next_rows=None if train else next_rows, row_seeds=row_seeds)

    def _pretrain_step(self, view: CoordinatorView, handle: str, rows: np.ndarray, noise_seed: int,
                       optimizer: torch.optim.Optimizer, next_rows: np.ndarray | None = None) -> tuple[float, int]:
        """One stage-1 step: maximise the IWAE bound of the batch; returns (sum of per-sample bounds, count).

        ``next_rows``: the next batch, whose encode rides with this step's ``update``.
        """
        st = self._forward(view, handle, rows, self.settings_.importance_samples, train=True,
                           noise_seed=noise_seed, new_step=False)
        n_keep = int(st.keep.sum())
        if n_keep == 0:
            return 0.0, 0
        bound = log_mean_exp(st.log_w, dim=0)[self._tensor(np.flatnonzero(st.keep))]
        optimizer.zero_grad(set_to_none=True)
        self._rounds.backward(view, st, -bound.mean(), handle, next_rows)
        optimizer.step()
        return scalar(bound.detach().sum()), n_keep

    def _label_log_probs(self, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """log p(y|h) for samples ``h`` (S, B, d_h) and labels ``y`` (B,) (regression: standardised targets)."""
        out = self.discriminator_(h)
        if self.index_.task.is_classification:
            logp = torch.log_softmax(out, dim=-1)
            return logp.gather(-1, y.view(1, -1, 1).expand(h.shape[0], -1, 1)).squeeze(-1)
        mean, logvar = out[..., 0], out[..., 1].clamp(*self.settings_.encoder_logvar_range)
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

    def _epoch_batches(self, stage: str, rows_all: np.ndarray, batch_size: int, epochs: int
                       ) -> Callable[[int, np.random.Generator], Iterator[tuple[np.ndarray, int, np.ndarray | None]]]:
        """Batches of one epoch, their noise seeds and the batch after each (``None`` after the stage's last):
        pure functions of (seed, stage, epoch, batch index)."""

        def order(epoch: int) -> np.ndarray:
            return numpy_rng(self.seed, stage, epoch).permutation(rows_all)

        def batches(epoch: int, rng: np.random.Generator) -> Iterator[tuple[np.ndarray, int, np.ndarray | None]]:
            rows = order(epoch)
            for i, start in enumerate(range(0, len(rows), batch_size)):
                end = start + batch_size
                following = (rows[end:end + batch_size] if end < len(rows)
                             else order(epoch + 1)[:batch_size] if epoch + 1 < epochs else None)
                yield rows[start:end], derive_seed(self.seed, stage, epoch, i), following

        return batches

    def _pretrain_stage(self, view: CoordinatorView, handle: str) -> Stage:
        """Stage 1: IWAE bound over every sample with an observed party, labelled or not (Theta_g, II: psi)."""
        p = self.settings_
        optimizer = make_optimizer(
            list(self.global_encoder_.parameters()) + list(self.global_decoder_.parameters()), "adam",
            p.pretrain_lr, p.pretrain_weight_decay)
        self._new_rounds()

        def step(item: tuple[np.ndarray, int, np.ndarray | None], rng: np.random.Generator) -> Metrics:
            self.global_encoder_.train()
            self.global_decoder_.train()
            s, n = self._pretrain_step(view, handle, item[0], item[1], optimizer, next_rows=item[2])
            return {"bound": (s, n), "loss": (-s, n)}

        return Stage("pretrain", p.pretrain_epochs,
                     self._epoch_batches("pretrain", np.flatnonzero(view.observed.any(axis=1)),
                                         p.pretrain_batch_size, p.pretrain_epochs),
                     step, numpy_rng(self.seed, "false-vfl", "pretrain"),
                     state=lambda: {"optimizer": optimizer.state_dict()},
                     load_state=lambda st: optimizer.load_state_dict(st["optimizer"]))

    def _train_stage(self, view: CoordinatorView, handle: str) -> Stage:
        """Stage 2: Theta_g and psi frozen; maximise the label bound L' over labelled samples, phi only."""
        p = self.settings_
        optimizer = make_optimizer(self.discriminator_.parameters(), "adam", p.lr, p.weight_decay)
        y_all = self._target_tensor(view)
        self._new_rounds()
        rows = np.flatnonzero(view.labeled & view.observed.any(axis=1))
        epochs = self._supervised_epochs("train", p.epochs, math.ceil(len(rows) / p.batch_size))

        def step(item: tuple[np.ndarray, int, np.ndarray | None], rng: np.random.Generator) -> Metrics | None:
            rows, noise_seed, following = item
            self.global_encoder_.eval()
            self.global_decoder_.eval()
            self.discriminator_.train()
            with torch.no_grad():
                st = self._forward(view, handle, rows, p.importance_samples, train=False, noise_seed=noise_seed,
                                   new_step=False, next_rows=following)
            if not st.keep.any():
                return None
            keep = self._tensor(np.flatnonzero(st.keep))
            log_py = self._label_log_probs(st.h, y_all[self._tensor(rows)])
            bound_y = log_mean_exp(log_py + st.log_w, dim=0)[keep]
            bound_x = log_mean_exp(st.log_w, dim=0)[keep]
            loss = -bound_y.mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            n = int(st.keep.sum())
            return {"bound": (scalar(bound_y.detach().sum()), n),
                    "loss": (scalar((bound_x - bound_y).detach().sum()), n)}

        return Stage("train", epochs, self._epoch_batches("train", rows, p.batch_size, epochs),
                     step, numpy_rng(self.seed, "false-vfl", "train"),
                     state=lambda: {"optimizer": optimizer.state_dict()},
                     load_state=lambda st: optimizer.load_state_dict(st["optimizer"]),
                     supervised=True, parties_train=False)

    def _target_tensor(self, view: CoordinatorView) -> torch.Tensor:
        if self.index_.task.is_classification:
            return self._tensor(np.where(view.labeled, view.y, 0).astype(np.int64))
        y = np.where(view.labeled, view.y, self.y_mean_).astype(np.float64)
        return self._tensor((y - self.y_mean_) / self.y_std_, dtype=torch.float32)

    # ------------------------------------------------------------------ prediction
    def _prediction_rounds(self) -> int:
        """``decode`` rounds per prediction batch: ``predict_rounds`` for the adaptive estimator, 1 for the paper's."""
        p = self.settings_
        return p.predict_rounds if p.predict_estimator == "adaptive" else 1

    def _predictive_batches(self, view: CoordinatorView, handle: str, rows: np.ndarray) -> Iterator[Estimate]:
        """The prediction's importance samples, one batch at a time (:class:`Estimate`).

        Each row's samples come from its own seed (:meth:`_row_seeds`: the model's seed and the row's ID), so batches
        may be cut anywhere; while a fit validates, from the batch's seed as in training.  The adaptive estimator
        adds ``predict_rounds - 1`` rounds of samples from proposals fitted to each row (:mod:`.adaptive`)."""
        p = self.settings_
        n_samples, bs, n_rounds = p.predict_importance_samples, p.predict_batch_size, self._prediction_rounds()
        secret = self._label_side_digest()  # the seeds cross to the parties, which know the model's seed
        self.discriminator_.eval()
        self.global_encoder_.eval()
        self.global_decoder_.eval()
        self._new_rounds()
        with torch.no_grad():
            for i, start in enumerate(range(0, len(rows), bs)):
                batch = rows[start:start + bs]
                following = rows[start + bs:start + 2 * bs]
                noise_seed = derive_seed(self.seed, "predict", i)
                seeds = self._row_seeds(view, batch, "false-vfl", "predict", secret=secret)
                st = self._forward(view, handle, batch, n_samples, train=False, noise_seed=noise_seed,
                                   next_rows=following if n_rounds == 1 else None, row_seeds=seeds)
                if n_rounds == 1:
                    yield Estimate(st.keep, st.h, st.log_w)
                else:
                    yield self._adaptive_estimate(view, handle, st, n_rounds, noise_seed, seeds, following)

    def _adaptive_estimate(self, view: CoordinatorView, handle: str, first: Pass, n_rounds: int, noise_seed: int,
                           seeds: np.ndarray | None, following: np.ndarray) -> Estimate:
        """Adaptive multiple importance sampling of one batch (:mod:`.adaptive`): ``first`` is round 0 (the paper's
        draw from q(h|x_obs)); each further round draws from a Gaussian fitted to each row's weighted samples so far,
        and every sample is weighed against the mixture of the row's proposals."""
        p = self.settings_
        rounds = self._rounds
        samples = MixtureSamples(rounds.wire_dtype)
        samples.add(Proposal(first.mean_leaf, first.logvar_leaf, first.h.shape[0]), first.h)
        passes = [first]
        base_scale = torch.exp(0.5 * first.logvar_leaf)
        floor = p.latent_scale_floor if p.wire == "bound" else 0.0
        for t in range(1, n_rounds):
            log_w = samples.log_weights([rounds.target_terms(q) for q in passes])
            mean, logvar = fit_proposal(samples.h, log_w, base_scale, min_scale=floor,
                                        logvar_range=p.encoder_logvar_range)
            proposal = Proposal(mean, logvar, p.predict_importance_samples)
            passes.append(rounds.refine(view, handle, first, proposal, noise_seed=derive_seed(noise_seed, "amis", t),
                                        row_seeds=None if seeds is None else round_seeds(seeds, t),
                                        next_rows=following if t == n_rounds - 1 else None))
            samples.add(proposal, passes[-1].h)
        rounds.common_parties(passes)  # a party lost in some round loses its terms in every round
        return Estimate(first.keep, samples.h, samples.log_weights([rounds.target_terms(q) for q in passes]))

    def _predict(self, view: CoordinatorView, handle: str, rows: np.ndarray,
                 diagnostics: dict[str, np.ndarray] | None = None) -> np.ndarray:
        classification = self.index_.task.is_classification
        # a fit's validation with the paper's estimator sums as it always did (see _row_seeds)
        rowwise = not self._validating or self._prediction_rounds() > 1
        discriminator = self.discriminator_ if self._validating else RowBlocks(self.discriminator_)
        out, ess = [], []
        for est in self._predictive_batches(view, handle, rows):
            keep = est.keep
            disc = discriminator(est.h)
            if classification:
                log_probs = predictive_log_probs(est.log_w, torch.log_softmax(disc, dim=-1), rowwise=rowwise)
                probs = to_numpy(log_probs.exp().double())
                probs /= probs.sum(axis=1, keepdims=True)
                probs[~keep] = self.label_prior_
            else:
                mean = predictive_mean(est.log_w, disc[..., 0], rowwise=rowwise)
                probs = to_numpy(mean.double()) * self.y_std_ + self.y_mean_
                probs[~keep] = self.label_prior_[0]
            out.append(probs)
            if diagnostics is not None:
                part = to_numpy(effective_sample_size(est.log_w))
                part[~keep] = np.nan
                ess.append(part)
        if diagnostics is not None:
            diagnostics["importance_ess"] = np.concatenate(ess) if ess else np.zeros(0)
        return np.concatenate(out, axis=0)

    def importance_ess(self, data: VerticalDataset) -> np.ndarray:
        """Effective sample size ``(sum w)^2 / sum w^2`` of each row's prediction importance weights (of every
        sample the estimator drew: ``L`` for the paper's, ``predict_rounds x L`` for the adaptive one).

        A diagnostic of the self-normalised importance sampling that prediction uses (1 = one sample carries all the
        weight); NaN for rows that hold no party (predicted by the label prior alone).  :meth:`predict_output` with
        ``diagnostics`` gives the same alongside the prediction.
        """
        diagnostics: dict[str, np.ndarray] = {}
        self.predict_output(data, diagnostics=diagnostics)
        return diagnostics["importance_ess"]


class FalseVFL1(_FalseVFL):
    """FALSE-VFL-I: missingness assumed MAR, so the mask model cancels (Appendix A.1)."""

    name = "false-vfl-1"
    variant = 1


class FalseVFL2(_FalseVFL):
    """FALSE-VFL-II: a per-party missing-indicator network psi_k models MNAR alignment gaps (Appendix A.2)."""

    name = "false-vfl-2"
    variant = 2
