"""A party's coordinator session on its own disk, so that the party, restarted, *continues* it.

A party that crashed and was started again with the same configuration and state directory reads back what its
session held (``state_dir/session/``, files readable by its owner only, each written atomically) before it listens:

* the session: its identifier, the SHA-256 of its secret (never the secret), the coordinator's key, when it was last
  used (``session.json``);
* the alignment: this session's nonce, salt and lookups counted (``alignment.json``), every aligned table's tokens
  with their rows, written once, so no token is computed again (``tokens-*.pt``), and the points its lookups
  evaluated, appended as they come (``evaluated.bin``);
* the data sets attached under a handle (their ``attach`` requests, replayed from the restored tokens:
  ``handles.pt``);
* the program: its name, set-up config and the seed it was built with, the party's preprocessing, the program's
  state (with what a step in progress holds where the program can say so: ``resumes_mid_step``), and the last
  request that changed it with its reply (``program.pt``: written after every request that changes the program).

The coordinator then continues the session with a ``hello`` carrying its secret and ``continue_session``
(:mod:`.sessions`): authenticated as any ``hello``, and nothing it sent before is served again (its sequence numbers
go on).  A request the party had served and written when it crashed, sent again unchanged as the first after the
``hello``, gets the reply it had (the party does not apply it twice); any other is served as usual.  Nothing is kept
for a party with a differential-privacy budget (its noise is drawn afresh and charged: it always starts a new
session), nor with ``[party] resume_sessions = false``; ``bye`` deletes it all.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from partialvfl.data.preprocessing import ColumnScaler
from partialvfl.federation.grpc.frames import WireRequest
from partialvfl.federation.trust.token_index import TokenIndex
from partialvfl.federation.wire.messages import Reply, Request
from partialvfl.federation.wire.program import PROGRAMS
from partialvfl.federation.wire.schema import INFERS
from partialvfl.utils.private_files import write_private, write_private_json

__all__ = ["SESSION_DIR", "ResumeStore", "request_digest"]

log = logging.getLogger("partialvfl.party")
#: where a party keeps its session, inside its state directory
SESSION_DIR = "session"
_ALIGNMENT_KINDS = ("psu_open", "psu_tokens", "psu_unblind", "psu_eval")
_PROGRAM_BUILTINS = ("setup", "preprocess", "load")
#: how often a session in use writes when it was last used (its idle timeout counts from then after a restart)
TOUCH_SECONDS = 10.0
#: a program whose saved state is larger is written at set-up and load only, not after every training request (a
#: restart then continues a prediction session, not a fit in the middle of a step)
STEP_STATE_LIMIT_BYTES = 32 * 2**20


def request_digest(request: Request) -> str:
    """The SHA-256 of a request's kind, tensors (names, dtypes, shapes, bytes) and metadata (step and round aside)."""
    h = hashlib.sha256(request.kind.encode())
    for name in sorted(request.tensors):
        t = request.tensors[name].detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.numpy().tobytes() if t.dtype != torch.bfloat16 else t.view(torch.int16).numpy().tobytes())
    meta = {k: v for k, v in request.meta.items() if k not in ("step", "round")}
    h.update(json.dumps(meta, sort_keys=True, default=str).encode())
    return h.hexdigest()


def _save(path: Path, content: Any) -> None:
    """``torch.save`` atomically, readable by the owner only."""
    write_private(path, lambda f: torch.save(content, f), binary=True)


