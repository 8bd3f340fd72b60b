"""LASER-VFL (Valdeira, Wang & Chi, ICLR 2025): shared representation models, mean aggregation, task sampling.

Every party k has one representation model f_k; a fusion model ("head") g maps the *mean* of the representations
of any subset I of observed parties to class scores, so one head serves every subset (eq. 4):
h_{k,I}(x_I) = g_k( (1/|I|) sum_{i in I} f_i(x_i) ).  The per-sample objective (eq. 5) over the observed set O_n is

    L_n = sum_{k in O_n} sum_{I subset O_n, k in I} (1/|I|) * loss(h_{k,I}(x_I), y_n).

Task sampling (eq. 8): each head k in O draws one subset per size i = 1..|O|, uniformly among the subsets of O of
size i that contain k, and weighs its loss by a_i = C(|O| - 1, i - 1) / i, which makes the estimate unbiased
(Lemma 1) at |O|^2 head evaluations instead of |O| * 2^(|O|-1).  For |O| = 4: a = (1, 3/2, 1, 1/4).

Heads (option ``heads``):

* ``"single"`` (default): one fusion model at the active party, the only label holder (the FALSE-VFL paper's
  setting, Appendix D.1).  All g_k are the same g, so the objective becomes the plain sum over all non-empty
  subsets of O_n (each subset is counted |I| times with weight 1/|I|); the estimator is unchanged.
* ``"per-party"``: LASER's original K heads, one owned by each party.  Heads would need labels at every party; here
  only the active party holds labels, so the K heads all sit at the active party (head k is "party k's predictor":
  it is trained and asked only when party k observes the sample).  ``predict_proba`` averages the observing heads'
  probabilities; :func:`client_averaged_accuracy` gives LASER's metric (each observing head's correctness,
  averaged per sample; Appendix D).

Batching (option ``batching``):

* ``"pattern"``: the paper's availability-aware batching.  Training samples are grouped by their observed pattern
  (what block-availability-aware entity alignment yields) and every mini-batch is cut from one group, so the whole
  batch shares one pattern and one draw of subsets per (head, size), exactly Algorithm 1.  Small groups give small
  batches.
* ``"per-sample"``: no such batching.  Batches mix patterns; every sample draws its own subsets from its own
  observed set, with its own weights a_i(|O_n|).  Per sample this is the same unbiased estimator, so the
  mini-batch estimate is unbiased for the mean of eq. 5 over the batch.

Communication (all heads at the active party): one round of representations (each observing party's f_k on its
rows), one round of gradients (the sum over heads of dL/df_k is formed at the active party, which is what LASER's
clients do by summing the derivatives they receive).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from itertools import combinations
from math import comb

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from partialvfl.data.dataset import CoordinatorView, VerticalDataset
from partialvfl.methods.splitnn import SplitNNMethod
from partialvfl.methods.splitnn.rounds import StepPlan
from partialvfl.methods.splitnn.spec import SPACES
from partialvfl.utils.devices import to_device, to_numpy

__all__ = [
    "LaserVFL",
    "client_averaged_accuracy",
    "laser_estimate",
    "laser_objective",
    "laser_weight",
    "sample_task_sets",
]


def laser_weight(k_observed: int, size: int) -> float:
    """a_i = C(K_o - 1, i - 1) / i: weight of a sampled task of size ``size`` when ``k_observed`` blocks are seen."""
    if not 1 <= size <= k_observed:
        raise ValueError(f"a task size must lie in 1..{k_observed}, got {size}")
    return comb(k_observed - 1, size - 1) / size


def sample_task_sets(observed: np.ndarray, rng: np.random.Generator, *, shared: bool = False
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Draw LASER's tasks for a batch: for each head k and size i, a subset of the observed set containing k.

    ``observed`` is ``(B, K)`` boolean.  Returns ``sets`` ``(K, K, B, K)`` boolean (``sets[k, i-1, n]`` is the
    subset for head k, size i, sample n) and ``weights`` ``(K, K, B)`` (a_i(|O_n|), zero where the task does not
    exist: head k not observed or i > |O_n|).  ``shared=True`` draws one subset per (k, i) for the whole batch,
    which requires every row to share one pattern (the paper's batching).
    """
    obs = np.asarray(observed, dtype=bool)
    b, k_parties = obs.shape
    if shared and b and not (obs == obs[0]).all():
        raise ValueError("shared task sampling needs a batch whose samples all share one observed pattern")
    n_obs = obs.sum(axis=1)
    sets = np.zeros((k_parties, k_parties, b, k_parties), dtype=bool)
    weights = np.zeros((k_parties, k_parties, b))
    wtab = np.zeros((k_parties + 1, k_parties + 1))
    for ko in range(1, k_parties + 1):
        for i in range(1, ko + 1):
            wtab[ko, i] = laser_weight(ko, i)
    for k in range(k_parties):
        keys = rng.random((1 if shared else b, k_parties))
        keys = np.broadcast_to(keys, (b, k_parties)).copy()
        keys[~obs] = 2.0          # unobserved parties are never chosen
        keys[:, k] = -1.0         # head k is always in its own subsets
        ranks = np.argsort(np.argsort(keys, axis=1), axis=1)
        for i in range(1, k_parties + 1):
            valid = obs[:, k] & (n_obs >= i)
            sets[k, i - 1] = (ranks < i) & valid[:, None]
            weights[k, i - 1] = np.where(valid, wtab[n_obs, i], 0.0)
    return sets, weights


