"""Transformations (jit, vmap, eval_shape, export), argument validation and the raw FFI targets."""

import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import _ffi_calls, _mask_blocks, _registration
from attention_cases import Case, forward_calls, set_path_switch


def _inputs(**overrides):
    return Case(**{"seqlen_q": 19, "seqlen_k": 23, **overrides}).inputs()


def test_jit_matches_eager():
    q, k, v = _inputs()
    f = lambda *a: jax_flash.attention(*a, causal=True, window_size=(4, -1))
    np.testing.assert_array_equal(np.asarray(jax.jit(f)(q, k, v)), np.asarray(f(q, k, v)))


def test_jitted_training_step():
    q, k, v = _inputs()

    @jax.jit
    def step(q_, k_, v_):
        loss, g = jax.value_and_grad(lambda x: jnp.mean(jax_flash.attention(x, k_, v_, causal=True) ** 2))(q_)
        return loss, q_ - 0.1 * g

    loss, updated = step(q, k, v)
    assert np.isfinite(float(loss)) and updated.shape == q.shape


@pytest.mark.parametrize("in_axes", [(0, 0, 0), (0, None, None), (2, 2, 2), (1, None, 1)],
                         ids=("all_mapped", "kv_unmapped", "axis2", "mixed"))
def test_vmap_matches_loop(in_axes):
    """vmap over any axis, k/v mapped or not; values and gradients equal a Python loop over the mapped axis."""
    q, k, v = _inputs()
    n = 3
    keys = jax.random.split(jax.random.key(11), 3)
    stacked = []
    for x, axis, key in zip((q, k, v), in_axes, keys):
        if axis is None:
            stacked.append(x)
        else:
            extra = jax.random.normal(key, (n,) + x.shape, x.dtype)
            stacked.append(jnp.moveaxis(extra, 0, axis))
    f = lambda q_, k_, v_: jax_flash.attention(q_, k_, v_, causal=True, softcap=3.0)
    batched = jax.vmap(f, in_axes=in_axes)(*stacked)

    def take(x, axis, i):
        return x if axis is None else jnp.take(x, i, axis=axis)

    looped = jnp.stack([f(*(take(x, a, i) for x, a in zip(stacked, in_axes))) for i in range(n)])
    np.testing.assert_allclose(np.asarray(batched), np.asarray(looped), atol=1e-6, rtol=1e-6)

    loss = lambda *a: jnp.sum(jax.vmap(f, in_axes=in_axes)(*a) ** 2)
    loop_loss = lambda *a: sum(jnp.sum(f(*(take(x, ax, i) for x, ax in zip(a, in_axes))) ** 2) for i in range(n))
    for g, r in zip(jax.grad(loss, argnums=(0, 1, 2))(*stacked), jax.grad(loop_loss, argnums=(0, 1, 2))(*stacked)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=2e-5, rtol=1e-5)


def test_nested_vmap_with_mask_operands():
    q, k, v = _inputs()
    seqlens = jnp.array([10, 23], jnp.int32)
    qq = jnp.stack([jnp.stack([q * (i + j + 1) for j in range(2)]) for i in range(3)])
    f = lambda q_: jax_flash.attention(q_, k, v, kv_seqlens=seqlens, alibi_slopes=jnp.ones(4) * 0.2)
    out = jax.vmap(jax.vmap(f))(qq)
    for i in range(3):
        for j in range(2):
            np.testing.assert_allclose(np.asarray(out[i, j]), np.asarray(f(qq[i, j])), atol=1e-6)


def test_eval_shape_runs_nothing():
    q, k, v = (jax.ShapeDtypeStruct(x.shape, jnp.bfloat16) for x in _inputs())
    o, lse = jax.eval_shape(lambda *a: jax_flash.attention(*a, return_lse=True), q, k, v)
    assert o.shape == q.shape and o.dtype == jnp.bfloat16
    assert lse.shape == (2, 4, 19) and lse.dtype == jnp.float32


