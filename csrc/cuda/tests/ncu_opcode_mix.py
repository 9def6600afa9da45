"""Executed warp instructions per SASS opcode of one or more kernels, side by side, from Nsight Compute source-page
CSVs (`ncu --import R --page source --csv --print-source sass` of a report with the SourceCounters section).

    python3 ncu_opcode_mix.py NAME=ours.csv NAME=cudnn.csv [--top 40]

An opcode is the instruction's first word without its predicate and modifiers (`@!P0 BRA 0x..` is BRA,
`HGMMA.64x64x16.F32.BF16 ..` is HGMMA). The executed count is the first column whose name starts with
"Instructions Executed" (warp-level); a cell that does not parse as a number counts as 0. Rows are sorted by the
largest difference between the first kernel and the others, so the opcodes that make one kernel longer come first.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ncu_src_summary import number, read_sass_page  # noqa: E402


def opcode(source: str) -> str:
    words = [w for w in source.split() if not w.startswith("@")]
    return words[0].split(".")[0] if words else "?"


def opcode_counts(path: str) -> Counter:
    header, body, source = read_sass_page(path)
    executed = next(i for i, name in enumerate(header) if name.startswith("Instructions Executed"))
    counts: Counter = Counter()
    for row in body:
        if len(row) > max(source, executed):
            counts[opcode(row[source])] += number(row[executed]) or 0.0
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kernels", nargs="+", help="NAME=path.csv, the first is the one compared")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    names, counts = [], []
    for item in args.kernels:
        name, _, path = item.partition("=")
        names.append(name)
        counts.append(opcode_counts(path))
    opcodes = set().union(*counts)
    ranked = sorted(opcodes, key=lambda op: -abs(counts[0][op] - max(c[op] for c in counts[1:]))
                    if len(counts) > 1 else -counts[0][op])
    print(f"{'opcode':12}" + "".join(f"{name:>16}" for name in names))
    print(f"{'total':12}" + "".join(f"{sum(c.values()):16,.0f}" for c in counts))
    for op in ranked[:args.top]:
        print(f"{op:12}" + "".join(f"{c[op]:16,.0f}" for c in counts))


if __name__ == "__main__":
    main()
