"""The coordinator's side of alignment: how it gets comparable tokens for the parties' rows and for its own IDs.

Two strategies behind one interface (:class:`PsuAlignment`, the default, and :class:`HmacAlignment`, the explicit
``alignment = "hmac"``), used by :class:`~partialvfl.federation.grpc.federation.GrpcFederation`:

* ``party_tokens(parties, table, own)``: every asked party's tokens of its table (training table, or the prediction
  table ``table``) and the tokens of the coordinator's own IDs ``own`` (its label table, the IDs it predicts);
* ``id_tokens(texts)``: the tokens of the coordinator's own IDs alone (a lookup: one round to one keyed party).

Message flow of one session (``psu``; K parties of which the keyed ones hold the passive parties' secret):

1. ``psu_open`` to every party: each keyed party replies a fresh nonce (or, given the ticket it handed out for an
   alignment to resume, the nonce it kept under it); the salt is the sorted nonces.
2. concurrently: ``psu_tokens`` (salt) to each keyed party -> its tokens ``H(y)^a``, sorted, and a key check;
   ``psu_blind`` to each party without the key -> its rows blinded ``H(y)^r``, sorted.
3. ``psu_eval`` (salt): the unkeyed parties' points and the coordinator's own blinded IDs, split over the keyed
   parties -> the same points raised to ``a``.
4. ``psu_unblind`` to each unkeyed party -> its tokens; the coordinator unblinds its own with ``1/r``.

Every reply is checked before anything is used: the number of tokens against the rows the party said it holds,
duplicates, the keyed parties' key checks agreeing, and every element that enters a group operation (libsodium
refuses an invalid encoding); a failure is an :class:`AlignmentError` naming the party, and nothing is attached.
The coordinator blinds and unblinds its own IDs while the parties compute (libsodium runs without the GIL).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from partialvfl.data.ids import hash_ids
from partialvfl.federation.grpc.sessions import AlignmentTickets
from partialvfl.federation.trust.psu import (
    AlignmentError,
    Blinding,
    GroupWork,
    as_points,
    check_distinct,
)
from partialvfl.federation.wire.messages import Request
from partialvfl.federation.wire.transport import Transport

__all__ = ["ALIGNMENT_MODES", "AlignmentError", "HmacAlignment", "PsuAlignment", "make_alignment"]

ALIGNMENT_MODES = ("psu", "hmac")
log = logging.getLogger("partialvfl.federation")
HMAC_WARNING = ("alignment = 'hmac': every institution holding the shared HMAC key, the coordinator included, can "
                "test any ID it can enumerate against the parties' hashes (a dictionary attack on their customer "
                "lists); use it only for parties inside one trust domain")


class _Base:
    def __init__(self, transport: Transport, party_names: Sequence[str]) -> None:
        self.transport = transport
        self.names = list(party_names)

    def who(self, k: int) -> str:
        return f"party {k} ({self.names[k]!r})"

    def reset(self) -> None:
        """A new coordinator session: forget everything of the previous one."""

    @staticmethod
    def _table_meta(table: str | None) -> dict[str, Any]:
        return {} if table is None else {"table": table}

    def _check_count(self, k: int, tokens: np.ndarray, expected: int | None, table: str | None) -> None:
        if expected is not None and len(tokens) != expected:
            what = f"table {table!r}" if table else "its training table"
            raise AlignmentError(f"{self.who(k)} sent {len(tokens)} tokens for the {expected} rows of {what}")


class HmacAlignment(_Base):
    """The shared-key mode: parties report ``HMAC-SHA256(key, id)``; the coordinator hashes its own IDs itself."""

    def __init__(self, transport: Transport, party_names: Sequence[str], key: bytes | None) -> None:
        super().__init__(transport, party_names)
        if key is None:
            raise ValueError("alignment = 'hmac' needs hmac_key_file in [coordinator]")
        self.key = key
        log.warning(HMAC_WARNING)

    def party_tokens(self, parties: Sequence[int], table: str | None, own: Sequence[str] | None = None, *,
                     tolerate: bool = False, expected: dict[int, int] | None = None,
                     ) -> tuple[dict[int, np.ndarray], np.ndarray | None]:
        """The HMAC tokens of each party's IDs (of ``table``), and the label holder's of ``own``."""
        self.transport.new_step()
        replies = self.transport.call_many({k: Request("ids", {}, self._table_meta(table)) for k in parties},
                                           tolerate=tolerate)
        out = {k: r.tensors["hashes"].numpy() for k, r in replies.items()}
        for k, tokens in out.items():
            self._check_count(k, tokens, (expected or {}).get(k), table)
        return out, (self.id_tokens(own) if own is not None else None)

    def id_tokens(self, texts: Sequence[str]) -> np.ndarray:
        """The HMAC tokens of the IDs ``texts``."""
        return hash_ids(texts, self.key, normalized=True)


class PsuAlignment(_Base):
    """The keyless private set union (module docstring).  ``alignment_id``: asks the parties to keep this
    session's nonces (to resume a fit with the same tokens), if their policy allows; each keyed party hands out a
    ticket for it, kept in ``tickets`` (with a fit's checkpoints), which a later session presents to resume."""

    def __init__(self, transport: Transport, party_names: Sequence[str], *, alignment_id: str | None = None,
                 threads: int = 0, tickets: AlignmentTickets | None = None) -> None:
        super().__init__(transport, party_names)
        self.alignment_id = alignment_id
        #: where the coordinator's own group arithmetic runs (blinding its IDs, checking replies): every core
        self.work = GroupWork(threads)
        self.tickets = tickets if tickets is not None else AlignmentTickets()
        self.cache_tokens = False
        self.reset()

    def reset(self) -> None:
        """Forget the session's salt and which parties are keyed or opened (a new alignment)."""
        self.salt: list[str] | None = None
        self.keyed: list[int] = []
        self.opened: set[int] = set()
        self.persisted: dict[int, bool] = {}
        self._next = 0
        self.avoid: set[int] = set()  # keyed parties not to ask a lookup of while another can answer (a slow one)
        # lookups each keyed party's budget has left for this coordinator (from its hello; absent: no budget known):
        # a lookup batch goes to the party with the most left, so that one party's budget is not spent first
        self.remaining: dict[int, float] = {}
        # with ``cache_tokens`` (a long-lived prediction service), each ID is looked up once per session
        self.token_cache: dict[str, bytes] = {}

    # ------------------------------------------------------------------ step 1
    def open(self, parties: Sequence[int], tolerate: bool = False) -> None:
        """``psu_open`` at the parties not yet opened in this session (once per session: the salt is fixed then)."""
        todo = [k for k in parties if k not in self.opened]
        if not todo:
            return
        if self.salt is not None:
            raise AlignmentError(f"{[self.who(k) for k in todo]} joined after this session's alignment was opened; "
                                 "open a new session (connect again)")
        self.transport.new_step()
        replies = self.transport.call_many({k: Request("psu_open", {}, self._open_meta(k)) for k in todo},
                                           tolerate=tolerate)
        nonces = []
        for k, r in sorted(replies.items()):
            self.opened.add(k)
            if r.meta.get("keyed"):
                self.keyed.append(k)
                self.persisted[k] = bool(r.meta.get("persisted"))
                nonces.append(str(r.meta.get("nonce")))
                if self.alignment_id is not None:
                    self.tickets.set(self.alignment_id, self.names[k], r.meta.get("ticket"))
        if not self.keyed:
            raise AlignmentError("no party holds the alignment key: give the passive parties alignment_key_file "
                                 "(partialvfl certs init writes one; never to the label holder), or choose "
                                 "alignment = 'hmac' for parties inside one trust domain")
        if len(set(nonces)) != len(nonces):
            raise AlignmentError("two keyed parties sent the same nonce (a replayed psu_open reply)")
        self.salt = sorted(nonces)
        if self.alignment_id is not None:
            kept = [self.names[k] for k in self.keyed if not self.persisted[k]]
            if kept:
                log.warning("parties %s do not keep alignment keys (persist_alignment = false): a resumed fit "
                            "aligns with new tokens", kept)

    def _open_meta(self, k: int) -> dict[str, Any]:
        """``psu_open``'s metadata for party ``k``: keep this alignment (``alignment_id``), and resume it with the
        ticket the party handed out for it, if this coordinator holds one."""
        if self.alignment_id is None:
            return {}
        ticket = self.tickets.get(self.alignment_id, self.names[k])
        return {"alignment_id": self.alignment_id, **({"resume": ticket} if ticket else {})}

    # ------------------------------------------------------------------ steps 2-4
    def party_tokens(self, parties: Sequence[int], table: str | None, own: Sequence[str] | None = None, *,
                     tolerate: bool = False, expected: dict[int, int] | None = None,
                     ) -> tuple[dict[int, np.ndarray], np.ndarray | None]:
        """Tokens of every asked party's table and of the coordinator's own IDs ``own`` (see the module doc)."""
        self.open(parties, tolerate)
        parties = [k for k in parties if k in self.opened]
        self.transport.new_step()
        meta = self._table_meta(table)
        requests = {k: Request("psu_tokens", {}, {**meta, "salt": self.salt}) if k in self.keyed
                    else Request("psu_blind", {}, dict(meta)) for k in parties}
        with ThreadPoolExecutor(2) as pool:  # the coordinator blinds its own IDs while the parties work
            blinding = pool.submit(Blinding, list(own), self.work) if own is not None else None
            replies = self.transport.call_many(requests, tolerate=tolerate)
            mine = blinding.result() if blinding is not None else None
            return self._finish(replies, mine, meta, tolerate, expected or {}, table, pool)

    def _finish(self, replies: dict[int, Any], mine: Blinding | None, meta: dict[str, Any], tolerate: bool,
                expected: dict[int, int], table: str | None, pool: ThreadPoolExecutor,
                ) -> tuple[dict[int, np.ndarray], np.ndarray | None]:
        tokens: dict[int, np.ndarray] = {}
        checks: dict[str, int] = {}
        blinded: dict[int, np.ndarray] = {}
        for k, r in sorted(replies.items()):
            if k in self.keyed:
                tokens[k] = self._checked(k, r.tensors["tokens"], expected.get(k), table)
                checks.setdefault(str(r.meta.get("key_check")), k)
            else:
                pts = as_points(r.tensors["points"], f"{self.who(k)}, psu_blind")
                self._check_count(k, np.empty(len(pts)), expected.get(k), table)
                check_distinct(pts, f"{self.who(k)}, psu_blind")
                blinded[k] = pts
        if len(checks) > 1:
            a, b = sorted(checks.values())[:2]
            raise AlignmentError(f"{self.who(a)} and {self.who(b)} hold different alignment keys: give every "
                                 "passive party the same alignment_key_file")
        evaluated, answers = self._evaluate([*blinded.values(), *([mine.points] if mine else [])], check=False)
        checking = pool.submit(self._validate, answers)  # while the parties unblind: blames a bad evaluator first
        unblinding = None
        if mine is not None:
            unblinding = pool.submit(mine.unblind, evaluated.pop(), "the keyed parties' psu_eval replies")
        try:
            tokens.update(self._unblind(dict(zip(blinded, evaluated, strict=True)), meta, tolerate))
        finally:
            checking.result()
        return tokens, (unblinding.result() if unblinding is not None else None)

    def id_tokens(self, texts: Sequence[str]) -> np.ndarray:
        """Tokens of the coordinator's own IDs: blinded, evaluated by one keyed party in one round, unblinded."""
        if self.salt is None:
            raise AlignmentError("align the parties first: this session's alignment is not open")
        if not self.cache_tokens:
            mine = Blinding(list(texts), self.work)
            evaluated = self._evaluate([mine.points])[0][0]
            return mine.unblind(evaluated, "the keyed party's psu_eval reply")
        cache = self.token_cache
        todo = [t for t in dict.fromkeys(texts) if t not in cache]
        if todo:
            mine = Blinding(todo, self.work)
            evaluated = self._evaluate([mine.points])[0][0]
            got = mine.unblind(evaluated, "the keyed party's psu_eval reply")
            cache.update(zip(todo, (bytes(row) for row in got), strict=True))
        if not texts:
            return np.zeros((0, 32), dtype=np.uint8)
        return np.frombuffer(b"".join(cache[t] for t in texts), dtype=np.uint8).reshape(len(texts), 32).copy()

    def _checked(self, k: int, arr: torch.Tensor, expected: int | None, table: str | None) -> np.ndarray:
        tokens = as_points(arr, f"{self.who(k)}, psu_tokens")
        self._check_count(k, tokens, expected, table)
        check_distinct(tokens, f"{self.who(k)}, psu_tokens")
        return tokens  # only compared: an invalid encoding would match nothing (the group operations check theirs)

    def _validate(self, answers: dict[int, np.ndarray]) -> None:
        for k, got in answers.items():
            self.work.validate(got, f"{self.who(k)}, psu_eval")

    def _evaluate(self, sets: list[np.ndarray], check: bool = True,
                  ) -> tuple[list[np.ndarray], dict[int, np.ndarray]]:
        """Every set raised to the session key by the keyed parties: the concatenation split over them in one round
        (a single small set goes to one party, taking turns).  Also returns each party's answer, validated here
        with ``check``, else by the caller before another party uses it."""
        flat = np.concatenate(sets) if sets else np.zeros((0, 32), dtype=np.uint8)
        if not len(flat):
            return [np.zeros((0, 32), dtype=np.uint8) for _ in sets], {}
        n_parts = len(self.keyed) if len(flat) >= 4096 else 1  # a lookup batch: one round to one party
        chunk = -(-len(flat) // n_parts)
        parts = {}
        turns = [k for k in self.keyed if k not in self.avoid] if n_parts == 1 else []
        if turns and self.remaining:  # the parties with the most budget left, taking turns among them
            most = max(self.remaining.get(k, math.inf) for k in turns)
            turns = [k for k in turns if self.remaining.get(k, math.inf) == most]
        for i in range(n_parts):
            k = turns[self._next % len(turns)] if turns else self.keyed[(self._next + i) % len(self.keyed)]
            parts[k] = (i * chunk, min(len(flat), (i + 1) * chunk))
        self._next += 1
        self.transport.new_step()
        replies = self.transport.call_many({k: Request("psu_eval", {"points": torch.from_numpy(
            np.ascontiguousarray(flat[a:b]))}, {"salt": self.salt}) for k, (a, b) in parts.items()})
        for k, (a, b) in parts.items():  # what each party's budget has left, as it counts (a refusal charges none)
            if k in self.remaining:
                self.remaining[k] -= b - a
        out: list[np.ndarray] = []
        answers: dict[int, np.ndarray] = {}
        for k, (a, b) in sorted(parts.items(), key=lambda kv: kv[1]):
            got = as_points(replies[k].tensors["points"], f"{self.who(k)}, psu_eval")
            if len(got) != b - a:
                raise AlignmentError(f"{self.who(k)} answered psu_eval with {len(got)} elements for {b - a} sent")
            answers[k] = got
            out.append(got)
        out_all = np.concatenate(out)
        if check:
            self._validate(answers)
        result, start = [], 0
        for s in sets:
            result.append(out_all[start:start + len(s)])
            start += len(s)
        return result, answers

    def _unblind(self, evaluated: dict[int, list[bytes]], meta: dict[str, Any], tolerate: bool,
                 ) -> dict[int, np.ndarray]:
        if not evaluated:
            return {}
        self.transport.new_step()
        replies = self.transport.call_many({k: Request("psu_unblind", {"points": torch.from_numpy(
            np.ascontiguousarray(v))}, dict(meta)) for k, v in evaluated.items()}, tolerate=tolerate)
        return {k: self._checked(k, r.tensors["tokens"], len(evaluated[k]), meta.get("table"))
                for k, r in replies.items()}


def make_alignment(mode: str, transport: Transport, party_names: Sequence[str], *, key: bytes | None = None,
                   alignment_id: str | None = None, tickets: AlignmentTickets | None = None,
                   ) -> HmacAlignment | PsuAlignment:
    """The coordinator's alignment for ``mode`` (``"psu"``, the default, or the explicit ``"hmac"``)."""
    if mode == "hmac":
        return HmacAlignment(transport, party_names, key)
    if mode != "psu":
        raise ValueError(f"alignment must be one of {list(ALIGNMENT_MODES)}, got {mode!r}")
    return PsuAlignment(transport, party_names, alignment_id=alignment_id, tickets=tickets)
