"""The split-network party program (``splitnn/party``): a party's representation models, trained by split learning."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from partialvfl.federation.dp.gaussian import clip_rows
from partialvfl.federation.runtime.party import PartyRuntime
from partialvfl.federation.wire.messages import Reply, Request
from partialvfl.federation.wire.meta_keys import FLAG, HANDLE, MetaKey
from partialvfl.federation.wire.program import PartyProgram, register_program, state_file
from partialvfl.federation.wire.refusals import PolicyViolation
from partialvfl.federation.wire.schema import INFERS, Messages, MessageSpec, TensorSpec
from partialvfl.federation.wire.setup_config import FeatureSetup, OptimiserSetup, setting
from partialvfl.federation.wire.setup_shape import Network, SetupShape, optimiser_settings
from partialvfl.methods.splitnn.batched import handle_batch
from partialvfl.methods.splitnn.private import private_update
from partialvfl.methods.splitnn.simsiam import SimSiamConfig, SimSiamTrainer
from partialvfl.methods.splitnn.spec import ENCODERS
from partialvfl.nn.blocks import build_encoder, encoder_arch, for_device
from partialvfl.nn.optim import make_optimizer
from partialvfl.utils.seeding import torch_generator, torch_seeded

__all__ = ["SplitParty", "SplitSetup", "build_party_model", "encoder_init"]


@dataclass(frozen=True, kw_only=True)
class SplitSetup(FeatureSetup):
    """The set-up config of ``splitnn/party`` (the coordinator builds it from the method's parameters)."""

    models: tuple[str, ...] = setting(doc="the names of the representation models it builds, one encoder each")
    latent_dim: int = setting(low=1, doc="width of each representation (sent per row)")
    encoder: str = setting("auto", choices=ENCODERS, doc="encoder family (auto: mlp for a vector, cnn otherwise)")
    encoder_hidden: tuple[int, ...] = setting((256, 256), low=1, doc="hidden widths of an MLP encoder")
    resnet_width: int = setting(64, low=1, doc="base width of a resnet18 encoder")
    optimizer: OptimiserSetup = setting(doc="the encoders' optimiser")


def build_party_model(config: SplitSetup, seed: int, party: int, name: str) -> nn.Module:
    """Party ``party``'s model ``name`` as a ``setup`` with ``config`` and ``seed`` builds it (seeded weights)."""
    with torch_seeded(seed, "splitnn", party, name):
        return build_encoder(config.feature_shape, config.latent_dim, config.encoder, hidden=config.encoder_hidden,
                             width=config.resnet_width)


def encoder_init(source: dict[str, torch.Tensor], target: dict[str, torch.Tensor], who: str
                 ) -> dict[str, torch.Tensor]:
    """``target``'s weights taken from a FALSE-VFL encoder ``source`` of the same architecture: equal shapes are
    copied; the output layer, twice as wide there (mean and log-variance of q(h|x)), gives its first half (the
    mean), so the representation starts as the posterior mean.  Any other difference is refused, naming the weight."""
    out = {}
    last = next(reversed(target)).rsplit(".", 1)[0]  # the output layer: the module of the last weights
    for key, t in target.items():
        s = source.get(key)
        if s is not None and s.shape == t.shape:
            out[key] = s.clone()
        elif (s is not None and key.rsplit(".", 1)[0] == last and s.dim() >= 1 and s.shape[0] == 2 * t.shape[0]
              and s.shape[1:] == t.shape[1:]):
            out[key] = s[:t.shape[0]].clone()
        else:
            raise ValueError(f"{who}: the generative encoder's {key!r} ({None if s is None else tuple(s.shape)}) does "
                             f"not fit the encoder's ({tuple(t.shape)}): the architectures differ (latent_dim must be "
                             "the generative d_h, encoder and encoder_hidden the same)")
    return out


@register_program
class SplitParty(PartyProgram):
    """A party's representation models f_k (one per name in ``config['models']``), trained by split learning."""

    program_name = "splitnn/party"
    supports_privacy = True
    resumes_mid_step = True  # state_dict holds the rows of a pending training forward: it is run again on load
    setup_config = SplitSetup
    config: SplitSetup
    messages: ClassVar[Messages] = {
        "embed": MessageSpec(request=[TensorSpec("rows:{model}", "int64", ("B",))],
                             reply=[TensorSpec("emb:{model}", "float32", ("B", "latent_dim"))],
                             meta={"data": HANDLE}, optional_meta={"train": FLAG}, role=INFERS,
                             releases=["emb:{model}"]),
        "grad_embedding": MessageSpec(
            request=[TensorSpec("grad:{model}", "float32", ("B", "latent_dim")),
                     TensorSpec("sections:{model}", "int64", ("Q",), optional=True),
                     TensorSpec("next:{model}", "int64", ("N",), optional=True)],
            reply=[TensorSpec("emb:{model}", "float32", ("N", "latent_dim"), optional=True)],
            optional_meta={"data": HANDLE, "train": FLAG}, gradients=["grad:{model}"], releases=["emb:{model}"],
            doc="The loss gradient of the representations it sent: back-propagate, step.  `sections:<model>` (rows "
                "per step, in order): several steps' gradients, each applied after the model is run again on that "
                "step's rows (the stale schedule).  `next:<model>`: the next step's rows, whose `embed` (of "
                "`data`, with `train`) rides with this message: their representations come back as `emb:<model>`."),
        "pretrain": MessageSpec(meta={"data": HANDLE, "simsiam": MetaKey(dict, doc="SimSiam's settings"),
                                      "epoch": MetaKey(int, low=0, doc="0 starts pretraining")},
                                optional_meta={"models": MetaKey(tuple[str, ...], doc="the models to pretrain"),
                                               "last": MetaKey(bool, doc="the last epoch")},
                                learning_rates=["simsiam.lr"], weight_decays=["simsiam.weight_decay"],
                                momenta=["simsiam.momentum"]),
        "set_lr": MessageSpec(meta={"lr": MetaKey(float, low=0)}, learning_rates=["lr"]),
        "init_encoder": MessageSpec(meta={"dir": MetaKey(str, doc="a state directory"),
                                          "program": MetaKey(str, choices=("false-vfl/party",))},
                                    doc="Initialise every model from this party's own saved state of another program "
                                        "in `dir` (FALSE-VFL's stage-1 encoder: its weights, the output layer's "
                                        "mean half); read from the party's own disk, nothing crosses."),
    }

    @classmethod
    def describe_setup(cls, config: SplitSetup) -> SetupShape:
        """One encoder per model name, each sending ``latent_dim`` values per row (and their gradients back)."""
        shape, latent = config.feature_shape, config.latent_dim
        family = encoder_arch(config.encoder, shape)
        nets = tuple(Network(f"model {name!r}", family, config.encoder_hidden, shape, latent, latent,
                             resnet_width=config.resnet_width) for name in config.models)
        return SetupShape(nets, feature_shape=shape, **optimiser_settings(optimizer=config.optimizer))

    @classmethod
    def private_setup_refusal(cls, config: SplitSetup) -> str | None:
        """ResNet-18's batch normalisation mixes the rows of a batch: no per-row clipping bounds one row's part."""
        if encoder_arch(config.encoder, config.feature_shape) == "resnet18":
            return ("a resnet18 encoder (batch normalisation mixes the rows of a batch) cannot be trained under it: "
                    "use encoder mlp or cnn")
        return None

    def released_rows(self, kind: str, request: Request, reply: Reply) -> dict[str, tuple[str, np.ndarray, int]]:
        """``emb:<model>`` is about the rows of ``rows:<model>``."""
        handle: str = request.meta["data"]
        prefix = "next:" if kind == "grad_embedding" else "rows:"
        return {f"emb:{k.removeprefix(prefix)}": (handle, t.numpy(), 0) for k, t in request.tensors.items()
                if k.startswith(prefix) and f"emb:{k.removeprefix(prefix)}" in reply.tensors}

    def __init__(self, runtime: PartyRuntime, config: SplitSetup, seed: int) -> None:
        super().__init__(runtime, config, seed)
        self.feature_shape = config.feature_shape
        self.latent_dim = config.latent_dim
        self.models: dict[str, nn.Module] = {}
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        opt = config.optimizer
        for name in config.models:
            model = for_device(build_party_model(config, seed, runtime.index, name).to(self.device), self.device)
            self.models[name] = model
            self.optimizers[name] = make_optimizer(model.parameters(), opt.name, opt.lr, opt.weight_decay,
                                                   opt.momentum)
        self._pending: dict[str, torch.Tensor] = {}
        self._inputs: dict[str, torch.Tensor] = {}  # model -> the features of its pending training forward
        self._sources: dict[str, tuple[str, torch.Tensor]] = {}  # model -> (handle, rows) of that forward
        self._lazy: dict[str, tuple[str, torch.Tensor]] = {}  # pending forwards of a loaded state, run on demand
        self._buffers_before: dict[str, dict[str, torch.Tensor]] = {}  # model -> buffers before a ridden forward
        self._private_rows: dict[str, tuple[str, np.ndarray, torch.Tensor]] = {}  # model -> (handle, rows, x)
        self._groups: dict[str, Any] = {}  # model -> (stacked group, slot) of a batched training forward
        self._simsiam: dict[str, SimSiamTrainer] = {}
        self._simsiam_saved: dict[str, Any] | None = None

    def _features(self, handle: str, rows: torch.Tensor) -> torch.Tensor:
        return self.rows_features(handle, rows)

    def _model(self, name: str) -> nn.Module:
        try:
            return self.models[name]
        except KeyError:
            raise ValueError(
                f"party {self.party}: no representation model {name!r}; it holds {sorted(self.models)}"
            ) from None

    def forward_model(self, name: str, x: torch.Tensor, train: bool,
                      source: tuple[str, torch.Tensor] | None = None) -> torch.Tensor:
        """Model ``name`` on its rows ``x`` (training: the graph is kept until its gradient arrives; ``source``: the
        handle and rows ``x`` is of, kept with the state meanwhile).  Under a privacy budget each row's
        representation is clipped to the plan's norm here, inside the graph, so that the gradient the party
        back-propagates is that of what it released."""
        model = self._model(name)
        if train:
            self.keep_buffers(name, source)
        model.train(train)
        with torch.set_grad_enabled(train):
            h = model(x) if len(x) else x.new_zeros(0, self.latent_dim)
            if self.runtime.privacy is not None and len(x):
                h = clip_rows(h, self.runtime.privacy.clip_for("emb:{model}"))
        if train:
            self._pending[name] = h
            self._inputs[name] = x
        return h

    def on_embed(self, req: Request) -> Reply:
        """``embed``: the party's representations (``emb:<model>``) of the rows each ``rows:<model>`` names."""
        return Reply(self._embed_rows(req.meta["data"], req.tensors, req.meta.get("train", False), "rows:"))

    def _embed_rows(self, handle: str, tensors: dict[str, torch.Tensor], train: bool, prefix: str
                    ) -> dict[str, torch.Tensor]:
        """``emb:<model>`` of the rows each ``<prefix><model>`` tensor names."""
        out: dict[str, torch.Tensor] = {}
        for key, rows in tensors.items():
            if not key.startswith(prefix):
                if prefix == "rows:":
                    raise ValueError(f"party {self.party}: unexpected tensor {key!r} in an embed request")
                continue
            name = key.removeprefix(prefix)
            x = self._features(handle, rows)
            out[f"emb:{name}"] = self.forward_model(name, x, train, (handle, rows))
            if train and self.runtime.privacy is not None:
                self._private_rows[name] = (handle, rows.numpy(), x)
        return out

    def next_embed(self, req: Request) -> Request | None:
        """The ``embed`` that rides with a ``grad_embedding`` (its ``next:<model>`` rows), or ``None``."""
        rows = {f"rows:{k.removeprefix('next:')}": t for k, t in req.tensors.items() if k.startswith("next:")}
        if not rows:
            return None
        if "data" not in req.meta:
            raise ValueError(f"party {self.party}: next-step rows without meta 'data' (the handle they are of)")
        return Request("embed", rows, {"data": req.meta["data"], "train": req.meta.get("train", False)})

    def keep_buffers(self, name: str, source: tuple[str, torch.Tensor] | None) -> None:
        """Before a training forward of model ``name``: keep the buffers it will change (batch normalisation) and
        what it is run on, so that :meth:`state_dict` until its gradient arrives is the state before it (a
        checkpoint or a restart in between runs it again and comes out the same)."""
        self._lazy.pop(name, None)
        buffers = {k: b.detach().clone() for k, b in self._model(name).named_buffers()}
        self._buffers_before.pop(name, None)
        if buffers:
            self._buffers_before[name] = buffers
        if source is not None:
            self._sources[name] = source
        else:
            self._sources.pop(name, None)

    def _pending_forward(self, name: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The pending training forward of model ``name`` (its output and features): the one this process ran, or
        one of a loaded state run now (at the same weights: the same floats)."""
        h, x = self._pending.pop(name, None), self._inputs.pop(name, None)
        if h is None and name in self._lazy:
            handle, rows = self._lazy.pop(name)
            x = self._features(handle, rows)
            h = self.forward_model(name, x, True, (handle, rows))
            self._pending.pop(name, None)
            self._inputs.pop(name, None)
        self._buffers_before.pop(name, None)
        self._sources.pop(name, None)
        return h, x

    def handle(self, request: Request) -> Reply:
        """Answer ``request``; a ``grad_embedding`` of a batched round is answered with its round."""
        if request.kind == "grad_embedding" and self._groups:  # its forward was part of a batched round's
            return handle_batch([(self, request)])[0]
        return super().handle(request)

    @classmethod
    def handle_batch(cls, items: Sequence[tuple[PartyProgram, Request]]) -> list[Reply] | None:
        """In-process rounds of several parties as one batched computation (:mod:`.batched`)."""
        return handle_batch(items)

    def on_grad_embedding(self, req: Request) -> Reply:
        """``grad_embedding``: apply the gradients of its representations, then embed the next rows if they ride with
        it.
        """
        nxt = self.next_embed(req)
        self.apply_gradients(req)
        return Reply() if nxt is None else self.on_embed(nxt)

    def apply_gradients(self, req: Request) -> None:
        """The update of a ``grad_embedding`` (without the ``embed`` riding with it)."""
        grads = {k.removeprefix("grad:"): g for k, g in req.tensors.items() if k.startswith("grad:")}
        sections = {k.removeprefix("sections:"): t for k, t in req.tensors.items() if k.startswith("sections:")}
        if sections and self.runtime.privacy is not None:
            raise ValueError(f"party {self.party}: the stale schedule (sections) is not covered by this party's "
                             "differential-privacy budget")
        if self.runtime.privacy is not None:
            private_update(self, grads)
            self._inputs, self._sources, self._buffers_before = {}, {}, {}
            return
        total: torch.Tensor | None = None
        stale: dict[str, torch.Tensor] = {}
        for name, grad in grads.items():
            h, x = self._pending_forward(name)
            if h is None or x is None:
                raise RuntimeError(f"party {self.party}: gradient for {name!r} without a pending training forward")
            if name in sections:
                stale[name] = x
                continue
            if h.requires_grad and h.numel():
                term = (h * grad).sum()
                total = term if total is None else total + term
        plain = [name for name in grads if name not in sections]
        for name in plain:
            self.optimizers[name].zero_grad()
        if total is not None:
            total.backward()
        for name in plain:
            self.optimizers[name].step()
        for name, x in stale.items():  # the rows of several steps: one update each
            self._stale_updates(name, x, grads[name], sections[name])

    def _stale_updates(self, name: str, x: torch.Tensor, grad: torch.Tensor, counts: torch.Tensor) -> None:
        """One optimiser step per section of ``x`` (a step's rows, in order): the model run again at its current
        weights, back-propagated with that step's (stale) gradient."""
        sizes = [int(n) for n in counts.tolist()]
        if sum(sizes) != len(x) or any(n < 0 for n in sizes):
            raise ValueError(f"party {self.party}: sections of {name!r} sum to {sum(sizes)}, its rows are {len(x)}")
        model, optimizer = self._model(name), self.optimizers[name]
        model.train(True)
        start = 0
        for n in sizes:
            if n:
                optimizer.zero_grad()
                (model(x[start:start + n]) * grad[start:start + n]).sum().backward()
                optimizer.step()
            start += n

    def on_set_lr(self, req: Request) -> Reply:
        """``set_lr``: the learning rate of every optimiser of the party."""
        for opt in self.optimizers.values():
            for group in opt.param_groups:
                group["lr"] = req.meta["lr"]
        return Reply()

    def on_pretrain(self, req: Request) -> Reply:
        """One SimSiam epoch of each model on all the party's own rows of ``data`` (nothing crosses but losses).

        ``meta['epoch']`` 0 starts pretraining (fresh SimSiam heads); ``meta['last']`` ends it (heads dropped).
        """
        if self.runtime.privacy is not None:
            raise PolicyViolation("dp_epsilon", f"party {self.party}: SimSiam pretraining is not covered by this "
                                  "party's differential-privacy budget (its updates are not DP-SGD and it reports "
                                  "losses); fit with pretrain=false")
        view = self.data(req.meta["data"])
        names = list(req.meta.get("models") or list(self.models))
        if req.meta["epoch"] == 0 or not self._simsiam:
            cfg = SimSiamConfig.from_dict(req.meta["simsiam"])
            self._simsiam = {
                name: SimSiamTrainer(self._model(name), self.runtime.table(req.meta["data"]), self.feature_shape, cfg,
                                     torch_generator(self.seed, "simsiam", self.party, name), out_dim=self.latent_dim,
                                     device=self.device)
                for name in names}
            if self._simsiam_saved is not None:  # resumed between two epochs: continue exactly where it stopped
                for name, st in self._simsiam_saved.items():
                    self._simsiam[name].load_state_dict(st)
                self._simsiam_saved = None
        losses = {name: self._simsiam[name].run_epoch() for name in names}
        if req.meta.get("last"):
            self._simsiam = {}
        return Reply(meta={"losses": losses, "n_rows": int(view.n_observed)})

    def on_init_encoder(self, req: Request) -> Reply:
        """Every model takes this party's own FALSE-VFL stage-1 encoder saved in ``dir`` (see :func:`encoder_init`)."""
        path = state_file(self.runtime.resolve_dir(req.meta["dir"]), self.party)
        saved = torch.load(path, map_location="cpu", weights_only=True)  # saved on any device; moved on load
        if saved.get("program") != req.meta["program"] or req.meta["program"] != "false-vfl/party":
            raise ValueError(f"party {self.party}: {path} holds a {saved.get('program')!r} state; init_encoder reads "
                             "a 'false-vfl/party' state")
        encoder = {k.removeprefix("encoder."): v for k, v in saved["state"]["net"].items() if k.startswith("encoder.")}
        for name, model in self.models.items():
            model.load_state_dict(encoder_init(encoder, model.state_dict(), f"party {self.party} model {name!r}"))
        return Reply(meta={"ok": True})

    def state_dict(self) -> dict[str, Any]:
        """Models and optimisers (and SimSiam's heads between pretraining epochs), for an exact resume."""
        state: dict[str, Any] = {
            "models": {name: {k: self._buffers_before.get(name, {}).get(k, v).detach().clone()
                              for k, v in m.state_dict().items()} for name, m in self.models.items()},
            "optimizers": {name: opt.state_dict() for name, opt in self.optimizers.items()},
        }
        if self._simsiam:
            state["simsiam"] = {name: t.state_dict() for name, t in self._simsiam.items()}
        pending = {name: {"handle": h, "rows": r.clone()} for name, (h, r) in self._sources.items()
                   if name in self._pending}
        pending.update({name: {"handle": h, "rows": r.clone()} for name, (h, r) in self._lazy.items()})
        if pending:  # training forwards whose gradient has not arrived: run again on load, when it arrives
            state["pending"] = pending
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the state saved by :meth:`state_dict`."""
        if "models" not in state:  # models saved before optimiser states were kept: {name: weights}
            state = {"models": state}
        for name, sd in state["models"].items():
            self._model(name).load_state_dict(sd)
        for name, sd in state.get("optimizers", {}).items():
            self.optimizers[name].load_state_dict(sd)
        self._simsiam = {}
        self._simsiam_saved = state.get("simsiam")
        self._pending, self._groups, self._private_rows = {}, {}, {}
        self._inputs, self._buffers_before, self._sources = {}, {}, {}
        self._lazy = {name: (str(p["handle"]), p["rows"]) for name, p in state.get("pending", {}).items()}
