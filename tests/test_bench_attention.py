"""CPU check of benchmarks/bench_attention.py's attention functions: every row computes the call it is labelled
with (a feature row really applies its feature, a float32 row its precision). Not a timing test. The twelfth
session found the float32 rows ignoring --features, so their "softcap" and "padding_mask" timings were plain calls."""

import os
import time
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from attention_cases import backward_call_operand_types

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

bench = pytest.importorskip("bench_attention", exc_type=ImportError)

BATCH, SEQLEN, HEADS, HEAD_DIM = 2, 24, 2, 16


def inputs():
    keys = jax.random.split(jax.random.key(0), 3)
    # Large scores, so that a softcap of bench.SOFTCAP visibly changes the softmax.
    return [40.0 * jax.random.normal(key, (BATCH, SEQLEN, HEADS, HEAD_DIM), jnp.float32) for key in keys]


def expected(implementation: str, feature: str, causal: bool):
    """What the row should compute, written out with jax_flash's own API."""
    q, k, v = inputs()
    mask = bench.padding_mask(BATCH, SEQLEN) if feature == "padding_mask" else None
    softcap = bench.SOFTCAP if feature == "softcap" and implementation.startswith("jax_flash") else 0.0
    return jax_flash.attention(q, k, v, causal=causal, mask=mask, softcap=softcap, implementation="xla")


@pytest.mark.parametrize("causal", (False, True))
@pytest.mark.parametrize("feature", ("none", "padding_mask", "softcap"))
@pytest.mark.parametrize("implementation", ("jax_flash_tf32", "jax_flash_tf32_fp16ops", "jax_flash_f32_highest",
                                            "jax_flash_f32_split", "jax_flash_f32_fp16parts", "xla_f32_default",
                                            "xla_f32_highest", "jax_flash_sm80"))
def test_rows_compute_their_feature(implementation, feature, causal):
    attend = bench.attention_fn(implementation, causal, feature, batch=BATCH, seqlen=SEQLEN)
    out = np.asarray(jax.jit(attend)(*inputs()), np.float64)
    want = np.asarray(expected(implementation, feature, causal), np.float64)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)
    if feature != "none" and (feature == "padding_mask" or implementation.startswith("jax_flash")):
        plain = np.asarray(expected(implementation, "none", causal), np.float64)
        assert np.max(np.abs(plain - want)) > 1e-2, "the feature does not change this call: the test is vacuous"


def _kernel_head_dim_inputs(head_dim: int, seed: int):
    """Unit-scale float32 q, k, v at a head dim the float32 Hopper kernels have (HEAD_DIM is below them)."""
    keys = jax.random.split(jax.random.key(seed), 3)
    return [jax.random.normal(key, (BATCH, SEQLEN, HEADS, head_dim), jnp.float32) for key in keys]


def _lowered_gradient(row: str, q, k, v) -> str:
    """The lowered module of the row's causal gradient step, traced under its kernel families."""
    with bench.kernel_families(row):
        attend = bench.attention_fn(row, True)
        step = jax.grad(lambda *a: jnp.sum(attend(*a)), argnums=(0, 1, 2))
        return jax.jit(step).lower(q, k, v).as_text()


def _set_or_unset(monkeypatch, name: str, setting: str | None) -> None:
    """The process's value of a switch for a test: `setting`, or unset for None."""
    if setting is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, setting)


@pytest.mark.parametrize("setting", (None, "0", "1"))
def test_split_row_traces_with_the_split_tf32_switch_and_restores_it(monkeypatch, setting):
    """Under its kernel families, the split row's forward and backward are traced with JAX_FLASH_SM90_SPLIT_TF32 and
    JAX_FLASH_SM90_SPLIT_TF32_BACKWARD at 1 (their lowered calls carry the split-TF32 workspaces), the exact row's
    with 0, whatever the process has; the process's values are back afterwards."""
    from jax_flash import _ffi_calls

    switches = (_ffi_calls.SPLIT_TF32_ENV, _ffi_calls.SPLIT_TF32_BACKWARD_ENV)
    for switch in switches:
        _set_or_unset(monkeypatch, switch, setting)
    q, k, v = inputs()
    workspaces = ("tensor<{}x{}x{}xf32>".format(*_ffi_calls.split_tf32_workspace_shape(q, k)),
                  "tensor<{}x{}x{}xf32>".format(*_ffi_calls.backward_parts_workspace_shape(q, k)))
    lowered = {row: _lowered_gradient(row, q, k, v) for row in ("jax_flash_f32_split", "jax_flash_f32_highest")}
    for workspace in workspaces:
        assert workspace in lowered["jax_flash_f32_split"]
        assert workspace not in lowered["jax_flash_f32_highest"]
    for switch in switches:
        assert os.environ.get(switch) == setting


