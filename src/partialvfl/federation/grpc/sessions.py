"""Coordinator sessions at a party, and the secrets a coordinator keeps to resume one (and its alignment).

A party serves one coordinator session at a time.  A ``hello`` opens one when none is live; while one is live
(its last request less than ``[party] session_idle_seconds`` ago) a ``hello`` is refused without touching it,
unless it proves it holds that session: its ``resume`` is the *session secret* the party handed out when the
session opened (``session_secret`` in the first ``hello``'s reply, 32 random bytes from :mod:`secrets`, compared in
constant time).  So an allowlisted peer's stray ``hello`` can no longer end a running fit, and a coordinator that
really restarted (``fit --resume``, which finds the secrets kept with its checkpoints) takes its session back; one
without the secret waits for the idle timeout.  ``bye`` ends the session (the coordinator says it when it closes).
A party that restarted with its session on disk (:mod:`.party_resume`) knows the session and a digest of its secret:
the coordinator *continues* it with a ``hello`` that carries the secret and ``continue_session`` (refused, leaving
everything as it is, unless this party holds that very session), and says where each of its lanes' sequence numbers
stand, so that nothing it sent before is served again.  Until then the session serves nothing but that ``hello`` and
its coordinator's ``bye``, and holds no other coordinator off (as a party that restarted without it).

:class:`SessionGuard` is the party's side (with the replay rules inside a session); :class:`SessionSecrets` the
coordinator's (a JSON file, readable by its owner only, written atomically).  :class:`AlignmentTickets` keeps the
tickets keyed parties hand out when a fit asks them to keep its alignment (:mod:`partialvfl.federation.trust.psu`): only
with its ticket does a party reuse a session's tokens, so a resumed fit (``fit --resume``, which finds them with its
checkpoints) aligns in the same order.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import math
import secrets
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import grpc

from partialvfl.federation.grpc.frames import WireRequest
from partialvfl.federation.grpc.limits import Refused
from partialvfl.utils.private_files import write_private_json

__all__ = ["DEFAULT_IDLE_SECONDS", "AlignmentTickets", "SessionGuard", "SessionSecrets", "secret_digest"]

#: how long a party keeps a silent session before another coordinator may open one
DEFAULT_IDLE_SECONDS = 600.0


class SessionGuard:
    """Which coordinator session the party serves, and the replay rules within it.

    :meth:`check` changes nothing; :meth:`commit` records a message that passed every check (a ``hello`` opens or
    resumes its session only then, so a refused ``hello`` leaves a live session as it was) and returns what the
    ``hello`` reply adds (the session secret); :meth:`touch` marks the session active at the end of a request.
    """

    def __init__(self, party: str, idle_seconds: float = DEFAULT_IDLE_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.party = party
        self.idle = float(idle_seconds)
        self.clock = clock
        self.session: str | None = None
        self.secret: str | None = None
        self.secret_sha256: str | None = None  # a restored session's secret, as its digest (the party's disk)
        self.awaiting_continue = False  # restored from disk: nothing is served until its coordinator continues it
        self.last_active = -math.inf
        self.resumed = False  # whether the last hello resumed the session it found (rather than opening one)
        self.last_seq = 0
        self.last_step = -1
        self.served: set[tuple[int, int, str]] = set()
        #: the replay state (last sequence number, last step, served) of each lane other than 0: a coordinator's
        #: prediction service keeps several batches in flight, each lane numbered on its own
        self.lanes: dict[int, tuple[int, int, set[tuple[int, int, str]]]] = {}

    def _replay_state(self, lane: int) -> tuple[int, int, set[tuple[int, int, str]]]:
        return (self.last_seq, self.last_step, self.served) if lane == 0 else self.lanes.get(lane, (0, -1, set()))

    def live(self) -> bool:
        """Whether a session is open and had a request less than ``idle`` seconds ago."""
        return self.session is not None and self.clock() - self.last_active < self.idle

    def _resumes(self, meta: Mapping[str, Any]) -> bool:
        proof = meta.get("resume")
        if not isinstance(proof, str):
            return False
        if self.secret is not None:
            return hmac.compare_digest(proof, self.secret)
        return self.secret_sha256 is not None and hmac.compare_digest(secret_digest(proof), self.secret_sha256)

    def restore(self, session: str, secret_sha256: str, idle_for: float) -> None:
        """A session kept on the party's disk (a restart): known by its digest until its coordinator continues it;
        ``idle_for``: seconds since its last request (its idle timeout goes on counting)."""
        self.session, self.secret, self.secret_sha256 = session, None, secret_sha256
        self.last_active = self.clock() - max(0.0, float(idle_for))
        self.last_seq, self.last_step = 0, -1
        self.served.clear()
        self.lanes.clear()
        self.awaiting_continue = True

    def check(self, wire: WireRequest) -> None:
        """Refuse ``wire`` if it breaks the session's rules (changes nothing; :meth:`commit` records)."""
        kind = wire.request.kind
        if kind == "hello" and wire.request.meta.get("continue_session"):
            if not (self.live() and wire.session == self.session and self._resumes(wire.request.meta)):
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                              f"party {self.party!r} holds no such session to continue (it restarted without it, "
                              "the session ended or went idle, or another took over): a new session is needed")
            return
        if kind == "hello":
            # a session read back from disk, not continued yet, holds nobody off: as a party that restarted did
            if self.live() and not self.awaiting_continue and not self._resumes(wire.request.meta):
                quiet = self.clock() - self.last_active
                raise Refused(grpc.StatusCode.ABORTED,
                              f"party {self.party!r} is serving another coordinator session (its last request "
                              f"{quiet:.0f} s ago); that session was left as it is. The party accepts a new session "
                              f"after {self.idle:g} s without requests ([party] session_idle_seconds), or from the "
                              "coordinator that holds the session (the same fit with --resume and the same --out)")
            return
        if self.session is None:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                          f"party {self.party!r} has no coordinator session (it restarted, or the session ended): "
                          "a coordinator must say hello first")
        if self.awaiting_continue and not (kind == "bye" and wire.session == self.session):
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                          f"party {self.party!r} restarted and holds its session on disk: its coordinator continues "
                          "it with a hello (continue_session) first")
        if wire.session != self.session:
            raise Refused(grpc.StatusCode.ABORTED,
                          f"party {self.party!r} no longer serves this coordinator session: another session took "
                          "over (a coordinator holding its secret, e.g. a resumed fit, or any allowlisted one after "
                          f"{self.idle:g} s without requests); this coordinator must stop")
        last_seq, last_step, served = self._replay_state(wire.lane)
        if wire.seq <= last_seq:
            raise Refused(grpc.StatusCode.ALREADY_EXISTS,
                          f"replayed message: sequence number {wire.seq} already seen (last {last_seq})")
        if wire.step < last_step:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                          f"stale message: step {wire.step} is older than the current step {last_step}")
        if wire.step == last_step and (wire.step, wire.round, kind) in served:
            raise Refused(grpc.StatusCode.ALREADY_EXISTS,
                          f"replayed message: {kind!r} was already served in step {wire.step} round {wire.round} "
                          "(a method calling the same kind twice must start a new round in between)")

    def commit(self, wire: WireRequest) -> dict[str, Any]:
        """Record a message that passed every check; the ``hello`` reply's additions (its session secret)."""
        kind = wire.request.kind
        self.last_active = self.clock()
        if kind == "hello":
            self.resumed = self.session is not None and self._resumes(wire.request.meta)
            if self.resumed and self.secret is None:  # a restored session, continued: its secret is known again
                self.secret = str(wire.request.meta["resume"])
            if not self.resumed:
                self.secret = secrets.token_hex(32)  # a new session, not a resumed one
            self.secret_sha256 = secret_digest(self.secret)
            self.session, self.last_seq, self.last_step = wire.session, wire.seq, wire.step
            self.served.clear()
            self.lanes.clear()
            self.awaiting_continue = False
            floors = wire.request.meta.get("lane_seqs") if self.resumed else None
            for lane, seq in (floors or {}).items():  # nothing a lane sent before this hello is served again
                if str(lane).isdigit() and int(lane) > 0 and isinstance(seq, int):
                    self.lanes[int(lane)] = (seq, -1, set())
            return {"session_secret": self.secret}
        if kind == "bye":
            self.session = self.secret = self.secret_sha256 = None
            self.awaiting_continue = False
            self.served.clear()
            self.lanes.clear()
            return {}
        if wire.lane:
            _, last_step, served = self._replay_state(wire.lane)
            served = set() if wire.step > last_step else served
            served.add((wire.step, wire.round, kind))
            self.lanes[wire.lane] = (wire.seq, wire.step, served)
            return {}
        if wire.step > self.last_step:
            self.served.clear()
        self.last_seq, self.last_step = wire.seq, wire.step
        self.served.add((wire.step, wire.round, kind))
        return {}

    def touch(self, session: str) -> None:
        """A request of ``session`` finished: the session is active now (its idle time starts again)."""
        if session == self.session:
            self.last_active = self.clock()


