"""How each X-VFL holder updates its parameters: SGD-type steps, or the PAGE-type estimator (X-VFL Eq. 10)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from partialvfl.nn.optim import make_optimizer

__all__ = ["_Updater"]


class _Updater:
    """One holder's parameters (a party's f_k and XCom_k, or the active party's h) and their update rule.

    ``mode`` of :meth:`step`: ``sgd`` steps on the accumulated gradient; ``page-fresh`` does the same and remembers
    it as g_t; ``page-correct`` uses g_t = g_{t-1} + grad(theta_t) - grad(theta_{t-1}), the second gradient having
    been accumulated in the copy ``prev`` that holds theta_{t-1} (X-VFL Eq. 10).
    """

    def __init__(self, module: nn.Module, optimiser: Any, page: bool) -> None:
        """``optimiser``: its ``name``, ``lr``, ``weight_decay`` and ``momentum`` as typed attributes (a party's
        :class:`~partialvfl.federation.wire.setup_config.OptimiserSetup`, the coordinator's settings group)."""
        self.module = module
        self.optimizer = make_optimizer(module.parameters(), optimiser.name, optimiser.lr, optimiser.weight_decay,
                                        optimiser.momentum)
        self.prev = copy.deepcopy(module) if page else None
        self.g_prev: list[torch.Tensor] | None = None

    def model(self, version: str) -> nn.Module:
        if version == "cur":
            return self.module
        if version == "prev" and self.prev is not None:
            return self.prev
        raise ValueError(f"no parameter version {version!r} (PAGE keeps 'cur' and 'prev')")

    def zero_grad(self) -> None:
        self.module.zero_grad(set_to_none=True)
        if self.prev is not None:
            self.prev.zero_grad(set_to_none=True)

    def step(self, mode: str) -> None:
        params = list(self.module.parameters())
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        if mode == "sgd":
            pass
        elif mode in ("page-fresh", "page-correct"):
            if self.prev is None:
                raise ValueError("a PAGE step on a holder built for plain SGD")
            if mode == "page-correct":
                if self.g_prev is None:
                    raise RuntimeError("the first PAGE step must be a fresh one")
                old = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.prev.parameters()]
                grads = [gp + g - o for gp, g, o in zip(self.g_prev, grads, old)]
            self.g_prev = [g.detach().clone() for g in grads]
            self.prev.load_state_dict(self.module.state_dict())  # theta_t becomes theta_{t-1} of the next step
        else:
            raise ValueError(f"unknown step mode {mode!r}")
        for p, g in zip(params, grads):
            p.grad = g
        self.optimizer.step()
        self.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        """Optimiser state and, for PAGE, theta_{t-1} and g_{t-1} (the module's own weights are saved by its
        holder)."""
        return {"optimizer": self.optimizer.state_dict(),
                "prev": None if self.prev is None else self.prev.state_dict(),
                "g_prev": None if self.g_prev is None else [g.clone() for g in self.g_prev]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        if self.prev is not None and state.get("prev") is not None:
            self.prev.load_state_dict(state["prev"])
        self.g_prev = None if state.get("g_prev") is None else [
            g.to(p.device, copy=True) for g, p in zip(state["g_prev"], self.module.parameters())]
