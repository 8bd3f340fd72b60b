"""SimSiam self-supervised pretraining of one party's encoder on its own rows (Chen & He, 2021).

The FALSE-VFL paper (Appendix D.1) pretrains every local feature extractor of Vanilla VFL, LASER-VFL and PlugVFL
with SimSiam on all of the party's samples, labelled or not, then fine-tunes; its Table 3 gives a 3-layer MLP
projector and a 2-layer MLP predictor.  SimSiam's loss for two augmented views x1, x2 of a batch, with
z = projector(encoder(x)) and p = predictor(z), is

    L = -1/2 * [ cos(p1, stopgrad(z2)) + cos(p2, stopgrad(z1)) ]

(negative cosine similarity, symmetrised; the stop-gradient is what keeps it from collapsing).

Everything here is party-local: the functions see one party's block and nothing crosses a boundary.  Augmentations:

* image pieces (``feature_shape`` (H, W) or (C, H, W)): a random crop after zero padding (a random shift), a random
  horizontal flip, additive Gaussian noise;
* tabular blocks: random feature corruption from the empirical marginals (each entry replaced, with probability
  ``corruption``, by the same column's value in a random row of the party's own data; Bahri et al., 2022, SCARF),
  plus a little Gaussian noise.

This module is private (not a registered method); the split-network parties pretrain with :class:`SimSiamTrainer`
(one epoch per coordinator step) and FedHSSL reuses :class:`SimSiamHead`, :func:`simsiam_loss` and
:func:`make_augmenter`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from partialvfl.nn.blocks import MLP, image_shape
from partialvfl.nn.optim import make_optimizer
from partialvfl.utils.devices import scalar, to_numpy

__all__ = [
    "Augmenter",
    "SimSiamConfig",
    "SimSiamHead",
    "SimSiamTrainer",
    "image_augmenter",
    "make_augmenter",
    "simsiam_loss",
    "tabular_augmenter",
]

Augmenter = Callable[[torch.Tensor, torch.Generator], torch.Tensor]


@dataclass(frozen=True)
class SimSiamConfig:
    """Hyperparameters of one party's SimSiam pretraining (defaults: the FALSE-VFL paper's pretraining column of
    Tables 6-8 for tabular data, SGD lr 0.02, weight decay 3e-5, batch 512; momentum 0.9 as in SimSiam)."""

    epochs: int = 150
    batch_size: int = 512
    lr: float = 0.02
    weight_decay: float = 3e-5
    momentum: float = 0.9
    optimizer: str = "sgd"
    proj_dim: int = 128
    proj_hidden: int = 128
    pred_hidden: int = 32
    corruption: float = 0.3
    noise: float = 0.05
    crop_pad: int = 2
    flip: bool = True

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SimSiamConfig:
        """The configuration stored by :meth:`to_dict`."""
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown SimSiam option(s) {sorted(unknown)}; known: {sorted(known)}")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        """The configuration as plain values."""
        return asdict(self)


class SimSiamHead(nn.Module):
    """Projector (3-layer MLP with batch norm) and predictor (2-layer bottleneck MLP) put on top of an encoder."""

    def __init__(self, in_dim: int, proj_dim: int = 128, proj_hidden: int = 128, pred_hidden: int = 32) -> None:
        super().__init__()
        self.projector = MLP(in_dim, [proj_hidden, proj_hidden], proj_dim, batch_norm=True)
        self.predictor = MLP(proj_dim, [pred_hidden], proj_dim, batch_norm=True)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The projection ``z`` of ``h`` and the prediction made from it."""
        z = self.projector(h)
        return z, self.predictor(z)


def simsiam_loss(p1: torch.Tensor, z1: torch.Tensor, p2: torch.Tensor, z2: torch.Tensor) -> torch.Tensor:
    """Symmetrised negative cosine similarity with stop-gradient on the targets (in [-1, 1]; -1 is perfect)."""
    return -0.5 * (F.cosine_similarity(p1, z2.detach(), dim=-1).mean()
                   + F.cosine_similarity(p2, z1.detach(), dim=-1).mean())


