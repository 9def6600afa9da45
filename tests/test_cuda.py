"""The CUDA kernels on a GPU: the same bound as the CPU tests against the float64 reference, agreement with the
CPU handlers on the same inputs, gradients, determinism and CUDA graphs. Skipped when JAX sees no GPU."""

import dataclasses
import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import _config, _ffi_calls
from attention_cases import (FEATURES, Case, assert_within_bound, backward_call_operand_types, bit_identical_runs,
                              block_structured_mask, feature_kwargs, grads, max_error, oracle, oracle_grads)


def _gpus():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


GPUS = _gpus()
pytestmark = pytest.mark.skipif(not GPUS, reason="no GPU visible to JAX")
CPU = jax.devices("cpu")[0]
HALF_DTYPES = (jnp.bfloat16, jnp.float16)


@pytest.fixture(autouse=True)
def dense_masks_stay_dense(monkeypatch):
    """These tests aim boolean masks at the kernels' mask forms: short calls keep their key-only masks dense rather
    than as kv lengths and segment ids (jax_flash/_key_masks.py, tested against the dense path in
    test_key_masks.py)."""
    monkeypatch.setenv("JAX_FLASH_KEY_MASKS", "0")


def test_built_with_cuda():
    assert jax_flash.BUILT_WITH_CUDA, "a GPU is present but jax_flash was built without its CUDA kernels"


def _poison_gpu_memory():
    """Fill and free a large NaN buffer, so outputs the kernels fail to write are likely to read back NaN."""
    poison = jax.device_put(jnp.full((64 << 20,), jnp.nan, jnp.float32), GPUS[0])
    poison.block_until_ready()
    del poison


def _on(device, *arrays):
    return [jax.device_put(a, device) for a in arrays]


# Forward kernel families (csrc/cuda/README.md): the forward tests run through each one, forced by
# JAX_FLASH_CUDA_KERNEL (read by the C++ dispatcher at every call). sm90 runs only on compute capability 9.x and
# where its TMA loads apply (head_dim a multiple of 8); elsewhere the automatic choice is sm80, tested as such.
FORWARD_KERNELS = ("sm80", "sm90")


def _is_hopper():
    return _config.gpus_are_hopper()  # the library's own test, which also sets the float32 paths' defaults


def use_forward_kernel(monkeypatch, kernel: str, head_dim: int):
    if kernel == "sm90" and not _is_hopper():
        pytest.skip("the sm90 kernel needs a compute capability 9.x GPU")
    if kernel == "sm90" and head_dim % 8 != 0:
        pytest.skip("the sm90 kernel needs head_dim % 8 == 0 (TMA); such calls run on sm80")
    monkeypatch.setenv("JAX_FLASH_CUDA_KERNEL", kernel)


def check_forward_on_gpu(case: Case, inputs=None, **kwargs):
    """The GPU forward of case.inputs() (or of `inputs`, q k v in the case's dtype) within the accuracy bound;
    returns the GPU's output and lse."""
    q, k, v = case.inputs() if inputs is None else inputs
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
    return o, lse


@pytest.mark.parametrize("kernel", FORWARD_KERNELS)
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("head_dim", (32, 64, 96, 128, 192, 256, 7, 40, 100))
@pytest.mark.parametrize("seqlens", ((1, 1), (17, 17), (128, 128), (1000, 1000), (17, 300), (300, 17), (1, 1000)),
                         ids=lambda s: f"{s[0]}x{s[1]}")
