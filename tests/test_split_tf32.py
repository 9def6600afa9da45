"""float32_precision="highest" with JAX_FLASH_SM90_SPLIT_TF32=1: the forward call carries the split-TF32 workspace
(csrc/common/tf32_workspace.h), sized from the operands the call really passes (packed GQA rows, split-KV chunks,
vmapped batches), and the results stay within the exact mode's bound of the same call without the switch.
On the CPU (CI) the handler checks the workspace's size and ignores it, so the two runs agree exactly; on a
Hopper GPU (JAX_FLASH_TEST_PLATFORM=gpu) the first runs the split-TF32 kernel."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import _ffi_calls, _gqa_packing, _kv_split
from attention_cases import Case, feature_kwargs

EXACT_FLOAT32_RTOL = 1e-5
NO_WORKSPACE = "tensor<0xf32>"  # the forward call's third result when it has no workspace


@pytest.fixture(autouse=True)
def automatic_choices(monkeypatch):
    monkeypatch.delenv(_kv_split.SPLIT_KV_ENV, raising=False)
    monkeypatch.delenv(_gqa_packing.PACK_GQA_ENV, raising=False)
    monkeypatch.delenv(_ffi_calls.TF32_FORMS_ENV, raising=False)
    monkeypatch.delenv("JAX_FLASH_CUDA_KERNEL_F32", raising=False)  # the exact runs must not be forced onto sm90
    monkeypatch.delenv("JAX_FLASH_SM90_DENSE", raising=False)


# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, feature): decoding shapes that pack GQA heads and split
# keys, prefill, and the common form's features.
SHAPES = (
    (1, 4, 4096, 32, 8, 64, "causal"),   # packed and split
    (1, 1, 4096, 8, 8, 64, "none"),      # split into 16 chunks
    (2, 1, 300, 8, 2, 36, "none"),       # packed
    (2, 129, 200, 4, 2, 64, "causal"),
    (2, 70, 90, 4, 4, 128, "window"),
    (2, 50, 77, 4, 2, 100, "seqlens"),
    (2, 60, 60, 2, 2, 64, "segments"),
    (2, 40, 50, 4, 2, 64, "softcap"),    # the transforms form
    (1, 33, 70, 2, 1, 128, "alibi_batched_causal"),
    (2, 30, 41, 4, 2, 64, "bias"),       # the dense form
    (2, 30, 41, 4, 2, 100, "mask"),
)


@pytest.mark.parametrize("batch,seqlen_q,seqlen_k,heads_q,heads_kv,head_dim,feature", SHAPES)
def test_split_switch_keeps_the_exact_results(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, feature,
                                              monkeypatch):
    case = Case(batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, heads_q=heads_q, heads_kv=heads_kv,
                head_dim=head_dim, dtype=jnp.float32, seed=seqlen_q + head_dim)
    q, k, v = case.inputs()
    if feature == "bias":
        kwargs = {"bias": jax.random.normal(jax.random.key(1), (heads_q, seqlen_q, seqlen_k))}
    elif feature == "mask":
        kwargs = {"mask": jax.random.bernoulli(jax.random.key(2), 0.7, (batch, 1, seqlen_q, seqlen_k)), "causal": True}
    else:
        kwargs = feature_kwargs(feature, case)
    # A new function per switch setting: jit's trace cache does not know the switch (read when traced).
    new_call = lambda: jax.jit(lambda q_, k_, v_: jax_flash.attention(q_, k_, v_, return_lse=True,
                                                                      float32_precision="highest", **kwargs))
    monkeypatch.setenv(_ffi_calls.SPLIT_TF32_ENV, "1")
    assert NO_WORKSPACE not in new_call().lower(q, k, v).as_text(), "the switch gave the call no workspace"
    split = new_call()(q, k, v)
    monkeypatch.setenv(_ffi_calls.SPLIT_TF32_ENV, "0")
    assert NO_WORKSPACE in new_call().lower(q, k, v).as_text()
    exact = new_call()(q, k, v)
    for name, a, b in zip(("o", "lse"), split, exact):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        finite = np.isfinite(b)
        assert np.array_equal(np.isfinite(a), finite), name
        scale = max(float(np.max(np.abs(b[finite]), initial=0.0)), 1.0)
        error = float(np.max(np.abs(a[finite] - b[finite]), initial=0.0)) / scale
        assert error <= 2 * EXACT_FLOAT32_RTOL, f"{name}: {error:.2e}"


def test_split_switch_under_vmap(monkeypatch):
    """A vmapped call: the workspace gains the vmapped dimension with the operands (the handler checks it)."""
    case = Case(batch=2, seqlen_q=33, seqlen_k=47, heads_q=4, heads_kv=2, head_dim=64, dtype=jnp.float32)
    q, k, v = (jnp.stack([x, 2 * x]) for x in case.inputs())
    new_call = lambda: jax.jit(jax.vmap(lambda q_, k_, v_: jax_flash.attention(q_, k_, v_, causal=True,
                                                                               float32_precision="highest")))
    monkeypatch.setenv(_ffi_calls.SPLIT_TF32_ENV, "1")
    assert NO_WORKSPACE not in new_call().lower(q, k, v).as_text()
    split = new_call()(q, k, v)
    monkeypatch.setenv(_ffi_calls.SPLIT_TF32_ENV, "0")
    exact = new_call()(q, k, v)
    np.testing.assert_allclose(np.asarray(split), np.asarray(exact), rtol=0,
                               atol=2 * EXACT_FLOAT32_RTOL * float(np.max(np.abs(np.asarray(exact)))))


def test_split_switch_rejects_other_values(monkeypatch):
    q, k, v = Case(dtype=jnp.float32, head_dim=64).inputs()
    monkeypatch.setenv(_ffi_calls.SPLIT_TF32_ENV, "yes")
    with pytest.raises(ValueError, match="JAX_FLASH_SM90_SPLIT_TF32 must be 0 or 1"):
        jax_flash.attention(q, k, v, float32_precision="highest")