@pytest.mark.parametrize("setting", (None, "0", "1"))
def test_fp16ops_row_traces_its_backward_on_float16_operands(monkeypatch, setting):
    """Under its kernel families the fp16ops row's backward call takes float16 operands (with float32 gradients),
    the plain TF32 row's float32 ones, whatever the process's JAX_FLASH_SM90_TF32_BACKWARD_FP16; restored after."""
    from jax_flash import _ffi_calls

    switch = _ffi_calls.HALF_OPERANDS_BACKWARD_ENV
    _set_or_unset(monkeypatch, switch, setting)
    q, k, v = _kernel_head_dim_inputs(64, seed=1)
    operand_types = {}
    for row in ("jax_flash_tf32_fp16ops", "jax_flash_tf32"):
        with bench.kernel_families(row):
            attend = bench.attention_fn(row, True)
            (operand_types[row],) = backward_call_operand_types(lambda *a: jnp.sum(attend(*a)), q, k, v)
    assert "xf16>" in operand_types["jax_flash_tf32_fp16ops"]
    assert "xf16>" not in operand_types["jax_flash_tf32"]
    assert os.environ.get(switch) == setting


@pytest.mark.parametrize("setting", (None, "0", "1"))
def test_fp16parts_row_traces_its_backward_on_float16_parts(monkeypatch, setting):
    """Under its kernel families the fp16parts row's backward call at head_dim 128 carries the float16-parts workspace,
    the split row's the split-TF32 one, whatever the process's JAX_FLASH_SM90_HIGHEST_BACKWARD_FP16; restored
    after."""
    from jax_flash import _ffi_calls

    switch = _ffi_calls.FLOAT16_PARTS_BACKWARD_ENV
    _set_or_unset(monkeypatch, switch, setting)
    q, k, v = _kernel_head_dim_inputs(128, seed=2)
    shape = "x".join(map(str, _ffi_calls.backward_parts_workspace_shape(q, k)))
    lowered = {row: _lowered_gradient(row, q, k, v) for row in ("jax_flash_f32_fp16parts", "jax_flash_f32_split")}
    assert f"tensor<{shape}xf16>" in lowered["jax_flash_f32_fp16parts"]
    assert f"tensor<{shape}xf32>" in lowered["jax_flash_f32_split"]
    assert os.environ.get(switch) == setting


def test_short_calls_get_enough_repetitions_for_a_long_trial():
    """median_seconds makes more than `reps` calls when they are short, so that each trial lasts
    min_trial_seconds, and still returns the time of one call."""
    calls = []

    def two_milliseconds(x):
        calls.append(None)
        time.sleep(0.002)
        return x

    seconds = bench.median_seconds(two_milliseconds, (jnp.ones(1),), reps=1, min_trial_seconds=0.03)
    # Warm-up and calibration calls, then 3 trials of about 0.03 / 0.002 = 15 calls (at least 6 with a slow sleep).
    assert len(calls) >= 2 + 3 * 6, len(calls)
    assert 0.002 <= seconds < 0.02, seconds


def test_rounds_take_turns_and_keep_each_implementations_best():
    """--rounds: the implementations alternate (reversed on odd rounds), and each row keeps its own best forward and
    backward TFLOP/s, with every round's numbers, whichever round they came from."""
    calls = []
    timings = {("a", 0): (100.0, 50.0), ("b", 0): (80.0, None), ("a", 1): (90.0, 60.0), ("b", 1): (85.0, 40.0),
               ("a", 2): (95.0, 55.0), ("b", 2): (70.0, 45.0)}

    def measure_one(implementation):
        round_index = sum(1 for c in calls if c == implementation)
        calls.append(implementation)
        fwd, bwd = timings[implementation, round_index]
        return {"impl": implementation, "fwd_tflops": fwd, "bwd_tflops": bwd}

    rows = bench.measure_cell(["a", "b"], 3, measure_one)
    assert calls == ["a", "b", "b", "a", "a", "b"]
    assert [r["impl"] for r in rows] == ["a", "b"]
    assert (rows[0]["fwd_tflops"], rows[0]["bwd_tflops"]) == (100.0, 60.0)
    assert (rows[1]["fwd_tflops"], rows[1]["bwd_tflops"]) == (85.0, 45.0)
    assert rows[1]["bwd_tflops_rounds"] == [None, 40.0, 45.0]
    assert "error" not in rows[0]


def test_one_round_is_the_plain_measurement_and_errors_survive():
    rows = bench.measure_cell(["a"], 1, lambda implementation: {"impl": implementation, "fwd_tflops": None,
                                                                "bwd_tflops": None, "error": "ValueError: no"})
    assert rows == [{"impl": "a", "fwd_tflops": None, "bwd_tflops": None, "error": "ValueError: no"}]
