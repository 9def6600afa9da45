"""``jax_flash.ring_attention`` inside ``jax.shard_map`` (contiguous and zigzag layouts), its block plans and the
zigzag helpers: results and gradients (including through lse) equal the unsharded ``jax_flash.attention``."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_flash
from attention_cases import Case, feature_kwargs
from jax_flash._block_plan import PositionMask, ring_schedule
from jax_flash.sequence_layout import SequenceLayout
from sharding_cases import DTYPE, TOLERANCE, cotangents, mesh, needs_devices, probe, split_kwargs

CASE = Case(batch=2, seqlen_q=32, seqlen_k=32, heads_q=4, heads_kv=2, head_dim=8, dtype=DTYPE)
RING_FEATURES = ("none", "causal", "window", "window_left_causal", "softcap", "alibi", "alibi_batched_causal",
                 "seqlens", "segments")


def _visible(mask: PositionMask, rows: np.ndarray, cols: np.ndarray, offset: int) -> np.ndarray:
    """Boolean [rows, cols] of the band around diagonal ``row + offset``."""
    distance = cols[None, :] - (rows[:, None] + offset)
    right = 0 if mask.causal else mask.window_right
    visible = np.ones(distance.shape, bool)
    if right >= 0:
        visible &= distance <= right
    if mask.window_left >= 0:
        visible &= distance >= -mask.window_left
    return visible


def _positions(layout: SequenceLayout, shard: int) -> np.ndarray:
    return np.concatenate([np.arange(s, s + layout.chunk_len) for s in layout.chunk_starts(shard)])


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("mask", [
    PositionMask(True, -1, -1, 0, False), PositionMask(True, 5, -1, 0, False), PositionMask(False, 3, 2, 0, False),
    PositionMask(False, -1, 4, 0, False), PositionMask(True, -1, -1, 8, False), PositionMask(True, -1, -1, 0, True),
    PositionMask(False, 6, 6, -3, True)], ids=str)
@pytest.mark.parametrize("shards,seqlen_q,seqlen_k", [(4, 32, 32), (2, 16, 24), (4, 16, 48)])
def test_block_plans_cover_the_mask_exactly_once(layout, mask, shards, seqlen_q, seqlen_k):
    """Every visible (query, key) pair of every (step, shard) block is computed by exactly one kernel call, with
    the right mask; hidden pairs by none."""
    q_layout, kv_layout = (SequenceLayout(layout, shards, n) for n in (seqlen_q, seqlen_k))
    schedule = ring_schedule(q_layout, kv_layout, mask)
    for step in range(shards):
        for shard in range(shards):
            q_pos, kv_pos = _positions(q_layout, shard), _positions(kv_layout, (shard - step) % shards)
            expected = _visible(mask, q_pos, kv_pos, mask.diagonal)
            covered = np.zeros(expected.shape, int)
            for call in schedule.plans[schedule.table[step][shard]]:
                rows = np.arange(call.q_slots[0] * q_layout.chunk_len, (call.q_slots[-1] + 1) * q_layout.chunk_len)
                cols = np.arange(call.kv_slots[0] * kv_layout.chunk_len,
                                 (call.kv_slots[-1] + 1) * kv_layout.chunk_len)
                call_mask = PositionMask(call.causal, call.window_left, call.window_right, 0, False)
                local = _visible(call_mask, np.arange(len(rows)), np.arange(len(cols)), call.diagonal_offset)
                covered[np.ix_(rows, cols)] += local
                if mask.alibi:  # distances must be global ones
                    local_rows, local_cols = rows - rows[0], cols - cols[0]
                    np.testing.assert_array_equal(q_pos[rows][:, None] - kv_pos[cols][None, :] + mask.diagonal,
                                                  local_rows[:, None] - local_cols[None, :] + call.diagonal_offset)
            np.testing.assert_array_equal(covered, expected.astype(int), err_msg=f"step {step} shard {shard}")


def test_causal_schedules_compile_three_branches():
    mask = PositionMask(True, -1, -1, 0, False)
    for layout in ("contiguous", "zigzag"):
        assert len(ring_schedule(*(SequenceLayout(layout, 8, 64),) * 2, mask).plans) == 3


def test_zigzag_layout():
    positions = jnp.arange(16)[None]
    zigzag = jax_flash.to_zigzag(positions, 4)
    np.testing.assert_array_equal(zigzag.reshape(4, 4), [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11],
                                                         [6, 7, 8, 9]])
    np.testing.assert_array_equal(jax_flash.from_zigzag(zigzag, 4), positions)
    np.testing.assert_array_equal(jax_flash.from_zigzag(jax_flash.to_zigzag(positions.T, 2, axis=0), 2, axis=0),
                                  positions.T)


def _ring(m, seq_axes: tuple[str, ...], batch_axis: str | None, layout: str):
    """``jax_flash.attention``'s signature on global arrays, computed by ring_attention under shard_map."""
    shards = int(np.prod([m.shape[a] for a in seq_axes]))
    to, back = ((functools.partial(jax_flash.to_zigzag, num_shards=shards),
                 functools.partial(jax_flash.from_zigzag, num_shards=shards)) if layout == "zigzag"
                else (lambda x, axis=1: x, lambda x, axis=1: x))
    seq = P(batch_axis, seq_axes)

    def fn(q, k, v, return_lse, **kwargs):
        static, arrays = split_kwargs(kwargs)
        arrays = {name: to(x) if name.endswith("segment_ids") else x for name, x in arrays.items()}
        specs = {name: seq if name.endswith("segment_ids") else P(batch_axis) if x.ndim == 1 and "seqlens" in name
                 else P() if x.ndim == 1 else P(batch_axis) for name, x in arrays.items()}
        body = functools.partial(jax_flash.ring_attention, axis_name=seq_axes, layout=layout,
                                 return_lse=return_lse, **static)
        o, lse = jax.shard_map(lambda q_, k_, v_, a: body(q_, k_, v_, **a), mesh=m,
                               in_specs=(seq, seq, seq, specs),
                               out_specs=(seq, P(batch_axis, None, seq_axes)))(to(q), to(k), to(v), arrays)
        return back(o), back(lse, axis=2)

    return fn


