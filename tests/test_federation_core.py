"""The federation core: transport, party runtime, message log, audit, and the method contract's save/load."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from partialvfl import Task, VerticalDataset
from partialvfl.federation import (
    LocalFederation,
    MessageLog,
    MessageSpec,
    PartyProgram,
    PartyUnavailable,
    Reply,
    Request,
    TensorSpec,
    find_raw_feature_leaks,
    register_program,
)


def _data(n: int = 30, seed: int = 0) -> VerticalDataset:
    rng = np.random.default_rng(seed)
    blocks = [rng.normal(size=(n, 3)), rng.normal(size=(n, 4))]
    obs = np.ones((n, 2), bool)
    obs[::5, 0] = False
    blocks[0][~obs[:, 0]] = np.nan
    return VerticalDataset(blocks, obs, y=rng.integers(0, 2, n), task=Task.classification([0, 1]))


@register_program
class _LinearParty(PartyProgram):
    """A toy party: one linear map; forward sends embeddings, backward receives their gradient."""

    program_name = "test/linear"
    messages = {
        "forward": MessageSpec(request=[TensorSpec("rows", "int64", ("B",))],
                               reply=[TensorSpec("embedding", "float32", ("B", 2))], meta=["data"]),
        "leak": MessageSpec(reply=[TensorSpec("oops", "float32", ("N", "feature_dim"))], meta=["data"]),
        "backward": MessageSpec(request=[TensorSpec("grad", "float32", ("B", 2))]),
    }

    def __init__(self, runtime, config, seed):
        super().__init__(runtime, config, seed)
        g = torch.Generator().manual_seed(seed + runtime.index)
        self.w = torch.randn(config["feature_dim"], 2, generator=g, requires_grad=True)
        self._out: torch.Tensor | None = None

    def on_forward(self, req: Request) -> Reply:
        view = self.data(req.meta["data"])
        x = torch.as_tensor(view.features[view.position_of_rows(req.tensors["rows"].numpy())])
        self._out = x @ self.w
        return Reply({"embedding": self._out})

    def on_leak(self, req: Request) -> Reply:
        view = self.data(req.meta["data"])
        return Reply({"oops": torch.tensor(view.features[:3])})

    def on_backward(self, req: Request) -> Reply:
        assert self._out is not None
        self._out.backward(req.tensors["grad"])
        return Reply({})

    def state_dict(self):
        return {"w": self.w.detach()}

    def load_state_dict(self, state):
        self.w = state["w"].clone().requires_grad_()


def _setup(data: VerticalDataset, log: MessageLog | None = None) -> LocalFederation:
    fed = LocalFederation.for_dataset(data, log=log)
    fed.attach(data, "train")
    fed.setup("test/linear", [{"feature_dim": d} for d in data.feature_dims], seed=3)
    return fed


def test_split_gradients_match_centralised_computation() -> None:
    data = _data()
    fed = _setup(data)
    rows = np.arange(10, 20)
    fed.transport.new_step()
    replies = {}
    for k in range(2):
        have = rows[data.observed[rows, k]]
        replies[k] = (have, fed.call(k, "forward", {"rows": torch.as_tensor(have)}, data="train"))
    embs = {k: r.tensors["embedding"].clone().requires_grad_() for k, (_, r) in replies.items()}
    total = torch.zeros(len(rows), 2)
    for k, (have, _) in replies.items():
        total = total.index_add(0, torch.as_tensor(np.searchsorted(rows, have)), embs[k])
    loss = (total**2).sum()
    loss.backward()
    for k in range(2):
        fed.call(k, "backward", {"grad": embs[k].grad})
    # centralised reference
    ws = [fed.runtimes[k].program.w for k in range(2)]
    ref_ws = [w.detach().clone().requires_grad_() for w in ws]
    ref_total = torch.zeros(len(rows), 2)
    for k in range(2):
        b = np.nan_to_num(data.blocks[k][rows])
        ref_total = ref_total + torch.as_tensor(b) @ ref_ws[k]
    (ref_total**2).sum().backward()
    for w, rw in zip(ws, ref_ws):
        torch.testing.assert_close(w.grad, rw.grad)


def test_log_records_every_message_with_bytes_and_boundary() -> None:
    data = _data()
    log = MessageLog()
    fed = _setup(data, log)
    n0 = len(log)
    fed.transport.new_step()
    fed.call(0, "forward", {"rows": torch.arange(1, 4)}, data="train")
    new = log.entries[n0:]
    assert [e.direction for e in new] == ["request", "reply"]
    assert new[1].names == ("embedding",) and new[1].shapes == ((3, 2),) and new[1].nbytes == 3 * 2 * 4
    assert new[0].crosses_boundary  # coordinator is party 1 (the active party), talking to party 0
    fed.call(1, "forward", {"rows": torch.arange(0, 2)}, data="train")
    assert not log.entries[-1].crosses_boundary


def test_audit_finds_raw_rows_and_passes_embeddings() -> None:
    data = _data()
    log = MessageLog(keep_payloads=True)
    fed = _setup(data, log)
    fed.transport.new_step()
    fed.call(0, "forward", {"rows": torch.arange(1, 5)}, data="train")
    assert find_raw_feature_leaks(log, data) == []
    fed.call(0, "leak", {}, data="train")
    leaks = find_raw_feature_leaks(log, data)
    assert leaks and leaks[0].party == 0 and leaks[0].tensor == "oops"


def test_tensors_cross_detached_so_no_graph_spans_parties() -> None:
    data = _data()
    fed = _setup(data)
    fed.transport.new_step()
    r = fed.call(0, "forward", {"rows": torch.arange(1, 4)}, data="train")
    assert r.tensors["embedding"].grad_fn is None and not r.tensors["embedding"].requires_grad


def test_down_party_raises_or_is_tolerated() -> None:
    data = _data()
    fed = _setup(data)
    fed.transport.down.add(0)
    with pytest.raises(PartyUnavailable):
        fed.call(0, "ping")
    fed.transport.new_round()
    out = fed.transport.broadcast([0, 1], "ping", tolerate=True)
    assert set(out) == {1} and fed.transport.failures[-1][1] == 0


def test_same_kind_twice_in_one_round_is_refused_like_the_network_does() -> None:
    fed = _setup(_data())
    fed.transport.new_step()
    fed.call(0, "ping")
    with pytest.raises(RuntimeError, match="new_round"):
        fed.call(0, "ping")
    fed.transport.new_round()
    fed.call(0, "ping")


def test_party_sees_only_its_own_block() -> None:
    data = _data()
    fed = _setup(data)
    view = fed.runtimes[0].data("train")
    assert view.features.shape == (int(data.observed[:, 0].sum()), 3)
    assert view.labels is None  # only the active party holds labels
    assert fed.runtimes[1].data("train").labels is not None
    with pytest.raises(ValueError):
        fed.runtimes[0].attach("x", data.party(1))


def test_party_state_save_load_roundtrip(tmp_path) -> None:
    data = _data()
    fed = _setup(data)
    fed.save(tmp_path)
    fed2 = _setup(data)
    with torch.no_grad():
        fed2.runtimes[0].program.w.add_(1.0)
    fed2.load(tmp_path)
    for k in range(2):
        torch.testing.assert_close(fed2.runtimes[k].program.w, fed.runtimes[k].program.w, rtol=0, atol=0)


def test_counting_log_keeps_totals_without_entries() -> None:
    data = _data()
    full, counting = MessageLog(), MessageLog(keep_entries=False)
    for log in (full, counting):
        fed = _setup(data, log)
        fed.transport.new_step()
        fed.call(0, "forward", {"rows": torch.arange(1, 5)}, data="train")
    assert len(counting) == len(full) and counting.entries == []
    assert counting.total_bytes() == full.total_bytes() > 0
    assert counting.bytes_by_kind() == full.bytes_by_kind()
    with pytest.raises(ValueError, match="counts only"):
        counting.crossing()
