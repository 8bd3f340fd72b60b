"""FedHSSL's party program: cross-party encoder, local bottom and top encoders, their SimSiam heads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from partialvfl.federation.runtime.party import PartyRuntime
from partialvfl.federation.wire.messages import Reply, Request
from partialvfl.federation.wire.meta_keys import FLAG, HANDLE, MetaKey
from partialvfl.federation.wire.program import PartyProgram, register_program
from partialvfl.federation.wire.schema import INFERS, SHARES_WEIGHTS, Messages, MessageSpec, TensorSpec
from partialvfl.federation.wire.setup_config import FeatureSetup, OptimiserSetup, SetupConfig, setting
from partialvfl.federation.wire.setup_shape import Network, SetupShape, optimiser_settings
from partialvfl.methods.fedhssl.networks import split_encoder
from partialvfl.methods.fedhssl.spec import ENCODERS, FEDHSSL_PARAMS
from partialvfl.methods.splitnn.simsiam import SimSiamConfig, SimSiamHead, make_augmenter, simsiam_loss
from partialvfl.nn.blocks import build_encoder, encoder_arch
from partialvfl.nn.optim import make_optimizer
from partialvfl.utils.devices import scalar, to_numpy
from partialvfl.utils.seeding import torch_generator, torch_seeded

__all__ = ["FedHSSLParty", "FedHSSLSetup", "SimSiamHeads"]


@dataclass(frozen=True, kw_only=True)
class SimSiamHeads(SetupConfig):
    """The widths of FedHSSL's SimSiam heads (projector and predictor)."""

    proj_dim: int = setting(low=1, doc="projection width (sent per row in cross-party pretraining)")
    proj_hidden: int = setting(low=1, doc="projector hidden width")
    pred_hidden: int = setting(low=1, doc="predictor hidden width")


@dataclass(frozen=True, kw_only=True)
class FedHSSLSetup(FeatureSetup):
    """The set-up config of ``fedhssl/party`` (the coordinator builds it from the method's parameters)."""

    latent_dim: int = setting(low=1, doc="width of each encoder's output")
    encoder: str = setting(choices=ENCODERS, doc="encoder family (auto: mlp for a vector, cnn otherwise)")
    encoder_hidden: tuple[int, ...] = setting(low=1, doc="hidden widths of an MLP encoder")
    resnet_width: int = setting(low=1, doc="base width of a resnet18 encoder")
    pool: str = setting(choices=FEDHSSL_PARAMS.param("pool").choices, doc="the party's representation: a weighted "
                        "mean or the concatenation of its cross-party and local encoders")
    pool_ratio: float = setting(low=0, high=1, doc="weight of the cross-party encoder in the mean pool")
    simsiam: SimSiamHeads = setting(doc="the SimSiam heads")
    pretrain_optimizer: OptimiserSetup = setting(doc="the pretraining optimiser")
    finetune_optimizer: OptimiserSetup = setting(doc="the fine-tuning optimiser")
    aggregate: str = setting("top+head", choices=("top", "top+head", "none"), doc="what partial model aggregation "
                             "shares (none: nothing; the party's policy decides whether it agrees)")


