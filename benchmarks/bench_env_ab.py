"""A/B of one jax_flash environment switch through JAX, against cuDNN in the same run.

The C++ launchers read their tuning switches (JAX_FLASH_SM90_PERSISTENT, JAX_FLASH_SM90_CAUSAL_BAND_MIB, ...) at
every call, so one process can time every value of a switch on the same inputs, interleaved over --rounds rounds
(the best round of each value is kept, and of cuDNN, which takes a turn in every round), which takes
process-to-process noise out of the comparison. Each value gets a freshly jitted function, so no executable or
captured command buffer carries a kernel choice over from another value. Shapes and FLOPs as
benchmarks/bench_attention.py (16k tokens per batch, heads * head_dim = 2048, bf16).

Run:  python benchmarks/bench_env_ab.py --env JAX_FLASH_SM90_CAUSAL_BAND_MIB --values 0 auto 4 64 \
          [--head-dims 64 128 256] [--seqlens 512 1024 ...] [--causal yes|no|both] [--backward] [--tag TAG]
Writes benchmarks/results/env_ab_<gpu>_<date>[_<tag>].json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_attention import (MODEL_WIDTH, RESULTS_DIR, TOKENS, attention_fn, environment, median_seconds,  # noqa: E402
                             versions)


def time_cell(attend, inputs, d_o, flops: float, reps: int, backward: bool) -> dict:
    """TFLOP/s of a freshly jitted forward (and backward) of `attend`."""
    import jax

    timings = {"fwd_tflops": flops / median_seconds(jax.jit(lambda *a: attend(*a)), inputs, reps) / 1e12}
    if backward:
        _, vjp = jax.vjp(attend, *inputs)
        seconds = median_seconds(jax.jit(lambda vjp_fn, g: vjp_fn(g)), (vjp, d_o), reps)
        timings["bwd_tflops"] = 2.5 * flops / seconds / 1e12
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", required=True, help="the switch, e.g. JAX_FLASH_SM90_CAUSAL_BAND_MIB")
    parser.add_argument("--values", nargs="+", required=True, help="its values; the first is the baseline")
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--causal", choices=("yes", "no", "both"), default="both")
    parser.add_argument("--backward", action="store_true", help="also time the backward")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--kernel", default="sm90", help="JAX_FLASH_CUDA_KERNEL for the jax_flash rows")
    parser.add_argument("--out-dir", default=RESULTS_DIR)
    parser.add_argument("--tag", default="")
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp

    os.environ["JAX_FLASH_CUDA_KERNEL"] = args.kernel
    causal_values = {"yes": [True], "no": [False], "both": [False, True]}[args.causal]
    rows = []
    for head_dim in args.head_dims:
        for seqlen in args.seqlens:
            batch, heads = TOKENS // seqlen, MODEL_WIDTH // head_dim
            shape = (batch, seqlen, heads, head_dim)
            q, k, v, d_o = (jax.random.normal(key, shape, jnp.bfloat16)
                            for key in jax.random.split(jax.random.key(seqlen + head_dim), 4))
            for causal in causal_values:
                flops = 4.0 * batch * heads * seqlen * seqlen * head_dim * (0.5 if causal else 1.0)
                cell = {"head_dim": head_dim, "seqlen": seqlen, "batch": batch, "heads": heads, "causal": causal}
                # cuDNN takes a turn in every round too and keeps its best round, like each value: timed once, it
                # was held to one draw of the clock-speed noise against the values' best of several.
                # The turns go in reverse order on odd rounds (as bench_attention.py's), so no value always follows
                # the same one.
                best: dict[str, dict] = {}
                for round_index in range(args.rounds):
                    turns = [*args.values, "cudnn"]
                    for value in turns[::-1] if round_index % 2 else turns:
                        with environment({args.env: None if value == "cudnn" else value}):
                            implementation = "cudnn" if value == "cudnn" else "jax_flash_sm90"
                            t = time_cell(attention_fn(implementation, causal), (q, k, v), d_o, flops, args.reps,
                                          args.backward)
                        best[value] = {m: max(t[m], best.get(value, {}).get(m, 0.0)) for m in t}
                cudnn = best.pop("cudnn")
                rows.append({**cell, "values": best, "cudnn": cudnn})
                line = " ".join(f"{value}={best[value]['fwd_tflops']:6.1f}" for value in args.values)
                ratio = best[args.values[-1]]["fwd_tflops"] / best[args.values[0]]["fwd_tflops"]
                print(f"d={head_dim:3d} s={seqlen:5d} causal={causal!s:5}  fwd {line}  cudnn={cudnn['fwd_tflops']:6.1f}"
                      f"  last/first={ratio:.3f}", flush=True)
                if args.backward:
                    line = " ".join(f"{value}={best[value]['bwd_tflops']:6.1f}" for value in args.values)
                    print(f"{'':32}bwd {line}  cudnn={cudnn['bwd_tflops']:6.1f}", flush=True)

    gpu = jax.devices()[0].device_kind
    date = datetime.date.today().isoformat()
    os.makedirs(args.out_dir, exist_ok=True)
    name = f"env_ab_{gpu.replace(' ', '_')}_{date}{'_' + args.tag if args.tag else ''}.json"
    with open(os.path.join(args.out_dir, name), "w") as f:
        json.dump({"gpu": gpu, "date": date, "versions": versions(), "env": args.env, "values": args.values,
                   "kernel": args.kernel, "rounds": args.rounds, "reps": args.reps, "rows": rows}, f, indent=1)
    print("wrote", os.path.join(args.out_dir, name))


if __name__ == "__main__":
    main()
