"""jax_flash's Flax layers against Flax's own, with the same parameters."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen, nnx

from jax_flash import flax_layers

# f32 kernels and XLA differ only in summation order.
F32_TOL = 2e-5
# bf16 layers: inputs, projections and attention all round to 8 mantissa bits.
BF16_TOL = 5e-2

HAS_NUM_KV_HEADS = "num_kv_heads" in inspect.signature(nnx.MultiHeadAttention.__init__).parameters
HAS_IS_CAUSAL = "is_causal" in inspect.signature(nnx.MultiHeadAttention.__call__).parameters


@dataclasses.dataclass(frozen=True)
class Case:
    """One layer configuration; ``kv_*`` = None means self-attention."""

    name: str
    num_heads: int = 2
    num_kv_heads: int | None = None
    q_len: int = 8
    kv_len: int | None = None
    in_kv_features: int | None = None
    batch_shape: tuple[int, ...] = (2,)
    is_causal: bool = False
    features: int = 24
    qkv_features: int = 32


CASES = [
    Case("self"),
    Case("cross", q_len=6, kv_len=11, in_kv_features=20),
    Case("causal", is_causal=True),
    Case("two_batch_axes", batch_shape=(2, 3), q_len=5),
    Case("gqa", num_heads=4, num_kv_heads=2),
    Case("causal_gqa_cross", num_heads=4, num_kv_heads=1, q_len=9, kv_len=6,
         in_kv_features=20, is_causal=True),
]
LINEN_CASES = [c for c in CASES if c.num_kv_heads is None]


def _inputs(case: Case, dtype: Any = jnp.float32) -> tuple[jax.Array, jax.Array]:
    """Query-side ``[batch..., q_len, features]`` and key/value-side inputs."""
    key_q, key_kv = jax.random.split(jax.random.key(42))
    x_q = jax.random.normal(key_q, (*case.batch_shape, case.q_len, case.features), dtype)
    if case.kv_len is None:
        return x_q, x_q
    x_kv_shape = (*case.batch_shape, case.kv_len, case.in_kv_features or case.features)
    return x_q, jax.random.normal(key_kv, x_kv_shape, dtype)


def _cotangent(case: Case) -> jax.Array:
    return jax.random.normal(jax.random.key(7), (*case.batch_shape, case.q_len, case.features))


def _assert_trees_close(ours: Any, theirs: Any, tol: float) -> None:
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)
    for ours_leaf, theirs_leaf in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
        np.testing.assert_allclose(
            np.asarray(ours_leaf, np.float32), np.asarray(theirs_leaf, np.float32),
            rtol=tol, atol=tol,
        )


def _output_and_grads(apply: Callable[..., jax.Array], params: Any, x_q, x_kv, cotangent, use_jit):
    """Output and its vector-Jacobian product with respect to ``params`` and both inputs."""

    def output_and_grads(params, x_q, x_kv):
        out, vjp = jax.vjp(apply, params, x_q, x_kv)
        return out, vjp(cotangent.astype(out.dtype))

    return (jax.jit(output_and_grads) if use_jit else output_and_grads)(params, x_q, x_kv)


# --- linen -----------------------------------------------------------------


def _linen_layers(case: Case, **kwargs: Any):
    """Our linen layer and Flax's, configured alike; causal is bound into ours."""
    ours_fn = functools.partial(flax_layers.dot_product_attention, is_causal=case.is_causal)
    common = dict(num_heads=case.num_heads, qkv_features=case.qkv_features, **kwargs)
    return (
        flax_layers.linen.MultiHeadDotProductAttention(attention_fn=ours_fn, **common),
        linen.MultiHeadDotProductAttention(**common),
    )


def _linen_apply(layer: linen.Module, case: Case, theirs: bool) -> Callable[..., jax.Array]:
    def apply(params, x_q, x_kv):
        mask = None
        if case.is_causal and theirs:
            mask = jnp.tril(jnp.ones((case.q_len, case.kv_len or case.q_len), jnp.bool_))
        return layer.apply({"params": params}, x_q, x_kv, mask=mask)

    return apply