def _mean_over(sets: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
    m = sets.to(emb.dtype)
    return (m[..., None] * emb).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)[:, None]


def laser_estimate(emb: torch.Tensor, y: torch.Tensor, sets: np.ndarray, weights: np.ndarray,
                   head: Callable[[int], nn.Module]) -> torch.Tensor:
    """Task-sampled loss (eq. 8 summed over heads as in eq. 7), averaged over the batch.

    ``emb`` is ``(B, K, d)`` (rows of unobserved parties are ignored), ``head(k)`` the fusion model of head k.
    Every live task (head k, size i, sample n) is aggregated in one batched pass and each distinct head runs once
    over all its tasks; when the whole batch shares its tasks (the paper's pattern batching) they are aggregated
    once for all rows.
    """
    b = emb.shape[0]
    if b and (sets == sets[:, :, :1]).all() and (weights == weights[:, :, :1]).all():
        return _shared_tasks_loss(emb, y, sets[:, :, 0], weights[:, :, 0], head)
    k_idx, i_idx, n_idx = np.nonzero(weights > 0)  # in (head, size, sample) order
    if k_idx.size == 0:
        return emb.new_zeros(())
    dev = emb.device
    members = to_device(torch.as_tensor(sets, dtype=emb.dtype), dev)  # (K, K, B, K): every task's subset, live or not
    means = torch.einsum("kibj,bjd->kibd", members, emb) / members.sum(-1).clamp(min=1.0).unsqueeze(-1)
    n_t = to_device(torch.as_tensor(n_idx), dev)
    k_t, i_t = (to_device(torch.as_tensor(idx), dev) for idx in (k_idx, i_idx))
    agg = means[k_t, i_t, n_t]  # (L, d): live tasks
    ce = F.cross_entropy(_per_head(agg, k_idx, head), y[n_t], reduction="none")
    return (ce * to_device(torch.as_tensor(weights[k_idx, i_idx, n_idx], dtype=ce.dtype), dev)).sum() / max(b, 1)


def _shared_tasks_loss(emb: torch.Tensor, y: torch.Tensor, sets: np.ndarray, weights: np.ndarray,
                       head: Callable[[int], nn.Module]) -> torch.Tensor:
    """:func:`laser_estimate` when every row has the same tasks: ``sets`` ``(K, K, K)``, ``weights`` ``(K, K)``."""
    b = emb.shape[0]
    k_idx, i_idx = np.nonzero(weights > 0)
    if k_idx.size == 0:
        return emb.new_zeros(())
    members = to_device(torch.as_tensor(sets[k_idx, i_idx], dtype=emb.dtype), emb.device)  # (T, K)
    agg = torch.einsum("tj,bjd->tbd", members / members.sum(1, keepdim=True), emb)  # (T, B, d)
    rows = np.repeat(k_idx, b)  # the head of every (task, row)
    ce = F.cross_entropy(_per_head(agg.reshape(-1, agg.shape[-1]), rows, head), y.repeat(len(k_idx)),
                         reduction="none").view(len(k_idx), b)
    return (ce.sum(1) * to_device(torch.as_tensor(weights[k_idx, i_idx], dtype=ce.dtype), ce.device)).sum() / b


