"""float32_precision="highest" with JAX_FLASH_SM90_SPLIT_TF32_BACKWARD=1: the backward call carries the split-TF32
workspace in its dq_accum slot (csrc/common/tf32_workspace.h backward_parts_per_head), sized from the operands
the call really passes (GQA groups, vmapped batches), only for the common form the Hopper TF32 backward passes
have, and the gradients stay within the exact mode's bound of the same call without the switch. On the CPU (CI)
the handler checks the workspace's size and ignores it, so the two runs agree exactly; on a Hopper GPU
(JAX_FLASH_TEST_PLATFORM=gpu) the first runs the split-TF32 passes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import _ffi_calls, _registration
from jax_flash._config import ScoreConfig
from attention_cases import Case, feature_kwargs

EXACT_FLOAT32_RTOL = 1e-5


@pytest.fixture(autouse=True)
def automatic_choices(monkeypatch):
    monkeypatch.delenv("JAX_FLASH_CUDA_KERNEL_F32_BACKWARD", raising=False)  # the exact runs must not be forced
    for name in (_ffi_calls.SPLIT_TF32_ENV, _ffi_calls.FLOAT16_PARTS_BACKWARD_ENV):
        monkeypatch.setenv(name, "0")  # float16 parts, on by default on a Hopper GPU, would take d=128 calls


def _grads_call(**kwargs):
    """A new jitted gradient function (jit's trace cache does not know the switch, read when traced)."""
    def loss(q, k, v, d_o):
        out = jax_flash.attention(q, k, v, float32_precision="highest", **kwargs)
        return jnp.sum(out * d_o)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def _backward_line(call, *args):
    text = call.lower(*args).as_text()
    (line,) = [line for line in text.splitlines() if f"@{_registration.BACKWARD_TARGET}" in line]
    return line


def _workspace_type(q, k):
    return "tensor<{}x{}x{}xf32>".format(*_ffi_calls.backward_parts_workspace_shape(q, k))


def _assert_within_exact_bound(split, exact):
    for name, a, b in zip(("dq", "dk", "dv"), split, exact):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.all(np.isfinite(a)), name
        scale = max(float(np.max(np.abs(b))), 1e-30)
        error = float(np.max(np.abs(a - b))) / scale
        assert error <= 2 * EXACT_FLOAT32_RTOL, f"{name}: {error:.2e}"


# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, feature)
SHAPES = (
    (2, 129, 200, 4, 2, 64, "causal"),
    (1, 1, 300, 8, 2, 64, "none"),          # one query row
    (2, 17, 33, 4, 4, 36, "none"),          # head dim below the kernel's 64
    (2, 70, 90, 4, 4, 128, "window"),
    (2, 50, 77, 4, 2, 100, "seqlens"),
    (2, 60, 60, 2, 2, 64, "segments"),
    (1, 300, 257, 8, 1, 128, "causal"),     # MQA
)


@pytest.mark.parametrize("batch,seqlen_q,seqlen_k,heads_q,heads_kv,head_dim,feature", SHAPES)
def test_split_backward_switch_keeps_the_exact_gradients(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim,
                                                         feature, monkeypatch):
    case = Case(batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, heads_q=heads_q, heads_kv=heads_kv,
                head_dim=head_dim, dtype=jnp.float32, seed=seqlen_k + head_dim)
    q, k, v = case.inputs()
    d_o = jax.random.normal(jax.random.key(7), q.shape, jnp.float32)
    kwargs = feature_kwargs(feature, case)
    monkeypatch.setenv(_ffi_calls.SPLIT_TF32_BACKWARD_ENV, "1")
    call = _grads_call(**kwargs)
    assert _workspace_type(q, k) in _backward_line(call, q, k, v, d_o), "the switch gave the call no workspace"
    split = call(q, k, v, d_o)
    monkeypatch.setenv(_ffi_calls.SPLIT_TF32_BACKWARD_ENV, "0")
    call = _grads_call(**kwargs)
    assert _workspace_type(q, k) not in _backward_line(call, q, k, v, d_o)
    _assert_within_exact_bound(split, call(q, k, v, d_o))


def test_split_backward_switch_under_vmap(monkeypatch):
    """A vmapped gradient: the call folds the vmapped axis into the batch, and its workspace with it (the handler
    checks the size)."""
    case = Case(batch=2, seqlen_q=33, seqlen_k=47, heads_q=4, heads_kv=2, head_dim=64, dtype=jnp.float32)
    q, k, v = (jnp.stack([x, 2 * x]) for x in case.inputs())
    d_o = jax.random.normal(jax.random.key(3), q.shape, jnp.float32)

    def new_call():
        loss = lambda q_, k_, v_, g_: jnp.sum(jax_flash.attention(q_, k_, v_, causal=True,
                                                                  float32_precision="highest") * g_)
        return jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2))))

    monkeypatch.setenv(_ffi_calls.SPLIT_TF32_BACKWARD_ENV, "1")
    folded = [x.reshape(-1, *x.shape[2:]) for x in (q, k)]  # the vmapped axis folded into the batch
    assert _workspace_type(*folded) in _backward_line(new_call(), q, k, v, d_o)
    split = new_call()(q, k, v, d_o)
    monkeypatch.setenv(_ffi_calls.SPLIT_TF32_BACKWARD_ENV, "0")
    _assert_within_exact_bound(split, new_call()(q, k, v, d_o))


