"""Shared machinery of the split-network methods (LASER-VFL, Vanilla VFL, PlugVFL, Local, Ensemble, Combinatorial).

Party side: :class:`SplitParty` (program ``splitnn/party``) holds one or more named representation models f_k (one
per predictor that uses the party's block: a single ``"f"`` for most methods, one per subset for Combinatorial),
each with its own optimiser.  Message kinds:

* ``embed``: tensors ``rows:<model>`` (shared-order row positions the party holds), meta ``data`` (the handle) and
  ``train``; replies ``emb:<model>``, the representations of those rows.  In training mode the party keeps the
  graph until the gradient arrives;
* ``grad_embedding``: tensors ``grad:<model>``, the loss gradient with respect to the representations it sent;
  the party back-propagates through its own models and takes a local optimiser step;
* ``pretrain``: SimSiam on all the party's own rows of ``data`` (labelled or not, nothing crosses; only the
  per-epoch losses come back as metadata);
* ``set_lr``: the learning rate for the next steps (schedules are driven by the coordinator).

Coordinator side: :class:`SplitNNMethod`, the base of the methods, holds the fusion models / heads (at the active
party, the only label holder) and runs the loops: pick a batch, ask every observing party for representations, fuse,
compute the loss, send each party the gradient of its representations.  Raw features never leave a party; only
representations, their gradients, row positions and scalars cross.  A method says what a step asks for
(``_step_plan``) and its loss (``_step_loss``); the round trips (``rounds``: the next step's representations riding
with this step's gradients, or several steps per round) are :mod:`.rounds`'.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from partialvfl.data.dataset import CoordinatorView, DataValidationError, VerticalDataset
from partialvfl.data.holdout import hold_out_labels
from partialvfl.federation.wire.messages import Request
from partialvfl.federation.wire.setup_config import OptimiserSetup
from partialvfl.methods.base import VFLMethod
from partialvfl.methods.splitnn.party import SplitSetup
from partialvfl.methods.splitnn.rounds import (
    Prefetch,
    StepPlan,
    grouped,
    merge_plans,
    representations,
    ride_next,
    stale_group,
)
from partialvfl.methods.splitnn.simsiam import SimSiamConfig
from partialvfl.methods.training import Metrics, Stage, TrainingLoop
from partialvfl.nn.blocks import MLP
from partialvfl.nn.optim import make_optimizer
from partialvfl.utils.devices import scalar, to_device
from partialvfl.utils.seeding import derive_seed, numpy_rng, torch_seeded
from partialvfl.utils.threads import mlp_flops

__all__ = ["SplitNNMethod", "fit_best_of_pretraining", "fuse"]


class SplitNNMethod(VFLMethod):
    """Coordinator half of the split-network methods: heads at the active party, loops, pretraining, presets.

    Subclasses define ``name``, ``_model_names(k)`` (the representation models party k holds), ``_build_heads()``,
    ``_training_rows(view)``, ``_step_plan(view, rows, rng)`` (what a training step asks for) and
    ``_step_loss(view, plan, embs, rng)`` (its loss), and ``_predict``; a subclass may instead override
    ``_train_step(view, handle, rows, rng)`` (returns the loss), which then runs two round trips per step.
    """

    parallel_inference: ClassVar[bool] = True  # one inference round (IDs in, representations out), nothing kept

    party_program = "splitnn/party"

    # ------------------------------------------------------------------ hooks
    def _model_names(self, party: int) -> list[str]:
        return ["f"]

    def _build_heads(self) -> nn.ModuleDict:
        raise NotImplementedError

    def _training_rows(self, view: CoordinatorView) -> np.ndarray:
        """Labelled rows with at least one observed party (the default training set of a supervised method)."""
        return np.flatnonzero(view.labeled & view.observed.any(axis=1))

    def _batches(self, view: CoordinatorView, rows: np.ndarray, rng: np.random.Generator) -> Iterator[np.ndarray]:
        """One epoch of mini-batches (sorted row positions): a seeded shuffle cut into ``batch_size`` pieces."""
        bs = self.settings_.batch_size
        perm = rng.permutation(rows)
        for start in range(0, len(perm), bs):
            yield np.sort(perm[start:start + bs])

    def _steps_per_epoch(self, view: CoordinatorView, rows: np.ndarray) -> int:
        """How many batches :meth:`_batches` makes of ``rows`` in one epoch."""
        return math.ceil(len(rows) / self.settings_.batch_size)

    def _step_plan(self, view: CoordinatorView, rows: np.ndarray, rng: np.random.Generator) -> StepPlan | None:
        """What the training step of batch ``rows`` asks for (``None``: nothing, the step is skipped).  It may draw
        from ``rng``: drawn ahead with the batch when the step's representations ride with the previous step's
        gradients, in the same order."""
        raise NotImplementedError

    def _step_loss(self, view: CoordinatorView, plan: StepPlan, embs: dict[tuple[int, str], torch.Tensor],
                   rng: np.random.Generator) -> torch.Tensor:
        """The loss of a planned step from the representations it asked for (leaves requiring grad)."""
        raise NotImplementedError

    def _plans_steps(self) -> bool:
        """Whether this method says its steps' plans (:meth:`_step_plan`), which its rounds then carry ahead."""
        return type(self)._step_plan is not SplitNNMethod._step_plan

    def _train_step(self, view: CoordinatorView, handle: str, rows: np.ndarray,
                    rng: np.random.Generator) -> torch.Tensor | None:
        """One training step: the plan (drawn ahead with the batch, or now), the representations (from the
        previous step's round, or an ``embed`` round), the loss, the heads' step and the gradients' round."""
        pre = self._take_prefetch(handle, [rows])
        plan = pre.plans[0] if pre is not None else self._step_plan(view, rows, rng)
        if plan is None:
            return None
        embs = ({key: e.requires_grad_() for key, e in pre.replies.items()} if pre is not None
                else self._embed(handle, plan.wanted, train=True))
        loss = self._step_loss(view, plan, embs, rng)
        self._step_heads(loss, embs)
        return loss.detach()

    # ------------------------------------------------------------------ the rounds of a training stage
    def _take_prefetch(self, handle: str, key: list[np.ndarray]) -> Prefetch | None:
        """The item's plans and representations if they rode with the previous step's round (then forgotten)."""
        pre, self._prefetch = getattr(self, "_prefetch", None), None
        return pre if pre is not None and pre.matches(handle, key) else None

    def _ahead(self) -> tuple[str, list[np.ndarray], list[StepPlan | None]] | None:
        """The next item of the stage and its plans, drawn now (the training loop's look ahead), if this fit's
        schedule lets the next step's requests ride with this step's last round."""
        ctx = getattr(self, "_stage_ctx", None)
        if ctx is None or self.settings_.rounds == "sequential" or not self._plans_steps():
            return None
        view, handle, loop, rng = ctx
        item = loop.peek()
        if item is None:
            return None
        key = list(item) if self.settings_.rounds == "stale" else [item]
        return handle, key, [self._step_plan(view, r, rng) for r in key]

    def _ride(self, requests: dict[int, Request]) -> None:
        """Send this round's ``requests`` with the next item's ``embed`` riding on them; its representations become
        the prefetch of the next step."""
        ahead = self._ahead()
        self._prefetch = None
        if ahead is None:
            self.transport.call_many(requests)
            return
        handle, key, plans = ahead
        wanted = merge_plans([p for p in plans if p is not None])[0]
        replies = self.transport.call_many(ride_next(requests, handle, wanted, train=True))
        self._prefetch = Prefetch(handle, key, plans, representations(replies, wanted))

    def _train_group(self, view: CoordinatorView, handle: str, group: list[np.ndarray],
                     rng: np.random.Generator) -> tuple[float, int] | None:
        """One loop step of the ``stale`` schedule (:func:`.rounds.stale_group`)."""
        pre = self._take_prefetch(handle, group)
        plans = pre.plans if pre is not None else [self._step_plan(view, r, rng) for r in group]
        live = [p for p in plans if p is not None]
        if not live:
            return None
        return stale_group(self, handle, live, pre.replies if pre is not None else None,
                           lambda plan, embs: self._step_loss(view, plan, embs, rng), self._ride)

    # ------------------------------------------------------------------ differential privacy
    def _privacy_charges(self, party: int, purpose: str) -> int:
        """Per row and model, one released representation and one DP-SGD update per epoch; one release per
        prediction (``dp_options['predictions']``)."""
        models = len(self._model_names(party))
        fit = 2 * self.settings_.epochs * models if purpose == "fit" else 0
        return max(1, fit + int(self.dp_options["predictions"]))

    def _privacy_refusal(self) -> str | None:
        if self.settings_.pretrain:
            return "SimSiam pretraining (pretrain=true) is not covered by a party's budget: fit with pretrain=false"
        return None

    # ------------------------------------------------------------------ contract
    @classmethod
    def estimated_step_flops(cls, params: dict[str, Any], feature_shapes: list[tuple[int, ...]]) -> float | None:
        """FLOPs of one supervised step of the parties' MLP encoders (forward and backward, every row at every
        party), or ``None`` for convolutional encoders (for the thread policy, :mod:`partialvfl.utils.threads`)."""
        p = cls.settings_of(params)
        if p.encoder not in ("mlp", "auto") or any(len(s) != 1 for s in feature_shapes if p.encoder == "auto"):
            return None
        return 3.0 * sum(mlp_flops([math.prod(s), *p.encoder_hidden, p.latent_dim], p.batch_size)
                         for s in feature_shapes)

    def _party_config(self, party: int) -> dict[str, Any]:
        """The party's set-up config, built as its program declares it (:class:`SplitSetup`: checked here)."""
        s = self.settings_
        return SplitSetup(feature_dim=int(self.index_.feature_dims[party]),
                          feature_shape=tuple(self.index_.feature_shapes[party]), models=self._model_names(party),
                          **s._pick("latent_dim", "encoder", "encoder_hidden", "resnet_width"),
                          optimizer=OptimiserSetup(**s.optim._asdict())).to_wire()

    @property
    def n_classes(self) -> int:
        """The number of classes of the fitted task (0 for regression)."""
        return self.index_.task.n_classes

    def _fusion_dim(self, n_parts: int | None = None) -> int:
        """Input width of a fusion head over ``n_parts`` representations (all parties by default)."""
        d = self.settings_.latent_dim
        n = self.index_.n_parties if n_parts is None else n_parts
        return d * n if self.settings_.fusion == "concat" else d

    def _make_head(self, in_dim: int) -> nn.Module:
        return MLP(in_dim, self.settings_.head_hidden, self.n_classes)

    def _init_heads(self) -> None:
        with torch_seeded(self.seed, "heads", self.name):
            self.heads_ = self._on_device(self._build_heads())

    def _fit(self, view: CoordinatorView, handle: str, loop: TrainingLoop) -> None:
        if not view.task.is_classification:
            raise ValueError(f"{self.name}: only classification tasks are supported (got {view.task.kind})")
        self._init_heads()
        head_params = list(self.heads_.parameters())
        self.head_optimizer_ = make_optimizer(head_params, **self.settings_.optim._asdict()) if head_params else None
        self.pretrained_ = self.settings_.pretrain
        if self.pretrained_ and self.settings_.pretrain_kind == "false-vfl":
            if loop.resume is None:  # resuming: the restored party states hold the initialised encoders
                self._generative_init(view, handle)
        elif self.pretrained_:
            loop.run(self._pretrain_stage(handle))
        rows = self._training_rows(view)
        if rows.size == 0:
            raise ValueError(f"{self.name}: no training sample qualifies ({self._rows_description()})")
        stage = self._train_stage(view, handle, rows)
        self._stage_ctx = (view, handle, loop, stage.rng)  # what the rounds' look ahead needs
        self._prefetch = None
        try:
            loop.run(stage)
        finally:
            self._stage_ctx, self._prefetch = None, None
        self.heads_.eval()

    def _train_stage(self, view: CoordinatorView, handle: str, rows: np.ndarray) -> Stage:
        """Supervised split learning: batches from one seeded generator, which the steps also draw from; the
        epochs follow the schedule (``min_steps``).  Under the ``stale`` schedule a loop step is a group of
        ``stale_steps`` batches (:mod:`.rounds`)."""
        epochs = self._supervised_epochs("train", self.settings_.epochs, self._steps_per_epoch(view, rows))
        stale = self.settings_.rounds == "stale" and self._plans_steps()
        if stale and getattr(self.federation_, "privacy_setups", None):
            raise ValueError(f"{self.name}: rounds = 'stale' is not covered by a party's differential-privacy budget: "
                             "fit with rounds = 'piggyback'")

        def start(epoch: int) -> None:
            if self.settings_.lr_schedule == "cosine":
                self._set_lr(self._cosine_lr(epoch, epochs))

        def step(item: Any, rng: np.random.Generator) -> Metrics | None:
            self.heads_.train()
            if stale:
                done = self._train_group(view, handle, item, rng)
                return None if done is None else {"loss": done}
            loss = self._train_step(view, handle, item, rng)
            return None if loss is None else {"loss": (scalar(loss) * len(item), len(item))}

        def items(epoch: int, rng: np.random.Generator) -> Iterator[Any]:
            batches = self._batches(view, rows, rng)
            return grouped(batches, self.settings_.stale_steps) if stale else batches

        opt = self.head_optimizer_
        return Stage("train", epochs, items, step,
                     numpy_rng(self.seed, "batches", self.name), on_epoch_start=start,
                     state=lambda: {"optimizer": opt.state_dict() if opt is not None else {}},
                     load_state=lambda st: opt.load_state_dict(st["optimizer"]) if opt is not None else None,
                     supervised=True)

    def _rows_description(self) -> str:
        return "labelled samples with at least one observed party"

    def _cosine_lr(self, epoch: int, epochs: int) -> float:
        lr = self.settings_.lr
        lo = lr * self.settings_.eta_min_ratio
        return lo + 0.5 * (lr - lo) * (1 + math.cos(math.pi * epoch / max(epochs, 1)))

    def _set_lr(self, lr: float) -> None:
        if self.head_optimizer_ is not None:
            for g in self.head_optimizer_.param_groups:
                g["lr"] = lr
        self.transport.new_step()
        self.transport.broadcast(range(self.index_.n_parties), "set_lr", lr=lr)

    def _pretrain_stage(self, handle: str) -> Stage:
        """SimSiam at every party on all its own rows (labelled or not), one epoch per step; only losses return."""
        cfg = SimSiamConfig(**self.settings_.simsiam._asdict())
        parties = [k for k in range(self.index_.n_parties) if self._model_names(k)]
        epochs = cfg.epochs

        def step(epoch: int, rng: np.random.Generator) -> Metrics:
            replies = self.transport.broadcast(parties, "pretrain", data=handle, simsiam=cfg.to_dict(), epoch=epoch,
                                               last=epoch == epochs - 1)
            out: dict[str, tuple[float, float]] = {}
            for k, rep in sorted(replies.items()):
                for name, loss in rep.meta["losses"].items():
                    if loss is not None:
                        key = f"loss_party{k}" if name == "f" else f"loss_party{k}_{name}"
                        out[key] = (float(loss), 1.0)
            if out:
                out["loss"] = (float(np.mean([v for v, _ in out.values()])), 1.0)
            return out

        return Stage("pretrain", epochs, lambda epoch, rng: [epoch], step,
                     numpy_rng(self.seed, "pretrain", self.name))

    def _generative_init(self, view: CoordinatorView, handle: str) -> None:
        """FALSE-VFL-I's stage 1 on every row (federated, on these parties), then each party initialises its own
        encoder from its own stage-1 encoder (``init_encoder``: the party reads the state it saved on its own disk;
        nothing crosses but the directory's name).  Not checkpointed: a crash in it restarts it."""
        import tempfile

        from partialvfl.methods.false_vfl.coordinator import FalseVFL1

        s = self.settings_
        params = {**dict(s.generative or {}), "d_h": s.latent_dim, "encoder": s.encoder,
                  "encoder_hidden": list(s.encoder_hidden), "resnet_width": s.resnet_width,
                  "pretrain_epochs": s.pretrain_epochs, "epochs": 0, "min_steps": 0, "early_stopping": "off",
                  "standardize": s.standardize}
        gen = FalseVFL1("fast", seed=self.seed, progress=self.progress, device=self.torch_device,
                        precision=self.precision, compile=self.compile, **params)
        fed = self.federation_
        gen.fit_federated(fed, view, handle, data_info=self.data_info_)
        fed.transport.device = self.torch_device  # the stage-1 fit pointed replies at its own device
        with tempfile.TemporaryDirectory(prefix="partialvfl-generative-") as d:
            fed.save(d)  # every party writes its own stage-1 state
            fed.setup(self.party_program, [self._party_config(k) for k in range(self.index_.n_parties)], self.seed)
            self.transport.new_step()
            self.transport.broadcast(range(self.index_.n_parties), "init_encoder", dir=fed.party_dir(d),
                                     program=gen.party_program)
            fed.forget(d)
        bounds = [h["bound"] for h in gen.history_ if h["stage"] == "pretrain"]
        self.generative_ = {"epochs": len(bounds), "bound": bounds[-1] if bounds else None,
                            "params": dict(gen.params_)}
        self.history_.extend({**h, "stage": "generative-" + h["stage"]} for h in gen.history_)

    # ------------------------------------------------------------------ wire helpers
    def _embed(self, handle: str, wanted: dict[int, dict[str, np.ndarray]], train: bool, leaves: bool = True
               ) -> dict[tuple[int, str], torch.Tensor]:
        """Ask parties for representations: ``wanted[k][model]`` are the rows party k holds (sorted positions).

        In training mode (unless ``leaves`` is false) the returned tensors are leaves requiring grad, to be passed to
        :meth:`_send_grads`.
        """
        reqs = {}
        for k, models in wanted.items():
            tensors = {f"rows:{m}": torch.as_tensor(np.asarray(r, dtype=np.int64)) for m, r in models.items()}
            if tensors:
                reqs[k] = Request("embed", tensors, {"data": handle, "train": bool(train)})
        replies = self.transport.call_many(reqs)
        out: dict[tuple[int, str], torch.Tensor] = {}
        for k, rep in replies.items():
            for m in wanted[k]:
                e = rep.tensors[f"emb:{m}"]
                out[(k, m)] = e.requires_grad_() if train and leaves else e
        return out

    def _embed_observed(self, handle: str, rows: np.ndarray, observed: np.ndarray, train: bool
                        ) -> dict[tuple[int, str], torch.Tensor]:
        """Representations (model ``f``) of ``rows`` from every party that observes some of them."""
        return self._embed(handle, {k: {"f": rows[observed[:, k]]} for k in range(observed.shape[1])
                                    if observed[:, k].any()}, train=train)

    def _send_grads(self, embs: dict[tuple[int, str], torch.Tensor]) -> None:
        self.transport.new_round()
        by_party: dict[int, dict[str, torch.Tensor]] = {}
        for (k, m), e in embs.items():
            g = e.grad if e.grad is not None else torch.zeros_like(e)
            by_party.setdefault(k, {})[f"grad:{m}"] = g
        self._ride({k: Request("grad_embedding", t) for k, t in by_party.items()})

    def _step_heads(self, loss: torch.Tensor, embs: dict[tuple[int, str], torch.Tensor]) -> None:
        """Back-propagate ``loss`` at the active party, update the heads, send the parties their gradients."""
        if self.head_optimizer_ is not None:
            self.head_optimizer_.zero_grad()
        loss.backward()
        if self.head_optimizer_ is not None:
            self.head_optimizer_.step()
        self._send_grads(embs)

    def _stack(self, batch_rows: np.ndarray, observed: np.ndarray, embs: dict[tuple[int, str], torch.Tensor],
               model: str = "f") -> torch.Tensor:
        """(B, K, d) representations of a batch, zeros where a party does not hold (or did not send) the row.

        Party k's representations are of ``batch_rows[observed[:, k]]``; all parties land with one scatter.
        """
        n_parties, b = self.index_.n_parties, len(batch_rows)
        d = self.settings_.latent_dim
        sent = [(k, e) for k in range(n_parties) if (e := embs.get((k, model))) is not None]
        out = torch.zeros(b * n_parties, d, device=self.torch_device)
        if sent:
            flat = self._tensor(np.concatenate([np.flatnonzero(observed[:, k]) * n_parties + k for k, _ in sent]))
            out = out.index_copy(0, flat, torch.cat([e for _, e in sent]))
        return out.view(b, n_parties, d)

    def _cut_embeddings(self, view: CoordinatorView, handle: str, masks: np.ndarray, wanted: np.ndarray
                        ) -> Iterator[tuple[int, np.ndarray, np.ndarray, np.ndarray, torch.Tensor]]:
        """Coalition predictions that share each party's representation (it does not depend on the coalition):
        per chunk of the rows some coalition wants, one ``embed`` round, then for each coalition ``m`` with rows in
        the chunk ``(m, chunk, want, cut, emb)``: the chunk's rows, which of them want it, their observed pattern
        cut to the coalition and the ``(len(chunk), K, d)`` representations with zeros outside the cut (what
        :meth:`_stack` gives a prediction from exactly that pattern; a head runs on the whole chunk, as in a
        prediction).  Used by :meth:`_coalition_predictions` of the methods whose head reads ``_stack``."""
        for chunk in self._chunks(np.flatnonzero(wanted.any(axis=0))):
            obs = view.observed[chunk]
            self.transport.new_step()
            emb = self._stack(chunk, obs, self._embed_observed(handle, chunk, obs, train=False))
            for m, mask in enumerate(masks):
                cut = obs & mask
                want = wanted[m, chunk] & cut.any(axis=1)
                if want.any():
                    keep = self._tensor(cut)[..., None]
                    yield m, chunk, want, cut, torch.where(keep, emb, torch.zeros((), dtype=emb.dtype,
                                                                                  device=emb.device))

    def _chunks(self, rows: np.ndarray) -> Iterator[np.ndarray]:
        bs = self.settings_.predict_batch_size
        for start in range(0, len(rows), bs):
            yield rows[start:start + bs]

    def _row_draws(self, view: CoordinatorView, rows: np.ndarray, purpose: str,
                   draw: Callable[[np.random.Generator, int], np.ndarray]) -> np.ndarray:
        """A prediction's random choices for ``rows`` (a tie-break, a guess): ``draw(generator, n)`` gives ``n``
        rows' worth.  Each row's from a generator of its own seed (the model's seed and its ID, :meth:`_row_seeds`);
        while a fit validates, all rows' from one generator of the method's seed, as before per-row seeds."""
        seeds = self._row_seeds(view, rows, self.name, purpose)
        if seeds is None:
            return draw(np.random.default_rng(derive_seed(self.seed, "predict", self.name)), len(rows))
        parts = [draw(np.random.default_rng(int(s)), 1) for s in seeds]
        return np.concatenate(parts) if parts else draw(np.random.default_rng(0), 0)

    # ------------------------------------------------------------------ persistence of the active party's part
    def _coordinator_modules(self) -> dict[str, nn.Module]:
        return {"heads": self.heads_}

    def _build_coordinator(self) -> None:
        self._init_heads()

    def _coordinator_extra_state(self) -> dict[str, Any]:
        return {"pretrained": bool(getattr(self, "pretrained_", False))}

    def _load_coordinator_extra_state(self, state: dict[str, Any]) -> None:
        self.pretrained_ = bool(state.get("pretrained", False))


