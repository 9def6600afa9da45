"""Where the time of a feature forward goes through JAX (device_run.sh stage `ncu_features`).

The fifth session measured the padding-mask forward at 186 TFLOP/s through JAX (bench_attention.py) against 563 in
the standalone CUDA-event benchmark (d=128, seqlen 4096, batch 4, 16 heads, [batch, 1, 1, seqlen] key-padding mask).
The sixth session found the standalone number wrong (its problem left inner_batch at 1, so batch rows 1-3 read
mask and summary bytes past their ends) and Nsight Compute put the kernels at: plain 1.07 ms, padding mask (sm90
dense form) 2.6 ms, softcap (transforms form) 3.06 ms, at ncu's locked 1.35 GHz. This script runs those calls (and
ALiBi) jitted and prints each one's wall-clock TFLOP/s; `--only NAME` runs one, for a detailed ncu profile of it
(device_run.sh stage ncu_forms).

  python3 csrc/cuda/tests/feature_forward_probe.py [--reps N] [--only plain|padding_mask|softcap|alibi]
"""

import argparse
import time

import jax
import jax.numpy as jnp

import jax_flash

BATCH, SEQLEN, HEADS, HEAD_DIM = 4, 4096, 16, 128


def padding_mask():
    """benchmarks/bench_attention.py's mask: batch row b keeps its first SEQLEN * (1 - b / (2 * BATCH)) keys."""
    lengths = SEQLEN - (SEQLEN * jnp.arange(BATCH)) // (2 * BATCH)
    return (jnp.arange(SEQLEN)[None, :] < lengths[:, None])[:, None, None, :]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--only", choices=("plain", "padding_mask", "softcap", "alibi"), default=None)
    args = parser.parse_args()
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, (BATCH, SEQLEN, HEADS, HEAD_DIM), jnp.bfloat16) for key in keys)
    flops = 4.0 * BATCH * HEADS * SEQLEN * SEQLEN * HEAD_DIM
    mask = padding_mask()
    slopes = jnp.full((BATCH, HEADS), 0.0625, jnp.float32)
    calls = {
        "plain": lambda q, k, v: jax_flash.attention(q, k, v),
        "padding_mask (closure constant)": lambda q, k, v: jax_flash.attention(q, k, v, mask=mask),
        "padding_mask (argument)": lambda q, k, v, m: jax_flash.attention(q, k, v, mask=m),
        "softcap 50": lambda q, k, v: jax_flash.attention(q, k, v, softcap=50.0),
        "alibi": lambda q, k, v: jax_flash.attention(q, k, v, alibi_slopes=slopes),
    }
    for name, fn in calls.items():
        if args.only is not None and not name.startswith(args.only):
            continue
        operands = (q, k, v, mask) if "argument" in name else (q, k, v)
        forward = jax.jit(fn)
        jax.block_until_ready(forward(*operands))
        start = time.perf_counter()
        for _ in range(args.reps):
            out = forward(*operands)
        jax.block_until_ready(out)
        seconds = (time.perf_counter() - start) / args.reps
        print(f"{name:32s} {seconds * 1e3:8.3f} ms {flops / seconds * 1e-12:7.1f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