@pytest.mark.parametrize(
    "case, use_jit",
    [(c, True) for c in LINEN_CASES] + [(LINEN_CASES[1], False)],
    ids=lambda x: x.name if isinstance(x, Case) else ("jit" if x else "eager"),
)
def test_linen_matches_flax(case, use_jit):
    ours, theirs = _linen_layers(case)
    x_q, x_kv = _inputs(case)
    params = theirs.init(jax.random.key(0), x_q, x_kv)["params"]
    cotangent = _cotangent(case)
    our_out, our_grads = _output_and_grads(_linen_apply(ours, case, False), params, x_q, x_kv, cotangent, use_jit)
    their_out, their_grads = _output_and_grads(
        _linen_apply(theirs, case, True), params, x_q, x_kv, cotangent, use_jit=True
    )
    _assert_trees_close(our_out, their_out, F32_TOL)
    _assert_trees_close(our_grads, their_grads, F32_TOL)


def test_linen_param_tree_is_flax():
    case = CASES[1]
    ours, theirs = _linen_layers(case)
    x_q, x_kv = _inputs(case)
    _assert_trees_close(
        ours.init(jax.random.key(0), x_q, x_kv), theirs.init(jax.random.key(0), x_q, x_kv), 0.0
    )


def test_linen_fields_are_flax():
    for ours, theirs in [
        (flax_layers.linen.MultiHeadDotProductAttention, linen.MultiHeadDotProductAttention),
        (flax_layers.linen.MultiHeadAttention, linen.MultiHeadAttention),
    ]:
        our_fields = [(f.name, f.default) for f in dataclasses.fields(ours) if f.name != "attention_fn"]
        assert our_fields == [(f.name, f.default) for f in dataclasses.fields(theirs) if f.name != "attention_fn"]
        assert ours.attention_fn is flax_layers.dot_product_attention


def test_linen_alias_keeps_flax_naming():
    class Block(linen.Module):
        layer_cls: type

        @linen.compact
        def __call__(self, x):
            return self.layer_cls(num_heads=2)(x)

    x = jnp.ones((1, 4, 8))
    ours = Block(flax_layers.linen.MultiHeadAttention).init(jax.random.key(0), x)
    theirs = Block(linen.MultiHeadAttention).init(jax.random.key(0), x)
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)


def test_linen_bf16_matches_flax():
    case = CASES[2]
    ours, theirs = _linen_layers(case, dtype=jnp.bfloat16)
    x_q, x_kv = _inputs(case, jnp.bfloat16)
    params = theirs.init(jax.random.key(0), x_q, x_kv)["params"]
    our_out = jax.jit(_linen_apply(ours, case, False))(params, x_q, x_kv)
    assert our_out.dtype == jnp.bfloat16
    _assert_trees_close(our_out, jax.jit(_linen_apply(theirs, case, True))(params, x_q, x_kv), BF16_TOL)


def test_linen_deterministic_dropout_matches_flax():
    case = CASES[0]
    ours, theirs = _linen_layers(case, dropout_rate=0.2)
    x_q, _ = _inputs(case)
    variables = theirs.init(jax.random.key(0), x_q, deterministic=True)
    _assert_trees_close(
        ours.apply(variables, x_q, deterministic=True),
        theirs.apply(variables, x_q, deterministic=True),
        F32_TOL,
    )


def test_linen_sow_weights_raises():
    layer = flax_layers.linen.MultiHeadDotProductAttention(num_heads=2)
    with pytest.raises(NotImplementedError, match="sow_weights"):
        layer.init(jax.random.key(0), jnp.ones((2, 8, 16)), sow_weights=True)


