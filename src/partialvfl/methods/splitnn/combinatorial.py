"""Combinatorial: one independent predictor per non-empty subset of parties (eq. 3 of LASER-VFL).

For each subset S there are representation models f_{k,S} at every party k in S (named ``S<k1>-<k2>...`` at the
parties) and a fusion head g_S at the active party.  Each training step, predictor S learns from the batch's
labelled samples that every party of S observes; at inference a sample is predicted by the predictor of *exactly*
its observed set.  Memory, compute and communication grow as 2^K - 1, so K is capped by ``max_parties``
(default 6: 63 predictors, 192 representation models); raise it explicitly if you really mean it.
"""

from __future__ import annotations

from itertools import combinations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from partialvfl.data.dataset import CoordinatorView
from partialvfl.methods.splitnn import SplitNNMethod
from partialvfl.methods.splitnn.rounds import StepPlan
from partialvfl.methods.splitnn.spec import SPACES
from partialvfl.utils.devices import to_numpy

__all__ = ["Combinatorial", "subset_name"]




def subset_name(subset: tuple[int, ...]) -> str:
    """The model name of a subset's predictor, e.g. ``S0-2`` for parties 0 and 2."""
    return "S" + "-".join(str(k) for k in subset)


class Combinatorial(SplitNNMethod):
    """2^K - 1 independent split networks, the exact-observed-set one used at inference."""

    name = "combinatorial"
    params = SPACES["combinatorial"]

    def _subsets(self) -> list[tuple[int, ...]]:
        k = self.index_.n_parties
        bound = self.settings_.max_parties
        if k > bound:
            raise ValueError(
                f"{self.name}: {k} parties would need {2 ** k - 1} predictors (cost exponential in K); the bound "
                f"is max_parties={bound} ({2 ** bound - 1} predictors). Use another method or raise max_parties."
            )
        return [s for r in range(1, k + 1) for s in combinations(range(k), r)]

    def _model_names(self, party: int) -> list[str]:
        return [subset_name(s) for s in self._subsets() if party in s]

    def _build_heads(self) -> nn.ModuleDict:
        return nn.ModuleDict({subset_name(s): self._make_head(self._fusion_dim(len(s))) for s in self._subsets()})

    def _fused(self, subset: tuple[int, ...], embs: dict[tuple[int, str], torch.Tensor]) -> torch.Tensor:
        parts = [embs[(k, subset_name(subset))] for k in subset]
        if self.settings_.fusion == "concat":
            return torch.cat(parts, dim=1)
        return torch.stack(parts, dim=1).mean(dim=1)

    def _step_plan(self, view: CoordinatorView, rows: np.ndarray, rng: np.random.Generator) -> StepPlan | None:
        """Every subset's predictor on the batch rows that subset observes (``extra``: the subsets and their rows)."""
        obs = view.observed[rows]
        wanted: dict[int, dict[str, np.ndarray]] = {}
        used: list[tuple[tuple[int, ...], np.ndarray]] = []
        for s in self._subsets():
            mask = obs[:, list(s)].all(axis=1)
            if not mask.any():
                continue
            used.append((s, mask))
            for k in s:
                wanted.setdefault(k, {})[subset_name(s)] = rows[mask]
        return StepPlan(rows, obs, wanted, used) if used else None

    def _step_loss(self, view: CoordinatorView, plan: StepPlan, embs: dict[tuple[int, str], torch.Tensor],
                   rng: np.random.Generator) -> torch.Tensor:
        y = self._tensor(view.y[plan.rows], dtype=torch.long)
        loss = torch.zeros((), device=self.torch_device)
        for s, mask in plan.extra:
            loss = loss + F.cross_entropy(self.heads_[subset_name(s)](self._fused(s, embs)),
                                          y[self._tensor(np.flatnonzero(mask))])
        return loss

    def _predict(self, view: CoordinatorView, handle: str, rows: np.ndarray) -> np.ndarray:
        out = np.zeros((len(rows), self.n_classes))
        for chunk_pos in self._chunks(np.arange(len(rows))):
            chunk = rows[chunk_pos]
            obs = view.observed[chunk]
            patterns, group = np.unique(obs, axis=0, return_inverse=True)
            group = np.asarray(group).reshape(-1)
            wanted: dict[int, dict[str, np.ndarray]] = {}
            for g, pat in enumerate(patterns):
                s = tuple(int(k) for k in np.flatnonzero(pat))
                for k in s:
                    wanted.setdefault(k, {})[subset_name(s)] = chunk[group == g]
            self.transport.new_step()
            embs = self._embed(handle, wanted, train=False)
            with torch.no_grad():
                for g, pat in enumerate(patterns):
                    s = tuple(int(k) for k in np.flatnonzero(pat))
                    logits = self.heads_[subset_name(s)](self._fused(s, embs))
                    out[chunk_pos[group == g]] = to_numpy(torch.softmax(logits, dim=1))
        return out
