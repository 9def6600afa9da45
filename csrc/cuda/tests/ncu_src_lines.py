"""Nsight Compute's per-instruction stall samples and executed-instruction counts (the source-page CSV of
device_run.sh's `ncu_src` stage) summed per line of one source file, using the line table of the same kernel's
SASS: an `nvdisasm -gi` listing (inlined call chains) of a cubin compiled from the same sources with the build's
flags. Instruction offsets must match, which they do when the nvcc versions and flags match (the script checks the
opcodes and stops at the first mismatch).

    nvcc <the build's flags> -lineinfo -cubin -o k.cubin csrc/cuda/sm90/instantiations/<unit>.cu
    nvdisasm -gi -c k.cubin > k.sass
    python3 ncu_src_lines.py ncu_src_sass.csv k.sass --kernel 'Lb1E' --file backward_dkdv_kernel.h \
        --per 4194304 [--count 40]

Each instruction counts for the innermost frame of its inline chain that lies in --file (a line of a kernel body,
not of the CuTe or CUTLASS helper it calls). --per divides the executed counts (warp-level) by, e.g., items x warps,
to print instructions per warp and item.
"""
import argparse
import collections
import csv
import re


def sass_lines(listing: str, kernel: str) -> dict[int, tuple[list[tuple[str, int]], str]]:
    """Offset -> (inline chain innermost first, opcode) for the first .text section whose name contains `kernel`."""
    lines = open(listing).read().split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith(".text.") and kernel in line)
    table, chain, pending = {}, [], []
    for line in lines[start + 1:]:
        if line.startswith(".text.") or line.startswith("//---"):
            break
        where = re.match(r'\s*//## File "(.*?)", line (\d+)', line)
        if where:
            pending.append((where.group(1).split("/")[-1], int(where.group(2))))
            continue
        instruction = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if instruction:
            if pending:
                chain, pending = pending, []
            table[int(instruction.group(1), 16)] = (list(chain), instruction.group(2).strip())
    return table


def opcode(instruction: str) -> str:
    """The opcode of a SASS instruction, after its predicate if it has one ("@!P0 BRA ..." -> "BRA")."""
    tokens = instruction.split()
    return tokens[1] if tokens and tokens[0].startswith("@") else (tokens[0] if tokens else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv")
    parser.add_argument("sass")
    parser.add_argument("--kernel", required=True, help="a substring of the kernel's mangled name")
    parser.add_argument("--file", required=True, help="the source file whose lines to sum over")
    parser.add_argument("--per", type=float, default=1.0)
    parser.add_argument("--count", type=int, default=40)
    args = parser.parse_args()

    table = sass_lines(args.sass, args.kernel)
    rows = [row for row in csv.reader(open(args.csv, newline="")) if row]
    header_at = next(i for i, row in enumerate(rows) if "Address" in row and "Source" in row)
    header, body = rows[header_at], rows[header_at + 1:]
    address, source = header.index("Address"), header.index("Source")
    samples = next(i for i, name in enumerate(header) if "Warp Stall Sampling (All" in name)
    executed = header.index("Instructions Executed")
    reasons = [i for i, name in enumerate(header) if name.startswith("stall_") and "Not Issued" not in name]
    base = int(body[0][address], 16)

    total = sum(int(row[samples] or 0) for row in body)
    per_line = collections.defaultdict(lambda: [0, 0, collections.Counter()])
    for row in body:
        offset = int(row[address], 16) - base
        chain, listed = table.get(offset, ([], ""))
        if not listed or opcode(row[source]) != opcode(listed):
            raise SystemExit(f"offset {offset:#x}: the CSV has '{row[source].strip()}', the listing '{listed}': "
                             "not the same kernel build")
        in_file = [frame for frame in chain if frame[0] == args.file]
        key = in_file[0][1] if in_file else -1
        entry = per_line[key]
        entry[0] += int(row[samples] or 0)
        entry[1] += int(row[executed] or 0)
        for i in reasons:
            entry[2][header[i][len("stall_"):]] += int(row[i] or 0)

    print(f"{total} stall samples; line -1: instructions outside {args.file}")
    for line, (sampled, count, why) in sorted(per_line.items(), key=lambda kv: -kv[1][0])[:args.count]:
        top = ", ".join(f"{name} {100 * n / total:.1f}%" for name, n in why.most_common(3))
        print(f"{args.file}:{line:<5} {100 * sampled / total:5.2f}%  executed/per {count / args.per:7.1f}  {top}")


if __name__ == "__main__":
    main()