def test_linen_mask_and_dropout():
    """An explicit padding mask matches Flax's layer; dropout runs and is reproducible for one key."""
    ours = flax_layers.linen.MultiHeadDotProductAttention(num_heads=2, dropout_rate=0.2)
    theirs = linen.MultiHeadDotProductAttention(num_heads=2, dropout_rate=0.2)
    x = jax.random.normal(jax.random.key(2), (2, 8, 16))
    mask = (jnp.arange(8) < jnp.array([5, 8])[:, None])[:, None, None, :]
    variables = ours.init(jax.random.key(0), x, deterministic=True)
    _assert_trees_close(ours.apply(variables, x, mask=mask, deterministic=True),
                        theirs.apply(variables, x, mask=mask, deterministic=True), F32_TOL)
    rngs = {"dropout": jax.random.key(1)}
    dropped = ours.apply(variables, x, mask=mask, deterministic=False, rngs=rngs)
    np.testing.assert_array_equal(dropped, ours.apply(variables, x, mask=mask, deterministic=False, rngs=rngs))
    assert not np.allclose(dropped, ours.apply(variables, x, mask=mask, deterministic=True))


def test_linen_decode_matches_flax():
    """Autoregressive decoding: Flax builds a cache mask, which now goes to the kernels."""
    ours = flax_layers.linen.MultiHeadDotProductAttention(num_heads=2, decode=True)
    theirs = linen.MultiHeadDotProductAttention(num_heads=2, decode=True)
    variables = ours.init(jax.random.key(0), jnp.ones((2, 8, 16)))
    steps = jax.random.normal(jax.random.key(3), (3, 2, 1, 16))
    cache_ours = cache_theirs = variables["cache"]
    for step in steps:
        out_ours, updated = ours.apply({"params": variables["params"], "cache": cache_ours}, step, mutable=["cache"])
        cache_ours = updated["cache"]
        out_theirs, updated = theirs.apply({"params": variables["params"], "cache": cache_theirs}, step,
                                           mutable=["cache"])
        cache_theirs = updated["cache"]
        _assert_trees_close(out_ours, out_theirs, F32_TOL)


# --- nnx -------------------------------------------------------------------


def _nnx_kwargs(case: Case, **kwargs: Any) -> dict[str, Any]:
    kwargs = dict(
        num_heads=case.num_heads,
        in_features=case.features,
        qkv_features=case.qkv_features,
        in_kv_features=case.in_kv_features,
        decode=False,
        rngs=nnx.Rngs(0),
        **kwargs,
    )
    if case.num_kv_heads is not None:
        kwargs["num_kv_heads"] = case.num_kv_heads
    return kwargs


def _nnx_call_kwargs(case: Case) -> dict[str, bool]:
    # Older Flax's nnx layer has no is_causal call argument; NNX_CASES skips
    # the causal cases there.
    return {"is_causal": True} if case.is_causal else {}


def _nnx_apply(graphdef: nnx.GraphDef, case: Case) -> Callable[..., jax.Array]:
    def apply(state, x_q, x_kv):
        return nnx.merge(graphdef, state)(x_q, x_kv, **_nnx_call_kwargs(case))

    return apply


NNX_CASES = [
    c for c in CASES if (HAS_NUM_KV_HEADS or c.num_kv_heads is None) and (HAS_IS_CAUSAL or not c.is_causal)
]


@pytest.mark.parametrize(
    "case, use_jit",
    [(c, True) for c in NNX_CASES] + [(NNX_CASES[-1], False)],
    ids=lambda x: x.name if isinstance(x, Case) else ("jit" if x else "eager"),
)
def test_nnx_matches_flax(case, use_jit):
    ours_graphdef, state = nnx.split(flax_layers.nnx.MultiHeadAttention(**_nnx_kwargs(case)))
    # Flax's layer runs on our layer's state: the checkpoint is interchangeable.
    theirs_graphdef, _ = nnx.split(nnx.MultiHeadAttention(**_nnx_kwargs(case)))
    x_q, x_kv = _inputs(case)
    cotangent = _cotangent(case)
    our_out, our_grads = _output_and_grads(_nnx_apply(ours_graphdef, case), state, x_q, x_kv, cotangent, use_jit)
    their_out, their_grads = _output_and_grads(
        _nnx_apply(theirs_graphdef, case), state, x_q, x_kv, cotangent, use_jit=True
    )
    _assert_trees_close(our_out, their_out, F32_TOL)
    _assert_trees_close(our_grads, their_grads, F32_TOL)


