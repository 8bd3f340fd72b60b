"""The Transport: the only way anything crosses between parties.

The coordinator (the process that plays the active party's label-side role) drives every step: it sends a
:class:`~partialvfl.federation.wire.messages.Request` to a party and gets a
:class:`~partialvfl.federation.wire.messages.Reply`.  Parties never call each other.  A transport stamps every request
with the current step and round and records both directions in its :class:`MessageLog`.

:class:`LocalTransport` delivers in-process: tensors are *detached* (zero-copy) on the way in and out, so that no
autograd graph spans two parties; gradients cross explicitly as messages, exactly as they must over a network.

Every transport admits requests the same way (:meth:`Transport.call_many`: a known party, each kind once per step
and round, stamped, logged, replies logged, failures recorded) and differs only in delivery
(:meth:`Transport._deliveries`): in process party by party or as one batched computation, over gRPC concurrently.
A check added to the admission path holds for all of them.

Devices: a transport's ``device`` is the coordinator's (the method sets it when it fits or loads).  Replies arrive
with their floating-point tensors there and their integer and boolean tensors on the CPU; over a network the wire
carries CPU tensors both ways, in process a tensor goes straight to the receiver's device
(:mod:`partialvfl.utils.devices`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Generator, Mapping, Sequence
from typing import Any

import torch

from partialvfl.federation.wire.concurrent import ConcurrentParties, concurrent_default
from partialvfl.federation.wire.messages import MessageLog, Reply, Request, TensorDict
from partialvfl.federation.wire.program import PartyProgram
from partialvfl.federation.wire.refusals import PolicyViolation
from partialvfl.federation.wire.schema import MessageError
from partialvfl.utils.devices import move_message

__all__ = ["LocalTransport", "PartiesRefused", "PartyUnavailable", "Transport"]


class PartiesRefused(RuntimeError):
    """Several parties refused one round's requests (``errors``: party -> its refusal), raised together."""

    def __init__(self, errors: Mapping[int, Exception]) -> None:
        self.errors = dict(errors)
        lines = "\n".join(f"  party {p}: {e}" for p, e in sorted(self.errors.items()))
        super().__init__(f"{len(self.errors)} part{'y' if len(self.errors) == 1 else 'ies'} refused:\n{lines}")


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
        """Start a new round within the step (another exchange with the parties); its number."""
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

    def call_many(self, requests: Mapping[int, Request], *, tolerate: bool = False,
                  gather: bool = False) -> dict[int, Reply]:
        """Send several requests (concurrently where the transport can) within the current round.

        The one admission path of every transport: each request is checked (a known party, a kind not yet sent to it
        in this step and round) before any is sent, then stamped and logged as it goes; each reply is logged as it
        comes back.  The party checks every message against its declaration and its policy (in process and behind
        the gRPC server alike), whichever way the request is delivered (:meth:`_deliveries`).

        With ``tolerate=True`` a party that fails is left out of the result (and recorded in ``failures``) instead
        of raising, so the caller can treat it as a missing block for this step.  With ``gather=True`` every party
        gets its request even when one refuses, and the refusals are raised together (:class:`PartiesRefused`).
        """
        for party, req in requests.items():
            self._check_new(party, req.kind)
        out: dict[int, Reply] = {}
        errors: dict[int, Exception] = {}
        deliveries = self._deliveries(requests, tolerate=tolerate, gather=gather)
        for party, req, outcome in deliveries:
            if isinstance(outcome, Reply):
                out[party] = self._answered(party, req, outcome)
                continue
            if isinstance(outcome, PartyUnavailable):
                self.failures.append((self.step, party, outcome.reason))
                if tolerate:
                    continue
            errors[party] = outcome
            if not (self.gathers or gather):
                deliveries.close()
                break
        self._raise(errors, gather)
        return out

    def _check_new(self, party: int, kind: str) -> None:
        """A known party, and a kind not yet sent to it in this (step, round)."""
        self._check_party(party)
        if (party, kind) in self._sent:
            # A party serves each kind once per (step, round): the network servers refuse repeats as replays.
            raise RuntimeError(
                f"party {party} already got a {kind!r} request in step {self.step} round {self.round}; "
                "call transport.new_round() between rounds"
            )

    def _admit(self, party: int, req: Request) -> Request:
        """Record ``req`` as sent to ``party`` in this (step, round); stamp it and log it."""
        self._sent.add((party, req.kind))
        req = self._stamp(req)
        self.log.record(
            step=self.step, round=self.round, sender=self.coordinator, receiver=party, kind=req.kind,
            direction="request", tensors=req.tensors,
        )
        return req

    def _answered(self, party: int, req: Request, reply: Reply) -> Reply:
        self.log.record(
            step=self.step, round=self.round, sender=party, receiver=self.coordinator, kind=req.kind,
            direction="reply", tensors=reply.tensors,
        )
        return Reply(move_message(reply.tensors, self.device), reply.meta)

    @staticmethod
    def _raise(errors: Mapping[int, Exception], gather: bool) -> None:
        """A refusal before an unavailable party; with ``gather``, every refusal at once."""
        refused = {p: e for p, e in errors.items() if not isinstance(e, PartyUnavailable)}
        if gather and refused:
            raise PartiesRefused(refused)
        for e in (*refused.values(), *errors.values()):
            raise e

    def broadcast(
        self, parties: Sequence[int], kind: str, tensors: TensorDict | None = None, *, tolerate: bool = False,
        **meta: Any,
    ) -> dict[int, Reply]:
        """The same request to several parties."""
        return self.call_many({p: Request(kind, dict(tensors or {}), dict(meta)) for p in parties}, tolerate=tolerate)

    #: whether a failed delivery lets the other parties' deliveries of the round finish (the network transports:
    #: the requests are already on their way) or stops the round at once (in process)
    gathers: bool = False

    @abstractmethod
    def _deliveries(self, requests: Mapping[int, Request], *, tolerate: bool,
                    gather: bool) -> Generator[tuple[int, Request, Reply | Exception], None, None]:
        """Deliver ``requests`` (already checked), admitting each (:meth:`_admit`) as it is sent; yield
        ``(party, admitted request, reply or the exception that stands for it)`` in party order.

        A :class:`PartyUnavailable` is always yielded; another exception may be raised at once unless ``gather``.
        """

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
    """In-process delivery to :class:`~partialvfl.federation.runtime.party.PartyRuntime` objects: zero-copy, detached.

    ``batched=True`` (the default): when several parties of one round run the same program and the program can answer a
    round jointly (:meth:`~partialvfl.federation.wire.program.PartyProgram.handle_batch`, e.g. stacked weights and one
    batched matmul per layer), their requests are answered in one computation.  Everything else is as on the per-party
    path: each request and reply is checked against its declaration and logged per party with the same names, shapes and
    bytes, each party's weights and optimiser stay its own, and a party marked down fails alone. ``batched=False``
    answers every request by itself (for tests and comparisons).

    ``concurrent``: the parties of a round answer at the same time, a thread each (and on a GPU a CUDA stream each:
    :mod:`.concurrent`), where their program allows it; ``None`` (the default): when every party of the round
    computes on a CUDA device.  Every party gets its request and the round finishes before a failure is raised (as
    over gRPC); the replies, the log and the floats are those of the one-by-one path.
    """

    def __init__(self, runtimes: Sequence[Any], coordinator: int, log: MessageLog | None = None, *,
                 batched: bool = True, concurrent: bool | None = None) -> None:
        super().__init__(len(runtimes), coordinator, log)
        self.runtimes = list(runtimes)
        self.down: set[int] = set()  # parties to treat as unreachable (fault-injection for tests)
        self.batched = batched
        self.concurrent = concurrent
        self._parallel = ConcurrentParties(len(self.runtimes))

    def _deliver(self, party: int, request: Request) -> Reply:
        if party in self.down:
            raise PartyUnavailable(party, "marked down")
        reply = self.runtimes[party].handle(Request(request.kind, _detached(request.tensors), dict(request.meta)),
                                            reply_device=self.device)
        return Reply(_detached(reply.tensors), dict(reply.meta))

    def _deliveries(self, requests: Mapping[int, Request], *, tolerate: bool,
                    gather: bool) -> Generator[tuple[int, Request, Reply | Exception], None, None]:
        """Party by party, or the parties a program answers jointly as one batched computation first."""
        answers = self._batch_answers(requests, tolerate) if self.batched and not gather else {}
        together = self._concurrent_parties(requests, answers)
        if together:
            yield from self._concurrent_deliveries(requests, answers, together, gather)
            return
        for party, req in requests.items():
            req = self._admit(party, req)
            if party in answers:
                yield party, req, self._batched_reply(party, answers[party])
                continue
            try:
                yield party, req, self._deliver(party, req)
            except PartyUnavailable as e:
                yield party, req, e
            except Exception as e:  # a refusal, collected with the others' (gather only)
                if not gather:
                    raise
                yield party, req, e

    def _batched_reply(self, party: int, answered: tuple[Request, Reply]) -> Reply:
        """A reply of a batched round as the party's own would leave it: detached, checked against its declaration."""
        stamped, answer = answered
        reply = Reply(_detached(answer.tensors), dict(answer.meta))
        self.runtimes[party].check(stamped, reply)
        return reply

    def _concurrent_parties(self, requests: Mapping[int, Request], answered: Mapping[int, Any]) -> list[int]:
        """The parties of this round that answer at the same time (none unless at least two can)."""
        parties = []
        for party, req in requests.items():
            rt = self.runtimes[party]
            program = getattr(rt, "program", None)
            if (party in answered or party in self.down or program is None or req.kind not in program.messages
                    or not getattr(program, "answers_concurrently", False) or getattr(rt, "privacy", None) is not None):
                continue
            parties.append(party)
        if len(parties) < 2:
            return []
        wanted = self.concurrent
        if wanted is None:
            wanted = concurrent_default([torch.device(self.runtimes[p].device) for p in parties])
        return parties if wanted else []

    def _concurrent_deliveries(self, requests: Mapping[int, Request], answers: Mapping[int, tuple[Request, Reply]],
                               together: list[int], gather: bool
                               ) -> Generator[tuple[int, Request, Reply | Exception], None, None]:
        """Every request admitted (logged) in party order, ``together`` answered at the same time, the rest one by
        one, the outcomes yielded in party order."""
        admitted = {party: self._admit(party, req) for party, req in requests.items()}
        outcomes = self._parallel.run({p: (torch.device(self.runtimes[p].device),
                                           lambda p=p: self._deliver(p, admitted[p])) for p in together})
        for party, req in admitted.items():
            if party in answers:
                yield party, req, self._batched_reply(party, answers[party])
                continue
            if party in outcomes:
                outcome = outcomes[party]
            else:
                try:
                    outcome = self._deliver(party, req)
                except Exception as e:  # raised below as the one-by-one path would
                    outcome = e
            if isinstance(outcome, Exception) and not isinstance(outcome, PartyUnavailable) and not gather:
                raise outcome
            yield party, req, outcome

    def close(self) -> None:
        """Stop the threads of concurrent rounds."""
        self._parallel.close()

    def _batch_answers(self, requests: Mapping[int, Request],
                       tolerate: bool) -> dict[int, tuple[Request, Reply]]:
        """The replies of the parties whose program answers this round jointly (with the stamped request each was
        checked as); none where a request would fail, which the per-party path raises where and as it always does."""
        if not tolerate and any(p in self.down for p in requests):
            return {}
        groups = self._batch_groups(requests)
        if not groups:
            return {}
        stamped = {p: self._stamp(Request(r.kind, _detached(r.tensors), dict(r.meta))) for p, r in requests.items()}
        try:
            for parties in groups.values():
                for p in parties:
                    stamped[p] = self.runtimes[p].check(stamped[p])  # admitted: gradients clipped by policy
        except (MessageError, PolicyViolation):
            return {}
        answers: dict[int, tuple[Request, Reply]] = {}
        for (cls, _, _), parties in groups.items():
            runtimes = [self.runtimes[p] for p in parties]
            with runtimes[0].computing():  # one device and precision per group
                replies = cls.handle_batch([(rt.program, rt.arrive(stamped[p])) for rt, p in zip(runtimes, parties)])
            if replies is not None:
                answers.update((p, (stamped[p], rt.depart(rt.program.messages[stamped[p].kind], r, self.device)))
                               for rt, p, r in zip(runtimes, parties, replies))
        return answers

    def _batch_groups(self, requests: Mapping[int, Request]) -> dict[tuple[type, Any, str], list[int]]:
        """Parties whose program can answer this round jointly, by program class, device and precision (in party
        order)."""
        groups: dict[tuple[type, Any, str], list[int]] = {}
        for party, req in sorted(requests.items()):
            if party in self.down or getattr(self.runtimes[party], "privacy", None) is not None:
                continue  # a party with a privacy budget answers through its runtime (noise, ledger, DP-SGD)
            program = self.runtimes[party].program
            if program is None or req.kind not in program.messages:
                continue
            cls = type(program)
            if cls.handle_batch.__func__ is not PartyProgram.handle_batch.__func__:  # type: ignore[attr-defined]
                rt = self.runtimes[party]
                groups.setdefault((cls, rt.device, rt.precision), []).append(party)
        return groups