def test_forward_shapes(dtype, head_dim, seqlens, kernel, monkeypatch):
    use_forward_kernel(monkeypatch, kernel, head_dim)
    case = Case(seqlen_q=seqlens[0], seqlen_k=seqlens[1], head_dim=head_dim, dtype=dtype, seed=head_dim)
    check_forward_on_gpu(case, causal=(seqlens[0] + head_dim) % 2 == 0)


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("seqlens", ((33, 33), (40, 300), (300, 40)), ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("heads", ((4, 4), (8, 2), (4, 1)), ids=("mha", "gqa", "mqa"))
@pytest.mark.parametrize("kernel", FORWARD_KERNELS)
def test_forward_features(feature, dtype, seqlens, heads, kernel, monkeypatch):
    use_forward_kernel(monkeypatch, kernel, 64)
    case = Case(seqlen_q=seqlens[0], seqlen_k=seqlens[1], heads_q=heads[0], heads_kv=heads[1], head_dim=64,
                dtype=dtype, seed=len(feature))
    check_forward_on_gpu(case, **feature_kwargs(feature, case))


@pytest.mark.parametrize("head_dim", (128, 64))
@pytest.mark.parametrize("feature", ("none", "causal", "everything"))
def test_forward_sm90_long_sequences(feature, head_dim, monkeypatch):
    """Many key tiles through the sm90 pipeline (stages wrap around several times), GQA, ragged lengths;
    seqlen_k > 2048 runs one CTA per tile, at d=64 in the common form's 192-row tile (three consumers)."""
    use_forward_kernel(monkeypatch, "sm90", head_dim)
    case = Case(batch=2, seqlen_q=1500, seqlen_k=2100, heads_q=8, heads_kv=2, head_dim=head_dim, dtype=jnp.bfloat16,
                seed=11)
    check_forward_on_gpu(case, **feature_kwargs(feature, case))


@pytest.mark.parametrize("head_dim", (96, 192))
@pytest.mark.parametrize("feature", ("softcap", "alibi_batched_causal", "everything", "bias", "mask"))
def test_forward_sm90_forms_at_head_dims_96_and_192(feature, head_dim, monkeypatch):
    """The transforms form (softcap / ALiBi) and the dense form (bias / mask) on the d=96 and d=192 tiles, which
    the forward_shapes grid reaches only through the common form; GQA and ragged tiles."""
    use_sm90_dense(monkeypatch, head_dim)
    case = Case(**{**DENSE_CASE.__dict__, "head_dim": head_dim, "seed": head_dim})
    if feature == "bias":
        kwargs = dict(bias=jax.random.normal(jax.random.key(head_dim), GPU_BIAS_SHAPES[0], jnp.float32), causal=True)
    elif feature == "mask":
        kwargs = dict(mask=_padding_mask([203, 90], case.seqlen_k))
    else:
        kwargs = feature_kwargs(feature, case)
    check_forward_on_gpu(case, **kwargs)


def test_automatic_forward_kernel_is_sm90_on_hopper(monkeypatch):
    """On a 9.x GPU the default forward is bit-identical to the forced sm90 kernel (both deterministic)."""
    if not _is_hopper():
        pytest.skip("needs a compute capability 9.x GPU")
    q, k, v = _on(GPUS[0], *Case(seqlen_q=300, seqlen_k=300, head_dim=128, dtype=jnp.bfloat16).inputs())
    outputs = {}
    for kernel in ("auto", "sm90"):
        monkeypatch.setenv("JAX_FLASH_CUDA_KERNEL", kernel)
        outputs[kernel] = np.asarray(jax_flash.attention(q, k, v, causal=True).astype(jnp.float32))
    np.testing.assert_array_equal(outputs["auto"], outputs["sm90"])


@pytest.mark.parametrize("seqlen_k", (700, 2100), ids=("persistent-by-default", "per-tile-by-default"))
def test_sm90_forward_grid_modes_are_bit_identical(seqlen_k, monkeypatch):
    """JAX_FLASH_SM90_PERSISTENT: auto (persistent where seqlen_k <= 2048), forced one CTA per tile and forced
    persistent (capped at 2 CTAs, so that each CTA loops over many tiles) run the same tile code: identical
    outputs. Any other value is an error naming the variable."""
    use_forward_kernel(monkeypatch, "sm90", 64)
    q, k, v = _on(GPUS[0], *Case(batch=2, seqlen_q=900, seqlen_k=seqlen_k, heads_q=4, heads_kv=2, head_dim=64,
                                 dtype=jnp.bfloat16, seed=21).inputs())
    outputs = {}
    for mode, ctas in (("0", ""), ("1", "2"), ("auto", "")):
        monkeypatch.setenv("JAX_FLASH_SM90_PERSISTENT", mode)
        monkeypatch.setenv("JAX_FLASH_SM90_PERSISTENT_CTAS", ctas)
        o, lse = jax_flash.attention(q, k, v, causal=True, return_lse=True)
        outputs[mode] = (np.asarray(o.astype(jnp.float32)), np.asarray(lse))
    for mode in ("1", "auto"):
        np.testing.assert_array_equal(outputs[mode][0], outputs["0"][0])
        np.testing.assert_array_equal(outputs[mode][1], outputs["0"][1])
    monkeypatch.setenv("JAX_FLASH_SM90_PERSISTENT", "yes")
    with pytest.raises(Exception, match="JAX_FLASH_SM90_PERSISTENT"):
        jax.block_until_ready(jax_flash.attention(q, k, v))


def test_sm90_causal_bands_are_bit_identical(monkeypatch):
    """JAX_FLASH_SM90_CAUSAL_BAND_MIB only reorders the causal grid's tiles (forward_kernel.h split_tile): one band
    of every slice ("0"), the default, and 1 MiB bands, which with 2048 keys at d=64 and GQA group 2 hold 4 of the
    6 slices (a narrower last band of 2), on the persistent grid capped at 2 CTAs and on one CTA per tile, give
    identical outputs. A value that is not a whole number of MiB is an error naming the variable."""
    use_forward_kernel(monkeypatch, "sm90", 64)
    q, k, v = _on(GPUS[0], *Case(batch=3, seqlen_q=900, seqlen_k=2048, heads_q=2, heads_kv=1, head_dim=64,
                                 dtype=jnp.bfloat16, seed=23).inputs())
    outputs = {}
    for band, persistent, ctas in (("0", "auto", ""), ("auto", "auto", ""), ("1", "1", "2"), ("1", "0", "")):
        monkeypatch.setenv("JAX_FLASH_SM90_CAUSAL_BAND_MIB", band)
        monkeypatch.setenv("JAX_FLASH_SM90_PERSISTENT", persistent)
        monkeypatch.setenv("JAX_FLASH_SM90_PERSISTENT_CTAS", ctas)
        o, lse = jax_flash.attention(q, k, v, causal=True, return_lse=True)
        outputs[band, persistent] = (np.asarray(o.astype(jnp.float32)), np.asarray(lse))
    baseline = outputs["0", "auto"]
    assert np.isfinite(baseline[0]).all() and np.isfinite(baseline[1]).all()
    for key, (o, lse) in outputs.items():
        np.testing.assert_array_equal(o, baseline[0], err_msg=str(key))
        np.testing.assert_array_equal(lse, baseline[1], err_msg=str(key))
    for bad in ("-1", "16MB"):
        monkeypatch.setenv("JAX_FLASH_SM90_CAUSAL_BAND_MIB", bad)
        with pytest.raises(Exception, match="JAX_FLASH_SM90_CAUSAL_BAND_MIB"):
            jax.block_until_ready(jax_flash.attention(q, k, v, causal=True))


@pytest.mark.parametrize("feature", ("none", "causal", "window_left_causal", "seqlens_causal", "segments"))
def test_sm90_two_per_sm_tile_is_bit_identical(feature, monkeypatch):
    """JAX_FLASH_SM90_TWO_PER_SM=1 runs the common form's 64-row tile with two CTAs per SM (kernel_traits.h
    RowTile::kTwoPerSm). A row's arithmetic is that of the 128-row tile (same key tiles, same order, same WGMMA
    shapes per warpgroup), so outputs and lse are identical to "0", on the persistent grid (by default at 700 keys,
    and capped at 2 CTAs so that each loops over many tiles) and on one CTA per tile. Within the accuracy bound
    too, and any other value is an error naming the variable. The three-per-SM tile is switched off: by default it
    takes the causal calls among those on the two-per-SM tile (its 64-key stages rescale
    differently, so it is not bit-identical; test_sm90_three_per_sm_tile checks it)."""
    use_forward_kernel(monkeypatch, "sm90", 64)
    monkeypatch.setenv("JAX_FLASH_SM90_THREE_PER_SM", "0")
    case = Case(batch=2, seqlen_q=1000, seqlen_k=700, heads_q=4, heads_kv=2, head_dim=64, dtype=jnp.bfloat16,
                seed=31)
    kwargs = feature_kwargs(feature, case)
    kwargs_gpu = {n: jax.device_put(a, GPUS[0]) if isinstance(a, jax.Array) else a for n, a in kwargs.items()}
    q, k, v = _on(GPUS[0], *case.inputs())
    outputs = {}
    for tile, persistent, ctas in (("0", "auto", ""), ("1", "auto", ""), ("1", "1", "2"), ("1", "0", "")):
        monkeypatch.setenv("JAX_FLASH_SM90_TWO_PER_SM", tile)
        monkeypatch.setenv("JAX_FLASH_SM90_PERSISTENT", persistent)
        monkeypatch.setenv("JAX_FLASH_SM90_PERSISTENT_CTAS", ctas)
        _poison_gpu_memory()
        o, lse = jax_flash.attention(q, k, v, return_lse=True, **kwargs_gpu)
        outputs[tile, persistent] = (np.asarray(o.astype(jnp.float32)), np.asarray(lse))
    baseline = outputs["0", "auto"]
    assert not np.isnan(baseline[0]).any() and not np.isnan(baseline[1]).any()
    for key, (o, lse) in outputs.items():
        np.testing.assert_array_equal(o, baseline[0], err_msg=str(key))
        np.testing.assert_array_equal(lse, baseline[1], err_msg=str(key))
    monkeypatch.setenv("JAX_FLASH_SM90_PERSISTENT", "auto")
    monkeypatch.setenv("JAX_FLASH_SM90_PERSISTENT_CTAS", "")
    monkeypatch.setenv("JAX_FLASH_SM90_TWO_PER_SM", "1")
    check_forward_on_gpu(case, **kwargs)
    monkeypatch.setenv("JAX_FLASH_SM90_TWO_PER_SM", "2")
    with pytest.raises(Exception, match="JAX_FLASH_SM90_TWO_PER_SM"):
        jax.block_until_ready(jax_flash.attention(q, k, v))


def rising_score_inputs(case: Case):
    """case.inputs() with scores that rise steadily towards the first key, by ~20 (natural units) over the keys:
    q's first component is shifted by 4, k's by a ramp from 40 (first key) to 0 (last key). The Hopper forward
    walks the key tiles last to first, so each row's maximum keeps rising as it goes, in steps of a few log2 units
    per key tile."""
    q, k, v = case.inputs()
    ramp = jnp.linspace(40.0, 0.0, case.seqlen_k)[None, :, None]
    q = q.at[..., 0].add(jnp.asarray(4.0, q.dtype))
    k = k.at[..., 0].add(ramp.astype(k.dtype))
    return q, k, v


@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("head_dim", (64, 128, 256))
def test_sm90_lazy_rescale(head_dim, causal, monkeypatch):
    """The Hopper forward's 16-bit kernels at d >= 128 keep a row's reference maximum until a key tile's maximum
    exceeds it by more than 8 log2 units (forward_kernel.h lazy_rescale, online_softmax.h step;
    JAX_FLASH_SM90_LAZY_RESCALE, on by default). With scores that rise by a few log2 units per key tile
    (rising_score_inputs), rows keep their reference through some tiles and rescale O past others. On ("auto") and
    off ("0") are both within the accuracy bound, output and lse, and differ (the switch is live: a kept reference
    rounds the probabilities differently); d=64 kernels have no lazy rescale, so there the two are bit-identical.
    An invalid value is an error naming the variable."""
    use_forward_kernel(monkeypatch, "sm90", head_dim)
    case = Case(batch=2, seqlen_q=1000, seqlen_k=1000, heads_q=4, heads_kv=2, head_dim=head_dim,
                dtype=jnp.bfloat16, seed=61 + head_dim)
    inputs = rising_score_inputs(case)
    q, k, v = _on(GPUS[0], *inputs)
    outputs = {}
    for setting in ("auto", "0"):
        monkeypatch.setenv("JAX_FLASH_SM90_LAZY_RESCALE", setting)
        o, lse = check_forward_on_gpu(case, inputs=inputs, causal=causal)
        outputs[setting] = (np.asarray(o.astype(jnp.float32)), np.asarray(lse))
    if head_dim == 64:
        np.testing.assert_array_equal(outputs["auto"][0], outputs["0"][0])
        np.testing.assert_array_equal(outputs["auto"][1], outputs["0"][1])
    else:
        assert not np.array_equal(outputs["auto"][0], outputs["0"][0])
    monkeypatch.setenv("JAX_FLASH_SM90_LAZY_RESCALE", "2")
    with pytest.raises(Exception, match="JAX_FLASH_SM90_LAZY_RESCALE"):
        jax.block_until_ready(jax_flash.attention(q, k, v))


@pytest.mark.parametrize("keys", (64, 96))
@pytest.mark.parametrize("grid", ("persistent", "persistent-2-ctas", "per-tile"))
@pytest.mark.parametrize("feature", ("none", "causal", "window_left_causal", "seqlens_causal", "segments"))
def test_sm90_three_per_sm_tile(feature, grid, keys, monkeypatch):
    """JAX_FLASH_SM90_THREE_PER_SM=1 runs every d=64 two-per-SM call (by default only the causal ones) on a
    64-row tile with 64-key stages, three CTAs per SM, or with JAX_FLASH_SM90_WIDE_KEYS=1 two 96-key stages (by
    default from 1025 keys). Its rows see the keys in 64- or 96-key steps (the 128-key tile's rescaling differs), so
    it is checked against the accuracy bound, not bit for bit. A bad value is an error."""
    use_forward_kernel(monkeypatch, "sm90", 64)
    monkeypatch.setenv("JAX_FLASH_SM90_TWO_PER_SM", "1")
    monkeypatch.setenv("JAX_FLASH_SM90_THREE_PER_SM", "1")
    monkeypatch.setenv("JAX_FLASH_SM90_WIDE_KEYS", "1" if keys == 96 else "0")
    monkeypatch.setenv("JAX_FLASH_SM90_PERSISTENT", "0" if grid == "per-tile" else "1")
    monkeypatch.setenv("JAX_FLASH_SM90_PERSISTENT_CTAS", "2" if grid == "persistent-2-ctas" else "")
    case = Case(batch=2, seqlen_q=1000, seqlen_k=700, heads_q=4, heads_kv=2, head_dim=64, dtype=jnp.bfloat16,
                seed=41 + len(feature))
    check_forward_on_gpu(case, **feature_kwargs(feature, case))
    monkeypatch.setenv("JAX_FLASH_SM90_THREE_PER_SM", "3")
    q, k, v = _on(GPUS[0], *case.inputs())
    with pytest.raises(Exception, match="JAX_FLASH_SM90_THREE_PER_SM"):
        jax.block_until_ready(jax_flash.attention(q, k, v))


@pytest.mark.parametrize("grid", ("persistent-2-ctas", "per-tile"))
@pytest.mark.parametrize("feature", ("none", "causal", "window_left_causal", "seqlens_causal", "segments"))
@pytest.mark.parametrize("head_dim", (64, 128, 192, 256))
def test_sm90_wide_keys_tile(head_dim, feature, grid, monkeypatch):
    """JAX_FLASH_SM90_WIDE_KEYS=1 runs the common form's calls on the wide-keys tiles (kernel_traits.h
    RowTile::kWideKeys: d=64/128/192/256 192/176/112/80-key stages; at d=64 also kTwoPerSmWideKeys, taken here on the
    persistent grid and the 128-row one on the per-tile grid; off by default until measured). 700 and 1000 keys end in
    a partial key tile (the first one each row block visits). Checked against the accuracy bound (rows rescale at
    other key steps than on the standard tile), lse included, float16 for the causal case; a bad value is an error
    naming the variable."""
    use_forward_kernel(monkeypatch, "sm90", head_dim)
    monkeypatch.setenv("JAX_FLASH_SM90_WIDE_KEYS", "1")
    monkeypatch.setenv("JAX_FLASH_SM90_TWO_PER_SM", "0" if grid == "per-tile" else "1")
    monkeypatch.setenv("JAX_FLASH_SM90_THREE_PER_SM", "0")  # else short causal d=64 calls take the three-per-SM tile
    monkeypatch.setenv("JAX_FLASH_SM90_PERSISTENT", "0" if grid == "per-tile" else "1")
    monkeypatch.setenv("JAX_FLASH_SM90_PERSISTENT_CTAS", "2" if grid == "persistent-2-ctas" else "")
    case = Case(batch=2, seqlen_q=1000, seqlen_k=700 if feature == "none" else 1000, heads_q=4, heads_kv=2,
                head_dim=head_dim, dtype=jnp.float16 if feature == "causal" else jnp.bfloat16,
                seed=head_dim + len(feature))
    check_forward_on_gpu(case, **feature_kwargs(feature, case))
    monkeypatch.setenv("JAX_FLASH_SM90_WIDE_KEYS", "2")
    q, k, v = _on(GPUS[0], *case.inputs())
    with pytest.raises(Exception, match="JAX_FLASH_SM90_WIDE_KEYS"):
        jax.block_until_ready(jax_flash.attention(q, k, v))


def test_forcing_sm90_on_an_unsupported_call_is_a_clear_error(monkeypatch):
    if not _is_hopper():
        pytest.skip("needs a compute capability 9.x GPU")
    monkeypatch.setenv("JAX_FLASH_CUDA_KERNEL", "sm90")
    q, k, v = _on(GPUS[0], *Case(head_dim=7, dtype=jnp.bfloat16).inputs())
    with pytest.raises(Exception, match="sm90"):
        jax.block_until_ready(jax_flash.attention(q, k, v))


def check_gradients_on_gpu(case: Case, deterministic=False, **kwargs):
    q, k, v = case.inputs()
    d_o = jax.random.normal(jax.random.key(case.seed + 99), q.shape, jnp.float32).astype(case.dtype)
    # A cotangent for lse too (softmax_d = rowsum(dO * O) - dlse in every backward kernel).
    d_lse = jax.random.normal(jax.random.key(case.seed + 98), (q.shape[0], q.shape[2], q.shape[1]), jnp.float32)
    kwargs_gpu = {n: jax.device_put(a, GPUS[0]) if isinstance(a, jax.Array) else a for n, a in kwargs.items()}
    _poison_gpu_memory()
    ours = grads(*_on(GPUS[0], q, k, v, d_o), d_lse=jax.device_put(d_lse, GPUS[0]), deterministic=deterministic,
                 **kwargs_gpu)
    cpu = grads(*_on(CPU, q, k, v, d_o), d_lse=jax.device_put(d_lse, CPU), **kwargs)
    xla = grads(*_on(CPU, q, k, v, d_o), implementation="xla", d_lse=jax.device_put(d_lse, CPU), **kwargs)
    reference = oracle_grads(q, k, v, d_o, d_lse=d_lse, **kwargs)
    for name, g, g_cpu, g_xla, g_ref in zip(("dq", "dk", "dv"), ours, cpu, xla, reference):
        assert_within_bound(name, g, g_xla, g_ref, case.dtype, scale=4.0)
        assert_within_bound(name + " vs CPU", g, g_xla, np.asarray(g_cpu.astype(jnp.float32)), case.dtype, scale=4.0)


# Backward kernel families: sm80 and the Hopper backward (the default on 9.x where it applies), each forced through
# JAX_FLASH_CUDA_KERNEL_BACKWARD (read by the C++ dispatcher at every call). Forced to sm90, a call it cannot run is
# an error, so the skips below never hide a silent fallback to sm80.
BACKWARD_KERNELS = ("sm80", "sm90")
# Every feature of FEATURES: softcap and ALiBi run its transforms form (bias, boolean masks and dropout, which it
# refuses, are not in FEATURES).
SM90_BACKWARD_FEATURES = ("none", "causal", "window", "window_left_causal", "softcap", "alibi", "alibi_batched_causal",
                          "seqlens", "seqlens_causal", "segments", "everything")
# The features of the sm90 backward's transforms form (softcap/ALiBi), which has no d=256 kernel.
SM90_TRANSFORMS_FEATURES = ("softcap", "alibi", "alibi_batched_causal", "everything")


@functools.cache
def _sm90_backward_refusal() -> str:
    """Empty when this GPU and build run the sm90 backward, else why not (probed once with a tiny call)."""
    if not _is_hopper():
        return "the sm90 backward needs a compute capability 9.x GPU"
    previous = os.environ.get("JAX_FLASH_CUDA_KERNEL_BACKWARD")
    os.environ["JAX_FLASH_CUDA_KERNEL_BACKWARD"] = "sm90"
    try:
        q = jax.device_put(jnp.ones((1, 8, 1, 64), jnp.bfloat16), GPUS[0])
        jax.block_until_ready(jax.grad(lambda x: jnp.sum(jax_flash.attention(x, x, x).astype(jnp.float32)))(q))
        return ""
    except Exception as error:  # noqa: BLE001 - only a build without the kernels is a reason to skip
        if "no sm_90a backward kernel" in str(error):
            return "this build has no sm_90a backward kernels (JAX_FLASH_CUDA_ARCHS without 90a)"
        raise
    finally:
        if previous is None:
            os.environ.pop("JAX_FLASH_CUDA_KERNEL_BACKWARD", None)
        else:
            os.environ["JAX_FLASH_CUDA_KERNEL_BACKWARD"] = previous


def use_backward_kernel(monkeypatch, kernel: str, head_dim: int, feature: str = "none"):
    if kernel == "sm90":
        if reason := _sm90_backward_refusal():
            pytest.skip(reason)
        if head_dim % 8 != 0 or head_dim > 256:
            pytest.skip("the sm90 backward has d=64, d=128 and d=256 kernels (TMA: head_dim % 8 == 0)")
        if feature not in SM90_BACKWARD_FEATURES:
            pytest.skip(f"{feature} runs on the sm80 backward only")
        if feature in SM90_TRANSFORMS_FEATURES and head_dim > 128:
            pytest.skip(f"{feature} at head_dim > 128 runs on the sm80 backward (no d=256 transforms form)")
    monkeypatch.setenv("JAX_FLASH_CUDA_KERNEL_BACKWARD", kernel)


@pytest.mark.parametrize("kernel", BACKWARD_KERNELS)
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("head_dim", (32, 64, 96, 128, 192, 256, 7, 40, 100))
@pytest.mark.parametrize("seqlens", ((1, 1), (17, 17), (1000, 1000), (64, 300), (300, 64)),
                         ids=lambda s: f"{s[0]}x{s[1]}")
def test_backward_shapes(dtype, head_dim, seqlens, kernel, monkeypatch):
    use_backward_kernel(monkeypatch, kernel, head_dim)
    case = Case(seqlen_q=seqlens[0], seqlen_k=seqlens[1], head_dim=head_dim, dtype=dtype, seed=head_dim + 1)
    # Causal alternates along the shapes, so every head dim runs both.
    check_gradients_on_gpu(case, causal=(seqlens[0] + head_dim) % 2 == 0)


@pytest.mark.parametrize("kernel", BACKWARD_KERNELS)
@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("heads", ((4, 4), (8, 2), (4, 1)), ids=("mha", "gqa", "mqa"))
@pytest.mark.parametrize("seqlens", ((40, 300), (300, 40)), ids=lambda s: f"{s[0]}x{s[1]}")
def test_backward_features(feature, heads, seqlens, kernel, monkeypatch):
    use_backward_kernel(monkeypatch, kernel, 64, feature)
    case = Case(seqlen_q=seqlens[0], seqlen_k=seqlens[1], heads_q=heads[0], heads_kv=heads[1], head_dim=64,
                dtype=jnp.bfloat16, seed=len(feature) + 1)
    check_gradients_on_gpu(case, **feature_kwargs(feature, case))


@pytest.mark.parametrize("head_dim", (128, 256))
@pytest.mark.parametrize("feature", ("causal", "seqlens_causal", "segments", "softcap", "alibi_batched_causal",
                                     "everything"))
def test_backward_sm90_long_sequences(feature, head_dim, monkeypatch):
    """Many query and key tiles through the sm90 backward's pipelines (stages wrap), the GQA group loop (whose
    query heads have ALiBi slopes of their own); softcap and ALiBi in the transforms form (d=128 only); d=256 is
    the split-head-dim dK/dV kernel and the 32-key-tile dQ kernel."""
    use_backward_kernel(monkeypatch, "sm90", head_dim, feature)
    case = Case(batch=2, seqlen_q=1500, seqlen_k=2100, heads_q=8, heads_kv=2, head_dim=head_dim, dtype=jnp.bfloat16,
                seed=12)
    check_gradients_on_gpu(case, **feature_kwargs(feature, case))


# The transforms-form features have no d=256 kernel (they run on sm80 there): left out rather than always skipped.
@pytest.mark.parametrize("feature", [f for f in SM90_BACKWARD_FEATURES if f not in SM90_TRANSFORMS_FEATURES])
@pytest.mark.parametrize("heads", ((4, 4), (4, 1)), ids=("mha", "mqa"))
@pytest.mark.parametrize("seqlens", ((40, 300), (300, 40), (333, 517)), ids=lambda s: f"{s[0]}x{s[1]}")
def test_backward_sm90_hdim256_features(feature, heads, seqlens, monkeypatch):
    """Every mask the sm90 backward takes at d=256 (two consumer warpgroups sharing 64 keys, P^T/dS^T through
    shared memory), ragged query and key tiles, the MQA group loop."""
    use_backward_kernel(monkeypatch, "sm90", 256, feature)
    case = Case(seqlen_q=seqlens[0], seqlen_k=seqlens[1], heads_q=heads[0], heads_kv=heads[1], head_dim=256,
                dtype=jnp.bfloat16, seed=len(feature) + 7)
    check_gradients_on_gpu(case, **feature_kwargs(feature, case))


@pytest.mark.parametrize("kernel", BACKWARD_KERNELS)
@pytest.mark.parametrize("dq_mode", ("fused", "separate"))
@pytest.mark.parametrize("feature", ("none", "causal", "seqlens_causal", "window", "segments", "softcap",
                                     "alibi_batched_causal"))
@pytest.mark.parametrize("head_dim", (64, 128, 120, 256, 36, 33))
def test_backward_dq_modes(feature, head_dim, dq_mode, kernel, monkeypatch):
    """Both ways to dQ of either backward family: fused (the default, JAX_FLASH_FUSED_DQ=1: dQ summed in the
    dK/dV pass into a float32 workspace) and the separate dQ pass (=0). Several key tiles add into each dQ row,
    ragged edges, GQA, head dims below the tile width (120 on d=128; sm80 only: 36 and an odd 33, element-wise
    loads and pairs that are not 8-byte aligned), d=256 (no workspace). Softcap and ALiBi: the sm90 transforms
    form fuses dQ like the common form; sm80's general variant always runs its dQ pass. head_dim < 64 and > 128 get
    no workspace (jax_flash/_ffi_calls.py), so both modes run that pass.
    Fused here includes head_dim 64 (_FUSED_DQ_MIN_HEAD_DIM set to 64, the default since the sixth session), so
    that the d=64 fused forms stay tested should the default move back."""
    use_backward_kernel(monkeypatch, kernel, head_dim, feature)
    monkeypatch.setenv("JAX_FLASH_FUSED_DQ", "1" if dq_mode == "fused" else "0")
    monkeypatch.setattr(_ffi_calls, "_FUSED_DQ_MIN_HEAD_DIM", 64)
    case = Case(batch=2, seqlen_q=700, seqlen_k=900, heads_q=8, heads_kv=2, head_dim=head_dim, dtype=jnp.bfloat16,
                seed=head_dim + len(feature))
    check_gradients_on_gpu(case, **feature_kwargs(feature, case))


@pytest.mark.parametrize("dq_mode", ("fused", "separate"))
@pytest.mark.parametrize("band_mib", ("1", "3", "4096"))
@pytest.mark.parametrize("head_dim", (64, 128))
def test_backward_sm90_causal_bands(head_dim, band_mib, dq_mode, monkeypatch):
    """The sm90 dK/dV pass's causal CTA order in bands of slices (JAX_FLASH_SM90_BWD_CAUSAL_BAND_MIB): 3 slices
    (batch 3, one KV head of 4 query heads) of Q, dO and float32 dQ rows taking ~1.4 MiB (d=64) / ~2.7 MiB (d=128)
    each, so 1 MiB makes bands of one slice, 3 MiB bands of two at d=64 (the last one narrower) and of one at
    d=128, 4096 one band of all three."""
    use_backward_kernel(monkeypatch, "sm90", head_dim, "causal")
    monkeypatch.setenv("JAX_FLASH_SM90_BWD_CAUSAL_BAND_MIB", band_mib)
    monkeypatch.setenv("JAX_FLASH_FUSED_DQ", "1" if dq_mode == "fused" else "0")
    case = Case(batch=3, seqlen_q=700, seqlen_k=900, heads_q=4, heads_kv=1, head_dim=head_dim, dtype=jnp.bfloat16,
                seed=head_dim + len(band_mib))
    check_gradients_on_gpu(case, **feature_kwargs("causal", case))


@pytest.mark.parametrize("dq_mode", ("fused", "deterministic"))
@pytest.mark.parametrize("feature", ("none", "causal", "window_left_causal", "seqlens_causal", "segments", "softcap",
                                     "alibi_batched_causal"))
@pytest.mark.parametrize("head_dim", (64, 96, 40))
def test_backward_sm90_persistent_grid(feature, head_dim, dq_mode, monkeypatch):
    """JAX_FLASH_SM90_BWD_PERSISTENT=1: the dK/dV kernels with two K/V buffers (d=64, d=96; 40 on the d=64 kernel)
    loop over key blocks, the pipelines, item counts and K/V buffers carrying over from block to block. Capped at
    1, 2, 3 and 7 CTAs (so that each takes many blocks, of different item counts when causal or windowed) and
    uncapped: dK and dV are bit-identical to one CTA per block (a block's sums do not depend on the CTA that runs
    it), and so is dQ when deterministic (its own pass); fused dQ (bulk float adds in any order) within the bound.
    Any other switch value is an error naming the variable."""
    use_backward_kernel(monkeypatch, "sm90", head_dim, feature)
    built = os.environ.get("JAX_FLASH_CUDA_SM90_HEAD_DIMS")  # set when the build being tested was narrowed by it
    if head_dim == 96 and built and "96" not in built.split(";"):
        pytest.skip("no d=96 sm90 kernels in this build: d=96 would run the d=128 dK/dV kernel, which has no "
                    "persistent grid")
    deterministic = dq_mode == "deterministic"
    case = Case(batch=2, seqlen_q=700, seqlen_k=900, heads_q=8, heads_kv=2, head_dim=head_dim, dtype=jnp.bfloat16,
                seed=head_dim + len(feature) + 7)
    kwargs = feature_kwargs(feature, case)
    q, k, v = case.inputs()
    d_o = jax.random.normal(jax.random.key(case.seed + 99), q.shape, jnp.float32).astype(case.dtype)
    on_gpu = _on(GPUS[0], q, k, v, d_o)
    outputs = {}
    for persistent, ctas in (("0", ""), ("1", "1"), ("1", "2"), ("1", "3"), ("1", "7"), ("1", "")):
        monkeypatch.setenv("JAX_FLASH_SM90_BWD_PERSISTENT", persistent)
        monkeypatch.setenv("JAX_FLASH_SM90_BWD_PERSISTENT_CTAS", ctas)
        _poison_gpu_memory()
        outputs[persistent, ctas] = [np.asarray(g.astype(jnp.float32))
                                     for g in grads(*on_gpu, deterministic=deterministic, **_gpu_kwargs(kwargs))]
    baseline = outputs["0", ""]
    assert all(np.isfinite(g).all() for g in baseline)
    for key, (dq, dk, dv) in outputs.items():
        np.testing.assert_array_equal(dk, baseline[1], err_msg=f"dk {key}")
        np.testing.assert_array_equal(dv, baseline[2], err_msg=f"dv {key}")
        if deterministic:
            np.testing.assert_array_equal(dq, baseline[0], err_msg=f"dq {key}")
    monkeypatch.setenv("JAX_FLASH_SM90_BWD_PERSISTENT", "1")
    monkeypatch.setenv("JAX_FLASH_SM90_BWD_PERSISTENT_CTAS", "3")
    check_gradients_on_gpu(case, deterministic=deterministic, **kwargs)
    for variable, bad in (("JAX_FLASH_SM90_BWD_PERSISTENT", "yes"), ("JAX_FLASH_SM90_BWD_PERSISTENT_CTAS", "0")):
        monkeypatch.setenv(variable, bad)
        with pytest.raises(Exception, match=variable):
            jax.block_until_ready(grads(*on_gpu, deterministic=deterministic, **_gpu_kwargs(kwargs)))
        monkeypatch.setenv(variable, "1" if variable == "JAX_FLASH_SM90_BWD_PERSISTENT" else "3")


def test_backward_sm90_causal_band_switch_rejects_bad_values(monkeypatch):
    use_backward_kernel(monkeypatch, "sm90", 64, "causal")
    monkeypatch.setenv("JAX_FLASH_SM90_BWD_CAUSAL_BAND_MIB", "wide")
    q, k, v = _on(GPUS[0], *Case(head_dim=64, dtype=jnp.bfloat16).inputs())
    with pytest.raises(Exception, match="JAX_FLASH_SM90_BWD_CAUSAL_BAND_MIB must be"):
        jax.block_until_ready(jax.grad(lambda q_: jnp.sum(
            jax_flash.attention(q_, k, v, causal=True).astype(jnp.float32)))(q))


@pytest.mark.parametrize("feature", ("none", "segments"))
@pytest.mark.parametrize("heads", ((140, 140), (280, 70)), ids=("mha", "gqa"))
@pytest.mark.parametrize("head_dim", (64, 128))
def test_sm80_fused_backward_splits_its_last_wave(head_dim, heads, feature, monkeypatch):
    """More key blocks than one wave, and not a whole number of waves (on the H200's 132 SMs: 560 blocks of 128 keys
    are 4 waves and 32 blocks over), so the fused dK/dV pass splits the last blocks' items across every SM
    (csrc/cuda/sm80/dkdv_tail_plan.h): whole-block CTAs, then pieces of the last blocks adding into their slots, the
    slots' conversion. test_backward_dq_modes' none / segments cases (fewer blocks than SMs) split too."""
    use_backward_kernel(monkeypatch, "sm80", head_dim, feature)
    monkeypatch.setenv("JAX_FLASH_FUSED_DQ", "1")
    case = Case(batch=1, seqlen_q=512, seqlen_k=512, heads_q=heads[0], heads_kv=heads[1], head_dim=head_dim,
                dtype=jnp.bfloat16, seed=head_dim + heads[1])
    check_gradients_on_gpu(case, **feature_kwargs(feature, case))


def test_forcing_sm90_backward_on_an_unsupported_call_is_a_clear_error(monkeypatch):
    use_backward_kernel(monkeypatch, "sm90", 64)
    case = Case(head_dim=64, dtype=jnp.bfloat16)
    q, k, v = _on(GPUS[0], *case.inputs())
    bias = jax.device_put(jnp.zeros((case.batch, case.heads_q, case.seqlen_q, case.seqlen_k), jnp.float32), GPUS[0])
    with pytest.raises(Exception, match="sm90 backward cannot run this call: bias"):
        jax.block_until_ready(jax.grad(lambda q_: jnp.sum(
            jax_flash.attention(q_, k, v, bias=bias).astype(jnp.float32)))(q))


@pytest.mark.parametrize("kernel", BACKWARD_KERNELS)
@pytest.mark.parametrize("feature", ("causal", "seqlens_causal", "everything"))
@pytest.mark.parametrize("head_dim", (128, 256))
def test_deterministic_backward_is_bit_identical(feature, kernel, head_dim, monkeypatch):
    use_backward_kernel(monkeypatch, kernel, head_dim, feature)
    case = Case(batch=2, seqlen_q=1000, seqlen_k=1500, heads_q=8, heads_kv=2, head_dim=head_dim, dtype=jnp.bfloat16)
    q, k, v = _on(GPUS[0], *case.inputs())
    d_o = jax.device_put(jax.random.normal(jax.random.key(3), q.shape, jnp.bfloat16), GPUS[0])
    kwargs = {n: jax.device_put(a, GPUS[0]) if isinstance(a, jax.Array) else a
              for n, a in feature_kwargs(feature, case).items()}
    bit_identical_runs(lambda: grads(q, k, v, d_o, deterministic=True, **kwargs))


_GRAPH_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np, jax_flash
q, k, v = (jax.random.normal(jax.random.key(i), (2, 512, 8, 64), jnp.bfloat16) for i in range(3))
@jax.jit
def step(q, k, v):
    loss = lambda q_, k_, v_: jnp.mean(jax_flash.attention(q_, k_, v_, causal=%(causal)s).astype(jnp.float32) ** 2)
    return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)
