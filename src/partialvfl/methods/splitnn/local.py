"""Local: the active party's own model on its own block (eq. 2 of LASER-VFL, for the single label holder).

In LASER-VFL every client holds labels and trains its own h_k = g_k(f_k(x_k)).  Here only the active party holds
labels, so Local is the active party alone: f and g both live there, it trains on the labelled samples it
observes, and nothing crosses a boundary.  Samples the active party does not observe cannot be predicted from its
block; they get the labelled-training class prior (the most frequent class wins), the same no-information
fallback the contract uses for samples nobody observes.  (The per-party local models that would need labels at
passive parties are what ``ensemble`` trains, with the heads kept at the active party.)
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from partialvfl.data.dataset import CoordinatorView, VerticalDataset
from partialvfl.methods.splitnn import SplitNNMethod
from partialvfl.methods.splitnn.rounds import StepPlan
from partialvfl.methods.splitnn.spec import SPACES
from partialvfl.utils.devices import to_numpy

__all__ = ["Local"]


class Local(SplitNNMethod):
    """The active party's own predictor; other samples fall back to the label prior."""

    name = "local"
    params = SPACES["local"]
    label_exposure = "nothing"  # the passive parties are sent nothing

    def _model_names(self, party: int) -> list[str]:
        return ["f"] if party == self.index_.active_party else []

    def _build_heads(self) -> nn.ModuleDict:
        return nn.ModuleDict({"g": self._make_head(self.settings_.latent_dim)})

    def _training_rows(self, view: CoordinatorView) -> np.ndarray:
        return np.flatnonzero(view.labeled & view.observed[:, view.active_party])

    def _rows_description(self) -> str:
        return "Local trains on labelled samples the active party observes, and there are none"

    def _step_plan(self, view: CoordinatorView, rows: np.ndarray, rng: np.random.Generator) -> StepPlan:
        return StepPlan(rows, view.observed[rows], {view.active_party: {"f": rows}})

    def _step_loss(self, view: CoordinatorView, plan: StepPlan, embs: dict[tuple[int, str], torch.Tensor],
                   rng: np.random.Generator) -> torch.Tensor:
        return F.cross_entropy(self.heads_["g"](embs[(view.active_party, "f")]),
                               self._tensor(view.y[plan.rows], dtype=torch.long))

    def parties_used(self, view: CoordinatorView | VerticalDataset) -> np.ndarray:
        """Only the active party's block, for the rows it holds; the others use no party (the label prior)."""
        used = np.zeros_like(np.asarray(view.observed, dtype=bool))
        used[:, view.active_party] = np.asarray(view.observed, dtype=bool)[:, view.active_party]
        return used

    def fallback(self) -> str:
        """What a row is predicted from when the label holder does not hold it."""
        return "the training label prior (local predicts from the active party alone, which does not hold them)"

    def _predict(self, view: CoordinatorView, handle: str, rows: np.ndarray) -> np.ndarray:
        a = view.active_party
        out = np.tile(self.label_prior_, (len(rows), 1)).astype(np.float64)
        seen = np.flatnonzero(view.observed[rows, a])
        for chunk in self._chunks(seen):
            self.transport.new_step()
            embs = self._embed(handle, {a: {"f": rows[chunk]}}, train=False)
            with torch.no_grad():
                out[chunk] = to_numpy(torch.softmax(self.heads_["g"](embs[(a, "f")]), dim=1))
        return out