def test_export_for_cuda_from_cpu():
    """Lowering for the GPU works on a machine without one; the module calls our targets."""
    specs = [jax.ShapeDtypeStruct(x.shape, jnp.bfloat16) for x in _inputs()]
    loss = lambda q_, k_, v_: jnp.sum(jax_flash.attention(q_, k_, v_, causal=True).astype(jnp.float32))
    checks = [jax.export.DisabledSafetyCheck.custom_call(t)
              for t in (_registration.FORWARD_TARGET, _registration.BACKWARD_TARGET)]
    exported = jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), platforms=["cuda"],
                                 disabled_checks=checks)(*specs)
    text = exported.mlir_module()
    assert f"@{_registration.FORWARD_TARGET}" in text
    assert f"@{_registration.BACKWARD_TARGET}" in text
    assert exported.platforms == ("cuda",)


def _raw_forward(q, k, v, o_shape, lse_shape, masks=None, dense=None, workspace_shape=(0,), allow_tf32=False,
                 packed_heads=1, kv_chunks=1, dropout_rate=0.0):
    batch = q.shape[0]
    masks = masks or [jnp.zeros((batch, 0), jnp.float32)] + [jnp.zeros((batch, 0), jnp.int32)] * 4
    dense = dense or [jnp.zeros((1, 1, 1, 0), jnp.float32), jnp.zeros((1, 1, 1, 0), bool),
                      jnp.zeros((1, 1, 1, 0), jnp.uint8), jnp.zeros((batch, 0), jnp.uint32)]
    call = jax.ffi.ffi_call(_registration.FORWARD_TARGET,
                            (jax.ShapeDtypeStruct(o_shape, q.dtype), jax.ShapeDtypeStruct(lse_shape, jnp.float32),
                             jax.ShapeDtypeStruct(workspace_shape, jnp.float32)))
    o, lse, _ = call(q, k, v, *masks, *dense, softmax_scale=np.float32(1.0), softcap=np.float32(0.0), causal=False,
                     align_to_sequence_end=True, diagonal_offset=np.int64(0), window_left=np.int64(-1),
                     window_right=np.int64(-1), dropout_rate=np.float32(dropout_rate), allow_tf32=allow_tf32,
                     packed_heads=np.int64(packed_heads), kv_chunks=np.int64(kv_chunks))
    return o, lse


def test_raw_target_accepts_consistent_buffers():
    q, k, v = _inputs()
    o, lse = _raw_forward(q, k, v, q.shape, (2, 4, 19))
    np.testing.assert_allclose(np.asarray(o), np.asarray(jax_flash.attention(q, k, v, softmax_scale=1.0)),
                               atol=1e-6)


def test_raw_target_accepts_a_mask_with_its_block_summary():
    q, k, v = _inputs()
    mask = jax.random.bernoulli(jax.random.key(5), 0.5, (2, 1, 1, 23))
    dense = [jnp.zeros((1, 1, 1, 0), jnp.float32), mask, _mask_blocks.block_summary(mask),
             jnp.zeros((2, 0), jnp.uint32)]
    o, _ = _raw_forward(q, k, v, q.shape, (2, 4, 19), dense=dense)
    np.testing.assert_allclose(np.asarray(o), np.asarray(jax_flash.attention(q, k, v, softmax_scale=1.0, mask=mask)),
                               atol=1e-6)


