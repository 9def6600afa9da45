"""Shared helpers of the attention tests: random inputs, the float64 oracle and the FA-style error bound.

The bound: the error of a jax_flash result against the float64 reference must be at most twice the error of
the same-dtype pure-JAX attention (``implementation="xla"``) plus a small absolute tolerance.
"""

from __future__ import annotations

import dataclasses
import unittest.mock
from typing import Any

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np

import jax_flash
from jax_flash import _config

ATOL = {jnp.dtype(jnp.float32): 2e-5, jnp.dtype(jnp.bfloat16): 2e-3, jnp.dtype(jnp.float16): 5e-4}


@dataclasses.dataclass(frozen=True)
class Case:
    batch: int = 2
    seqlen_q: int = 17
    seqlen_k: int = 17
    heads_q: int = 4
    heads_kv: int = 2
    head_dim: int = 16
    dtype: Any = jnp.float32
    seed: int = 0

    def inputs(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Fresh random q, k, v (never zeros)."""
        kq, kk, kv = jax.random.split(jax.random.key(self.seed), 3)
        q = jax.random.normal(kq, (self.batch, self.seqlen_q, self.heads_q, self.head_dim), jnp.float32)
        k = jax.random.normal(kk, (self.batch, self.seqlen_k, self.heads_kv, self.head_dim), jnp.float32)
        v = jax.random.normal(kv, (self.batch, self.seqlen_k, self.heads_kv, self.head_dim), jnp.float32)
        return q.astype(self.dtype), k.astype(self.dtype), v.astype(self.dtype)


def feature_kwargs(feature: str, case: Case) -> dict[str, Any]:
    """Keyword arguments of jax_flash.attention that exercise one masking feature."""
    rng = np.random.default_rng(case.seed + 7)
    b, sq, sk = case.batch, case.seqlen_q, case.seqlen_k
    if feature == "none":
        return {}
    if feature == "causal":
        return {"causal": True}
    if feature == "window":
        return {"window_size": (5, 3)}
    if feature == "window_left_causal":
        return {"window_size": (4, -1), "causal": True}
    if feature == "softcap":
        return {"softcap": 2.0, "softmax_scale": 0.7}
    if feature == "alibi":
        return {"alibi_slopes": jnp.asarray(rng.uniform(0.05, 0.5, (case.heads_q,)), jnp.float32)}
    if feature == "alibi_batched_causal":
        return {"alibi_slopes": jnp.asarray(rng.uniform(0.05, 0.5, (b, case.heads_q)), jnp.float32),
                "causal": True}
    if feature == "seqlens":
        return {"q_seqlens": jnp.asarray(rng.integers(0, sq + 1, (b,)), jnp.int32),
                "kv_seqlens": jnp.asarray(rng.integers(1, sk + 1, (b,)), jnp.int32)}
    if feature == "seqlens_causal":
        return {"q_seqlens": jnp.asarray(rng.integers(1, sq + 1, (b,)), jnp.int32),
                "kv_seqlens": jnp.asarray(rng.integers(1, sk + 1, (b,)), jnp.int32), "causal": True}
    if feature == "segments":
        return {"q_segment_ids": jnp.asarray(np.sort(rng.integers(0, 3, (b, sq)), axis=1), jnp.int32),
                "kv_segment_ids": jnp.asarray(np.sort(rng.integers(0, 3, (b, sk)), axis=1), jnp.int32)}
    if feature == "everything":
        return {"causal": True, "window_size": (6, -1), "softcap": 3.0,
                "alibi_slopes": jnp.asarray(rng.uniform(0.05, 0.3, (case.heads_q,)), jnp.float32),
                "kv_seqlens": jnp.asarray(rng.integers(1, sk + 1, (b,)), jnp.int32),
                "q_segment_ids": jnp.asarray(np.sort(rng.integers(0, 2, (b, sq)), axis=1), jnp.int32),
                "kv_segment_ids": jnp.asarray(np.sort(rng.integers(0, 2, (b, sk)), axis=1), jnp.int32)}
    raise ValueError(feature)


def forward_calls(q, k, v, **kwargs) -> list[Any]:
    """The forward custom calls (ffi_call equations: results o, lse, workspace) in the jaxpr of jax_flash.attention,
    traced as on a machine without Hopper GPUs (whatever a test patched): where every GPU is one, a float32 call is
    traced once per platform (_config.per_platform) and its jaxpr holds each call twice, once per branch."""
    with unittest.mock.patch.object(_config, "gpus_are_hopper", lambda: False):
        jaxpr = jax.make_jaxpr(lambda q_, k_, v_: jax_flash.attention(q_, k_, v_, **kwargs))(q, k, v)
    calls = []

    def visit(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "ffi_call" and len(eqn.outvars) == 3:  # the forward: (o, lse, workspace)
                calls.append(eqn)
        for sub in jax.extend.core.subjaxprs(jaxpr):
            visit(sub)

    visit(jaxpr.jaxpr)
    return calls


def forward_call_operand_shapes(q, k, v, **kwargs) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The (q, k) operand shapes of every forward custom call of jax_flash.attention (``forward_calls``): what GQA
    packing and the split-KV forward made of the call."""
    return [(tuple(eqn.invars[0].aval.shape), tuple(eqn.invars[1].aval.shape))
            for eqn in forward_calls(q, k, v, **kwargs)]


def runs_tf32(x) -> bool:
    """float32 input on a GPU: jax_flash's default float32_precision ("tf32") and XLA's default precision there
    both multiply on TF32 tensor cores."""
    return jnp.dtype(x.dtype) == jnp.float32 and any(device.platform == "gpu" for device in x.devices())


# One TF32 rounding (10 mantissa bits, round to nearest): XLA's error under TF32 is taken to be at least this times
# the reference magnitude, because XLA turns some small dots (a single query, tiny head dims) into float32
# reductions whatever the precision, and then its error says nothing about what TF32 kernels can reach.
TF32_ROUNDING = 2.0 ** -11


def same_attention_tolerance(x, lse: bool = False) -> dict[str, float]:
    """assert_allclose tolerances between two computations of the same attention (a converted mask against the
    dense one, packed or split calls against plain ones, jax_flash against XLA), by the dtype and platform of the
    input ``x``; ``lse`` for the float32 log-sum-exp of such calls. Half precision: a rounding or two of the
    output. float32: float32 summation order on the CPU, but TF32 on the GPU (runs_tf32), where two kernel
    families, or a kernel and XLA, round the operands differently."""
    if runs_tf32(x):  # lse: absolute, a dropped key out of 60 moves it by ~0.017
        return {"rtol": 0.0, "atol": 5e-3} if lse else {"rtol": 1e-2, "atol": 5e-3}
    if lse or jnp.dtype(x.dtype) == jnp.float32:
        return {"rtol": 1e-5, "atol": 1e-5}
    return {"rtol": 2e-2, "atol": 1e-2}


def assert_vmapped_jit_matches_xla(case: Case) -> None:
    """jax_flash.attention under jit(vmap) over a stack of two calls (the inputs and twice them) against each call of
    the pure-JAX path."""
    q, k, v = case.inputs()
    stacked = [jnp.stack([x, 2.0 * x]) for x in (q, k, v)]
    batched = jax.jit(jax.vmap(lambda q_, k_, v_: jax_flash.attention(q_, k_, v_)))(*stacked)
    for i in range(2):
        one = jax_flash.attention(*(x[i] for x in stacked), implementation="xla")
        np.testing.assert_allclose(np.asarray(batched[i], np.float32), np.asarray(one, np.float32),
                                   **same_attention_tolerance(q))


def block_structured_mask(shape, seed: int, region: int = 32, blind_parts: bool = True) -> jax.Array:
    """A boolean mask of ``shape`` ([..., Sq, Sk]) made of ``region x region`` squares, each hidden, visible, half
    or almost all visible at random, so that its 64 x 64 blocks (jax_flash/_mask_blocks.py) take every summary
    value. With ``blind_parts``, where the axes allow, the last 40 keys are padding and row 5 sees nothing."""
    rng = np.random.default_rng(seed)
    *lead, seqlen_q, seqlen_k = shape
    density = rng.choice([0.0, 1.0, 0.5, 0.99], size=(*lead, -(-seqlen_q // region), -(-seqlen_k // region)))
    density = np.repeat(np.repeat(density, region, axis=-2), region, axis=-1)[..., :seqlen_q, :seqlen_k]
    mask = rng.random(shape) < density
    if blind_parts and seqlen_k > 40:
        mask[..., -40:] = False
    if blind_parts and seqlen_q > 5:
        mask[..., 5, :] = False
    return jnp.asarray(mask)


FEATURES = ("none", "causal", "window", "window_left_causal", "softcap", "alibi", "alibi_batched_causal",
            "seqlens", "seqlens_causal", "segments", "everything")


def gradient_inputs(case: Case, scales=(1.0, 1.0, 1.0, 1.0), seed_offset: int = 99):
    """``(q, k, v, d_o, d_lse)``: the case's inputs with a float32 output cotangent and an lse cotangent (``[batch,
    heads_q, seqlen_q]``), q, k, v and d_o multiplied by ``scales``."""
    q, k, v = case.inputs()
    keys = jax.random.split(jax.random.key(case.seed + seed_offset), 2)
    d_o = jax.random.normal(keys[0], q.shape, jnp.float32)
    d_lse = jax.random.normal(keys[1], (q.shape[0], q.shape[2], q.shape[1]), jnp.float32)
    q, k, v, d_o = (x * s for x, s in zip((q, k, v, d_o), scales))
    return q, k, v, d_o, d_lse


def oracle(q, k, v, **kwargs):
    """(o, lse) of the pure-JAX reference evaluated in float64."""
    with jax.enable_x64(True):
        o, lse = jax_flash.attention(*(jnp.asarray(x, jnp.float64) for x in (q, k, v)), implementation="xla",
                                     return_lse=True, **kwargs)
        return np.asarray(o), np.asarray(lse)


def _loss(attend, d_o, d_lse, dtype):
    """sum(o * d_o), plus sum(lse * d_lse) over the finite lse (rows that see a key) when d_lse is given."""
    def loss(q_, k_, v_):
        if d_lse is None:
            return jnp.sum((attend(q_, k_, v_) * d_o).astype(dtype))
        o, lse = attend(q_, k_, v_, return_lse=True)
        lse_term = jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0).astype(dtype) * d_lse)
        return jnp.sum((o * d_o).astype(dtype)) + lse_term
    return loss


def oracle_grads(q, k, v, d_o, d_lse=None, **kwargs):
    """Gradients of sum(o * d_o) (+ sum(lse * d_lse)) of the float64 reference with respect to q, k, v."""
    with jax.enable_x64(True):
        args = [jnp.asarray(x, jnp.float64) for x in (q, k, v)]
        attend = lambda *a, **kw: jax_flash.attention(*a, implementation="xla", **kwargs, **kw)  # noqa: E731
        loss = _loss(attend, jnp.asarray(d_o, jnp.float64), None if d_lse is None else jnp.asarray(d_lse, jnp.float64),
                     jnp.float64)
        return [np.asarray(g) for g in jax.grad(loss, argnums=(0, 1, 2))(*args)]


def grads(q, k, v, d_o, implementation=None, d_lse=None, **kwargs):
    attend = lambda *a, **kw: jax_flash.attention(*a, implementation=implementation, **kwargs, **kw)  # noqa: E731
    return jax.grad(_loss(attend, d_o, d_lse, jnp.float32), argnums=(0, 1, 2))(q, k, v)


def backward_call_operand_types(loss, *args, platforms: tuple[str, ...] | None = None) -> list[str]:
    """The operand types of each backward custom call in the jitted gradient of ``loss`` at ``args``, as written in
    the module lowered for ``platforms`` (default: this process's backend; e.g. "tensor<2x17x4x64xf16>, ..."): which
    call a routing rule chose."""
    text = jax.jit(jax.grad(loss, argnums=tuple(range(len(args))))).trace(*args).lower(
        lowering_platforms=platforms).as_text()
    calls = [line for line in text.splitlines() if "jax_flash_attention_backward" in line]
    return [call.split(" : (")[1].split(") -> ")[0] for call in calls]


def bit_identical_runs(compute_grads, runs: int = 3) -> list:
    """Calls compute_grads() `runs` times and asserts every gradient equals the first run's bit for bit; returns the
    first run's gradients as float32 numpy arrays."""
    results = [[np.asarray(jnp.asarray(g, jnp.float32)) for g in compute_grads()] for _ in range(runs)]
    for run in results[1:]:
        for first, again in zip(results[0], run):
            np.testing.assert_array_equal(first, again)
    return results[0]


def set_path_switch(monkeypatch, variable: str, setting: str) -> tuple[str, ...] | None:
    """A float32 path's switch (jax_flash/_ffi_calls.py) for a routing test: "1", "0" or "" (unset) as the
    environment value on a process without Hopper GPUs; "hopper" unset, as in a process whose GPUs are all Hoppers
    (jax_flash._config.gpus_are_hopper patched), where the switches default to on in calls lowered for CUDA;
    "hopper-cpu" the same for a call lowered for the CPU, where they stay off. Returns the platforms to lower the
    test's call for (None: this process's backend)."""
    on_hopper = setting.startswith("hopper")
    monkeypatch.setattr(_config, "gpus_are_hopper", lambda: on_hopper)
    monkeypatch.setenv(variable, "" if on_hopper else setting)
    return {"hopper": ("cuda",), "hopper-cpu": ("cpu",)}.get(setting)


def max_error(x, reference) -> float:
    x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    reference = np.asarray(reference, np.float64)
    finite = np.isfinite(reference)
    assert np.array_equal(np.isfinite(x), finite), "non-finite entries differ from the reference"
    assert np.array_equal(x[~finite], reference[~finite]), "infinite entries differ from the reference"
    return float(np.max(np.abs(x[finite] - reference[finite]), initial=0.0))


def assert_forward_within_bound(q, k, v, dtype, **kwargs) -> None:
    """o and lse of the kernels: shapes, dtypes and the FA-style bound against the float64 reference."""
    o, lse = jax_flash.attention(q, k, v, return_lse=True, **kwargs)
    o_xla, lse_xla = jax_flash.attention(q, k, v, return_lse=True, implementation="xla", **kwargs)
    o_ref, lse_ref = oracle(q, k, v, **kwargs)
    batch, seqlen_q, heads_q, _ = q.shape
    assert o.shape == q.shape and o.dtype == q.dtype
    assert lse.shape == (batch, heads_q, seqlen_q) and lse.dtype == jnp.float32
    assert_within_bound("o", o, o_xla, o_ref, dtype, tf32=runs_tf32(q))
    assert_within_bound("lse", lse, lse_xla, lse_ref, jnp.float32, tf32=runs_tf32(q))


def assert_gradients_within_bound(q, k, v, d_o, dtype, **kwargs) -> None:
    """dq, dk, dv of sum(o * d_o): shapes, dtypes and the bound against jax.grad of the float64 reference."""
    ours = grads(q, k, v, d_o, **kwargs)
    xla = grads(q, k, v, d_o, implementation="xla", **kwargs)
    reference = oracle_grads(q, k, v, d_o, **kwargs)
    for name, g, g_xla, g_ref, x in zip(("dq", "dk", "dv"), ours, xla, reference, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype, name
        assert_within_bound(name, g, g_xla, g_ref, dtype, scale=4.0, tf32=runs_tf32(q))


def assert_within_bound(name: str, ours, xla_same_dtype, reference, dtype, scale: float = 1.0,
                        tf32: bool = False) -> None:
    """FA-style bound: err(ours) <= 2 * err(xla, same dtype) + atol (atol scaled by the reference magnitude).
    ``tf32``: both ran on TF32 tensor cores, so XLA's error counts as at least TF32_ROUNDING of the magnitude."""
    ours_error = max_error(ours, reference)
    xla_error = max_error(xla_same_dtype, reference)
    magnitude = max(1.0, float(np.max(np.abs(np.nan_to_num(reference, neginf=0.0)), initial=0.0)))
    if tf32:
        xla_error = max(xla_error, TF32_ROUNDING * magnitude * scale)
    atol = ATOL[jnp.dtype(dtype)] * magnitude * scale
    assert ours_error <= 2 * xla_error + atol, (
        f"{name}: error {ours_error:.3e} exceeds 2 x XLA error {xla_error:.3e} + atol {atol:.1e}")
