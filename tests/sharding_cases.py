"""Shared helpers of the multi-device tests: meshes over the 8 (fake, on CPU) devices, sharding of inputs and mask
arguments, and the value-and-gradient probe compared between sharded and unsharded runs."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flash

# The 8 fake CPU devices by default (the CPU handlers are the specification, and `pytest tests` must pass on a GPU
# machine too); JAX_FLASH_TEST_PLATFORM=gpu runs these tests on the GPUs instead.
PLATFORM = os.environ.get("JAX_FLASH_TEST_PLATFORM", "cpu")
DEVICES = jax.devices(PLATFORM)
# The CUDA kernels take half precision; elsewhere float32 keeps the comparison tight.
ON_GPU = PLATFORM == "gpu"
DTYPE = jnp.bfloat16 if ON_GPU else jnp.float32
# Sharded vs unsharded: ring merges reassociate sums (and round partial results to bfloat16 on GPU).
TOLERANCE = dict(rtol=2e-2, atol=2e-2) if ON_GPU else dict(rtol=2e-5, atol=2e-5)
# 8 devices (faked on CPU by conftest.py) give 2 x 4 meshes; a 2-GPU machine runs the tests on 1 x 2 meshes.
NUM_DEVICES = 8 if len(DEVICES) >= 8 else 2
DEFAULT_SHAPE = (2, 4) if NUM_DEVICES == 8 else (1, 2)
needs_devices = pytest.mark.skipif(len(DEVICES) < 2, reason="needs 2 or more devices")


def mesh(names: tuple[str, ...], shape: tuple[int, ...] | None = None, **kwargs: Any) -> Mesh:
    shape = DEFAULT_SHAPE if shape is None else shape
    devices = np.asarray(DEVICES[:int(np.prod(shape))]).reshape(shape)
    return Mesh(devices, names, **kwargs)


def split_kwargs(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, jax.Array]]:
    """(static options, array options) of a jax_flash.attention keyword dict."""
    arrays = {name: value for name, value in kwargs.items() if hasattr(value, "shape")}
    return {name: value for name, value in kwargs.items() if name not in arrays}, arrays


def mask_spec(name: str, value: jax.Array, qkv_spec: P) -> P:
    """Sharding of a mask argument consistent with q/k/v sharded as ``qkv_spec`` ([B, S, H, D])."""
    spec = tuple(qkv_spec) + (None,) * (4 - len(qkv_spec))
    batch, seq, heads = spec[0], spec[1], spec[2]
    if name in ("bias", "mask"):  # [B|1, H|1, Sq|1, Sk|1], leading axes optional: full axes sharded like q's
        roles = (batch, heads, seq, None)[4 - value.ndim:]
        return P(*(role if size != 1 else None for role, size in zip(roles, value.shape)))
    if value.ndim == 0:  # a PRNG key
        return P()
    if name.endswith("segment_ids"):
        return P(batch, seq)
    if name == "alibi_slopes":
        return P(heads) if value.ndim == 1 else P(batch, heads)
    return P(batch)


def probe(fn: Callable[..., tuple[jax.Array, jax.Array]], static: dict[str, Any]) -> Callable[..., tuple]:
    """A jitted ``(q, k, v, d_o, d_lse, arrays) -> (o, lse, dq, dk, dv[, dbias])`` of ``fn(q, k, v,
    return_lse=True, **static, **arrays)``, the gradients (dbias when ``arrays`` has a bias) being those of
    ``sum(o * d_o) + sum(lse * d_lse)`` (fully masked rows' -inf lse left out)."""

    def loss(q, k, v, bias, d_o, d_lse, arrays):
        extra = {} if bias is None else {"bias": bias}
        o, lse = fn(q, k, v, return_lse=True, **static, **arrays, **extra)
        total = jnp.sum(o * d_o) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * d_lse)
        return total, (o, lse)

    @jax.jit
    def run(q, k, v, d_o, d_lse, arrays):
        arrays = dict(arrays)
        bias = arrays.pop("bias", None)
        argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
        (_, (o, lse)), grads = jax.value_and_grad(loss, argnums=argnums, has_aux=True)(q, k, v, bias, d_o, d_lse,
                                                                                         arrays)
        return (o, lse, *grads)

    return run


def cotangents(q: jax.Array, seed: int = 1) -> tuple[jax.Array, jax.Array]:
    k1, k2 = jax.random.split(jax.random.key(seed))
    batch, seqlen, heads, _ = q.shape
    return (jax.random.normal(k1, q.shape, q.dtype), jax.random.normal(k2, (batch, heads, seqlen), jnp.float32))


def compare_sharded(q, k, v, kwargs: dict[str, Any], m: Mesh, q_spec: P, kv_spec: P | None = None,
                    fn: Callable[..., Any] = jax_flash.attention, return_hlo: bool = False) -> str | None:
    """Asserts that results and gradients with inputs sharded on ``m`` equal the unsharded ones; returns the
    compiled HLO text of the sharded run when asked (it costs one more compilation)."""
    kv_spec = q_spec if kv_spec is None else kv_spec
    static, arrays = split_kwargs(kwargs)
    d_o, d_lse = cotangents(q)
    run = probe(fn, static)
    expected = run(q, k, v, d_o, d_lse, arrays)

    spec = tuple(q_spec) + (None,) * (4 - len(q_spec))
    put = lambda x, s: jax.device_put(x, NamedSharding(m, s))
    args = (put(q, q_spec), put(k, kv_spec), put(v, kv_spec), put(d_o, q_spec),
            put(d_lse, P(spec[0], spec[2], spec[1])),
            {name: put(x, mask_spec(name, x, kv_spec if name == "kv_segment_ids" else q_spec))
             for name, x in arrays.items()})
    actual = run(*args)
    for name, got, want in zip(("o", "lse", "dq", "dk", "dv", "dbias"), actual, expected):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), err_msg=name,
                                   **TOLERANCE)
    return run.lower(*args).compile().as_text() if return_hlo else None