def _per_head(agg: torch.Tensor, heads_of_rows: np.ndarray, head: Callable[[int], nn.Module]) -> torch.Tensor:
    """Class scores of every row of ``agg`` from its head, each distinct head module run once."""
    modules: dict[int, tuple[nn.Module, list[int]]] = {}
    for k in np.unique(heads_of_rows).tolist():
        module = head(k)
        modules.setdefault(id(module), (module, []))[1].append(k)
    if len(modules) == 1:
        return next(iter(modules.values()))[0](agg)
    parts, order = [], []
    for module, ks in modules.values():
        rows = np.flatnonzero(np.isin(heads_of_rows, ks))
        parts.append(module(agg[to_device(torch.as_tensor(rows), agg.device)]))
        order.append(rows)
    return torch.cat(parts)[to_device(torch.as_tensor(np.argsort(np.concatenate(order), kind="stable")), agg.device)]


def laser_objective(emb: torch.Tensor, y: torch.Tensor, observed: np.ndarray,
                    head: Callable[[int], nn.Module]) -> torch.Tensor:
    """The exact objective (eq. 5) by full enumeration of subsets, averaged over the batch (for tests, small K)."""
    obs = np.asarray(observed, dtype=bool)
    b, k_parties = obs.shape
    total = emb.new_zeros(())
    for n in range(b):
        seen = [j for j in range(k_parties) if obs[n, j]]
        for k in seen:
            others = [j for j in seen if j != k]
            for r in range(len(others) + 1):
                for extra in combinations(others, r):
                    members = [k, *extra]
                    agg = emb[n, members].mean(dim=0, keepdim=True)
                    ce = F.cross_entropy(head(k)(agg), y[n:n + 1])
                    total = total + ce / len(members)
    return total / max(b, 1)