first = step(q, k, v)
for _ in range(3):
    again = step(q, k, v)
def close(a, b, rtol=%(rtol)s):  # rtol 0: bit-identical
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return bool(np.all(np.abs(a - b) <= rtol * np.abs(b).max()))
print(float(first[0]), all(close(a, b) for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again))))
"""


# The default families, causal (reruns bit-identical); and the sm80 backward non-causal, whose fused pass splits
# its key blocks into pieces (csrc/cuda/sm80/dkdv_tail_plan.h: its four launches inside the graph; dK/dV of split
# blocks sum in any order, so reruns agree to bf16 rounding).
@pytest.mark.parametrize("backward_family, causal, rtol", (("auto", True, 0.0), ("sm80", False, 1e-2)),
                         ids=("default_causal", "sm80_split_tail"))
def test_training_step_under_cuda_graphs(backward_family, causal, rtol):
    """XLA command buffers (CUDA graphs) on, custom calls included: same results as without them."""
    outputs = []
    script = _GRAPH_SCRIPT % {"causal": causal, "rtol": rtol}
    for flags in ("--xla_gpu_enable_command_buffer=", "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL "
                  "--xla_gpu_graph_min_graph_size=1"):
        env = dict(os.environ, XLA_FLAGS=flags, JAX_FLASH_CUDA_KERNEL_BACKWARD=backward_family)
        result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                                timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        outputs.append(result.stdout.split())
    assert outputs[0][1] == "True" and outputs[1][1] == "True"
    np.testing.assert_allclose(float(outputs[0][0]), float(outputs[1][0]), rtol=1e-6)


# ---- additive bias, boolean mask, dropout (the kernels' general variant) ------------------------------------

from jax_flash import _dropout  # noqa: E402

DENSE_CASE = Case(batch=2, seqlen_q=150, seqlen_k=203, heads_q=4, heads_kv=2, head_dim=64, dtype=jnp.bfloat16,
                  seed=11)
# Full shape (dQ pass stores dbias), broadcast along batch / heads / query / everything (atomics, or the
# deterministic dbias kernel), and key-broadcast shapes (whose dbias jax_flash forms outside the kernel).
GPU_BIAS_SHAPES = [(2, 4, 150, 203), (4, 150, 203), (2, 1, 150, 203), (1, 4, 1, 203), (203,), (2, 1, 150, 1)]


def _gpu_kwargs(kwargs):
    return {n: jax.device_put(a, GPUS[0]) if isinstance(a, jax.Array) else a for n, a in kwargs.items()}


def _grads_with_bias(q, k, v, d_o, bias, implementation=None, **kwargs):
    loss = lambda q_, k_, v_, b_: jnp.sum(
        (jax_flash.attention(q_, k_, v_, bias=b_, implementation=implementation, **kwargs) * d_o).astype(jnp.float32))
    return jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, bias)


@pytest.mark.parametrize("scale", (-0.3, 0.0), ids=("negative", "zero"))
def test_non_positive_softmax_scale(scale):
    """The common kernels fold a positive scale into exp2 after the row max of raw dots; other scales take the
    general variant (found in review: they would give inf/NaN there)."""
    case = Case(batch=2, seqlen_q=70, seqlen_k=150, heads_q=4, heads_kv=2, head_dim=64, dtype=jnp.bfloat16, seed=3)
    check_forward_on_gpu(case, softmax_scale=scale, causal=True)
    check_gradients_on_gpu(case, softmax_scale=scale, causal=True)


def _oracle_grads_with_bias(q, k, v, d_o, bias, **kwargs):
    with jax.enable_x64(True):
        args = [jnp.asarray(x, jnp.float64) for x in (q, k, v, bias)]
        weights = jnp.asarray(d_o, jnp.float64)
        loss = lambda q_, k_, v_, b_: jnp.sum(
            jax_flash.attention(q_, k_, v_, bias=b_, implementation="xla", **kwargs) * weights)
        return [np.asarray(g) for g in jax.grad(loss, argnums=(0, 1, 2, 3))(*args)]


def check_bias_gradients_on_gpu(case: Case, bias, deterministic=False, **kwargs):
    q, k, v = case.inputs()
    d_o = jax.random.normal(jax.random.key(case.seed + 99), q.shape, jnp.float32).astype(case.dtype)
    _poison_gpu_memory()
    ours = _grads_with_bias(*_on(GPUS[0], q, k, v, d_o, bias), deterministic=deterministic, **_gpu_kwargs(kwargs))
    cpu = _grads_with_bias(*_on(CPU, q, k, v, d_o, bias), **kwargs)
    xla = _grads_with_bias(*_on(CPU, q, k, v, d_o, bias), implementation="xla", **kwargs)
    reference = _oracle_grads_with_bias(q, k, v, d_o, bias, **kwargs)
    assert ours[3].shape == bias.shape and ours[3].dtype == jnp.float32
    for name, g, g_cpu, g_xla, g_ref in zip(("dq", "dk", "dv", "dbias"), ours, cpu, xla, reference):
        assert_within_bound(name, g, g_xla, g_ref, case.dtype, scale=4.0)
        assert_within_bound(name + " vs CPU", g, g_xla, np.asarray(g_cpu), case.dtype, scale=4.0)
    return ours


@pytest.mark.parametrize("shape", GPU_BIAS_SHAPES, ids=str)
def test_bias_forward(shape):
    bias = jax.random.normal(jax.random.key(1), shape, jnp.float32)
    check_forward_on_gpu(DENSE_CASE, bias=bias, causal=True)


@pytest.mark.parametrize("deterministic", (False, True), ids=("atomic", "deterministic"))
@pytest.mark.parametrize("shape", GPU_BIAS_SHAPES, ids=str)
def test_bias_gradients(shape, deterministic):
    bias = jax.random.normal(jax.random.key(2), shape, jnp.float32)
    check_bias_gradients_on_gpu(DENSE_CASE, bias, deterministic=deterministic, window_size=(120, 40))


def test_bias_with_softcap_alibi_and_gqa_fp16():
    case = Case(batch=2, seqlen_q=77, seqlen_k=130, heads_q=8, heads_kv=2, head_dim=128, dtype=jnp.float16, seed=5)
    bias = jax.random.normal(jax.random.key(3), (8, 77, 130), jnp.float32)
    kwargs = dict(softcap=4.0, alibi_slopes=jnp.linspace(0.05, 0.4, 8, dtype=jnp.float32))
    check_forward_on_gpu(case, bias=bias, **kwargs)
    check_bias_gradients_on_gpu(case, bias, **kwargs)


def _padding_mask(lengths, seqlen_k):
    return (jnp.arange(seqlen_k)[None, :] < jnp.asarray(lengths)[:, None])[:, None, None, :]


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_padding_mask(dtype):
    case = Case(**{**DENSE_CASE.__dict__, "dtype": dtype})
    mask = _padding_mask([203, 90], case.seqlen_k)
    check_forward_on_gpu(case, mask=mask)
    check_gradients_on_gpu(case, mask=mask)


def _mask_with_blind_rows_and_tiles(case: Case):
    """Random [B, 1, Sq, Sk]: row 5 of batch row 0 and rows 140.. of batch row 1 see nothing, keys 64..139 are hidden
    from rows < 100 (whole hidden key tiles)."""
    i, j = jnp.arange(case.seqlen_q)[:, None], jnp.arange(case.seqlen_k)[None, :]
    mask = jax.random.bernoulli(jax.random.key(4), 0.7, (2, 1, case.seqlen_q, case.seqlen_k))
    return (mask & ((j < 64) | (j >= 140) | (i >= 100))).at[0, :, 5].set(False).at[1, :, 140:].set(False)


def test_mask_with_fully_masked_rows_and_tiles():
    """A random mask with rows that see nothing (o = 0, lse = -inf, finite gradients) and whole hidden key tiles."""
    case = DENSE_CASE
    mask = _mask_with_blind_rows_and_tiles(case)
    kwargs = dict(mask=mask, causal=True)
    check_forward_on_gpu(case, **kwargs)
    q, k, v = _on(GPUS[0], *case.inputs())
    o, lse = jax_flash.attention(q, k, v, return_lse=True, **_gpu_kwargs(kwargs))
    assert np.all(np.isneginf(np.asarray(lse)[0, :, 5])) and np.all(np.asarray(o.astype(jnp.float32))[0, 5] == 0)
    assert np.all(np.isneginf(np.asarray(lse)[1, :, 140:]))
    check_gradients_on_gpu(case, **kwargs)
    d_o = jnp.ones_like(q)
    for g in grads(q, k, v, d_o, **_gpu_kwargs(kwargs)):
        assert np.all(np.isfinite(np.asarray(g.astype(jnp.float32))))


# Masks with whole hidden / visible tiles, which the sm80 kernels skip or read no mask element of, through the
# block summary (jax_flash/_mask_blocks.py). Tiles (rows x keys): forward d=64 128x128, d=128 128x64, d=256 128x32;
# dQ 64x64 (64x32 at d=256); dK/dV 64x128 (64x64 and one Q/dO stage at d=256), over the GQA group's heads.
MASK_BLOCK_SHAPES = {"per_head": (2, 4, 300, 520), "key_padding": (2, 1, 1, 520), "key_broadcast": (1, 4, 300, 1)}


@pytest.mark.parametrize("head_dim", (64, 128, 256))
@pytest.mark.parametrize("shape", tuple(MASK_BLOCK_SHAPES), ids=str)
def test_mask_block_skipping(head_dim, shape):
    case = Case(batch=2, seqlen_q=300, seqlen_k=520, heads_q=4, heads_kv=2, head_dim=head_dim, dtype=jnp.bfloat16,
                seed=head_dim)
    mask = block_structured_mask(MASK_BLOCK_SHAPES[shape], seed=head_dim, region=128)
    if shape == "per_head":  # and a 128-row block of one head that sees nothing
        mask = mask.at[1, 2, 128:256].set(False)
    kwargs = dict(mask=mask, causal=shape == "per_head")
    check_forward_on_gpu(case, **kwargs)
    check_gradients_on_gpu(case, **kwargs)
    q, k, v = _on(GPUS[0], *case.inputs())
    o, lse = jax_flash.attention(q, k, v, return_lse=True, **_gpu_kwargs(kwargs))
    _, lse_ref = oracle(*case.inputs(), **kwargs)
    blind = np.isneginf(lse_ref)
    assert blind.any() or shape == "key_padding"  # row 5 sees nothing where the mask has a query axis
    assert np.all(np.isneginf(np.asarray(lse)[blind]))
    assert np.all(np.asarray(o.astype(jnp.float32)).transpose(0, 2, 1, 3)[blind] == 0)
    for g in grads(q, k, v, jnp.ones_like(q), **_gpu_kwargs(kwargs)):
        assert np.all(np.isfinite(np.asarray(g.astype(jnp.float32))))


# The sm90 backward's masked form (a boolean mask, head_dim <= 128), forced (JAX_FLASH_CUDA_KERNEL_BACKWARD=sm90) so
# that a refusal fails the test instead of falling back to sm80: hidden items skipped by every role of the dK/dV
# kernel and by the dQ kernel, partial items read per element, rows and row blocks that see nothing.
def use_sm90_masked_backward(monkeypatch, head_dim: int, dq_mode: str):
    """dq_mode: "fused" (a dq_accum workspace, d=64 too), "separate" (JAX_FLASH_FUSED_DQ=0) or "deterministic"."""
    from jax_flash import _ffi_calls

    use_backward_kernel(monkeypatch, "sm90", head_dim)
    if head_dim > 128:
        pytest.skip("boolean masks at head_dim > 128 run on the sm80 backward (no d=256 masked form)")
    monkeypatch.setenv("JAX_FLASH_FUSED_DQ", "0" if dq_mode == "separate" else "1")
    monkeypatch.setattr(_ffi_calls, "_FUSED_DQ_MIN_HEAD_DIM", 64)


@pytest.mark.parametrize("dq_mode", ("fused", "separate", "deterministic"))
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("shape", tuple(MASK_BLOCK_SHAPES), ids=str)
def test_backward_sm90_mask_blocks(shape, head_dim, dq_mode, monkeypatch):
    use_sm90_masked_backward(monkeypatch, head_dim, dq_mode)
    case = Case(batch=2, seqlen_q=300, seqlen_k=520, heads_q=4, heads_kv=2, head_dim=head_dim, dtype=jnp.bfloat16,
                seed=head_dim + 3)
    mask = block_structured_mask(MASK_BLOCK_SHAPES[shape], seed=head_dim + 1, region=128)
    if shape == "per_head":  # a 128-row block of one head of the GQA group sees nothing
        mask = mask.at[1, 2, 128:256].set(False)
    kwargs = dict(mask=mask, causal=shape == "per_head")
    check_gradients_on_gpu(case, deterministic=dq_mode == "deterministic", **kwargs)
    q, k, v = _on(GPUS[0], *case.inputs())
    for g in grads(q, k, v, jnp.ones_like(q), deterministic=dq_mode == "deterministic", **_gpu_kwargs(kwargs)):
        assert np.all(np.isfinite(np.asarray(g.astype(jnp.float32))))


@pytest.mark.parametrize("dq_mode", ("fused", "deterministic"))
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("head_dim", (64, 128))
def test_backward_sm90_key_padding_mask(head_dim, dtype, dq_mode, monkeypatch):
    """A [batch, 1, 1, seqlen_k] key-padding mask (query stride 0), with a batch row that sees no key at all: its
    dq, and dk/dv of its keys, are 0."""
    use_sm90_masked_backward(monkeypatch, head_dim, dq_mode)
    case = Case(batch=3, seqlen_q=700, seqlen_k=900, heads_q=8, heads_kv=2, head_dim=head_dim, dtype=dtype,
                seed=head_dim + 5)
    mask = _padding_mask([900, 333, 0], case.seqlen_k)
    check_gradients_on_gpu(case, deterministic=dq_mode == "deterministic", mask=mask)
    q, k, v = _on(GPUS[0], *case.inputs())
    dq, dk, dv = (np.asarray(g.astype(jnp.float32)) for g in grads(
        q, k, v, jnp.ones_like(q), deterministic=dq_mode == "deterministic", **_gpu_kwargs(dict(mask=mask))))
    assert np.all(dq[2] == 0) and np.all(dk[2] == 0) and np.all(dv[2] == 0)
    assert np.all(dk[1, 333:] == 0) and np.all(dv[1, 333:] == 0)


@pytest.mark.parametrize("dq_mode", ("fused", "deterministic"))
@pytest.mark.parametrize("feature", ("causal", "seqlens_causal", "segments", "softcap", "alibi_batched_causal",
                                     "everything"))
def test_backward_sm90_mask_with_features(feature, dq_mode, monkeypatch):
    """The masked form with the position masks, lengths and segments, and with softcap/ALiBi (which it transforms
    like the transforms form); many query and key tiles, GQA, fp16."""
    use_sm90_masked_backward(monkeypatch, 128, dq_mode)
    case = Case(batch=2, seqlen_q=1100, seqlen_k=1300, heads_q=8, heads_kv=2, head_dim=128, dtype=jnp.float16,
                seed=len(feature) + 11)
    mask = block_structured_mask((2, 8, 1100, 1300), seed=len(feature), region=128)
    check_gradients_on_gpu(case, deterministic=dq_mode == "deterministic", mask=mask, **feature_kwargs(feature, case))


def test_backward_sm90_mask_deterministic_is_bit_identical(monkeypatch):
    use_sm90_masked_backward(monkeypatch, 128, "deterministic")
    case = Case(batch=2, seqlen_q=1000, seqlen_k=1500, heads_q=8, heads_kv=2, head_dim=128, dtype=jnp.bfloat16)
    q, k, v = _on(GPUS[0], *case.inputs())
    d_o = jax.device_put(jax.random.normal(jax.random.key(3), q.shape, jnp.bfloat16), GPUS[0])
    mask = jax.device_put(block_structured_mask((2, 1, 1000, 1500), seed=9, region=128), GPUS[0])
    bit_identical_runs(lambda: grads(q, k, v, d_o, deterministic=True, mask=mask))


def test_forcing_sm90_backward_on_a_mask_at_head_dim_256_is_a_clear_error(monkeypatch):
    use_backward_kernel(monkeypatch, "sm90", 256)
    case = Case(head_dim=256, dtype=jnp.bfloat16)
    q, k, v = _on(GPUS[0], *case.inputs())
    mask = jax.device_put(_padding_mask([40], case.seqlen_k), GPUS[0])
    with pytest.raises(Exception) as error:
        jax.block_until_ready(jax.grad(lambda q_: jnp.sum(
            jax_flash.attention(q_, k, v, mask=mask).astype(jnp.float32)))(q))
    if "no sm_90a backward kernel for head_dim" in str(error.value):
        pytest.skip("this build has no d=256 sm90 backward (JAX_FLASH_CUDA_HEAD_DIMS)")
    assert "sm90 backward cannot run this call: softcap, ALiBi and boolean masks" in str(error.value)


def _raw_calls_with_summary(q, k, v, mask, summary):
    """The forward and backward custom calls with a given block summary (the public API always passes the
    mask's own): (o, lse, dq, dk, dv) for d_o = 1."""
    from jax_flash import _ffi_calls, _registration
    from jax_flash._config import ScoreConfig

    batch, seqlen_q, heads_q, head_dim = q.shape
    stats = jax.ShapeDtypeStruct((batch, heads_q, seqlen_q), jnp.float32)
    masks = [jnp.zeros((batch, 0), jnp.float32)] + [jnp.zeros((batch, 0), jnp.int32)] * 4
    dense = [jnp.zeros((1, 1, 1, 0), jnp.float32), mask, summary, jnp.zeros((batch, 0), jnp.uint32)]
    masks, dense = _on(GPUS[0], *masks), _on(GPUS[0], *dense)
    config = ScoreConfig(softmax_scale=1.0 / np.sqrt(head_dim))
    attributes = _ffi_calls._score_attributes(config)
    forward = jax.ffi.ffi_call(_registration.FORWARD_TARGET, (jax.ShapeDtypeStruct(q.shape, q.dtype), stats,
                                                              jax.ShapeDtypeStruct((0,), jnp.float32)))
    o, lse, _ = forward(q, k, v, *masks, *dense, **_ffi_calls._forward_attributes(config))
    backward = jax.ffi.ffi_call(_registration.BACKWARD_TARGET, (
        jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
        jax.ShapeDtypeStruct(v.shape, v.dtype), stats,
        jax.ShapeDtypeStruct(_ffi_calls.dq_workspace_shape(q), jnp.float32),
        jax.ShapeDtypeStruct(_ffi_calls.dkdv_tail_shape(k), jnp.float32),
        jax.ShapeDtypeStruct((1, 1, 1, 0), jnp.float32)))
    dq, dk, dv, *_ = backward(q, k, v, o, lse, jnp.ones_like(q), jnp.zeros_like(lse), *masks, *dense, **attributes,
                              deterministic=False)
    return o, lse, dq, dk, dv


def test_kernels_follow_the_block_summary():
    """The sm80 kernels act on the summary they are given: all blocks "hidden" skips every tile (o = 0,
    lse = -inf, zero gradients although the mask shows everything); all "visible" reads no mask element (the
    result is that of no mask although the mask hides half the keys)."""
    case = Case(batch=2, seqlen_q=200, seqlen_k=300, heads_q=4, heads_kv=2, head_dim=64, dtype=jnp.bfloat16, seed=5)
    q, k, v = _on(GPUS[0], *case.inputs())
    summary_shape = (2, 1, 4, 5)
    shows_all = jnp.ones((2, 1, 200, 300), bool)
    o, lse, *grads_hidden = _raw_calls_with_summary(q, k, v, shows_all, jnp.zeros(summary_shape, jnp.uint8))
    assert np.all(np.asarray(o.astype(jnp.float32)) == 0) and np.all(np.isneginf(np.asarray(lse)))
    for g in grads_hidden:
        assert np.all(np.asarray(g.astype(jnp.float32)) == 0)

    hides_half = jnp.broadcast_to(jnp.arange(300) % 2 == 0, (2, 1, 200, 300))
    o, lse, *_ = _raw_calls_with_summary(q, k, v, hides_half, jnp.full(summary_shape, 2, jnp.uint8))
    o_unmasked, lse_unmasked = oracle(*case.inputs())
    o_masked, _ = oracle(*case.inputs(), mask=hides_half)
    o_xla, lse_xla = jax_flash.attention(*_on(CPU, *case.inputs()), return_lse=True, implementation="xla")
    assert_within_bound("o (summary: all visible)", o, o_xla, o_unmasked, case.dtype)
    assert_within_bound("lse (summary: all visible)", lse, lse_xla, lse_unmasked, jnp.float32)
    assert max_error(o, o_masked) > 10 * max_error(o, o_unmasked)


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_dropout_values_and_gradients(dtype):
    """Against the float64 reference, which draws the same keep mask from jax_flash/_dropout.py."""
    case = Case(**{**DENSE_CASE.__dict__, "dtype": dtype})
    kwargs = dict(dropout_rate=0.2, dropout_rng=jax.random.key(7), causal=True)
    check_forward_on_gpu(case, **kwargs)
    check_gradients_on_gpu(case, **kwargs)
    bias = jax.random.normal(jax.random.key(8), (4, 1, case.seqlen_k), jnp.float32)
    check_bias_gradients_on_gpu(case, bias, mask=_padding_mask([203, 150], case.seqlen_k), **kwargs)


@pytest.mark.parametrize("rate", (0.1, 0.5))
def test_dropout_keep_mask_matches_cpu_and_generator(rate):
    """With one-hot value rows, o[b, i, h, j] = dropout(P)[b, h, i, j] / rowsum: its zeros are exactly the dropped
    elements. 150 x 61 leaves partial 16-row and 64-column blocks of the Philox mapping (one call serves rows i,
    i + 8 and columns j, j + 1, j + 32, j + 33) and an odd last column."""
    batch, seqlen_q, heads, seqlen_k, head_dim = 2, 150, 3, 61, 64
    q = 0.3 * jax.random.normal(jax.random.key(0), (batch, seqlen_q, heads, head_dim))
    k = 0.3 * jax.random.normal(jax.random.key(1), (batch, seqlen_k, heads, head_dim))
    v = jnp.broadcast_to(jnp.eye(seqlen_k, head_dim)[None, :, None, :], (batch, seqlen_k, heads, head_dim))
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    key = jax.random.key(42)
    kept = {}
    for name, device in (("gpu", GPUS[0]), ("cpu", CPU)):
        o = jax_flash.attention(*_on(device, q, k, v), dropout_rate=rate, dropout_rng=jax.device_put(key, device))
        kept[name] = np.asarray(o.astype(jnp.float32) != 0)[..., :seqlen_k].transpose(0, 2, 1, 3)  # [B, H, Sq, Sk]
    expected = np.asarray(_dropout.keep_mask(_dropout.seeds_from_key(key, batch), rate, heads, seqlen_q, seqlen_k))
    np.testing.assert_array_equal(kept["gpu"], expected)
    np.testing.assert_array_equal(kept["gpu"], kept["cpu"])
    standard_error = np.sqrt(rate * (1 - rate) / expected.size)
    assert abs(kept["gpu"].mean() - (1 - rate)) < 5 * standard_error


def test_dropout_gpu_and_cpu_outputs_agree():
    case = DENSE_CASE
    q, k, v = case.inputs()
    key = jax.random.key(9)
    o_gpu = jax_flash.attention(*_on(GPUS[0], q, k, v), dropout_rate=0.3, dropout_rng=jax.device_put(key, GPUS[0]))
    o_cpu = jax_flash.attention(*_on(CPU, q, k, v), dropout_rate=0.3, dropout_rng=key)
    o_xla = jax_flash.attention(*_on(CPU, q, k, v), dropout_rate=0.3, dropout_rng=key, implementation="xla")
    o_ref, _ = oracle(q, k, v, dropout_rate=0.3, dropout_rng=key)
    assert_within_bound("o vs CPU", o_gpu, o_xla, np.asarray(o_cpu.astype(jnp.float32)), case.dtype)
    assert_within_bound("o", o_gpu, o_xla, o_ref, case.dtype)


@pytest.mark.parametrize("shape", [(4, 150, 203), (1, 4, 1, 203), (203,), (2, 4, 150, 203)], ids=str)
def test_deterministic_dbias_is_bit_identical(shape):
    case = DENSE_CASE
    q, k, v = _on(GPUS[0], *case.inputs())
    d_o = jax.device_put(jax.random.normal(jax.random.key(3), q.shape, jnp.bfloat16), GPUS[0])
    bias = jax.device_put(jax.random.normal(jax.random.key(4), shape, jnp.float32), GPUS[0])
    kwargs = _gpu_kwargs(dict(dropout_rate=0.1, dropout_rng=jax.random.key(5), causal=True,
                              mask=_padding_mask([203, 170], case.seqlen_k)))
    first = bit_identical_runs(lambda: _grads_with_bias(q, k, v, d_o, bias, deterministic=True, **kwargs))
    atomic = _grads_with_bias(q, k, v, d_o, bias, **kwargs)[3]
    np.testing.assert_allclose(np.asarray(atomic), first[3], rtol=1e-4, atol=1e-4)


# The sm90 forward with an additive bias and/or a boolean mask (the default; JAX_FLASH_SM90_DENSE=0 turns it off).
# Forced to sm90 (JAX_FLASH_CUDA_KERNEL=sm90) with JAX_FLASH_SM90_DENSE unset, so that a refusal of the default
# fails the test; same references as the sm80 tests.
def use_sm90_dense(monkeypatch, head_dim: int):
    use_forward_kernel(monkeypatch, "sm90", head_dim)
    monkeypatch.delenv("JAX_FLASH_SM90_DENSE", raising=False)


@pytest.mark.parametrize("shape", GPU_BIAS_SHAPES, ids=str)
def test_sm90_dense_bias_forward(shape, monkeypatch):
    use_sm90_dense(monkeypatch, DENSE_CASE.head_dim)
    bias = jax.random.normal(jax.random.key(1), shape, jnp.float32)
    check_forward_on_gpu(DENSE_CASE, bias=bias, causal=True)
    check_forward_on_gpu(DENSE_CASE, bias=bias, window_size=(120, 40))


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_sm90_dense_padding_mask_and_gradients(dtype, monkeypatch):
    """The backward (sm80) takes the sm90 forward's o and lse."""
    use_sm90_dense(monkeypatch, 64)
    case = Case(**{**DENSE_CASE.__dict__, "dtype": dtype})
    mask = _padding_mask([203, 90], case.seqlen_k)
    check_forward_on_gpu(case, mask=mask)
    check_gradients_on_gpu(case, mask=mask)


@pytest.mark.parametrize("persistent", ("0", "1"), ids=("per_tile", "persistent"))
def test_sm90_dense_mask_with_fully_masked_rows_and_tiles(persistent, monkeypatch):
    use_sm90_dense(monkeypatch, DENSE_CASE.head_dim)
    monkeypatch.setenv("JAX_FLASH_SM90_PERSISTENT", persistent)
    monkeypatch.setenv("JAX_FLASH_SM90_PERSISTENT_CTAS", "3")  # persistent: each CTA loops over several tiles
    case = DENSE_CASE
    mask = _mask_with_blind_rows_and_tiles(case)
    check_forward_on_gpu(case, mask=mask, causal=True)
    q, k, v = _on(GPUS[0], *case.inputs())
    o, lse = jax_flash.attention(q, k, v, return_lse=True, **_gpu_kwargs(dict(mask=mask, causal=True)))
    assert np.all(np.isneginf(np.asarray(lse)[0, :, 5])) and np.all(np.asarray(o.astype(jnp.float32))[0, 5] == 0)
    assert np.all(np.isneginf(np.asarray(lse)[1, :, 140:]))
    assert np.all(np.isfinite(np.asarray(o.astype(jnp.float32))))


@pytest.mark.parametrize("persistent", ("0", "1"), ids=("per_tile", "persistent"))
@pytest.mark.parametrize("head_dim", (64, 128, 256))
@pytest.mark.parametrize("shape", tuple(MASK_BLOCK_SHAPES), ids=str)
def test_sm90_dense_mask_block_skipping(head_dim, shape, persistent, monkeypatch):
    """Hidden key tiles skipped by producer and consumers alike, whole row blocks that see nothing (o = 0,
    lse = -inf), a bias on top; per-tile grid and a persistent grid of 3 CTAs."""
    use_sm90_dense(monkeypatch, head_dim)
    monkeypatch.setenv("JAX_FLASH_SM90_PERSISTENT", persistent)
    monkeypatch.setenv("JAX_FLASH_SM90_PERSISTENT_CTAS", "3")
    case = Case(batch=2, seqlen_q=300, seqlen_k=520, heads_q=4, heads_kv=2, head_dim=head_dim, dtype=jnp.bfloat16,
                seed=head_dim)
    mask = block_structured_mask(MASK_BLOCK_SHAPES[shape], seed=head_dim, region=128)
    if shape == "per_head":  # a 128-row block (one sm90 tile) of one head that sees nothing
        mask = mask.at[1, 2, 128:256].set(False)
    bias = jax.random.normal(jax.random.key(head_dim), (4, 1, 520), jnp.float32)
    for kwargs in (dict(mask=mask, causal=shape == "per_head"), dict(mask=mask, bias=bias)):
        check_forward_on_gpu(case, **kwargs)
        q, k, v = _on(GPUS[0], *case.inputs())
        o, lse = jax_flash.attention(q, k, v, return_lse=True, **_gpu_kwargs(kwargs))
        _, lse_ref = oracle(*case.inputs(), **kwargs)
        blind = np.isneginf(lse_ref)
        assert blind.any() or shape == "key_padding"
        assert np.all(np.isneginf(np.asarray(lse)[blind]))
        assert np.all(np.asarray(o.astype(jnp.float32)).transpose(0, 2, 1, 3)[blind] == 0)


def test_sm90_dense_bias_mask_softcap_alibi_gqa_fp16(monkeypatch):
    use_sm90_dense(monkeypatch, 128)
    case = Case(batch=2, seqlen_q=77, seqlen_k=130, heads_q=8, heads_kv=2, head_dim=128, dtype=jnp.float16, seed=5)
    bias = jax.random.normal(jax.random.key(3), (8, 77, 130), jnp.float32)
    kwargs = dict(softcap=4.0, alibi_slopes=jnp.linspace(0.05, 0.4, 8, dtype=jnp.float32),
                  mask=_padding_mask([130, 70], case.seqlen_k))
    check_forward_on_gpu(case, bias=bias, **kwargs)


def test_sm90_dense_matches_sm80_closely(monkeypatch):
    """The automatic choice (sm90 dense form) against sm80 on a long padding-mask call: many key tiles, whole
    hidden tiles at the end of the short batch row."""
    if not _is_hopper():
        pytest.skip("needs a compute capability 9.x GPU")
    case = Case(batch=2, seqlen_q=1100, seqlen_k=1500, heads_q=4, heads_kv=2, head_dim=128, dtype=jnp.bfloat16,
                seed=17)
    q, k, v = _on(GPUS[0], *case.inputs())
    mask = _padding_mask([1500, 600], case.seqlen_k)
    kwargs = _gpu_kwargs(dict(mask=mask))
    results = {}
    for kernel, dense in (("sm80", "0"), ("auto", "1")):
        monkeypatch.setenv("JAX_FLASH_CUDA_KERNEL", kernel)
        monkeypatch.setenv("JAX_FLASH_SM90_DENSE", dense)
        o, lse = jax_flash.attention(q, k, v, return_lse=True, **kwargs)
        results[kernel] = (np.asarray(o.astype(jnp.float32)), np.asarray(lse))
        check_forward_on_gpu(case, mask=mask)  # each family within the bound (host mask: the CPU handler runs too)
    np.testing.assert_allclose(results["auto"][0], results["sm80"][0], atol=2e-2)
    np.testing.assert_allclose(results["auto"][1], results["sm80"][1], atol=1e-3)



@pytest.mark.parametrize("dense", ("bias", "mask"))
def test_sm90_dense_can_be_turned_off(dense, monkeypatch):
    """Forced sm90 with JAX_FLASH_SM90_DENSE=0 refuses a bias/mask call, naming the variable; dropout is refused
    with the dense form on; a bad value is an error."""
    if not _is_hopper():
        pytest.skip("needs a compute capability 9.x GPU")
    monkeypatch.setenv("JAX_FLASH_CUDA_KERNEL", "sm90")
    monkeypatch.setenv("JAX_FLASH_SM90_DENSE", "0")
    case = DENSE_CASE
    q, k, v = _on(GPUS[0], *case.inputs())
    kwargs = (dict(bias=jax.random.normal(jax.random.key(1), (4, 150, 203), jnp.float32)) if dense == "bias"
              else dict(mask=_padding_mask([203, 90], case.seqlen_k)))
    kwargs = _gpu_kwargs(kwargs)
    with pytest.raises(Exception, match="JAX_FLASH_SM90_DENSE"):
        jax.block_until_ready(jax_flash.attention(q, k, v, **kwargs))
    monkeypatch.setenv("JAX_FLASH_SM90_DENSE", "1")
    with pytest.raises(Exception, match="dropout"):
        jax.block_until_ready(jax_flash.attention(q, k, v, dropout_rate=0.1, dropout_rng=jax.random.key(2), **kwargs))
    monkeypatch.setenv("JAX_FLASH_SM90_DENSE", "yes")
    with pytest.raises(Exception, match="JAX_FLASH_SM90_DENSE must be 0 or 1"):
        jax.block_until_ready(jax_flash.attention(q, k, v, **kwargs))


# float32 inputs (issue #10): "highest" (exact SIMT FMA) within 1e-5 of the float64 reference, relative to the
# reference's largest magnitude; "tf32" within the usual bound against XLA's own TF32 attention on the GPU.
FLOAT32_MODES = ("highest", "tf32")
EXACT_FLOAT32_RTOL = 1e-5


def only_float32_paths(monkeypatch, *on: str):
    """Turns on the named switches of the Hopper float32 paths (_ffi_calls.HOPPER_PATH_SWITCHES: the split-TF32 forward
    and backward, the exact mode's backward on float16 parts, the TF32 mode's backward on float16 operands; unset, all
    on on a Hopper GPU) and off the others: a test of one path runs that path (or the SIMT / TF32 kernels, with none
    named) whatever the defaults."""
    for variable in _ffi_calls.HOPPER_PATH_SWITCHES:
        monkeypatch.setenv(variable, "1" if variable in on else "0")


# Inputs are unit normals, so the largest element of an output or gradient is O(1). A gradient that is zero in
# theory (one visible key: the softmax is constant) comes out as rounding noise of dP - rowsum(dO * O), terms of
# size ~sqrt(head_dim), so the magnitude divided by has a floor of 1: EXACT_FLOAT32_RTOL is then an absolute bound.
RELATIVE_ERROR_FLOOR = 1.0


def _relative_error(x, reference) -> float:
    reference = np.asarray(reference, np.float64)
    finite = np.isfinite(reference)
    magnitude = float(np.max(np.abs(reference[finite]), initial=0.0))
    return max_error(x, reference) / max(magnitude, RELATIVE_ERROR_FLOOR)


def check_float32_on_gpu(case: Case, precision: str, gradients: bool = True, **kwargs):
    """o, lse and (with `gradients`) the gradients of sum(o * dO) + sum(lse * dlse) (an lse cotangent, as in
    check_gradients_on_gpu) against the float64 reference: the exact bound for "highest", else the TF32 bound."""
    q, k, v = case.inputs()
    d_o = jax.random.normal(jax.random.key(case.seed + 99), q.shape, jnp.float32)
    d_lse = jax.random.normal(jax.random.key(case.seed + 98), (q.shape[0], q.shape[2], q.shape[1]), jnp.float32)
    kwargs_gpu = {n: jax.device_put(a, GPUS[0]) if isinstance(a, jax.Array) else a for n, a in kwargs.items()}
    _poison_gpu_memory()
    on_gpu = _on(GPUS[0], q, k, v, d_o)
    d_lse_gpu = jax.device_put(d_lse, GPUS[0])
    o, lse = jax_flash.attention(*on_gpu[:3], return_lse=True, float32_precision=precision, **kwargs_gpu)
    assert o.dtype == jnp.float32 and lse.dtype == jnp.float32
    results = [("o", o), ("lse", lse)]
    references = list(oracle(q, k, v, **kwargs))
    if gradients:
        results += list(zip(("dq", "dk", "dv"), grads(*on_gpu, d_lse=d_lse_gpu, float32_precision=precision,
                                                      **kwargs_gpu)))
        references += oracle_grads(q, k, v, d_o, d_lse=d_lse, **kwargs)
    if precision == "highest":
        for (name, x), reference in zip(results, references):
            error = _relative_error(x, reference)
            assert error <= EXACT_FLOAT32_RTOL, f"{name}: relative error {error:.2e} > {EXACT_FLOAT32_RTOL:.0e}"
        return
    with jax.default_matmul_precision("tensorfloat32"):
        xla = list(jax_flash.attention(*on_gpu[:3], return_lse=True, implementation="xla", **kwargs_gpu))
        if gradients:
            xla += list(grads(*on_gpu, implementation="xla", d_lse=d_lse_gpu, **kwargs_gpu))
    for (name, x), x_xla, reference in zip(results, xla, references):
        assert_within_tf32_bound(name, x, x_xla, reference, scale=1.0 if name in ("o", "lse") else 4.0)


def assert_within_tf32_bound(name, ours, xla_tf32, reference, scale):
    """The usual bound with XLA at "tensorfloat32" (attention_cases.assert_within_bound with tf32)."""
    assert_within_bound(name, ours, xla_tf32, reference, jnp.float32, scale=scale, tf32=True)


# "simt": "highest" with every Hopper float32 path off, so that the exact SIMT kernels (the mode's kernels for bias,
# mask and dropout, and on GPUs other than Hoppers) stay tested on a Hopper in the common form too.
@pytest.mark.parametrize("precision", FLOAT32_MODES + ("simt",))
@pytest.mark.parametrize("head_dim", (64, 128, 7, 40, 100))
@pytest.mark.parametrize("seqlens", ((1, 1), (17, 17), (1000, 1000), (17, 300), (300, 17)),
                         ids=lambda s: f"{s[0]}x{s[1]}")
def test_float32_shapes(precision, head_dim, seqlens, monkeypatch):
    if precision == "simt":
        only_float32_paths(monkeypatch)
        precision = "highest"
    case = Case(seqlen_q=seqlens[0], seqlen_k=seqlens[1], head_dim=head_dim, dtype=jnp.float32, seed=head_dim + 3)
    check_float32_on_gpu(case, precision, causal=(seqlens[0] + head_dim) % 2 == 0)


@pytest.mark.parametrize("precision", FLOAT32_MODES)
@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("shape", ((40, 300, 8, 2), (300, 40, 4, 1)), ids=("40x300-gqa", "300x40-mqa"))
def test_float32_features(precision, feature, shape):
    case = Case(seqlen_q=shape[0], seqlen_k=shape[1], heads_q=shape[2], heads_kv=shape[3], head_dim=64,
                dtype=jnp.float32, seed=len(feature) + 5)
    check_float32_on_gpu(case, precision, **feature_kwargs(feature, case))


# The TF32 forward's two kernel families (JAX_FLASH_CUDA_KERNEL_F32, read at every call): sm90 (TMA + WGMMA,
# V^T workspace; head dims 64 and 128, the common form) and sm80 (mma.sync). Forcing sm90 fails loudly where it
# cannot run a call, so a pass shows that the Hopper kernel computed these outputs.
@pytest.mark.parametrize("kernel", FORWARD_KERNELS)
@pytest.mark.parametrize("head_dim", (64, 128, 36, 100))
@pytest.mark.parametrize("seqlens,heads,causal", (((1000, 1000), (8, 2), True), ((300, 777), (4, 4), False),
                                                  ((1, 4100), (8, 1), False), ((129, 70), (2, 1), True)),
                         ids=("1000-gqa-causal", "300x777", "1x4100-mqa", "129x70-causal"))
def test_float32_tf32_forward_kernels(kernel, head_dim, seqlens, heads, causal, monkeypatch):
    if kernel == "sm90" and not _is_hopper():
        pytest.skip("the sm90 kernel needs a compute capability 9.x GPU")
    monkeypatch.setenv("JAX_FLASH_CUDA_KERNEL_F32", kernel)
    case = Case(batch=2, seqlen_q=seqlens[0], seqlen_k=seqlens[1], heads_q=heads[0], heads_kv=heads[1],
                head_dim=head_dim, dtype=jnp.float32, seed=head_dim + seqlens[0])
    check_float32_on_gpu(case, "tf32", gradients=False, causal=causal)


def test_float32_tf32_forward_kernel_switch(monkeypatch):
    q, k, v = _on(GPUS[0], *Case(dtype=jnp.float32, head_dim=64).inputs())
    monkeypatch.setenv("JAX_FLASH_CUDA_KERNEL_F32", "fast")
    with pytest.raises(Exception, match="JAX_FLASH_CUDA_KERNEL_F32 must be sm80, sm90 or auto"):
        jax.block_until_ready(jax_flash.attention(q, k, v, float32_precision="tf32"))
    if _is_hopper():  # a feature the Hopper TF32 kernel does not have: forcing it is an error, not a fallback
        monkeypatch.setenv("JAX_FLASH_CUDA_KERNEL_F32", "sm90")
        with pytest.raises(Exception, match="dropout runs on the float32 kernels only"):
            jax.block_until_ready(jax_flash.attention(q, k, v, float32_precision="tf32", dropout_rate=0.1,
                                                      dropout_rng=jax.random.key(0)))


# Shapes and features of the Hopper float32 kernels' tests: GQA / MQA, one query row over 4100 keys, causal with
# fewer keys than queries, windows, sequence lengths, segments.
HOPPER_FLOAT32_SHAPES = pytest.mark.parametrize(
    "seqlens,heads,feature",
    (((1000, 1000), (8, 2), "causal"), ((300, 777), (4, 4), "none"), ((1, 4100), (8, 1), "none"),
     ((129, 70), (2, 1), "causal"), ((200, 200), (4, 2), "window"), ((150, 190), (4, 2), "seqlens"),
     ((160, 160), (2, 2), "segments")),
    ids=("1000-gqa-causal", "300x777", "1x4100-mqa", "129x70-causal", "window", "seqlens", "segments"))


# The TF32 backward on the Hopper kernels (JAX_FLASH_CUDA_KERNEL_F32_BACKWARD, read at every call: unset or auto runs
# them where they can run the call, sm90 insists, sm80 keeps the mma.sync passes): forcing them fails loudly where
# they cannot run a call, so a pass shows that they computed these gradients (dK/dV and dQ passes). Windows, seqlens
# and segment ids are SliceMask positions, which their common form applies like the 16-bit kernels'.
@pytest.mark.parametrize("head_dim", (64, 128, 36, 100))
@HOPPER_FLOAT32_SHAPES
def test_float32_tf32_backward_on_sm90(head_dim, seqlens, heads, feature, monkeypatch):
    if not _is_hopper():
        pytest.skip("the sm90 kernel needs a compute capability 9.x GPU")
    only_float32_paths(monkeypatch)
    monkeypatch.setenv("JAX_FLASH_CUDA_KERNEL_F32_BACKWARD", "sm90")
    case = Case(batch=2, seqlen_q=seqlens[0], seqlen_k=seqlens[1], heads_q=heads[0], heads_kv=heads[1],
                head_dim=head_dim, dtype=jnp.float32, seed=head_dim + seqlens[1])
    check_float32_on_gpu(case, "tf32", **feature_kwargs(feature, case))


# The TF32 mode's backward on scaled float16 operands (JAX_FLASH_SM90_TF32_BACKWARD_FP16=1, jax_flash/_half_operands.py:
# the 16-bit Hopper backward's fused-dQ common form with float32 gradients) must meet the TF32 bound (gradients with
# an lse cotangent, as every check_float32_on_gpu). The handler has no fallback for such a call (an error where that kernel cannot run it),
# so a pass shows it computed these gradients. Head dims: every kernel's (d=96 / 192 / 256 through the separate dQ
# pass, 256 the split-head-dim dK/dV consumer), and 72 padded to 96.
@pytest.mark.parametrize("head_dim", (64, 128, 72, 96, 192, 256), ids=lambda d: f"d{d}")
@HOPPER_FLOAT32_SHAPES
def test_float32_tf32_backward_on_float16_operands(head_dim, seqlens, heads, feature, monkeypatch):
    if not _is_hopper():
        pytest.skip("the sm90 kernel needs a compute capability 9.x GPU")
    only_float32_paths(monkeypatch, _ffi_calls.HALF_OPERANDS_BACKWARD_ENV)
    case = Case(batch=2, seqlen_q=seqlens[0], seqlen_k=seqlens[1], heads_q=heads[0], heads_kv=heads[1],
                head_dim=head_dim, dtype=jnp.float32, seed=head_dim + seqlens[1] + 2)
    assert_backward_takes_float16_operands(case, **feature_kwargs(feature, case))
    check_float32_on_gpu(case, "tf32", **feature_kwargs(feature, case))


@pytest.mark.parametrize("head_dim", (64, 128), ids=lambda d: f"d{d}")
def test_float32_tf32_backward_on_float16_operands_deterministic(head_dim, monkeypatch):
    """deterministic=True: the separate dQ pass with float32 dQ where d=64 / 128 otherwise fuse it; bit-identical
    runs."""
    if not _is_hopper():
        pytest.skip("the sm90 kernel needs a compute capability 9.x GPU")
    only_float32_paths(monkeypatch, _ffi_calls.HALF_OPERANDS_BACKWARD_ENV)
    case = Case(batch=2, seqlen_q=300, seqlen_k=777, heads_q=4, heads_kv=2, head_dim=head_dim, dtype=jnp.float32,
                seed=head_dim + 5)
    assert_backward_takes_float16_operands(case, deterministic=True)
    check_float32_on_gpu(case, "tf32", deterministic=True)
    q, k, v = _on(GPUS[0], *case.inputs())
    d_o = jax.device_put(jax.random.normal(jax.random.key(1), q.shape, jnp.float32), GPUS[0])
    bit_identical_runs(lambda: grads(q, k, v, d_o, deterministic=True))


def assert_backward_takes_float16_operands(case: Case, **kwargs):
    """The switch routed this call's backward to the float16-operand custom call (not a vacuous pass through the TF32
    kernels, which meet the same bound)."""
    def loss(q_, k_, v_):
        return jnp.sum(jax_flash.attention(q_, k_, v_, **kwargs))
    calls = backward_call_operand_types(loss, *_on(GPUS[0], *case.inputs()))
    assert calls and all("xf16>" in call for call in calls), calls


@pytest.mark.parametrize("head_dim", (64, 128), ids=lambda d: f"d{d}")
@pytest.mark.parametrize("feature", ("softcap", "alibi_batched_causal", "everything", "mask"))
def test_float32_tf32_backward_on_float16_operands_forms(head_dim, feature, monkeypatch):
    """The transforms (softcap, ALiBi) and masked forms of the float32-gradient kernels, as the test above."""
    if not _is_hopper():
        pytest.skip("the sm90 kernel needs a compute capability 9.x GPU")
    only_float32_paths(monkeypatch, _ffi_calls.HALF_OPERANDS_BACKWARD_ENV)
    case = Case(batch=2, seqlen_q=200, seqlen_k=260, heads_q=4, heads_kv=2, head_dim=head_dim, dtype=jnp.float32,
                seed=head_dim + len(feature))
    if feature == "mask":
        kwargs = {"mask": block_structured_mask((case.batch, 1, case.seqlen_q, case.seqlen_k), case.seed)}
    else:
        kwargs = feature_kwargs(feature, case)
    assert_backward_takes_float16_operands(case, **kwargs)
    check_float32_on_gpu(case, "tf32", **kwargs)


# The split-TF32 forward (float32_precision="highest" with JAX_FLASH_SM90_SPLIT_TF32=1: each operand as two TF32
# parts, three TF32 WGMMAs per GEMM; csrc/common/tf32_workspace.h) must meet the exact mode's bound. Forcing sm90
# (JAX_FLASH_CUDA_KERNEL_F32) makes a call it cannot run an error, so a pass shows the split kernel computed it.
@pytest.mark.parametrize("head_dim", (64, 128, 36, 100), ids=lambda d: f"d{d}")
@HOPPER_FLOAT32_SHAPES
def test_float32_split_tf32_forward_on_sm90(head_dim, seqlens, heads, feature, monkeypatch):
    if not _is_hopper():
        pytest.skip("the sm90 kernel needs a compute capability 9.x GPU")
    only_float32_paths(monkeypatch, _ffi_calls.SPLIT_TF32_ENV)
    monkeypatch.setenv("JAX_FLASH_CUDA_KERNEL_F32", "sm90")
    case = Case(batch=2, seqlen_q=seqlens[0], seqlen_k=seqlens[1], heads_q=heads[0], heads_kv=heads[1],
                head_dim=head_dim, dtype=jnp.float32, seed=head_dim + seqlens[0])
    check_float32_on_gpu(case, "highest", gradients=False, **feature_kwargs(feature, case))


# The split-TF32 backward passes (float32_precision="highest" with JAX_FLASH_SM90_SPLIT_TF32_BACKWARD=1: the TF32 dK/dV
# and dQ passes with every operand as two TF32 parts; csrc/cuda/sm90/split_tf32_backward_launch.h) must meet the exact
# mode's bound, gradients included. Forcing sm90 (JAX_FLASH_CUDA_KERNEL_F32_BACKWARD) makes a call they cannot run an
# error, so a pass shows they computed it; the forward is the exact kernel's (its own switch off).
@pytest.mark.parametrize("head_dim", (64, 128, 36, 100), ids=lambda d: f"d{d}")
@HOPPER_FLOAT32_SHAPES
def test_float32_split_tf32_backward_on_sm90(head_dim, seqlens, heads, feature, monkeypatch):
    if not _is_hopper():
        pytest.skip("the sm90 kernel needs a compute capability 9.x GPU")
    only_float32_paths(monkeypatch, _ffi_calls.SPLIT_TF32_BACKWARD_ENV)
    monkeypatch.setenv("JAX_FLASH_CUDA_KERNEL_F32_BACKWARD", "sm90")
    case = Case(batch=2, seqlen_q=seqlens[0], seqlen_k=seqlens[1], heads_q=heads[0], heads_kv=heads[1],
                head_dim=head_dim, dtype=jnp.float32, seed=head_dim + seqlens[1] + 1)
    check_float32_on_gpu(case, "highest", **feature_kwargs(feature, case))


@pytest.mark.parametrize("head_dim", (64, 128), ids=lambda d: f"d{d}")
def test_float32_split_tf32_backward_on_sm90_long_sums(head_dim, monkeypatch):
    """2048 queries per key block and 2048 keys per query block: the tensor cores' float32 accumulation truncates,
    and summed over a whole sequence in one accumulator the gradients came out ~2e-5 low (1000-query causal cases
    failed on the H200; benchmarks/emulate_split_products.py --accumulate truncate puts this shape at 1.5-2.8e-5).
    The passes sum each item in a fresh accumulator (split_tf32_mma.h add_partial_sums): ~1e-6 emulated."""
    if not _is_hopper():
        pytest.skip("the sm90 kernel needs a compute capability 9.x GPU")
    only_float32_paths(monkeypatch, _ffi_calls.SPLIT_TF32_BACKWARD_ENV)
    monkeypatch.setenv("JAX_FLASH_CUDA_KERNEL_F32_BACKWARD", "sm90")
    case = Case(batch=1, seqlen_q=2048, seqlen_k=2048, heads_q=4, heads_kv=2, head_dim=head_dim, dtype=jnp.float32,
                seed=head_dim + 11)
    check_float32_on_gpu(case, "highest")


@pytest.mark.parametrize("head_dim", (64, 128), ids=lambda d: f"d{d}")
def test_float32_split_tf32_backward_on_sm90_is_bit_identical(head_dim, monkeypatch):
    """Many query tiles per dK/dV CTA and key tiles per dQ CTA through the split passes: the same gradients run to
    run (no atomics; a stage released before its loads landed would show here, as in the TF32 passes)."""
    if not _is_hopper():
        pytest.skip("the sm90 kernel needs a compute capability 9.x GPU")
    only_float32_paths(monkeypatch, _ffi_calls.SPLIT_TF32_BACKWARD_ENV)
    monkeypatch.setenv("JAX_FLASH_CUDA_KERNEL_F32_BACKWARD", "sm90")
    case = Case(batch=2, seqlen_q=300, seqlen_k=1024, heads_q=4, heads_kv=2, head_dim=head_dim, dtype=jnp.float32)
    q, k, v = _on(GPUS[0], *case.inputs())
    d_o = jax.device_put(jax.random.normal(jax.random.key(3), q.shape, jnp.float32), GPUS[0])
    bit_identical_runs(lambda: grads(q, k, v, d_o, float32_precision="highest"), runs=4)


# The float16-parts backward (float32_precision="highest" with JAX_FLASH_SM90_HIGHEST_BACKWARD_FP16=1: the 16-bit Hopper
# backward on float16 hi and lo parts of scaled operands, three products per product; csrc/cuda/sm90/
# float16_parts_backward_launch.h) must meet the exact mode's bound, gradients with an lse cotangent. Forcing sm90
# (JAX_FLASH_CUDA_KERNEL_F32_BACKWARD) makes a call those kernels cannot run an error, and the call is asserted to
# carry the float16-parts workspace, so a pass shows they computed it. Head dims: the kernel's 128, and 72 / 96 / 104
# zero-padded to it.
@pytest.mark.parametrize("head_dim", (128, 72, 96, 104), ids=lambda d: f"d{d}")
@HOPPER_FLOAT32_SHAPES
def test_float32_highest_backward_on_float16_parts(head_dim, seqlens, heads, feature, monkeypatch):
    if not _is_hopper():
        pytest.skip("the sm90 kernel needs a compute capability 9.x GPU")
    only_float32_paths(monkeypatch, _ffi_calls.FLOAT16_PARTS_BACKWARD_ENV)
    monkeypatch.setenv("JAX_FLASH_CUDA_KERNEL_F32_BACKWARD", "sm90")
    case = Case(batch=2, seqlen_q=seqlens[0], seqlen_k=seqlens[1], heads_q=heads[0], heads_kv=heads[1],
                head_dim=head_dim, dtype=jnp.float32, seed=head_dim + seqlens[1] + 3)
    assert_backward_has_float16_parts(case, **feature_kwargs(feature, case))
    check_float32_on_gpu(case, "highest", **feature_kwargs(feature, case))


def test_float32_highest_backward_on_float16_parts_long_sums_and_magnitudes(monkeypatch):
    """2048 queries per key block and keys per query tile (the item-by-item partial sums), and operands far from 1 in
    both directions (the scaling's powers of two): within the exact bound; bit-identical runs (no atomics)."""
    if not _is_hopper():
        pytest.skip("the sm90 kernel needs a compute capability 9.x GPU")
    only_float32_paths(monkeypatch, _ffi_calls.FLOAT16_PARTS_BACKWARD_ENV)
    monkeypatch.setenv("JAX_FLASH_CUDA_KERNEL_F32_BACKWARD", "sm90")
    case = Case(batch=1, seqlen_q=2048, seqlen_k=2048, heads_q=4, heads_kv=2, head_dim=128, dtype=jnp.float32,
                seed=17)
    assert_backward_has_float16_parts(case)
    check_float32_on_gpu(case, "highest")
    q, k, v = _on(GPUS[0], *case.inputs())
    q, k, v = q * 1e-12, k * 1e12, v * 1e20
    d_o = jax.device_put(jax.random.normal(jax.random.key(5), q.shape, jnp.float32) * 1e-15, GPUS[0])
    ours = bit_identical_runs(lambda: grads(q, k, v, d_o, float32_precision="highest", causal=True), runs=3)
    for name, g, reference in zip(("dq", "dk", "dv"), ours, oracle_grads(q, k, v, d_o, causal=True)):
        assert max_error(g, reference) <= 2e-5 * float(np.max(np.abs(reference))), name


def assert_backward_has_float16_parts(case: Case, **kwargs):
    """The switch gave this call's backward the float16-parts workspace (not a vacuous pass through the exact
    kernels, which meet the same bound)."""
    def loss(q_, k_, v_):
        return jnp.sum(jax_flash.attention(q_, k_, v_, float32_precision="highest", **kwargs))
    q, k, v = _on(GPUS[0], *case.inputs())
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).as_text()
    workspace = "tensor<{}x{}x{}xf16>".format(*_ffi_calls.backward_parts_workspace_shape(q, k))
    calls = [line for line in text.splitlines() if "jax_flash_attention_backward" in line]
    assert calls and all(workspace in call for call in calls), calls


