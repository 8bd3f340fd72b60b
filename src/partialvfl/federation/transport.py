"""The Transport: the only way anything crosses between parties.

The coordinator (the process that plays the active party's label-side role) drives every step: it sends a
:class:`~partialvfl.federation.messages.Request` to a party and gets a
:class:`~partialvfl.federation.messages.Reply`.  Parties never call each other.  A transport stamps every request
with the current step and round and records both directions in its :class:`MessageLog`.

:class:`LocalTransport` delivers in-process: tensors are *detached* (zero-copy) on the way in and out, so that no
autograd graph spans two parties; gradients cross explicitly as messages, exactly as they must over a network.
A network transport (gRPC) implements ``_deliver`` (and a concurrent ``call_many``); nothing else changes.

Devices: a transport's ``device`` is the coordinator's (the method sets it when it fits or loads).  Replies arrive
with their floating-point tensors there and their integer and boolean tensors on the CPU; over a network the wire
carries CPU tensors both ways, in process a tensor goes straight to the receiver's device
(:mod:`partialvfl.utils.devices`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from partialvfl.federation.messages import MessageLog, Reply, Request, TensorDict
from partialvfl.federation.party import PartyProgram
from partialvfl.federation.policy import PolicyViolation
from partialvfl.federation.schema import MessageError
from partialvfl.utils.devices import move_message

__all__ = ["LocalTransport", "PartyUnavailable", "Transport"]


class PartyUnavailable(RuntimeError):
    """A party did not answer (down, too slow for the deadline, or crashed); the caller treats it as missing."""

    def __init__(self, party: int, reason: str) -> None:
        super().__init__(f"party {party} unavailable: {reason}")
        self.party = party
        self.reason = reason


class Transport(ABC):
    """Carries requests from the coordinator to parties and their replies back, logging every message."""

    def __init__(self, n_parties: int, coordinator: int, log: MessageLog | None = None) -> None:
        if not 0 <= coordinator < n_parties:
            raise ValueError(f"coordinator index {coordinator} out of range for {n_parties} parties")
        self.n_parties = n_parties
        self.coordinator = coordinator
        self.log = log if log is not None else MessageLog(keep_entries=False)  # counts only, unless asked
        self.step = 0
        self.round = 0
        self.failures: list[tuple[int, int, str]] = []  # (step, party, reason)
        self._sent: set[tuple[int, str]] = set()  # (party, kind) already sent in this step and round
        self.device = torch.device("cpu")  # the coordinator's: where replies' floating-point tensors arrive

    def new_step(self) -> int:
        """Start a new step (one mini-batch of training or prediction); rounds restart at 0."""
        self.step += 1
        self.round = 0
        self._sent.clear()
        return self.step

    def new_round(self) -> int:
        self.round += 1
        self._sent.clear()
        return self.round

    def _stamp(self, request: Request) -> Request:
        return Request(request.kind, request.tensors, {**request.meta, "step": self.step, "round": self.round})

    def _check_party(self, party: int) -> None:
        if not 0 <= party < self.n_parties:
            raise ValueError(f"no party {party}: the federation has parties 0..{self.n_parties - 1}")

    def call(self, party: int, kind: str, tensors: TensorDict | None = None, **meta: Any) -> Reply:
        """Send one request and wait for its reply; raises :class:`PartyUnavailable` if the party is down."""
        return self.call_many({party: Request(kind, tensors or {}, meta)})[party]

    def call_many(self, requests: Mapping[int, Request], *, tolerate: bool = False) -> dict[int, Reply]:
        """Send several requests (concurrently where the transport can) within the current round.

        With ``tolerate=True`` a party that fails is left out of the result (and recorded in ``failures``) instead
        of raising, so the caller can treat it as a missing block for this step.
        """
        out: dict[int, Reply] = {}
        for party, req in requests.items():
            req = self._admit(party, req)
            try:
                reply = self._deliver(party, req)
            except PartyUnavailable as e:
                self._failed(party, e, tolerate)
                continue
            out[party] = self._answered(party, req, reply)
        return out

    def _admit(self, party: int, req: Request) -> Request:
        """Check the party and that this kind is new in this (step, round); stamp the request and log it."""
        self._check_party(party)
        if (party, req.kind) in self._sent:
            # A party serves each kind once per (step, round): the network servers refuse repeats as replays.
            raise RuntimeError(
                f"party {party} already got a {req.kind!r} request in step {self.step} round {self.round}; "
                "call transport.new_round() between rounds"
            )
        self._sent.add((party, req.kind))
        req = self._stamp(req)
        self.log.record(
            step=self.step, round=self.round, sender=self.coordinator, receiver=party, kind=req.kind,
            direction="request", tensors=req.tensors,
        )
        return req

    def _failed(self, party: int, error: PartyUnavailable, tolerate: bool) -> None:
        self.failures.append((self.step, party, error.reason))
        if not tolerate:
            raise error

    def _answered(self, party: int, req: Request, reply: Reply) -> Reply:
        self.log.record(
            step=self.step, round=self.round, sender=party, receiver=self.coordinator, kind=req.kind,
            direction="reply", tensors=reply.tensors,
        )
        return Reply(move_message(reply.tensors, self.device), reply.meta)

    def broadcast(
        self, parties: Sequence[int], kind: str, tensors: TensorDict | None = None, *, tolerate: bool = False,
        **meta: Any,
    ) -> dict[int, Reply]:
        """The same request to several parties."""
        return self.call_many({p: Request(kind, dict(tensors or {}), dict(meta)) for p in parties}, tolerate=tolerate)

    @abstractmethod
    def _deliver(self, party: int, request: Request) -> Reply:
        """Carry one stamped request to ``party`` and return its reply."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections (network transports)."""


