"""Scaling of jax_flash attention over devices: the forward + backward step time of one call with its batch, its
heads or its sequence sharded, at each device count of ``--device-counts``, against one device.

Cases (``--cases``; at every count N the call is the same, so the times compare directly: strong scaling):
- ``batch``: ``--batch`` sequences of ``--seq-len`` tokens (default: the least common multiple of the counts), the batch
  sharded (jit + NamedSharding: custom partitioning, no communication).
- ``heads``: one sequence, the query and KV heads sharded (the same; N must divide ``--kv-heads``).
- ``ring-jit``: one sequence, its tokens sharded under jit (custom partitioning: ring attention; a causal mask moves
  the contiguous shards into the zigzag layout and back inside every call).
- ``ring-zigzag``: the same through ``jax_flash.ring_attention`` in ``shard_map`` on inputs already in the zigzag
  layout (what a model that keeps its tokens in zigzag order pays).

Each row: the median step time, TFLOP/s (forward + backward = 3.5 x the forward's 4·b·h·s²·d, halved when causal),
the speedup over one device and the scaling efficiency (speedup / N; and against two devices, 2·t₂ / (N·t_N)), and
the largest difference of the gradients from the one-device run's (absolute, and relative to their largest value).

Run on a machine with several GPUs:  python benchmarks/bench_sharding.py --device-counts 1 2 4 8
CPU smoke test:  python benchmarks/bench_sharding.py --cpu-devices 4 --seq-len 512 --heads 4 --head-dim 32 --iters 2
Writes benchmarks/results/sharding_<device>_<date>[_<tag>].json (``--out-dir`` to change).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flash

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)  # bench_attention: the shared results header
from bench_attention import versions  # noqa: E402

RESULTS_DIR = os.path.join(_HERE, "results")
CASES = ("batch", "heads", "ring-jit", "ring-zigzag")


def _inputs(batch: int, args: argparse.Namespace) -> tuple[jax.Array, ...]:
    keys = jax.random.split(jax.random.key(0), 4)
    dtype = jnp.dtype(args.dtype)
    q_shape = (batch, args.seq_len, args.heads, args.head_dim)
    kv_shape = (batch, args.seq_len, args.kv_heads, args.head_dim)
    return tuple(jax.random.normal(key, shape, dtype)
                 for key, shape in zip(keys, (q_shape, kv_shape, kv_shape, q_shape)))


def _step(attend: Callable[..., jax.Array]) -> Callable[..., tuple[jax.Array, ...]]:
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


def _host(arrays: tuple[jax.Array, ...]) -> tuple[np.ndarray, ...]:
    return tuple(np.asarray(x, np.float32) for x in arrays)


def _differences(got: tuple[np.ndarray, ...], expected: tuple[np.ndarray, ...]) -> tuple[float, float]:
    """Largest |got - expected| over the gradients, absolute and relative to the largest |expected|."""
    absolute = max(float(np.max(np.abs(x - y))) for x, y in zip(got, expected))
    scale = max(float(np.max(np.abs(y))) for y in expected)
    return absolute, absolute / scale if scale > 0 else absolute


def _case_call(case: str, mesh: Mesh, inputs: tuple[jax.Array, ...], causal: bool):
    """(the jitted step, its inputs placed on ``mesh``, a map of its gradients back to the unsharded layout)."""
    n = mesh.size
    attend = functools.partial(jax_flash.attention, causal=causal)
    if case == "batch":
        return _step(attend), _place(inputs, mesh, P("x")), lambda grads: grads
    if case == "heads":
        return _step(attend), _place(inputs, mesh, P(None, None, "x")), lambda grads: grads
    if case == "ring-jit":
        return _step(attend), _place(inputs, mesh, P(None, "x")), lambda grads: grads
    if case == "ring-zigzag":
        ring = functools.partial(jax_flash.ring_attention, axis_name="x", layout="zigzag", causal=causal)
        sharded = jax.shard_map(ring, mesh=mesh, in_specs=(P(None, "x"),) * 3, out_specs=P(None, "x"))
        zigzag = tuple(jax_flash.to_zigzag(x, n) for x in inputs)
        return (_step(sharded), _place(zigzag, mesh, P(None, "x")),
                lambda grads: tuple(jax_flash.from_zigzag(g, n) for g in grads))
    raise ValueError(f"case must be one of {CASES}, got {case!r}")


def step_flops(batch: int, args: argparse.Namespace) -> float:
    forward = 4.0 * batch * args.heads * args.seq_len ** 2 * args.head_dim / (2 if args.causal else 1)
    return 3.5 * forward


def device_counts(requested: list[int] | None, available: int) -> list[int]:
    """The device counts to run, ascending: ``requested``, or 1, 2, 4, ... and ``available`` itself. Each must fit,
    and 1 must be among them (every row is measured against it)."""
    counts = sorted(set(requested or [1 << i for i in range(available.bit_length())] + [available]))
    if counts[0] != 1 or counts[-1] > available:
        raise SystemExit(f"--device-counts must start at 1 and stay within the {available} visible devices")
    return counts


def scaling(seconds: dict[int, float], n: int) -> dict[str, float | None]:
    """Speedup of ``n`` devices over one, and scaling efficiency against one and (from two devices on) two, from the
    step seconds per device count."""
    return {"speedup_vs_1": seconds[1] / seconds[n], "efficiency_vs_1": seconds[1] / (n * seconds[n]),
            "efficiency_vs_2": 2 * seconds[2] / (n * seconds[n]) if 2 in seconds and n >= 2 else None}


def run(args: argparse.Namespace, devices: list[jax.Device] | None = None,
        on_row: Callable[[list[dict]], None] = lambda rows: None) -> list[dict]:
    """Every case of ``args`` at every device count, on the first N of ``devices`` (default: the default backend's);
    ``on_row`` sees the rows so far after each one."""
    devices = devices or jax.devices()
    counts = device_counts(args.device_counts, len(devices))
    batch = args.batch or math.lcm(*counts)
    divisors = {"batch": ("--batch", batch), "heads": ("--kv-heads", args.kv_heads),
                "ring-jit": ("--seq-len / 2", args.seq_len / 2), "ring-zigzag": ("--seq-len / 2", args.seq_len / 2)}
    for case in args.cases:
        name, value = divisors[case]
        if any(value % n for n in counts):
            raise SystemExit(f"case {case}: every device count must divide {name} = {value:g}")
    rows = []
    print(f"{'case':>12} | {'devices':>7} | {'step ms':>10} | {'TFLOP/s':>8} | {'speedup':>7} | {'eff/1':>5} | "
          f"{'eff/2':>5} | max |diff| vs 1 device (relative)")
    for case in args.cases:
        inputs = _inputs(batch if case == "batch" else 1, args)
        flops = step_flops(inputs[0].shape[0], args)
        times: dict[int, float] = {}
        expected = None
        for n in counts:
            mesh = Mesh(np.asarray(devices[:n]), ("x",))
            step, placed, unshard = _case_call(case, mesh, inputs, args.causal)
            seconds, grads = _time(step, placed, args.iters)
            times[n] = seconds
            got = _host(unshard(grads))
            del grads, placed
            absolute: float | None = None
            relative: float | None = None
            if expected is None:
                expected = got
            else:
                absolute, relative = _differences(got, expected)
            row = {"case": case, "devices": n, "step_ms": 1e3 * seconds, "tokens": inputs[0].shape[0] * args.seq_len,
                   "tflops": flops / seconds / 1e12, **scaling(times, n),
                   "max_abs_difference_vs_1_device": absolute, "max_rel_difference_vs_1_device": relative}
            rows.append(row)
            on_row(rows)
            eff2 = "" if row["efficiency_vs_2"] is None else f"{row['efficiency_vs_2']:.2f}"
            diff = "" if absolute is None else f"{absolute:.2e} ({relative:.1e})"
            print(f"{case:>12} | {n:>7} | {row['step_ms']:>10.2f} | {row['tflops']:>8.1f} | "
                  f"{row['speedup_vs_1']:>7.2f} | {row['efficiency_vs_1']:>5.2f} | {eff2:>5} | {diff}", flush=True)
    return rows


def fake_cpu_devices(count: int) -> None:
    """Run on `count` fake CPU devices; call before anything asks jax for its devices."""
    # Read when jax creates its CPU backend, which has not happened yet.
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={count}"
    jax.config.update("jax_platforms", "cpu")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device-counts", type=int, nargs="+", default=None,
                        help="device counts to time (default: 1, 2, 4, ... up to every visible device)")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--cpu-devices", type=int, default=0, help="fake this many CPU devices (smoke test)")
    parser.add_argument("--seq-len", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=0, help="sequences of the batch case (default: the largest count)")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=0, help="default: --heads")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--tag", default="", help="suffix of the results file's name")
    parser.add_argument("--out-dir", default=RESULTS_DIR)
    args = parser.parse_args(argv)
    args.kv_heads = args.kv_heads or args.heads
    return args


def main() -> None:
    args = parse_args()
    if args.cpu_devices:
        fake_cpu_devices(args.cpu_devices)
    args.device_counts = device_counts(args.device_counts, jax.device_count())
    device = jax.devices()[0].device_kind
    print(f"{jax.device_count()} x {device}, jax {jax.__version__}, seq_len {args.seq_len}, heads "
          f"{args.heads}/{args.kv_heads}, head_dim {args.head_dim}, {args.dtype}, causal {args.causal}")
    os.makedirs(args.out_dir, exist_ok=True)
    date = datetime.date.today().isoformat()
    path = os.path.join(args.out_dir, f"sharding_{device.replace(' ', '_')}_{date}"
                        + (f"_{args.tag}" if args.tag else "") + ".json")

    def write(rows: list[dict]) -> None:  # after every row, so that a run cut short still leaves its results
        with open(path, "w") as f:
            json.dump({"device": device, "device_count": jax.device_count(), "date": date, "versions": versions(),
                       "config": vars(args), "rows": rows}, f, indent=1)

    run(args, on_row=write)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
