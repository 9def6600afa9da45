"""Which kernels one jitted attention backward (or, with --forward, forward) runs, and how long each takes
(device_run.sh stages `kernel_times` and `ncu_vs_cudnn`).

Run under Nsight Compute with a single cheap metric and neither cache flushing nor clock locking, so that each
kernel's duration is close to its time in a normal run:

  ncu --csv --metrics gpu__time_duration.sum --cache-control none --clock-control none \
      python3 csrc/cuda/tests/attention_kernel_times.py --impl jax_flash_sm90 --head-dim 64 --seqlen 1024 \
      --causal > t.csv
  python3 csrc/cuda/tests/attention_kernel_times.py --summarize t.csv

The program calls the jitted backward (the vjp of attention, as benchmarks/bench_attention.py times it, same
shapes: 16k tokens per batch, heads * head_dim = 2048, bf16) four times; with --forward, the jitted forward four
times instead. --summarize takes the kernels of the last call (the tail that the launches before it repeat: the
first call also compiles and autotunes) and prints each kernel's duration and share, and their sum.
"""

import argparse
import csv
import io
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "benchmarks"))
from bench_attention import MODEL_WIDTH, TOKENS, attention_fn, kernel_families  # noqa: E402

IMPLEMENTATIONS = ("jax_flash_sm90", "cudnn")  # bench_attention.py's names


def run(implementation: str, head_dim: int, seqlen: int, causal: bool, forward: bool) -> None:
    import jax
    import jax.numpy as jnp

    batch, heads = TOKENS // seqlen, MODEL_WIDTH // head_dim
    keys = jax.random.split(jax.random.key(1), 4)
    q, k, v, d_o = (jax.random.normal(key, (batch, seqlen, heads, head_dim), jnp.bfloat16) for key in keys)
    with kernel_families(implementation):
        if forward:
            attention = jax.jit(attention_fn(implementation, causal))
            for _ in range(4):
                jax.block_until_ready(attention(q, k, v))
            return
        _, vjp = jax.vjp(attention_fn(implementation, causal), q, k, v)
        backward = jax.jit(lambda vjp_fn, g: vjp_fn(g))
        for _ in range(4):
            jax.block_until_ready(backward(vjp, d_o))


def summarize(path: str) -> None:
    text = open(path).read()
    start = text.find('"ID"')
    if start < 0:
        sys.exit(f"{path}: no Nsight Compute CSV table")
    names, microseconds = [], []
    for row in csv.DictReader(io.StringIO(text[start:])):
        if row["Metric Name"] != "gpu__time_duration.sum":
            continue
        scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}[row["Metric Unit"]]
        names.append(row["Kernel Name"])
        microseconds.append(float(row["Metric Value"].replace(",", "")) * scale)
    # The last call's kernels: the shortest tail that the launches before it repeat twice (three calls alike).
    count = len(names)
    period = next((p for p in range(1, count // 3 + 1)
                   if names[count - p:] == names[count - 2 * p:count - p] == names[count - 3 * p:count - 2 * p]), None)
    if period is None:
        sys.exit(f"{path}: no repeating tail among {count} launches")
    total = sum(microseconds[count - period:])
    print(f"{period} kernels per call, {total:.1f} us in all")
    for name, us in zip(names[count - period:], microseconds[count - period:]):
        print(f"  {us:9.1f} us  {100 * us / total:5.1f}%  {name[:110]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", choices=IMPLEMENTATIONS, default=IMPLEMENTATIONS[0])
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--seqlen", type=int, default=1024)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--forward", action="store_true", help="time the forward instead of the backward")
    parser.add_argument("--summarize", metavar="CSV", help="print the last call's kernels from ncu's CSV output")
    args = parser.parse_args()
    if args.summarize:
        summarize(args.summarize)
    else:
        run(args.impl, args.head_dim, args.seqlen, args.causal, args.forward)


if __name__ == "__main__":
    main()
