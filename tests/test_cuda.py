"""The CUDA kernels on a GPU: the same bound as the CPU tests against the float64 reference, agreement with the
CPU handlers on the same inputs, gradients, determinism and CUDA graphs. Skipped when JAX sees no GPU."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from attention_cases import FEATURES, Case, assert_within_bound, feature_kwargs, grads, max_error, oracle, oracle_grads


def _gpus():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


GPUS = _gpus()
pytestmark = pytest.mark.skipif(not GPUS, reason="no GPU visible to JAX")
CPU = jax.devices("cpu")[0]
HALF_DTYPES = (jnp.bfloat16, jnp.float16)


def test_built_with_cuda():
    assert jax_flash.BUILT_WITH_CUDA, "a GPU is present but jax_flash was built without its CUDA kernels"


def _poison_gpu_memory():
    """Fill and free a large NaN buffer, so outputs the kernels fail to write are likely to read back NaN."""
    poison = jax.device_put(jnp.full((64 << 20,), jnp.nan, jnp.float32), GPUS[0])
    poison.block_until_ready()
    del poison


def _on(device, *arrays):
    return [jax.device_put(a, device) for a in arrays]


def check_forward_on_gpu(case: Case, **kwargs):
    q, k, v = case.inputs()
    kwargs_gpu = {n: jax.device_put(a, GPUS[0]) if isinstance(a, jax.Array) else a for n, a in kwargs.items()}
    _poison_gpu_memory()
    o, lse = jax_flash.attention(*_on(GPUS[0], q, k, v), return_lse=True, **kwargs_gpu)
    o_cpu, lse_cpu = jax_flash.attention(*_on(CPU, q, k, v), return_lse=True, **kwargs)
    o_xla, lse_xla = jax_flash.attention(*_on(CPU, q, k, v), return_lse=True, implementation="xla", **kwargs)
    o_ref, lse_ref = oracle(q, k, v, **kwargs)
    assert_within_bound("o", o, o_xla, o_ref, case.dtype)
    assert_within_bound("lse", lse, lse_xla, lse_ref, jnp.float32)
    # Agreement with the CPU specification: as close to it as the bound allows either to be from the truth.
    assert_within_bound("o vs CPU", o, o_xla, np.asarray(o_cpu.astype(jnp.float32)), case.dtype)
    assert max_error(lse, lse_cpu) <= 1e-3 * max(1.0, float(np.nanmax(np.abs(np.where(np.isinf(lse_ref), 0, lse_ref)))))


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("head_dim", (32, 64, 96, 128, 192, 256, 7, 40, 100))
@pytest.mark.parametrize("seqlens", ((1, 1), (17, 17), (128, 128), (1000, 1000), (17, 300), (300, 17), (1, 1000)),
                         ids=lambda s: f"{s[0]}x{s[1]}")
def test_forward_shapes(dtype, head_dim, seqlens):
    case = Case(seqlen_q=seqlens[0], seqlen_k=seqlens[1], head_dim=head_dim, dtype=dtype, seed=head_dim)
    check_forward_on_gpu(case, causal=(seqlens[0] + head_dim) % 2 == 0)


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("seqlens", ((33, 33), (40, 300), (300, 40)), ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("heads", ((4, 4), (8, 2), (4, 1)), ids=("mha", "gqa", "mqa"))
def test_forward_features(feature, dtype, seqlens, heads):
    case = Case(seqlen_q=seqlens[0], seqlen_k=seqlens[1], heads_q=heads[0], heads_kv=heads[1], head_dim=64,
                dtype=dtype, seed=len(feature))
    check_forward_on_gpu(case, **feature_kwargs(feature, case))


def check_gradients_on_gpu(case: Case, deterministic=False, **kwargs):
    q, k, v = case.inputs()
    d_o = jax.random.normal(jax.random.key(case.seed + 99), q.shape, jnp.float32).astype(case.dtype)
    kwargs_gpu = {n: jax.device_put(a, GPUS[0]) if isinstance(a, jax.Array) else a for n, a in kwargs.items()}
    _poison_gpu_memory()
    ours = grads(*_on(GPUS[0], q, k, v, d_o), deterministic=deterministic, **kwargs_gpu)
    cpu = grads(*_on(CPU, q, k, v, d_o), **kwargs)
    xla = grads(*_on(CPU, q, k, v, d_o), implementation="xla", **kwargs)
    reference = oracle_grads(q, k, v, d_o, **kwargs)
    for name, g, g_cpu, g_xla, g_ref in zip(("dq", "dk", "dv"), ours, cpu, xla, reference):
        assert_within_bound(name, g, g_xla, g_ref, case.dtype, scale=4.0)
        assert_within_bound(name + " vs CPU", g, g_xla, np.asarray(g_cpu.astype(jnp.float32)), case.dtype, scale=4.0)


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("head_dim", (32, 64, 96, 128, 192, 256, 40))
@pytest.mark.parametrize("seqlens", ((1, 1), (17, 17), (1000, 1000), (64, 300), (300, 64)),
                         ids=lambda s: f"{s[0]}x{s[1]}")
def test_backward_shapes(dtype, head_dim, seqlens):
    case = Case(seqlen_q=seqlens[0], seqlen_k=seqlens[1], head_dim=head_dim, dtype=dtype, seed=head_dim + 1)
    check_gradients_on_gpu(case, causal=head_dim % 64 == 0)


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("heads", ((4, 4), (8, 2), (4, 1)), ids=("mha", "gqa", "mqa"))
@pytest.mark.parametrize("seqlens", ((40, 300), (300, 40)), ids=lambda s: f"{s[0]}x{s[1]}")
def test_backward_features(feature, heads, seqlens):
    case = Case(seqlen_q=seqlens[0], seqlen_k=seqlens[1], heads_q=heads[0], heads_kv=heads[1], head_dim=64,
                dtype=jnp.bfloat16, seed=len(feature) + 1)
    check_gradients_on_gpu(case, **feature_kwargs(feature, case))


@pytest.mark.parametrize("feature", ("causal", "everything"))
def test_deterministic_backward_is_bit_identical(feature):
    case = Case(batch=2, seqlen_q=1000, seqlen_k=1500, heads_q=8, heads_kv=2, head_dim=128, dtype=jnp.bfloat16)
    q, k, v = _on(GPUS[0], *case.inputs())
    d_o = jax.device_put(jax.random.normal(jax.random.key(3), q.shape, jnp.bfloat16), GPUS[0])
    kwargs = {n: jax.device_put(a, GPUS[0]) if isinstance(a, jax.Array) else a
              for n, a in feature_kwargs(feature, case).items()}
    runs = [[np.asarray(g.astype(jnp.float32)) for g in grads(q, k, v, d_o, deterministic=True, **kwargs)]
            for _ in range(3)]
    for run in runs[1:]:
        for a, b in zip(runs[0], run):
            np.testing.assert_array_equal(a, b)


_GRAPH_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np, jax_flash
q, k, v = (jax.random.normal(jax.random.key(i), (2, 512, 8, 64), jnp.bfloat16) for i in range(3))
@jax.jit
def step(q, k, v):
    loss = lambda q_, k_, v_: jnp.mean(jax_flash.attention(q_, k_, v_, causal=True).astype(jnp.float32) ** 2)
    return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)
first = step(q, k, v)
for _ in range(3):
    again = step(q, k, v)
print(float(first[0]), all(np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
                           for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again))))
"""


