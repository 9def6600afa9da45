"""The sharded training example (``examples/sharded_training.py``) at several device counts: its step time, the
scaling efficiency against one and two devices, and its losses against the one-device run's.

At every count of ``--device-counts`` the model, its initialisation and its batches are the same (the global batch
and sequence do not change: strong scaling); only the mesh grows. ``--all-on-sequence`` puts every device on the
sequence axis (one ring of N devices: what a single long sequence needs), otherwise the example's own layout
(``--seq-shards``, capped at N; default: all of two or fewer devices, else half of them, the rest on the batch).
Both attention modes of the example (``--attention``: the jit-partitioned ring, the zigzag ring in shard_map) run
at each count.

Each row: the median step time (the first step, with compilation, apart), tokens/s, the speedup over one device,
the scaling efficiency (speedup / N; and 2·t₂ / (N·t_N) against two devices), and the losses' differences from the
one-device run of the same mode: the first step's, relative (same parameters, same batch: only the reduction order
differs, so it must agree within the dtype's tolerance; the script exits 1 where it does not), and the largest over
all steps (training amplifies roundings, so this one is reported, not judged).

Arguments not listed below go to the example (model size, ``--seq-len``, ``--batch-size``, ``--steps``, ``--dtype``,
``--cpu-devices``...). On a machine with 8 GPUs, 128k tokens on one ring:
    python benchmarks/bench_sharded_training.py --device-counts 1 2 4 8 --all-on-sequence --attention both \\
        --seq-len 131072 --batch-size 1 --d-model 1024 --num-heads 8 --num-kv-heads 8 --num-layers 4 --steps 10
CPU smoke run: python benchmarks/bench_sharded_training.py --cpu-devices 4 --device-counts 1 2 4 --steps 3
Writes benchmarks/results/sharded_training_<device>_<date>[_<tag>].json (``--out-dir`` to change).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from collections.abc import Callable

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(_HERE), "examples"))  # the example and its model
sys.path.insert(0, _HERE)

import jax  # noqa: E402

import sharded_training  # noqa: E402
from bench_attention import versions  # noqa: E402
from bench_sharding import device_counts, fake_cpu_devices, scaling  # noqa: E402
from bench_training_step import TOLERANCE  # noqa: E402

RESULTS_DIR = os.path.join(_HERE, "results")


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, argparse.Namespace]:
    """(this driver's arguments, the example's)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device-counts", type=int, nargs="+", default=None,
                        help="device counts to train on (default: 1, 2, 4, ... up to every visible device)")
    parser.add_argument("--all-on-sequence", action="store_true",
                        help="every device on the sequence axis (default: the example's --seq-shards rule)")
    parser.add_argument("--tag", default="", help="suffix of the results file's name")
    parser.add_argument("--out-dir", default=RESULTS_DIR)
    args, rest = parser.parse_known_args(argv)
    return args, sharded_training.parse_args(rest)


def scaling_rows(runs: dict[tuple[str, int], tuple[list[float], list[float]]], batch_tokens: int,
                 tolerance: float) -> list[dict]:
    """One row per (mode, device count) from the runs' (losses, step seconds); each mode needs its 1-device run."""
    step_of = {key: statistics.median(seconds[1:]) for key, (_, seconds) in runs.items()}  # the first step compiles
    rows = []
    for (mode, n), (losses, seconds) in sorted(runs.items()):
        step = step_of[(mode, n)]
        base_losses = runs[(mode, 1)][0]
        steps = {count: value for (of_mode, count), value in step_of.items() if of_mode == mode}
        first = abs(losses[0] - base_losses[0]) / abs(base_losses[0])
        rows.append({
            "mode": mode, "devices": n, "step_ms": 1e3 * step, "first_step_s": seconds[0],
            "tokens_per_s": batch_tokens / step, **scaling(steps, n),
            "first_loss_rel_difference_vs_1": first, "first_loss_agrees": first <= tolerance,
            "max_loss_abs_difference_vs_1": max(abs(a - b) for a, b in zip(losses, base_losses)),
            "losses": losses,
        })
    return rows


def layout_at(example: argparse.Namespace, n: int, all_on_sequence: bool) -> argparse.Namespace:
    """The example's arguments at ``n`` devices: every device on the sequence, or its ``--seq-shards`` capped at n."""
    seq_shards = n if all_on_sequence else min(example.seq_shards, n)
    return argparse.Namespace(**vars(example) | {"seq_shards": seq_shards})


def run(args: argparse.Namespace, example: argparse.Namespace, devices: list[jax.Device],
        on_rows: Callable[[list[dict]], None] = lambda rows: None) -> list[dict]:
    """The example trained at every count of ``args.device_counts`` on the first N of ``devices``, both attention
    modes of ``example.attention``; ``on_rows`` sees the rows so far after each count."""
    counts = device_counts(args.device_counts, len(devices))
    config = sharded_training.model_config(example)
    modes = ["partitioned", "ring"] if example.attention == "both" else [example.attention]
    print(f"{len(devices)} x {devices[0].device_kind}, counts {counts}, {config}")
    tolerance = TOLERANCE[example.dtype]["loss"]
    runs, rows = {}, []
    for n in counts:
        layout = layout_at(example, n, args.all_on_sequence)
        mesh = sharded_training.make_mesh(layout, devices[:n])
        print(f"{n} device(s), mesh {dict(mesh.shape)}", flush=True)
        for mode in modes:
            mode_args = argparse.Namespace(**vars(layout) | {"attention": mode})
            runs[(mode, n)] = sharded_training.train(mesh, config, mode_args)
        rows = scaling_rows(runs, example.batch_size * example.seq_len, tolerance)
        on_rows(rows)
    print(f"{'mode':>11} | {'devices':>7} | {'step ms':>9} | {'tokens/s':>10} | {'speedup':>7} | {'eff/1':>5} | "
          f"{'eff/2':>5} | first loss vs 1 device (relative)")
    for row in rows:
        eff2 = "" if row["efficiency_vs_2"] is None else f"{row['efficiency_vs_2']:.2f}"
        print(f"{row['mode']:>11} | {row['devices']:>7} | {row['step_ms']:>9.1f} | {row['tokens_per_s']:>10.0f} | "
              f"{row['speedup_vs_1']:>7.2f} | {row['efficiency_vs_1']:>5.2f} | {eff2:>5} | "
              f"{row['first_loss_rel_difference_vs_1']:.1e}" + ("" if row["first_loss_agrees"] else " DISAGREES"))
    return rows


def main() -> None:
    args, example = parse_args()
    if example.cpu_devices:
        fake_cpu_devices(example.cpu_devices)
    devices = jax.devices()
    args.device_counts = device_counts(args.device_counts, len(devices))
    os.makedirs(args.out_dir, exist_ok=True)
    device = devices[0].device_kind
    date = datetime.date.today().isoformat()
    path = os.path.join(args.out_dir, f"sharded_training_{device.replace(' ', '_')}_{date}"
                        + (f"_{args.tag}" if args.tag else "") + ".json")

    def write(rows: list[dict]) -> None:  # after every count, so that a run cut short still leaves its results
        with open(path, "w") as f:
            json.dump({"device": device, "device_count": len(devices), "date": date, "versions": versions(),
                       "config": vars(args) | {"example": vars(example)},
                       "loss_tolerance": TOLERANCE[example.dtype]["loss"], "rows": rows}, f, indent=1)

    rows = run(args, example, devices, on_rows=write)
    print(f"wrote {path}")
    if not all(row["first_loss_agrees"] for row in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