def _detached(tensors: TensorDict) -> TensorDict:
    out = {}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"message tensor {name!r} is a {type(t).__name__}, not a torch.Tensor")
        out[name] = t.detach()
    return out


class LocalTransport(Transport):
    """In-process delivery to :class:`~partialvfl.federation.party.PartyRuntime` objects: zero-copy, detached.

    ``batched=True`` (the default): when several parties of one round run the same program and the program can
    answer a round jointly (:meth:`~partialvfl.federation.party.PartyProgram.handle_batch`, e.g. stacked weights and
    one batched matmul per layer), their requests are answered in one computation.  Everything else is as on the
    per-party path: each request and reply is checked against its declaration and logged per party with the same
    names, shapes and bytes, each party's weights and optimiser stay its own, and a party marked down fails alone.
    ``batched=False`` answers every request by itself (for tests and comparisons).
    """

    def __init__(self, runtimes: Sequence[Any], coordinator: int, log: MessageLog | None = None, *,
                 batched: bool = True) -> None:
        super().__init__(len(runtimes), coordinator, log)
        self.runtimes = list(runtimes)
        self.down: set[int] = set()  # parties to treat as unreachable (fault-injection for tests)
        self.batched = batched

    def _deliver(self, party: int, request: Request) -> Reply:
        if party in self.down:
            raise PartyUnavailable(party, "marked down")
        reply = self.runtimes[party].handle(Request(request.kind, _detached(request.tensors), dict(request.meta)),
                                            reply_device=self.device)
        return Reply(_detached(reply.tensors), dict(reply.meta))

    def call_many(self, requests: Mapping[int, Request], *, tolerate: bool = False) -> dict[int, Reply]:
        valid = all(0 <= p < self.n_parties and (p, r.kind) not in self._sent and (tolerate or p not in self.down)
                    for p, r in requests.items())
        groups = self._batch_groups(requests) if self.batched and valid else {}
        if not groups:  # nothing to batch, or an error the per-party path raises where and as it always does
            return super().call_many(requests, tolerate=tolerate)
        stamped = {p: self._stamp(Request(r.kind, _detached(r.tensors), dict(r.meta))) for p, r in requests.items()}
        try:
            for parties in groups.values():
                for p in parties:
                    self.runtimes[p].check(stamped[p])
        except (MessageError, PolicyViolation):  # the per-party path raises it where and as it always does
            return super().call_many(requests, tolerate=tolerate)
        answers: dict[int, Reply] = {}
        for (cls, _, _), parties in groups.items():
            runtimes = [self.runtimes[p] for p in parties]
            with runtimes[0].computing():  # one device and precision per group
                replies = cls.handle_batch([(rt.program, rt.arrive(stamped[p])) for rt, p in zip(runtimes, parties)])
            if replies is not None:
                answers.update((p, rt.depart(rt.program.messages[stamped[p].kind], r, self.device))
                               for rt, p, r in zip(runtimes, parties, replies))
        out: dict[int, Reply] = {}
        for party, req in requests.items():
            req = self._admit(party, req)
            if party not in answers:
                try:
                    out[party] = self._answered(party, req, self._deliver(party, req))
                except PartyUnavailable as e:
                    self._failed(party, e, tolerate)
                continue
            reply = Reply(_detached(answers[party].tensors), dict(answers[party].meta))
            self.runtimes[party].check(stamped[party], reply)
            out[party] = self._answered(party, req, reply)
        return out

    def _batch_groups(self, requests: Mapping[int, Request]) -> dict[tuple[type, Any, str], list[int]]:
        """Parties whose program can answer this round jointly, by program class, device and precision (in party
        order)."""
        groups: dict[tuple[type, Any, str], list[int]] = {}
        for party, req in sorted(requests.items()):
            if party in self.down:
                continue
            program = self.runtimes[party].program
            if program is None or req.kind not in program.messages:
                continue
            cls = type(program)
            if cls.handle_batch.__func__ is not PartyProgram.handle_batch.__func__:  # type: ignore[attr-defined]
                rt = self.runtimes[party]
                groups.setdefault((cls, rt.device, rt.precision), []).append(party)
        return groups
