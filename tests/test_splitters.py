"""Party splitters: the paper's arithmetic, grid pixels, explicit columns, names and errors."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from partialvfl.data.splitters import (
    ColumnsSplitter,
    ContiguousSplitter,
    GridSplitter,
    SplitterError,
    ViewsSplitter,
    default_feature_names,
    parse_splitter,
    split_source_array,
)


@pytest.mark.parametrize("d, k, width", [(617, 8, 77), (561, 8, 70), (64, 4, 16), (10, 3, 3)])
def test_contiguous_blocks_drop_the_remainder(d, k, width):
    groups = ContiguousSplitter().groups((d,), k)
    assert len(groups) == k
    for j, g in enumerate(groups):
        assert g.feature_shape == (width,)
        np.testing.assert_array_equal(g.columns, np.arange(j * width, (j + 1) * width))
    used = np.concatenate([g.columns for g in groups])
    assert len(used) == d - d % k  # 617 -> one feature dropped, 561 -> one dropped
    assert set(range(d)) - set(used.tolist()) == set(range(k * width, d))


def test_split_source_array_contiguous_values_and_names():
    X = np.arange(3 * 617, dtype=float).reshape(3, 617)
    blocks, names, shapes = split_source_array(X, "contiguous", 8)
    assert [b.shape for b in blocks] == [(3, 77)] * 8
    np.testing.assert_array_equal(blocks[1], X[:, 77:154])
    assert names[1][0] == "x77" and names[7][-1] == "x615"
    assert shapes == [(77,)] * 8


def test_fashionmnist_default_grid_is_2x4_of_14x7_pieces():
    X = np.random.default_rng(0).random((5, 28, 28))
    blocks, names, shapes = split_source_array(X, "grid", 8)
    assert shapes == [(14, 7)] * 8
    for k, b in enumerate(blocks):
        r, c = divmod(k, 4)
        np.testing.assert_array_equal(b, X[:, r * 14 : (r + 1) * 14, c * 7 : (c + 1) * 7].reshape(5, -1))
    assert names[1][0] == "x0_7"  # party 1 = grid row 0, column 1: starts at pixel (0, 7)


def test_grid_4x2_gives_eight_7x14_pieces_with_the_right_pixels():
    X = np.random.default_rng(1).random((4, 28, 28))
    blocks, _, shapes = split_source_array(X, "grid:4x2", 8)
    assert shapes == [(7, 14)] * 8
    for k, b in enumerate(blocks):
        r, c = divmod(k, 2)
        piece = X[:, r * 7 : (r + 1) * 7, c * 14 : (c + 1) * 14]
        np.testing.assert_array_equal(b.reshape(4, 7, 14), piece)
    # the pieces tile the image: every pixel exactly once
    cols = np.concatenate([g.columns for g in GridSplitter(4, 2).groups((28, 28), 8)])
    np.testing.assert_array_equal(np.sort(cols), np.arange(784))


def test_grid_keeps_channels():
    X = np.random.default_rng(2).random((3, 3, 32, 32))
    blocks, _, shapes = split_source_array(X, "grid", 4)
    assert shapes == [(3, 16, 16)] * 4
    np.testing.assert_array_equal(blocks[3].reshape(3, 3, 16, 16), X[:, :, 16:, 16:])
    np.testing.assert_array_equal(blocks[1].reshape(3, 3, 16, 16), X[:, :, :16, 16:])


@pytest.mark.parametrize(
    "shape, k, grid",
    [((28, 28), 8, (2, 4)), ((28, 28), 4, (2, 2)), ((28, 28), 2, (1, 2)), ((32, 64), 2, (1, 2)),
     ((64, 32), 2, (2, 1)), ((28, 28), 7, (1, 7)), ((32, 32), 1, (1, 1))],
)
def test_default_grid_prefers_square_pieces(shape, k, grid):
    assert GridSplitter.default_grid(*shape, k) == grid


def test_grid_errors():
    with pytest.raises(SplitterError, match="no grid of 5 equal pieces tiles a 28x28"):
        GridSplitter().groups((28, 28), 5)
    with pytest.raises(SplitterError, match="makes 6 pieces, not 8"):
        GridSplitter(3, 2).groups((28, 28), 8)
    with pytest.raises(SplitterError, match="does not tile a 28x28"):
        GridSplitter(3, 1).groups((28, 28), 3)
    with pytest.raises(SplitterError, match="image samples"):
        GridSplitter().groups((617,), 8)
    with pytest.raises(SplitterError, match="both grid rows and grid columns"):
        GridSplitter(rows=2)


def test_explicit_columns_by_index_and_by_name():
    X = np.arange(2 * 6).reshape(2, 6)
    names = ["a", "b", "c", "d", "e", "f"]
    blocks, pnames, shapes = split_source_array(X, ColumnsSplitter(((4, 0), ("b", "f"))), 2, names)
    np.testing.assert_array_equal(blocks[0], X[:, [4, 0]])
    np.testing.assert_array_equal(blocks[1], X[:, [1, 5]])
    assert pnames == [("e", "a"), ("b", "f")]
    assert shapes == [(2,), (2,)]
    blocks, _, _ = split_source_array(X, "columns:0-1;3,e", 2, names)
    np.testing.assert_array_equal(blocks[1], X[:, [3, 4]])


@pytest.mark.parametrize(
    "groups, k, message",
    [
        (((0, 1), (1, 2)), 2, "column index 1 is given to both party 0 and party 1"),
        (((0, 0), (1,)), 2, "party 0 lists column index 0 twice"),
        (((0, 9),), 1, "party 0: column index 9 is out of range for 6 features"),
        (((0,), ("zz",)), 2, "party 1: column 'zz' not found"),
        (((0,), ("a",)), 2, "column 'a' is given to both party 0 and party 1"),
        (((0,), (1,)), 3, "2 column groups given for 3 parties"),
    ],
)
def test_explicit_column_errors(groups, k, message):
    with pytest.raises(SplitterError, match=message):
        ColumnsSplitter(groups).groups((6,), k, ["a", "b", "c", "d", "e", "f"])


def test_bad_input_errors():
    with pytest.raises(SplitterError, match="empty column list"):
        ColumnsSplitter(((0,), ()))
    with pytest.raises(SplitterError, match="cannot give 9 parties at least one feature each out of 8"):
        ContiguousSplitter().groups((8,), 9)
    with pytest.raises(SplitterError, match="positive integer"):
        ContiguousSplitter().groups((8,), 0)
    with pytest.raises(SplitterError, match="unknown splitter 'rows'.*valid forms"):
        parse_splitter("rows")
    with pytest.raises(SplitterError, match="3 feature names given for 4 features"):
        split_source_array(np.zeros((2, 4)), "contiguous", 2, ["a", "b", "c"])
    with pytest.raises(SplitterError, match="runs backwards"):
        parse_splitter("columns:5-2")


def test_default_feature_names():
    assert default_feature_names((3,)) == ("x0", "x1", "x2")
    assert default_feature_names((1, 2, 2)) == ("x0_0_0", "x0_0_1", "x0_1_0", "x0_1_1")


def test_views_splitter_gives_each_party_one_view():
    X = np.random.default_rng(3).random((2, 6, 3, 4, 4))
    blocks, _, shapes = split_source_array(X, "views", 6)
    assert shapes == [(3, 4, 4)] * 6
    np.testing.assert_array_equal(blocks[4].reshape(2, 3, 4, 4), X[:, 4])
    with pytest.raises(SplitterError, match="samples have 6 views .* not 4 parties"):
        ViewsSplitter().groups((6, 3, 4, 4), 4)


@pytest.mark.parametrize("name", ["contiguous", "grid", "views", "grid:4x2", "columns:0-76;77,79,100-120;a,b"])
def test_parse_format_round_trip(name):
    s = parse_splitter(name)
    assert s.name == name
    assert parse_splitter(s.name) == s
    assert parse_splitter(s) is s


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_columns_round_trip_property(data):
    n = data.draw(st.integers(2, 40))
    perm = data.draw(st.permutations(range(n)))
    k = data.draw(st.integers(1, n))
    cuts = sorted(data.draw(st.lists(st.integers(1, n - 1), min_size=k - 1, max_size=k - 1, unique=True))) \
        if k > 1 else []
    bounds = [0, *cuts, n]
    groups = tuple(tuple(perm[a:b]) for a, b in zip(bounds, bounds[1:]))
    s = ColumnsSplitter(groups)
    back = parse_splitter(s.name)
    assert back == s
    got = back.groups((n,), len(groups))
    assert [tuple(g.columns.tolist()) for g in got] == [tuple(g) for g in groups]


# ---------------------------------------------------------------------- near-equal grids (any K) and importance splits
@pytest.mark.parametrize(("k", "grid"), [(4, (2, 2)), (6, (2, 3)), (8, (2, 4)), (10, (2, 5)), (12, (3, 4))])
def test_near_grid_cuts_fashion_mnist_into_any_k_near_equal_pieces(k, grid):
    groups = parse_splitter("grid:near").groups((28, 28), k)
    assert len(groups) == k
    cols = np.concatenate([g.columns for g in groups])
    assert sorted(cols.tolist()) == list(range(784))  # every pixel, once
    heights = {g.feature_shape[0] for g in groups}
    widths = {g.feature_shape[1] for g in groups}
    assert max(heights) - min(heights) <= 1 and max(widths) - min(widths) <= 1  # near-equal
    tops, lefts = set(), set()
    for g in groups:  # each piece is a rectangle of the image
        rows, cc = np.unravel_index(g.columns, (28, 28))
        assert (rows.max() - rows.min() + 1, cc.max() - cc.min() + 1) == g.feature_shape
        tops.add(int(rows.min()))
        lefts.add(int(cc.min()))
    assert (len(tops), len(lefts)) == grid  # the most square R x C grid, ties to fewer grid rows
    if 28 % grid[0] == 0 and 28 % grid[1] == 0:  # where an exact grid exists, 'grid:near' is that grid
        exact = parse_splitter("grid").groups((28, 28), k)
        assert all(np.array_equal(a.columns, b.columns) for a, b in zip(groups, exact))


def test_exact_grid_still_refuses_what_it_cannot_tile_and_names_the_near_form():
    with pytest.raises(SplitterError, match="no grid of 6 equal pieces"):
        parse_splitter("grid").groups((28, 28), 6)
    with pytest.raises(SplitterError, match="grid:near:2x3"):
        parse_splitter("grid:2x3").groups((28, 28), 6)
    assert parse_splitter("grid:near:2x3").name == "grid:near:2x3"


def _signal_data(n: int = 600, d: int = 40, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Features with graded signal: feature j carries (d - j) / d of the label."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n)
    strength = np.linspace(1.5, 0.0, d)
    return rng.normal(size=(n, d)) + strength * y[:, None], y


def test_importance_split_assigns_every_feature_once_and_matches_the_target_shares():
    from partialvfl.data.importance_split import ImportanceSplitter

    X, y = _signal_data()
    split = parse_splitter("importance:alpha=1")
    assert isinstance(split, ImportanceSplitter) and split.name == "importance:alpha=1"
    fitted = split.fitted(X, y, 4, seed=3)
    groups = fitted.groups((40,), 4)
    cols = np.concatenate([g.columns for g in groups])
    assert sorted(cols.tolist()) == list(range(40)) and all(len(g.columns) >= 1 for g in groups)
    rep = fitted.report()
    np.testing.assert_allclose(rep["realised_shares"], rep["target_shares"], atol=0.08)
    again = parse_splitter("importance:alpha=1").fitted(X, y, 4, seed=3)  # seeded
    assert np.array_equal(again.owner, fitted.owner)
    assert not np.array_equal(parse_splitter("importance:alpha=1").fitted(X, y, 4, seed=4).owner, fitted.owner)


def test_importance_shares_concentrate_as_alpha_grows():
    from partialvfl.data.importance_split import draw_shares

    def spread(alpha: float) -> float:  # mean distance of the shares from equal shares over many draws
        rng = np.random.default_rng(0)
        return float(np.mean([np.abs(draw_shares(alpha, 8, rng) - 1 / 8).sum() for _ in range(400)]))

    spreads = [spread(a) for a in (0.1, 1.0, 10.0, float("inf"))]
    assert spreads[0] > spreads[1] > spreads[2] > spreads[3] == 0.0


def test_importance_split_in_the_protocol_records_the_shares_and_flat_blocks():
    from partialvfl.data.protocol import ProtocolConfig, make_protocol

    train, test = make_protocol(ProtocolConfig(dataset="digits", parties=4, n_labels=100, n_aligned=20,
                                               splitter="importance:alpha=inf", seed=1, max_train=400))
    rep = train.info["split"]
    np.testing.assert_allclose(rep["target_shares"], [0.25] * 4)
    np.testing.assert_allclose(rep["realised_shares"], [0.25] * 4, atol=0.02)
    assert train.feature_names == test.feature_names and all(len(s) == 1 for s in train.feature_shapes)
    with pytest.raises(SplitterError, match="alpha=0.1"):
        parse_splitter("importance:beta=3")
