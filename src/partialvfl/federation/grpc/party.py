"""The party server: one long-lived gRPC server per institution (``partialvfl party serve --config FILE``,
:mod:`partialvfl.federation.grpc.party_process`).

It reads the party's own tables (CSV or Parquet with an ID column: its training table and, separately, tables of
users to predict) and nothing else, keeps one :class:`~partialvfl.federation.runtime.party.PartyRuntime` (so a program's
forward state lives between the calls of a step), and answers the coordinator over mutual TLS.  Before a request
reaches the runtime the server checks, in order:

1. the peer's certificate identity (CN or a DNS SAN) is on the allowlist -> else ``PERMISSION_DENIED``, and its
   certificate is the one the party pins for that name (``[peers.NAME]``: key fingerprint or CA,
   :mod:`partialvfl.federation.trust.pins`) -> else ``UNAUTHENTICATED``; this is checked when the call starts, *before*
   the request body is read;
2. the peer's bounds (:mod:`partialvfl.federation.grpc.limits`): calls in flight, the request's length (its header
   states it; gRPC refuses any wire message over a chunk), request bytes held -> else ``RESOURCE_EXHAUSTED``; the
   request is read into one buffer its tensors use in place, and it is a well-formed frame of allowed dtypes -> else
   ``INVALID_ARGUMENT``;
3. the message belongs to the current coordinator session (:mod:`partialvfl.federation.grpc.sessions`: a ``hello``
   while another session is live is refused, ``ABORTED``, unless it carries that session's secret), its sequence
   number is new, its step is not older than the last one and its ``(step, round, kind)`` was not served yet ->
   else ``FAILED_PRECONDITION`` (stale), ``ABORTED`` (another session's) or ``ALREADY_EXISTS`` (replay); a ``hello``
   changes the session only once it passed every check;
4. the party's policy (:mod:`partialvfl.federation.trust.policy`) admits it: the program and its architecture at
   ``setup``, learning rates, weight sharing, the number of data sets held, and that rows of a prediction table
   are only predicted -> else ``PERMISSION_DENIED`` naming the rule;
5. the kind is declared (a built-in or one of the program's ``messages``) -> else ``UNIMPLEMENTED``
   (``FAILED_PRECONDITION`` before any setup), and its tensors and metadata match the declaration -> else
   ``INVALID_ARGUMENT`` (the runtime checks, as in process: :mod:`partialvfl.federation.wire.schema`).

A handler that raises on bad input (``ValueError``, ``KeyError``, shape errors...) becomes ``INVALID_ARGUMENT``
with the party's message; a reply that does not match its declaration (the program's own bug) ``INTERNAL``; a reply
that would carry one of the party's own parameters or optimiser-state tensors is not sent (``PERMISSION_DENIED``)
unless the policy allows weight sharing.  Every request, served or refused, is written to the party's access log
(:mod:`partialvfl.federation.trust.access_log`), and the server keeps serving.

Built-in kinds of the server (besides the runtime's ``ping``/``setup``/``save``/``load``/``forget``): ``hello``
(open a coordinator session), ``bye`` (end it), the alignment kinds ``psu_*`` (:mod:`partialvfl.federation.trust.psu`,
the default) or, with ``alignment = "hmac"``, ``ids`` (the IDs of a table as HMAC hashes), ``attach`` (hold the rows
of a table, named by their alignment tokens, at the given positions of the shared order under a handle),
``release``.  ``save``/``load`` directories are resolved inside the party's own state directory: a party's model
state stays on its own disk.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import PurePosixPath
from typing import Any

import grpc

from partialvfl.federation.grpc.frames import (
    MAX_WIRE_MESSAGE,
    SECONDS_KEY,
    WireError,
    WireRequest,
    decode_request,
    encode_reply,
)
from partialvfl.federation.grpc.limits import PeerLimits, Refused, read_request
from partialvfl.federation.grpc.party_config import TRAINING_TABLE, PartyConfig
from partialvfl.federation.grpc.party_resume import ResumeStore
from partialvfl.federation.grpc.party_tables import TableBuiltins
from partialvfl.federation.grpc.sessions import SessionGuard
from partialvfl.federation.grpc.transport import ATTACH_PREFIX
from partialvfl.federation.runtime.party import PartyRuntime
from partialvfl.federation.trust.access_log import AccessLog, AccessLogConfig, tensor_summary
from partialvfl.federation.trust.alignment import load_key
from partialvfl.federation.trust.audit import disclosed_state
from partialvfl.federation.trust.guards import InferenceGuard
from partialvfl.federation.trust.lookups import LOOKUP_LEDGER, LookupLedger
from partialvfl.federation.trust.pins import spki_sha256
from partialvfl.federation.trust.psu import TABLE, PartyAligner, read_alignment_key
from partialvfl.federation.wire.messages import Reply, Request
from partialvfl.federation.wire.meta_keys import COUNT, MetaKey
from partialvfl.federation.wire.program import NotSetUp
from partialvfl.federation.wire.refusals import PolicyViolation
from partialvfl.federation.wire.schema import INFERS, MessageError, MessageSpec, TensorSpec, UnknownKindError

__all__ = ["LOGGED_META", "PRIVACY_LEDGER", "SERVER_MESSAGES", "PartyServer"]

log = logging.getLogger("partialvfl.party")
#: Request metadata copied into the access log (what was asked for, never a value the party computed).
LOGGED_META = ("data", "handle", "table", "program", "train", "dir", "n_samples", "rows", "predictions")
#: The party's differential-privacy ledger in its state directory (mu^2 spent per row, kept across restarts).
PRIVACY_LEDGER = "privacy-ledger.npz"

#: The server's own message kinds (besides the runtime's ``ping``/``setup``/``save``/``load``/``forget``).
SERVER_MESSAGES: dict[str, MessageSpec] = {
    "hello": MessageSpec(optional_meta={"resume": MetaKey(str, doc="the live session's secret"),
                                        "continue_session": MetaKey(bool, doc="continue the session as it is (a "
                                                                    "restarted party that kept it on disk)"),
                                        "lane_seqs": MetaKey(dict, doc="lane -> its last sequence number")},
                         doc="Open a coordinator session (refused while another one is live, unless `resume` is "
                             "that session's secret; with `continue_session`, refused unless the party holds that "
                             "very session, which then goes on as it was: its alignment, data and program, "
                             "`continued` and what it holds in the reply); replies the party's name, index, row "
                             "count, feature shape, the "
                             "names and row counts of its prediction tables and the session's secret as metadata "
                             "(and `dp`, its differential-privacy budget, where it keeps one)."),
    "bye": MessageSpec(doc="End this coordinator session (another coordinator may then say hello)."),
    "ids": MessageSpec(reply=[TensorSpec("hashes", "uint8", ("N", 32))], optional_meta={"table": TABLE},
                       doc="alignment = 'hmac' only: the IDs of the training table (or of prediction table `table`) "
                           "as HMAC-SHA256 hashes."),
    "attach": MessageSpec(
        request=[TensorSpec("hashes", "uint8", ("R", 32)), TensorSpec("rows", "int64", ("R",)),
                 TensorSpec("table_of", "int64", ("R",), optional=True),
                 TensorSpec("labels", ("int64", "float64"), ("N",), optional=True),
                 TensorSpec("labeled", "bool", ("N",), optional=True),
                 TensorSpec("features", ("float32", "float64"), ("F", "D"), optional=True),
                 TensorSpec("feature_rows", "int64", ("F",), optional=True)],
        meta={"handle": MetaKey(str, doc="the handle it attaches the rows under"), "n_samples": COUNT},
        optional_meta={"table": TABLE, "tables": MetaKey(tuple[str, ...], doc="tables, indexed by `table_of`"),
                       "feature_ids": MetaKey(tuple[str, ...], doc="one ID per row of `features`")},
        doc="Hold the rows with these alignment tokens (or HMAC hashes) at these positions of the shared order (of "
            "`n_samples`) under "
            "`handle`, from the training table or from prediction table `table` (then only predicted, never "
            "trained on), or row by row from the tables `tables` (`table_of`: each row's index into that list); "
            "the active party also gets the labels (training table only). `features`/`feature_rows`/`feature_ids`: "
            "the coordinator's own values of this party's features for rows it holds in no table (the label "
            "holder's new users; only predicted), accepted only under `[policy] accept_coordinator_features`."),
    "release": MessageSpec(meta={"handle": MetaKey(str)}, doc="Drop the data attached under `handle`."),
}


# ---------------------------------------------------------------------- the server
class PartyServer(TableBuiltins):
    """The party's request handler: authentication, replay checks, policy, then the runtime (declarations,
    handlers); every request is written to the access log."""

    def __init__(self, cfg: PartyConfig, key: bytes | None = None) -> None:
        self.cfg = cfg
        if key is None and cfg.alignment == "hmac":
            if cfg.hmac_key_file is None:
                raise ValueError(f"party {cfg.name!r}: alignment = 'hmac' needs hmac_key_file in [party]")
            key = load_key(cfg.hmac_key_file)
        self._read_tables(key)
        handlers = {"hello": self._hello, "bye": self._bye, "ids": self._ids, "attach": self._attach,
                    "release": self._release}
        self.state_dir = cfg.state_dir.resolve()
        where = f"party {cfg.index} ({cfg.name!r})"
        limits = cfg.policy.lookup_limits(len(self.table.ids))
        self.lookups = LookupLedger(limits, self.state_dir / LOOKUP_LEDGER, where=where,
                                    warn_fraction=cfg.policy.lookup_warn_fraction)  # kept across sessions, restarts
        self.aligner = PartyAligner(  # the keyless alignment (unused with alignment = "hmac")
            cfg.name, read_alignment_key(cfg.alignment_key_file) if cfg.alignment_key_file else None,
            lambda name: self.tables[name].ids, self.state_dir, persist=cfg.policy.persist_alignment,
            max_lookups=cfg.policy.max_lookups, threads=cfg.alignment_threads, ledger=self.lookups if limits else None,
            resume_by_name=cfg.policy.resume_alignment_by_name, ray_address=cfg.ray_address)
        builtins = {k: (SERVER_MESSAGES[k], h) for k, h in handlers.items()}
        if cfg.alignment == "psu":
            builtins.update(self.aligner.handlers(lambda req: self._table(req)[0]))
        self.runtime = PartyRuntime(cfg.index, cfg.name, resolve_dir=self._state_path, builtins=builtins,
                                    policy=cfg.policy, feature_shape=self.table.feature_shape,
                                    privacy_ledger=self.state_dir / PRIVACY_LEDGER,
                                    device=cfg.device, precision=cfg.precision)
        self.runtime.charge_explanation = self._charge_explanation  # explanations spend the lookup budget too
        self.policy = cfg.policy
        self._lock = threading.Lock()
        self.sessions = SessionGuard(cfg.name, cfg.session_idle_seconds)
        self._session_reply: dict[str, Any] = {}  # what the hello being served adds to its reply
        self.peers = PeerLimits(cfg.policy.max_peer_rpcs, int(cfg.policy.max_peer_mb * 2**20))
        self.inference = InferenceGuard()
        self.prediction_handles: set[str] = set()
        self.refusals = 0
        self.access = AccessLog(cfg.access_log or AccessLogConfig(self.state_dir / "access.log"))
        #: the threads its calls are answered on (the gRPC server's pool): :meth:`close` waits for them
        self.workers = futures.ThreadPoolExecutor(max_workers=cfg.max_concurrent_rpcs, thread_name_prefix="party-call")
        #: its session on its own disk, read back now if it restarted with one (:mod:`.party_resume`)
        self.resume = ResumeStore(self, cfg.resume_sessions)
        self.restored = self.resume.restore()

    @property
    def session(self) -> str | None:
        """The coordinator session the party serves (``None`` before a hello)."""
        return self.sessions.session

    # -- checks
    def _check_peer(self, context: grpc.ServicerContext, entry: dict[str, Any]) -> tuple[str, str]:
        """The peer's allowlisted name (its certificate must match the pin of that name) and its identity for the
        lookup budget (the SHA-256 of its certificate's public key); ``entry`` records who asked, refused or not."""
        auth = context.auth_context()
        names = [v.decode() for key in ("x509_common_name", "x509_subject_alternative_name")
                 for v in auth.get(key, [])]
        for n in names:
            if n in self.cfg.allowed_peers:
                pin = self.cfg.peers.get(n)
                cert = (auth.get("x509_pem_cert") or [b""])[0]
                fingerprint = spki_sha256(cert) if cert else n
                entry["peer"] = n
                if cert:
                    entry["peer_key"] = fingerprint[:16]
                why = pin.refusal(cert) if pin is not None else None
                if why is not None:  # the right name from a CA or key this party does not trust for it
                    raise Refused(grpc.StatusCode.UNAUTHENTICATED, f"party {self.cfg.name!r} refused the peer: "
                                                                   f"{why}")
                return n, fingerprint
        raise Refused(grpc.StatusCode.PERMISSION_DENIED,
                      f"party {self.cfg.name!r} does not accept peer {names or 'without certificate'}: not on its "
                      f"allowlist {list(self.cfg.allowed_peers)}")

    def _state_path(self, rel: Any) -> str:
        if not isinstance(rel, str) or not rel:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "save/load/forget need meta 'dir', a relative path")
        pp = PurePosixPath(rel)
        if pp.is_absolute() or ".." in pp.parts:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"state directory {rel!r} must be relative and stay inside the party's state directory")
        return str(self.state_dir.joinpath(*pp.parts))

    # -- built-ins
    def _hello(self, req: Request) -> Reply:
        continued = req.meta.get("continue_session", False)
        if not continued:  # a continued session keeps its alignment, data and program as they were
            self.aligner.new_session(self.sessions.resumed)  # keys, blindings and tokens are per session
            self._reread_prediction_tables()
        t = self.table
        tables = {name: int(len(tb.ids)) for name, tb in self.tables.items() if name != TRAINING_TABLE}
        meta = {"name": self.cfg.name, "index": self.cfg.index, "n_rows": int(len(t.ids)),
                "feature_dim": int(t.features.shape[1]), "feature_shape": list(t.feature_shape),
                "tables": tables, "feature_names": list(t.feature_names), "alignment": self.cfg.alignment,
                "policy": self.policy.announced(), **self._session_reply}
        if self.runtime.privacy is not None:  # the coordinator learns the budget; it cannot change it
            budget = self.runtime.privacy.budget
            meta["dp"] = {"epsilon": budget.epsilon, "delta": budget.delta}
        if self.cfg.alignment == "psu" and self.aligner.budget():  # its lookup budget, and what this caller used
            meta["lookups"] = self.aligner.budget()
        if continued:
            meta.update(continued=True, holds=self.resume.summary())
        return Reply(meta=meta)

    def _bye(self, req: Request) -> Reply:
        return Reply()

    def _charge_explanation(self, n: int, check_only: bool) -> None:
        """An explanation's extra predictions of this party's rows count as lookups of the coordinator that asked
        (the ledger of :mod:`partialvfl.federation.trust.lookups`): refused past its budget, charged before any."""
        who, name = self.aligner.caller, self.aligner.caller_name
        self.lookups.check(who, n, name)
        if not check_only:
            self.lookups.record(who, n, name)

    # -- the gRPC entry point
    def handle_stream(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        """One call: the peer is checked when the call starts, the body is read only for an allowed peer, within
        the peer's bounds (:mod:`partialvfl.federation.grpc.limits`)."""
        entry: dict[str, Any] = {"peer": None, "address": context.peer(), "kind": "?"}
        try:
            peer, caller = self._check_peer(context, entry)
            with self.peers.call(peer), contextlib.ExitStack() as held:
                reply = self._answer(requests, entry, lambda size: held.enter_context(
                    self.peers.bytes(peer, size, context.time_remaining())), caller)
            payload = encode_reply(reply)
            self._log(entry, "served", grpc.StatusCode.OK, reply_bytes=len(payload),
                      reply=tensor_summary(reply.tensors))
            return payload
        except Refused as e:
            self._refuse(context, entry, e.code, str(e))
        except Exception as e:  # anything else is the party's own bug: report, keep serving
            self._refuse(context, entry, grpc.StatusCode.INTERNAL,
                         f"party {self.cfg.name!r} failed on {entry['kind']!r}: {type(e).__name__}: {e}")
        raise AssertionError("unreachable")  # context.abort raises

    def _answer(self, requests: Iterator[bytes], entry: dict[str, Any], hold: Callable[[int], object],
                caller: str) -> Reply:
        """Read, decode and serve one request.  Its buffer (which the request's tensors are views of) is freed
        before this returns or raises, so that the peer's byte budget is released only once the memory is: a
        failure is re-raised without the traceback that would keep the request alive."""
        data: bytearray | None = None
        wire: WireRequest | None = None
        try:
            data = read_request(requests, self.cfg.max_message_bytes, hold)
            entry["request_bytes"] = len(data)
            try:
                wire = decode_request(data, self.cfg.max_message_bytes)
            except WireError as e:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"malformed message: {e}") from None
            data = None  # the tensors are views of it: it lives as long as they do
            return self._serve(wire, entry, caller)
        except Exception as e:  # re-raised below, without the frames that hold the request
            if not isinstance(e, Refused):
                log.exception("internal error while serving %r", entry["kind"])
            failure = e
        data = wire = None
        failure.__context__ = failure.__cause__ = None
        failure = failure.with_traceback(None)
        if entry.get("request_bytes", 0) > MAX_WIRE_MESSAGE:
            gc.collect(1)  # the failed request's frames may sit in young reference cycles
        raise failure

    def _serve(self, wire: WireRequest, entry: dict[str, Any], caller: str) -> Reply:
        request = wire.request
        kind = request.kind
        entry.update(kind=kind, step=wire.step, round=wire.round, session=wire.session[:8],
                     request=tensor_summary(request.tensors),
                     meta={k: request.meta[k] for k in LOGGED_META if k in request.meta})
        if wire.lane:
            entry["lane"] = wire.lane
        with self._lock:
            t0 = time.perf_counter()
            self.aligner.caller, self.aligner.caller_name = caller, str(entry.get("peer") or "")
            self.sessions.check(wire)
            program = self.runtime.program
            if wire.lane:
                self._check_lane(request, wire.lane)
            cached = self.resume.cached_reply(wire)
            if cached is not None:  # served and kept just before the party went down: not applied twice
                self._accepted(wire)
                self.sessions.touch(wire.session)
                entry["sent_again"] = True
                return Reply(cached.tensors, {**cached.meta, SECONDS_KEY: time.perf_counter() - t0})
            try:
                request = self._carried_attach(request, entry)
                if kind not in self.runtime.builtins:
                    self.inference.check(None if program is None else program.messages, kind, request.meta,
                                         self.prediction_handles, None if program is None else program.program_name)
                reply = self.runtime.handle(request, accepted=lambda: self._accepted(wire))
            except Refused:
                raise
            except PolicyViolation as e:
                raise Refused(grpc.StatusCode.PERMISSION_DENIED, f"party {self.cfg.name!r} refused {kind!r}: {e}") \
                    from None
            except UnknownKindError as e:
                raise Refused(grpc.StatusCode.UNIMPLEMENTED, str(e)) from None
            except MessageError as e:  # the same text as in process; a bad reply is the party's own bug
                code = grpc.StatusCode.INVALID_ARGUMENT if e.direction == "request" else grpc.StatusCode.INTERNAL
                raise Refused(code, str(e)) from None
            except NotSetUp as e:
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION, str(e)) from None
            except (ValueError, KeyError, TypeError, IndexError, RuntimeError, FileNotFoundError) as e:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                              f"party {self.cfg.name!r} refused {kind!r}: {type(e).__name__}: {e}") from None
            self._check_disclosure(kind, reply)
            self.resume.after(wire, request, reply)
            if self.runtime.privacy is not None and kind not in self.runtime.builtins:
                entry["dp_epsilon_spent"] = self.runtime.privacy.ledger.epsilon_spent()
            if kind == "psu_eval" and self.aligner.ledger is not None:  # the caller's lookups after this one
                entry["lookups"] = self.aligner.budget()["used"]
            elif kind == "explain":
                entry["lookups"] = self.lookups.counts(caller)
            self.sessions.touch(wire.session)
            if self.runtime.clipped_rows:
                entry["clipped_rows"] = self.runtime.clipped_rows
            return Reply(reply.tensors, {**reply.meta, SECONDS_KEY: time.perf_counter() - t0})

    def _check_lane(self, request: Request, lane: int) -> None:
        """A lane other than 0 (a prediction service's batches in flight side by side) carries inference requests
        of the program (without ``train``) and ID lookups only: whatever changes the party's state keeps the
        session's one order."""
        program = self.runtime.program
        spec = None if program is None else program.messages.get(request.kind)
        if request.kind == "psu_eval" or (spec is not None and spec.role == INFERS and not request.meta.get("train")):
            return
        raise Refused(grpc.StatusCode.PERMISSION_DENIED, f"party {self.cfg.name!r}: lane {lane} carries inference "
                                                         f"requests and ID lookups only, not {request.kind!r}")

    def _carried_attach(self, request: Request, entry: dict[str, Any]) -> Request:
        """Serve the ``attach`` a request carries (``meta['attach']``, its tensors named ``attach.*``: one round for
        attaching a batch and predicting it) and return the request without it.  Only an inference request of the
        program, on the data set it attaches, not training, may carry one."""
        carried = request.meta.get("attach")
        if carried is None:
            return request
        program = self.runtime.program
        spec = None if program is None else program.messages.get(request.kind)
        if not isinstance(carried, dict) or spec is None or spec.role != INFERS or request.meta.get("train") \
                or request.meta.get("data") != carried.get("handle"):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"party {self.cfg.name!r}: only an inference request "
                                                            "of the program, not training, may carry the attach of "
                                                            "the data set it names (meta 'data' = the attach's "
                                                            "handle)")
        tensors = {k[len(ATTACH_PREFIX):]: t for k, t in request.tensors.items() if k.startswith(ATTACH_PREFIX)}
        attach = Request("attach", tensors, {**carried, "step": request.meta.get("step"),
                                             "round": request.meta.get("round")})
        self.runtime.handle(attach)
        entry["attach"] = {k: carried[k] for k in ("handle", "table", "tables", "n_samples") if k in carried}
        entry["attach"]["rows"] = int(tensors["rows"].shape[0]) if "rows" in tensors else 0
        meta = {k: v for k, v in request.meta.items() if k != "attach"}
        return Request(request.kind, {k: t for k, t in request.tensors.items() if not k.startswith(ATTACH_PREFIX)},
                       meta)

    def _accepted(self, wire: WireRequest) -> None:
        """A request passed every check: record it as served (and, for ``setup``, forget the old program's rows)."""
        self._session_reply = self.sessions.commit(wire)
        if wire.request.kind == "setup":
            self.inference.reset()
        elif wire.request.kind not in self.runtime.builtins:
            self.inference.accepted(wire.request.meta, self.prediction_handles)

    def _check_disclosure(self, kind: str, reply: Reply) -> None:
        """Never send the party's own parameters or optimiser state (unless its policy allows weight sharing)."""
        if self.policy.allow_weight_sharing or not reply.tensors:
            return
        hit = disclosed_state(reply.tensors, self.runtime.program)
        if hit is not None:
            raise Refused(grpc.StatusCode.PERMISSION_DENIED,
                          f"party {self.cfg.name!r} did not send its reply to {kind!r}: policy rule "
                          f"'allow_weight_sharing': tensor {hit[0]!r} holds the values of its state tensor {hit[1]}")

    def _log(self, entry: dict[str, Any], outcome: str, code: grpc.StatusCode, **more: Any) -> None:
        self.access.write(**entry, outcome=outcome, status=code.name, **more)

    def _refuse(self, context: grpc.ServicerContext, entry: dict[str, Any], code: grpc.StatusCode,
                reason: str) -> None:
        self.refusals += 1
        log.warning("refused %r: %s: %s", entry["kind"], code.name, reason)
        self._log(entry, "refused", code, reason=reason)
        context.abort(code, reason)

    def close(self) -> None:
        """After the server stopped: a call still being answered (its reply may no longer be sendable) finishes what
        it writes (the program's state, the lookup and privacy ledgers, its access-log line), then the log closes."""
        self.workers.shutdown(wait=True)
        self.access.close()


