"""Bias, boolean mask and dropout under ``jax.jit`` with sharded inputs: results and gradients (dbias included)
equal the unsharded call, batch/head sharding and rings move no q/k/v, and dropout draws the same bits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_flash
from attention_cases import Case
from sharding_cases import DTYPE, TOLERANCE, compare_sharded, mesh, needs_devices
from test_sharding import CASE, COLLECTIVES_MOVING_DATA, MESHES, gspmd  # noqa: F401 (gspmd: a fixture)

pytestmark = needs_devices

# Full, per-head, per-batch key padding, and per-query (key-broadcast: its gradient comes from lse's).
BIAS_SHAPES = [(2, 8, 16, 16), (8, 16, 16), (2, 1, 1, 16), (16, 1)]


def _bias(shape, seed=1):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _mask(shape, seed=2):
    return jax.random.bernoulli(jax.random.key(seed), 0.7, shape).at[..., 3, :].set(False)


@pytest.mark.parametrize("shape", BIAS_SHAPES, ids=str)
@pytest.mark.parametrize("mesh_name", MESHES)
def test_bias_sharded_equals_unsharded(mesh_name, shape):
    names, spec, mesh_shape = MESHES[mesh_name]
    compare_sharded(*CASE.inputs(), {"causal": True, "bias": _bias(shape)}, mesh(names, mesh_shape), spec)


@pytest.mark.parametrize("mesh_name", MESHES)
def test_mask_sharded_equals_unsharded(mesh_name):
    """Rows the mask hides entirely (row 3) stay (0, -inf) in every shard."""
    names, spec, mesh_shape = MESHES[mesh_name]
    kwargs = {"window_size": (5, 3), "mask": _mask((2, 1, 16, 16)), "bias": _bias((8, 1, 16))}
    compare_sharded(*CASE.inputs(), kwargs, mesh(names, mesh_shape), spec)


@pytest.mark.parametrize("mesh_name", MESHES)
def test_dropout_sharded_equals_unsharded(mesh_name):
    """The same elements are dropped: heads and sequences are gathered for it, the batch stays sharded."""
    names, spec, mesh_shape = MESHES[mesh_name]
    kwargs = {"causal": True, "dropout_rate": 0.3, "dropout_rng": jax.random.key(9), "bias": _bias((8, 16, 16))}
    compare_sharded(*CASE.inputs(), kwargs, mesh(names, mesh_shape), spec)


def test_dropout_batch_sharding_moves_no_data():
    names, _, mesh_shape = MESHES["data_heads"]
    kwargs = {"causal": True, "dropout_rate": 0.3, "dropout_rng": jax.random.key(9), "bias": _bias((2, 1, 1, 16))}
    hlo = compare_sharded(*CASE.inputs(), kwargs, mesh(names, mesh_shape), P("data"), return_hlo=True)
    for collective in COLLECTIVES_MOVING_DATA:
        assert collective not in hlo, collective


@pytest.mark.parametrize("partitioner", ["shardy", "gspmd"])
def test_batch_and_head_sharding_with_bias_and_mask_moves_no_data(partitioner, request):
    """A per-head bias (replicated over the batch: its gradient is summed by an all-reduce) and a per-batch mask
    on a (data, heads) mesh: no gather, all-to-all or permute of q/k/v."""
    if partitioner == "gspmd":
        request.getfixturevalue("gspmd")
    names, spec, mesh_shape = MESHES["data_heads"]
    kwargs = {"causal": True, "bias": _bias((8, 16, 16)), "mask": _mask((2, 1, 16, 16))}
    hlo = compare_sharded(*CASE.inputs(), kwargs, mesh(names, mesh_shape), spec, return_hlo=True)
    for collective in COLLECTIVES_MOVING_DATA:
        assert collective not in hlo, collective


def test_ring_with_bias_gathers_nothing():
    """A full bias on a causal (zigzag) ring: its query rows are sharded, its key columns cut per block."""
    names, spec, mesh_shape = MESHES["data_seq"]
    kwargs = {"causal": True, "bias": _bias((2, 8, 16, 16)), "mask": _mask((16, 16))}
    hlo = compare_sharded(*CASE.inputs(), kwargs, mesh(names, mesh_shape), spec, return_hlo=True)
    assert "collective-permute" in hlo
    assert "all-gather" not in hlo and "all-to-all" not in hlo


@pytest.mark.parametrize("shape", [(2, 8, 16, 24), (8, 1, 24)], ids=str)
def test_query_sequence_sharded_bias_with_replicated_keys(shape):
    case = Case(batch=2, seqlen_q=16, seqlen_k=24, heads_q=8, heads_kv=4, head_dim=8, dtype=DTYPE)
    hlo = compare_sharded(*case.inputs(), {"causal": True, "bias": _bias(shape)}, mesh(("data", "seq")),
                          P("data", "seq"), P("data"), return_hlo=True)
    for collective in COLLECTIVES_MOVING_DATA:
        assert collective not in hlo, collective


@pytest.mark.parametrize("bias_shape, in_axes", [((3, 1, 8, 16, 16), 0), ((2, 8, 16, 16), None)],
                         ids=["batched_broadcast_batch", "shared_full_batch"])
def test_vmap_folds_the_bias_into_the_batch(bias_shape, in_axes):
    q, k, v = CASE.inputs()
    qs = jnp.stack([q, 2 * q, -q])
    bias = _bias(bias_shape)
    attend = lambda q_, b: jax_flash.attention(q_, k, v, bias=b, causal=True)
    vmapped = lambda qs_, b: jnp.sum(jax.vmap(attend, in_axes=(0, in_axes))(qs_, b) ** 2)
    looped = lambda qs_, b: sum(jnp.sum(attend(qs_[i], b if in_axes is None else b[i]) ** 2) for i in range(3))
    got = jax.grad(vmapped, argnums=(0, 1))(qs, bias)
    want = jax.grad(looped, argnums=(0, 1))(qs, bias)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), **TOLERANCE)