# Each problem and what its error must name (the handler's message, not just its "jax_flash: " prefix).
RAW_BUFFER_PROBLEMS = {
    "o_shape": r"buffer `o` has shape \[2, 19, 4, 8\]", "lse_shape": r"buffer `lse` has shape \[2, 19, 4\]",
    "k_heads": r"heads_q \(4\) must be a positive multiple of heads_kv \(3\)",
    "v_shape": r"buffer `v` has shape \[2, 22, 2, 16\]", "mask_shape": r"buffer `alibi_slopes` has shape \[2, 3\]",
    "mask_dtype": r"buffer `q_seqlens` .* dtype float32; expected .* dtype int32",
    "bias_shape": r"buffer `bias` has shape \[2, 3, 19, 23\]",
    "bool_mask_dtype": r"buffer `mask` .* dtype int32; .* dtype bool",
    "seeds_shape": r"buffer `dropout_seeds` has shape \[2, 3\]",
    "mask_blocks_shape": r"buffer `mask_blocks` has shape \[2, 1, 1, 2\]",
    "mask_blocks_dtype": r"buffer `mask_blocks` .* dtype int32; .* dtype uint8",
    "mask_blocks_without_mask": r"buffer `mask_blocks` .*expected shape \[1, 1, 1, 0\]",
    "mask_without_blocks": r"buffer `mask_blocks` has shape \[1, 1, 1, 0\]",
    "tf32_vt_shape": r"buffer `tf32_vt` has shape \[2, 2, 1472\] .*expected shape \[2, 2, 1536\]",
    "tf32_vt_without_tf32": r"buffer `tf32_vt` .*expected shape \[2, 2, 5024\]",
}


@pytest.mark.parametrize("problem", list(RAW_BUFFER_PROBLEMS))
def test_raw_target_rejects_inconsistent_buffers(problem):
    """Calling the custom call directly with bad buffers is an error, never a crash or a bad write."""
    q, k, v = _inputs()
    o_shape, lse_shape, masks, dense = q.shape, (2, 4, 19), None, None
    absent_dense = [jnp.zeros((1, 1, 1, 0), jnp.float32), jnp.zeros((1, 1, 1, 0), bool),
                    jnp.zeros((1, 1, 1, 0), jnp.uint8), jnp.zeros((2, 0), jnp.uint32)]
    bool_mask = jnp.ones((2, 1, 19, 23), bool)
    workspace_shape, allow_tf32 = (0,), False
    if problem == "o_shape":
        o_shape = (2, 19, 4, 8)
    elif problem == "lse_shape":
        lse_shape = (2, 19, 4)
    elif problem == "k_heads":
        k = jnp.concatenate([k, k[:, :, :1]], axis=2)
        v = jnp.concatenate([v, v[:, :, :1]], axis=2)
    elif problem == "v_shape":
        v = v[:, :-1]
    elif problem == "mask_shape":
        masks = [jnp.zeros((2, 3), jnp.float32)] + [jnp.zeros((2, 0), jnp.int32)] * 4
    elif problem == "mask_dtype":
        masks = [jnp.zeros((2, 0), jnp.float32), jnp.zeros((2, 1), jnp.float32)] + [jnp.zeros((2, 0), jnp.int32)] * 3
    elif problem == "bias_shape":
        dense = [jnp.zeros((2, 3, 19, 23), jnp.float32)] + absent_dense[1:]
    elif problem == "bool_mask_dtype":
        dense = [absent_dense[0], jnp.ones((1, 1, 19, 23), jnp.int32), *absent_dense[2:]]
    elif problem == "seeds_shape":
        dense = absent_dense[:3] + [jnp.zeros((2, 3), jnp.uint32)]
    elif problem == "mask_blocks_shape":  # one block per 64 x 64: [2, 1, 1, 1] is right, one key block too many
        dense = [absent_dense[0], bool_mask, jnp.full((2, 1, 1, 2), 2, jnp.uint8), absent_dense[3]]
    elif problem == "mask_blocks_dtype":
        dense = [absent_dense[0], bool_mask, jnp.full((2, 1, 1, 1), 2, jnp.int32), absent_dense[3]]
    elif problem == "mask_blocks_without_mask":
        dense = [absent_dense[0], absent_dense[1], jnp.full((2, 1, 1, 1), 2, jnp.uint8), absent_dense[3]]
    elif problem == "mask_without_blocks":
        dense = [absent_dense[0], bool_mask, absent_dense[2], absent_dense[3]]
    elif problem == "tf32_vt_shape":  # V^T of 23 keys is 64 x 24 floats per KV head
        workspace_shape, allow_tf32 = (2, 2, 64 * 23), True
    elif problem == "tf32_vt_without_tf32":  # without allow_tf32 a workspace is the split-TF32 one: wrong size
        workspace_shape = (2, 2, 64 * 24)
    with pytest.raises(Exception, match=RAW_BUFFER_PROBLEMS[problem]):
        jax.block_until_ready(_raw_forward(q, k, v, o_shape, lse_shape, masks, dense, workspace_shape, allow_tf32))


