"""Feature reconstruction by a curious coordinator, from what a party released about its rows.

* **known-row regression**: the coordinator knows ``n_known`` of a party's rows (e.g. its own customers' data at
  another institution) and regresses the features on what it received for each row (embeddings, posterior
  parameters), ridge with a penalty chosen by leave-one-out on the known rows, applied to every other row;
* **the decode oracle** (FALSE-VFL): the coordinator sends the same ``S`` latents for every row in a ``decode``
  (mean 0, scale 1, the same noise position): each row's log-likelihoods are then an affine function of its raw row
  (the decoder variance is shared by all rows), and ``n_known`` rows let it fit the inverse.

Reconstructions are scored by :func:`relative_rmse`: per feature, the RMSE over the rows the attacker did not know,
in units of that feature's standard deviation (1.0: guessing the mean; features held constant are left out).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from partialvfl.federation.runtime.coordinator import Federation
from partialvfl.federation.wire.messages import Request
from partialvfl.federation.wire.refusals import PolicyViolation
from partialvfl.privacy.recording import Recorder
from partialvfl.utils.seeding import numpy_rng

__all__ = ["ALPHAS", "decode_oracle", "direct_release_attack", "known_row_attack", "relative_rmse",
           "released_per_row", "ridge"]

ALPHAS = (1e-3, 1e-2, 0.1, 1.0, 10.0, 100.0)


def relative_rmse(x: np.ndarray, x_hat: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
    """Per-feature RMSE of ``x_hat`` over ``rows`` (default all), in units of each feature's standard deviation."""
    rows = np.arange(len(x)) if rows is None else rows
    std = x.std(axis=0)
    keep = std > 1e-12
    err = np.sqrt(np.mean((x_hat[rows] - x[rows]) ** 2, axis=0))
    return err[keep] / std[keep]


def ridge(features: np.ndarray, targets: np.ndarray, known: np.ndarray, alphas: Sequence[float] = ALPHAS
          ) -> np.ndarray:
    """Ridge regression of ``targets`` on ``features`` fitted on rows ``known`` (standardised inputs, intercept),
    predicted for every row; the penalty is the one with the smallest leave-one-out error on the known rows (what an
    attacker can choose without knowing any other row)."""
    mu, sd = features[known].mean(0), features[known].std(0) + 1e-9
    z = (features - mu) / sd
    y_mu = targets[known].mean(0)
    yk = targets[known] - y_mu
    scale = targets[known].std(0) + 1e-9
    kernel = z[known] @ z[known].T
    best, best_err = None, np.inf
    for alpha in alphas:
        inv = np.linalg.inv(kernel + alpha * np.eye(len(known)))
        hat = kernel @ inv
        loo = (yk - hat @ yk) / np.maximum(1.0 - np.diag(hat) - 1.0 / len(known), 1e-6)[:, None]
        err = float(np.mean((loo / scale) ** 2))
        if err < best_err:
            best, best_err = inv @ yk, err
    return y_mu + (z @ z[known].T) @ best


def _rows_of(kind: str, tensor: str, request: dict[str, np.ndarray]) -> np.ndarray | None:
    """The request rows a reply tensor is about (``emb:<m>``: ``rows:<m>``; posterior parameters: ``rows`` of an
    ``encode``, else the ``next_rows`` riding with the request)."""
    if tensor.startswith("emb:"):
        return request.get("rows:" + tensor.removeprefix("emb:"))
    if tensor in ("emb", "mu", "logvar", "z"):
        return request.get("rows") if "rows" in request else request.get("next_rows")
    return None


def released_per_row(recorder: Recorder, party: int, tensors: Iterable[str], handle: str | None = "train"
                     ) -> dict[int, list[np.ndarray]]:
    """Shared-order row of the data set attached as ``handle`` (``None``: any; positions of different data sets
    coincide) -> what ``party`` released about it in the replies named ``tensors`` (side by side within one reply),
    in order."""
    wanted = tuple(tensors)
    out: dict[int, list[np.ndarray]] = {}
    for req, rep in recorder.exchanges(party):
        if handle is not None and req.meta.get("data") != handle:
            continue
        parts: dict[int, list[np.ndarray]] = {}
        for name in wanted:
            if name not in rep.tensors:
                continue
            rows = _rows_of(req.kind, name, req.tensors)
            t = rep.tensors[name]
            if rows is None or len(rows) != len(t):
                continue
            for r, v in zip(rows.tolist(), t.reshape(len(t), -1)):
                parts.setdefault(r, []).append(v)
        for r, vs in parts.items():
            out.setdefault(r, []).append(np.concatenate(vs))
    return out