@pytest.mark.parametrize("kwargs, expected", [
    (dict(causal=True), True),
    (dict(softcap=5.0), False),  # the Hopper TF32 backward passes have the common form only
    (dict(alibi_slopes=jnp.full((4,), 0.1, jnp.float32)), False),
    (dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)), False),
    (dict(float32_precision="tensorfloat32"), False),  # TF32 runs the TF32 passes, no parts
])
def test_split_backward_workspace_by_form(monkeypatch, kwargs, expected):
    case = Case(batch=2, seqlen_q=19, seqlen_k=23, heads_q=4, heads_kv=2, head_dim=64, dtype=jnp.float32)
    q, k, v = case.inputs()
    monkeypatch.setenv(_ffi_calls.SPLIT_TF32_BACKWARD_ENV, "1")
    precision = kwargs.pop("float32_precision", "highest")
    loss = lambda q_: jnp.sum(jax_flash.attention(q_, k, v, float32_precision=precision, **kwargs))
    text = jax.jit(jax.grad(loss)).lower(q).as_text()
    assert (_workspace_type(q, k) in text) == expected


def test_split_backward_switch_rejects_other_values(monkeypatch):
    q, k, v = Case(dtype=jnp.float32, head_dim=64).inputs()
    monkeypatch.setenv(_ffi_calls.SPLIT_TF32_BACKWARD_ENV, "yes")
    loss = lambda q_: jnp.sum(jax_flash.attention(q_, k, v, float32_precision="highest"))
    with pytest.raises(ValueError, match="JAX_FLASH_SM90_SPLIT_TF32_BACKWARD must be 0 or 1"):
        jax.grad(loss)(q)


@pytest.mark.parametrize("parts_type", (jnp.float32, jnp.float16))
def test_raw_backward_checks_the_split_workspace(parts_type):
    """A float32 call's dq_accum is a parts workspace, of split TF32 (float32) or float16 parts (float16): per
    (batch row, KV head) four times G * Sq * D + Sk * D elements. The handler accepts exactly that (ignored on the
    CPU, run by the split or float16-parts passes on a GPU), refuses any other size naming the buffer, and refuses
    it on a TF32 call."""
    case = Case(batch=2, seqlen_q=19, seqlen_k=23, heads_q=4, heads_kv=2, head_dim=16, dtype=jnp.float32)
    q, k, v = case.inputs()
    masks = [jnp.zeros((2, 0), jnp.float32)] + [jnp.zeros((2, 0), jnp.int32)] * 4
    dense = [jnp.zeros((1, 1, 1, 0), jnp.float32), jnp.zeros((1, 1, 1, 0), bool), jnp.zeros((1, 1, 1, 0), jnp.uint8),
             jnp.zeros((2, 0), jnp.uint32)]
    stats = jax.ShapeDtypeStruct((2, 4, 19), jnp.float32)

    def run(workspace_shape, allow_tf32=False):
        config = ScoreConfig(softmax_scale=0.25, allow_tf32=allow_tf32)
        o, lse, _ = jax.ffi.ffi_call(_registration.FORWARD_TARGET, (
            jax.ShapeDtypeStruct(q.shape, q.dtype), stats, jax.ShapeDtypeStruct((0,), jnp.float32)))(
            q, k, v, *masks, *dense, **_ffi_calls._forward_attributes(config))
        call = jax.ffi.ffi_call(_registration.BACKWARD_TARGET, (
            jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
            jax.ShapeDtypeStruct(v.shape, v.dtype), stats, jax.ShapeDtypeStruct(workspace_shape, parts_type),
            jax.ShapeDtypeStruct((0,), jnp.float32), jax.ShapeDtypeStruct((1, 1, 1, 0), jnp.float32)))
        return jax.block_until_ready(call(q, k, v, o, lse, jnp.ones_like(q), jnp.zeros_like(lse), *masks, *dense,
                                          **_ffi_calls._score_attributes(config), deterministic=False))[:3]

    per_head = 4 * (2 * 19 * 16 + 23 * 16)
    assert _ffi_calls.backward_parts_workspace_shape(q, k) == (2, 2, per_head)
    split, plain = run((2, 2, per_head)), run((0,))
    if q.devices().pop().platform == "cpu":  # the CPU handler ignores the workspace
        for got, want in zip(split, plain):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    else:  # a GPU runs the split-TF32 (float16-parts) passes with it: within the exact bound
        _assert_within_exact_bound(split, plain)
    with pytest.raises(Exception, match="dq_accum"):
        run((2, 2, per_head + 4))
    with pytest.raises(Exception, match="parts workspace: only without allow_tf32"):
        run((2, 2, per_head), allow_tf32=True)