def secret_digest(secret: str) -> str:
    """What a party keeps of a session secret on its disk: its SHA-256 (hex)."""
    return hashlib.sha256(secret.encode()).hexdigest()


class SessionSecrets:
    """The coordinator's session secrets, per party name, in memory and (if ``path`` is set) in a JSON file readable
    by its owner only, rewritten atomically whenever a party hands out a new one."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self.secrets: dict[str, str] = {}
        self._made: list[Path] = []  # folders this store created (removed again, if empty, once the sessions end)
        if self.path is not None and self.path.is_file():
            try:
                raw = json.loads(self.path.read_text())
            except (OSError, ValueError) as e:
                raise ValueError(f"session file {self.path} is not readable JSON ({type(e).__name__}); remove it "
                                 "(the parties then accept this coordinator after their idle timeout)") from None
            parties = raw.get("parties") if isinstance(raw, dict) else None
            if isinstance(parties, dict):
                self.secrets = {str(k): str(v) for k, v in parties.items() if isinstance(v, str)}

    def get(self, party: str) -> str | None:
        """The session secret of ``party`` (``None`` if none is kept)."""
        return self.secrets.get(party)

    def set(self, party: str, secret: str | None) -> None:
        """Keep ``secret`` for ``party`` (written to disk when it changes)."""
        if not isinstance(secret, str) or self.secrets.get(party) == secret:
            return
        self.secrets[party] = secret
        self._write()

    def forget(self) -> None:
        """Every session ended (``bye``): drop the secrets and the file."""
        self.secrets.clear()
        if self.path is not None:
            self.path.unlink(missing_ok=True)
        for d in reversed(self._made):  # a fit that stopped before anything was written leaves no folder behind
            with contextlib.suppress(OSError):
                d.rmdir()
        self._made.clear()

    def _write(self) -> None:
        if self.path is None:
            return
        missing = [d for d in (self.path.parent, *self.path.parent.parents) if not d.exists()]
        self._made.extend(reversed(missing))
        write_private_json(self.path, {"parties": self.secrets})



class AlignmentTickets:
    """The tickets under which keyed parties keep an alignment's nonce: ``{alignment_id: {party: ticket}}``, in
    memory and (if ``path`` is set) in a JSON file readable by its owner only, rewritten atomically.  Unlike the
    session secrets they outlive ``bye``: a fit stopped by a signal resumes with them."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self.tickets: dict[str, dict[str, str]] = {}
        if self.path is not None and self.path.is_file():
            try:
                raw = json.loads(self.path.read_text())
                self.tickets = {str(a): {str(p): str(t) for p, t in per.items()} for a, per in raw.items()}
            except (OSError, ValueError, AttributeError) as e:
                raise ValueError(f"alignment ticket file {self.path} is not readable JSON ({type(e).__name__}); "
                                 "remove it (the parties then align a resumed fit with new tokens)") from None

    def get(self, alignment_id: str, party: str) -> str | None:
        """The ticket ``party`` holds for alignment ``alignment_id`` (``None`` if none)."""
        return self.tickets.get(alignment_id, {}).get(party)

    def set(self, alignment_id: str, party: str, ticket: Any) -> None:
        """Keep ``ticket`` for ``party`` in alignment ``alignment_id`` (written to its file, if any, on a change)."""
        if not isinstance(ticket, str) or self.get(alignment_id, party) == ticket:
            return
        self.tickets.setdefault(alignment_id, {})[party] = ticket
        if self.path is not None:
            write_private_json(self.path, self.tickets)

    def discard(self) -> None:
        """Drop every ticket and the file (nothing is left to resume)."""
        self.tickets.clear()
        if self.path is not None:
            self.path.unlink(missing_ok=True)