@pytest.mark.parametrize("head_dim", (64, 128))
def test_float32_tf32_backward_on_sm90_is_bit_identical(head_dim, monkeypatch):
    """Many key tiles per CTA and both consumer warpgroups busy: where the thirteenth session's dQ pass released a
    K stage before its loads had landed, dQ differed from run to run (and from the reference) in these shapes."""
    if not _is_hopper():
        pytest.skip("the sm90 kernel needs a compute capability 9.x GPU")
    only_float32_paths(monkeypatch)
    monkeypatch.setenv("JAX_FLASH_CUDA_KERNEL_F32_BACKWARD", "sm90")
    case = Case(batch=2, seqlen_q=300, seqlen_k=1024, heads_q=4, heads_kv=4, head_dim=head_dim, dtype=jnp.float32)
    q, k, v = _on(GPUS[0], *case.inputs())
    d_o = jax.device_put(jax.random.normal(jax.random.key(3), q.shape, jnp.float32), GPUS[0])
    bit_identical_runs(lambda: grads(q, k, v, d_o, float32_precision="tf32"), runs=4)


@pytest.mark.parametrize("head_dim", (64, 100))
@pytest.mark.parametrize("feature", ("causal", "seqlens"))
def test_float32_tf32_backward_on_the_mma_sync_passes(head_dim, feature, monkeypatch):
    """sm80 keeps the mma.sync TF32 passes, which on a Hopper GPU run only the calls the sm90 ones refuse by default
    (bias, dropout, softcap, ALiBi): these common-form calls keep them tested there."""
    only_float32_paths(monkeypatch)
    monkeypatch.setenv("JAX_FLASH_CUDA_KERNEL_F32_BACKWARD", "sm80")
    case = Case(batch=2, seqlen_q=300, seqlen_k=777, heads_q=4, heads_kv=2, head_dim=head_dim, dtype=jnp.float32,
                seed=head_dim)
    check_float32_on_gpu(case, "tf32", **feature_kwargs(feature, case))


