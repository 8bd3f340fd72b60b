"""Vanilla VFL: the split network of standard VFL (eq. 1 of LASER-VFL; Liu et al., 2022), trained on fully
aligned labelled samples only.

Each party k has a representation model f_k; the active party fuses them (concatenation by default, or LASER's
mean) and predicts with a head g.  Training uses only samples that are labelled *and* observed by every party: no
partially aligned or unlabelled sample ever reaches the supervised loop (SimSiam pretraining, when on, is local to
each party and sends nothing).

At inference a sample may miss parties (option ``missing``):

* ``"zero"`` (default): absent parties' representations are zeros (the FALSE-VFL paper's variant, Appendix D.1);
* ``"random"``: the sample gets a uniformly random class (LASER-VFL's variant: "when it cannot predict, a random
  prediction is made"), drawn from the row's own seed (the model's seed and the row's ID).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from partialvfl.data.dataset import CoordinatorView, VerticalDataset
from partialvfl.methods.splitnn import SplitNNMethod, fuse
from partialvfl.methods.splitnn.rounds import StepPlan
from partialvfl.methods.splitnn.spec import SPACES
from partialvfl.utils.devices import to_numpy

__all__ = ["VanillaVFL"]


class VanillaVFL(SplitNNMethod):
    """Standard split-network VFL on the fully aligned labelled samples."""

    name = "vanilla-vfl"
    params = SPACES["vanilla-vfl"]
    subset_refusal = ("it is trained only on rows every party holds; a row with a party missing gets zero "
                      "representations in its place (missing='zero') or a random class (missing='random'), neither "
                      "a prediction from the parties that are there")

    def _build_heads(self) -> nn.ModuleDict:
        return nn.ModuleDict({"g": self._make_head(self._fusion_dim())})

    def _training_rows(self, view: CoordinatorView) -> np.ndarray:
        return np.flatnonzero(view.labeled & view.observed.all(axis=1))

    def _rows_description(self) -> str:
        return "Vanilla VFL trains on labelled samples observed by every party, and there are none"

    def _step_plan(self, view: CoordinatorView, rows: np.ndarray, rng: np.random.Generator) -> StepPlan:
        return StepPlan(rows, view.observed[rows], {k: {"f": rows} for k in range(view.n_parties)})

    def _step_loss(self, view: CoordinatorView, plan: StepPlan, embs: dict[tuple[int, str], torch.Tensor],
                   rng: np.random.Generator) -> torch.Tensor:
        logits = self.heads_["g"](fuse(self._stack(plan.rows, plan.obs, embs), plan.obs, how=self.settings_.fusion))
        return F.cross_entropy(logits, self._tensor(view.y[plan.rows], dtype=torch.long))

    def fallback(self) -> str:
        """What a row is predicted from when a party does not hold it."""
        if self.settings_.missing == "random":
            return ("a uniformly random class where some party does not hold the row (missing='random'), the "
                    "training label prior where none does")
        return super().fallback()

    def parties_used(self, view: CoordinatorView | VerticalDataset) -> np.ndarray:
        """Every holding party; with ``missing='random'`` none for a row some party lacks (a random class)."""
        used = np.array(view.observed, dtype=bool)
        if self.settings_.missing == "random":
            used &= used.all(axis=1, keepdims=True)
        return used

    def _predict(self, view: CoordinatorView, handle: str, rows: np.ndarray) -> np.ndarray:
        out = np.zeros((len(rows), self.n_classes))
        full = view.observed[rows].all(axis=1)
        if self.settings_.missing == "random":
            guess = self._row_draws(view, rows, "guess", lambda g, n: g.integers(0, self.n_classes, size=n))
            out[np.flatnonzero(~full), guess[~full]] = 1.0
            ask = rows[full]
        else:
            ask = rows
        start = 0
        pos = np.flatnonzero(full) if self.settings_.missing == "random" else np.arange(len(rows))
        for chunk in self._chunks(ask):
            obs = view.observed[chunk]
            self.transport.new_step()
            embs = self._embed_observed(handle, chunk, obs, train=False)
            with torch.no_grad():
                logits = self.heads_["g"](fuse(self._stack(chunk, obs, embs), obs, how=self.settings_.fusion))
            out[pos[start:start + len(chunk)]] = to_numpy(torch.softmax(logits, dim=1))
            start += len(chunk)
        return out