def _neg_cos(p: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    return -F.cosine_similarity(p, z.detach(), dim=-1).mean()


#: what partial model aggregation averages (a program set up with aggregate "none" is never asked)
_AGGREGATE = MetaKey(str, choices=("top", "top+head"))


@register_program
class FedHSSLParty(PartyProgram):
    """Party k of FedHSSL: cross-party encoder, local bottom and top encoders, their SimSiam heads.

    Message kinds: ``cross_project`` / ``cross_update`` (one cross-party SimSiam step on aligned rows),
    ``local_ssl`` (one guided local SimSiam epoch on its own rows), ``get_top`` / ``set_top`` (partial model
    aggregation), ``embed`` / ``grad_embedding`` (fine-tuning by split learning), ``zero_embedding`` (r_k(0), for
    zero-imputation at inference).
    """

    program_name = "fedhssl/party"
    setup_config = FedHSSLSetup
    config: FedHSSLSetup
    # P: SimSiam projection width, J: partners, R: representation width (latent_dim, or twice it with pool=concat)
    messages: ClassVar[Messages] = {
        "cross_project": MessageSpec(request=[TensorSpec("rows", "int64", ("B",))],
                                     reply=[TensorSpec("z", "float32", ("B", "P"))], meta={"data": HANDLE},
                                     releases=["z"]),
        "cross_update": MessageSpec(request=[TensorSpec("targets", "float32", ("B", "J", "P"))]),
        "local_ssl": MessageSpec(meta={"data": HANDLE, "batch_size": MetaKey(int, low=1),
                                       "local_weight": MetaKey(float, low=0), "guidance_weight": MetaKey(float, low=0),
                                       "augment": MetaKey(dict, doc="SimSiam's augmentation (corruption, noise)")}),
        "get_top": MessageSpec(reply=[TensorSpec("top.*", ("float32", "int64")),
                                      TensorSpec("local_head.*", ("float32", "int64"), optional=True)],
                               meta={"aggregate": _AGGREGATE}, role=SHARES_WEIGHTS),
        "set_top": MessageSpec(request=[TensorSpec("top.*", ("float32", "int64")),
                                        TensorSpec("local_head.*", ("float32", "int64"), optional=True)],
                               meta={"aggregate": _AGGREGATE}),
        "embed": MessageSpec(request=[TensorSpec("rows", "int64", ("B",))],
                             reply=[TensorSpec("emb", "float32", ("B", "R"))], meta={"data": HANDLE},
                             optional_meta={"train": FLAG},
                             role=INFERS, releases=["emb"]),
        "grad_embedding": MessageSpec(request=[TensorSpec("grad", "float32", ("B", "R"))], gradients=["grad"]),
        "zero_embedding": MessageSpec(reply=[TensorSpec("emb", "float32", ("R",))], role=INFERS),
    }

    @classmethod
    def describe_setup(cls, config: FedHSSLSetup) -> SetupShape:
        """The cross-party and local encoders (``latent_dim`` per row each) and the SimSiam projection (its
        ``proj_dim`` outputs are sent in cross-party pretraining); aggregation (unless ``none``) shares weights."""
        shape, hidden, latent, width = config.feature_shape, config.encoder_hidden, config.latent_dim, \
            config.resnet_width
        family, proj = encoder_arch(config.encoder, shape), config.simsiam.proj_dim
        nets = (Network("cross-party encoder", family, hidden, shape, latent, latent, resnet_width=width),
                Network("local encoder", family, hidden, shape, latent, latent, resnet_width=width),
                Network("SimSiam projection", "mlp", (config.simsiam.proj_hidden,), (latent,), proj, proj))
        opts = optimiser_settings(pretrain_optimizer=config.pretrain_optimizer,
                                  finetune_optimizer=config.finetune_optimizer)
        return SetupShape(nets, shares_weights=config.aggregate != "none", feature_shape=shape, **opts)

    def __init__(self, runtime: PartyRuntime, config: FedHSSLSetup, seed: int) -> None:
        super().__init__(runtime, config, seed)
        self.feature_shape = config.feature_shape
        latent = config.latent_dim
        arch, hidden, width = config.encoder, list(config.encoder_hidden), config.resnet_width
        ss = config.simsiam
        with torch_seeded(seed, "fedhssl", runtime.index, "cross"):
            cross = build_encoder(self.feature_shape, latent, arch, hidden=hidden, width=width)
        with torch_seeded(seed, "fedhssl", runtime.index, "local"):
            bottom, top = split_encoder(self.feature_shape, latent, arch, hidden, width)
        with torch_seeded(seed, "fedhssl", runtime.index, "heads"):
            cross_head = SimSiamHead(latent, ss.proj_dim, ss.proj_hidden, ss.pred_hidden)
            local_head = SimSiamHead(latent, ss.proj_dim, ss.proj_hidden, ss.pred_hidden)
        self.net = nn.ModuleDict({"cross": cross, "bottom": bottom, "top": top, "cross_head": cross_head,
                                  "local_head": local_head}).to(self.device)
        pt = config.pretrain_optimizer
        self.cross_opt = make_optimizer(list(cross.parameters()) + list(cross_head.parameters()), pt.name, pt.lr,
                                        pt.weight_decay, pt.momentum)
        self.local_opt = make_optimizer(
            list(bottom.parameters()) + list(top.parameters()) + list(local_head.parameters()), pt.name, pt.lr,
            pt.weight_decay, pt.momentum,
        )
        ft = config.finetune_optimizer
        self.ft_opt = make_optimizer(list(cross.parameters()) + list(bottom.parameters()) + list(top.parameters()),
                                     ft.name, ft.lr, ft.weight_decay, ft.momentum)
        self.pool = config.pool
        self.ratio = config.pool_ratio
        self._gen = torch_generator(seed, "fedhssl", runtime.index, "augment")
        self._pending: torch.Tensor | None = None

    # ------------------------------------------------------------------ helpers
    def _features(self, handle: str, rows: torch.Tensor) -> torch.Tensor:
        return self.rows_features(handle, rows)

    def represent(self, x: torch.Tensor) -> torch.Tensor:
        """r_k(x): the pooled cross-party and local representations (the fine-tuned party model)."""
        xc = self.net["cross"](x)
        xl = self.net["top"](self.net["bottom"](x))
        if self.pool == "concat":
            return torch.cat([xc, xl], dim=1)
        return self.ratio * xc + (1 - self.ratio) * xl

    def top_modules(self, aggregate: str) -> nn.ModuleDict:
        """The modules partial model aggregation averages: the local top encoder (with its SimSiam head)."""
        mods = {"top": self.net["top"]}
        if aggregate == "top+head":
            mods["local_head"] = self.net["local_head"]
        elif aggregate != "top":
            raise ValueError(f"aggregate must be 'top' or 'top+head', got {aggregate!r}")
        return nn.ModuleDict(mods)

    # ------------------------------------------------------------------ cross-party SimSiam
    def on_cross_project(self, req: Request) -> Reply:
        """``cross_project``: the cross-party projections ``z`` of the party's ``rows``; keeps its predictions for the
        update.
        """
        self.net.train()
        x = self._features(req.meta["data"], req.tensors["rows"])
        z, p = self.net["cross_head"](self.net["cross"](x))
        self._pending = p
        return Reply({"z": z})

    def on_cross_update(self, req: Request) -> Reply:
        """``cross_update``: one SimSiam step of the cross-party encoder against the other parties' projections
        (``targets``).
        """
        p = self._pending
        if p is None:
            raise RuntimeError(f"party {self.party}: cross_update without cross_project")
        self._pending = None
        targets = req.tensors["targets"]  # (B, partners, proj_dim), other parties' projections
        loss = torch.stack([_neg_cos(p, targets[:, j]) for j in range(targets.shape[1])]).mean()
        self.cross_opt.zero_grad()
        loss.backward()
        self.cross_opt.step()
        return Reply(meta={"loss": scalar(loss)})

    # ------------------------------------------------------------------ guided local SimSiam
    def on_local_ssl(self, req: Request) -> Reply:
        """One epoch of cross-party-guided local SimSiam over all the party's rows (nothing crosses but the loss)."""
        bs = max(2, req.meta["batch_size"])
        wl, wg = req.meta["local_weight"], req.meta["guidance_weight"]
        cfg = SimSiamConfig.from_dict(req.meta["augment"])
        x_all = self.runtime.table(req.meta["data"])  # on the party's device, moved there once
        n = x_all.shape[0]
        if n < 2:
            return Reply(meta={"loss": None})
        augment = make_augmenter(self.feature_shape, to_numpy(x_all), cfg)
        self.net.train()
        perm = torch.randperm(n, generator=self._gen)
        total, count = 0.0, 0
        for start in range(0, n, bs):
            idx = perm[start:start + bs]
            if len(idx) < 2:
                continue
            x = x_all[idx.to(self.device)]
            x1, x2 = augment(x, self._gen), augment(x, self._gen)
            z1, p1 = self.net["local_head"](self.net["top"](self.net["bottom"](x1)))
            z2, p2 = self.net["local_head"](self.net["top"](self.net["bottom"](x2)))
            loss = wl * 2 * simsiam_loss(p1, z1, p2, z2)  # = wl * (negcos(p1, z2) + negcos(p2, z1))
            if wg > 0:
                with torch.no_grad():
                    zc1 = self.net["cross_head"].projector(self.net["cross"](x1))
                    zc2 = self.net["cross_head"].projector(self.net["cross"](x2))
                loss = loss + wg * (_neg_cos(p1, zc1) + _neg_cos(p2, zc2))
            self.local_opt.zero_grad()
            loss.backward()
            self.local_opt.step()
            total += scalar(loss) * len(idx)
            count += len(idx)
        return Reply(meta={"loss": total / max(count, 1)})

    # ------------------------------------------------------------------ partial model aggregation
    def on_get_top(self, req: Request) -> Reply:
        """``get_top``: the weights of the top encoder modules to aggregate."""
        sd = self.top_modules(req.meta["aggregate"]).state_dict()
        return Reply({k: v.detach().clone() for k, v in sd.items()})

    def on_set_top(self, req: Request) -> Reply:
        """``set_top``: load the aggregated weights of the top encoder modules."""
        self.top_modules(req.meta["aggregate"]).load_state_dict(dict(req.tensors))
        return Reply()

    # ------------------------------------------------------------------ fine-tuning and prediction
    def on_embed(self, req: Request) -> Reply:
        """``embed``: the party's representations of its ``rows`` (kept for the gradient when training)."""
        train = req.meta.get("train", False)
        x = self._features(req.meta["data"], req.tensors["rows"])
        self.net.train(train)
        if train:
            r = self.represent(x)
            self._pending = r
        else:
            with torch.no_grad():
                r = self.represent(x)
        return Reply({"emb": r})

    def on_grad_embedding(self, req: Request) -> Reply:
        """``grad_embedding``: back-propagate the representations' gradient and step the fine-tuning optimiser."""
        r = self._pending
        if r is None:
            raise RuntimeError(f"party {self.party}: gradient without a pending training forward")
        self._pending = None
        self.ft_opt.zero_grad()
        r.backward(req.tensors["grad"])
        self.ft_opt.step()
        return Reply()

    def on_zero_embedding(self, req: Request) -> Reply:
        """r_k of an all-zero block (zero-imputation of this party's features)."""
        self.net.eval()
        with torch.no_grad():
            r = self.represent(torch.zeros(1, int(np.prod(self.feature_shape)), device=self.device))
        return Reply({"emb": r[0]})

    # ------------------------------------------------------------------ persistence
    def state_dict(self) -> dict[str, Any]:
        """Modules, the three optimisers and the augmentation generator (an exact resume needs all of them)."""
        return {"net": {k: v.detach().clone() for k, v in self.net.state_dict().items()},
                "optimizers": {"cross": self.cross_opt.state_dict(), "local": self.local_opt.state_dict(),
                               "finetune": self.ft_opt.state_dict()},
                "generator": self._gen.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the state saved by :meth:`state_dict`."""
        self.net.load_state_dict(state["net"])
        if "optimizers" in state:  # models saved before optimiser states were kept load without them
            self.cross_opt.load_state_dict(state["optimizers"]["cross"])
            self.local_opt.load_state_dict(state["optimizers"]["local"])
            self.ft_opt.load_state_dict(state["optimizers"]["finetune"])
            self._gen.set_state(state["generator"])
