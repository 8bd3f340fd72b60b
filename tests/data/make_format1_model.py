"""How tests/data/format1-model was made: run with the code of commit 86ddc4e (model format 1, before party
preprocessing, feature names and digests), e.g.

    git archive 86ddc4e | tar -x -C /tmp/old && PYTHONPATH=/tmp/old/src python tests/data/make_format1_model.py

It saves a small vanilla-vfl model and the probabilities it predicts for the same tables (expected.json); the test
loads the model with today's code and must predict the same.
"""

import json
from pathlib import Path

import numpy as np
import pandas as pd

from partialvfl.data.builders import from_tables
from partialvfl.methods import get_method

HERE = Path(__file__).resolve().parent


def tables() -> dict[str, pd.DataFrame]:
    rng = np.random.default_rng(5)
    y = rng.integers(0, 3, 60)
    a = pd.DataFrame({"uid": np.arange(60), "x": y + rng.normal(0, 0.3, 60), "label": y})
    b = pd.DataFrame({"uid": np.arange(0, 60, 2), "z": y[::2] * 0.5 + rng.normal(0, 0.3, 30)})
    return {"a": a, "b": b}


if __name__ == "__main__":
    data = from_tables(tables(), id_column="uid", label_column="label", active_party="a")
    model = get_method("vanilla-vfl")("fast", seed=1, epochs=3, latent_dim=4, encoder_hidden=[8]).fit(data)
    out = HERE / "format1-model"
    model.save(out)
    (HERE / "format1-expected.json").write_text(json.dumps({"ids": [int(i) for i in data.ids],
                                                            "proba": model.predict_proba(data).tolist()}))
    print("saved", out)
