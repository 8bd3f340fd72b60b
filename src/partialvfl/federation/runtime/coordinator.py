"""The coordinator's handle on the federation: who the parties are, how to reach them, which data they hold.

Methods' coordinator code (the active party's label-side role) receives a :class:`Federation`; it never sees a
party's features.  :class:`LocalFederation` runs every party in this process (research, tests, benchmarks); the gRPC
deployment provides another subclass whose ``attach`` asks each party process to load the rows it holds.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from partialvfl.data.dataset import VerticalDataset
from partialvfl.federation.runtime.party import PartyRuntime
from partialvfl.federation.trust.policy import PartyPolicy
from partialvfl.federation.wire.messages import MessageLog, Reply, Request
from partialvfl.federation.wire.transport import LocalTransport, PartiesRefused, Transport

__all__ = ["ExplanationRefused", "Federation", "LocalFederation", "SetupRefused"]


class Federation(ABC):
    """K parties reached through one :class:`Transport`, driven by the coordinator (the active party)."""

    def __init__(self, transport: Transport, party_names: Sequence[str], active_party: int) -> None:
        self.transport = transport
        self.party_names = tuple(party_names)
        self.active_party = active_party
        self._handles = itertools.count()
        self.privacy_setups: dict[int, dict[str, Any]] = {}  # what parties with a budget said at the last setup
        # what a fit in progress tells every setup about its labels (``{"fit": True, "label_dp": EPS}``, set by the
        # fit's orchestration; ``None``: a setup that does not say it trains, e.g. to predict): a party whose policy
        # requires label protection ([policy] require_label_dp) refuses a fit without it
        self.fit_labels: dict[str, Any] | None = None

    @property
    def n_parties(self) -> int:
        """The number of parties."""
        return len(self.party_names)

    @property
    def log(self) -> MessageLog:
        """The log of every message that crossed the transport."""
        return self.transport.log

    @abstractmethod
    def attach(self, data: VerticalDataset, handle: str | None = None) -> str:
        """Make each party hold its own view of ``data`` under a handle; return the handle."""

    @abstractmethod
    def release(self, handle: str) -> None:
        """Let the parties drop the data attached under ``handle``."""

    def new_handle(self, prefix: str = "data") -> str:
        """A fresh handle to attach data under."""
        return f"{prefix}-{next(self._handles)}"

    def setup(self, program: str, configs: Sequence[dict[str, Any]], seed: int,
              plans: Mapping[int, dict[str, Any]] | None = None) -> None:
        """Build the party program ``program`` at every party, each with its own config (and, for a party that keeps
        a differential-privacy budget, the method's privacy plan ``plans[k]``).

        Every party is asked, whatever the others answer: if any refuses (its policy, most often), one
        :class:`SetupRefused` names every party that refused and why, before anything was trained.
        """
        if len(configs) != self.n_parties:
            raise ValueError(f"{len(configs)} configs for {self.n_parties} parties")
        self._setup_at(program, configs, seed, range(self.n_parties), tolerate=False, plans=plans)

    def _setup_at(self, program: str, configs: Sequence[dict[str, Any]], seed: int, parties: Iterable[int], *,
                  tolerate: bool, plans: Mapping[int, dict[str, Any]] | None = None) -> dict[int, Reply]:
        """``setup`` at ``parties`` in one round, every refusal gathered into one :class:`SetupRefused`."""
        self.transport.new_step()
        requests = {}
        for k in parties:
            meta = {"program": program, "config": dict(configs[k]), "seed": int(seed), **(self.fit_labels or {})}
            if plans and k in plans:
                meta["privacy"] = dict(plans[k])
            requests[k] = Request("setup", {}, meta)
        try:
            replies = self.transport.call_many(requests, tolerate=tolerate, gather=True)
        except PartiesRefused as e:
            raise SetupRefused(program, self.party_names, e.errors) from None
        self.privacy_setups = {k: r.meta["privacy"] for k, r in replies.items() if "privacy" in r.meta}
        return replies

    def request_explanation(self, handle: str, charges: Mapping[int, tuple[int, int]]) -> None:
        """Tell each party of ``charges`` (``{party: (rows, predictions)}``) that an explanation is about to predict
        that many of its rows from coalitions of parties, ``predictions`` predictions using its block beyond each
        row's own; each party may refuse (its policy) or charge them to its lookup budget.  Every party is asked
        first whether it would accept (a round that charges nothing); the refusals are raised together
        (:class:`ExplanationRefused`), before any party is charged or any coalition predicted."""
        absent = set(getattr(self, "absent", ()))
        asked = {k: {"data": handle, "rows": int(r), "predictions": int(p)} for k, (r, p) in charges.items()
                 if p > 0 and k not in absent}
        for check in (True, False):
            if not asked:
                return
            self.transport.new_step()
            try:
                self.transport.call_many({k: Request("explain", {}, {**meta, **({"check": True} if check else {})})
                                          for k, meta in asked.items()}, gather=True)
            except PartiesRefused as e:
                raise ExplanationRefused(self.party_names, e.errors) from None

    def private_parties(self) -> dict[int, dict[str, float]]:
        """The parties that keep a differential-privacy budget for their rows: ``{party: {"epsilon", "delta"}}``
        (what they said about themselves; the coordinator cannot change it)."""
        return {}

    def privacy_reports(self, parties: Iterable[int]) -> dict[int, dict[str, Any]]:
        """Each party's account of its budget: what its most-charged row spent (``privacy`` requests)."""
        wanted = list(parties)
        if not wanted:
            return {}
        self.transport.new_step()
        return {k: dict(r.meta) for k, r in self.transport.broadcast(wanted, "privacy", tolerate=True).items()}

    def preprocess(self, handle: str, *, standardize: bool) -> None:
        """Have every party fit its own preprocessing on its rows under ``handle`` (statistics stay at the party)."""
        self.transport.new_step()
        self.transport.broadcast(range(self.n_parties), "preprocess", data=handle, standardize=bool(standardize))

    def save(self, directory: str | Path, *, model: str | None = None) -> None:
        """Have every party save its state for ``directory``, tagged with the digest ``model`` of the whole model."""
        self.transport.new_step()
        self.transport.broadcast(range(self.n_parties), "save", dir=str(directory), **model_tag(model))

    def load(self, directory: str | Path, *, model: str | None = None) -> None:
        """Have every party restore its state of ``directory`` (refused where it belongs to another ``model``)."""
        self.transport.new_step()
        self.transport.broadcast(range(self.n_parties), "load", dir=str(directory), **model_tag(model))

    def party_dir(self, directory: str | Path) -> str:
        """The ``dir`` a party program's own message names to read the state :meth:`save` wrote for ``directory``
        (in one process: the directory itself; a deployment maps it to a path inside each party's state directory)."""
        return str(directory)

    def forget(self, directory: str | Path) -> bool:
        """Have every reachable party delete the state it saved for ``directory`` (pruned checkpoints); whether
        every party answered (one that did not keeps its file until it is asked again)."""
        self.transport.new_step()
        replies = self.transport.broadcast(range(self.n_parties), "forget", tolerate=True, dir=str(directory))
        return len(replies) == self.n_parties

    def call(self, party: int, kind: str, tensors: Any = None, **meta: Any) -> Reply:
        """Send party ``party`` one ``kind`` message and return its reply."""
        return self.transport.call(party, kind, tensors, **meta)

    def announced_policies(self) -> list[dict[str, Any]]:
        """What each party says of its policy (``PartyPolicy.announced``), for an honest coordinator to plan within
        it (``{}``: nothing said); every party still checks every request against its whole policy."""
        return [{} for _ in range(self.n_parties)]

    def close(self) -> None:
        """Close the transport."""
        self.transport.close()


class SetupRefused(PartiesRefused):
    """Parties refused to set up a program: every one of them, each with its reason (and, for a policy refusal,
    the ``[policy]`` value of its ``party.toml`` that would accept it).  Raised before anything is trained."""

    def __init__(self, program: str, party_names: Sequence[str], errors: Mapping[int, Exception]) -> None:
        self.program = program
        lines = [f"  party {k} ({party_names[k]!r}): {_reason(party_names[k], e)}" for k, e in sorted(errors.items())]
        policy = any("policy rule " in line for line in lines)
        RuntimeError.__init__(
            self, f"{len(errors)} of {len(party_names)} parties refused to set up {program!r}; nothing was trained:\n"
            + "\n".join(lines) + ("\na party's [policy] is its own decision: it can change it in its party.toml, or "
                                  "the coordinator can ask for a model within it (--param)" if policy else ""))
        self.errors = dict(errors)


class ExplanationRefused(PartiesRefused):
    """Parties refused to take part in an explanation (their policy, or their lookup budget): every one of them,
    each with its reason; raised before any coalition was predicted."""

    def __init__(self, party_names: Sequence[str], errors: Mapping[int, Exception]) -> None:
        lines = [f"  party {k} ({party_names[k]!r}): {_reason(party_names[k], e, 'explain')}"
                 for k, e in sorted(errors.items())]
        RuntimeError.__init__(
            self, f"{len(errors)} of {len(party_names)} parties refused the explanation; nothing was predicted:\n"
            + "\n".join(lines) + "\na party's [policy] is its own decision (allow_explanations, its lookup budget)")
        self.errors = dict(errors)


def _reason(name: str, error: Exception, kind: str = "setup") -> str:
    """A party's refusal without the wire's framing (``party 'bank' refused 'setup': ...``)."""
    text = str(getattr(error, "details", None) or error)
    return text.removeprefix(f"party {name!r} refused {kind!r}: ")


def _by_index(table: Mapping[int | str, Any], names: Sequence[str], what: str) -> dict[int, Any]:
    """``table`` keyed by party index (keys may be party names or indices; an unknown one is an error naming it)."""
    out = {}
    for key, value in table.items():
        k = names.index(key) if isinstance(key, str) and key in names else key
        if not isinstance(k, int) or not 0 <= k < len(names):
            raise ValueError(f"{what}: no party {key!r}; the parties are {list(names)}")
        out[k] = value
    return out


def model_tag(model: str | None) -> dict[str, str]:
    """The ``model`` meta of a save/load request (a party keeps a model's state under its name), if any."""
    return {} if model is None else {"model": str(model)}


class LocalFederation(Federation):
    """Every party in this process, each a :class:`PartyRuntime` holding only its own views.

    ``batched`` (default): a round whose parties run the same program is answered as one batched computation where
    the program supports it (:class:`~partialvfl.federation.wire.transport.LocalTransport`); ``False`` forces the
    per-party path.  ``device``, ``precision`` and ``compile``: where and how every party computes (a list or tuple
    of devices gives each party its own).  ``concurrent``: the parties of a round answer at the same time, a thread
    (and on a GPU a CUDA stream) each, where their program allows it; ``None``: on CUDA devices only
    (:mod:`partialvfl.federation.wire.concurrent`).
    """

    def __init__(
        self,
        party_names: Sequence[str],
        active_party: int,
        *,
        log: MessageLog | None = None,
        batched: bool = True,
        policies: Mapping[int | str, PartyPolicy] | None = None,
        device: Any = "cpu",
        precision: str = "fp32",
        compile: bool = False,  # torch's word
        concurrent: bool | None = None,
    ) -> None:
        chosen = _by_index(policies or {}, party_names, "policies")
        devices = list(device) if isinstance(device, list | tuple) else [device] * len(party_names)
        if len(devices) != len(party_names):
            raise ValueError(f"{len(devices)} devices for {len(party_names)} parties")
        self.runtimes = [PartyRuntime(k, n, policy=chosen.get(k), device=d, precision=precision, compile=compile)
                         for k, (n, d) in enumerate(zip(party_names, devices))]
        super().__init__(LocalTransport(self.runtimes, active_party, log, batched=batched, concurrent=concurrent),
                         party_names, active_party)

    @classmethod
    def for_dataset(cls, data: VerticalDataset, *, log: MessageLog | None = None, batched: bool = True,
                    policies: Mapping[int | str, PartyPolicy] | None = None,
                    party_dp: Mapping[int | str, tuple[float, float]] | None = None,
                    device: Any = "cpu", precision: str = "fp32", compile: bool = False,
                    concurrent: bool | None = None) -> LocalFederation:
        """Parties for ``data``; ``batched=False`` answers every party's requests alone (see LocalTransport);
        ``device``/``precision``/``compile``: where and how the parties compute; ``concurrent``: see the class.

        ``policies``: a party's own policy by name or index (default: research); ``party_dp``: ``{party: (epsilon,
        delta)}``, the research policy with that differential-privacy budget (the in-process ``[policy] dp_epsilon,
        dp_delta``).
        """
        chosen: dict[int | str, PartyPolicy] = dict(_by_index(policies or {}, data.party_names, "policies"))
        for k, (eps, delta) in _by_index(party_dp or {}, data.party_names, "party_dp").items():
            chosen[k] = chosen.get(k, PartyPolicy.research()).with_dp(eps, delta)
        return cls(data.party_names, data.active_party, log=log, batched=batched, policies=chosen, device=device,
                   precision=precision, compile=compile, concurrent=concurrent)

    def private_parties(self) -> dict[int, dict[str, float]]:
        """The privacy budget of each party that keeps one."""
        return {k: {"epsilon": rt.privacy.budget.epsilon, "delta": rt.privacy.budget.delta}
                for k, rt in enumerate(self.runtimes) if rt.privacy is not None}

    def attach(self, data: VerticalDataset, handle: str | None = None) -> str:
        """Give each party its block of ``data`` under a handle (new unless given); the handle."""
        if data.n_parties != self.n_parties:
            raise ValueError(f"data has {data.n_parties} parties, the federation {self.n_parties}")
        handle = handle or self.new_handle()
        for k, rt in enumerate(self.runtimes):
            rt.attach(handle, data.party(k))  # party k is handed its own view, nothing else
        return handle

    def release(self, handle: str) -> None:
        """Have the parties forget the data attached as ``handle``."""
        for rt in self.runtimes:
            rt.release(handle)

    def announced_policies(self) -> list[dict[str, Any]]:
        """Each party's policy as it announces it."""
        return [rt.policy.announced() for rt in self.runtimes]
