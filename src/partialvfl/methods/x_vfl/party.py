"""X-VFL's party program: bottom model f_k, completer XCom_k, and (after training) a copy of the top model h."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from partialvfl.data.dataset import PartyView
from partialvfl.data.within_block import (
    within_block_mask,
)
from partialvfl.federation.runtime.party import PartyRuntime
from partialvfl.federation.wire.messages import Reply, Request
from partialvfl.federation.wire.meta_keys import FLAG, HANDLE, MetaKey
from partialvfl.federation.wire.program import PartyProgram, register_program
from partialvfl.federation.wire.schema import INFERS, Messages, MessageSpec, TensorSpec
from partialvfl.federation.wire.setup_config import FeatureSetup, OptimiserSetup, SetupConfig, setting
from partialvfl.federation.wire.setup_shape import Network, SetupShape, optimiser_settings
from partialvfl.methods.x_vfl.spec import ENCODERS, XVFL_PARAMS
from partialvfl.methods.x_vfl.updater import _Updater
from partialvfl.nn.blocks import MLP, build_decoder, build_encoder, decoder_arch, encoder_arch
from partialvfl.utils.devices import to_numpy
from partialvfl.utils.seeding import torch_seeded

__all__ = ["WithinBlock", "XVFLParty", "XVFLSetup"]


@dataclass(frozen=True, kw_only=True)
class XVFLSetup(FeatureSetup):
    """The set-up config of ``x-vfl/party`` (the coordinator builds it from the method's parameters)."""

    embed_dim: int = setting(low=1, doc="width of its embedding E_k (sent per row)")
    encoder: str = setting(choices=ENCODERS, doc="bottom model family (auto: mlp for a vector, cnn otherwise)")
    encoder_hidden: tuple[int, ...] = setting(low=1, doc="hidden widths of an MLP bottom model")
    resnet_width: int = setting(low=1, doc="base width of a resnet18 bottom model")
    xcom: str = setting(choices=XVFL_PARAMS.param("xcom").choices, doc="completer family (auto: mlp for a vector, "
                        "deconv otherwise)")
    xcom_hidden: tuple[int, ...] = setting(low=1, doc="hidden widths of an MLP completer")
    optimizer: OptimiserSetup = setting(doc="the optimiser of its bottom model and completer")
    estimator: str = setting(choices=XVFL_PARAMS.param("estimator").choices, doc="sgd, or page (PAGE's estimator "
                             "keeps the previous parameters)")


@dataclass(frozen=True, kw_only=True)
class WithinBlock(SetupConfig):
    """What a party needs to recompute its own masks of features lost inside its block (``wb`` of a request:
    :func:`~partialvfl.data.within_block.wire_setting`)."""

    rate: float = setting(low=0, high=1, doc="the fraction of a partial row's features lost")
    seed: int = setting(doc="the seed of the masks")


_VERSION = MetaKey(str, choices=("cur", "prev"), doc="the parameters (PAGE keeps the previous ones)")
_WB = MetaKey(WithinBlock | None, doc="the within-block setting")


@register_program
class XVFLParty(PartyProgram):
    """Party k of X-VFL: bottom model f_k, completer XCom_k, and (after training) a copy of the top model h.

    Message kinds: ``embed`` (E_k of rows it holds), ``complete`` (Et_k = f_k(XCom_k(input)) from averaged
    embeddings, mixed with its own present features where its block is partial), ``backward_complete`` and
    ``backward`` (gradients of Et_k and E_k; the first replies the gradient of the XCom input), ``step`` (update),
    ``share_top`` (receive h and the label prior for locally independent inference).
    """

    program_name = "x-vfl/party"
    setup_config = XVFLSetup
    config: XVFLSetup
    messages: ClassVar[Messages] = {
        "embed": MessageSpec(request=[TensorSpec("rows", "int64", ("B",)),
                                      TensorSpec("partial", "bool", ("B",), optional=True)],
                             reply=[TensorSpec("emb", "float32", ("B", "embed_dim"))],
                             meta={"data": HANDLE}, optional_meta={"train": FLAG, "version": _VERSION, "wb": _WB},
                             role=INFERS,
                             releases=["emb"]),
        "complete": MessageSpec(request=[TensorSpec("rows", "int64", ("B",)),
                                         TensorSpec("partial", "bool", ("B",), optional=True),
                                         TensorSpec("inputs", "float32", ("B", "embed_dim"))],
                                reply=[TensorSpec("emb_tilde", "float32", ("B", "embed_dim"))],
                                meta={"data": HANDLE}, optional_meta={"train": FLAG, "version": _VERSION, "wb": _WB,
                                                                      "input_grad": FLAG}, role=INFERS,
                                releases=["emb_tilde"]),
        "backward_complete": MessageSpec(
            request=[TensorSpec("grad", "float32", ("B", "embed_dim"))],
            reply=[TensorSpec("grad_inputs", "float32", ("B", "embed_dim"), optional=True)],
            optional_meta={"version": _VERSION}, releases=["grad_inputs"], gradients=["grad"]),
        "backward": MessageSpec(request=[TensorSpec("grad", "float32", ("B", "embed_dim"))],
                                optional_meta={"version": _VERSION}, gradients=["grad"]),
        "step": MessageSpec(meta={"mode": MetaKey(str, choices=("sgd", "page-fresh", "page-correct"))}),
        "share_top": MessageSpec(request=[TensorSpec("top.*", "float32"),
                                          TensorSpec("label_prior", "float64", ("C",))],
                                 meta={"top_hidden": MetaKey(tuple[int, ...], low=1),
                                       "n_classes": MetaKey(int, low=1)}),
        "predict_local": MessageSpec(request=[TensorSpec("rows", "int64", ("N",)),
                                              TensorSpec("partial", "bool", ("N",))],
                                     reply=[TensorSpec("probs", "float64", ("N", "C"))],
                                     meta={"data": HANDLE, "completion": MetaKey(str, choices=("self", "none"))},
                                     optional_meta={"wb": _WB}, role=INFERS,
                                     releases=["probs"]),
    }

    @classmethod
    def describe_setup(cls, config: XVFLSetup) -> SetupShape:
        """The bottom model (sends ``embed_dim`` per row) and the completer, which works on averaged embeddings and
        whose output is re-encoded by the bottom model (nothing of its own is sent)."""
        shape, e = config.feature_shape, config.embed_dim
        nets = (Network("bottom", encoder_arch(config.encoder, shape), config.encoder_hidden, shape, e, e,
                        resnet_width=config.resnet_width),
                Network("xcom", decoder_arch(config.xcom, shape), config.xcom_hidden, (e,), math.prod(shape)))
        return SetupShape(nets, feature_shape=shape, **optimiser_settings(optimizer=config.optimizer))

    def __init__(self, runtime: PartyRuntime, config: XVFLSetup, seed: int) -> None:
        super().__init__(runtime, config, seed)
        self.feature_shape = config.feature_shape
        self.feature_dim = config.feature_dim
        self.embed_dim = config.embed_dim
        with torch_seeded(seed, "x-vfl", runtime.index, "bottom"):
            bottom = build_encoder(self.feature_shape, self.embed_dim, config.encoder, hidden=config.encoder_hidden,
                                   width=config.resnet_width)
        with torch_seeded(seed, "x-vfl", runtime.index, "xcom"):
            xcom = build_decoder(self.embed_dim, self.feature_shape, config.xcom, hidden=config.xcom_hidden)
        self.net = nn.ModuleDict({"bottom": bottom, "xcom": xcom}).to(self.device)
        self.updater = _Updater(self.net, config.optimizer, page=config.estimator == "page")
        self.top: nn.Module | None = None
        self.top_hidden: list[int] = []
        self.label_prior: torch.Tensor | None = None
        self._pending: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor | None]] = {}

    # ------------------------------------------------------------------ own data
    def _block(self, view: PartyView, rows: np.ndarray, partial: np.ndarray,
               wb: WithinBlock | None, handle: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Party k's features for ``rows`` (zero where lost inside a partial block) and the present-feature mask
        (``handle``: the data ``view`` is, whose table is on the party's device already)."""
        pos = view.position_of_rows(rows)
        if handle is not None:  # the table the party moved to its device once
            x = self.runtime.table(handle)[torch.as_tensor(pos, device=self.device)]
        else:
            x = torch.as_tensor(np.asarray(view.features[pos]), dtype=torch.float32).to(self.device)
        mask = torch.ones(x.shape, dtype=torch.bool, device=self.device)
        if partial.any():
            if wb is None:
                raise ValueError(f"party {self.party}: rows flagged partial but no within-block setting was sent")
            keep = within_block_mask(view.ids[pos[partial]], self.party, self.feature_dim, wb.rate, wb.seed)
            mask[torch.as_tensor(np.flatnonzero(partial), device=self.device)] = torch.as_tensor(keep,
                                                                                               device=self.device)
            x = x * mask
        return x, mask

    @staticmethod
    def _rows(req: Request) -> tuple[np.ndarray, np.ndarray]:
        rows = req.tensors["rows"].numpy().astype(np.int64)
        partial = req.tensors["partial"].numpy().astype(bool) if "partial" in req.tensors else np.zeros(len(rows), bool)
        return rows, partial

    # ------------------------------------------------------------------ handlers
    def on_embed(self, req: Request) -> Reply:
        """``embed``: the bottom model's embeddings of the party's ``rows`` (kept for the gradient when training)."""
        rows, partial = self._rows(req)
        train = req.meta.get("train", False)
        version = req.meta.get("version", "cur")
        net = self.updater.model(version)
        net.train(train)
        x, _ = self._block(self.data(req.meta["data"]), rows, partial, req.meta.get("wb"), req.meta["data"])
        if train:
            e = net["bottom"](x)
            self._pending[(version, "emb")] = (e, None)
        else:
            with torch.no_grad():
                e = net["bottom"](x)
        return Reply({"emb": e})

    def _complete(self, net: nn.Module, inputs: torch.Tensor, view: PartyView | None, rows: np.ndarray,
                  partial: np.ndarray, wb: WithinBlock | None, handle: str | None = None) -> torch.Tensor:
        """Et = f_k(Xt): Xt = XCom_k(input), keeping the party's own present features where its block is partial."""
        xt = net["xcom"](inputs)
        if partial.any():
            assert view is not None
            x, mask = self._block(view, rows[partial], np.ones(int(partial.sum()), bool), wb, handle)
            idx = torch.as_tensor(np.flatnonzero(partial), device=self.device)
            xt = xt.index_copy(0, idx, torch.where(mask, x, xt[idx]))
        return net["bottom"](xt)  # the completed block stays here; only its embedding is returned

    def on_complete(self, req: Request) -> Reply:
        """``complete``: the party's completed embeddings ``emb_tilde`` from the ``inputs`` (other parties' embeddings)
        through its XCom.
        """
        rows, partial = self._rows(req)
        train = req.meta.get("train", False)
        version = req.meta.get("version", "cur")
        net = self.updater.model(version)
        net.train(train)
        view = self.data(req.meta["data"]) if partial.any() else None
        inputs = req.tensors["inputs"]
        if train:
            if req.meta.get("input_grad", True):
                inputs = inputs.clone().requires_grad_()
            et = self._complete(net, inputs, view, rows, partial, req.meta.get("wb"), req.meta["data"])
            self._pending[(version, "tilde")] = (et, inputs if inputs.requires_grad else None)
        else:
            with torch.no_grad():
                et = self._complete(net, inputs, view, rows, partial, req.meta.get("wb"), req.meta["data"])
        return Reply({"emb_tilde": et})

    def _pop(self, version: str, what: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        try:
            return self._pending.pop((version, what))
        except KeyError:
            raise RuntimeError(f"party {self.party}: gradient for {what!r} ({version}) without a training forward") \
                from None

    def on_backward_complete(self, req: Request) -> Reply:
        """``backward_complete``: back-propagate through the completion; reply the inputs' gradient when it was asked
        for.
        """
        et, inputs = self._pop(req.meta.get("version", "cur"), "tilde")
        et.backward(req.tensors["grad"])
        if inputs is not None and inputs.grad is not None:
            return Reply({"grad_inputs": inputs.grad})
        return Reply()

    def on_backward(self, req: Request) -> Reply:
        """``backward``: back-propagate the embeddings' gradient into the bottom model."""
        e, _ = self._pop(req.meta.get("version", "cur"), "emb")
        e.backward(req.tensors["grad"])
        return Reply()

    def on_step(self, req: Request) -> Reply:
        """``step``: the optimiser step of ``mode`` (the gradients of the round are in)."""
        self._pending.clear()
        self.updater.step(req.meta["mode"])
        return Reply()

    def on_share_top(self, req: Request) -> Reply:
        """``share_top``: the top model and label prior, for locally independent inference."""
        self.top_hidden = req.meta["top_hidden"]  # a list of integers >= 1: the declaration read it
        n_classes = req.meta["n_classes"]
        self.top = MLP(self.embed_dim, self.top_hidden, n_classes).to(self.device)
        self.top.load_state_dict({k.removeprefix("top."): v.clone() for k, v in req.tensors.items()
                                  if k.startswith("top.")})
        self.top.eval()
        self.label_prior = req.tensors["label_prior"].clone()
        return Reply()

    # ------------------------------------------------------------------ locally independent inference
    def on_predict_local(self, req: Request) -> Reply:
        """Locally independent inference on the rows of ``data`` this party holds: ``probs`` ``(n_rows, C)``.

        ``rows`` must be every row the party holds in ``data`` (in order); ``partial`` flags those with features
        missing inside the block.  Only this party's data and models are used.
        """
        view = self.data(req.meta["data"])
        rows = req.tensors["rows"].numpy()
        if not np.array_equal(rows, view.rows):
            raise ValueError(f"party {self.party}: predict_local covers every row it holds in {req.meta['data']!r} "
                             f"({view.n_observed}), in order; got {len(rows)} rows")
        partial = req.tensors["partial"].numpy().astype(bool)
        probs = self.predict_local(view, partial, req.meta.get("wb"), completion=req.meta["completion"])
        return Reply({"probs": torch.as_tensor(probs)})

    @torch.no_grad()
    def predict_local(self, view: PartyView, partial: np.ndarray, wb: WithinBlock | None,
                      completion: str = "self") -> np.ndarray:
        """h(f_k(x_k)) for every row this party holds, computed here alone (no message): ``(n_observed, C)``.

        Rows flagged ``partial`` (features missing inside the block) are first completed from the party's own
        embedding when ``completion == "self"`` (see the module docstring).
        """
        if self.top is None or self.label_prior is None:
            raise RuntimeError(f"party {self.party} has no top model yet: it is shared when training ends")
        if completion not in ("self", "none"):
            raise ValueError(f"local_completion must be 'self' or 'none', got {completion!r}")
        self.net.eval()
        if view.n_observed == 0:
            return np.zeros((0, int(self.label_prior.shape[0])))
        x, mask = self._block(view, view.rows, partial, wb)
        e = self.net["bottom"](x)
        if completion == "self" and partial.any():
            xt = torch.where(mask, x, self.net["xcom"](e))
            e = self.net["bottom"](xt)
        return to_numpy(torch.softmax(self.top(e), dim=-1).double())

    # ------------------------------------------------------------------ persistence
    def state_dict(self) -> dict[str, Any]:
        """The state to save: what :meth:`load_state_dict` restores."""
        return {
            "net": {k: v.detach().clone() for k, v in self.net.state_dict().items()},
            "updater": self.updater.state_dict(),
            "top": None if self.top is None else {k: v.detach().clone() for k, v in self.top.state_dict().items()},
            "top_hidden": list(self.top_hidden),
            "label_prior": None if self.label_prior is None else self.label_prior.clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the state saved by :meth:`state_dict`."""
        self.net.load_state_dict(state["net"])
        if "updater" in state:  # models saved before optimiser states were kept load without one
            self.updater.load_state_dict(state["updater"])
        if state.get("top") is not None:
            self.top_hidden = [int(h) for h in state["top_hidden"]]
            out_dim = int(state["label_prior"].shape[0])
            self.top = MLP(self.embed_dim, self.top_hidden, out_dim).to(self.device)
            self.top.load_state_dict(state["top"])
            self.top.eval()
            self.label_prior = state["label_prior"].clone()
