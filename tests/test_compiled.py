"""``--compile``: compiled steps give the eager results; without a working C++ compiler they fall back to eager
with a message (simulated by pointing inductor at a compiler that does not exist, with an empty kernel cache)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import partialvfl.nn.compiled as compiled_module
from helpers import make_data
from partialvfl.methods.base import get_method
from test_contract import TINY


@pytest.fixture(scope="module")
def data():
    return make_data(96, seed=0, prefix="tr"), make_data(40, seed=1, prefix="te")


@pytest.mark.slow
def test_without_a_cxx_compiler_compile_falls_back_to_eager_with_a_message(data, tmp_path, monkeypatch,
                                                                          capsys) -> None:
    import torch._inductor.config as inductor_config

    train, test = data
    eager = get_method("false-vfl-1")("fast", seed=3, **TINY["false-vfl-1"]).fit(train).predict_proba(test)
    monkeypatch.setattr(compiled_module, "_FAILED", {})
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "empty-cache"))  # nothing compiled before
    torch._dynamo.reset()
    try:  # inductor's own patch (monkeypatch's undo left cpp.cxx missing: every later compile in the process failed)
        with inductor_config.patch({"cpp.cxx": (str(tmp_path / "no-such-c++"),)}):
            model = get_method("false-vfl-1")("fast", seed=3, compile=True, **TINY["false-vfl-1"]).fit(train)
            proba = model.predict_proba(test)
    finally:
        torch._dynamo.reset()
    err = capsys.readouterr().err
    # FALSE-VFL's compiled step: its latent log-weights (its parties answer alone, uncompiled, since issue 21)
    assert "partialvfl --compile: could not compile FALSE-VFL's latent log-weights" in err
    assert "running it eagerly instead" in err and "needs a C++ compiler" in err
    assert err.count("could not compile FALSE-VFL's latent log-weights") == 1  # said once, not every step
    assert "InvalidCxxCompiler" in compiled_module.compile_failures()["FALSE-VFL's latent log-weights"]
    np.testing.assert_array_equal(proba, eager)  # eager after the failure: the same numbers


@pytest.mark.slow
@pytest.mark.parametrize("name", ["false-vfl-1", "vanilla-vfl"])
def test_compiled_steps_give_the_eager_results(name: str, data, monkeypatch) -> None:
    train, test = data
    monkeypatch.setattr(compiled_module, "_FAILED", {})
    eager = get_method(name)("fast", seed=3, **TINY[name]).fit(train)
    fast = get_method(name)("fast", seed=3, compile=True, **TINY[name]).fit(train)
    assert not compiled_module.compile_failures(), compiled_module.compile_failures()
    # FALSE-VFL keys each row's prediction draws by the exact bits of the label side's weights (a secret the parties
    # lack); compiled and eager weights agree to float rounding, not bit for bit, so compare them under the same draws
    fast._label_side_digest = eager._label_side_digest
    np.testing.assert_allclose(fast.predict_proba(test), eager.predict_proba(test), rtol=1e-4, atol=1e-5)
    assert [h["stage"] for h in fast.history_] == [h["stage"] for h in eager.history_]
