"""CPU handlers vs the pure-XLA path: time at a medium size, and memory at a length XLA cannot hold.

Run:  python benchmarks/bench_cpu.py [--long-seqlen 32768]
Each measurement runs in a fresh subprocess so that its peak resident memory (ru_maxrss) is its own.
Writes benchmarks/results/cpu_<date>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import time

RESULTS_DIR = os.path.join(os.path.dirname(__file__), "results")


def measure(implementation: str, batch: int, seqlen: int, heads: int, head_dim: int, causal: bool,
            backward: bool, repeats: int) -> dict:
    """Runs in the child process: median seconds and peak RSS of one configuration."""
    import jax
    import jax.numpy as jnp

    import jax_flash

    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, (batch, seqlen, heads, head_dim), jnp.float32) for key in keys)
    impl = None if implementation == "jax_flash" else "xla"
    attend = lambda q_, k_, v_: jax_flash.attention(q_, k_, v_, causal=causal, implementation=impl)
    fn = jax.jit(jax.grad(lambda *a: jnp.sum(attend(*a)), argnums=(0, 1, 2)) if backward else attend)
    jax.block_until_ready(fn(q, k, v))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(q, k, v))
        times.append(time.perf_counter() - start)
    flops = 4 * batch * heads * seqlen * seqlen * head_dim * (0.5 if causal else 1.0) * (3.5 if backward else 1.0)
    seconds = sorted(times)[len(times) // 2]
    return {"impl": implementation, "batch": batch, "seqlen": seqlen, "heads": heads, "head_dim": head_dim,
            "causal": causal, "backward": backward, "seconds": seconds, "gflops": flops / seconds / 1e9,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def run_child(**config) -> dict:
    command = [sys.executable, __file__, "--child", json.dumps(config)]
    output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(output.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--long-seqlen", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(**json.loads(args.child))))
        return

    rows = []
    medium = dict(batch=2, seqlen=2048, heads=8, head_dim=64, causal=False, repeats=args.repeats)
    for backward in (False, True):
        for implementation in ("jax_flash", "xla"):
            rows.append(run_child(implementation=implementation, backward=backward, **medium))
    long = dict(batch=1, seqlen=args.long_seqlen, heads=1, head_dim=64, causal=True, backward=False, repeats=1)
    rows.append(run_child(implementation="jax_flash", **long))
    score_matrix_mib = long["batch"] * long["heads"] * args.long_seqlen ** 2 * 4 / 2 ** 20

    print(f"{'impl':>10} {'pass':>9} {'B':>2} {'S':>6} {'H':>2} {'D':>3} {'causal':>6} {'ms':>10} "
          f"{'GFLOP/s':>8} {'peak RSS MiB':>12}")
    for r in rows:
        print(f"{r['impl']:>10} {'fwd+bwd' if r['backward'] else 'fwd':>9} {r['batch']:>2} {r['seqlen']:>6} "
              f"{r['heads']:>2} {r['head_dim']:>3} {str(r['causal']):>6} {r['seconds'] * 1e3:>10.1f} "
              f"{r['gflops']:>8.1f} {r['peak_rss_mib']:>12.0f}")
    for backward in (False, True):
        ours, xla = (r for r in rows[:4] if r["backward"] == backward)
        print(f"{'fwd+bwd' if backward else 'fwd'}: jax_flash / xla time ratio = {ours['seconds'] / xla['seconds']:.2f}")
    print(f"S={args.long_seqlen}: the XLA path's float32 score matrix alone would need {score_matrix_mib:,.0f} MiB; "
          f"jax_flash peaked at {rows[-1]['peak_rss_mib']:,.0f} MiB resident for the whole process")

    os.makedirs(RESULTS_DIR, exist_ok=True)
    today = datetime.date.today().isoformat()
    import jax
    result = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "date": today,
              "versions": {"jax": jax.__version__, "python": platform.python_version()},
              "xla_score_matrix_mib_at_long_seqlen": score_matrix_mib, "rows": rows}
    path = os.path.join(RESULTS_DIR, f"cpu_{today}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
