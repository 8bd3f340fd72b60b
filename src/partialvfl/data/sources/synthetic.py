"""``synthetic``: a generator with a known latent structure in which more observed parties carry more information.

The model (all draws from one ``numpy.random.Generator`` seeded by ``seed``):

* each sample has a class ``y`` (uniform over ``n_classes``) and a latent vector
  ``z = mu[y] + e``, ``e ~ N(0, I_d)``, where the class centres ``mu[c] ~ N(0, class_sep^2 I_d)``;
* party ``k`` sees only a random ``r``-dimensional projection of ``z`` (``r = max(1, d // n_parties)``, a
  party-specific orthonormal basis ``V_k``), mixed into its ``n_features`` columns by a random matrix ``A_k`` and,
  if ``nonlinear``, bent mildly (``h + 0.5 tanh(h)``), plus party-specific Gaussian noise of scale
  ``noise * s_k`` with ``s_k ~ U(0.75, 1.25)``:  ``x_k = f(A_k V_k^T z) + noise * s_k * eps_k``.

No single party sees the whole latent space and every party's view is noisy, so accuracy rises with the number of
observed parties (the union of the projections covers more of ``z`` and independent noises average out).
Columns are party-major: party 0's ``n_features`` columns first, so the ``contiguous`` splitter with
``n_parties`` parties recovers exactly the generating parties.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from partialvfl.data.dataset import Task
from partialvfl.data.sources.base import RawSource, SourceInfo, register_source

__all__ = ["make_synthetic"]


def make_synthetic(
    data_dir: str | Path | None = None,
    *,
    n_samples: int = 2000,
    n_test: int = 1000,
    n_parties: int = 4,
    n_features: int = 8,
    n_classes: int = 4,
    noise: float = 1.0,
    latent_dim: int | None = None,
    class_sep: float = 1.5,
    nonlinear: bool = True,
    seed: int = 0,
) -> RawSource:
    """Draw ``n_samples`` training and ``n_test`` test samples from the model in the module docstring.

    ``latent_dim`` defaults to ``2 * n_parties``.  The same seed gives the same data; ``data_dir`` is ignored.
    """
    for opt, val, low in (("n_samples", n_samples, 1), ("n_parties", n_parties, 1), ("n_features", n_features, 1),
                          ("n_classes", n_classes, 2), ("n_test", n_test, 0)):
        if int(val) != val or val < low:
            raise ValueError(f"synthetic: option {opt} must be an integer >= {low}, got {val!r}")
    if not noise >= 0:
        raise ValueError(f"synthetic: option noise must be >= 0, got {noise!r}")
    d = int(latent_dim) if latent_dim is not None else 2 * n_parties
    if d < 1:
        raise ValueError(f"synthetic: option latent_dim must be >= 1, got {latent_dim!r}")
    r = min(d, max(1, d // n_parties))
    rng = np.random.default_rng(seed)
    centres = class_sep * rng.standard_normal((n_classes, d))
    bases = [np.linalg.qr(rng.standard_normal((d, r)))[0] for _ in range(n_parties)]
    mixers = [rng.standard_normal((r, n_features)) for _ in range(n_parties)]
    scales = rng.uniform(0.75, 1.25, size=n_parties)

    def draw(n: int) -> tuple[np.ndarray, np.ndarray]:
        y = rng.integers(0, n_classes, size=n)
        z = centres[y] + rng.standard_normal((n, d))
        blocks = []
        for k in range(n_parties):
            h = z @ bases[k] @ mixers[k]
            if nonlinear:
                h = h + 0.5 * np.tanh(h)
            blocks.append(h + noise * scales[k] * rng.standard_normal((n, n_features)))
        return np.concatenate(blocks, axis=1).astype(np.float32), y.astype(np.int64)

    X_train, y_train = draw(n_samples)
    X_test, y_test = draw(n_test) if n_test > 0 else (None, None)
    names = tuple(f"p{k}_f{j}" for k in range(n_parties) for j in range(n_features))
    return RawSource(
        name="synthetic",
        X_train=X_train,
        y_train=y_train,
        X_test=X_test,
        y_test=y_test,
        task=Task.classification([f"class{c}" for c in range(n_classes)]),
        feature_names=names,
        origin=f"generated (seed={seed})",
        kind="tabular",
        extra={
            "n_parties": n_parties,
            "party_sizes": [n_features] * n_parties,
            "party_noise": [float(noise * s) for s in scales],
            "latent_dim": d,
            "projection_dim": r,
        },
    )


def _synthetic_available(data_dir: str | Path | None = None) -> tuple[bool, str]:
    return True, "generated in memory (options n_samples, n_parties, n_features, n_classes, noise, seed)"


register_source(
    SourceInfo(
        name="synthetic",
        description="latent-variable generator where every added party adds information (4 parties x 8 features)",
        loader=make_synthetic,
        availability=_synthetic_available,
        train_shape=(2000, 32),
        test_shape=(1000, 32),
        n_classes=4,
    )
)
