"""What a party enforces on each program request beyond its declaration: gradient bounds, no rewinds, and no
training on rows it was asked only to predict.

Three guards of :class:`~partialvfl.federation.runtime.party.PartyRuntime`, both read from the party's policy
(:class:`~partialvfl.federation.trust.policy.PartyPolicy`) and the program's declarations (never a method's name):

* :func:`clip_gradient_rows`: every request tensor a message declares as ``gradients`` is clipped, row by row, to
  an L2 norm of at most ``max_grad_norm`` (a row's norm over all the tensor's other dimensions); a non-finite
  gradient is refused.  With the learning-rate ceiling this bounds what one step can do to the party's weights,
  whatever scale the coordinator gives its gradients: for SGD a step moves the parameters by at most
  ``lr x (rows in the batch) x max_grad_norm x ||d output / d parameters||`` (Adam's step is about ``lr`` per
  parameter whatever the gradient's scale).  Honest gradients stay far below the default bound (measured per
  method in ``docs/reference.md``), so a fit within the policy computes exactly what it did before.
* :class:`RewindGuard`: the coordinator cannot train the party's program again and again from one saved state
  (save, probe a crafted step, load, probe another...).  Each saved state carries an identifier; loading a state and
  then training from it once more than it was trained from before counts a *rewind*; more than ``max_rewinds``
  rewinds from the same state are refused.  Resuming after a crash is one rewind of the checkpoint it resumes from.
* :class:`InferenceGuard`: rows of a prediction table never reach training.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Any

import torch

from partialvfl.federation.wire.refusals import PolicyViolation
from partialvfl.federation.wire.schema import INFERS, Messages, MessageSpec, kinds_with_role

__all__ = ["InferenceGuard", "RewindGuard", "clip_gradient_rows"]


def _row_norms(t: torch.Tensor, row_dim: int) -> torch.Tensor:
    moved = t.detach().double().movedim(row_dim, 0)
    return moved.reshape(moved.shape[0], -1).norm(dim=1) if moved.ndim > 1 else moved.abs()


def clip_gradient_rows(spec: MessageSpec, tensors: Mapping[str, torch.Tensor], max_norm: float | None,
                       kind: str) -> tuple[dict[str, torch.Tensor], int]:
    """``tensors`` with every declared gradient's rows clipped to norm ``max_norm``; and how many rows were clipped.

    Under a bound, a gradient holding a NaN or an infinity is refused (:class:`PolicyViolation`, rule
    ``max_grad_norm``): it would replace the party's weights by non-numbers.  ``max_norm`` ``None``: nothing checked.
    """
    out = dict(tensors)
    if not spec.gradients or max_norm is None:  # no bound (the research policy): the gradients as they came
        return out, 0
    clipped = 0
    decls = {d.name: d for d in spec.request}
    for name, t in tensors.items():
        row_dim = next((dim for g, dim in spec.gradients if decls[g].match(name) is not None), None)
        if row_dim is None or not t.is_floating_point() or t.numel() == 0:
            continue
        if not bool(torch.isfinite(t).all()):
            raise PolicyViolation("max_grad_norm", f"{kind} gradient {name!r} holds a NaN or an infinity", name)
        norms = _row_norms(t, row_dim)
        over = norms > max_norm
        if not bool(over.any()):
            continue
        clipped += int(over.sum())
        scale = torch.where(over, max_norm / norms, torch.ones_like(norms))
        shape = [1] * t.ndim
        shape[row_dim] = -1
        out[name] = (t.double() * scale.view(shape)).to(t.dtype)
    return out, clipped


class RewindGuard:
    """Which saved states the party's program has trained from, and how often each was rewound to.

    ``state`` identifies the program's current parameters: a fresh one at every ``setup`` and after every training
    request, the saved one after a ``load`` (a state saved again unchanged keeps its identifier, so saving a copy
    does not make a new state).
    """

    def __init__(self) -> None:
        self._instance = secrets.token_hex(6)
        self._clock = 0
        self.state = self._fresh()
        self.saved: set[str] = set()  # states written to a file (only those can be rewound to)
        self.trained_from: set[str] = set()  # saved states some training continued from
        self.rewinds: dict[str, int] = {}  # saved state -> training restarted from it again, so many times
        self.sources: dict[str, str] = {}  # saved state -> the file it was last loaded from (for messages)

    def _fresh(self) -> str:
        self._clock += 1
        return f"{self._instance}:{self._clock}"

    def setup(self) -> None:
        """A new program: fresh parameters."""
        self.state = self._fresh()

    def on_save(self) -> str:
        """The identifier to store with a saved state."""
        self.saved.add(self.state)
        return self.state

    def on_load(self, state: str | None, source: str) -> None:
        """The program now holds the state saved as ``state`` (``None``: a file saved before identifiers existed,
        named by its path)."""
        self.state = state if isinstance(state, str) and state else f"file:{source}"
        self.saved.add(self.state)
        self.sources[self.state] = source

    def training(self, limit: int | None) -> None:
        """A training request was admitted: count a rewind if it continues from a state trained from before."""
        state = self.state
        if state in self.trained_from:
            n = self.rewinds.get(state, 0) + 1
            if limit is not None and n > limit:
                where = self.sources.get(state, "a state saved earlier")
                raise PolicyViolation("max_rewinds", f"training again from the state loaded from {where} would "
                                      f"be rewind {n} to that state (training continued from it before); at most "
                                      f"{limit}", n, {"max_rewinds": n})
            self.rewinds[state] = n
        elif state in self.saved:
            self.trained_from.add(state)
        self.state = self._fresh()


class InferenceGuard:
    """Rows of a prediction table never reach training.

    A request naming a prediction-only data set (``meta['data']``) must be a kind its program declares with the
    role ``infers`` and must not set ``train``; after it, the party accepts only such requests until one names a
    training data set again (so a later training message cannot use what the program computed from those rows).
    """

    def __init__(self) -> None:
        self.tainted_by: str | None = None

    def check(self, messages: Messages | None, kind: str, meta: Mapping[str, Any], prediction_handles: set[str],
              program: str | None = None) -> None:
        """Raise :class:`PolicyViolation` (rule ``prediction_tables``) for a request that could train on them.

        ``messages``: the declarations of the program set up (``None``: none), ``program`` its name (for the text).
        """
        handle = meta.get("data")
        named = handle if isinstance(handle, str) else None
        on_prediction = named is not None and named in prediction_handles
        if not on_prediction and (self.tainted_by is None or named is not None):
            return
        allowed = kinds_with_role(messages or {}, INFERS)
        if kind not in allowed or meta.get("train"):
            source = named if on_prediction else self.tainted_by
            what = f"{kind!r} with train=true" if kind in allowed else f"{kind!r}"
            raise PolicyViolation("prediction_tables", f"{what} after rows of the prediction-only data set "
                                  f"{source!r}: those rows are only predicted, never trained on (inference kinds of "
                                  f"{program!r}: {sorted(allowed)})", kind)

    def accepted(self, meta: Mapping[str, Any], prediction_handles: set[str]) -> None:
        """Record a request that passed: which kind of data set it last named."""
        handle = meta.get("data")
        if isinstance(handle, str):
            self.tainted_by = handle if handle in prediction_handles else None

    def reset(self) -> None:
        """A new program (``setup``) holds nothing computed from earlier rows."""
        self.tainted_by = None
