"""Compare benchmarks/bench_attention.py result files from one machine: the steps of a device_ab.sh / device_ladder.sh
call (base, then each change), or two sessions' grids.

For each run after the first, and each implementation, head dim and direction: the geometric mean of its TFLOP/s over
the previous run's, over the cells both have, and how many of those cells went up. cuDNN's rows change no code
between the steps of one call, so its ratios show how far the machine alone moves the numbers; a jax_flash change
smaller than that is noise. --cells also lists every jax_flash cell.

Run:  python benchmarks/compare_runs.py base.json change.json [more.json ...] [--impl jax_flash_sm90] [--cells]
"""
from __future__ import annotations

import argparse
import json
import math
import os

Key = tuple  # (impl, head_dim, causal, seqlen, feature)


def load_rows(path: str) -> dict[Key, dict]:
    """The rows of one results file, keyed by what they measured."""
    with open(path) as f:
        rows = json.load(f)["rows"]
    return {(r["impl"], r["head_dim"], r["causal"], r["seqlen"], r.get("feature", "none")): r for r in rows}


def geometric_ratios(before: dict[Key, dict], after: dict[Key, dict]) -> list[dict]:
    """Per (impl, head dim, direction): geometric mean of after / before over the common cells, and cells up."""
    groups: dict[tuple, list[float]] = {}
    for key in set(before) & set(after):
        for direction in ("fwd_tflops", "bwd_tflops"):
            old, new = before[key].get(direction), after[key].get(direction)
            if old and new:
                groups.setdefault((key[0], key[1], direction[:3]), []).append(new / old)
    return [{"impl": impl, "head_dim": head_dim, "direction": direction, "cells": len(ratios),
             "up": sum(r > 1 for r in ratios), "geomean": math.exp(sum(map(math.log, ratios)) / len(ratios))}
            for (impl, head_dim, direction), ratios in sorted(groups.items())]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", help="results JSONs in order (the first is the reference)")
    parser.add_argument("--impl", default="jax_flash_sm90", help="the implementation --cells lists")
    parser.add_argument("--cells", action="store_true", help="also every cell of --impl, TFLOP/s per run")
    args = parser.parse_args()
    if len(args.files) < 2:
        parser.error("give at least two results files")
    runs = [load_rows(path) for path in args.files]
    names = [os.path.basename(path) for path in args.files]
    for i in range(1, len(runs)):
        print(f"{names[i]} / {names[i - 1]}")
        for g in geometric_ratios(runs[i - 1], runs[i]):
            print(f"  {g['impl']:16s} d={g['head_dim']:<4d} {g['direction']}  {g['geomean']:.3f}"
                  f"  ({g['up']} of {g['cells']} cells up)")
    if args.cells:
        keys = sorted({k for run in runs for k in run if k[0] == args.impl}, key=lambda k: (k[1], k[2], k[3], k[4]))
        print(f"{args.impl}: fwd / bwd TFLOP/s per run ({', '.join(names)})")
        for key in keys:
            cells = ["   -   " if key not in run else
                     f"{run[key].get('fwd_tflops') or 0:4.0f}/{run[key].get('bwd_tflops') or 0:<4.0f}" for run in runs]
            print(f"  d={key[1]:<4d} causal={int(key[2])} seqlen={key[3]:<6d} {key[4]:12s} " + "  ".join(cells))


if __name__ == "__main__":
    main()