class LaserVFL(SplitNNMethod):
    """LASER-VFL: one f_k per party, mean aggregation, task-sampled training, exact-observed-set inference."""

    name = "laser-vfl"
    params = SPACES["laser-vfl"]

    def _build_heads(self) -> nn.ModuleDict:
        d = self.settings_.latent_dim
        if self.settings_.heads == "single":
            return nn.ModuleDict({"g": self._make_head(d)})
        return nn.ModuleDict({f"g{k}": self._make_head(d) for k in range(self.index_.n_parties)})

    def _head(self, k: int) -> nn.Module:
        return self.heads_["g"] if "g" in self.heads_ else self.heads_[f"g{k}"]

    def _steps_per_epoch(self, view: CoordinatorView, rows: np.ndarray) -> int:
        if self.settings_.batching == "per-sample":
            return super()._steps_per_epoch(view, rows)
        _, counts = np.unique(view.observed[rows], axis=0, return_counts=True)
        return int(np.ceil(counts / self.settings_.batch_size).sum())

    def _batches(self, view: CoordinatorView, rows: np.ndarray, rng: np.random.Generator) -> Iterator[np.ndarray]:
        if self.settings_.batching == "per-sample":
            yield from super()._batches(view, rows, rng)
            return
        bs = self.settings_.batch_size
        _, group = np.unique(view.observed[rows], axis=0, return_inverse=True)
        group = np.asarray(group).reshape(-1)
        batches: list[np.ndarray] = []
        for g in range(int(group.max()) + 1 if group.size else 0):
            members = rng.permutation(rows[group == g])
            batches += [np.sort(members[s:s + bs]) for s in range(0, len(members), bs)]
        for i in rng.permutation(len(batches)):
            yield batches[i]

    def _step_plan(self, view: CoordinatorView, rows: np.ndarray, rng: np.random.Generator) -> StepPlan:
        obs = view.observed[rows]
        return StepPlan(rows, obs, {k: {"f": rows[obs[:, k]]} for k in range(view.n_parties) if obs[:, k].any()})

    def _step_loss(self, view: CoordinatorView, plan: StepPlan, embs: dict[tuple[int, str], torch.Tensor],
                   rng: np.random.Generator) -> torch.Tensor:
        emb = self._stack(plan.rows, plan.obs, embs)
        sets, weights = sample_task_sets(plan.obs, rng, shared=self.settings_.batching == "pattern")
        y = self._tensor(view.y[plan.rows], dtype=torch.long)
        return laser_estimate(emb, y, sets, weights, self._head)

    def _head_probabilities(self, cut: np.ndarray, emb: torch.Tensor) -> np.ndarray:
        """Each head's class probabilities ``(B, H, C)`` from the mean of ``emb`` ``(B, K, d)`` over the pattern
        ``cut`` ``(B, K)``; NaN where head k's party is not in the pattern (per-party heads)."""
        n_heads = len(self.heads_)
        out = np.full((len(cut), n_heads, self.n_classes), np.nan)
        with torch.no_grad():
            agg = _mean_over(self._tensor(cut), emb)
            for h in range(n_heads):
                probs = to_numpy(torch.softmax(self._head(h)(agg), dim=1))
                if n_heads > 1:
                    probs = np.where(cut[:, h:h + 1], probs, np.nan)
                out[:, h] = probs
        return out

    def _predict_heads(self, view: CoordinatorView, handle: str, rows: np.ndarray) -> np.ndarray:
        """Each head's class probabilities from the mean over exactly the observed set: ``(len(rows), K|1, C)``."""
        out = np.full((len(rows), len(self.heads_), self.n_classes), np.nan)
        start = 0
        for chunk in self._chunks(rows):
            obs = view.observed[chunk]
            self.transport.new_step()
            embs = self._embed_observed(handle, chunk, obs, train=False)
            out[start:start + len(chunk)] = self._head_probabilities(obs, self._stack(chunk, obs, embs))
            start += len(chunk)
        return out

    def _predict(self, view: CoordinatorView, handle: str, rows: np.ndarray) -> np.ndarray:
        per_head = self._predict_heads(view, handle, rows)
        return np.nanmean(per_head, axis=1)

    def _coalition_predictions(self, view: CoordinatorView, handle: str, masks: np.ndarray, wanted: np.ndarray
                               ) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """Each party's representation once per row, then every coalition's mean and heads (no query per
        coalition)."""
        for m, chunk, want, cut, emb in self._cut_embeddings(view, handle, masks, wanted):
            yield m, chunk[want], np.nanmean(self._head_probabilities(cut, emb)[want], axis=1)

    def predict_heads(self, data: VerticalDataset) -> np.ndarray:
        """``(N, H, C)`` probabilities of each head (H = 1 or K); NaN where head k's party does not observe."""
        with self.attached(data) as (data, handle):  # parties and columns by name, as the model was trained
            view = data.coordinator_view()
            out = np.full((view.n_samples, len(self.heads_), self.n_classes), np.nan)
            rows = np.flatnonzero(view.observed.any(axis=1))
            if rows.size:
                out[rows] = self._predict_heads(view, handle, rows)
            return out


def client_averaged_accuracy(model: LaserVFL, data: VerticalDataset) -> float:
    """LASER-VFL's metric (Appendix D): per sample, the fraction of observing heads that are right, averaged over
    the labelled samples with at least one observed block (with a single head this is the plain accuracy)."""
    per_head = model.predict_heads(data)
    keep = data.labeled & data.observed.any(axis=1)
    if not keep.any():
        return float("nan")
    ph = per_head[keep]
    pred = np.where(np.isnan(ph).any(axis=2), -1, np.nan_to_num(ph, nan=-1.0).argmax(axis=2))
    seen = ~np.isnan(ph).any(axis=2)
    right = (pred == data.y[keep][:, None]) & seen
    return float((right.sum(axis=1) / seen.sum(axis=1)).mean())
