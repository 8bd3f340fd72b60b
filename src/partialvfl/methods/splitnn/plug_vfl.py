"""PlugVFL (Sun et al., 2024) as extended by LASER-VFL and run by the FALSE-VFL paper.

A split network with concatenation fusion at the active party.  Absent parties' representations are zeros, in
training and at inference; during training each *passive* party is additionally dropped with probability
``p_drop`` (0.5, the FALSE-VFL paper's value; LASER-VFL's released scripts leave it at 0) - the active party (the
fusion-model holder) is never dropped.  The original's label-protection objective is not used.

``dropout_unit``: ``"batch"`` (default; PlugVFL's party-wise dropout, one draw per passive party per step) or
``"sample"`` (one draw per passive party per sample).  A dropped party is not asked for its representations, so
dropout also saves communication.  Training uses every labelled sample with at least one observed party; samples
left with no party after dropout are skipped for that step.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from partialvfl.data.dataset import CoordinatorView
from partialvfl.methods.splitnn import SplitNNMethod, fuse
from partialvfl.methods.splitnn.rounds import StepPlan
from partialvfl.methods.splitnn.spec import SPACES
from partialvfl.utils.devices import to_numpy

__all__ = ["PlugVFL", "plug_dropout"]


def plug_dropout(observed: np.ndarray, active: int, p_drop: float, rng: np.random.Generator,
                 unit: str = "batch") -> np.ndarray:
    """The observed mask after party-wise dropout: each passive party dropped with probability ``p_drop``.

    ``observed`` is ``(B, K)``; the active party's column is returned unchanged.
    """
    if not 0.0 <= p_drop <= 1.0:
        raise ValueError(f"p_drop must be a probability, got {p_drop}")
    obs = np.asarray(observed, dtype=bool)
    b, k = obs.shape
    if unit == "batch":
        keep = np.broadcast_to(rng.random(k) >= p_drop, (b, k)).copy()
    elif unit == "sample":
        keep = rng.random((b, k)) >= p_drop
    else:
        raise ValueError(f"dropout_unit must be 'batch' or 'sample', got {unit!r}")
    keep[:, active] = True
    return obs & keep


class PlugVFL(SplitNNMethod):
    """Concatenation fusion, zero representations for absent parties, passive-party dropout in training."""

    name = "plug-vfl"
    params = SPACES["plug-vfl"]

    def _build_heads(self) -> nn.ModuleDict:
        return nn.ModuleDict({"g": self._make_head(self._fusion_dim())})

    def _step_plan(self, view: CoordinatorView, rows: np.ndarray, rng: np.random.Generator) -> StepPlan | None:
        """The batch's dropout draw (the only draw of a step) and the parties it keeps."""
        obs = plug_dropout(view.observed[rows], view.active_party, self.settings_.p_drop, rng,
                           self.settings_.dropout_unit)
        keep = obs.any(axis=1)
        rows, obs = rows[keep], obs[keep]
        if rows.size == 0:
            return None
        return StepPlan(rows, obs, {k: {"f": rows[obs[:, k]]} for k in range(obs.shape[1]) if obs[:, k].any()})

    def _step_loss(self, view: CoordinatorView, plan: StepPlan, embs: dict[tuple[int, str], torch.Tensor],
                   rng: np.random.Generator) -> torch.Tensor:
        logits = self.heads_["g"](fuse(self._stack(plan.rows, plan.obs, embs), plan.obs, how=self.settings_.fusion))
        return F.cross_entropy(logits, self._tensor(view.y[plan.rows], dtype=torch.long))

    def _coalition_predictions(self, view: CoordinatorView, handle: str, masks: np.ndarray, wanted: np.ndarray
                               ) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """Each party's representation once per row; every coalition is the head on them with zeros outside it."""
        for m, chunk, want, cut, emb in self._cut_embeddings(view, handle, masks, wanted):
            with torch.no_grad():
                logits = self.heads_["g"](fuse(emb, cut, how=self.settings_.fusion))
            yield m, chunk[want], to_numpy(torch.softmax(logits, dim=1))[want]

    def _predict(self, view: CoordinatorView, handle: str, rows: np.ndarray) -> np.ndarray:
        out = np.zeros((len(rows), self.n_classes))
        start = 0
        for chunk in self._chunks(rows):
            obs = view.observed[chunk]
            self.transport.new_step()
            embs = self._embed_observed(handle, chunk, obs, train=False)
            with torch.no_grad():
                logits = self.heads_["g"](fuse(self._stack(chunk, obs, embs), obs, how=self.settings_.fusion))
            out[start:start + len(chunk)] = to_numpy(torch.softmax(logits, dim=1))
            start += len(chunk)
        return out
