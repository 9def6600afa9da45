"""Finds pipeline releases that can overtake the thread's own loads from shared memory, in a compiled cubin.

An mbarrier arrive (SASS `SYNCS.ARRIVE*`, what PipelineTmaAsync::consumer_release emits) does not wait for earlier
loads: if a consumer reads a stage with plain loads (LDS / LD / LDSM) and releases it before any instruction has
used the loaded registers, the producer may refill the stage while those loads are still pending. That raced the
Hopper TF32 dQ pass in the thirteenth session (benchmarks/NOTES.md). For each arrive this walks back through the
listing (to the previous CTA / named barrier, which waits for everything) and reports the loads whose scoreboard
no instruction up to the arrive has waited on.

  python3 csrc/cuda/tests/release_audit.py unit.cubin [--nvdisasm PATH] [--all]

Needs nvdisasm (the CUDA toolkit's, or pip's nvidia-cuda-nvdisasm). Exit status 1 when a release has pending loads.
The control word decoding (high 64-bit word >> 41: stall, yield, write barrier, read barrier, wait mask) is that of
Volta and later."""
import argparse
import re
import shutil
import subprocess
import sys

INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;?\s*/\* (0x[0-9a-f]{16}) \*/\s*$")
HIGH_WORD = re.compile(r"^\s*/\* (0x[0-9a-f]{16}) \*/\s*$")
LOAD = re.compile(r"^(@!?U?P\w+ )?(LDS|LDSM|LD)\b")
WALK_LIMIT = 400  # instructions


def listing(cubin: str, nvdisasm: str):
    """[(function, [(address, text, write_barrier, wait_mask)])] from `nvdisasm -c -hex`."""
    text = subprocess.run([nvdisasm, "-c", "-hex", cubin], check=True, capture_output=True, text=True).stdout
    lines = text.split("\n")
    functions = []
    for i, line in enumerate(lines):
        if line.startswith(".text.") and line.endswith(":"):
            functions.append((line[6:-1], []))
            continue
        match = INSTRUCTION.match(line)
        if not match or not functions or i + 1 >= len(lines) or not HIGH_WORD.match(lines[i + 1]):
            continue
        control = int(HIGH_WORD.match(lines[i + 1]).group(1), 16) >> 41
        write_barrier = (control >> 5) & 7
        wait_mask = {k for k in range(6) if (control >> 11) >> k & 1}
        functions[-1][1].append((match.group(1), match.group(2), None if write_barrier == 7 else write_barrier,
                                 wait_mask))
    return functions


def pending_loads(instructions, arrive: int):
    """Loads before instructions[arrive] (back to the last barrier) that no instruction up to it waits on."""
    pending = []
    for j in range(arrive - 1, max(-1, arrive - WALK_LIMIT), -1):
        address, text, write_barrier, _ = instructions[j]
        if text.startswith(("BAR.SYNC", "BAR.RED", "DEPBAR")):
            break
        if LOAD.match(text) and write_barrier is not None:
            if not any(write_barrier in instructions[k][3] for k in range(j + 1, arrive + 1)):
                pending.append((address, text))
    return list(reversed(pending))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("cubin")
    parser.add_argument("--nvdisasm", default=shutil.which("nvdisasm") or "nvdisasm")
    parser.add_argument("--all", action="store_true", help="list every arrive, not only those with pending loads")
    args = parser.parse_args()
    racy = 0
    for function, instructions in listing(args.cubin, args.nvdisasm):
        for i, (address, text, _, _) in enumerate(instructions):
            if "SYNCS.ARRIVE" not in text:
                continue
            pending = pending_loads(instructions, i)
            racy += bool(pending)
            if pending or args.all:
                print(f"{function[:90]}\n  {address}: {text}")
                for load_address, load in pending:
                    print(f"    pending {load_address}: {load}")
    print(f"{racy} release(s) with pending loads")
    return 1 if racy else 0


if __name__ == "__main__":
    sys.exit(main())