def test_float32_tf32_backward_kernel_switch(monkeypatch):
    q, k, v = _on(GPUS[0], *Case(dtype=jnp.float32, head_dim=64).inputs())
    d_o = jax.device_put(jax.random.normal(jax.random.key(3), q.shape, jnp.float32), GPUS[0])
    only_float32_paths(monkeypatch)
    monkeypatch.setenv("JAX_FLASH_CUDA_KERNEL_F32_BACKWARD", "fast")
    with pytest.raises(Exception, match="JAX_FLASH_CUDA_KERNEL_F32_BACKWARD must be sm80, sm90 or auto"):
        jax.block_until_ready(grads(q, k, v, d_o, float32_precision="tf32"))
    if _is_hopper():  # a feature the Hopper TF32 backward does not have: forcing it is an error, not a fallback
        monkeypatch.setenv("JAX_FLASH_CUDA_KERNEL_F32_BACKWARD", "sm90")
        with pytest.raises(Exception, match="run on the float32 kernels only"):
            jax.block_until_ready(grads(q, k, v, d_o, float32_precision="tf32", softcap=5.0))


@pytest.mark.parametrize("precision", FLOAT32_MODES)
def test_float32_backward_is_bit_identical(precision):
    """``deterministic=True`` with the defaults: on a Hopper the TF32 mode's backward runs on float16 operands, whose
    non-deterministic calls sum dQ with atomics like the 16-bit backward's (s41 on an H100: 1.8% of dQ's elements
    differed by an ulp between two runs without the flag)."""
    case = Case(batch=2, seqlen_q=700, seqlen_k=900, heads_q=8, heads_kv=2, head_dim=128, dtype=jnp.float32)
    q, k, v = _on(GPUS[0], *case.inputs())
    d_o = jax.device_put(jax.random.normal(jax.random.key(3), q.shape, jnp.float32), GPUS[0])
    runs = [[np.asarray(g) for g in grads(q, k, v, d_o, causal=True, float32_precision=precision,
                                          deterministic=True)]
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


@pytest.mark.parametrize("precision", FLOAT32_MODES)
def test_float32_defaults_on_a_hopper(precision, monkeypatch):
    """The switches unset on a Hopper: the call's CUDA branch (_config.per_platform) is all that compiles, with no
    conditional left on the platform; its backward takes the Hopper path (float16 operands in the TF32 mode, the
    float16-parts workspace in "highest" at d=128) and meets the mode's bound."""
    if not _is_hopper():
        pytest.skip("the float32 paths' defaults are on on compute capability 9.x GPUs only")
    for variable in _ffi_calls.HOPPER_PATH_SWITCHES:
        monkeypatch.delenv(variable, raising=False)
    case = Case(batch=1, seqlen_q=200, seqlen_k=260, heads_q=4, heads_kv=2, head_dim=128, dtype=jnp.float32, seed=9)
    q, k, v = _on(GPUS[0], *case.inputs())

    def loss(q_, k_, v_):
        return jnp.sum(jax_flash.attention(q_, k_, v_, causal=True, float32_precision=precision))
    gradient = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v)
    assert "conditional" not in gradient.compile().as_text()
    (call,) = [line for line in gradient.as_text().splitlines() if "jax_flash_attention_backward" in line]
    assert "xf16>" in call, call
    check_float32_on_gpu(case, precision, causal=True)