@pytest.mark.parametrize("problem,match", [
    ("packed_heads_0", "packed_heads must be a power of two"), ("packed_heads_3", "packed_heads must be a power"),
    ("packed_heads_19_rows", "must divide seqlen_q"), ("kv_chunks_without_lengths", "needs kv_seqlens"),
    ("packed_heads_alibi", "alibi_slopes cannot"), ("packed_heads_query_mask", "mask that varies along the queries"),
    ("kv_chunks_0", "kv_chunks must be >= 1"), ("kv_chunks_batch", "must divide the batch"),
    ("kv_chunks_dropout", "dropout cannot be combined with kv_chunks")])
def test_raw_target_rejects_bad_row_layouts(problem, match):
    """GQA packing's packed_heads and split-KV's kv_chunks, re-checked by the handler against the buffers."""
    q, k, v = _inputs()
    kwargs, masks, dense = {}, None, None
    absent_masks = [jnp.zeros((2, 0), jnp.float32)] + [jnp.zeros((2, 0), jnp.int32)] * 4
    absent_dense = [jnp.zeros((1, 1, 1, 0), jnp.float32), jnp.zeros((1, 1, 1, 0), bool),
                    jnp.zeros((1, 1, 1, 0), jnp.uint8), jnp.zeros((2, 0), jnp.uint32)]
    if problem == "packed_heads_0":
        kwargs = dict(packed_heads=0)
    elif problem == "packed_heads_3":
        q = q[:, :18]
        kwargs = dict(packed_heads=3)
    elif problem == "kv_chunks_without_lengths":
        kwargs = dict(kv_chunks=2)
    elif problem == "packed_heads_19_rows":
        kwargs = dict(packed_heads=2)
    elif problem == "packed_heads_alibi":
        q = q[:, :18]
        kwargs, masks = dict(packed_heads=2), [jnp.ones((2, 4), jnp.float32)] + absent_masks[1:]
    elif problem == "packed_heads_query_mask":
        q = q[:, :18]
        mask = jnp.ones((2, 1, 18, 23), bool)
        kwargs = dict(packed_heads=2)
        dense = [absent_dense[0], mask, _mask_blocks.block_summary(mask), absent_dense[3]]
    elif problem == "kv_chunks_0":
        kwargs = dict(kv_chunks=0)
    elif problem == "kv_chunks_batch":
        kwargs, masks = dict(kv_chunks=3), absent_masks[:2] + [jnp.full((2, 1), 23, jnp.int32)] + absent_masks[3:]
    elif problem == "kv_chunks_dropout":
        kwargs, masks = dict(kv_chunks=2, dropout_rate=0.1), absent_masks[:2] + [jnp.full((2, 1), 23, jnp.int32)] + \
            absent_masks[3:]
        dense = absent_dense[:3] + [jnp.ones((2, 2), jnp.uint32)]
    with pytest.raises(Exception, match=match):
        jax.block_until_ready(_raw_forward(q, k, v, q.shape, (2, 4, q.shape[1]), masks, dense, **kwargs))


def test_raw_target_accepts_the_tf32_workspace():
    """A float32 call with allow_tf32 may pass V^T's workspace (used by the Hopper TF32 forward, ignored elsewhere)."""
    q, k, v = _inputs()
    assert _ffi_calls.tf32_workspace_shape(q, k) == (2, 2, 64 * 24)
    o, lse = _raw_forward(q, k, v, q.shape, (2, 4, 19), workspace_shape=(2, 2, 64 * 24), allow_tf32=True)
    o_plain, lse_plain = _raw_forward(q, k, v, q.shape, (2, 4, 19))
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o_plain))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse_plain))


