"""benchmarks/emulate_split_products.py, the CPU emulation behind the split-operand designs (NOTES, thirty-fifth
session): its rounding helpers against their definitions, and its schemes' accuracy ordering on a small causal
backward (the split schemes near float32's floor, one TF32 product three orders of magnitude worse)."""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import emulate_split_products as emu  # noqa: E402


def test_tf32_rounding_keeps_ten_mantissa_bits_and_rounds_half_away():
    one = np.float32(1.0)
    ulp = np.float32(2.0 ** -10)
    assert emu.round_tf32(np.float32(1.0 + 2.0 ** -11)) == one + ulp  # a tie rounds away from zero
    assert emu.round_tf32(np.float32(-(1.0 + 2.0 ** -11))) == -(one + ulp)
    assert emu.round_tf32(np.float32(1.0 + 2.0 ** -12)) == one
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    bits = emu.round_tf32(x).view(np.uint32)
    assert np.all(bits & np.uint32(0x1FFF) == 0)
    assert np.max(np.abs(emu.round_tf32(x) - x) / np.abs(x)) <= 2.0 ** -11


def test_tf32_parts_carry_twice_the_bits():
    x = (np.random.default_rng(1).standard_normal(1000) * 100).astype(np.float32)
    hi, lo = emu.parts(x, emu.round_tf32)
    assert np.all(hi == emu.round_tf32(hi)) and np.all(lo == emu.round_tf32(lo))
    assert np.max(np.abs((hi.astype(np.float64) + lo) - x) / np.abs(x)) <= 2.0 ** -21


def test_fp16_parts_of_a_scaled_tensor_carry_twice_the_bits_of_its_largest_element():
    # float16's range: the scheme scales the tensor first; elements far below its maximum lose their lo part to
    # subnormals, an error of at most 2^-25 absolute, i.e. far below 2^-21 of the maximum.
    x = (np.random.default_rng(1).standard_normal(1000) * 1e-3).astype(np.float32)
    x = x * np.float32(emu.power_of_two_scale(np.abs(x).max()))
    hi, lo = emu.parts(x, emu.round_fp16)
    assert np.all(hi == emu.round_fp16(hi)) and np.all(lo == emu.round_fp16(lo))
    assert np.max(np.abs((hi.astype(np.float64) + lo) - x)) <= 2.0 ** -21 * np.abs(x).max()
    unscaled_hi, unscaled_lo = emu.parts(x * np.float32(2.0 ** -20), emu.round_fp16)
    assert np.max(np.abs((unscaled_hi.astype(np.float64) + unscaled_lo) - x * 2.0 ** -20)) > (
        2.0 ** -21 * np.abs(x).max() * 2.0 ** -20)  # why the scale is needed


def test_power_of_two_scale_lands_in_the_target_octave():
    for bound in (3e-7, 0.5, 1.0, 7.0, 12345.0):
        scaled = bound * emu.power_of_two_scale(bound)
        assert 2.0 ** 13 <= scaled < 2.0 ** 14
        assert np.log2(emu.power_of_two_scale(bound)) % 1 == 0
    assert emu.power_of_two_scale(0.0) == 1.0


def test_split_schemes_reach_float32_accuracy_where_one_tf32_product_does_not():
    rng = np.random.default_rng(2)
    q, d_o = (rng.standard_normal((40, 32), dtype=np.float32) * 0.01 for _ in range(2))
    k, v = (rng.standard_normal((70, 32), dtype=np.float32) * 0.01 for _ in range(2))
    reference = emu.backward(q, k, v, d_o, 1 / np.sqrt(32), True, "float64")
    errors = {}
    for scheme in ("float32", "tf32", "tf32x3", "fp16x3"):
        grads = emu.backward(q, k, v, d_o, 1 / np.sqrt(32), True, scheme)
        errors[scheme] = max(emu.relative_error(g, r) for g, r in zip(grads, reference))
    assert errors["float32"] < 2e-6
    assert errors["tf32x3"] < 1e-5 and errors["fp16x3"] < 1e-5
    assert errors["tf32"] > 1e-4
    o_ref, _ = emu.forward(q, k, v, 1 / np.sqrt(32), True, "float64")
    o_errors = {scheme: emu.relative_error(emu.forward(q, k, v, 1 / np.sqrt(32), True, scheme)[0], o_ref)
                for scheme in ("tf32", "tf32x3", "fp16x3")}
    assert o_errors["tf32x3"] < 1e-5 and o_errors["fp16x3"] < 1e-5 and o_errors["tf32"] > 1e-4


def test_round_toward_zero_never_rounds_up_in_magnitude():
    x = np.random.default_rng(3).standard_normal(1000) * 10.0 ** np.random.default_rng(4).uniform(-5, 5, 1000)
    rounded = emu.round_toward_zero(x)
    assert rounded.dtype == np.float32
    assert np.all(np.abs(rounded.astype(np.float64)) <= np.abs(x))
    assert np.all(np.abs(x - rounded) < np.abs(np.spacing(rounded)))  # within one float32 ulp
    assert np.all(emu.round_toward_zero(np.array([1.0, -2.5, 0.0])) == np.array([1.0, -2.5, 0.0], np.float32))


def test_accumulation_models_agree_on_a_short_k_and_walk_items_in_order():
    rng = np.random.default_rng(5)
    a, b = rng.standard_normal((6, 8)).astype(np.float32), rng.standard_normal((8, 5)).astype(np.float32)
    exact = emu.accumulate([(a, b)], "exact")
    for mode in ("truncate", "per-item"):  # one k-step: one rounding toward zero of the exact sum
        np.testing.assert_array_equal(emu.accumulate([(a, b)], mode, item=8),
                                      emu.round_toward_zero(a.astype(np.float64) @ b))
    assert np.max(np.abs(emu.accumulate([(a, b)], "truncate", item=8) - exact)) <= 2.0 ** -22 * np.abs(exact).max()


def test_per_item_partial_sums_keep_the_split_backward_within_the_exact_bound():
    """The split-TF32 backward's first form summed each gradient over all 1000 queries of a causal key block in the
    tensor cores' truncating accumulator: dK, dV past the exact mode's 1e-5 (as on the H200, NOTES thirty-sixth
    session); summing per item of 32 and adding items in float32 (split_tf32_mma.h add_partial_sums) stays ~1e-6."""
    rng = np.random.default_rng(0)
    q, d_o, k, v = (rng.standard_normal((1000, 16), dtype=np.float32) for _ in range(4))
    reference = emu.backward(q, k, v, d_o, 0.25, True, "float64")

    def errors(mode):
        grads = emu.backward(q, k, v, d_o, 0.25, True, "tf32x3", mode, 32)
        return [emu.relative_error(g, r) for g, r in zip(grads, reference)]

    truncated, per_item = errors("truncate"), errors("per-item")
    assert max(truncated[1:]) > 1e-5  # dk, dv
    assert max(per_item) < 2e-6