# float32 with an additive bias, a boolean mask and dropout (issues #8, #10): the same bounds as above, in both
# modes. The mask has all-false rows (o = 0, lse = -inf, never NaN); dropout's reference draws the same keep mask.
FLOAT32_DENSE_CASE = Case(batch=2, seqlen_q=150, seqlen_k=203, heads_q=4, heads_kv=2, head_dim=64,
                          dtype=jnp.float32, seed=11)


def _float32_mask_with_empty_rows(case: Case):
    mask = jax.random.bernoulli(jax.random.key(6), 0.7, (case.batch, 1, case.seqlen_q, case.seqlen_k))
    return mask.at[:, :, 5].set(False).at[1, :, 77].set(False)


@pytest.mark.parametrize("precision", FLOAT32_MODES)
@pytest.mark.parametrize("dense", ("bias", "mask", "dropout", "all"))
def test_float32_bias_mask_dropout(precision, dense):
    case = FLOAT32_DENSE_CASE
    kwargs = {}
    if dense in ("bias", "all"):
        kwargs["bias"] = jax.random.normal(jax.random.key(1), (case.heads_q, case.seqlen_q, case.seqlen_k))
    if dense in ("mask", "all"):
        kwargs["mask"] = _float32_mask_with_empty_rows(case)
    if dense in ("dropout", "all"):
        kwargs.update(dropout_rate=0.2, dropout_rng=jax.random.key(7))
    check_float32_on_gpu(case, precision, causal=dense == "all", **kwargs)
    if "mask" in kwargs:
        o, lse = jax_flash.attention(*_on(GPUS[0], *case.inputs()), return_lse=True, float32_precision=precision,
                                     **_gpu_kwargs(kwargs))
        assert np.all(np.isneginf(np.asarray(lse)[:, :, 5])) and np.all(np.asarray(o)[:, 5] == 0)