def tabular_augmenter(data: np.ndarray | torch.Tensor, corruption: float = 0.3, noise: float = 0.05) -> Augmenter:
    """Random feature corruption from the empirical marginals of ``data`` (the party's own rows), plus noise."""
    table = torch.tensor(np.array(data, dtype=np.float32))
    if table.ndim != 2 or table.shape[0] == 0:
        raise ValueError(f"tabular augmentation needs a non-empty (rows, columns) table, got {tuple(table.shape)}")
    if not 0.0 <= corruption <= 1.0:
        raise ValueError(f"corruption must be a probability, got {corruption}")
    n, d = table.shape
    cols = torch.arange(d)

    def augment(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        x = x.reshape(x.shape[0], -1)
        replace = torch.rand(x.shape, generator=g) < corruption  # drawn on the CPU: the same on every device
        donors = torch.randint(0, n, x.shape, generator=g)
        out = torch.where(replace.to(x.device), table[donors, cols.expand_as(donors)].to(x.device), x)
        if noise > 0:
            out = out + noise * torch.randn(out.shape, generator=g).to(x.device)
        return out

    return augment


def image_augmenter(feature_shape: Sequence[int], crop_pad: int = 2, flip: bool = True,
                    noise: float = 0.05) -> Augmenter:
    """Random crop (shift after zero padding by ``crop_pad``), random horizontal flip, Gaussian noise."""
    c, h, w = image_shape(feature_shape)

    def augment(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        b, dev = x.shape[0], x.device  # random draws on the CPU (the same on every device), applied on x's device
        img = x.reshape(b, c, h, w)
        if crop_pad > 0:
            padded = F.pad(img, (crop_pad, crop_pad, crop_pad, crop_pad))
            dy = torch.randint(0, 2 * crop_pad + 1, (b,), generator=g)
            dx = torch.randint(0, 2 * crop_pad + 1, (b,), generator=g)
            rows = (dy[:, None] + torch.arange(h)[None, :]).to(dev)  # (b, h)
            cols = (dx[:, None] + torch.arange(w)[None, :]).to(dev)  # (b, w)
            img = padded[torch.arange(b, device=dev)[:, None, None, None],
                         torch.arange(c, device=dev)[None, :, None, None], rows[:, None, :, None],
                         cols[:, None, None, :]]
        if flip:
            do = (torch.rand(b, generator=g) < 0.5).to(dev)
            img = torch.where(do[:, None, None, None], img.flip(-1), img)
        if noise > 0:
            img = img + noise * torch.randn(img.shape, generator=g).to(dev)
        return img.reshape(b, -1)

    return augment


def make_augmenter(feature_shape: Sequence[int], data: np.ndarray, config: SimSiamConfig) -> Augmenter:
    """The augmentation for a party block: image pieces (2-D/3-D ``feature_shape``) or tabular (1-D)."""
    if len(tuple(feature_shape)) >= 2:
        return image_augmenter(feature_shape, config.crop_pad, config.flip, config.noise)
    return tabular_augmenter(data, config.corruption, config.noise)


class SimSiamTrainer:
    """SimSiam pretraining of one encoder on one party's own rows, one epoch per :meth:`run_epoch` call.

    A fresh projector/predictor is built (seeded from ``generator``) and discarded when pretraining ends; only the
    encoder's weights are kept.  Batches of one sample are skipped (batch norm needs two).  Between epochs the
    trainer keeps its head, optimiser and generator, and :meth:`state_dict` returns all three, so a party that is
    checkpointed between epochs resumes exactly (the coordinator drives the epochs through the training loop).
    """

    def __init__(self, encoder: nn.Module, data: np.ndarray | torch.Tensor, feature_shape: Sequence[int],
                 config: SimSiamConfig, generator: torch.Generator, *, out_dim: int | None = None,
                 device: torch.device | str = "cpu") -> None:
        self.encoder = encoder
        self.device = torch.device(device)
        # the party's rows: a tensor already on the device (a party's table), or an array moved there once
        self.x_all = (data if isinstance(data, torch.Tensor)
                      else torch.tensor(np.array(data, dtype=np.float32))).to(self.device)
        self.config = config
        self.generator = generator
        dim = int(out_dim if out_dim is not None else encoder.out_dim)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(torch.randint(0, 2**62, (1,), generator=generator)))
            self.head = SimSiamHead(dim, config.proj_dim, config.proj_hidden, config.pred_hidden).to(self.device)
        params = list(encoder.parameters()) + list(self.head.parameters())
        self.optimizer = make_optimizer(params, config.optimizer, config.lr, config.weight_decay, config.momentum)
        self.augment = make_augmenter(feature_shape, to_numpy(self.x_all), config)

    def run_epoch(self) -> float | None:
        """One epoch over the party's rows; the mean loss (``None`` with fewer than two rows)."""
        n = self.x_all.shape[0]
        if n < 2:
            return None
        was_training = self.encoder.training
        self.encoder.train()
        self.head.train()
        bs = max(2, int(self.config.batch_size))
        perm = torch.randperm(n, generator=self.generator)
        total, count = 0.0, 0
        for start in range(0, n, bs):
            idx = perm[start:start + bs]
            if len(idx) < 2:
                continue
            x = self.x_all[idx.to(self.device)]
            z1, p1 = self.head(self.encoder(self.augment(x, self.generator)))
            z2, p2 = self.head(self.encoder(self.augment(x, self.generator)))
            loss = simsiam_loss(p1, z1, p2, z2)
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()
            total += scalar(loss) * len(idx)
            count += len(idx)
        self.encoder.train(was_training)
        return total / max(count, 1)

    def state_dict(self) -> dict[str, Any]:
        """The state to save: what :meth:`load_state_dict` restores."""
        return {"head": self.head.state_dict(), "optimizer": self.optimizer.state_dict(),
                "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the state saved by :meth:`state_dict`."""
        self.head.load_state_dict(state["head"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(state["generator"])