class ResumeStore:
    """The session of a :class:`~partialvfl.federation.grpc.party.PartyServer` on its disk: written as requests are
    served (:meth:`after`), read back at start (:meth:`restore`)."""

    def __init__(self, server: Any, enabled: bool = True) -> None:
        self.server = server
        self.enabled = bool(enabled) and server.runtime.privacy is None
        self.dir = Path(server.state_dir) / SESSION_DIR
        self.handles: dict[str, Request] = {}
        self.setup: tuple[str, Any] | None = None  # (program, its set-up config as the coordinator sent it)
        self.marker: tuple[int, int, int, str, str] | None = None  # (lane, step, round, kind, digest) persisted last
        self.reply: Reply | None = None
        self.restored = False  # the party read its session back at start
        self._touched = 0.0  # when session.json was last written (its "wall": the session's last use)
        self.first_after_restore = False  # the next request may be one it had served before it went down
        self.state_bytes = 0  # the size of the program's state as last written
        self.mid_step = True  # the program's state on disk follows every training request
        if not self.enabled:  # a session kept by an earlier run that kept them is not this run's to continue
            shutil.rmtree(self.dir, ignore_errors=True)

    # ------------------------------------------------------------------ writing
    def after(self, wire: WireRequest, request: Request, reply: Reply) -> None:
        """``request`` (as the runtime served it) was answered with ``reply``: keep what it changed."""
        if not self.enabled:
            return
        kind = request.kind
        if kind != "hello":
            self.first_after_restore = False
        try:
            if kind == "hello" and not request.meta.get("continue_session"):  # a new alignment, no handle yet
                self.handles.clear()
                for name in ("alignment.pt", "handles.pt", "evaluated.bin", *self._token_files()):
                    (self.dir / name).unlink(missing_ok=True)
            if kind == "hello" or time.time() - self._touched > TOUCH_SECONDS:
                self._write_session()
            if kind == "bye":
                self.forget()
            elif kind in _ALIGNMENT_KINDS:
                self._write_alignment(request, reply)
            elif kind in ("attach", "release"):
                handle = str(request.meta.get("handle"))
                if kind == "attach":
                    self.handles[handle] = Request("attach", dict(request.tensors), dict(request.meta))
                else:
                    self.handles.pop(handle, None)
                _save(self.dir / "handles.pt", {"handles": {h: (r.tensors, r.meta) for h, r in self.handles.items()},
                                                "prediction": sorted(self.server.prediction_handles)})
            elif kind == "setup":
                self.setup = (str(request.meta["program"]), request.meta.get("config", {}))
                self._write_program(wire, request, reply)
            elif kind in _PROGRAM_BUILTINS:
                self._write_program(wire, request, reply)
            elif self._changes_program(request):
                if self.state_bytes <= STEP_STATE_LIMIT_BYTES:
                    self._write_program(wire, request, reply)
                elif self.mid_step:
                    self.mid_step = False
                    (self.dir / "program.pt").unlink(missing_ok=True)
                    log.info("party %s: its program's state (%.0f MB) is not written after every training request; "
                             "a restart during this fit starts a new session", self.server.cfg.name,
                             self.state_bytes / 2**20)
        except OSError as e:  # a full or read-only disk: the party serves on, a restart starts a new session
            log.warning("party %s could not keep its session on disk (%s): a restart will need a new session",
                        self.server.cfg.name, e)

    def _changes_program(self, request: Request) -> bool:
        program = self.server.runtime.program
        spec = None if program is None else program.messages.get(request.kind)
        return spec is not None and (spec.role != INFERS or request.meta.get("train") is True)

    def _write_session(self) -> None:
        guard = self.server.sessions
        if guard.session is None:
            return
        self._touched = time.time()
        write_private_json(self.dir / "session.json", {
            "session": guard.session, "secret_sha256": guard.secret_sha256, "wall": time.time(),
            "coordinator": self.server.aligner.caller})

    def _token_files(self) -> list[str]:
        return [p.name for p in self.dir.glob("tokens-*.pt")] if self.dir.is_dir() else []

    def _write_alignment(self, request: Request, reply: Reply) -> None:
        """The session's nonce and salt and the lookups counted (small, every time); a table's tokens once, when
        they are computed; the points a lookup evaluated, appended (a replayed set stays refused after a restart)."""
        a = self.server.aligner
        if request.kind in ("psu_tokens", "psu_unblind"):
            for table, idx in a.rows.items():
                path = self.dir / f"tokens-{hashlib.sha256(table.encode()).hexdigest()[:16]}.pt"
                if not path.is_file():  # the table's token index (:class:`~..trust.token_index.TokenIndex`)
                    _save(path, {"table": table, "tokens": torch.from_numpy(idx.sorted_tokens().copy()),
                                 "rows": torch.from_numpy(np.asarray(idx.rows, dtype=np.int64).copy())})
        if request.kind == "psu_eval" and "points" in request.tensors:
            self.dir.mkdir(parents=True, exist_ok=True)
            with open(self.dir / "evaluated.bin", "ab") as f:
                f.write(request.tensors["points"].numpy().astype(np.uint8).tobytes())
        write_private_json(self.dir / "alignment.json", {"nonce": a.nonce, "salt": a.salt, "lookups": a.lookups})

    def _write_program(self, wire: WireRequest, request: Request, reply: Reply) -> None:
        rt = self.server.runtime
        program = rt.program
        self.marker = (wire.lane, wire.step, wire.round, request.kind, request_digest(request))
        self.reply = reply
        path = self.dir / "program.pt"
        _save(path, {
            "setup": self.setup, "seed": None if program is None else program.seed, "trains": rt.trains,
            "state": None if program is None else program.state_dict(),
            "scaler": None if rt.scaler is None else rt.scaler.state_dict(),
            "marker": self.marker, "reply": (reply.tensors, reply.meta), "wall": time.time()})
        self.state_bytes = path.stat().st_size
        self.mid_step = True

    def forget(self) -> None:
        """The session ended: nothing of it stays on disk."""
        self.handles.clear()
        self.setup = self.marker = self.reply = None
        shutil.rmtree(self.dir, ignore_errors=True)

    # ------------------------------------------------------------------ a request sent again
    def cached_reply(self, wire: WireRequest) -> Reply | None:
        """The reply to the request the party served last before it went down, if this is that request again (the
        first after the restart, same lane, step, round, kind and content); else ``None``."""
        if not self.first_after_restore or self.marker is None or self.reply is None:
            return None
        req = wire.request
        if self.marker[:4] != (wire.lane, wire.step, wire.round, req.kind):
            return None
        return self.reply if self.marker[4] == request_digest(req) else None

    # ------------------------------------------------------------------ reading back
    def restore(self) -> dict[str, Any] | None:
        """Read the session back (at start, before the party listens); what was restored, or ``None``."""
        if not self.enabled or not (self.dir / "session.json").is_file():
            return None
        t0 = time.perf_counter()
        try:
            summary = self._restore()
        except Exception as e:  # anything unreadable: start without it (a new session)
            log.warning("party %s could not read its session back (%s: %s): it starts without one",
                        self.server.cfg.name, type(e).__name__, e)
            self._reset()
            return None
        self.restored = self.first_after_restore = True
        log.info("party %s restored its coordinator session from %s in %.3f s: %s", self.server.cfg.name, self.dir,
                 time.perf_counter() - t0, summary)
        return summary

    def _reset(self) -> None:
        srv = self.server
        srv.sessions.session = srv.sessions.secret = srv.sessions.secret_sha256 = None
        srv.aligner.new_session()
        for h in list(srv.runtime.handles):
            srv.runtime.release(h)
        srv.runtime.program = None
        self.handles.clear()
        self.setup = self.marker = self.reply = None

    def _restore(self) -> dict[str, Any]:
        srv = self.server
        sess = json.loads((self.dir / "session.json").read_text())
        srv.sessions.restore(str(sess["session"]), str(sess["secret_sha256"]), time.time() - float(sess["wall"]))
        srv.aligner.caller = str(sess.get("coordinator", srv.aligner.caller))
        out: dict[str, Any] = {"session": True}
        if (self.dir / "alignment.json").is_file():
            a = json.loads((self.dir / "alignment.json").read_text())
            al = srv.aligner
            al.nonce, al.salt, al.lookups = a["nonce"], a["salt"], int(a["lookups"])
            if al.salt is not None and al.keyed:
                al._session_key(al.salt, "restore")  # the session key again, from the kept salt (one HMAC)
            for path in sorted(self.dir.glob("tokens-*.pt")):
                t = torch.load(path, weights_only=True)
                al.rows[str(t["table"])] = TokenIndex(t["tokens"].numpy(), t["rows"].numpy())
            evaluated = self.dir / "evaluated.bin"
            if evaluated.is_file():
                raw = evaluated.read_bytes()
                raw = raw[:len(raw) - len(raw) % 32]  # a record cut short by the crash was not evaluated
                al.evaluated = np.unique(np.frombuffer(raw, dtype="S32"))  # sorted, as the aligner keeps it
            out["tables"] = {t: len(r) for t, r in al.rows.items()}
        if (self.dir / "handles.pt").is_file():
            h = torch.load(self.dir / "handles.pt", weights_only=True)
            for handle, (tensors, meta) in h["handles"].items():
                srv._attach(Request("attach", tensors, meta))
                self.handles[handle] = Request("attach", tensors, meta)
            srv.prediction_handles.clear()
            srv.prediction_handles.update(h["prediction"])
            out["handles"] = sorted(self.handles)
        if (self.dir / "program.pt").is_file():
            out.update(self._restore_program(torch.load(self.dir / "program.pt", weights_only=True)))
        return out

    def _restore_program(self, saved: dict[str, Any]) -> dict[str, Any]:
        rt = self.server.runtime
        if saved.get("scaler") is not None:
            rt._set_scaler(ColumnScaler.from_state(saved["scaler"]))
        self.marker = tuple(saved["marker"]) if saved.get("marker") is not None else None  # type: ignore[assignment]
        tensors, meta = saved.get("reply") or ({}, {})
        self.reply = Reply(tensors, meta)
        if saved.get("setup") is None or saved.get("state") is None:
            return {}
        name, raw = saved["setup"]
        cls = PROGRAMS.get(name)
        if cls is None or not rt.policy.runs(name, cls):
            raise ValueError(f"program {name!r} is not one this party runs now")
        config = cls.read_config(raw, f"party {rt.index} ({rt.name!r}), program {name!r}")
        shape = rt.feature_shape
        rt.policy.check_setup(name, config, registered=PROGRAMS, feature_shape=shape,
                              n_features=None if shape is None else int(np.prod(shape)))
        program = cls(rt, config, int(saved["seed"]))
        program.load_state_dict(saved["state"])
        rt.program, rt.trains = program, bool(saved["trains"])
        rt.rewinds.setup()
        self.setup = (name, raw)
        return {"program": name, "mid_step": bool(getattr(cls, "resumes_mid_step", False))}

    def summary(self) -> dict[str, Any]:
        """What the party holds of its session now (the continued ``hello``'s reply)."""
        program = self.server.runtime.program
        return {"restored": self.restored, "program": None if program is None else program.program_name,
                "mid_step": bool(program is not None and getattr(program, "resumes_mid_step", False)
                                 and self.mid_step),
                "handles": sorted(self.server.runtime.handles)}

