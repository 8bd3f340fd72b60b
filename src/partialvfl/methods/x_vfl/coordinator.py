"""X-VFL: cross completion (XCom), decision-subspace alignment (DS-Align) and locally independent inference.

After Yao, Xu & Li, "X-VFL: A New Vertical Federated Learning Framework with Cross Completion and Decision Subspace
Alignment" (2025), in the K-party form of its Appendix D.1 (Eqs. 26-31); see ``docs/x-vfl.md`` and
``../shared/spec/x-vfl.md``.

Model.  Party k holds a bottom model f_k (embedding E_k = f_k(x_k), dimension D) and a completer XCom_k that maps an
embedding to party k's own raw feature space.  The active party holds the top model h, applied to one embedding or
to an *average* of embeddings (never a concatenation), which is what lets one party predict alone: h(f_k(x_k)).

Per sample, M is the set of parties whose block is complete (observed, and no feature missing inside it), m = |M|,
E' = sum_{j in M} E_j.  A sample is *aligned* when m = K.

The per-sample loss::

    * aligned:      sum_{i in M} l(h(E_i)) + l(h(E'/m)) + sum_{i=1..K} l(h((Et_i + E_{-i}) / K)),
                    Et_i = f_i(XCom_i(E_{-i} / (K-1))), E_{-i} = sum_{j != i} E_j            (Eqs. 27, 28)
    * non-aligned:  sum_{i in M} l(h(E_i)) + l(h(E'/m)) + l(h((Et' + E') / K)),
                    Et' = sum_{i not in M} f_i(Xt'_i), Xt'_i = XCom_i(E'/m) for a missing block, and
                    Xt'_i = mask_i * x_i + (1 - mask_i) * XCom_i(E'/m) for a block with features missing inside it
                                                                                            (Eqs. 27, 29; Sec. 2.2)
    * DS-Align (aligned samples only):  L1 = sum_i MSE(h(Et_i), h(E_i)),  L2 = sum_i MSE(h(E_i), h(E'/K))  (Eqs. 30, 31)
    * L = L_decision + lambda1 * L1 + lambda2 * L2, averaged over the samples of the batch.

Choices where the paper is silent (all documented in ``docs/x-vfl.md``; the important ones are options):

* XCom is an MLP (tabular) or a transposed-CNN decoder (image pieces) from D to the party's block (``xcom``,
  ``xcom_hidden``); it is trained only through the loss above (the paper has no reconstruction loss).
* DS-Align compares softmax probabilities (``ds_align_space="probs"``; ``"logits"`` is the other choice) and lets
  the gradient flow into both sides (``ds_align_detach=False``).
* The gradient of the loss reaches the parties whose embeddings fed an XCom input (``xcom_input_grad=True``: the
  exact gradient of L, which the paper's convergence analysis is about).
* Aligned samples use the full XCom output (so Et_i differs from E_i and DS-Align 1 is not trivial).
* Samples with no complete block are not trained on; at prediction their partially observed blocks are encoded as
  they are (features missing inside a block are zero, the standardised mean) and treated as complete.
* In locally independent inference a party with features missing inside its block completes them from its own
  embedding: Xt_k = mask * x_k + (1 - mask) * XCom_k(f_k(mask * x_k)) (``local_completion="self"``; ``"none"``
  predicts h(f_k(mask * x_k))).  The paper's Fig. 5b says each client "leverages its XCom module" without saying
  where the XCom input comes from when no other client takes part.
* The top model h is sent to every party once training ends (X-VFL's independent inference needs h at the party),
  with the training label prior; after that, :meth:`XVFL.predict_output_local` sends no message at all.

Party boundary.  Party k's completion runs at party k: it receives an averaged embedding, writes the completion into
its own feature space, re-encodes it with f_k and returns only the embedding; the completed raw-space block never
leaves the party.  Across the wire go row positions, per-row flags, embeddings (E_k, Et_k, the averaged XCom inputs)
and their gradients, and once the top model's weights.

Features missing inside a block (X-VFL's "partial" setting) are a property of the data: build it with
:func:`with_within_block_missing`, which zero-fills the lost features (every method sees the same data) and records
which party holds an incomplete block for which ID; which features are lost is fixed by
:func:`within_block_mask`, seeded per (seed, party, ID), so the party recomputes its own mask locally.

Optimisation.  ``estimator="sgd"``: the optimiser (``optimizer``: Adam or SGD) steps on the stochastic gradient of
a mini-batch (X-VFL's SGD-type algorithm).  ``estimator="page"``: the PAGE-type estimator of X-VFL Eq. (10) (Li et al.,
2021): with probability p a fresh gradient on a batch of size b, otherwise g_t = g_{t-1} + grad_{b'}(theta_t) -
grad_{b'}(theta_{t-1}) on one small batch of size b' evaluated at both parameter vectors; defaults b' = floor(sqrt(b)),
p = b'/(b + b') (the paper's Theorem 2).  Every party keeps its own theta_{t-1} and g_{t-1}; the coin is tossed at
the active party and announced with each step.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from partialvfl.data.dataset import CoordinatorView, VerticalDataset
from partialvfl.data.within_block import (
    INFO_KEY,
    incomplete_matrix,
    setting_of,
    wire_setting,
)
from partialvfl.federation.wire.messages import Request
from partialvfl.federation.wire.setup_config import OptimiserSetup
from partialvfl.methods.base import VFLMethod
from partialvfl.methods.training import Metrics, Stage, TrainingLoop

__all__ = ["XVFL"]
from partialvfl.methods.x_vfl.party import XVFLSetup
from partialvfl.methods.x_vfl.spec import XVFL_PARAMS
from partialvfl.methods.x_vfl.updater import _Updater
from partialvfl.nn.blocks import MLP
from partialvfl.utils.devices import all_finite, scalar, to_numpy
from partialvfl.utils.seeding import numpy_rng, torch_seeded


@dataclass(frozen=True)
class _TrainContext:
    """What one fit's steps share: the sample index, the data handle, the partial setting and the labels."""

    view: CoordinatorView
    handle: str
    incomplete: np.ndarray
    wb: dict[str, Any] | None
    labels: torch.Tensor


