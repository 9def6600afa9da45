"""How much the backward loses to its last, partly filled wave of CTAs (a diagnostic for #3, not a benchmark).

At 16k tokens, d=128 and 16 heads, the sm80 dK/dV pass launches 2048 CTAs (one per 128-key block and head), one
per SM: 15.5 waves on the H200's 132 SMs, so the sixteenth runs half full. This script times the backward through
JAX at seqlen 4096, batch 1, with head counts around that (64 heads: 2048 CTAs; 66: 2112 = 16 full waves; 62 and
60 fewer) and prints TFLOP/s per head count: if the tail costs what the arithmetic says, 66 heads run ~3% faster
per FLOP than 64. `--same-inputs` passes one tensor as q, k, v and dO (as standalone_check --bench does), to see
how much of that benchmark's lead over bench_attention.py comes from its inputs.

  python3 csrc/cuda/tests/wave_probe.py [--family sm80|auto] [--heads 60 62 64 66] [--same-inputs]
"""

import argparse
import os
import sys

import jax
import jax.numpy as jnp

import jax_flash

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "benchmarks"))
from bench_attention import median_seconds  # noqa: E402 - the benchmark's timing, so the two numbers compare

SEQLEN, HEAD_DIM = 4096, 128


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="sm80", help="JAX_FLASH_CUDA_KERNEL_BACKWARD for the calls")
    parser.add_argument("--heads", type=int, nargs="+", default=[60, 62, 64, 66, 68])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--same-inputs", action="store_true")
    args = parser.parse_args()
    os.environ["JAX_FLASH_CUDA_KERNEL_BACKWARD"] = args.family
    for heads in args.heads:
        shape = (args.batch, SEQLEN, heads, HEAD_DIM)
        keys = jax.random.split(jax.random.key(heads), 4)
        q, k, v, d_o = (jax.random.normal(key, shape, jnp.bfloat16) for key in keys)
        if args.same_inputs:
            k = v = d_o = q
        _, vjp = jax.vjp(lambda q, k, v: jax_flash.attention(q, k, v), q, k, v)
        backward = jax.jit(lambda vjp_fn, g: vjp_fn(g))
        flops = 2.5 * 4.0 * args.batch * heads * SEQLEN * SEQLEN * HEAD_DIM
        seconds = median_seconds(backward, (vjp, d_o), args.reps)
        ctas = args.batch * heads * (SEQLEN // 128)
        print(f"family={args.family} batch={args.batch} heads={heads} dkdv_ctas={ctas} "
              f"same_inputs={args.same_inputs}: bwd {seconds * 1e3:.3f} ms {flops / seconds / 1e12:.1f} TFLOP/s",
              flush=True)


if __name__ == "__main__":
    main()
