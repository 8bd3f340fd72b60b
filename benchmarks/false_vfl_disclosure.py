"""What a coordinator learns about a party's rows from a trained FALSE-VFL party's messages (issue 23).

FALSE-VFL-I, fast preset, digits (4 parties of 16 features, 500 labels, 100 aligned, MCAR 0.2, seed 0), in process.
After the fit, the coordinator probes party 1 (its features standardised by the party, as in a fit) with:

* ``encode``: the posterior parameters ``mu``, ``logvar`` of every row (what every honest step sends);
* ``decode`` at free latents (the lean wire under the research policy): the same 64 latents for every row;
* ``decode`` at latents around one centre at a given scale, the noise learnt afterwards (what the bound wire leaves a
  coordinator: 20 calls of 16 latents per row; the per-row slopes of the log-likelihood in the latent offsets).

For each: the reconstruction error per feature (RMSE / std, median over features) of the best affine map over every
row (what the released values determine up to an affine map: a bound on any linear decoding) and of a ridge
regression on 17, 25 and 100 known rows scored on the others; and the fused posterior's scale (which a floor clamps).

    python benchmarks/false_vfl_disclosure.py          # about a minute on one core
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import torch

from partialvfl.bench.extraction import relative_rmse, ridge
from partialvfl.bench.extraction_false_vfl import EXACT_ALPHAS
from partialvfl.data.protocol import ProtocolConfig, make_protocol
from partialvfl.methods import get_method
from partialvfl.methods.false_vfl.formulas import latent_noise_generator


class Probe:
    """Requests to party ``k`` of a fitted in-process FALSE-VFL model, on every row it holds."""

    def __init__(self, model: Any, data: Any, k: int) -> None:
        self.fed, self.k = model.federation_, k
        self.handle = self.fed.attach(data, "probe")
        self.rows = np.flatnonzero(data.observed[:, k])
        self.d_h = model.settings_.d_h

    def encode(self, k: int | None = None, rows: np.ndarray | None = None) -> Any:
        self.fed.transport.new_step()
        return self.fed.transport.call(self.k if k is None else k, "encode",
                                       {"rows": torch.as_tensor(self.rows if rows is None else rows)},
                                       data=self.handle)

    def decode(self, mean: torch.Tensor, scale: torch.Tensor, pos: torch.Tensor, seed: int, samples: int,
               batch: int) -> np.ndarray:
        self.encode()
        self.fed.transport.new_round()
        reply = self.fed.transport.call(self.k, "decode", {"mean": mean, "scale": scale, "pos": pos},
                                        noise_seed=seed, batch=batch, samples=samples, data=self.handle)
        return reply.tensors["loglik"].double().numpy()


def errors(features: np.ndarray, x: np.ndarray) -> dict[str, float]:
    design = np.c_[features, np.ones(len(x))]
    out = {"affine": float(np.median(relative_rmse(x, design @ np.linalg.lstsq(design, x, rcond=None)[0])))}
    for n_known in (17, 25, 100):
        known = np.sort(np.random.default_rng(0).choice(len(x), n_known, replace=False))
        unknown = np.setdiff1d(np.arange(len(x)), known)
        out[f"{n_known} known"] = float(np.median(relative_rmse(x, ridge(features, x, known, EXACT_ALPHAS),
                                                                unknown)))
    return out


def around(probe: Probe, centre: float, scale: float, calls: int = 20, samples: int = 16) -> np.ndarray:
    """Per-row slopes of the log-likelihood in the latent offsets (latents around ``centre`` at ``scale``)."""
    n, d_h = len(probe.rows), probe.d_h
    ys, offsets = [], []
    for c in range(calls):
        eps = torch.randn((samples, n, d_h), generator=latent_noise_generator(100 + c))
        ys.append(probe.decode(torch.full((n, d_h), centre), torch.full((n, d_h), scale), torch.arange(n), 100 + c,
                               samples, n))
        offsets.append(scale * eps.double().numpy())
    y, dl = np.concatenate(ys), np.concatenate(offsets)
    y, dl = y - y.mean(0), dl - dl.mean(0)
    return np.stack([np.linalg.lstsq(dl[:, i], y[:, i], rcond=None)[0] for i in range(n)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--party", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    train, test = make_protocol(ProtocolConfig(dataset="digits", parties=4, n_labels=500, n_aligned=100,
                                               train_missing="mcar:0.2", seed=0))
    model = get_method("false-vfl-1")("fast", seed=0).fit(train)
    probe = Probe(model, train, args.party)
    x = train.blocks[args.party][probe.rows].astype(np.float64)
    precision = np.zeros((train.n_samples, probe.d_h))
    for k in range(train.n_parties):
        rows = np.flatnonzero(train.observed[:, k])
        precision[rows] += np.exp(-probe.encode(k, rows).tensors["logvar"].double().numpy())
    scale = 1 / np.sqrt(precision[train.observed.any(axis=1)])
    print(f"FALSE-VFL-I test accuracy {model.score(test):.3f}; fused posterior "
          f"scale over training rows: min {scale.min():.3f}, quantiles 0.1% {np.quantile(scale, 0.001):.3f}, 1% "
          f"{np.quantile(scale, 0.01):.3f}, 10% {np.quantile(scale, 0.1):.3f}, median {np.median(scale):.3f}")
    enc = probe.encode().tensors
    n = len(probe.rows)
    free = probe.decode(torch.zeros(n, probe.d_h), torch.ones(n, probe.d_h), torch.zeros(n, dtype=torch.int64), 7,
                        64, 1)
    rows = [("encode: mu, logvar", np.c_[enc["mu"].numpy(), enc["logvar"].numpy()]),
            ("decode, free latents (64, the same for every row)", (free[1:] - free[0]).T)]
    rows += [(f"decode around centre {c:g} at scale {s:g} (bound wire), 20 calls", around(probe, c, s))
             for c in (0.0, 5.0) for s in (0.3, 0.5, 1.0)]
    print("| released | best affine map (no known row) | 17 known rows | 25 known rows | 100 known rows |")
    print("|---|---|---|---|---|")
    for label, features in rows:
        e = errors(features, x)
        print(f"| {label} | {e['affine']:.2g} | {e['17 known']:.2f} | {e['25 known']:.2f} | {e['100 known']:.2f} |")
    print(f"({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