class XVFL(VFLMethod):
    """X-VFL at the active party: top model h, the per-sample loss terms, DS-Align, SGD- or PAGE-type training."""

    name = "x-vfl"
    party_program = "x-vfl/party"
    params = XVFL_PARAMS

    # ------------------------------------------------------------------ parameters
    def _batch_size(self) -> int:
        bs = self.settings_.batch_size
        if bs is None:  # the paper: 50 with two parties, 100 with four (and more)
            bs = 50 if self.index_.n_parties <= 2 else 100
            self.params_ = {**self.params_, "batch_size": bs}
        return bs

    def _party_config(self, party: int) -> dict[str, Any]:
        """The party's set-up config, built as its program declares it (:class:`XVFLSetup`: checked here)."""
        s = self.settings_
        return XVFLSetup(feature_dim=int(self.index_.feature_dims[party]),
                         feature_shape=tuple(self.index_.feature_shapes[party]), embed_dim=s.latent_dim,
                         **s._pick("encoder", "encoder_hidden", "resnet_width", "xcom", "xcom_hidden"),
                         optimizer=OptimiserSetup(**s.optim._asdict()), estimator=s.estimator).to_wire()

    @property
    def n_classes(self) -> int:
        """The number of classes of the fitted task."""
        return self.index_.task.n_classes

    def _build_top(self) -> nn.Module:
        with torch_seeded(self.seed, "x-vfl", "top"):
            return self._on_device(MLP(self.settings_.latent_dim, self.settings_.top_hidden, self.n_classes))

    # ------------------------------------------------------------------ fitting
    def _fit(self, view: CoordinatorView, handle: str, loop: TrainingLoop) -> None:
        if not view.task.is_classification:
            raise ValueError(f"{self.name}: only classification tasks are supported (got {view.task.kind})")
        if view.n_parties < 2:
            raise ValueError(f"{self.name}: cross completion needs at least 2 parties, got {view.n_parties}")
        p = self.settings_
        info = self.data_info_
        ctx = _TrainContext(view, handle, incomplete_matrix(view.ids, view.n_parties, info),
                            wire_setting(setting_of(info)), self._tensor(np.asarray(view.y), dtype=torch.long))
        if INFO_KEY in info:  # keep the rate and seed in model.json, not the ID lists
            info[INFO_KEY] = {k: v for k, v in info[INFO_KEY].items() if k != "incomplete_ids"}
        self.top_ = self._build_top()
        self.top_updater_ = _Updater(self.top_, p.optim, page=p.estimator == "page")
        complete = view.observed & ~ctx.incomplete
        usable = view.labeled & complete.any(axis=1)
        if not p.use_unaligned:
            usable &= complete.all(axis=1)
        rows = np.flatnonzero(usable)
        if rows.size == 0:
            raise ValueError(f"{self.name}: no labelled training sample has a complete block")
        loop.run(self._page_stage(ctx, rows) if p.estimator == "page" else self._sgd_stage(ctx, rows))
        self.top_.eval()
        self._share_top()

    def _stage(self, epochs: int, steps_per_epoch: int, items: Any, step: Any) -> Stage:
        """The training stage (the supervised one: its epochs follow the schedule's ``min_steps``)."""
        upd = self.top_updater_
        epochs = self._supervised_epochs("train", epochs, steps_per_epoch)
        return Stage("train", epochs, items, step, numpy_rng(self.seed, "x-vfl", "batches"),
                     state=lambda: {"top_updater": upd.state_dict()},
                     load_state=lambda st: upd.load_state_dict(st["top_updater"]), supervised=True)

    def _sgd_stage(self, ctx: _TrainContext, rows: np.ndarray) -> Stage:
        """X-VFL's SGD-type algorithm: one optimiser step on each mini-batch's stochastic gradient."""
        bs = self._batch_size()

        def batches(epoch: int, rng: np.random.Generator) -> Iterator[np.ndarray]:
            perm = rng.permutation(rows)
            for start in range(0, len(perm), bs):
                yield np.sort(perm[start:start + bs])

        def step(batch: np.ndarray, rng: np.random.Generator) -> Metrics:
            loss = self._pass(ctx, batch, "cur")
            self._step("sgd")
            return {"loss": (loss * len(batch), len(batch))}

        return self._stage(self.settings_.epochs, math.ceil(len(rows) / bs), batches, step)

    def _page_stage(self, ctx: _TrainContext, rows: np.ndarray) -> Stage:
        """X-VFL's PAGE-type algorithm (Eq. 10): a fresh batch with probability p, else a small correction batch."""
        p = self.settings_
        b = min(self._batch_size(), len(rows))
        b_small = p.page_small_batch if p.page_small_batch is not None else max(1, math.isqrt(b))
        b_small = min(b_small, len(rows))
        prob = p.page_prob if p.page_prob is not None else b_small / (b + b_small)
        steps = max(1, math.ceil(len(rows) / b))

        def items(epoch: int, rng: np.random.Generator) -> Iterator[tuple[bool, np.ndarray]]:
            for i in range(steps):
                fresh = (epoch == 0 and i == 0) or rng.random() < prob  # the first step of a fit is always fresh
                yield fresh, np.sort(rng.choice(rows, size=b if fresh else b_small, replace=False))

        def step(item: tuple[bool, np.ndarray], rng: np.random.Generator) -> Metrics:
            fresh, batch = item
            loss = self._pass(ctx, batch, "cur")
            if fresh:
                self._step("page-fresh")
            else:
                self.transport.new_round()
                self._pass(ctx, batch, "prev")
                self._step("page-correct")
            return {"loss": (loss * len(batch), len(batch)), "fresh_steps": (1.0 if fresh else 0.0, 0.0)}

        return self._stage(p.epochs, steps, items, step)

    def _step(self, mode: str) -> None:
        self.transport.new_round()
        self.transport.broadcast(range(self.index_.n_parties), "step", mode=mode)
        self.top_updater_.step(mode)

    def _share_top(self) -> None:
        """Send h (and the label prior) to every party: X-VFL's locally independent inference runs h at the party."""
        tensors = {f"top.{k}": v.detach().clone() for k, v in self.top_.state_dict().items()}
        tensors["label_prior"] = torch.as_tensor(self.label_prior_, dtype=torch.float64)
        self.transport.new_step()
        self.transport.broadcast(range(self.index_.n_parties), "share_top", tensors,
                                 **self.settings_._pick("top_hidden"), n_classes=self.n_classes)

    @staticmethod
    def _place(n: int, idx: np.ndarray, values: torch.Tensor) -> torch.Tensor:
        """A zero ``(n, d)`` tensor with ``values`` at rows ``idx`` (differentiable in ``values``)."""
        return torch.zeros(n, values.shape[1], dtype=values.dtype, device=values.device).index_copy(
            0, torch.as_tensor(idx, device=values.device), values)

    def _embed(self, handle: str, rows: np.ndarray, use: np.ndarray, partial: np.ndarray, train: bool,
               version: str, wb: dict[str, Any] | None) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Round: E_k from every party k for the rows flagged in ``use[:, k]``; returns (B, K, D) and the leaves."""
        n, k_parties = use.shape
        d = self.settings_.latent_dim
        reqs = {}
        for k in range(k_parties):
            sel = use[:, k]
            if sel.any():
                reqs[k] = Request("embed", {"rows": torch.as_tensor(rows[sel]),
                                            "partial": torch.as_tensor(partial[sel, k])},
                                  {"data": handle, "train": train, "version": version, "wb": wb})
        replies = self.transport.call_many(reqs)
        leaves: dict[int, torch.Tensor] = {}
        cols = []
        for k in range(k_parties):
            if k in replies:
                e = replies[k].tensors["emb"]
                if train:
                    e = e.requires_grad_()
                leaves[k] = e
                cols.append(self._place(n, np.flatnonzero(use[:, k]), e))
            else:
                cols.append(torch.zeros(n, d, device=self.torch_device))
        return torch.stack(cols, dim=1), leaves

    def _pass(self, ctx: _TrainContext, rows: np.ndarray, version: str) -> float:
        """One forward/backward pass of the X-VFL objective on ``rows``; gradients accumulate at every holder."""
        view, handle, wb = ctx.view, ctx.handle, ctx.wb
        obs = view.observed[rows]
        inc = ctx.incomplete[rows]
        comp = obs & ~inc
        K = view.n_parties
        E, leaves = self._embed(handle, rows, comp, np.zeros_like(comp), True, version, wb)

        # completion inputs, from their own graph (their gradients come back from the parties)
        cf = self._tensor(comp, dtype=torch.float32)
        aligned = comp.all(axis=1)
        esum_in = (E * cf[..., None]).sum(1)
        m_in = cf.sum(1, keepdim=True)
        plan: dict[int, tuple[np.ndarray, np.ndarray, torch.Tensor]] = {}
        reqs = {}
        al_idx = np.flatnonzero(aligned)
        for k in range(K):
            na_idx = np.flatnonzero(~aligned & ~comp[:, k])
            idx = np.concatenate([al_idx, na_idx])
            if idx.size == 0:
                continue
            inp = torch.cat([(esum_in[al_idx] - E[al_idx, k]) / (K - 1), esum_in[na_idx] / m_in[na_idx]])
            plan[k] = (al_idx, na_idx, inp)
            reqs[k] = Request("complete", {"rows": torch.as_tensor(rows[idx]), "inputs": inp,
                                           "partial": torch.as_tensor(obs[idx, k] & inc[idx, k])},
                              {"data": handle, "train": True, "version": version, "wb": wb,
                               "input_grad": self.settings_.xcom_input_grad})
        self.transport.new_round()
        replies = self.transport.call_many(reqs)
        tilde = {k: rep.tensors["emb_tilde"].requires_grad_() for k, rep in replies.items()}

        top = self.top_updater_.model(version)
        top.train()
        loss = self._objective(top, E, comp, tilde, plan, ctx.labels[self._tensor(rows)])
        if not all_finite(loss):
            raise FloatingPointError(
                f"{self.name}: the training loss is not finite (lr {self.settings_.lr}, optimizer "
                f"{self.settings_.optimizer}, estimator {self.settings_.estimator}); lower the learning rate "
                "(PAGE is meant for plain SGD: optimizer='sgd', momentum=0)"
            )
        # the XCom inputs share E's graph: keep it for their gradients, which arrive after this backward
        loss.backward(retain_graph=self.settings_.xcom_input_grad)

        # gradients back: completions first (they return the gradient of their inputs), then the embeddings
        self.transport.new_round()
        replies = self.transport.call_many({
            k: Request("backward_complete", {"grad": _grad(t)}, {"version": version}) for k, t in tilde.items()
        })
        ins, grads = [], []
        for k, rep in replies.items():
            if "grad_inputs" in rep.tensors:
                ins.append(plan[k][2])
                grads.append(rep.tensors["grad_inputs"])
        if ins:
            torch.autograd.backward(ins, grads)
        self.transport.new_round()
        self.transport.call_many({
            k: Request("backward", {"grad": _grad(e)}, {"version": version}) for k, e in leaves.items()
        })
        return scalar(loss)

    def _objective(self, top: nn.Module, E: torch.Tensor, comp: np.ndarray, tilde: dict[int, torch.Tensor],
                   plan: dict[int, tuple[np.ndarray, np.ndarray, torch.Tensor]], y: torch.Tensor) -> torch.Tensor:
        """L_decision + lambda1 L_DSAlign1 + lambda2 L_DSAlign2 (Eqs. 26-31), averaged over the batch."""
        terms = self.loss_terms(top, E, comp, tilde, plan, y)
        n = E.shape[0]
        p = self.settings_
        return (terms["decision"].sum() + p.lambda1 * terms["ds_align1"].sum()
                + p.lambda2 * terms["ds_align2"].sum()) / n

    def loss_terms(self, top: nn.Module, E: torch.Tensor, comp: np.ndarray, tilde: dict[int, torch.Tensor],
                   plan: dict[int, tuple[np.ndarray, np.ndarray, torch.Tensor]],
                   y: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-sample loss terms of a batch, each ``(B,)``: ``single`` (sum over complete i of l(h(E_i))), ``joint``
        (l(h(E'/m))), ``completed`` (the aligned sum over i, or the non-aligned l(h((Et' + E')/K))), ``decision``
        (their sum), ``ds_align1``, ``ds_align2`` (zero for non-aligned samples).

        ``E`` is (B, K, D) (zero where a block is not complete), ``comp`` (B, K) the complete blocks, ``tilde[k]``
        party k's completed embeddings for the rows ``plan[k] = (aligned_rows, nonaligned_rows, _)`` in that order.
        """
        n, K, _ = E.shape
        C = self.n_classes
        dev = E.device
        cf = torch.as_tensor(comp, dtype=torch.float32, device=dev)
        m = cf.sum(1)
        aligned = comp.all(axis=1)
        esum = (E * cf[..., None]).sum(1)
        logits_single = top(E.reshape(n * K, -1)).reshape(n, K, C)
        ce_single = F.cross_entropy(logits_single.reshape(n * K, C), y.repeat_interleave(K),
                                    reduction="none").reshape(n, K)
        single = (ce_single * cf).sum(1)
        logits_joint = top(esum / m.clamp(min=1)[:, None])
        joint = F.cross_entropy(logits_joint, y, reduction="none")
        completed = torch.zeros(n, device=dev)
        tilde_sum = torch.zeros_like(esum)
        ds1 = torch.zeros(n, device=dev)
        space = self._align_space
        target = (lambda t: t.detach()) if self.settings_.ds_align_detach else (lambda t: t)
        for k, et in tilde.items():
            al_idx, na_idx, _ = plan[k]
            n_al = len(al_idx)
            if n_al:
                ai = torch.as_tensor(al_idx, device=dev)
                et_al = et[:n_al]
                z = (et_al + esum[ai] - E[ai, k]) / K
                completed = completed.index_add(0, ai, F.cross_entropy(top(z), y[ai], reduction="none"))
                d1 = ((space(top(et_al)) - target(space(logits_single[ai, k]))) ** 2).mean(-1)
                ds1 = ds1.index_add(0, ai, d1.float())  # float32 sums, also under bf16 autocast
            if len(na_idx):
                tilde_sum = tilde_sum.index_add(0, torch.as_tensor(na_idx, device=dev), et[n_al:])
        na = np.flatnonzero(~aligned)
        if na.size:
            ni = torch.as_tensor(na, device=dev)
            z = (tilde_sum[ni] + esum[ni]) / K
            completed = completed.index_add(0, ni, F.cross_entropy(top(z), y[ni], reduction="none"))
        ds2 = torch.zeros(n, device=dev)
        if aligned.any():
            ai = torch.as_tensor(np.flatnonzero(aligned), device=dev)
            d2 = ((space(logits_single[ai]) - target(space(logits_joint[ai]))[:, None, :]) ** 2).mean(-1).sum(1)
            ds2 = ds2.index_add(0, ai, d2.float())
        return {"single": single, "joint": joint, "completed": completed, "decision": single + joint + completed,
                "ds_align1": ds1, "ds_align2": ds2}

    @property
    def _align_space(self):  # a tensor map
        if self.settings_.ds_align_space == "probs":
            return lambda t: torch.softmax(t, dim=-1)
        return lambda t: t

    # ------------------------------------------------------------------ collaborative prediction
    def parties_used(self, view: CoordinatorView | VerticalDataset) -> np.ndarray:
        """Every holding party; with ``inference='available'`` a block with features missing inside it is left out
        of a row that has a complete block (as :meth:`_predict` does)."""
        used = np.array(view.observed, dtype=bool)
        if self.settings_.inference == "complete":
            return used
        comp = used & ~incomplete_matrix(np.asarray(view.ids), used.shape[1], view.info)
        return np.where(comp.any(axis=1, keepdims=True), comp, used)

    @torch.no_grad()
    def _predict(self, view: CoordinatorView, handle: str, rows: np.ndarray) -> np.ndarray:
        inc_all = incomplete_matrix(np.asarray(view.ids), view.n_parties, view.info)
        wb = wire_setting(setting_of(view.info))
        K = view.n_parties
        self.top_.eval()
        out = np.zeros((len(rows), self.n_classes))
        bs = self.settings_.predict_batch_size
        for start in range(0, len(rows), bs):
            self.transport.new_step()  # a prediction batch is a step of its own (a second predict is not a replay)
            chunk = rows[start:start + bs]
            obs = view.observed[chunk]
            inc = inc_all[chunk]
            comp = obs & ~inc
            has = comp.any(axis=1)
            anchor = np.where(has[:, None], comp, obs)  # no complete block: use the partial ones as they are
            E, _ = self._embed(handle, chunk, anchor, obs & inc, False, "cur", wb)
            af = self._tensor(anchor, dtype=torch.float32)
            esum = (E * af[..., None]).sum(1)
            ma = af.sum(1, keepdim=True)
            if self.settings_.inference == "complete":
                reqs, idxs = {}, {}
                for k in range(K):
                    idx = np.flatnonzero(~anchor[:, k])
                    if idx.size:
                        idxs[k] = idx
                        reqs[k] = Request("complete", {"rows": torch.as_tensor(chunk[idx]),
                                                       "inputs": esum[idx] / ma[idx],
                                                       "partial": torch.as_tensor(obs[idx, k] & inc[idx, k])},
                                          {"data": handle, "train": False, "wb": wb})
                self.transport.new_round()
                replies = self.transport.call_many(reqs)
                total = esum.clone()
                for k, rep in replies.items():
                    total = total.index_add(0, self._tensor(idxs[k]), rep.tensors["emb_tilde"])
                z = total / K
            else:
                z = esum / ma
            out[start:start + len(chunk)] = to_numpy(torch.softmax(self.top_(z), dim=-1).double())
        return out

    # ------------------------------------------------------------------ locally independent prediction
    def predict_output_local(self, data: VerticalDataset, party: int) -> np.ndarray:
        """Locally independent inference: party ``party`` predicts alone, h(f_k(x_k)), with its own copy of h.

        One request goes to that party (its rows of ``data``, in any deployment) and its probabilities come back;
        no other party takes part.  Returns ``(N, C)``; samples the party does not hold get the training label prior.
        """
        self._check_fitted()
        K = self.index_.n_parties
        if not 0 <= party < K:
            raise ValueError(f"{self.name}: no party {party}; the model has parties 0..{K - 1}")
        with self.attached(data) as (data, handle):  # parties and columns by name, as the model was trained
            rows = np.flatnonzero(data.observed[:, party])
            partial = incomplete_matrix(np.asarray(data.ids), data.n_parties, data.info)[rows, party]
            self.transport.new_step()
            reply = self.transport.call(party, "predict_local", {"rows": torch.as_tensor(rows),
                                                                 "partial": torch.as_tensor(partial)},
                                        data=handle, completion=self.settings_.local_completion,
                                        wb=wire_setting(setting_of(data.info)))
        out = np.tile(np.asarray(self.label_prior_, dtype=np.float64), (data.n_samples, 1))
        out[rows] = to_numpy(reply.tensors["probs"].double())
        return out

    def predict_local(self, data: VerticalDataset, party: int) -> np.ndarray:
        """Class indices predicted by party ``party`` alone."""
        return self.predict_output_local(data, party).argmax(axis=1)

    # ------------------------------------------------------------------ persistence
    def _coordinator_modules(self) -> dict[str, nn.Module]:
        return {"top": self.top_}

    def _build_coordinator(self) -> None:
        self.top_ = self._build_top()


def _grad(t: torch.Tensor) -> torch.Tensor:
    return t.grad if t.grad is not None else torch.zeros_like(t)