# The Hopper TF32 and split-TF32 forwards' transforms form (softcap, ALiBi, softmax_scale <= 0) and dense form (bias,
# boolean mask; on by default, JAX_FLASH_TF32_FORMS=0 turns them off, so the test sets 1), forced with
# JAX_FLASH_CUDA_KERNEL_F32=sm90, so that a pass shows the Hopper kernel computed them. "split" is "highest" with
# JAX_FLASH_SM90_SPLIT_TF32=1, held to the exact mode's bound.
@pytest.mark.parametrize("mode", ("tf32", "split"))
@pytest.mark.parametrize("head_dim", (64, 100))
@pytest.mark.parametrize("feature", ("softcap", "alibi_batched_causal", "everything", "bias", "mask", "bias_mask"))
def test_float32_tf32_forms_on_sm90(feature, head_dim, mode, monkeypatch):
    if not _is_hopper():
        pytest.skip("the sm90 kernel needs a compute capability 9.x GPU")
    monkeypatch.setenv(_ffi_calls.TF32_FORMS_ENV, "1")
    monkeypatch.setenv("JAX_FLASH_CUDA_KERNEL_F32", "sm90")
    monkeypatch.setenv(_ffi_calls.SPLIT_TF32_ENV, "1" if mode == "split" else "0")
    case = dataclasses.replace(FLOAT32_DENSE_CASE, head_dim=head_dim)
    if feature in ("bias", "mask", "bias_mask"):
        kwargs = {"causal": feature == "bias_mask"}
        if "bias" in feature:
            kwargs["bias"] = jax.random.normal(jax.random.key(1), (case.heads_q, case.seqlen_q, case.seqlen_k))
        if "mask" in feature:
            kwargs["mask"] = _float32_mask_with_empty_rows(case)
    else:
        kwargs = feature_kwargs(feature, case)
    check_float32_on_gpu(case, "tf32" if mode == "tf32" else "highest", gradients=False, **kwargs)