def test_raw_target_accepts_the_split_tf32_workspace_and_checks_its_size():
    """A float32 call with float32_precision="highest" may pass the split-TF32 workspace (the Hopper split-TF32
    forward's; ignored elsewhere): V^T's, Q's and K's hi and lo parts, so per (batch row, KV head) twice
    64 * 24 + 2 * 19 * 16 + 23 * 16 floats. A workspace of any other size is refused, naming it."""
    q, k, v = _inputs()
    per_head = 2 * (64 * 24 + 2 * 19 * 16 + 23 * 16)
    assert _ffi_calls.split_tf32_workspace_shape(q, k) == (2, 2, per_head)
    o, lse = _raw_forward(q, k, v, q.shape, (2, 4, 19), workspace_shape=(2, 2, per_head))
    o_plain, lse_plain = _raw_forward(q, k, v, q.shape, (2, 4, 19))
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o_plain))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse_plain))
    with pytest.raises(Exception, match="tf32_vt"):
        jax.block_until_ready(_raw_forward(q, k, v, q.shape, (2, 4, 19), workspace_shape=(2, 2, 64 * 24)))


@pytest.mark.parametrize("setting, expected", [("1", "split"), ("0", "none"), ("", "none"), ("hopper", "split"),
                                              ("hopper-cpu", "none")])
def test_split_tf32_switch_decides_the_workspace(monkeypatch, setting, expected):
    """JAX_FLASH_SM90_SPLIT_TF32=1 gives float32 "highest" calls of the common form the split-TF32 workspace (its
    shape is in the lowered call); 0, none; unset, the workspace in calls lowered for CUDA where every GPU is a
    Hopper ("hopper"; not in those lowered for its CPU) and none elsewhere. Either way the CPU result is the same
    exact float32."""
    q, k, v = _inputs()
    platforms = set_path_switch(monkeypatch, _ffi_calls.SPLIT_TF32_ENV, setting)
    call = lambda q_, k_, v_: jax_flash.attention(q_, k_, v_, causal=True, float32_precision="highest")
    text = jax.jit(call).trace(q, k, v).lower(lowering_platforms=platforms).as_text()
    split_type = "tensor<2x2x{}xf32>".format(_ffi_calls.split_tf32_workspace_shape(q, k)[-1])
    assert (split_type in text) == (expected == "split")
    o = call(q, k, v)
    monkeypatch.delenv(_ffi_calls.SPLIT_TF32_ENV)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(call(q, k, v)))


@pytest.mark.parametrize("precision", ["tf32", "highest"])
@pytest.mark.parametrize("head_dim", [72, 128])
def test_cpu_calls_on_a_hopper_machine_stay_exact(monkeypatch, precision, head_dim):
    """A process whose GPUs are all Hoppers defaults the float32 paths on, but only for calls lowered for CUDA
    (``_config.per_platform``): on its CPU, outputs and gradients are the CPU reference's, bit for bit. Head dims
    where both scaled backwards apply (float16 operands in the TF32 mode round the inputs; the float16 parts'
    scaling in "highest" changes the CPU's roundings); the split-TF32 workspaces alone would leave the CPU's results
    as they are."""
    cpu = jax.devices("cpu")[0]  # the CPU's lowering, also in a run with JAX_FLASH_TEST_PLATFORM=gpu
    case = Case(seqlen_q=33, seqlen_k=40, head_dim=head_dim, seed=head_dim)
    q, k, v = (jax.device_put(x, cpu) for x in case.inputs())

    def results():
        def loss(q_, k_, v_):
            o = jax_flash.attention(q_, k_, v_, causal=True, float32_precision=precision)
            return jnp.sum(o * jnp.cos(o)), o
        grads, o = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
        return [np.asarray(x) for x in (o, *grads)]

    for variable in _ffi_calls.HOPPER_PATH_SWITCHES:
        set_path_switch(monkeypatch, variable, "hopper-cpu")
    on_hopper = results()
    for variable in _ffi_calls.HOPPER_PATH_SWITCHES:
        set_path_switch(monkeypatch, variable, "")
    for got, want in zip(on_hopper, results()):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("forms, kwargs, expected", [
    ("", dict(softcap=5.0), True),
    ("0", dict(softcap=5.0), False),  # JAX_FLASH_TF32_FORMS=0: the common form only, as for the TF32 forward
    ("0", dict(causal=True), True),
    ("", dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)), False),  # dropout: the float32 kernels only
])
def test_split_tf32_workspace_by_form(monkeypatch, forms, kwargs, expected):
    q, k, v = _inputs()
    monkeypatch.setenv(_ffi_calls.SPLIT_TF32_ENV, "1")
    monkeypatch.setenv(_ffi_calls.TF32_FORMS_ENV, forms)
    text = jax.jit(lambda *a: jax_flash.attention(*a, float32_precision="highest", **kwargs)).lower(q, k, v).as_text()
    workspace = "tensor<2x2x{}xf32>".format(_ffi_calls.split_tf32_workspace_shape(q, k)[-1])
    assert (workspace in text) == expected