def test_training_step_under_cuda_graphs():
    """XLA command buffers (CUDA graphs) on, custom calls included: same results as without them."""
    outputs = []
    for flags in ("--xla_gpu_enable_command_buffer=", "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL "
                  "--xla_gpu_graph_min_graph_size=1"):
        env = dict(os.environ, XLA_FLAGS=flags)
        result = subprocess.run([sys.executable, "-c", _GRAPH_SCRIPT], env=env, capture_output=True, text=True,
                                timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        outputs.append(result.stdout.split())
    assert outputs[0][1] == "True" and outputs[1][1] == "True"
    np.testing.assert_allclose(float(outputs[0][0]), float(outputs[1][0]), rtol=1e-6)


# float32 inputs (issue #10): "highest" (exact SIMT FMA) within 1e-5 of the float64 reference, relative to the
# reference's largest magnitude; "tf32" within the usual bound against XLA's own TF32 attention on the GPU.
FLOAT32_MODES = ("highest", "tf32")
EXACT_FLOAT32_RTOL = 1e-5


def _relative_error(x, reference) -> float:
    reference = np.asarray(reference, np.float64)
    finite = np.isfinite(reference)
    magnitude = float(np.max(np.abs(reference[finite]), initial=0.0))
    return max_error(x, reference) / max(magnitude, 1e-30)


def check_float32_on_gpu(case: Case, precision: str, gradients: bool = True, **kwargs):
    q, k, v = case.inputs()
    d_o = jax.random.normal(jax.random.key(case.seed + 99), q.shape, jnp.float32)
    kwargs_gpu = {n: jax.device_put(a, GPUS[0]) if isinstance(a, jax.Array) else a for n, a in kwargs.items()}
    _poison_gpu_memory()
    on_gpu = _on(GPUS[0], q, k, v, d_o)
    o, lse = jax_flash.attention(*on_gpu[:3], return_lse=True, float32_precision=precision, **kwargs_gpu)
    assert o.dtype == jnp.float32 and lse.dtype == jnp.float32
    results = [("o", o), ("lse", lse)]
    references = list(oracle(q, k, v, **kwargs))
    if gradients:
        results += list(zip(("dq", "dk", "dv"), grads(*on_gpu, float32_precision=precision, **kwargs_gpu)))
        references += oracle_grads(q, k, v, d_o, **kwargs)
    if precision == "highest":
        for (name, x), reference in zip(results, references):
            error = _relative_error(x, reference)
            assert error <= EXACT_FLOAT32_RTOL, f"{name}: relative error {error:.2e} > {EXACT_FLOAT32_RTOL:.0e}"
        return
    with jax.default_matmul_precision("tensorfloat32"):
        xla = list(jax_flash.attention(*on_gpu[:3], return_lse=True, implementation="xla", **kwargs_gpu))
        if gradients:
            xla += list(grads(*on_gpu, implementation="xla", **kwargs_gpu))
    for (name, x), x_xla, reference in zip(results, xla, references):
        assert_within_tf32_bound(name, x, x_xla, reference, scale=1.0 if name in ("o", "lse") else 4.0)


def assert_within_tf32_bound(name, ours, xla_tf32, reference, scale):
    """The usual bound (2 x XLA's error + atol) with XLA at "tensorfloat32". XLA turns some small dots (a
    single query, tiny head dims) into float32 reductions whatever the precision, so its TF32 error is taken
    to be at least one TF32 rounding (2^-11) of the reference magnitude."""
    magnitude = max(1.0, float(np.max(np.abs(np.nan_to_num(np.asarray(reference), neginf=0.0)), initial=0.0)))
    ours_error = max_error(ours, reference)
    xla_error = max(max_error(xla_tf32, reference), 2.0 ** -11 * magnitude * scale)
    atol = 2e-5 * magnitude * scale
    assert ours_error <= 2 * xla_error + atol, (
        f"{name}: error {ours_error:.3e} exceeds 2 x XLA TF32 error {xla_error:.3e} + atol {atol:.1e}")


@pytest.mark.parametrize("precision", FLOAT32_MODES)
@pytest.mark.parametrize("head_dim", (64, 128, 7, 40, 100))
@pytest.mark.parametrize("seqlens", ((1, 1), (17, 17), (1000, 1000), (17, 300), (300, 17)),
                         ids=lambda s: f"{s[0]}x{s[1]}")
def test_float32_shapes(precision, head_dim, seqlens):
    case = Case(seqlen_q=seqlens[0], seqlen_k=seqlens[1], head_dim=head_dim, dtype=jnp.float32, seed=head_dim + 3)
    check_float32_on_gpu(case, precision, causal=(seqlens[0] + head_dim) % 2 == 0)


@pytest.mark.parametrize("precision", FLOAT32_MODES)
@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("shape", ((40, 300, 8, 2), (300, 40, 4, 1)), ids=("40x300-gqa", "300x40-mqa"))
def test_float32_features(precision, feature, shape):
    case = Case(seqlen_q=shape[0], seqlen_k=shape[1], heads_q=shape[2], heads_kv=shape[3], head_dim=64,
                dtype=jnp.float32, seed=len(feature) + 5)
    check_float32_on_gpu(case, precision, **feature_kwargs(feature, case))


@pytest.mark.parametrize("precision", FLOAT32_MODES)
def test_float32_backward_is_bit_identical(precision):
    case = Case(batch=2, seqlen_q=700, seqlen_k=900, heads_q=8, heads_kv=2, head_dim=128, dtype=jnp.float32)
    q, k, v = _on(GPUS[0], *case.inputs())
    d_o = jax.device_put(jax.random.normal(jax.random.key(3), q.shape, jnp.float32), GPUS[0])
    runs = [[np.asarray(g) for g in grads(q, k, v, d_o, causal=True, float32_precision=precision)]
            for _ in range(2)]
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)


def test_float32_modes_differ_and_tf32_is_not_exact():
    """The mode argument reaches the kernels: TF32 rounding shows up in the output, the exact mode does not."""
    case = Case(batch=1, seqlen_q=256, seqlen_k=256, heads_q=2, heads_kv=2, head_dim=64, dtype=jnp.float32)
    q, k, v = case.inputs()
    o_ref, _ = oracle(q, k, v)
    errors = {mode: _relative_error(jax_flash.attention(*_on(GPUS[0], q, k, v), float32_precision=mode), o_ref)
              for mode in FLOAT32_MODES}
    assert errors["highest"] <= EXACT_FLOAT32_RTOL
    assert errors["tf32"] > 10 * errors["highest"], errors