@pytest.mark.parametrize("precision", FLOAT32_MODES)
@pytest.mark.parametrize("deterministic", (False, True), ids=("atomic", "deterministic"))
@pytest.mark.parametrize("shape", [(2, 4, 150, 203), (4, 150, 203), (1, 4, 1, 203), (203,)], ids=str)
def test_float32_dbias(precision, deterministic, shape):
    """dbias of full and broadcast biases (stores, atomics, or the deterministic kernel), with mask and dropout.
    No key-broadcast shape: its dbias is 0 up to rounding (softmax is shift-invariant), so a relative bound
    would compare noise."""
    case = FLOAT32_DENSE_CASE
    q, k, v = case.inputs()
    d_o = jax.random.normal(jax.random.key(case.seed + 99), q.shape, jnp.float32)
    bias = jax.random.normal(jax.random.key(4), shape, jnp.float32)
    kwargs = dict(causal=True, mask=_padding_mask([203, 170], case.seqlen_k), dropout_rate=0.1,
                  dropout_rng=jax.random.key(5))
    _poison_gpu_memory()
    on_gpu = _on(GPUS[0], q, k, v, d_o, bias)
    ours = _grads_with_bias(*on_gpu, deterministic=deterministic, float32_precision=precision,
                            **_gpu_kwargs(kwargs))
    reference = _oracle_grads_with_bias(q, k, v, d_o, bias, **kwargs)
    assert ours[3].shape == bias.shape and ours[3].dtype == jnp.float32
    names = ("dq", "dk", "dv", "dbias")
    if precision == "highest":
        for name, g, g_ref in zip(names, ours, reference):
            error = _relative_error(g, g_ref)
            assert error <= EXACT_FLOAT32_RTOL, f"{name}: relative error {error:.2e} > {EXACT_FLOAT32_RTOL:.0e}"
    else:
        with jax.default_matmul_precision("tensorfloat32"):
            xla = _grads_with_bias(*on_gpu, implementation="xla", **_gpu_kwargs(kwargs))
        for name, g, g_xla, g_ref in zip(names, ours, xla, reference):
            assert_within_tf32_bound(name, g, g_xla, g_ref, scale=4.0)
    if deterministic:
        again = _grads_with_bias(*on_gpu, deterministic=True, float32_precision=precision, **_gpu_kwargs(kwargs))
        for a, b in zip(ours, again):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
