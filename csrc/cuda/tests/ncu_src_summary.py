"""The instructions of an Nsight Compute source-page CSV (`ncu --import R --page source --csv --print-source sass`)
with the most sampled warp stalls, and the stall-reason columns that dominate each.

    python3 ncu_src_summary.py ncu_src_sass.csv [count]

The column names differ between ncu versions, so the header is the first row with a "Source" column, the sample
count is the first column whose name contains "Warp Stall Sampling (All", and the reasons are the other columns
whose name contains "stall" (any case) but not "Sampling"; a cell that does not parse as a number counts as 0.
"""
import csv
import sys


def number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def read_sass_page(path: str) -> tuple[list[str], list[list[str]], int]:
    """A source-page CSV's header, its instruction rows and the index of its "Source" column (the SASS text)."""
    with open(path, newline="") as handle:
        rows = [row for row in csv.reader(handle) if row]
    header_at = next(i for i, row in enumerate(rows) if any("Source" in cell for cell in row))
    header = rows[header_at]
    return header, rows[header_at + 1:], next(i for i, name in enumerate(header) if "Source" in name)


def main(path: str, count: int) -> None:
    header, body, source = read_sass_page(path)
    address = next((i for i, name in enumerate(header) if "Address" in name), None)
    samples = next(i for i, name in enumerate(header) if "Warp Stall Sampling (All" in name)
    reasons = [i for i, name in enumerate(header)
               if i != samples and ("stall" in name.lower()) and "Sampling" not in name]
    total = sum(number(row[samples]) or 0.0 for row in body if len(row) > samples)
    print(f"{len(body)} instructions, {total:.0f} stall samples; columns: {[header[i] for i in reasons][:12]}")
    ranked = sorted((row for row in body if len(row) > samples and number(row[samples])),
                    key=lambda row: -number(row[samples]))
    for row in ranked[:count]:
        share = 100.0 * number(row[samples]) / total if total else 0.0
        top = sorted(((number(row[i]) or 0.0, header[i]) for i in reasons if i < len(row)), reverse=True)[:3]
        where = row[address] if address is not None else ""
        print(f"{share:5.2f}%  {where:>8}  {row[source][:70]:70}  " +
              ", ".join(f"{name.split('(')[-1].rstrip(')')}={value:.0f}" for value, name in top if value))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40)
