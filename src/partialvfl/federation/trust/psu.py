"""Keyless alignment: a private set union of the parties' IDs in the ristretto255 group (the default).

**Group.**  ristretto255 (a prime-order group built on Curve25519) from libsodium, through the ``rbcl`` package
(PyNaCl 1.6 exposes no ristretto255 functions; ``rbcl`` ships libsodium with exactly these bindings).  No curve
arithmetic is written here.  An ID, normalised by :mod:`partialvfl.data.ids`, is mapped into the group as
``H(id) = ristretto255_from_hash(SHA-512(DOMAIN || id))`` (libsodium's hash-to-group, with our domain separation).

**Keys.**  The *passive* parties (every party but the label holder's own block) share a long-term alignment secret
``S`` (a file, ``alignment_key_file``; ``partialvfl certs init`` writes one), which the coordinator and the label
holder's own party process never hold.  At the start of every coordinator session each keyed party draws a fresh
nonce; the session key is ``a = reduce(HMAC-SHA512(S, KEY_DOMAIN || sorted nonces))``, so tokens of two sessions
are unlinkable unless the party itself reuses its nonce: a coordinator that asks to keep a session (to resume a fit)
gets a *ticket* (32 random bytes) under which the party keeps that nonce in its own state, bound to that
coordinator's certificate key; presenting it later resumes exactly that session's tokens (``persist_alignment``).
A salt or name the coordinator chooses cannot reproduce an earlier session's tokens (the research preset's
``resume_alignment_by_name`` also honours a name, so that simulations reproduce).

**Tokens.**  A keyed party reports ``T(y) = H(y)^a`` for its rows.  Everyone else (the label holder's party process,
the coordinator's label table and the IDs it predicts) gets tokens through an oblivious evaluation by one keyed party:
blind ``H(x)^r`` with a fresh secret scalar ``r``, have it raised to ``a`` (``psu_eval``), unblind with ``1/r``.
The evaluating party sees only uniformly random group elements; it counts them against its lookup budget (a ledger
per coordinator identity in its own state, over time windows and in total: :mod:`partialvfl.federation.trust.lookups`)
and its access log records every request.  The coordinator matches tokens (the union's membership pattern),
but cannot compute ``T`` for a guessed ID without a keyed party's online answer.  The security argument is in
``docs/security.md`` ("Alignment without a central table").

This module holds the group operations and the party's side (:class:`PartyAligner`); the coordinator's side is
:mod:`partialvfl.federation.grpc.psu_session`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from partialvfl.data.ids import normalize_ids, read_key
from partialvfl.federation.trust.group_work import DOMAIN, POINT_BYTES, AlignmentError, GroupWork
from partialvfl.federation.trust.group_work import sodium as _sodium
from partialvfl.federation.trust.lookups import LookupLedger
from partialvfl.federation.trust.token_index import TokenIndex, as_keys, first_repeat
from partialvfl.federation.wire.messages import Reply, Request
from partialvfl.federation.wire.meta_keys import MetaKey
from partialvfl.federation.wire.refusals import PolicyViolation
from partialvfl.federation.wire.schema import MessageSpec, TensorSpec
from partialvfl.utils.private_files import write_private_json

__all__ = ["DOMAIN", "POINT_BYTES", "PSU_MESSAGES", "AlignmentError", "Blinding", "GroupWork", "PartyAligner",
           "evaluate", "hash_to_group", "key_check", "points_array", "points_list", "random_scalar", "session_key",
           "session_order", "validate_points", "write_alignment_key"]

#: domain separation of the session key (version 1 of the protocol; the hash into the group's: DOMAIN)
KEY_DOMAIN = b"partialvfl/psu/v1/session-key\x00"
CHECK_DOMAIN = b"partialvfl/psu/v1/key-check\x00"
NONCE_BYTES = 32

#: a table the party serves (its training table when left out)
TABLE = MetaKey(str, doc="a table the party serves")
#: the session's salt: every keyed party's nonce (hex)
SALT = MetaKey(tuple[str, ...], doc="every keyed party's nonce")

#: the party server's alignment messages (built-in kinds, beside ``hello``/``ids``/``attach``/``release``)
PSU_MESSAGES: dict[str, MessageSpec] = {
    "psu_open": MessageSpec(optional_meta={"alignment_id": MetaKey(str, doc="keep this alignment under this name"),
                                           "resume": MetaKey(str, doc="a ticket the party handed out")},
                            doc="Start this session's alignment: a keyed party replies a fresh nonce; with "
                                "`alignment_id` (keep it, to resume a fit) also a `ticket`, and with `resume` (a "
                                "ticket it handed this coordinator before) the nonce it kept under it, if its policy "
                                "persists alignment keys."),
    "psu_tokens": MessageSpec(reply=[TensorSpec("tokens", "uint8", ("N", 32))], meta={"salt": SALT},
                              optional_meta={"table": TABLE},
                              doc="A keyed party's tokens H(id)^a of its table's rows, sorted; `salt` is every keyed "
                                  "party's nonce."),
    "psu_blind": MessageSpec(reply=[TensorSpec("points", "uint8", ("N", 32))], optional_meta={"table": TABLE},
                             doc="A party without the alignment key: its rows blinded, H(id)^r, sorted."),
    "psu_unblind": MessageSpec(request=[TensorSpec("points", "uint8", ("N", 32))],
                               reply=[TensorSpec("tokens", "uint8", ("N", 32))], optional_meta={"table": TABLE},
                               doc="Its blinded rows raised to the session key, in psu_blind's order: the party "
                                   "removes r and replies its tokens, sorted."),
    "psu_eval": MessageSpec(request=[TensorSpec("points", "uint8", ("N", 32))],
                            reply=[TensorSpec("points", "uint8", ("N", 32))], meta={"salt": SALT},
                            doc="Raise blinded points to the session key (an oblivious lookup: charged to the "
                                "coordinator's lookup budget, a ledger in the party's state, and logged)."),
}


# ---------------------------------------------------------------------- the group (libsodium, through rbcl)
def random_scalar() -> bytes:
    """A uniformly random non-zero scalar (libsodium's ``crypto_core_ristretto255_scalar_random``)."""
    return _sodium().crypto_core_ristretto255_scalar_random()


def invert(scalar: bytes) -> bytes:
    return _sodium().crypto_core_ristretto255_scalar_invert(scalar)


def hash_to_group(texts: Sequence[str], threads: int = 1) -> list[bytes]:
    """``H(id)`` for normalised ID texts: SHA-512 of the domain and the UTF-8 text, mapped into ristretto255."""
    return points_list(GroupWork(threads).hashed(texts), "hashed IDs")


def evaluate(points: Sequence[bytes], scalar: bytes, where: str, threads: int = 1) -> list[bytes]:
    """Every point raised to ``scalar``; an invalid encoding is an :class:`AlignmentError` naming ``where`` and the
    element (libsodium refuses non-canonical encodings, points off the group and the identity).  ``threads`` > 1
    splits the work (libsodium runs without the GIL); :class:`GroupWork` does the same on arrays."""
    return points_list(GroupWork(threads).evaluate(points_array(points), scalar, where), where)


def validate_points(points: Sequence[bytes] | np.ndarray, where: str, work: GroupWork | None = None) -> None:
    """Refuse an encoding that is not a ristretto255 group element (or is the identity), naming ``where``."""
    arr = points if isinstance(points, np.ndarray) else points_array(points)
    (work or GroupWork(1)).validate(arr, where)


def points_array(points: Sequence[bytes]) -> np.ndarray:
    """``(n, 32)`` uint8 array of encoded points."""
    if not points:
        return np.zeros((0, POINT_BYTES), dtype=np.uint8)
    return np.frombuffer(b"".join(points), dtype=np.uint8).reshape(len(points), POINT_BYTES).copy()


def points_list(arr: Any, where: str) -> list[bytes]:
    """The rows of an ``(n, 32)`` uint8 array (or tensor) as bytes; anything else names ``where``."""
    a = np.asarray(arr.numpy() if hasattr(arr, "numpy") else arr)
    if a.dtype != np.uint8 or a.ndim != 2 or a.shape[1] != POINT_BYTES:
        raise AlignmentError(f"{where}: expected an (n, {POINT_BYTES}) uint8 array of points, got {a.dtype} {a.shape}")
    raw = np.ascontiguousarray(a).tobytes()
    return [raw[i:i + POINT_BYTES] for i in range(0, len(raw), POINT_BYTES)]


def as_points(arr: Any, where: str) -> np.ndarray:
    """An ``(n, 32)`` uint8 array of points from an array or tensor; anything else names ``where``."""
    a = np.asarray(arr.numpy() if hasattr(arr, "numpy") else arr)
    if a.dtype != np.uint8 or a.ndim != 2 or a.shape[1] != POINT_BYTES:
        raise AlignmentError(f"{where}: expected an (n, {POINT_BYTES}) uint8 array of points, got {a.dtype} {a.shape}")
    return np.ascontiguousarray(a)


def check_distinct(points: Sequence[bytes] | np.ndarray, where: str) -> None:
    arr = points if isinstance(points, np.ndarray) else points_array(points)
    if first_repeat(arr) is not None:
        raise AlignmentError(f"{where}: the set holds the same element twice (a duplicated or replayed set)")


# ---------------------------------------------------------------------- keys
def _salt_bytes(salt: Sequence[str]) -> bytes:
    return b"".join(bytes.fromhex(n) for n in sorted(salt))


def check_salt(salt: Any, where: str) -> list[str]:
    """A salt is a non-empty list of distinct 32-byte hex nonces."""
    ok = isinstance(salt, list) and salt and all(isinstance(n, str) and len(n) == 2 * NONCE_BYTES for n in salt)
    if ok:
        try:
            _salt_bytes(salt)
        except ValueError:
            ok = False
    if not ok or len(set(salt)) != len(salt):
        raise AlignmentError(f"{where}: 'salt' must be a list of distinct {NONCE_BYTES}-byte hex nonces")
    return sorted(salt)


def session_key(secret: bytes, salt: Sequence[str]) -> bytes:
    """The session's scalar ``a``: HMAC-SHA512 of the sorted nonces under the shared secret, reduced mod the order."""
    wide = hmac.new(secret, KEY_DOMAIN + _salt_bytes(salt), hashlib.sha512).digest()
    return _sodium().crypto_core_ristretto255_scalar_reduce(wide)


def key_check(secret: bytes, salt: Sequence[str]) -> str:
    """A value that tells whether two parties hold the same secret (a PRF of this session's salt: reveals nothing)."""
    return hmac.new(secret, CHECK_DOMAIN + _salt_bytes(salt), hashlib.sha256).hexdigest()[:16]


def write_alignment_key(path: str | Path) -> Path:
    """A fresh 32-byte alignment secret as hex text, readable by its owner only (for the passive parties)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(secrets.token_hex(32) + "\n")
    p.chmod(0o600)
    return p


def read_alignment_key(path: str | Path) -> bytes:
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"alignment key file not found: {p} (make one with `partialvfl certs init`; only "
                                "the passive parties hold it)")
    return read_key(p)


def session_order(ids: Sequence[str], secret: bytes, salt: Sequence[str]) -> np.ndarray:
    """Positions that put normalised ``ids`` in the order a federation aligned with ``secret`` and ``salt`` built
    (sorted by token): for comparing an in-process fit with a federated one, by whoever holds every key."""
    texts = normalize_ids(ids, "IDs", unique=False)
    tokens = GroupWork().tokens(texts, session_key(secret, check_salt(list(salt), "salt")))
    return np.argsort(tokens.view("S32").ravel(), kind="stable").astype(np.int64)


class Blinding:
    """One set of the holder's own IDs, blinded with a fresh secret scalar ``r`` and unblinded after evaluation;
    ``points`` and the unblinded tokens are ``(n, 32)`` uint8 arrays."""

    def __init__(self, texts: Sequence[str], threads: int | GroupWork = 0) -> None:
        self.r = random_scalar()
        self.work = threads if isinstance(threads, GroupWork) else GroupWork(threads)
        self.points = self.work.tokens(texts, self.r)

    def unblind(self, evaluated: np.ndarray, where: str) -> np.ndarray:
        """``H(x)^a`` from ``H(x)^(r a)``; a wrong count or an invalid element names ``where``."""
        if len(evaluated) != len(self.points):
            raise AlignmentError(f"{where}: {len(evaluated)} evaluated elements for {len(self.points)} sent")
        return self.work.evaluate(evaluated, invert(self.r), where)


# ---------------------------------------------------------------------- a party's side
class PartyAligner:
    """A party's alignment state for the current coordinator session.

    ``secret``: the passive parties' shared alignment secret (``None``: a party without it, e.g. the label holder's
    own block, which gets its tokens through a keyed party).  ``texts(table)`` gives a table's normalised IDs.
    ``persist``: whether the party keeps a session's nonce when a coordinator asks (to resume a fit), under a ticket
    it hands that coordinator (and, with ``resume_by_name``, under the coordinator's ``alignment_id`` too: research
    runs, where a fit with the same seed gets the same tokens).  ``max_lookups``: points evaluated per coordinator
    session; ``ledger``: the party's lookup budget across sessions (:mod:`partialvfl.federation.trust.lookups`).  The
    server sets ``caller`` (the asking coordinator's certificate key fingerprint) and ``caller_name`` per request.
    ``threads`` and ``ray_address``: where its group arithmetic runs (:class:`GroupWork`; by default every local
    core); the results are the same wherever it runs.
    """

    def __init__(self, name: str, secret: bytes | None, texts: Callable[[str], Sequence[str]], state_dir: Path, *,
                 persist: bool = True, max_lookups: int | None = None, threads: int = 0,
                 ledger: LookupLedger | None = None, resume_by_name: bool = False,
                 ray_address: str | None = None) -> None:
        self.name, self.secret, self.texts = name, secret, texts
        self.state_dir, self.persist, self.max_lookups = state_dir, persist, max_lookups
        self.work = GroupWork(threads, ray_address)
        self.ledger, self.resume_by_name = ledger, resume_by_name
        self.caller, self.caller_name = "coordinator", ""
        self.lookups = 0
        self.new_session()

    @property
    def keyed(self) -> bool:
        """Whether this party holds the alignment key (a passive party)."""
        return self.secret is not None

    def new_session(self, resumed: bool = False) -> None:
        """Forget every key, blinding and token of the previous session (``resumed``: the same coordinator session
        goes on, e.g. after its coordinator restarted, and keeps counting its lookups)."""
        self.nonce: str | None = None
        self.salt: list[str] | None = None
        self.key: bytes | None = None
        self.rows: dict[str, TokenIndex] = {}
        self.blinded: dict[str, tuple[Blinding, np.ndarray]] = {}
        self.evaluated = np.zeros(0, dtype="S32")  # every point evaluated in this session, sorted
        if not resumed:
            self.lookups = 0

    def _where(self, what: str) -> str:
        return f"party {self.name!r}, {what}"

    # -- psu_open
    def open(self, alignment_id: Any = None, resume: Any = None) -> dict[str, Any]:
        """Start this session's alignment: a fresh nonce, unless ``resume`` is a ticket this party handed the same
        coordinator for an earlier session (or, with ``resume_by_name``, ``alignment_id`` names one); a coordinator
        that asks to keep the session (``alignment_id``) gets a ticket for it."""
        if self.nonce is not None:
            raise AlignmentError(self._where("psu_open: this session's alignment is already open"))
        if not self.keyed:
            self.nonce = ""
            return {"keyed": False}
        kept = None
        if self.persist and isinstance(resume, str):
            kept = self._ticket_nonce(resume)
        if kept is None and self.persist and self.resume_by_name and alignment_id is not None:
            kept = self._named_nonce(alignment_id)
        self.nonce = kept or secrets.token_hex(NONCE_BYTES)
        reply: dict[str, Any] = {"keyed": True, "nonce": self.nonce, "persisted": kept is not None,
                                 "resumed": kept is not None}
        if alignment_id is not None and self.persist:
            if kept is None:
                ticket = secrets.token_hex(NONCE_BYTES)
                write_private_json(self._ticket_file(ticket), {"nonce": self.nonce, "coordinator": self.caller,
                                                           "created": time.time()})
                reply.update(persisted=True, ticket=ticket)
                if self.resume_by_name and not self._named_file(alignment_id).is_file():
                    write_private_json(self._named_file(alignment_id), {"nonce": self.nonce})
            elif isinstance(resume, str):
                reply["ticket"] = resume
        return reply

    def _ticket_file(self, ticket: str) -> Path:
        return self.state_dir / "alignment" / "tickets" / f"{hashlib.sha256(ticket.encode()).hexdigest()[:32]}.json"

    def _ticket_nonce(self, ticket: str) -> str | None:
        """The nonce kept under ``ticket``, if this party issued it to the coordinator asking now."""
        path = self._ticket_file(ticket)
        if not path.is_file():
            return None
        kept = json.loads(path.read_text())
        if not hmac.compare_digest(str(kept.get("coordinator", "")).encode(), self.caller.encode()):
            return None  # another coordinator's ticket: it cannot link this party's sessions
        return str(kept["nonce"])

    def _named_file(self, alignment_id: Any) -> Path:
        digest = hashlib.sha256(str(alignment_id).encode()).hexdigest()[:32]
        return self.state_dir / "alignment" / f"{digest}.json"

    def _named_nonce(self, alignment_id: Any) -> str | None:
        path = self._named_file(alignment_id)
        return str(json.loads(path.read_text())["nonce"]) if path.is_file() else None

    def _session_key(self, salt: Any, kind: str) -> bytes:
        if not self.keyed:
            raise AlignmentError(self._where(f"{kind}: this party holds no alignment key (it is not a passive "
                                             "party); ask a party with alignment_key_file"))
        if not self.nonce:
            raise AlignmentError(self._where(f"{kind}: open the session's alignment first (psu_open)"))
        salt = check_salt(salt, self._where(kind))
        if self.nonce not in salt:
            raise AlignmentError(self._where(f"{kind}: the salt does not hold this party's nonce of this session"))
        if self.salt is not None and salt != self.salt:
            raise AlignmentError(self._where(f"{kind}: the salt changed within the session"))
        if self.key is None:
            assert self.secret is not None
            self.salt, self.key = salt, session_key(self.secret, salt)
        return self.key

    def _index(self, table: str, tokens: np.ndarray, rows: np.ndarray | None, kind: str) -> np.ndarray:
        check_distinct(tokens, self._where(f"{kind} of table {table!r}"))
        self.rows[table] = index = TokenIndex(tokens, rows)
        return index.sorted_tokens()

    # -- psu_tokens (keyed)
    def tokens(self, table: str, salt: Any) -> tuple[np.ndarray, dict[str, Any]]:
        """``psu_tokens``: the session's tokens of the party's IDs of ``table``, and what the reply says of them."""
        key = self._session_key(salt, "psu_tokens")
        tokens = self.work.tokens(self.texts(table), key)
        assert self.secret is not None and self.salt is not None
        return self._index(table, tokens, None, "psu_tokens"), {"key_check": key_check(self.secret,
                                                                                                     self.salt)}

    # -- psu_blind / psu_unblind (no key)
    def blind(self, table: str) -> np.ndarray:
        """``psu_blind``: the blinded points of the party's IDs of ``table`` (a party without the key)."""
        if self.keyed:
            raise AlignmentError(self._where("psu_blind: a keyed party reports its tokens (psu_tokens)"))
        blinding = Blinding(self.texts(table), self.work)
        order = np.argsort(blinding.points.view("S32").ravel(), kind="stable").astype(np.int64)
        blinding.points = blinding.points[order]
        self.blinded[table] = (blinding, order)
        return blinding.points

    def unblind(self, table: str, points: Any) -> np.ndarray:
        """``psu_unblind``: the tokens of the points blinded for ``table``, once a keyed party evaluated them."""
        if table not in self.blinded:
            raise AlignmentError(self._where(f"psu_unblind: table {table!r} was not blinded in this session"))
        blinding, order = self.blinded.pop(table)
        tokens = blinding.unblind(as_points(points, self._where("psu_unblind")), self._where("psu_unblind"))
        return self._index(table, tokens, order, "psu_unblind")

    # -- psu_eval (keyed): the oblivious lookup
    def evaluate(self, points: Any, salt: Any) -> np.ndarray:
        """``psu_eval``: the keyed evaluation of another party's blinded ``points`` (distinct points only)."""
        key = self._session_key(salt, "psu_eval")
        arr = as_points(points, self._where("psu_eval"))
        check_distinct(arr, self._where("psu_eval"))
        keys = as_keys(arr)
        seen = self.evaluated
        if len(seen) and bool((seen[np.minimum(np.searchsorted(seen, keys), len(seen) - 1)] == keys).any()):
            raise AlignmentError(self._where("psu_eval: elements already evaluated in this session (a replayed set)"))
        n = len(keys)
        if self.max_lookups is not None and self.lookups + n > self.max_lookups:
            raise PolicyViolation("max_lookups", f"evaluating {n} more IDs would make {self.lookups + n} "
                                  f"in this session; at most {self.max_lookups}", self.lookups + n,
                                  {"max_lookups": self.lookups + n})
        if self.ledger is not None:  # the party's budget across sessions: refused before anything is computed
            self.ledger.check(self.caller, n, self.caller_name)
        out = self.work.evaluate(arr, key, self._where("psu_eval"))
        self.lookups += n
        self.evaluated = np.sort(np.concatenate([seen, keys]))
        if self.ledger is not None:
            self.ledger.record(self.caller, n, self.caller_name)
        return out

    def handlers(self, table_name: Callable[[Request], str]) -> dict[str, tuple[MessageSpec, Callable[..., Reply]]]:
        """The party server's alignment kinds (``table_name(request)``: the table a request names, checked)."""
        import torch

        def t(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a)

        def tokens(req: Request) -> Reply:
            arr, meta = self.tokens(table_name(req), req.meta.get("salt"))
            return Reply({"tokens": t(arr)}, meta)

        fns: dict[str, Callable[[Request], Reply]] = {
            "psu_open": lambda req: Reply(meta=self.open(req.meta.get("alignment_id"), req.meta.get("resume"))),
            "psu_tokens": tokens,
            "psu_blind": lambda req: Reply({"points": t(self.blind(table_name(req)))}),
            "psu_unblind": lambda req: Reply({"tokens": t(self.unblind(table_name(req), req.tensors["points"]))}),
            "psu_eval": lambda req: Reply({"points": t(self.evaluate(req.tensors["points"], req.meta.get("salt")))}),
        }
        return {k: (PSU_MESSAGES[k], fn) for k, fn in fns.items()}

    def budget(self) -> dict[str, Any]:
        """What the party tells a coordinator about its lookup budget in its ``hello``: the limits and what that
        coordinator has used ({} for a party without the key or without a budget)."""
        if not self.keyed or self.ledger is None:
            return {}
        used = self.ledger.counts(self.caller)
        return {"limits": dict(self.ledger.limits), "used": {rule: used[rule] for rule in self.ledger.limits}}

    def row_index(self, table: str) -> TokenIndex:
        """Token -> row of ``table`` in this session (``attach`` names rows by token)."""
        if table not in self.rows:
            raise AlignmentError(self._where(f"table {table!r} is not aligned in this session (psu_tokens or "
                                             "psu_unblind first)"))
        return self.rows[table]