BAD_ARGUMENTS = [
    (dict(q=jnp.zeros((2, 3, 4))), ValueError, "q must have rank 4"),
    (dict(k=jnp.zeros((2, 23, 2, 16), jnp.bfloat16)), TypeError, "q, k and v must share one dtype"),
    (dict(q=jnp.zeros((2, 19, 4, 16), jnp.int32)), TypeError, "q must be float32"),
    (dict(k=jnp.zeros((2, 23, 2, 8)), v=jnp.zeros((2, 23, 2, 8))), ValueError, "q and k must have the same head_dim"),
    (dict(k=jnp.zeros((2, 23, 3, 16)), v=jnp.zeros((2, 23, 3, 16))), ValueError, r"query heads \(4, q.shape\[2\]\) must be a positive multiple"),
    (dict(v=jnp.zeros((2, 22, 2, 16))), ValueError, "k and v must have the same shape"),
    (dict(window_size=(-2, 3)), ValueError, "window_size"),
    (dict(window_size=5), TypeError, "window_size"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(softcap=float("nan")), ValueError, "softcap"),
    (dict(softmax_scale=float("inf")), ValueError, "softmax_scale"),
    (dict(causal=1), TypeError, "causal"),
    (dict(q_seqlens=jnp.zeros((3,), jnp.int32)), ValueError, "q_seqlens"),
    (dict(kv_seqlens=jnp.zeros((2,), jnp.float32)), TypeError, "kv_seqlens"),
    (dict(q_segment_ids=jnp.zeros((2, 19), jnp.int32)), ValueError, "segment_ids"),
    (dict(q_segment_ids=jnp.zeros((2, 18), jnp.int32), kv_segment_ids=jnp.zeros((2, 23), jnp.int32)),
     ValueError, "q_segment_ids"),
    (dict(alibi_slopes=jnp.zeros((3,))), ValueError, "alibi_slopes"),
    (dict(alibi_slopes=jnp.zeros((4,), jnp.int32)), TypeError, "alibi_slopes"),
    (dict(dropout_rate=1.5), ValueError, "dropout_rate"),
    (dict(dropout_rate=0.1), ValueError, "dropout_rng"),
    (dict(implementation="triton"), ValueError, "implementation"),
    (dict(float32_precision="fast"), ValueError, "float32_precision"),
    (dict(float32_precision=None), ValueError, "float32_precision"),
    (dict(float32_precision=32), ValueError, "float32_precision"),
]


@pytest.mark.parametrize("overrides, error, message", BAD_ARGUMENTS, ids=[m for _, _, m in BAD_ARGUMENTS])
def test_bad_arguments_raise_at_trace_time(overrides, error, message):
    q, k, v = _inputs()
    args = {"q": q, "k": k, "v": v}
    kwargs = dict(overrides)
    for name in ("q", "k", "v"):
        if name in kwargs:
            args[name] = kwargs.pop(name)
    with pytest.raises(error, match=message):
        jax.eval_shape(lambda: jax_flash.attention(args["q"], args["k"], args["v"], **kwargs))


