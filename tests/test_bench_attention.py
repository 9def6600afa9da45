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
@pytest.mark.parametrize("implementation", ("jax_flash_tf32", "jax_flash_f32_highest", "xla_f32_default",
                                            "xla_f32_highest", "jax_flash_sm80"))
def test_rows_compute_their_feature(implementation, feature, causal):
    attend = bench.attention_fn(implementation, causal, feature, batch=BATCH, seqlen=SEQLEN)
    out = np.asarray(jax.jit(attend)(*inputs()), np.float64)
    want = np.asarray(expected(implementation, feature, causal), np.float64)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)
    if feature != "none" and (feature == "padding_mask" or implementation.startswith("jax_flash")):
        plain = np.asarray(expected(implementation, "none", causal), np.float64)
        assert np.max(np.abs(plain - want)) > 1e-2, "the feature does not change this call: the test is vacuous"


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
