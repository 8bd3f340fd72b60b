"""Raw-data extraction by a coordinator: the attacks of issue 13, run against a real party process.

A coordinator with an allowlisted certificate can ask a party to build a party program of its choosing and to
embed every row the party holds.  If the party builds its weights from the coordinator's seed, a one-layer linear
encoder as wide as the party's feature count, learning rate 0, gives the coordinator ``W x + b`` with ``W`` and
``b`` known: every row comes back.  The attacks here, each against one party:

* ``seed``: the attack above (widths ``width`` x the feature count); if the party refuses, the strongest setup it
  accepts (fewest hidden layers, widest output, smallest learning rate), then the coordinator rebuilds the network
  from its seed and inverts it by optimisation;
* ``probes``: several setups (seeds) embedding the same rows, inverted jointly;
* ``known-rows``: the coordinator knows ``n_known`` rows and regresses features on embeddings (ridge), several
  probes' embeddings side by side;
* ``freeze``: learning rate 0 (or the party's floor) and zero gradients for a few steps before embedding, then as
  ``seed``.

Every reconstruction is scored by :func:`relative_rmse`: per feature, the RMSE over the rows the attacker did not
know, divided by that feature's standard deviation (1.0 is what guessing the mean achieves; features the party
holds constant are left out).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from partialvfl.federation.grpc.federation import GrpcFederation
from partialvfl.federation.grpc.transport import PartyError
from partialvfl.methods.splitnn.party import SplitSetup, build_party_model
from partialvfl.privacy.reconstruction import relative_rmse, ridge
from partialvfl.utils.seeding import numpy_rng

__all__ = ["ATTACKS", "AttackOutcome", "Extractor", "describe_config", "relative_rmse", "ridge"]

PROGRAM = "splitnn/party"
MODEL = "f"


@dataclass
class AttackOutcome:
    """One attack's result: the setups the party refused (rule and value), what it accepted, the error.

    ``rmse_std``: the reconstruction error per feature (``metric`` "rmse/std"); an attack that measures something
    else (how far one step moved the party's embeddings, how many rewinds it got) gives its one value and names it
    in ``metric``.
    """

    attack: str
    refusals: list[str]
    accepted: str
    rmse_std: np.ndarray
    metric: str = "rmse/std"

    @property
    def median(self) -> float:
        """The median RMSE / standard deviation over the attacked columns."""
        return float(np.median(self.rmse_std))

    def row(self) -> dict[str, Any]:
        """The outcome as one row of the attack report."""
        return {"attack": self.attack, "metric": self.metric, "median_rmse_std": self.median,
                "min_rmse_std": float(self.rmse_std.min()), "accepted": self.accepted,
                "refused": "; ".join(self.refusals)}


def _config(d: int, hidden: Sequence[int], latent: int, lr: float) -> dict[str, Any]:
    return {"feature_dim": d, "feature_shape": [d], "models": [MODEL], "latent_dim": int(latent), "encoder": "mlp",
            "encoder_hidden": [int(h) for h in hidden], "resnet_width": 64,
            "optimizer": {"name": "sgd", "lr": float(lr), "weight_decay": 0.0, "momentum": 0.0}}


def describe_config(cfg: dict[str, Any]) -> str:
    """A short description of an attack configuration's encoder and learning rate."""
    return (f"mlp hidden {cfg['encoder_hidden']} -> {cfg['latent_dim']}, lr {cfg['optimizer']['lr']:g}")


class Extractor:
    """An attacking coordinator against party ``party`` of a federation (it holds the federation's certificate).

    ``ids``: the users the attacker knows, in the order it wants the party's rows in (the evaluator passes the
    table's IDs so that a reconstruction lines up with the true rows).  Under keyless alignment the party's tokens
    arrive sorted, not in table order; the attacker looks its IDs up (one lookup per ID, which the keyed parties log
    and cap with ``max_lookups``).  Without ``ids`` the rows come in the order of the party's tokens."""

    def __init__(self, federation_file: Any, party: int, ids: Sequence[Any] | None = None) -> None:
        self.fed = GrpcFederation.from_config(federation_file)
        self.party = party
        self.d = int(self.fed.party_info[party]["feature_dim"])
        hashes = self.fed.party_hashes()[party] if ids is None else self.fed.id_tokens(ids)
        assert hashes is not None
        self.n = len(hashes)
        self._call("attach", {"hashes": torch.from_numpy(hashes.copy()), "rows": torch.arange(self.n)},
                   handle="probe", n_samples=self.n)

    def close(self) -> None:
        """Close the attacker's connection to the federation."""
        self.fed.close()

    def _call(self, kind: str, tensors: dict[str, torch.Tensor] | None = None, **meta: Any) -> Any:
        self.fed.transport.new_step()
        return self.fed.call(self.party, kind, tensors, **meta)

    def setup_first(self, candidates: Sequence[dict[str, Any]], seed: int,
                    program: str = PROGRAM) -> tuple[dict[str, Any], list[str]]:
        """Set up the first candidate config the party accepts; returns it and the refusals before it."""
        refusals = []
        for cfg in candidates:
            try:
                self._call("setup", program=program, config=cfg, seed=int(seed))
                return cfg, refusals
            except PartyError as e:
                refusals.append(e.details.split(": ", 1)[-1])
        raise RuntimeError(f"the party refused every setup: {refusals}")

    def announced(self) -> dict[str, Any]:
        """What the party's ``hello`` said of its policy."""
        return dict(self.fed.party_info[self.party].get("policy") or {})

    def embed(self, train: bool = False) -> np.ndarray:
        """The party's embeddings of all its rows, as the attacking coordinator receives them."""
        reply = self._call("embed", {f"rows:{MODEL}": torch.arange(self.n)}, data="probe", train=train)
        return reply.tensors[f"emb:{MODEL}"].detach().double().numpy()

    def zero_gradient_steps(self, steps: int, latent: int) -> None:
        """``steps`` training forwards answered with zero gradients (the party's weights stay where they are)."""
        for _ in range(steps):
            self.embed(train=True)
            self.fed.transport.new_round()
            self.fed.call(self.party, "grad_embedding", {f"grad:{MODEL}": torch.zeros(self.n, latent)})

    def set_lr(self, lr: float) -> str | None:
        """Try to set the learning rate; the party's refusal, if any."""
        try:
            self._call("set_lr", lr=float(lr))
        except PartyError as e:
            return e.details.split(": ", 1)[-1]
        return None

    def candidates(self, width: int, min_hidden: int = 0) -> list[dict[str, Any]]:
        """From the strongest setup for the attacker to weaker ones the party may accept: linear first, then one
        wide hidden layer (invertible when the weights are known); the widest output first; learning rate 0 first."""
        d = self.d
        out = []
        for hidden in ([], [4 * d])[min_hidden:]:
            for latent in sorted({d * width, *(k * d for k in (8, 4, 2, 1) if k <= width)}, reverse=True):
                for lr in (0.0, 1e-6, 1e-3):
                    out.append(_config(d, hidden, latent, lr))
        return out


def rebuild(cfg: dict[str, Any], seed: int, party: int) -> torch.nn.Module:
    """The party's network as the coordinator believes it was built (from the coordinator's seed)."""
    return build_party_model(SplitSetup.read(cfg), seed, party, MODEL).double().eval()


def invert(nets: Sequence[torch.nn.Module], embeddings: Sequence[np.ndarray], d: int, iters: int = 100) -> np.ndarray:
    """The inputs that best explain ``embeddings`` under ``nets`` (jointly): exact for a linear map, by L-BFGS
    otherwise."""
    n = len(embeddings[0])
    if all(len(list(net.children())) <= 1 for net in nets):  # linear maps: least squares
        w = np.concatenate([net[0].weight.detach().numpy() for net in nets])  # type: ignore[index]
        b = np.concatenate([net[0].bias.detach().numpy() for net in nets])  # type: ignore[index]
        e = np.concatenate(embeddings, axis=1)
        return np.linalg.lstsq(w, (e - b).T, rcond=None)[0].T
    x = torch.zeros(n, d, dtype=torch.float64, requires_grad=True)
    targets = [torch.as_tensor(e) for e in embeddings]
    opt = torch.optim.LBFGS([x], lr=1.0, max_iter=iters, line_search_fn="strong_wolfe")

    def loss() -> torch.Tensor:
        opt.zero_grad()
        value = sum(((net(x) - t) ** 2).sum() for net, t in zip(nets, targets))
        value.backward()  # type: ignore[union-attr]
        return value  # type: ignore[return-value]

    opt.step(loss)
    return x.detach().numpy()


# ---------------------------------------------------------------------- the attacks
def attack_seed(ex: Extractor, x: np.ndarray, *, width: int = 1, min_hidden: int = 0, seed: int = 1234,
                **_: Any) -> AttackOutcome:
    cfg, refused = ex.setup_first(ex.candidates(width, min_hidden), seed)
    x_hat = invert([rebuild(cfg, seed, ex.party)], [ex.embed()], ex.d)
    name = f"seed, width {width}d" + (", one hidden layer" if min_hidden else "")
    return AttackOutcome(name, refused, describe_config(cfg), relative_rmse(x, x_hat))


def _probe(ex: Extractor, width: int, probes: int, seed: int
           ) -> tuple[list[dict[str, Any]], list[np.ndarray], list[str]]:
    """``probes`` setups (seeds ``seed``, ``seed + 1``, ...) each embedding every row: the accepted configurations,
    the embeddings, and the first setup's refusals."""
    if probes < 1:
        raise ValueError(f"an attack needs at least one probe, got {probes}")
    cfgs, embs, refused = [], [], []
    for p in range(probes):
        cfg, r = ex.setup_first(ex.candidates(width), seed + p)
        refused += r if p == 0 else []
        cfgs.append(cfg)
        embs.append(ex.embed())
    return cfgs, embs, refused


def attack_probes(ex: Extractor, x: np.ndarray, *, width: int = 1, probes: int = 4, seed: int = 1234,
                  **_: Any) -> AttackOutcome:
    cfgs, embs, refused = _probe(ex, width, probes, seed)
    x_hat = invert([rebuild(c, seed + p, ex.party) for p, c in enumerate(cfgs)], embs, ex.d)
    cfg = cfgs[-1]
    return AttackOutcome(f"{probes} probes, width {width}d", refused, describe_config(cfg), relative_rmse(x, x_hat))


def attack_known_rows(ex: Extractor, x: np.ndarray, *, width: int = 1, n_known: int = 0, probes: int = 1,
                      seed: int = 1234, **_: Any) -> AttackOutcome:
    n_known = n_known or ex.d + 1
    known = np.sort(numpy_rng(seed, "known rows").choice(len(x), size=n_known, replace=False))
    cfgs, embs, refused = _probe(ex, width, probes, seed)
    cfg = cfgs[-1]
    x_hat = ridge(np.concatenate(embs, axis=1), x, known)
    unknown = np.setdiff1d(np.arange(len(x)), known)
    name = f"{n_known} known rows" + (f", {probes} probes" if probes > 1 else "") + f", width {width}d"
    return AttackOutcome(name, refused, describe_config(cfg), relative_rmse(x, x_hat, unknown))


def attack_freeze(ex: Extractor, x: np.ndarray, *, width: int = 1, steps: int = 3, seed: int = 1234,
                  **_: Any) -> AttackOutcome:
    cfg, refused = ex.setup_first(ex.candidates(width), seed)
    why = ex.set_lr(0.0)
    refused += [why] if why else []
    ex.zero_gradient_steps(steps, cfg["latent_dim"])
    x_hat = invert([rebuild(cfg, seed, ex.party)], [ex.embed()], ex.d)
    return AttackOutcome(f"lr 0 + {steps} zero-gradient steps", refused, describe_config(cfg), relative_rmse(x, x_hat))


ATTACKS = {"seed": attack_seed, "probes": attack_probes, "known-rows": attack_known_rows, "freeze": attack_freeze}
