"""``jax_flash.attention`` under ``jax.jit`` with sharded inputs (custom partitioning): every result and gradient
equals the unsharded call, batch/head sharding compiles without moving q/k/v, sequence sharding becomes ring
attention, and what cannot run sharded is gathered rather than computed wrongly."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flash
from jax_flash import _config, _relayout
from attention_cases import FEATURES, Case, feature_kwargs
from sharding_cases import DTYPE, NUM_DEVICES, ON_GPU, TOLERANCE, compare_sharded, mesh, needs_devices

pytestmark = needs_devices

# On 2 x 4 meshes batch 2 and 4 key/value heads divide evenly and seqlen 16 makes 4 shards of 2 zigzag chunks.
CASE = Case(batch=2, seqlen_q=16, seqlen_k=16, heads_q=8, heads_kv=4, head_dim=8, dtype=DTYPE)
# Name -> (axis names, q/k/v spec, mesh shape). With only 2 devices each mesh shards one role: the batch, the
# sequence (a ring), the heads.
MESHES = {
    "data_heads": (("data", "heads"), P("data", None, "heads"), None if NUM_DEVICES == 8 else (2, 1)),
    "data_seq": (("data", "seq"), P("data", "seq"), None),
    "heads_seq": (("heads", "seq"), P(None, "seq", "heads"), None if NUM_DEVICES == 8 else (2, 1)),
}
COLLECTIVES_MOVING_DATA = ("all-gather", "all-to-all", "collective-permute")


@pytest.fixture
def gspmd():
    """Runs a test with the GSPMD partitioner (the callbacks) instead of Shardy (the sharding rule)."""
    previous = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", False)
    yield
    jax.config.update("jax_use_shardy_partitioner", previous)


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("mesh_name", MESHES)
def test_sharded_equals_unsharded(mesh_name, feature):
    names, spec, shape = MESHES[mesh_name]
    compare_sharded(*CASE.inputs(), feature_kwargs(feature, CASE), mesh(names, shape), spec)


@pytest.mark.parametrize("partitioner", ["shardy", "gspmd"])
def test_batch_and_head_sharding_moves_no_data(partitioner, request):
    """GQA with causal masking on a (data, heads) mesh: the compiled forward+backward has no gather, all-to-all
    or permute (only the loss's all-reduce)."""
    if partitioner == "gspmd":
        request.getfixturevalue("gspmd")
    names, spec, shape = MESHES["data_heads"]
    hlo = compare_sharded(*CASE.inputs(), {"causal": True}, mesh(names, shape), spec, return_hlo=True)
    for collective in COLLECTIVES_MOVING_DATA:
        assert collective not in hlo, collective


@pytest.mark.parametrize("feature", ["causal", "everything"])
@pytest.mark.parametrize("mesh_name", ["data_seq", "heads_seq"])
def test_gspmd_partitioner(mesh_name, feature, gspmd):
    names, spec, shape = MESHES[mesh_name]
    compare_sharded(*CASE.inputs(), feature_kwargs(feature, CASE), mesh(names, shape), spec)


def test_sequence_sharding_is_a_ring():
    """Keys/values sharded on the sequence: blocks travel by collective-permute, nothing is gathered."""
    names, spec, shape = MESHES["data_seq"]
    hlo = compare_sharded(*CASE.inputs(), {"causal": True, "window_size": (5, -1)}, mesh(names, shape), spec,
                          return_hlo=True)
    assert "collective-permute" in hlo
    assert "all-gather" not in hlo and "all-to-all" not in hlo


@pytest.mark.parametrize("kwargs", [{"causal": True}, {"window_size": (3, 2)},
                                    {"causal": True, "alibi_slopes": jnp.linspace(0.1, 0.8, 8)}],
                         ids=["causal", "window", "alibi_causal"])
def test_query_sequence_sharded_with_replicated_keys(kwargs):
    """Cross-attention with a bottom-right diagonal: each query shard runs locally at its global offset."""
    case = Case(batch=2, seqlen_q=16, seqlen_k=24, heads_q=8, heads_kv=4, head_dim=8, dtype=DTYPE)
    hlo = compare_sharded(*case.inputs(), kwargs, mesh(("data", "seq")), P("data", "seq"), P("data"),
                          return_hlo=True)
    for collective in COLLECTIVES_MOVING_DATA:
        assert collective not in hlo, collective


def test_ring_cross_attention():
    case = Case(batch=2, seqlen_q=16, seqlen_k=32, heads_q=8, heads_kv=4, head_dim=8, dtype=DTYPE)
    compare_sharded(*case.inputs(), {"causal": True}, mesh(("data", "seq")), P("data", "seq"))


def test_lengths_with_bottom_right_causal_gather_the_sequence():
    """Per-sequence lengths move each sequence's diagonal, which a shard cannot express: the partitioner gathers
    the sequence (explicitly, visible in the HLO) and the result stays exact."""
    hlo = compare_sharded(*CASE.inputs(), feature_kwargs("seqlens_causal", CASE), mesh(("data", "seq")),
                          P("data", "seq"), return_hlo=True)
    assert "all-gather" in hlo


def test_top_left_causal_with_lengths_rings():
    """jax.nn-style (top-left) causal masks do not depend on the lengths: sequence sharding stays a ring."""
    lengths = jnp.asarray([11, 16], jnp.int32)

    def fn(q, k, v, return_lse, **kwargs):
        del return_lse
        out, residual = jax_flash.dot_product_attention(q, k, v, is_causal=True, query_seq_lengths=lengths,
                                                        key_value_seq_lengths=lengths, return_residual=True)
        return out, jnp.swapaxes(residual, 1, 2)

    hlo = compare_sharded(*CASE.inputs(), {}, mesh(("data", "seq")), P("data", "seq"), fn=fn, return_hlo=True)
    assert "collective-permute" in hlo and "all-gather" not in hlo


@pytest.mark.parametrize("partitioner", ["shardy", "gspmd"])
def test_multi_query_attention_shards_query_heads(partitioner, request):
    """One key/value head, query heads over 4 devices: keys/values stay replicated, nothing is gathered."""
    if partitioner == "gspmd":
        request.getfixturevalue("gspmd")
    case = Case(batch=2, seqlen_q=16, seqlen_k=16, heads_q=8, heads_kv=1, head_dim=8, dtype=DTYPE)
    hlo = compare_sharded(*case.inputs(), {"causal": True}, mesh(("data", "heads")), P("data", None, "heads"),
                          P("data"), return_hlo=True)
    assert "all-gather" not in hlo and "all-to-all" not in hlo


def test_heads_not_divisible_are_gathered():
    """Three key/value heads cannot be split over 2 or 4 devices: heads are gathered, results stay exact."""
    case = Case(batch=2, seqlen_q=16, seqlen_k=16, heads_q=12, heads_kv=3, head_dim=8, dtype=DTYPE)
    compare_sharded(*case.inputs(), {"causal": True}, mesh(("data", "heads")), P("data", None, "heads"),
                    P("data"))


def test_explicit_mesh_axes():
    """Meshes with explicit axes (jax.make_mesh's default in recent jax): outputs keep the inputs' sharding."""
    m = mesh(("data", "seq"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    compare_sharded(*CASE.inputs(), {"causal": True}, m, P("data", "seq"))
    sharding = NamedSharding(m, P("data", "seq"))
    q = jax.device_put(CASE.inputs()[0], sharding)
    assert jax.jit(lambda x: jax_flash.attention(x, x[:, :, :4], x[:, :, :4]))(q).sharding.is_equivalent_to(sharding, 4)


@pytest.mark.parametrize("precision", ["tf32", "highest"])
@pytest.mark.parametrize("mesh_name", ["data_heads", "data_seq", "explicit"])
def test_float32_on_a_hopper_machine(monkeypatch, precision, mesh_name):
    """Where every GPU is a Hopper, float32 calls are traced for CUDA too (``_config.per_platform``): at head_dim 72
    the TF32 mode's backward on float16 operands, "highest"'s split-TF32 forward and float16-parts backward, each
    scaling its operands per slice. Those traces must hold under batch, head and sequence (ring) sharding and explicit
    mesh axes, and the results stay the unsharded call's (on the CPU, its exact kernels; on Hopper GPUs, those
    paths' kernels)."""
    if not ON_GPU:
        monkeypatch.setattr(_config, "gpus_are_hopper", lambda: True)
    elif not _config.gpus_are_hopper():
        pytest.skip("the float32 paths' defaults are on on compute capability 9.x GPUs only")
    case = Case(batch=2, seqlen_q=16, seqlen_k=16, heads_q=8, heads_kv=4, head_dim=72, dtype=jnp.float32, seed=72)
    if mesh_name == "explicit":
        m, spec = mesh(("data", "seq"), axis_types=(jax.sharding.AxisType.Explicit,) * 2), P("data", "seq")
    else:
        names, spec, shape = MESHES[mesh_name]
        m = mesh(names, shape)
    compare_sharded(*case.inputs(), {"causal": True, "float32_precision": precision}, m, spec)


def test_vmap_over_sharded_inputs():
    """vmap folds the mapped axis into the batch before partitioning; values and gradients."""
    q, k, v = CASE.inputs()
    stack = lambda x: jnp.stack([x, 2 * x])
    sharding = NamedSharding(mesh(("data", "heads")), P(None, "data", None, "heads"))
    attend = jax.vmap(lambda q_, k_, v_: jax_flash.attention(q_, k_, v_, causal=True))
    f = jax.jit(jax.value_and_grad(lambda *a: jnp.sum(attend(*a) ** 2), argnums=(0, 1, 2)))
    got = f(*(jax.device_put(stack(x), sharding) for x in (q, k, v)))
    want = f(stack(q), stack(k), stack(v))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), **TOLERANCE)


def test_causal_ring_moves_shards_into_zigzag():
    """The per-device exchange gives each device exactly its zigzag chunks, and undoes it."""
    m = mesh(("seq",), (NUM_DEVICES,))
    x = jnp.arange(2 * 64).reshape(2, 64)
    exchange = lambda fn: jax.shard_map(functools.partial(fn, axis_name="seq", num_shards=NUM_DEVICES), mesh=m,
                                        in_specs=P(None, "seq"), out_specs=P(None, "seq"))
    zigzag = exchange(_relayout.to_zigzag)(x)
    np.testing.assert_array_equal(zigzag, jax_flash.to_zigzag(x, NUM_DEVICES))
    np.testing.assert_array_equal(exchange(_relayout.from_zigzag)(zigzag), x)