def _compare(case: Case, kwargs, fn, tolerance=TOLERANCE):
    q, k, v = case.inputs()
    d_o, d_lse = cotangents(q)
    static, arrays = split_kwargs(kwargs)
    expected = probe(jax_flash.attention, static)(q, k, v, d_o, d_lse, arrays)
    actual = probe(fn, static)(q, k, v, d_o, d_lse, arrays)
    for name, got, want in zip(("o", "lse", "dq", "dk", "dv"), actual, expected):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), err_msg=name,
                                   **tolerance)


@needs_devices
@pytest.mark.parametrize("feature", RING_FEATURES)
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_ring_attention_equals_attention(layout, feature):
    """Batch split over data, the ring over seq."""
    _compare(CASE, feature_kwargs(feature, CASE), _ring(mesh(("data", "seq")), ("seq",), "data", layout))


@needs_devices
def test_ring_over_two_mesh_axes():
    """The sequence sharded over both axes of the mesh: one ring over all devices."""
    _compare(CASE, {"causal": True, "window_size": (9, -1)}, _ring(mesh(("a", "b")), ("a", "b"), None, "zigzag"))


@needs_devices
def test_cross_attention_ring():
    case = Case(batch=2, seqlen_q=16, seqlen_k=32, heads_q=4, heads_kv=1, head_dim=8, dtype=DTYPE)
    _compare(case, {"causal": True}, _ring(mesh(("data", "seq")), ("seq",), "data", "zigzag"))


@needs_devices
def test_rows_seeing_no_key_anywhere():
    """Queries whose segment appears in no key: o = 0, lse = -inf, finite gradients, as unsharded."""
    q_segments = jnp.asarray(np.repeat([[0, 1, 7, 1]], 8, axis=1).reshape(1, 32).repeat(2, 0), jnp.int32)
    kv_segments = jnp.asarray(np.repeat([[0, 1, 1, 0]], 8, axis=1).reshape(1, 32).repeat(2, 0), jnp.int32)
    kwargs = {"causal": True, "q_segment_ids": q_segments, "kv_segment_ids": kv_segments}
    _compare(CASE, kwargs, _ring(mesh(("data", "seq")), ("seq",), "data", "zigzag"))


@needs_devices
def test_bfloat16():
    case = Case(batch=2, seqlen_q=32, seqlen_k=32, heads_q=4, heads_kv=2, head_dim=8, dtype=jnp.bfloat16)
    _compare(case, {"causal": True}, _ring(mesh(("data", "seq")), ("seq",), "data", "zigzag"),
             tolerance=dict(rtol=2e-2, atol=2e-2))


@needs_devices
def test_lengths_with_causal_raise():
    q, k, v = CASE.inputs()
    lengths = jnp.full((2,), 20, jnp.int32)
    fn = _ring(mesh(("data", "seq")), ("seq",), "data", "contiguous")
    with pytest.raises(NotImplementedError, match="segment_ids"):
        fn(q, k, v, return_lse=True, causal=True, kv_seqlens=lengths)


def _sub_jaxprs(value):
    if hasattr(value, "eqns"):
        yield value
    elif hasattr(getattr(value, "jaxpr", None), "eqns"):
        yield value.jaxpr
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _sub_jaxprs(item)


def _shard_map_operands(jaxpr):
    """The operands of every shard_map in ``jaxpr``, nested jaxprs included."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "shard_map":
            yield from eqn.invars
        for value in eqn.params.values():
            for sub in _sub_jaxprs(value):
                yield from _shard_map_operands(sub)


@needs_devices
@pytest.mark.parametrize("feature", ["none", "causal", "segments", "seqlens"])
def test_no_zero_size_operand_enters_shard_map(feature):
    """XLA's GPU Shardy partitioner segfaulted on zero-size operands of a shard_map (hoisted empty index constants
    of ``x.at[whole axis]`` updates); the ring program, forward and backward, must pass none."""
    q, k, v = CASE.inputs()
    d_o, d_lse = cotangents(q)
    static, arrays = split_kwargs(feature_kwargs(feature, CASE))
    fn = _ring(mesh(("data", "seq")), ("seq",), "data", "zigzag" if feature == "causal" else "contiguous")
    jaxpr = jax.make_jaxpr(probe(fn, static))(q, k, v, d_o, d_lse, arrays).jaxpr
    shapes = [tuple(x.aval.shape) for x in _shard_map_operands(jaxpr)]
    assert shapes and all(np.prod(shape) > 0 for shape in shapes), shapes
