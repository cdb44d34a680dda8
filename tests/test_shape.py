"""ShapeTracker against numpy views: random chains of movement ops on random shapes."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from luminal_num.hlir.shape import ShapeTracker, View
from luminal_num.hlir.symbolic import sym


def _factorizations(n):
    outs = [(n,)]
    for d in range(2, n):
        if n % d == 0:
            outs.append((d, n // d))
    return outs


@st.composite
def movement_chain(draw):
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=4)))
    ops = []
    cur = shape
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["permute", "reshape", "slice", "pad", "expand_dim", "expand"]))
        if kind == "permute":
            order = tuple(draw(st.permutations(range(len(cur)))))
            ops.append(("permute", order)); cur = tuple(cur[o] for o in order)
        elif kind == "reshape":
            n = int(np.prod(cur))
            choices = _factorizations(n) + [tuple(reversed(f)) for f in _factorizations(n)]
            new = draw(st.sampled_from(choices))
            if draw(st.booleans()):
                pos = draw(st.integers(0, len(new)))
                new = new[:pos] + (1,) + new[pos:]
            ops.append(("reshape", new)); cur = new
        elif kind == "slice":
            rng = []
            for d in cur:
                a = draw(st.integers(0, d)); b = draw(st.integers(a, d))
                rng.append((a, b))
            ops.append(("slice", tuple(rng))); cur = tuple(b - a for a, b in rng)
        elif kind == "pad":
            pads = tuple((draw(st.integers(0, 2)), draw(st.integers(0, 2))) for _ in cur)
            ops.append(("pad", pads)); cur = tuple(d + a + b for d, (a, b) in zip(cur, pads))
        elif kind == "expand_dim":
            ax = draw(st.integers(0, len(cur))); size = draw(st.integers(1, 3))
            ops.append(("expand_dim", (ax, size))); cur = cur[:ax] + (size,) + cur[ax:]
        else:
            ones = [i for i, d in enumerate(cur) if d == 1]
            if ones:
                ax = draw(st.sampled_from(ones)); size = draw(st.integers(1, 3))
                ops.append(("expand", (ax, size))); cur = cur[:ax] + (size,) + cur[ax + 1:]
    return shape, ops


def _apply_numpy(x, op, arg):
    if op == "permute":
        return np.transpose(x, arg)
    if op == "reshape":
        return np.reshape(x, arg)
    if op == "slice":
        return x[tuple(slice(a, b) for a, b in arg)]
    if op == "pad":
        return np.pad(x, arg)
    if op == "expand_dim":
        ax, size = arg
        return np.broadcast_to(np.expand_dims(x, ax), x.shape[:ax] + (size,) + x.shape[ax:])
    ax, size = arg
    return np.broadcast_to(x, x.shape[:ax] + (size,) + x.shape[ax + 1:])


def _apply_tracker(t, op, arg):
    if op in ("expand_dim", "expand"):
        return getattr(t, op)(*arg)
    return getattr(t, op)(arg)


@settings(max_examples=400, deadline=None)
@given(movement_chain())
def test_tracker_matches_numpy(chain):
    shape, ops = chain
    base = np.arange(1, int(np.prod(shape)) + 1, dtype=np.float64)  # 1-based so pad zeros are distinct
    ref = base.reshape(shape)
    t = ShapeTracker.contiguous(shape)
    for op, arg in ops:
        ref = _apply_numpy(ref, op, arg)
        t = _apply_tracker(t, op, arg)
        assert t.shape == ref.shape
        np.testing.assert_array_equal(t.realize(base), ref)


def test_views_are_canonical_and_merge():
    t = ShapeTracker.contiguous((2, 3, 4)).permute((0, 2, 1)).permute((0, 2, 1))
    assert t == ShapeTracker.contiguous((2, 3, 4))
    assert t.is_contiguous
    # a transposed reshape that cannot be one strided view stacks a second view
    t2 = ShapeTracker.contiguous((2, 3)).permute((1, 0)).reshape((6,))
    assert len(t2.views) == 2
    # merging contiguous dims stays one view
    t3 = ShapeTracker.contiguous((2, 3, 4)).permute((2, 0, 1)).reshape((4, 6))
    assert len(t3.views) == 1
    # size-1 dims get stride 0, full masks disappear
    v = View.create((1, 3), (5, 1), 0, ((0, 1), (0, 3)))
    assert v.strides == (0, 1) and v.mask is None


def test_symbolic_dims_bind_at_evaluation():
    s = sym("s")
    t = ShapeTracker.contiguous((s, 4)).permute((1, 0))
    assert t.views[0].strides == (1, 4)
    t = ShapeTracker.contiguous((4, s))
    assert t.views[0].strides == (s, 1)
    base = np.arange(12.0)
    np.testing.assert_array_equal(t.realize(base, {"s": 3}), base.reshape(4, 3))
    padded = t.pad(((0, 0), (1, 0)))
    assert padded.shape[1] == s + 1
    np.testing.assert_array_equal(padded.realize(base, {"s": 3}), np.pad(base.reshape(4, 3), ((0, 0), (1, 0))))
    with pytest.raises(KeyError, match="not bound"):
        t.realize(base, {})


def test_bad_movements_raise():
    t = ShapeTracker.contiguous((2, 3))
    with pytest.raises(ValueError):
        t.reshape((4,))
    with pytest.raises(ValueError):
        t.permute((0, 0))
    with pytest.raises(ValueError):
        t.expand(0, 5)
    with pytest.raises(ValueError):
        t.slice(((0, 3),))
