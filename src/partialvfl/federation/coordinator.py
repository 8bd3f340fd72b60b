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
from partialvfl.federation.messages import MessageLog, Reply, Request
from partialvfl.federation.party import PartyRuntime
from partialvfl.federation.transport import LocalTransport, PartiesRefused, Transport

__all__ = ["Federation", "LocalFederation", "SetupRefused"]


class Federation(ABC):
    """K parties reached through one :class:`Transport`, driven by the coordinator (the active party)."""

    def __init__(self, transport: Transport, party_names: Sequence[str], active_party: int) -> None:
        self.transport = transport
        self.party_names = tuple(party_names)
        self.active_party = active_party
        self._handles = itertools.count()

    @property
    def n_parties(self) -> int:
        return len(self.party_names)

    @property
    def log(self) -> MessageLog:
        return self.transport.log

    @abstractmethod
    def attach(self, data: VerticalDataset, handle: str | None = None) -> str:
        """Make each party hold its own view of ``data`` under a handle; return the handle."""

    @abstractmethod
    def release(self, handle: str) -> None:
        """Let the parties drop the data attached under ``handle``."""

    def new_handle(self, prefix: str = "data") -> str:
        return f"{prefix}-{next(self._handles)}"

    def setup(self, program: str, configs: Sequence[dict[str, Any]], seed: int) -> None:
        """Build the party program ``program`` at every party, each with its own config.

        Every party is asked, whatever the others answer: if any refuses (its policy, most often), one
        :class:`SetupRefused` names every party that refused and why, before anything was trained.
        """
        if len(configs) != self.n_parties:
            raise ValueError(f"{len(configs)} configs for {self.n_parties} parties")
        self._setup_at(program, configs, seed, range(self.n_parties), tolerate=False)

    def _setup_at(self, program: str, configs: Sequence[dict[str, Any]], seed: int, parties: Iterable[int], *,
                  tolerate: bool) -> dict[int, Reply]:
        """``setup`` at ``parties`` in one round, every refusal gathered into one :class:`SetupRefused`."""
        self.transport.new_step()
        try:
            return self.transport.call_many(
                {k: Request("setup", {}, {"program": program, "config": dict(configs[k]), "seed": int(seed)})
                 for k in parties}, tolerate=tolerate, gather=True)
        except PartiesRefused as e:
            raise SetupRefused(program, self.party_names, e.errors) from None

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

    def forget(self, directory: str | Path) -> bool:
        """Have every reachable party delete the state it saved for ``directory`` (pruned checkpoints); whether
        every party answered (one that did not keeps its file until it is asked again)."""
        self.transport.new_step()
        replies = self.transport.broadcast(range(self.n_parties), "forget", tolerate=True, dir=str(directory))
        return len(replies) == self.n_parties

    def call(self, party: int, kind: str, tensors: Any = None, **meta: Any) -> Reply:
        return self.transport.call(party, kind, tensors, **meta)

    def close(self) -> None:
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


def _reason(name: str, error: Exception) -> str:
    """A party's refusal without the wire's framing (``party 'bank' refused 'setup': ...``)."""
    text = str(getattr(error, "details", None) or error)
    return text.removeprefix(f"party {name!r} refused 'setup': ")


def model_tag(model: str | None) -> dict[str, str]:
    """The ``model`` meta of a save/load request (a party keeps a model's state under its name), if any."""
    return {} if model is None else {"model": str(model)}


class LocalFederation(Federation):
    """Every party in this process, each a :class:`PartyRuntime` holding only its own views.

    ``batched`` (default): a round whose parties run the same program is answered as one batched computation where
    the program supports it (:class:`~partialvfl.federation.transport.LocalTransport`); ``False`` forces the
    per-party path.  ``device``, ``precision`` and ``compile``: where and how every party computes (a list or tuple
    of devices gives each party its own).
    """

    def __init__(
        self,
        party_names: Sequence[str],
        active_party: int,
        *,
        log: MessageLog | None = None,
        batched: bool = True,
        device: Any = "cpu",
        precision: str = "fp32",
        compile: bool = False,  # noqa: A002 - torch's word
    ) -> None:
        devices = list(device) if isinstance(device, list | tuple) else [device] * len(party_names)
        if len(devices) != len(party_names):
            raise ValueError(f"{len(devices)} devices for {len(party_names)} parties")
        self.runtimes = [PartyRuntime(k, n, device=d, precision=precision, compile=compile)
                         for k, (n, d) in enumerate(zip(party_names, devices))]
        super().__init__(LocalTransport(self.runtimes, active_party, log, batched=batched), party_names, active_party)

    @classmethod
    def for_dataset(cls, data: VerticalDataset, *, log: MessageLog | None = None, batched: bool = True,
                    device: Any = "cpu", precision: str = "fp32",
                    compile: bool = False) -> LocalFederation:  # noqa: A002 - torch's word
        """Parties for ``data``; ``batched=False`` answers every party's requests alone (see LocalTransport);
        ``device``/``precision``/``compile``: where and how the parties compute."""
        return cls(data.party_names, data.active_party, log=log, batched=batched, device=device, precision=precision,
                   compile=compile)

    def attach(self, data: VerticalDataset, handle: str | None = None) -> str:
        if data.n_parties != self.n_parties:
            raise ValueError(f"data has {data.n_parties} parties, the federation {self.n_parties}")
        handle = handle or self.new_handle()
        for k, rt in enumerate(self.runtimes):
            rt.attach(handle, data.party(k))  # party k is handed its own view, nothing else
        return handle

    def release(self, handle: str) -> None:
        for rt in self.runtimes:
            rt.release(handle)