def known_row_attack(released: dict[int, list[np.ndarray]], x_by_row: dict[int, np.ndarray], n_known: int, *,
                     window: int = 1, seed: int = 0) -> dict[str, Any]:
    """Regress the features of ``x_by_row`` (shared-order row -> its true features) on the mean of each row's last
    ``window`` releases, knowing ``n_known`` rows drawn with ``seed``; returns the median and best relative RMSE over
    the features (rows the attacker did not know)."""
    rows = np.array(sorted(r for r in released if r in x_by_row), dtype=np.int64)
    if len(rows) <= n_known + 1:
        raise ValueError(f"known-row regression needs more than {n_known + 1} released rows, got {len(rows)}")
    feats = np.stack([np.mean(released[r][-window:], axis=0) for r in rows.tolist()])
    x = np.stack([x_by_row[r] for r in rows.tolist()]).astype(np.float64)
    known = np.sort(numpy_rng(seed, "known rows").choice(len(rows), size=n_known, replace=False))
    err = relative_rmse(x, ridge(feats, x, known), np.setdiff1d(np.arange(len(rows)), known))
    return {"median_rmse_std": float(np.median(err)), "min_rmse_std": float(err.min()), "n_rows": int(len(rows)),
            "n_known": int(n_known), "window": int(window)}


def decode_oracle(federation: Federation, party: int, handle: str, rows: np.ndarray, *, samples: int = 8,
                  repeats: int = 1, noise_seed: int = 0) -> tuple[np.ndarray, int]:
    """What a coordinator gets from FALSE-VFL's ``decode`` (lean wire) when it sends every row the same ``samples``
    latents: the mean over up to ``repeats`` calls of each row's log-likelihoods ``(len(rows), samples)``, and how
    many calls the party answered (it refuses once its privacy budget is spent)."""
    t = federation.transport
    rows_t = torch.as_tensor(np.asarray(rows, dtype=np.int64))
    total, answered = None, 0
    d_h = federation.runtimes[party].program.config.d_h  # type: ignore[attr-defined]
    for _ in range(repeats):
        try:
            t.new_step()
            t.call_many({party: Request("encode", {"rows": rows_t}, {"data": handle, "train": False})})
            t.new_round()
            zeros = torch.zeros(len(rows), d_h)
            req = Request("decode", {"mean": zeros, "scale": torch.ones(len(rows), d_h),
                                     "pos": torch.zeros(len(rows), dtype=torch.int64)},
                          {"train": False, "noise_seed": int(noise_seed), "batch": 1, "samples": int(samples)})
            ll = t.call_many({party: req})[party].tensors["loglik"].double().numpy().T
        except PolicyViolation:
            break
        total = ll if total is None else total + ll
        answered += 1
    if total is None:
        raise PolicyViolation("dp_epsilon", f"party {party} answered no decode: its privacy budget is spent")
    return total / answered, answered


def direct_release_attack(x: np.ndarray, epsilon: float, delta: float, n_known: int, *, quantile: float = 50.0,
                          seed: int = 0) -> float:
    """The strongest thing a party's budget lets out about a row: the row itself (standardised, clipped to the
    ``quantile`` of the row norms) in one Gaussian mechanism spending the whole ``(epsilon, delta)``, then known-row
    regression with ``n_known`` rows; the median relative RMSE over features.  No method releases this much: it is
    what the guarantee alone permits."""
    from partialvfl.federation.dp.gaussian import budget_mu

    x = np.asarray(x, dtype=np.float64)
    z = (x - x.mean(0)) / (x.std(0) + 1e-12)
    norms = np.linalg.norm(z, axis=1)
    clip = float(np.percentile(norms, quantile))
    rng = np.random.default_rng(seed)
    released = z * np.minimum(1.0, clip / np.maximum(norms, 1e-12))[:, None]
    released = released + rng.normal(size=z.shape) * 2.0 * clip / budget_mu(epsilon, delta)
    known = np.sort(rng.choice(len(x), n_known, replace=False))
    return float(np.median(relative_rmse(x, ridge(released, x, known), np.setdiff1d(np.arange(len(x)), known))))
