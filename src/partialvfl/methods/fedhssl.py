"""FedHSSL: hybrid self-supervised pretraining for VFL, then fine-tuning on aligned labelled samples.

After He et al., "A Hybrid Self-Supervised Learning Framework for Vertical Federated Learning" (IEEE Trans. Big Data,
2024), as the FALSE-VFL paper ran it (Appendix D.1, Tables 4 and 9): SimSiam as the self-supervised method, fine-tuning
on the fully aligned labelled samples only, zero-imputation of absent parties at inference.

Each party k holds a cross-party encoder g_k, a local model split into a local bottom encoder b_k and a local top
encoder t_k (FALSE-VFL Table 4: the lower and upper layers of one network), and SimSiam heads (projector, predictor)
for each.  Pretraining repeats, for ``pretrain_epochs`` epochs:

1. **cross-party SimSiam** on the aligned samples (all K parties observed, labelled or not): the parties' blocks of
   one sample are the two "views".  Party k sends z_k = proj(g_k(x_k)) (a projection, never features); with
   ``cross_pairs="active"`` (FedHSSL's default communication mode) the active party is pulled towards every other
   party and each passive party towards the active party; with ``"all"`` every party towards every other one.  The
   loss of party k is the mean over its partners j of -cos(pred(z_k), stopgrad(z_j)), computed and minimised at k.
2. **cross-party-guided local SimSiam** at every party on all its own samples: two augmentations (``_simsiam``'s
   image and tabular augmenters) through t_k(b_k(.)), the SimSiam loss weighted by ``local_weight``, plus
   ``guidance_weight`` * [-cos(pred(z1), stopgrad(z1_cross)) - cos(pred(z2), stopgrad(z2_cross))] with z_cross the
   cross-party encoder's projection of the same view (FedHSSL's regulariser).  Nothing crosses.
3. **partial model aggregation** (PMA): the active party averages the parties' local top encoders (``aggregate=
   "top"``) or the top encoders with their local SimSiam heads (``"top+head"``, as the authors' code) and sends the
   average back; bottom encoders and cross-party encoders stay private.

Fine-tuning: party k's representation is r_k = ratio * g_k(x_k) + (1 - ratio) * t_k(b_k(x_k)) (``pool="mean"``,
ratio 0.5, the authors' default) or the concatenation (``pool="concat"``); the active party's classifier maps the
concatenation [r_1, ..., r_K] to class logits; trained end to end by split learning on the aligned labelled samples.
At prediction a party absent for a sample is zero-imputed: its block is taken to be all zeros (the standardised mean),
i.e. its representation is r_k(0), which that party computes once per prediction call.

``pretrain=False`` skips pretraining (the FALSE-VFL paper's "*" results: labelled data only).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from partialvfl.data.dataset import CoordinatorView
from partialvfl.federation.messages import Reply, Request
from partialvfl.federation.party import PartyProgram, PartyRuntime, register_program
from partialvfl.federation.schema import Messages, MessageSpec, TensorSpec
from partialvfl.methods._simsiam import SimSiamConfig, SimSiamHead, make_augmenter, simsiam_loss
from partialvfl.methods.base import VFLMethod, register_method
from partialvfl.methods.training import Metrics, Stage, TrainingLoop
from partialvfl.methods.x_vfl_spec import FEDHSSL_PARAMS
from partialvfl.nn.blocks import MLP, ResNet18, build_encoder, image_shape
from partialvfl.nn.optim import make_optimizer
from partialvfl.utils.seeding import numpy_rng, torch_generator, torch_seeded

__all__ = ["FedHSSL", "FedHSSLParty", "average_state_dicts", "split_encoder"]



# ---------------------------------------------------------------------- networks
class _Unflatten(nn.Module):
    def __init__(self, shape: Sequence[int]) -> None:
        super().__init__()
        self.shape = tuple(shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1, *self.shape)


class _PoolFlatten(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=(2, 3))


def split_encoder(feature_shape: Sequence[int], out_dim: int, arch: str = "auto", hidden: Sequence[int] = (128,),
                  width: int = 64) -> tuple[nn.Module, nn.Module]:
    """A local model cut into (bottom, top) encoders whose top has the same shape at every party.

    ``mlp``: bottom = Linear(d, hidden[0]) + ReLU, top = MLP(hidden[0], hidden[1:], out_dim).  ``cnn``: bottom = one
    3x3 convolution (32 channels), top = a stride-2 convolution (64), global average pool, linear.  ``resnet18``:
    bottom = stem and first stage, top = the other three stages, pool and head (FedHSSL's split).  The top never
    depends on the piece size, so it can be averaged across parties.
    """
    shape = tuple(int(s) for s in feature_shape)
    if arch == "auto":
        arch = "mlp" if len(shape) == 1 else "cnn"
    if arch == "mlp":
        d = int(np.prod(shape))
        hidden = [int(h) for h in hidden]
        if not hidden:
            raise ValueError("a split MLP encoder needs at least one hidden width (encoder_hidden)")
        return nn.Sequential(nn.Linear(d, hidden[0]), nn.ReLU()), MLP(hidden[0], hidden[1:], out_dim)
    if arch == "cnn":
        c, _, _ = image_shape(shape)
        bottom = nn.Sequential(_Unflatten(image_shape(shape)), nn.Conv2d(c, 32, 3, padding=1), nn.ReLU())
        top = nn.Sequential(nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.ReLU(), _PoolFlatten(),
                            nn.Linear(64, out_dim))
        return bottom, top
    if arch == "resnet18":
        net = ResNet18(shape, out_dim, width=width)
        bottom = nn.Sequential(_Unflatten(net.shape), net.stem, net.stages[:2])
        top = nn.Sequential(net.stages[2:], _PoolFlatten(), net.head)
        return bottom, top
    raise ValueError(f"unknown encoder architecture {arch!r}; choose auto, mlp, cnn or resnet18")


def average_state_dicts(states: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Element-wise mean of state dicts with the same keys and shapes (integer buffers: rounded mean)."""
    if not states:
        raise ValueError("nothing to average")
    keys = list(states[0])
    for s in states[1:]:
        if list(s) != keys:
            raise ValueError("the parties' top encoders do not have the same parameters")
    out = {}
    for key in keys:
        stacked = torch.stack([s[key].detach().double() for s in states])
        mean = stacked.mean(0)
        out[key] = mean.round().to(states[0][key].dtype) if not states[0][key].is_floating_point() \
            else mean.to(states[0][key].dtype)
    return out


def _neg_cos(p: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    return -F.cosine_similarity(p, z.detach(), dim=-1).mean()


# ---------------------------------------------------------------------- party side
@register_program
class FedHSSLParty(PartyProgram):
    """Party k of FedHSSL: cross-party encoder, local bottom and top encoders, their SimSiam heads.

    Message kinds: ``cross_project`` / ``cross_update`` (one cross-party SimSiam step on aligned rows),
    ``local_ssl`` (guided local SimSiam epochs on its own rows), ``get_top`` / ``set_top`` (partial model
    aggregation), ``embed`` / ``grad_embedding`` (fine-tuning by split learning), ``zero_embedding`` (r_k(0), for
    zero-imputation at inference).
    """

    program_name = "fedhssl/party"
    # P: SimSiam projection width, J: partners, R: representation width (latent_dim, or twice it with pool=concat)
    messages: ClassVar[Messages] = {
        "cross_project": MessageSpec(request=[TensorSpec("rows", "int64", ("B",))],
                                     reply=[TensorSpec("z", "float32", ("B", "P"))], meta=["data"]),
        "cross_update": MessageSpec(request=[TensorSpec("targets", "float32", ("B", "J", "P"))]),
        "local_ssl": MessageSpec(meta=["data", "epochs", "batch_size", "local_weight", "guidance_weight", "augment"]),
        "get_top": MessageSpec(reply=[TensorSpec("top.*", ("float32", "int64")),
                                      TensorSpec("local_head.*", ("float32", "int64"), optional=True)],
                               meta=["aggregate"]),
        "set_top": MessageSpec(request=[TensorSpec("top.*", ("float32", "int64")),
                                        TensorSpec("local_head.*", ("float32", "int64"), optional=True)],
                               meta=["aggregate"]),
        "embed": MessageSpec(request=[TensorSpec("rows", "int64", ("B",))],
                             reply=[TensorSpec("emb", "float32", ("B", "R"))], meta=["data"], optional_meta=["train"]),
        "grad_embedding": MessageSpec(request=[TensorSpec("grad", "float32", ("B", "R"))]),
        "zero_embedding": MessageSpec(reply=[TensorSpec("emb", "float32", ("R",))]),
    }

    def __init__(self, runtime: PartyRuntime, config: dict[str, Any], seed: int) -> None:
        super().__init__(runtime, config, seed)
        self.feature_shape = tuple(int(s) for s in config["feature_shape"])
        latent = int(config["latent_dim"])
        arch, hidden, width = config["encoder"], [int(h) for h in config["encoder_hidden"]], int(config["resnet_width"])
        ss = config["simsiam"]
        with torch_seeded(seed, "fedhssl", runtime.index, "cross"):
            cross = build_encoder(self.feature_shape, latent, arch, hidden=hidden, width=width)
        with torch_seeded(seed, "fedhssl", runtime.index, "local"):
            bottom, top = split_encoder(self.feature_shape, latent, arch, hidden, width)
        with torch_seeded(seed, "fedhssl", runtime.index, "heads"):
            cross_head = SimSiamHead(latent, int(ss["proj_dim"]), int(ss["proj_hidden"]), int(ss["pred_hidden"]))
            local_head = SimSiamHead(latent, int(ss["proj_dim"]), int(ss["proj_hidden"]), int(ss["pred_hidden"]))
        self.net = nn.ModuleDict({"cross": cross, "bottom": bottom, "top": top, "cross_head": cross_head,
                                  "local_head": local_head})
        pt = config["pretrain_optimizer"]
        self.cross_opt = make_optimizer(list(cross.parameters()) + list(cross_head.parameters()), pt["name"],
                                    float(pt["lr"]), float(pt["weight_decay"]), float(pt["momentum"]))
        self.local_opt = make_optimizer(
            list(bottom.parameters()) + list(top.parameters()) + list(local_head.parameters()), pt["name"],
            float(pt["lr"]), float(pt["weight_decay"]), float(pt["momentum"]),
        )
        ft = config["finetune_optimizer"]
        self.ft_opt = make_optimizer(list(cross.parameters()) + list(bottom.parameters()) + list(top.parameters()),
                                 ft["name"], float(ft["lr"]), float(ft["weight_decay"]), float(ft["momentum"]))
        self.pool = config["pool"]
        self.ratio = float(config["pool_ratio"])
        self._gen = torch_generator(seed, "fedhssl", runtime.index, "augment")
        self._pending: torch.Tensor | None = None

    # ------------------------------------------------------------------ helpers
    def _features(self, handle: str, rows: torch.Tensor) -> torch.Tensor:
        view = self.data(handle)
        pos = view.position_of_rows(rows.numpy())
        return torch.as_tensor(np.asarray(view.features[pos]), dtype=torch.float32)

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
        self.net.train()
        x = self._features(req.meta["data"], req.tensors["rows"])
        z, p = self.net["cross_head"](self.net["cross"](x))
        self._pending = p
        return Reply({"z": z})

    def on_cross_update(self, req: Request) -> Reply:
        p = self._pending
        if p is None:
            raise RuntimeError(f"party {self.party}: cross_update without cross_project")
        self._pending = None
        targets = req.tensors["targets"]  # (B, partners, proj_dim), other parties' projections
        loss = torch.stack([_neg_cos(p, targets[:, j]) for j in range(targets.shape[1])]).mean()
        self.cross_opt.zero_grad()
        loss.backward()
        self.cross_opt.step()
        return Reply(meta={"loss": float(loss.detach())})

    # ------------------------------------------------------------------ guided local SimSiam
    def on_local_ssl(self, req: Request) -> Reply:
        view = self.data(req.meta["data"])
        epochs = int(req.meta["epochs"])
        bs = max(2, int(req.meta["batch_size"]))
        wl, wg = float(req.meta["local_weight"]), float(req.meta["guidance_weight"])
        cfg = SimSiamConfig.from_dict(dict(req.meta["augment"]))
        x_all = torch.tensor(np.asarray(view.features), dtype=torch.float32)
        n = x_all.shape[0]
        if n < 2:
            return Reply(meta={"loss": None})
        augment = make_augmenter(self.feature_shape, x_all.numpy(), cfg)
        self.net.train()
        total, count = 0.0, 0
        for _ in range(epochs):
            perm = torch.randperm(n, generator=self._gen)
            total, count = 0.0, 0
            for start in range(0, n, bs):
                idx = perm[start:start + bs]
                if len(idx) < 2:
                    continue
                x1, x2 = augment(x_all[idx], self._gen), augment(x_all[idx], self._gen)
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
                total += float(loss.detach()) * len(idx)
                count += len(idx)
        return Reply(meta={"loss": total / max(count, 1)})

    # ------------------------------------------------------------------ partial model aggregation
    def on_get_top(self, req: Request) -> Reply:
        sd = self.top_modules(req.meta["aggregate"]).state_dict()
        return Reply({k: v.detach().clone() for k, v in sd.items()})

    def on_set_top(self, req: Request) -> Reply:
        self.top_modules(req.meta["aggregate"]).load_state_dict(dict(req.tensors))
        return Reply()

    # ------------------------------------------------------------------ fine-tuning and prediction
    def on_embed(self, req: Request) -> Reply:
        train = bool(req.meta.get("train", False))
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
            r = self.represent(torch.zeros(1, int(np.prod(self.feature_shape))))
        return Reply({"emb": r[0]})

    # ------------------------------------------------------------------ persistence
    def state_dict(self) -> dict[str, Any]:
        """Modules, the three optimisers and the augmentation generator (an exact resume needs all of them)."""
        return {"net": {k: v.detach().clone() for k, v in self.net.state_dict().items()},
                "optimizers": {"cross": self.cross_opt.state_dict(), "local": self.local_opt.state_dict(),
                               "finetune": self.ft_opt.state_dict()},
                "generator": self._gen.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.net.load_state_dict(state["net"])
        if "optimizers" in state:  # models saved before optimiser states were kept load without them
            self.cross_opt.load_state_dict(state["optimizers"]["cross"])
            self.local_opt.load_state_dict(state["optimizers"]["local"])
            self.ft_opt.load_state_dict(state["optimizers"]["finetune"])
            self._gen.set_state(state["generator"])


# ---------------------------------------------------------------------- coordinator side
@register_method
class FedHSSL(VFLMethod):
    """FedHSSL at the active party: drives pretraining (cross-party SSL, local SSL, PMA) and fine-tuning."""

    name = "fedhssl"
    party_program = "fedhssl/party"
    params = FEDHSSL_PARAMS

    def _party_config(self, party: int) -> dict[str, Any]:
        p = self.params_
        return {
            "feature_dim": int(self.index_.feature_dims[party]),
            "feature_shape": list(self.index_.feature_shapes[party]),
            "latent_dim": int(p["latent_dim"]),
            "encoder": p["encoder"],
            "encoder_hidden": [int(h) for h in p["encoder_hidden"]],
            "resnet_width": int(p["resnet_width"]),
            "pool": p["pool"],
            "pool_ratio": float(p["pool_ratio"]),
            "simsiam": {"proj_dim": int(p["proj_dim"]), "proj_hidden": int(p["proj_hidden"]),
                        "pred_hidden": int(p["pred_hidden"])},
            "pretrain_optimizer": {"name": p["pretrain_optimizer"], "lr": float(p["pretrain_lr"]),
                                   "weight_decay": float(p["pretrain_weight_decay"]),
                                   "momentum": float(p["pretrain_momentum"])},
            "finetune_optimizer": {"name": p["optimizer"], "lr": float(p["lr"]),
                                   "weight_decay": float(p["weight_decay"]), "momentum": float(p["momentum"])},
        }

    @property
    def rep_dim(self) -> int:
        d = int(self.params_["latent_dim"])
        return 2 * d if self.params_["pool"] == "concat" else d

    def _build_head(self) -> nn.Module:
        with torch_seeded(self.seed, "fedhssl", "classifier"):
            return MLP(self.index_.n_parties * self.rep_dim, [int(h) for h in self.params_["head_hidden"]],
                       self.index_.task.n_classes)

    # ------------------------------------------------------------------ training
    def _fit(self, view: CoordinatorView, handle: str, loop: TrainingLoop) -> None:
        if not view.task.is_classification:
            raise ValueError(f"{self.name}: only classification tasks are supported (got {view.task.kind})")
        aligned = view.observed.all(axis=1)
        rows = np.flatnonzero(aligned & view.labeled)
        if rows.size == 0:
            raise ValueError(
                f"{self.name}: fine-tuning needs labelled samples that every party observes; the training data has "
                "none (keep an aligned reserve, e.g. ProtocolConfig.n_aligned)"
            )
        self.head_ = self._build_head()
        rng = numpy_rng(self.seed, "fedhssl", "batches")  # one generator for both stages, as the batches run
        if self.params_["pretrain"]:
            loop.run(self._pretrain_stage(view, handle, np.flatnonzero(aligned), rng))
        loop.run(self._finetune_stage(view, handle, rows, rng))
        self.head_.eval()

    def _finetune_stage(self, view: CoordinatorView, handle: str, rows: np.ndarray,
                        rng: np.random.Generator) -> Stage:
        """Split learning of the pooled party representations and the classifier on aligned labelled samples."""
        p = self.params_
        opt = make_optimizer(self.head_.parameters(), p["optimizer"], float(p["lr"]), float(p["weight_decay"]),
                             float(p["momentum"]))
        bs = int(p["batch_size"])
        y_all = torch.as_tensor(np.asarray(view.y), dtype=torch.long)
        K = view.n_parties

        def batches(epoch: int, rng: np.random.Generator) -> Iterator[np.ndarray]:
            perm = rng.permutation(rows)
            for start in range(0, len(perm), bs):
                yield np.sort(perm[start:start + bs])

        def step(batch: np.ndarray, rng: np.random.Generator) -> Metrics:
            self.head_.train()
            replies = self.transport.broadcast(range(K), "embed", {"rows": torch.as_tensor(batch)}, data=handle,
                                               train=True)
            embs = [replies[k].tensors["emb"].requires_grad_() for k in range(K)]
            loss = F.cross_entropy(self.head_(torch.cat(embs, dim=1)), y_all[torch.as_tensor(batch)])
            opt.zero_grad()
            loss.backward()
            opt.step()
            self.transport.new_round()
            self.transport.call_many({k: Request("grad_embedding", {"grad": embs[k].grad}) for k in range(K)})
            return {"loss": (float(loss.detach()) * len(batch), len(batch))}

        return Stage("finetune", int(p["epochs"]), batches, step, rng,
                     state=lambda: {"optimizer": opt.state_dict()},
                     load_state=lambda st: opt.load_state_dict(st["optimizer"]))

    def _pretrain_stage(self, view: CoordinatorView, handle: str, aligned: np.ndarray,
                        rng: np.random.Generator) -> Stage:
        """Per epoch: cross-party SimSiam steps on aligned rows, then guided local SimSiam and aggregation."""
        p = self.params_
        K = view.n_parties
        bs = int(p["pretrain_batch_size"])
        augment = {"corruption": float(p["pretrain_corruption"]), "noise": float(p["pretrain_noise"])}

        def items(epoch: int, rng: np.random.Generator) -> Iterator[np.ndarray | None]:
            if aligned.size >= 2:
                perm = rng.permutation(aligned)
                for start in range(0, len(perm), bs):
                    batch = np.sort(perm[start:start + bs])
                    if len(batch) >= 2:
                        yield batch
            yield None  # the epoch's local step

        def step(batch: np.ndarray | None, rng: np.random.Generator) -> Metrics:
            if batch is not None:
                return {"cross_loss": (self._cross_step(handle, batch, K, view.active_party) * len(batch),
                                       len(batch))}
            replies = self.transport.broadcast(
                range(K), "local_ssl", data=handle, epochs=int(p["local_epochs"]), batch_size=bs,
                local_weight=float(p["local_weight"]), guidance_weight=float(p["guidance_weight"]), augment=augment,
            )
            self.aggregate_tops(new_step=False)
            local = [r.meta["loss"] for r in replies.values() if r.meta.get("loss") is not None]
            return {"local_loss": (float(np.mean(local)) if local else float("nan"), 1.0)}

        return Stage("pretrain", int(p["pretrain_epochs"]), items, step, rng)

    def _cross_step(self, handle: str, batch: np.ndarray, K: int, active: int) -> float:
        """One cross-party SimSiam step: projections in, each party's partners' projections out."""
        replies = self.transport.broadcast(range(K), "cross_project", {"rows": torch.as_tensor(batch)}, data=handle)
        z = {k: replies[k].tensors["z"] for k in range(K)}
        reqs = {}
        for k in range(K):
            if self.params_["cross_pairs"] == "all" or k == active:
                partners = [j for j in range(K) if j != k]
            else:
                partners = [active]
            reqs[k] = Request("cross_update", {"targets": torch.stack([z[j] for j in partners], dim=1)})
        self.transport.new_round()
        out = self.transport.call_many(reqs)
        return float(np.mean([r.meta["loss"] for r in out.values()]))

    def aggregate_tops(self, *, new_step: bool = True) -> dict[str, torch.Tensor]:
        """Partial model aggregation: average the parties' local top encoders and send the average back."""
        K = self.index_.n_parties
        agg = self.params_["aggregate"]
        if new_step:
            self.transport.new_step()
        else:
            self.transport.new_round()
        replies = self.transport.broadcast(range(K), "get_top", aggregate=agg)
        mean = average_state_dicts([dict(replies[k].tensors) for k in range(K)])
        self.transport.new_round()
        self.transport.broadcast(range(K), "set_top", mean, aggregate=agg)
        return mean

    # ------------------------------------------------------------------ prediction (zero-imputation)
    @torch.no_grad()
    def _predict(self, view: CoordinatorView, handle: str, rows: np.ndarray) -> np.ndarray:
        K = view.n_parties
        self.head_.eval()
        self.transport.new_step()
        need = [k for k in range(K) if not view.observed[rows, k].all()]
        zero = {k: r.tensors["emb"] for k, r in self.transport.broadcast(need, "zero_embedding").items()}
        out = np.zeros((len(rows), self.index_.task.n_classes))
        bs = int(self.params_["predict_batch_size"])
        for start in range(0, len(rows), bs):
            chunk = rows[start:start + bs]
            obs = view.observed[chunk]
            self.transport.new_step()
            reqs = {k: Request("embed", {"rows": torch.as_tensor(chunk[obs[:, k]])}, {"data": handle, "train": False})
                    for k in range(K) if obs[:, k].any()}
            replies = self.transport.call_many(reqs)
            cols = []
            for k in range(K):
                col = (zero[k] if k in zero else torch.zeros(self.rep_dim)).expand(len(chunk), -1).clone()
                if k in replies:
                    col[torch.as_tensor(np.flatnonzero(obs[:, k]))] = replies[k].tensors["emb"]
                cols.append(col)
            out[start:start + len(chunk)] = torch.softmax(self.head_(torch.cat(cols, dim=1)), dim=-1).double().numpy()
        return out

    # ------------------------------------------------------------------ persistence
    def _coordinator_modules(self) -> dict[str, nn.Module]:
        return {"head": self.head_}

    def _build_coordinator(self) -> None:
        self.head_ = self._build_head()