def test_traced_scale_is_rejected():
    q, k, v = _inputs()
    with pytest.raises(TypeError, match="softmax_scale"):
        jax.jit(lambda s: jax_flash.attention(q, k, v, softmax_scale=s))(0.5)


def test_empty_batch_with_bias_gradient():
    q = k = v = jnp.zeros((0, 8, 2, 16), jnp.float32)
    bias = jnp.ones((1, 1, 8, 8), jnp.float32)
    dbias = jax.grad(lambda b: jax_flash.attention(q, k, v, bias=b).sum())(bias)
    assert dbias.shape == bias.shape and np.all(np.asarray(dbias) == 0)


def test_windows_past_every_sequence_are_unbounded():
    q, k, v = _inputs(seqlen_q=8, seqlen_k=4)
    huge = 2 ** 63 - 1
    for window in ((2, huge), (huge, -1), (huge, huge)):
        expected = tuple(-1 if side == huge else side for side in window)
        np.testing.assert_array_equal(np.asarray(jax_flash.attention(q, k, v, window_size=window)),
                                      np.asarray(jax_flash.attention(q, k, v, window_size=expected)))


def test_raw_target_rejects_overflowing_diagonal():
    q, k, v = _inputs()
    call = jax.ffi.ffi_call(_registration.FORWARD_TARGET,
                            (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((2, 4, 19), jnp.float32),
                             jax.ShapeDtypeStruct((0,), jnp.float32)))
    masks = [jnp.zeros((2, 0), jnp.float32)] + [jnp.zeros((2, 0), jnp.int32)] * 4
    dense = [jnp.zeros((1, 1, 1, 0), jnp.float32), jnp.zeros((1, 1, 1, 0), bool), jnp.zeros((1, 1, 1, 0), jnp.uint8),
             jnp.zeros((2, 0), jnp.uint32)]
    with pytest.raises(Exception, match="2\\^40"):
        jax.block_until_ready(call(q, k, v, *masks, *dense, softmax_scale=np.float32(1.0), softcap=np.float32(0.0),
                                   causal=False, align_to_sequence_end=True, diagonal_offset=np.int64(2 ** 62),
                                   window_left=np.int64(2 ** 62), window_right=np.int64(2 ** 62),
                                   dropout_rate=np.float32(0.0), allow_tf32=False, packed_heads=np.int64(1),
                                   kv_chunks=np.int64(1)))


def test_wide_integer_lengths_and_ids_under_x64():
    """int64 lengths beyond the sequence clip (never wrap); int64 segment ids are refused, not truncated."""
    q, k, v = _inputs(seqlen_q=2, seqlen_k=2)
    with jax.enable_x64(True):
        long_lengths = jnp.array([2 ** 32 + 1, 2 ** 32 + 1], jnp.int64)
        np.testing.assert_array_equal(np.asarray(jax_flash.attention(q, k, v, q_seqlens=long_lengths)),
                                      np.asarray(jax_flash.attention(q, k, v)))
        ids = jnp.array([[0, 2 ** 32]] * 2, jnp.int64)
        with pytest.raises(TypeError, match="32-bit"):
            jax_flash.attention(q, k, v, q_segment_ids=ids, kv_segment_ids=jnp.zeros((2, 2), jnp.int64))


def test_dropout_rate_that_rounds_to_one_in_float32_is_refused():
    q, k, v = _inputs()
    with pytest.raises(ValueError, match="dropout_rate"):
        jax_flash.attention(q, k, v, dropout_rate=0.99999999, dropout_rng=jax.random.key(0))


@pytest.mark.parametrize("precision, allow_tf32", [
    ("tf32", True), ("highest", False), ("HIGHEST", False), (jax.lax.Precision.DEFAULT, True),
    (jax.lax.Precision.HIGH, True), ("tensorfloat32", True), (jax.lax.Precision.HIGHEST, False), ("float32", False)])