def test_nnx_state_and_signature_are_flax():
    case = CASES[-1] if HAS_NUM_KV_HEADS else CASES[1]
    _assert_trees_close(
        nnx.state(flax_layers.nnx.MultiHeadAttention(**_nnx_kwargs(case))),
        nnx.state(nnx.MultiHeadAttention(**_nnx_kwargs(case))),
        0.0,
    )
    ours = inspect.signature(flax_layers.nnx.MultiHeadAttention.__init__).parameters
    theirs = inspect.signature(nnx.MultiHeadAttention.__init__).parameters
    assert list(ours) == list(theirs)
    assert ours["attention_fn"].default is flax_layers.dot_product_attention
    assert [p for n, p in ours.items() if n != "attention_fn"] == [
        p for n, p in theirs.items() if n != "attention_fn"
    ]


def test_nnx_under_nnx_jit_and_grad():
    case = NNX_CASES[-1]
    ours = flax_layers.nnx.MultiHeadAttention(**_nnx_kwargs(case))
    theirs = nnx.MultiHeadAttention(**_nnx_kwargs(case))
    x_q, x_kv = _inputs(case)

    @nnx.jit
    def grads(model):
        return nnx.grad(lambda m: jnp.sum(m(x_q, x_kv, **_nnx_call_kwargs(case)) ** 2))(model)

    _assert_trees_close(grads(ours), grads(theirs), F32_TOL)


def test_nnx_bf16_matches_flax():
    case = NNX_CASES[-1]
    ours = flax_layers.nnx.MultiHeadAttention(**_nnx_kwargs(case, dtype=jnp.bfloat16))
    theirs = nnx.MultiHeadAttention(**_nnx_kwargs(case, dtype=jnp.bfloat16))
    x_q, x_kv = _inputs(case, jnp.bfloat16)
    our_out = ours(x_q, x_kv, **_nnx_call_kwargs(case))
    assert our_out.dtype == jnp.bfloat16
    _assert_trees_close(our_out, theirs(x_q, x_kv, **_nnx_call_kwargs(case)), BF16_TOL)


def test_nnx_sow_weights_raises():
    layer = flax_layers.nnx.MultiHeadAttention(**_nnx_kwargs(CASES[0]))
    x, _ = _inputs(CASES[0])
    with pytest.raises(NotImplementedError, match="sow_weights"):
        layer(x, sow_weights=True)


def test_nnx_mask_matches_flax():
    layer = flax_layers.nnx.MultiHeadAttention(**_nnx_kwargs(CASES[0]))
    flax_layer = nnx.MultiHeadAttention(**_nnx_kwargs(CASES[0]))
    nnx.update(flax_layer, nnx.state(layer))
    x, _ = _inputs(CASES[0])
    mask = jax.random.bernoulli(jax.random.key(5), 0.7, (x.shape[0], 1, x.shape[1], x.shape[1]))
    mask = mask.at[..., 0].set(True)
    _assert_trees_close(layer(x, mask=mask), flax_layer(x, mask=mask), F32_TOL)


# --- linen and nnx ---------------------------------------------------------


@pytest.mark.parametrize("case", [c for c in CASES[1:3] if c in NNX_CASES], ids=lambda c: c.name)
def test_linen_and_nnx_agree(case):
    linen_layer, _ = _linen_layers(case)
    x_q, x_kv = _inputs(case)
    params = linen_layer.init(jax.random.key(3), x_q, x_kv)["params"]
    graphdef, state = nnx.split(flax_layers.nnx.MultiHeadAttention(**_nnx_kwargs(case)))
    nnx.replace_by_pure_dict(state, params)
    _assert_trees_close(
        jax.jit(_linen_apply(linen_layer, case, False))(params, x_q, x_kv),
        jax.jit(_nnx_apply(graphdef, case))(state, x_q, x_kv),
        F32_TOL,
    )
