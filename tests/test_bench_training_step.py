"""CPU smoke test of benchmarks/bench_training_step.py: its training step runs with jax_flash's attention and with
jax.nn's XLA attention from the same initialisation, and the two agree. Not a timing test."""

import json
import math
import os
import re
import sys

import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

bench = pytest.importorskip("bench_training_step", exc_type=ImportError)  # needs flax and optax


def tiny_config() -> "bench.ModelConfig":
    return bench.ModelConfig(vocab_size=64, seq_len=48, d_model=32, num_layers=2, num_heads=2, num_kv_heads=2,
                             dtype=jnp.dtype("float32"))


def custom_call_targets(step_fn, params, opt_state) -> set[str]:
    text = step_fn.lower(params, opt_state, jnp.int32(0)).as_text()
    return set(re.findall(r"custom_call @(\w+)", text))


def test_step_with_jax_flash_matches_xla():
    firsts = {}
    for implementation in ("jax_flash", "xla"):
        step_fn, params, opt_state = bench.make_train_step(
            bench.build_model(tiny_config(), implementation, seed=3), bench.optimizer(), batch_size=2, seed=3)
        targets = custom_call_targets(step_fn, params, opt_state)
        # The swap really swaps: jax_flash's kernels run forward and backward in one model and not in the other.
        uses_kernels = {"jax_flash_attention_forward", "jax_flash_attention_backward"} <= targets
        assert uses_kernels == (implementation == "jax_flash"), targets
        *_, firsts[implementation] = bench.first_two_steps(step_fn, params, opt_state)

    flash, xla = firsts["jax_flash"], firsts["xla"]
    assert math.isfinite(flash["loss_init"]) and flash["grad_norm_init"] > 0.0
    assert flash["loss_after_one_step"] != flash["loss_init"]
    tolerance = bench.TOLERANCE["float32"]
    for key, bound in (("loss_init", tolerance["loss"]), ("loss_after_one_step", tolerance["loss"]),
                       ("grad_norm_init", tolerance["grad_norm"])):
        assert bench.relative_difference(flash[key], xla[key]) <= bound, (key, flash, xla)

    # Not vacuous: other parameters (another seed) through the same compiled XLA step give another loss.
    _, other_params = bench.nnx.split(bench.build_model(tiny_config(), "xla", seed=4))
    *_, other = bench.first_two_steps(step_fn, other_params, bench.optimizer().init(other_params))
    assert bench.relative_difference(other["loss_init"], xla["loss_init"]) > tolerance["loss"]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU run, where cuDNN is skipped")
def test_quick_run_writes_results(tmp_path):
    status = bench.main(["--quick", "--impls", "jax_flash", "xla", "cudnn", "--num-layers", "1", "--seq-len", "64",
                         "--steps", "1", "--trials", "1", "--out-dir", str(tmp_path)])
    assert status == 0
    (path,) = tmp_path.glob("training_step_*.json")
    result = json.loads(path.read_text())
    assert {"gpu", "date", "versions", "config", "rows", "comparison"} <= set(result)
    assert result["config"]["num_layers"] == 1 and result["config"]["seq_len"] == 64
    rows = {row["impl"]: row for row in result["rows"]}
    assert rows["jax_flash"]["step_ms"] > 0.0 and rows["xla"]["step_ms"] > 0.0
    assert "GPU" in rows["cudnn"]["skipped"]
    assert result["comparison"]["xla"]["agree"]
