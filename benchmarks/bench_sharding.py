"""One device vs several: forward + backward step time of jax_flash attention with the batch sharded, and with the
sequence sharded (ring attention), at a long sequence (32k tokens by default).

Cases, each timed on 1 device and on all ``--devices`` (default: every visible device):
- ``batch``: ``--devices`` sequences of ``--seq-len`` tokens; 1 device runs them all, N devices one each
  (jit + NamedSharding over the batch: custom partitioning, no communication).
- ``ring-jit``: one sequence of ``--seq-len`` tokens, sequence sharded with NamedSharding under jit (custom
  partitioning: ring attention; a causal mask moves the contiguous shards into the zigzag layout and back inside
  every call).
- ``ring-zigzag``: the same through ``jax_flash.ring_attention`` in ``shard_map`` on inputs already in the zigzag
  layout (what a model that keeps its tokens in zigzag order pays).

Ideal scaling: ``batch`` N devices take as long as 1 device with 1/N of the batch, i.e. N x faster than 1 device
with the whole batch; ring attention splits one sequence's work N ways, minus communication.

Run on the two-GPU machine:  python benchmarks/bench_sharding.py
CPU smoke test:             python benchmarks/bench_sharding.py --cpu-devices 2 --seq-len 1024 --heads 2 --iters 2
Writes benchmarks/results/sharding_<date>.json.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flash

RESULTS_DIR = os.path.join(os.path.dirname(__file__), "results")


def _inputs(batch: int, args: argparse.Namespace) -> tuple[jax.Array, ...]:
    keys = jax.random.split(jax.random.key(0), 4)
    dtype = jnp.dtype(args.dtype)
    q_shape = (batch, args.seq_len, args.heads, args.head_dim)
    kv_shape = (batch, args.seq_len, args.kv_heads, args.head_dim)
    return tuple(jax.random.normal(key, shape, dtype)
                 for key, shape in zip(keys, (q_shape, kv_shape, kv_shape, q_shape)))


def _step(attend):
    """Jitted forward + backward: gradients of ``sum(attend(q, k, v) * d_o)``."""
    loss = lambda q, k, v, d_o: jnp.sum((attend(q, k, v) * d_o).astype(jnp.float32))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def _time(fn, args: tuple[jax.Array, ...], iters: int) -> tuple[float, tuple[jax.Array, ...]]:
    """Median seconds of ``fn(*args)`` after one warm-up (compilation) call, and its result."""
    result = jax.block_until_ready(fn(*args))
    seconds = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), result


def _place(arrays: tuple[jax.Array, ...], mesh: Mesh, spec: P) -> tuple[jax.Array, ...]:
    return tuple(jax.device_put(x, NamedSharding(mesh, spec)) for x in arrays)


def _max_difference(a: tuple[jax.Array, ...], b: tuple[jax.Array, ...]) -> float:
    return max(float(np.max(np.abs(np.asarray(x, np.float32) - np.asarray(y, np.float32)))) for x, y in zip(a, b))


def run(args: argparse.Namespace) -> list[dict]:
    devices = jax.devices()[:args.devices or None]
    n = len(devices)
    one = Mesh(np.asarray(devices[:1]), ("x",))
    many = Mesh(np.asarray(devices), ("x",))
    attend = functools.partial(jax_flash.attention, causal=args.causal)
    rows = []

    def record(case: str, devices_used: int, seconds: float, tokens: int, difference: float | None) -> None:
        rows.append({"case": case, "devices": devices_used, "step_ms": 1e3 * seconds, "tokens": tokens,
                     "max_abs_difference_vs_1_device": difference})
        print(f"{case:>12} | {devices_used:>7} | {1e3 * seconds:>10.2f} | {tokens:>8}"
              + ("" if difference is None else f" | {difference:.2e}"), flush=True)

    print(f"{'case':>12} | {'devices':>7} | {'step ms':>10} | {'tokens':>8} | max |diff| vs 1 device")
    # Batch sharding: n sequences.
    inputs = _inputs(n, args)
    step = _step(attend)
    base, expected = _time(step, _place(inputs, one, P()), args.iters)
    record("batch", 1, base, n * args.seq_len, None)
    seconds, got = _time(step, _place(inputs, many, P("x")), args.iters)
    record("batch", n, seconds, n * args.seq_len, _max_difference(got, expected))

    # Sequence sharding: one sequence.
    inputs = _inputs(1, args)
    base, expected = _time(step, _place(inputs, one, P()), args.iters)
    record("sequence", 1, base, args.seq_len, None)
    seconds, got = _time(step, _place(inputs, many, P(None, "x")), args.iters)
    record("ring-jit", n, seconds, args.seq_len, _max_difference(got, expected))

    ring = functools.partial(jax_flash.ring_attention, axis_name="x", layout="zigzag", causal=args.causal)
    sharded = jax.shard_map(ring, mesh=many, in_specs=(P(None, "x"),) * 3, out_specs=P(None, "x"))
    zigzag_step = _step(sharded)
    zigzag = tuple(jax_flash.to_zigzag(x, n) for x in inputs)
    seconds, got = _time(zigzag_step, _place(zigzag, many, P(None, "x")), args.iters)
    record("ring-zigzag", n, seconds, args.seq_len,
           _max_difference(tuple(jax_flash.from_zigzag(g, n) for g in got), expected))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=0, help="devices to shard over (default: all)")
    parser.add_argument("--cpu-devices", type=int, default=0, help="fake this many CPU devices (smoke test)")
    parser.add_argument("--seq-len", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=0, help="default: --heads")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    args.kv_heads = args.kv_heads or args.heads
    if args.cpu_devices:
        # Read when jax creates its CPU backend, which has not happened yet.
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={args.cpu_devices}")
        jax.config.update("jax_platforms", "cpu")
    print(f"{jax.device_count()} x {jax.devices()[0].device_kind}, jax {jax.__version__}, seq_len {args.seq_len}, "
          f"heads {args.heads}/{args.kv_heads}, head_dim {args.head_dim}, {args.dtype}, causal {args.causal}")
    rows = run(args)
    os.makedirs(RESULTS_DIR, exist_ok=True)
    path = os.path.join(RESULTS_DIR, f"sharding_{datetime.date.today().isoformat()}.json")
    with open(path, "w") as f:
        json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "config": vars(args),
                   "rows": rows}, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
