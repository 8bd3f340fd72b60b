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

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from partialvfl.data.dataset import CoordinatorView
from partialvfl.federation.wire.messages import Request
from partialvfl.federation.wire.setup_config import OptimiserSetup
from partialvfl.methods.base import VFLMethod
from partialvfl.methods.fedhssl.networks import average_state_dicts
from partialvfl.methods.fedhssl.party import FedHSSLSetup, SimSiamHeads
from partialvfl.methods.fedhssl.spec import FEDHSSL_PARAMS
from partialvfl.methods.training import Metrics, Stage, TrainingLoop
from partialvfl.nn.blocks import MLP
from partialvfl.nn.optim import make_optimizer
from partialvfl.utils.devices import scalar, to_numpy
from partialvfl.utils.seeding import numpy_rng, torch_seeded

__all__ = ["FedHSSL"]


class FedHSSL(VFLMethod):
    """FedHSSL at the active party: drives pretraining (cross-party SSL, local SSL, PMA) and fine-tuning."""

    name = "fedhssl"
    subset_refusal = ("its classifier is fine-tuned only on rows every party holds and fills a missing party with "
                      "a zero block, which is not a prediction from the parties that are there")
    party_program = "fedhssl/party"
    params = FEDHSSL_PARAMS

    def _party_config(self, party: int) -> dict[str, Any]:
        """The party's set-up config, built as its program declares it (:class:`FedHSSLSetup`: checked here)."""
        s = self.settings_
        return FedHSSLSetup(
            feature_dim=int(self.index_.feature_dims[party]), feature_shape=tuple(self.index_.feature_shapes[party]),
            **s._pick("latent_dim", "encoder", "encoder_hidden", "resnet_width", "pool", "pool_ratio"),
            simsiam=SimSiamHeads(**s.simsiam._asdict()),
            pretrain_optimizer=OptimiserSetup(**s.pretrain_optim._asdict()),
            finetune_optimizer=OptimiserSetup(**s.optim._asdict()),
            # what the party's top encoder is shared for (its policy decides whether it agrees); "none": never
            aggregate=s.aggregate if s.pretrain else "none").to_wire()

    @property
    def rep_dim(self) -> int:
        """The width of a party's representation (twice the latent width when the cross and local parts are
        concatenated).
        """
        d = self.settings_.latent_dim
        return 2 * d if self.settings_.pool == "concat" else d

    def _build_head(self) -> nn.Module:
        with torch_seeded(self.seed, "fedhssl", "classifier"):
            return self._on_device(MLP(self.index_.n_parties * self.rep_dim, self.settings_.head_hidden,
                                       self.index_.task.n_classes))

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
        if self.settings_.pretrain:
            loop.run(self._pretrain_stage(view, handle, np.flatnonzero(aligned), rng))
        loop.run(self._finetune_stage(view, handle, rows, rng))
        self.head_.eval()

    def _finetune_stage(self, view: CoordinatorView, handle: str, rows: np.ndarray,
                        rng: np.random.Generator) -> Stage:
        """Split learning of the pooled party representations and the classifier on aligned labelled samples."""
        opt = make_optimizer(self.head_.parameters(), **self.settings_.optim._asdict())
        bs = self.settings_.batch_size
        y_all = self._tensor(np.asarray(view.y), dtype=torch.long)
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
            loss = F.cross_entropy(self.head_(torch.cat(embs, dim=1)), y_all[self._tensor(batch)])
            opt.zero_grad()
            loss.backward()
            opt.step()
            self.transport.new_round()
            self.transport.call_many({k: Request("grad_embedding", {"grad": embs[k].grad}) for k in range(K)})
            return {"loss": (scalar(loss) * len(batch), len(batch))}

        epochs = self._supervised_epochs("finetune", self.settings_.epochs, math.ceil(len(rows) / bs))
        return Stage("finetune", epochs, batches, step, rng,
                     state=lambda: {"optimizer": opt.state_dict()},
                     load_state=lambda st: opt.load_state_dict(st["optimizer"]), supervised=True)

    def _pretrain_stage(self, view: CoordinatorView, handle: str, aligned: np.ndarray,
                        rng: np.random.Generator) -> Stage:
        """Per epoch: cross-party SimSiam steps on aligned rows, then guided local SimSiam and aggregation."""
        p = self.settings_
        K = view.n_parties
        bs = p.pretrain_batch_size
        augment = p.augment._asdict()
        local_epochs = p.local_epochs

        def items(epoch: int, rng: np.random.Generator) -> Iterator[np.ndarray | int]:
            if aligned.size >= 2:
                perm = rng.permutation(aligned)
                for start in range(0, len(perm), bs):
                    batch = np.sort(perm[start:start + bs])
                    if len(batch) >= 2:
                        yield batch
            yield from range(max(local_epochs, 1))  # the local SimSiam epochs; the last one ends with aggregation

        def step(item: np.ndarray | int, rng: np.random.Generator) -> Metrics:
            if isinstance(item, np.ndarray):
                return {"cross_loss": (self._cross_step(handle, item, K, view.active_party) * len(item),
                                       len(item))}
            out: Metrics = {}
            if local_epochs > 0:
                replies = self.transport.broadcast(
                    range(K), "local_ssl", data=handle, batch_size=bs, local_weight=p.local_weight,
                    guidance_weight=p.guidance_weight, augment=augment)
                local = [r.meta["loss"] for r in replies.values() if r.meta.get("loss") is not None]
                out = {"local_loss": (float(np.mean(local)), 1.0)} if local else {}  # no party had rows: no value
            if item == max(local_epochs, 1) - 1:
                self.aggregate_tops(new_step=False)
            return out

        return Stage("pretrain", p.pretrain_epochs, items, step, rng)

    def _cross_step(self, handle: str, batch: np.ndarray, K: int, active: int) -> float:
        """One cross-party SimSiam step: projections in, each party's partners' projections out."""
        replies = self.transport.broadcast(range(K), "cross_project", {"rows": torch.as_tensor(batch)}, data=handle)
        z = {k: replies[k].tensors["z"] for k in range(K)}
        reqs = {}
        for k in range(K):
            if self.settings_.cross_pairs == "all" or k == active:
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
        agg = self.settings_.aggregate
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
        bs = self.settings_.predict_batch_size
        for start in range(0, len(rows), bs):
            chunk = rows[start:start + bs]
            obs = view.observed[chunk]
            self.transport.new_step()
            reqs = {k: Request("embed", {"rows": torch.as_tensor(chunk[obs[:, k]])}, {"data": handle, "train": False})
                    for k in range(K) if obs[:, k].any()}
            replies = self.transport.call_many(reqs)
            cols = []
            for k in range(K):
                col = (zero[k] if k in zero else torch.zeros(self.rep_dim, device=self.torch_device)
                       ).expand(len(chunk), -1).clone()
                if k in replies:
                    col[self._tensor(np.flatnonzero(obs[:, k]))] = replies[k].tensors["emb"]
                cols.append(col)
            out[start:start + len(chunk)] = to_numpy(torch.softmax(self.head_(torch.cat(cols, dim=1)), dim=-1).double())
        return out

    # ------------------------------------------------------------------ persistence
    def _coordinator_modules(self) -> dict[str, nn.Module]:
        return {"head": self.head_}

    def _build_coordinator(self) -> None:
        self.head_ = self._build_head()
