"""Ensemble: one local predictor per party, majority vote of the observing parties (LASER-VFL's baseline).

Party k's predictor is g_k(f_k(x_k)).  LASER-VFL trains each at its own client with labels every client holds;
here only the active party holds labels, so f_k stays at party k and its head g_k stays at the active party: each
step party k sends the representations of the labelled rows it observes, the active party computes g_k's loss and
sends back the gradient, and no label ever leaves the active party.  The K predictors are independent (each sees
only its own party's block).  At inference every observing party's predictor votes; the majority wins and ties are
broken uniformly at random (:func:`majority_vote`).

``predict_proba`` returns the vote shares, with the tie-broken winner nudged up by 1e-6 so that ``argmax`` is the
vote's winner.  Each row's tie-break is drawn from its own seed (the model's seed and the row's ID), so a row's
answer does not depend on the other rows of its request.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from partialvfl.data.dataset import CoordinatorView
from partialvfl.methods.splitnn import SplitNNMethod
from partialvfl.methods.splitnn.rounds import StepPlan
from partialvfl.methods.splitnn.spec import SPACES
from partialvfl.utils.devices import to_numpy

__all__ = ["Ensemble", "majority_vote"]


def majority_vote(votes: np.ndarray, tie_break: np.random.Generator | np.ndarray) -> np.ndarray:
    """Winner per row of a ``(N, C)`` vote-count matrix; ties broken uniformly at random: by a generator, or by
    ``(N, C)`` uniform noise drawn beforehand (e.g. each row's from its own seed)."""
    votes = np.asarray(votes)
    top = votes == votes.max(axis=1, keepdims=True)
    noise = tie_break.random(votes.shape) if isinstance(tie_break, np.random.Generator) else np.asarray(tie_break)
    return np.where(top, noise, -1.0).argmax(axis=1)


class Ensemble(SplitNNMethod):
    """Per-party local predictors (heads at the active party), majority vote with seeded random tie-break."""

    name = "ensemble"
    params = SPACES["ensemble"]

    def _build_heads(self) -> nn.ModuleDict:
        d = self.settings_.latent_dim
        return nn.ModuleDict({f"g{k}": self._make_head(d) for k in range(self.index_.n_parties)})

    def _step_plan(self, view: CoordinatorView, rows: np.ndarray, rng: np.random.Generator) -> StepPlan:
        obs = view.observed[rows]
        return StepPlan(rows, obs, {k: {"f": rows[obs[:, k]]} for k in range(obs.shape[1]) if obs[:, k].any()})

    def _step_loss(self, view: CoordinatorView, plan: StepPlan, embs: dict[tuple[int, str], torch.Tensor],
                   rng: np.random.Generator) -> torch.Tensor:
        y = self._tensor(view.y[plan.rows], dtype=torch.long)
        loss = torch.zeros((), device=self.torch_device)
        for (k, _), e in embs.items():
            loss = loss + F.cross_entropy(self.heads_[f"g{k}"](e), y[self._tensor(np.flatnonzero(plan.obs[:, k]))])
        return loss

    def _votes(self, view: CoordinatorView, handle: str, rows: np.ndarray) -> np.ndarray:
        votes = np.zeros((len(rows), self.n_classes))
        start = 0
        for chunk in self._chunks(rows):
            obs = view.observed[chunk]
            self.transport.new_step()
            embs = self._embed_observed(handle, chunk, obs, train=False)
            for (k, _), e in embs.items():
                with torch.no_grad():
                    pred = to_numpy(self.heads_[f"g{k}"](e).argmax(dim=1))
                where = start + np.flatnonzero(obs[:, k])
                np.add.at(votes, (where, pred), 1.0)
            start += len(chunk)
        return votes

    def _predict(self, view: CoordinatorView, handle: str, rows: np.ndarray) -> np.ndarray:
        votes = self._votes(view, handle, rows)
        winner = majority_vote(votes, self._row_draws(view, rows, "tie-break",
                                                      lambda g, n: g.random((n, self.n_classes))))
        out = votes / np.maximum(votes.sum(axis=1, keepdims=True), 1.0)
        out[np.arange(len(rows)), winner] += 1e-6
        return out / out.sum(axis=1, keepdims=True)
