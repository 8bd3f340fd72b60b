"""Parties answering a round at the same time in process (``LocalFederation(concurrent=...)``, a thread each and on
a GPU a CUDA stream each): the same weights, messages and predictions as one by one.

On the CPU the threads run the same kernels on the same inputs, so a FALSE-VFL fit with its parties answering
concurrently ends in the same floats, bit for bit, as the one-by-one fit, with the same message log in the same
order; on a GPU (skipped without one) the same to float tolerance (cuDNN picks kernels per call).  The default is
concurrent on CUDA devices only.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from helpers import tiny_test, tiny_train
from partialvfl.federation import LocalFederation, MessageLog
from partialvfl.federation.wire.concurrent import concurrent_default
from partialvfl.federation.wire.messages import Request
from partialvfl.federation.wire.transport import PartyUnavailable
from partialvfl.methods import get_method

FALSE_VFL = dict(d_h=6, d_z=3, encoder_hidden=[12], decoder_hidden=[12], global_hidden=[12], discriminator_hidden=[12],
                 mask_hidden=[8], importance_samples=3, predict_importance_samples=4, pretrain_batch_size=16,
                 batch_size=8, pretrain_epochs=2, epochs=2)
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _fit(name: str, concurrent: bool, device: str = "cpu", wire: str = "lean"):
    train = tiny_train()
    log = MessageLog()
    fed = LocalFederation.for_dataset(train, log=log, device=device, concurrent=concurrent)
    model = get_method(name)("fast", seed=3, device=device, **FALSE_VFL, wire=wire).fit(train, federation=fed)
    return model, log


def _weights(model) -> dict[str, torch.Tensor]:
    out = {f"party{k}.{n}": t.detach().cpu() for k, rt in enumerate(model.federation_.runtimes)
           for n, t in rt.program.net.state_dict().items()}
    out.update({f"coordinator.{n}": t.detach().cpu() for n, t in model._coordinator_state().items()
                if isinstance(t, torch.Tensor)})
    return out


def _messages(log: MessageLog) -> list[tuple]:
    """The log's messages by step and round, requests first (a concurrent round, like the gRPC transport, logs all
    its requests before the replies; one by one each reply follows its request)."""
    return sorted((e.step, e.round, e.direction == "reply", e.sender, e.receiver, e.kind, e.names, e.shapes,
                   e.dtypes, e.nbytes) for e in log.entries)


@pytest.mark.parametrize(("name", "wire"), [("false-vfl-1", "lean"), ("false-vfl-2", "lean"),
                                            ("false-vfl-1", "samples")])
def test_concurrent_parties_fit_the_same_floats_and_messages_on_the_cpu(name: str, wire: str) -> None:
    alone, log_alone = _fit(name, concurrent=False, wire=wire)
    together, log_together = _fit(name, concurrent=True, wire=wire)
    a, b = _weights(alone), _weights(together)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert _messages(log_together) == _messages(log_alone)
    test = tiny_test()
    np.testing.assert_array_equal(together.predict_proba(test), alone.predict_proba(test))


def test_rounds_run_in_several_threads_only_when_asked_or_on_cuda() -> None:
    train = tiny_train()
    seen: set[str] = set()
    for concurrent in (None, False, True):
        fed = LocalFederation.for_dataset(train, concurrent=concurrent)
        model = get_method("false-vfl-1")("fast", seed=0, **dict(FALSE_VFL, pretrain_epochs=0, epochs=0))
        model.fit(train, federation=fed)
        program_cls = type(fed.runtimes[0].program)
        original = program_cls.on_encode
        names: set[str] = set()

        def spy(self, req, original=original, names=names):
            names.add(threading.current_thread().name)
            return original(self, req)

        program_cls.on_encode = spy
        try:
            model.predict_proba(tiny_test())
        finally:
            program_cls.on_encode = original
        seen.add(f"{concurrent}:{'threads' if any(n.startswith('party') for n in names) else 'caller'}")
    assert seen == {"None:caller", "False:caller", "True:threads"}
    assert not concurrent_default([torch.device("cpu")]) and concurrent_default([torch.device("cuda", 0)])
    assert not concurrent_default([torch.device("cuda", 0), torch.device("cpu")])


def test_a_party_down_in_a_concurrent_round_is_left_out_and_the_others_answer() -> None:
    train = tiny_train()
    fed = LocalFederation.for_dataset(train, concurrent=True)
    model = get_method("false-vfl-1")("fast", seed=0, **dict(FALSE_VFL, pretrain_epochs=0, epochs=0))
    model.fit(train, federation=fed)
    rows = torch.arange(4)
    requests = {k: ("encode", {"rows": rows}, {"data": fed.attach(train)}) for k in range(3)}
    fed.transport.down.add(2)
    fed.transport.new_step()
    replies = fed.transport.call_many({k: Request(*r) for k, r in requests.items()}, tolerate=True)
    assert sorted(replies) == [0, 1] and all(r.tensors["mu"].shape == (4, 6) for r in replies.values())
    assert fed.transport.failures[-1][1:] == (2, "marked down")
    fed.transport.new_round()
    with pytest.raises(PartyUnavailable):
        fed.transport.call_many({k: Request(*r) for k, r in requests.items()})
    fed.transport.close()


@CUDA
@pytest.mark.slow
def test_concurrent_parties_on_a_gpu_fit_what_one_by_one_fits() -> None:
    alone, _ = _fit("false-vfl-1", concurrent=False, device="cuda")
    together, _ = _fit("false-vfl-1", concurrent=True, device="cuda")
    a, b = _weights(alone), _weights(together)
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-4, atol=1e-5, msg=key)
    # one model's predictions, its parties answering concurrently and one by one: a prediction's noise is seeded by
    # a digest of the exact weights, which two GPU fits need not share bit for bit (atomics, cuDNN's choices)
    test = tiny_test()
    transport = together.federation_.transport
    transport.concurrent = False
    one_by_one = together.predict_proba(test)
    transport.concurrent = True
    np.testing.assert_allclose(together.predict_proba(test), one_by_one, atol=1e-5)