def test_float32_precision_reaches_the_custom_call(precision, allow_tf32):
    q, k, v = _inputs()
    text = jax.jit(lambda *a: jax_flash.attention(*a, float32_precision=precision)).lower(q, k, v).as_text()
    assert f"allow_tf32 = {str(allow_tf32).lower()}" in text


def test_float32_precision_defaults_to_tf32_and_cpu_is_exact_in_both_modes():
    q, k, v = _inputs()
    text = jax.jit(jax_flash.attention).lower(q, k, v).as_text()
    assert "allow_tf32 = true" in text
    np.testing.assert_array_equal(np.asarray(jax_flash.attention(q, k, v, float32_precision="tf32")),
                                  np.asarray(jax_flash.attention(q, k, v, float32_precision="highest")))


def _forward_workspaces(q, k, v, **kwargs) -> list[tuple[int, ...]]:
    """The shape of the workspace result (tf32_vt) of every forward custom call of jax_flash.attention."""
    return [tuple(eqn.outvars[2].aval.shape) for eqn in forward_calls(q, k, v, **kwargs)]


def test_which_forward_calls_get_the_tf32_workspace(monkeypatch):
    """V^T's workspace goes to float32 TF32 calls the Hopper TF32 forward can run (its common form, and softcap,
    ALiBi, bias and mask unless JAX_FLASH_TF32_FORMS=0), never to others."""
    monkeypatch.delenv(_ffi_calls.TF32_FORMS_ENV, raising=False)
    q, k, v = _inputs(dtype=jnp.float32, head_dim=40)
    full = [(2, 2, 64 * 24)]
    mask = jnp.ones((2, 1, 19, 23), bool)
    assert _forward_workspaces(q, k, v) == full
    assert _forward_workspaces(q, k, v, causal=True, window_size=(3, 2)) == full
    assert _forward_workspaces(q, k, v, softcap=2.0) == full
    assert _forward_workspaces(q, k, v, mask=mask) == full
    assert _forward_workspaces(q, k, v, float32_precision="highest") == [(0,)]
    assert _forward_workspaces(q, k, v, dropout_rate=0.1, dropout_rng=jax.random.key(0)) == [(0,)]
    assert _forward_workspaces(*_inputs(dtype=jnp.bfloat16, head_dim=40)) == [(0,)]
    assert _forward_workspaces(*_inputs(dtype=jnp.float32, head_dim=130)) == [(0,)]
    assert _forward_workspaces(*_inputs(dtype=jnp.float32, head_dim=6)) == [(0,)]  # TMA rows: head_dim % 4
    assert _forward_workspaces(*_inputs(dtype=jnp.float32, head_dim=100)) == [(2, 2, 128 * 24)]
    monkeypatch.setenv(_ffi_calls.TF32_FORMS_ENV, "0")
    assert _forward_workspaces(q, k, v) == full
    assert _forward_workspaces(q, k, v, softcap=2.0) == [(0,)]
    assert _forward_workspaces(q, k, v, mask=mask) == [(0,)]
    monkeypatch.setenv(_ffi_calls.TF32_FORMS_ENV, "yes")
    with pytest.raises(ValueError, match=_ffi_calls.TF32_FORMS_ENV):
        _forward_workspaces(q, k, v, softcap=2.0)


@pytest.mark.parametrize("function, flag", [(jax_flash.attention, "return_lse"),
                                            (jax_flash.ring_attention, "return_lse"),
                                            (jax_flash.dot_product_attention, "return_residual")])
def test_return_type_follows_the_flag_for_type_checkers(function, flag):
    # The package ships py.typed: without overloads a type checker sees `Array | tuple` for every call and
    # rejects `attention(q, k, v).shape` in user code.
    overloads = typing.get_overloads(function)
    returns = {typing.get_type_hints(o)[flag]: typing.get_type_hints(o)["return"] for o in overloads}
    assert returns[typing.Literal[False]] is jax.Array
    assert returns[typing.Literal[True]] == tuple[jax.Array, jax.Array]
    assert returns[bool] == jax.Array | tuple[jax.Array, jax.Array]
