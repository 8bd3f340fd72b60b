"""A party: its own data and the party-local half of a method (a *program*), reachable only through messages.

A :class:`PartyRuntime` is what runs at one institution.  It holds the data views it was given (only its own block,
see :class:`~partialvfl.data.dataset.PartyView`), and after a ``setup`` request the party program of the method in
use.  Every method is written as a :class:`PartyProgram` (party-local steps, one ``on_<kind>`` handler per message
kind) plus coordinator code that talks to the programs through a Transport; the same programs serve in-process and
behind a gRPC server.

Built-in message kinds handled by the runtime itself (:data:`RUNTIME_MESSAGES`): ``setup`` (build the program
named in ``meta['program']`` with ``meta['config']``, if the party's
:class:`~partialvfl.federation.trust.policy.PartyPolicy` agrees, seeded as the policy says: in a deployment by a seed
the party draws itself), ``preprocess`` (fit the party's own standardisation on a dataset it holds),
``save``/``load``/``forget`` (the program's state, the seed it was built with and the party's preprocessing in
``meta['dir']``, ``party-<k>.pt``, written atomically and tagged with the model's digest), ``ping``.  A server adds its
own built-ins.

Preprocessing belongs to the party: :meth:`PartyRuntime.data` hands programs the party's rows already standardised
with the statistics the party fitted on its own training rows (:class:`~partialvfl.data.preprocessing.ColumnScaler`);
they never leave the party.

Every message is checked against its declaration (:mod:`partialvfl.federation.wire.schema`) in
:meth:`PartyRuntime.handle`, the one path of both transports: the request before the handler runs, the reply after.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from partialvfl.data.dataset import PartyView
from partialvfl.data.preprocessing import ColumnScaler
from partialvfl.federation.dp.gaussian import DPBudget, PartyPrivacy, private_reply
from partialvfl.federation.dp.mechanism import get_mechanism, load_mechanisms
from partialvfl.federation.trust.guards import RewindGuard, clip_gradient_rows
from partialvfl.federation.trust.policy import PartyPolicy
from partialvfl.federation.wire.messages import Reply, Request
from partialvfl.federation.wire.program import (
    PROGRAMS,
    RUNTIME_MESSAGES,
    NotSetUp,
    PartyProgram,
    StateFileError,
    state_file,
)
from partialvfl.federation.wire.refusals import PolicyViolation
from partialvfl.federation.wire.schema import TRAINS, MessageSpec, UnknownKindError, check_reply, check_request
from partialvfl.utils.devices import autocast, check_precision, move_message, resolve_device, table_tensor

__all__ = ["PartyRuntime"]

Handler = Callable[[Request], Reply]


class PartyRuntime:
    """One party: its data views (its own block only), its program, and the message kinds it answers.

    ``builtins`` adds kinds a server answers itself (``{kind: (declaration, handler)}``); ``resolve_dir`` maps the
    ``dir`` of ``save``/``load``/``forget`` to a path (a server keeps states inside its own state directory).
    ``policy`` is what the party agrees to run (default: the permissive research policy of the in-process
    simulation); ``feature_shape`` the shape of its own table, if it has one (a setup must agree with it).  A policy
    with ``dp_epsilon``/``dp_delta`` gives the party a differential-privacy budget (``self.privacy``,
    :mod:`partialvfl.federation.dp.gaussian`) kept by the release mechanism ``dp_mechanism`` names, its ledger kept
    in ``privacy_ledger`` (a file) if given.
    ``device`` and ``precision`` (``fp32`` or ``bf16`` autocast) are where and how its programs compute: requests'
    floating-point tensors arrive there, replies leave as CPU tensors (:mod:`partialvfl.utils.devices`);
    ``compile``: whether its programs run their hot steps through ``torch.compile`` (:mod:`partialvfl.nn.compiled`).
    """

    def __init__(self, index: int, name: str, *, builtins: Mapping[str, tuple[MessageSpec, Handler]] | None = None,
                 resolve_dir: Callable[[Any], str | Path] = Path, policy: PartyPolicy | None = None,
                 feature_shape: tuple[int, ...] | None = None, privacy_ledger: str | Path | None = None,
                 device: str | torch.device = "cpu", precision: str = "fp32",
                 compile: bool = False) -> None:  # torch's word
        self.index = index
        self.name = name
        self.device = resolve_device(device, what=f"party {index} ({name!r}) device")
        self.precision = check_precision(precision, what=f"party {index} ({name!r}) precision")
        self.compile = bool(compile)  # compiled hot steps (nn.compiled), where a program has them
        self._tables: dict[str, torch.Tensor] = {}  # handle -> its (preprocessed) features on the device
        self.policy = policy if policy is not None else PartyPolicy.research()
        self.privacy: PartyPrivacy | None = None
        if self.policy.dp_epsilon is not None and self.policy.dp_delta is not None:
            load_mechanisms()  # the release mechanism the policy names may be a plug-in's (entry point group)
            self.privacy = PartyPrivacy(DPBudget(self.policy.dp_epsilon, self.policy.dp_delta),
                                        f"party {index} ({name!r})", privacy_ledger,
                                        get_mechanism(self.policy.dp_mechanism, "release"))
        self.feature_shape = feature_shape
        self._data: dict[str, PartyView] = {}
        self._scaled: dict[str, PartyView] = {}
        self.scaler: ColumnScaler | None = None  # the party's own standardisation (None: features as they are)
        self.program: PartyProgram | None = None
        self.resolve_dir = resolve_dir
        self.rewinds = RewindGuard()  # no training again and again from one saved state ([policy] max_rewinds)
        self.trains = True  # whether the current setup may train ([policy] require_label_dp: only a protected fit)
        self.clipped_rows = 0  # gradient rows the last admitted request had clipped ([policy] max_grad_norm)
        #: ``(n, check_only)``: charges an explanation's ``n`` extra predictions to a budget (a party server: its
        #: lookup ledger), or only checks that it could; refuses past it
        self.charge_explanation: Callable[[int, bool], None] | None = None
        own: dict[str, Handler] = {"ping": self._ping, "setup": self._setup, "preprocess": self._preprocess,
                                   "save": self._save, "load": self._load, "forget": self._forget,
                                   "privacy": self._privacy, "explain": self._explain}
        self.builtins: dict[str, tuple[MessageSpec, Handler]] = {k: (RUNTIME_MESSAGES[k], h) for k, h in own.items()}
        for kind, entry in (builtins or {}).items():
            if kind in self.builtins:
                raise ValueError(f"built-in kind {kind!r} is the runtime's own")
            self.builtins[kind] = entry

    def attach(self, handle: str, view: PartyView) -> None:
        """Give this party a dataset view under ``handle`` (in-process: the party's own slice of that dataset)."""
        if view.party != self.index:
            raise ValueError(f"party {self.index} ({self.name!r}) was handed the view of party {view.party}")
        self._data[handle] = view
        self._scaled.pop(handle, None)
        self._tables.pop(handle, None)

    def release(self, handle: str) -> None:
        """Forget the data attached as ``handle``."""
        self._data.pop(handle, None)
        self._scaled.pop(handle, None)
        self._tables.pop(handle, None)

    @property
    def handles(self) -> frozenset[str]:
        """The handles data is attached under."""
        return frozenset(self._data)

    def raw_data(self, handle: str) -> PartyView:
        """The rows attached under ``handle`` as the party's table holds them."""
        try:
            return self._data[handle]
        except KeyError:
            raise KeyError(
                f"party {self.index} ({self.name!r}) has no data attached as {handle!r}; has {sorted(self._data)}"
            ) from None

    def data(self, handle: str) -> PartyView:
        """The rows attached under ``handle`` as programs see them: after the party's own preprocessing."""
        view = self.raw_data(handle)
        if self.scaler is None:
            return view
        if handle not in self._scaled:
            feats = self.scaler.transform(view.features, f"party {self.index} ({self.name!r})")
            feats.flags.writeable = False
            self._scaled[handle] = dataclasses.replace(view, features=feats)
        return self._scaled[handle]

    def table(self, handle: str) -> torch.Tensor:
        """The rows attached under ``handle``, preprocessed, as one float32 tensor on the party's device: moved
        there once per dataset, not per step."""
        if handle not in self._tables:
            self._tables[handle] = table_tensor(self.data(handle).features, self.device)
        return self._tables[handle]

    def _set_scaler(self, scaler: ColumnScaler | None) -> None:
        self.scaler = scaler
        self._scaled.clear()
        self._tables.clear()

    # ------------------------------------------------------------------ devices
    def arrive(self, request: Request) -> Request:
        """``request`` as the party's program gets it: floating-point tensors on its device, the rest on the CPU."""
        return Request(request.kind, move_message(request.tensors, self.device), request.meta)

    def depart(self, spec: MessageSpec, reply: Reply, device: torch.device | None = None) -> Reply:
        """``reply`` on its way out: floating-point tensors to ``device`` (``None``: the CPU, the wire's), a bfloat16
        tensor computed under bf16 autocast as float32 where the declaration does not admit bfloat16."""
        tensors = dict(reply.tensors)
        if self.precision == "bf16":
            for name, t in tensors.items():
                if t.dtype == torch.bfloat16:
                    decl = next((d for d in spec.reply if d.match(name) is not None), None)
                    if decl is None or "bfloat16" not in decl.dtype:
                        tensors[name] = t.float()
        return Reply(move_message(tensors, device or torch.device("cpu")), reply.meta)

    def computing(self) -> contextlib.AbstractContextManager[None]:
        """The context the party's programs compute in (bf16 autocast with ``precision='bf16'``)."""
        return autocast(self.device, self.precision)

    # ------------------------------------------------------------------ dispatch
    def _declaration(self, kind: str) -> tuple[MessageSpec, Handler, str, dict[str, Any]]:
        """(declaration, handler, who answers, config for the checks) of ``kind``."""
        party = f"party {self.index} ({self.name!r})"
        if kind in self.builtins:
            spec, fn = self.builtins[kind]
            return spec, fn, f"{party}, built-in", {}
        program = self.program
        if program is None:
            raise NotSetUp(f"{party} got {kind!r} before any setup")
        where = f"{party}, program {program.program_name!r}"
        spec = program.messages.get(kind)
        if spec is None:
            raise UnknownKindError(where, kind, None, "unknown message kind; the program answers "
                                   f"{', '.join(sorted(program.messages))}")
        return spec, program.handle, where, program.wire_config

    def handle(self, request: Request, accepted: Callable[[], None] | None = None,
               reply_device: torch.device | None = None) -> Reply:
        """Check ``request`` against its kind's declaration, answer it, check the reply; the transports' one path.

        ``accepted`` is called once the request passed its checks, before the handler runs (a server records the
        message as served then).  Raises :class:`~partialvfl.federation.wire.schema.MessageError` for a message that
        does not match (``UnknownKindError`` for an undeclared kind) and :class:`NotSetUp` before ``setup``.
        The handler gets the request's floating-point tensors on the party's device; the reply's leave on
        ``reply_device`` (the CPU, the wire's, unless an in-process transport asks for the coordinator's).
        """
        spec, fn, where, config = self._declaration(request.kind)
        request = self._admit(request, spec, where, config)
        if accepted is not None:
            accepted()
        with self.computing():
            reply = fn(self.arrive(request))
        reply = self.depart(spec, reply, reply_device)
        check_reply(spec, request.tensors, reply.tensors, where=where, kind=request.kind, config=config)
        if self.privacy is not None and request.kind not in self.builtins:
            reply = self._private(spec, request, reply)
        return reply

    def _private(self, spec: MessageSpec, request: Request, reply: Reply) -> Reply:
        """The reply as the party's budget lets it leave: declared releases only, clipped, noised and charged."""
        assert self.privacy is not None and self.program is not None
        if not reply.tensors and not reply.meta:
            return reply
        rows = self.program.released_rows(request.kind, request, reply) if reply.tensors else {}
        keys = {}
        for name, (handle, positions, axis) in rows.items():
            view = self.raw_data(str(handle))
            keys[name] = (view.ids[view.position_of_rows(np.asarray(positions, dtype=np.int64))], axis)
        return Reply(private_reply(self.privacy, spec, request.kind, reply.tensors, reply.meta, keys))

    def row_keys(self, handle: str, rows: np.ndarray) -> list[str]:
        """The ledger's keys (the rows' IDs in the party's own table) of shared-order ``rows`` of ``handle``."""
        view = self.raw_data(handle)
        return [str(i) for i in view.ids[view.position_of_rows(np.asarray(rows, dtype=np.int64))]]

    def check(self, request: Request, reply: Reply | None = None) -> Request:
        """The checks of :meth:`handle` without the handler: the request (returned as the program gets it), and the
        reply if given.

        For an in-process transport that answers several parties' requests in one batched computation
        (:meth:`PartyProgram.handle_batch`): every message is still checked against its declaration and admitted
        by the party's policy.
        """
        spec, _, where, config = self._declaration(request.kind)
        if reply is None:
            return self._admit(request, spec, where, config)
        if self.privacy is not None and request.kind not in self.builtins:
            raise RuntimeError(f"{where}: a reply computed outside the party's runtime cannot pass its "
                               "differential-privacy budget (answer it through PartyRuntime.handle)")
        check_reply(spec, request.tensors, reply.tensors, where=where, kind=request.kind, config=config)
        return request

    def _admit(self, request: Request, spec: MessageSpec, where: str, config: dict[str, Any]) -> Request:
        """The party's policy (for its program's kinds), then the kind's declaration; the request as the program
        gets it: its metadata typed (:mod:`~partialvfl.federation.wire.meta_keys`), every declared gradient row
        clipped to ``max_grad_norm``, a training request counted against ``max_rewinds``
        (:mod:`partialvfl.federation.trust.guards`)."""
        program_kind = request.kind not in self.builtins and self.program is not None
        if program_kind:
            self.policy.check_request(spec, request.kind, request.meta)
        meta = check_request(spec, request.tensors, request.meta, where=where, kind=request.kind, config=config)
        self.clipped_rows = 0
        if not program_kind:
            return Request(request.kind, request.tensors, meta)
        tensors, self.clipped_rows = clip_gradient_rows(spec, request.tensors, self.policy.max_grad_norm,
                                                        request.kind)
        if spec.role == TRAINS:
            if not self.trains:
                self.policy.refuse_training(request.kind)
            self.rewinds.training(self.policy.max_rewinds)
        return Request(request.kind, tensors if self.clipped_rows else request.tensors, meta)

    # ------------------------------------------------------------------ built-ins
    def _ping(self, request: Request) -> Reply:
        return Reply(meta={"party": self.index, "name": self.name})

    def _setup(self, request: Request) -> Reply:
        name = request.meta["program"]
        config = request.meta.get("config", {})
        cls = PROGRAMS.get(name)
        if cls is not None and self.policy.runs(name, cls):  # read once, on arrival: typed from here on
            if self.privacy is not None and not cls.supports_privacy:  # refused whatever its config says
                self._refuse_private(name, cls.private_setup_refusal(config))
            config = cls.read_config(config, f"party {self.index} ({self.name!r}), program {name!r}")
        shape = self.feature_shape
        self.policy.check_setup(name, config, registered=PROGRAMS, n_features=None if shape is None
                                else math.prod(shape), feature_shape=shape)  # the party's own policy first
        if name not in PROGRAMS:
            raise ValueError(f"unknown party program {name!r}; known: {sorted(PROGRAMS)}")
        shadowed = sorted(set(PROGRAMS[name].messages) & set(self.builtins))
        if shadowed:
            raise ValueError(f"party program {name!r} declares this party's built-in kind(s) {shadowed}")
        self.trains = self.policy.check_labels(request.meta.get("fit"), request.meta.get("label_dp"))
        seed = self.policy.init_seed(request.meta["seed"])
        meta: dict[str, Any] = {"ok": True}
        if self.privacy is not None:
            self._refuse_private(name, PROGRAMS[name].private_setup_refusal(config))
            meta["privacy"] = self.privacy.configure(request.meta.get("privacy"), seed)
        self.program = PROGRAMS[name](self, config, seed)
        self.rewinds.setup()
        return Reply(meta=meta)

    def _refuse_private(self, program: str, why: str | None) -> None:
        """Refuse ``program`` at this party with a differential-privacy budget for the reason ``why`` (if any)."""
        if why is not None and self.privacy is not None:
            raise PolicyViolation("dp_epsilon", f"this party keeps a differential-privacy budget "
                                  f"({self.privacy.budget.describe()}) and {why}", program)

    def _explain(self, request: Request) -> Reply:
        """An explanation's extra predictions of rows of ``data``: refused unless ``[policy] allow_explanations``,
        then charged (:attr:`charge_explanation`) before any is made; with ``check``, only checked."""
        if not self.policy.allow_explanations:
            raise PolicyViolation("allow_explanations", f"party {self.index} ({self.name!r}) does not take part in "
                                  "explanations (predictions of its rows from coalitions of parties)", False,
                                  {"allow_explanations": True})
        self.raw_data(request.meta["data"])  # a data set it holds (else a KeyError naming the handles)
        n, check = request.meta["predictions"], request.meta.get("check", False)  # typed by the declaration
        if self.charge_explanation is not None:
            self.charge_explanation(n, check)
        return Reply(meta={"charged": 0 if check else n})

    def _privacy(self, request: Request) -> Reply:
        if self.privacy is None:
            return Reply(meta={"enabled": False})
        return Reply(meta={"enabled": True, **self.privacy.report()})

    def _program(self, kind: str) -> PartyProgram:
        if self.program is None:
            raise NotSetUp(f"party {self.index} ({self.name!r}) got {kind!r} before any setup")
        return self.program

    def _preprocess(self, request: Request) -> Reply:
        """Fit the party's standardisation on its own rows under ``data`` (or switch it off)."""
        view = self.raw_data(request.meta["data"])
        standardize: bool = request.meta["standardize"]  # a flag: the declaration refused anything else
        self._set_scaler(ColumnScaler.fit(view.features, f"party {self.index} ({self.name!r})") if standardize
                         else None)
        return Reply(meta={"n_rows": view.n_observed})

    def _save(self, request: Request) -> Reply:
        program = self._program("save")
        path = state_file(self.resolve_dir(request.meta["dir"]), self.index)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        torch.save({"program": program.program_name, "seed": program.seed, "state": program.state_dict(),
                    "model": request.meta.get("model"), "state_id": self.rewinds.on_save(),
                    "preprocessing": self.scaler.state_dict() if self.scaler is not None else None}, tmp)
        os.replace(tmp, path)  # a crash leaves the previous file or the new one, never half of one
        return Reply(meta={"path": str(path)})

    def _forget(self, request: Request) -> Reply:
        """Delete a state saved earlier (a pruned checkpoint)."""
        self._program("forget")
        path = state_file(self.resolve_dir(request.meta["dir"]), self.index)
        path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # other parties' files may share the directory (in process)
            path.parent.rmdir()
        return Reply(meta={"ok": True})

    def _load(self, request: Request) -> Reply:
        program = self._program("load")
        path = state_file(self.resolve_dir(request.meta["dir"]), self.index)
        who = f"party {self.index} ({self.name!r})"
        if not path.exists():
            raise StateFileError(f"{who}: no state file at {path}")
        try:
            saved = torch.load(path, map_location="cpu", weights_only=True)  # saved on any device; moved on load
        except Exception as e:  # any unreadable file gets the same plain message
            raise StateFileError(f"{who}: {path} is not a readable partialvfl party state (corrupted, truncated or "
                                 f"foreign: {type(e).__name__})") from None
        if not isinstance(saved, dict) or not {"program", "state"} <= set(saved):
            raise StateFileError(f"{who}: {path} is not a partialvfl party state")
        if saved["program"] != program.program_name:
            raise StateFileError(f"{who}: {path} holds a {saved['program']!r} state, not {program.program_name!r}")
        expected, got = request.meta.get("model"), saved.get("model")
        if expected is not None and got != expected:
            raise StateFileError(f"{who}: {path} belongs to another model (digest {str(got)[:12]}, this model "
                                 f"{expected[:12]}): a party file was swapped or left from an older save")
        try:
            scaler = ColumnScaler.from_state(saved["preprocessing"]) if saved.get("preprocessing") else None
            if saved.get("seed", program.seed) != program.seed:  # rebuilt as it was saved (a party draws its seeds)
                program = self.program = type(program)(self, program.config, int(saved["seed"]))
            program.load_state_dict(saved["state"])
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise StateFileError(f"{who}: {path} does not fit this model ({type(e).__name__}: {e})") from None
        self._set_scaler(scaler)  # files saved before party preprocessing existed hold none: features as they are
        self.rewinds.on_load(saved.get("state_id"), request.meta["dir"])
        return Reply(meta={"ok": True, "model": got})