def fuse(emb: torch.Tensor, present: np.ndarray, parties: list[int] | None = None, how: str = "concat"
         ) -> torch.Tensor:
    """Fusion input from ``(B, K, d)`` representations of ``parties`` (default all).

    ``concat``: the representations side by side, zeros for absent parties (``(B, len(parties) * d)``);
    ``mean``: the mean over the present ones (``(B, d)``; LASER-VFL's code uses it for all its decoupled models).
    """
    sel = list(range(emb.shape[1])) if parties is None else list(parties)
    part = emb[:, sel]
    if how == "concat":
        return part.reshape(part.shape[0], -1)
    if how == "mean":
        m = to_device(torch.as_tensor(np.asarray(present)[:, sel], dtype=emb.dtype), emb.device)
        return (m[..., None] * part).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)[:, None]
    raise ValueError(f"fusion must be 'concat' or 'mean', got {how!r}")


def fit_best_of_pretraining(method: type[VFLMethod] | str, train: VerticalDataset,
                            select_on: float | VerticalDataset = 0.2, *, preset: str = "fast", seed: int = 0,
                            refit: bool = True, **params: Any) -> VFLMethod:
    """Fit a method with and without SimSiam pretraining and keep the better, chosen on held-out labels.

    The FALSE-VFL paper reports, per cell, the better of "pretrained on all data" and "labelled data only" (marked
    ``*``).  Choosing on the test set would be optimistic, so the choice here is made on ``select_on``: a fraction of
    the labelled training samples (held out, seeded by ``seed``; they stay in training as unlabelled samples) or a
    separate labelled dataset.  With ``refit`` the chosen variant is then refitted on all of ``train``.

    The returned model carries ``selection_`` (``{"pretrain", "labelled_only", "marker", "val_accuracy"}``, also
    stored in ``data_info_['pretraining_selection']`` so that ``save`` keeps it).  Ties go to pretraining (the
    paper's default protocol).
    """
    from partialvfl.methods.base import get_method
    from partialvfl.methods.evaluation import evaluate

    cls = get_method(method) if isinstance(method, str) else method
    if "pretrain" not in cls.param_space().names:
        raise ValueError(f"{cls.name} has no 'pretrain' option")
    params.pop("pretrain", None)
    if isinstance(select_on, VerticalDataset):
        fit_data, val = train, select_on
        if not val.labeled.any():
            raise ValueError("select_on has no labelled sample to choose on")
    else:
        try:
            fit_data, val = hold_out_labels(train, float(select_on), seed, stream="select-pretraining")
        except DataValidationError as e:
            raise ValueError(f"select_on must be a fraction in (0, 1) or a labelled VerticalDataset: {e}") from None
    scores: dict[str, float] = {}
    models: dict[bool, VFLMethod] = {}
    for pretrain in (False, True):
        m = cls(preset, seed=seed, pretrain=pretrain, **params).fit(fit_data)
        scores["pretrained" if pretrain else "labelled_only"] = float(evaluate(m, val)["accuracy"])
        models[pretrain] = m
    chosen = scores["pretrained"] >= scores["labelled_only"]
    model = cls(preset, seed=seed, pretrain=chosen, **params).fit(train) if refit else models[chosen]
    model.selection_ = {"pretrain": chosen, "labelled_only": not chosen, "marker": "" if chosen else "*",
                        "val_accuracy": scores, "n_val": int(val.n_labeled)}
    model.data_info_["pretraining_selection"] = model.selection_
    return model
