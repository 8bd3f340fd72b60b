"""FALSE-VFL's prediction computed row by row: each row's answer depends on its data and ID, never on its batch.

Training draws a batch's noise from the batch's seed (:func:`~.formulas.latent_noise_generator`, shared by the
coordinator and the parties).  A prediction draws each row's noise from the row's own seed instead: the model's seed
and the row's normalised ID (:func:`partialvfl.data.ids.id_seeds`), which the coordinator sends with the row in every
``decode`` (``seed``, ``seed_mis``).  The same row then gets the same samples whatever else is in the request, in
whatever order, in one process or across a federation:

* the latent noise: a torch generator seeded with the row's seed draws ``eps_h`` ``(S, d_h)`` then ``eps_z``
  ``(S, d_z)``; the coordinator draws both, a ``lean`` party only ``eps_h`` (the same numbers: the first draw);
* the ``bound`` wire: SHA-256 of the row's seed and the exact bytes of the mean and scale sent for it (as
  :func:`~.formulas.bound_noise` does with the batch's seed and the row's position), so that a coordinator still
  cannot aim a row's latents;
* FALSE-VFL-II: a party's draws of ``x^k`` for a row it lacks, from the row's seed mixed with the party's index.

Every draw is made on the CPU (the same numbers on every device), one generator per row.

The same floats, too, not only the same draws (the ``bound`` wire hashes the exact bytes of a row's posterior, so
an ulp of difference would be another draw): at prediction every network, the parties' and the coordinator's, runs
on blocks of a fixed number of rows (:class:`partialvfl.nn.blocks.RowBlocks`: every row meets the same kernel), and
the coordinator reduces over the parties and over the importance samples along a row-major last axis
(:func:`samples_last`): a reduction over a leading axis vectorises across the rows, and a row's sum then depends on
how many rows there are and where it sits.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["as_seeds", "row_bound_noise", "row_latent_noise", "row_missing_noise", "samples_last"]


def as_seeds(seeds: torch.Tensor | np.ndarray | Sequence[int]) -> list[int]:
    """Row seeds as Python ints (from the int64 tensor that crosses in a ``decode``, or an array)."""
    if isinstance(seeds, torch.Tensor):
        seeds = seeds.numpy()
    return [int(s) for s in np.asarray(seeds, dtype=np.int64)]


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(seed))


def row_latent_noise(seeds: torch.Tensor | np.ndarray, samples: int, d_h: int, d_z: int = 0
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``eps_h`` ``(S, B, d_h)`` and ``eps_z`` ``(S, B, d_z)`` (empty with ``d_z = 0``: a party's draw), row ``i``
    from a generator seeded with ``seeds[i]``: ``eps_h`` first, then ``eps_z``."""
    rows = as_seeds(seeds)
    eps_h = torch.empty(samples, len(rows), d_h)
    eps_z = torch.empty(samples, len(rows), d_z)
    for i, seed in enumerate(rows):
        gen = _generator(seed)
        eps_h[:, i] = torch.randn((samples, d_h), generator=gen)
        if d_z:
            eps_z[:, i] = torch.randn((samples, d_z), generator=gen)
    return eps_h, eps_z


def row_bound_noise(seeds: torch.Tensor | np.ndarray, mean: torch.Tensor, scale: torch.Tensor,
                    samples: int) -> torch.Tensor:
    """The ``bound`` wire's noise ``(S, B, d_h)`` at prediction: row ``i``'s ``S`` draws from a generator seeded by
    SHA-256 of ``seeds[i]`` and the exact bytes of its mean and scale as they cross (their wire dtype)."""
    rows = as_seeds(seeds)
    raw_mean = mean.detach().contiguous().view(torch.uint8).numpy()
    raw_scale = scale.detach().contiguous().view(torch.uint8).numpy()
    out = torch.empty(samples, len(rows), int(mean.shape[-1]))
    for i, seed in enumerate(rows):
        digest = hashlib.sha256(b"row" + seed.to_bytes(8, "little") + raw_mean[i].tobytes()
                                + raw_scale[i].tobytes()).digest()
        out[:, i] = torch.randn((samples, int(mean.shape[-1])), generator=_generator(
            int.from_bytes(digest[:8], "little") >> 1))
    return out


def row_missing_noise(seeds: torch.Tensor | np.ndarray, party: int, shape: tuple[int, ...]) -> torch.Tensor:
    """FALSE-VFL-II: party ``party``'s noise for the decoder draws of the rows it lacks, ``shape`` ``(S, M, ...)``;
    row ``i``'s ``(S, ...)`` from ``seeds[i]`` mixed with the party's index."""
    rows = as_seeds(seeds)
    out = torch.empty(shape)
    for i, seed in enumerate(rows):
        digest = hashlib.sha256(b"party" + int(party).to_bytes(4, "little") + seed.to_bytes(8, "little")).digest()
        out[:, i] = torch.randn((shape[0], *shape[2:]), generator=_generator(int.from_bytes(digest[:8], "little") >> 1))
    return out


def samples_last(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its first axis (the samples, or the parties) moved last, as a row-major copy: reduced along that
    last axis, each row is reduced alone, the same floats whatever the other rows (see the module docstring)."""
    return t.movedim(0, -1).contiguous()
