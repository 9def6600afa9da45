"""GPU attention throughput: jax_flash's CUDA kernels vs jax.nn.dot_product_attention (cuDNN and XLA).

Shapes (../shared/ANCHORS.md): bf16, BSHD, 16k tokens per batch (batch = 16384 / seqlen), heads * head_dim = 2048,
head_dim in {64, 128, 256}, causal and not, seqlen 512..16k. FLOPs: 4 * b * h * sq * sk * d, halved when causal;
backward = 2.5 x forward. Times: wall clock over `--reps` jitted calls (more where needed for a trial to last 50 ms)
after warm-up, median of 3 trials; the backward is timed alone through a jitted VJP function. With --rounds N each
cell is measured N times, the implementations taking turns (in reverse order on odd rounds), and each keeps its
best round (every round's numbers stay in the row): a passing disturbance of the machine (a clock dip, another
process) then costs no implementation its cell, and all are treated alike.

Run:  python benchmarks/bench_attention.py [--head-dims 64 128 256] [--seqlens 512 1024 ...] [--memory] [--rounds 2]
      [--impls jax_flash_sm90 cudnn] [--forward-only] [--features none padding_mask dropout softcap] [--float32]
jax_flash_sm80 forces the sm80 kernels forward and backward (JAX_FLASH_CUDA_KERNEL[_BACKWARD]=sm80,
csrc/cuda/README.md); jax_flash_sm90 forces the Hopper forward and lets the backward choose (the Hopper backward
where it has a kernel, d <= 128; sm80 above), which is what a plain call does on an H100/H200.
--features adds padding-mask / dropout / softcap rows (see --help); --float32 compares jax_flash's float32 modes (tf32,
highest) with XLA float32 attention at default and "highest" matmul precision.
Writes benchmarks/results/attention_<gpu>_<date>[_<tag>].json and a .png plot of TFLOP/s vs seqlen.
--memory (--memory-only: nothing else) also runs forward + backward at seqlen 128k (d=128, batch 1, 16 heads) in fresh processes and reports
each implementation's peak device memory.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import subprocess
import sys
import time

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
TOKENS = 16384
MODEL_WIDTH = 2048  # heads * head_dim
IMPLEMENTATIONS = ("jax_flash_sm80", "jax_flash_sm90", "cudnn", "xla")
KERNEL_FAMILY = {"jax_flash_sm80": "sm80", "jax_flash_sm90": "sm90"}  # JAX_FLASH_CUDA_KERNEL per implementation
BACKWARD_FAMILY = {"jax_flash_sm80": "sm80", "jax_flash_sm90": "auto"}  # JAX_FLASH_CUDA_KERNEL_BACKWARD
FLOAT32_IMPLEMENTATIONS = ("jax_flash_tf32", "jax_flash_tf32_fp16ops", "jax_flash_f32_highest", "jax_flash_f32_split",
                           "jax_flash_f32_fp16parts", "xla_f32_default", "xla_f32_highest")
FLOAT32_MODE = {"jax_flash_tf32": "tf32", "jax_flash_tf32_fp16ops": "tf32",  # jax_flash's float32_precision
                "jax_flash_f32_highest": "highest", "jax_flash_f32_split": "highest",
                "jax_flash_f32_fp16parts": "highest"}
# JAX_FLASH_SM90_TF32_BACKWARD_FP16 per row (read when its functions are traced): the TF32 mode's backward on the TF32
# kernels, or on scaled float16 operands (jax_flash/_half_operands.py). Every row pins its switches, so on a Hopper the
# defaults are the fp16ops row (TF32 mode) and the fp16parts row (exact mode).
HALF_OPERANDS_SWITCH = {"jax_flash_tf32": "0", "jax_flash_tf32_fp16ops": "1"}
# JAX_FLASH_SM90_SPLIT_TF32 and JAX_FLASH_SM90_SPLIT_TF32_BACKWARD per row (read when its functions are traced):
# "highest" on the exact float32 kernels, or on the split-TF32 Hopper forward and backward passes.
SPLIT_TF32_SWITCH = {"jax_flash_f32_highest": "0", "jax_flash_f32_split": "1", "jax_flash_f32_fp16parts": "1"}
# JAX_FLASH_SM90_HIGHEST_BACKWARD_FP16 per row: the fp16parts row is the split row with the backward on float16 parts
# where they apply (head_dim 72..128; csrc/cuda/sm90/float16_parts_backward_launch.h), split TF32's elsewhere.
FLOAT16_PARTS_SWITCH = {"jax_flash_f32_highest": "0", "jax_flash_f32_split": "0", "jax_flash_f32_fp16parts": "1"}
XLA_FLOAT32 = {"xla_f32_default": "default", "xla_f32_highest": "highest"}  # XLA's matmul precision
JAX_FLASH_IMPLEMENTATIONS = (*KERNEL_FAMILY, *FLOAT32_MODE)  # the rows that take every feature


FEATURES = ("none", "padding_mask", "dropout", "softcap")
DROPOUT_RATE = 0.1
SOFTCAP = 50.0  # Gemma 2's attention logit softcap
# Features jax.nn does not expose: the cudnn/xla rows of these run without them.
JAX_FLASH_ONLY_FEATURES = ("dropout", "softcap")


def padding_mask(batch: int, seqlen: int):
    """[batch, 1, 1, seqlen] key-padding mask: batch row b keeps its first seqlen * (1 - b / (2 * batch)) keys."""
    import jax.numpy as jnp

    lengths = seqlen - (seqlen * jnp.arange(batch)) // (2 * batch)
    return (jnp.arange(seqlen)[None, :] < lengths[:, None])[:, None, None, :]


def attention_fn(implementation: str, causal: bool, feature: str = "none", batch: int = 1, seqlen: int = 1):
    """features "dropout" and "softcap": jax.nn exposes neither, so cudnn/xla rows run without them."""
    import jax

    import jax_flash

    mask = padding_mask(batch, seqlen) if feature == "padding_mask" else None
    if implementation in JAX_FLASH_IMPLEMENTATIONS:
        extra = ({"dropout_rate": DROPOUT_RATE, "dropout_rng": jax.random.key(0)} if feature == "dropout"
                 else {"softcap": SOFTCAP} if feature == "softcap" else {})
        if implementation in FLOAT32_MODE:
            extra["float32_precision"] = FLOAT32_MODE[implementation]
        return lambda q, k, v: jax_flash.attention(q, k, v, causal=causal, mask=mask, **extra)
    if mask is not None:  # jax.nn's cuDNN path wants the mask's query axis at full length (it becomes a bias)
        mask = jax.numpy.broadcast_to(mask, (batch, 1, seqlen, seqlen))

    def jax_nn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal,
                                            implementation="xla" if implementation in XLA_FLOAT32 else implementation)

    if XLA_FLOAT32.get(implementation) == "highest":
        def highest(q, k, v):  # the precision applies while jit traces the function
            with jax.default_matmul_precision("highest"):
                return jax_nn(q, k, v)

        return highest
    return jax_nn


# A trial lasts at least this long: at least `reps` calls, more when the calls are short. A trial starts with an idle
# GPU and ends with a host synchronisation; over ten 0.3 ms calls (d=64 1k) that fixed cost was several percent of
# the time, and with it a session-to-session drift of the short cells larger than the changes being measured.
MIN_TRIAL_SECONDS = 0.05


def median_seconds(fn, args, reps: int, min_trial_seconds: float = MIN_TRIAL_SECONDS) -> float:
    """Seconds per call of fn(*args): the median of 3 trials of back-to-back calls after a warm-up call.

    Each trial makes max(reps, enough calls to last min_trial_seconds, estimated from one timed call) calls."""
    import jax

    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    one_call = time.perf_counter() - start
    calls = max(reps, math.ceil(min_trial_seconds / max(one_call, 1e-6)))
    trials = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        trials.append((time.perf_counter() - start) / calls)
    return sorted(trials)[1]


def measure(implementation: str, head_dim: int, seqlen: int, causal: bool, reps: int,
            forward_only: bool = False, feature: str = "none") -> dict:
    """One cell, under the implementation's kernel families."""
    with kernel_families(implementation):
        return _measure(implementation, head_dim, seqlen, causal, reps, forward_only, feature)


def kernel_families(implementation: str):
    """Sets the implementation's JAX_FLASH_CUDA_KERNEL[_BACKWARD] (the C++ dispatcher reads them at every call),
    JAX_FLASH_SM90_SPLIT_TF32[_BACKWARD], JAX_FLASH_SM90_TF32_BACKWARD_FP16 and JAX_FLASH_SM90_HIGHEST_BACKWARD_FP16
    (read when the row's functions are traced, which happens inside)."""
    return environment({"JAX_FLASH_CUDA_KERNEL": KERNEL_FAMILY.get(implementation),
                        "JAX_FLASH_CUDA_KERNEL_BACKWARD": BACKWARD_FAMILY.get(implementation),
                        "JAX_FLASH_SM90_SPLIT_TF32": SPLIT_TF32_SWITCH.get(implementation),
                        "JAX_FLASH_SM90_SPLIT_TF32_BACKWARD": SPLIT_TF32_SWITCH.get(implementation),
                        "JAX_FLASH_SM90_TF32_BACKWARD_FP16": HALF_OPERANDS_SWITCH.get(implementation),
                        "JAX_FLASH_SM90_HIGHEST_BACKWARD_FP16": FLOAT16_PARTS_SWITCH.get(implementation)})


@contextlib.contextmanager
def environment(settings: dict):
    """Sets the environment variables of `settings` (a None value leaves its variable as it is), restored after."""
    previous = {name: os.environ.get(name) for name in settings}
    for name, value in settings.items():
        if value is not None:
            os.environ[name] = value
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _measure(implementation: str, head_dim: int, seqlen: int, causal: bool, reps: int, forward_only: bool,
             feature: str) -> dict:
    import jax
    import jax.numpy as jnp

    batch, heads = TOKENS // seqlen, MODEL_WIDTH // head_dim
    keys = jax.random.split(jax.random.key(seqlen + head_dim), 4)
    shape = (batch, seqlen, heads, head_dim)
    dtype = jnp.float32 if implementation in FLOAT32_IMPLEMENTATIONS else jnp.bfloat16
    q, k, v, d_o = (jax.random.normal(key, shape, dtype) for key in keys)
    attend = attention_fn(implementation, causal, feature, batch, seqlen)
    # FLOPs of the unmasked problem for every feature, so a padding mask shows up as time saved (or not).
    flops = 4.0 * batch * heads * seqlen * seqlen * head_dim * (0.5 if causal else 1.0)
    row = {"impl": implementation, "head_dim": head_dim, "seqlen": seqlen, "batch": batch, "heads": heads,
           "causal": causal, "feature": feature, "fwd_tflops": None, "bwd_tflops": None}
    if feature in JAX_FLASH_ONLY_FEATURES and implementation not in JAX_FLASH_IMPLEMENTATIONS:
        row["note"] = f"without {feature} (jax.nn exposes no {feature})"
    try:
        forward = jax.jit(attend)
        row["fwd_tflops"] = flops / median_seconds(forward, (q, k, v), reps) / 1e12
        if forward_only:
            return row
        _, vjp = jax.vjp(attend, q, k, v)
        backward = jax.jit(lambda vjp_fn, g: vjp_fn(g))
        row["bwd_tflops"] = 2.5 * flops / median_seconds(backward, (vjp, d_o), reps) / 1e12
    except Exception as error:  # noqa: BLE001 - an implementation that cannot run a shape is recorded, not fatal
        row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    return row


def best_of_rounds(rounds: list[dict]) -> dict:
    """One implementation's row of a cell from its rounds: the highest forward and backward TFLOP/s of any round,
    with every round's value under fwd_tflops_rounds / bwd_tflops_rounds (several rounds only), and the first
    round's error, if any round had one."""
    merged = {key: value for key, value in rounds[0].items() if key != "error"}
    for key in ("fwd_tflops", "bwd_tflops"):
        values = [r.get(key) for r in rounds]
        measured = [v for v in values if v]
        merged[key] = max(measured) if measured else None
        if len(rounds) > 1:
            merged[key + "_rounds"] = values
    errors = [r["error"] for r in rounds if "error" in r]
    if errors:
        merged["error"] = errors[0]
    return merged


def measure_cell(implementations, rounds: int, measure_one) -> list[dict]:
    """One cell's rows, in the order of `implementations`: measure_one(implementation) `rounds` times each, the
    implementations taking turns, in reverse order on odd rounds (so none is always first after another's
    compilation), merged by best_of_rounds."""
    measured = {implementation: [] for implementation in implementations}
    for round_index in range(rounds):
        order = implementations if round_index % 2 == 0 else list(reversed(implementations))
        for implementation in order:
            measured[implementation].append(measure_one(implementation))
    return [best_of_rounds(measured[implementation]) for implementation in implementations]


def peak_memory_child(implementation: str, seqlen: int) -> dict:
    """In a fresh process: forward + backward at [1, seqlen, 16, 128]; peak device bytes."""
    with kernel_families(implementation):
        return _peak_memory(implementation, seqlen)


def _peak_memory(implementation: str, seqlen: int) -> dict:
    import jax
    import jax.numpy as jnp

    shape = (1, seqlen, 16, 128)
    q, k, v = (jax.random.normal(key, shape, jnp.bfloat16) for key in jax.random.split(jax.random.key(0), 3))
    attend = attention_fn(implementation, causal=False)
    step = jax.jit(jax.grad(lambda *a: jnp.sum(attend(*a).astype(jnp.float32)), argnums=(0, 1, 2)))
    result = {"impl": implementation, "seqlen": seqlen, "batch": 1, "heads": 16, "head_dim": 128}
    try:
        jax.block_until_ready(step(q, k, v))
        result["peak_bytes"] = jax.devices()[0].memory_stats()["peak_bytes_in_use"]
    except Exception as error:  # noqa: BLE001 - the XLA path is expected to run out of memory here
        result["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    return result


def run_memory_benchmark(seqlen: int) -> list[dict]:
    rows = []
    for implementation in IMPLEMENTATIONS:
        command = [sys.executable, os.path.abspath(__file__), "--memory-child", implementation, str(seqlen)]
        done = subprocess.run(command, capture_output=True, text=True)
        lines = done.stdout.strip().splitlines()
        rows.append(json.loads(lines[-1]) if lines else {"impl": implementation, "seqlen": seqlen,
                                                         "error": done.stderr.strip().splitlines()[-1:]})
        print(rows[-1], flush=True)
    return rows


def versions() -> dict:
    import jax
    import jaxlib

    info = {"jax": jax.__version__, "jaxlib": jaxlib.__version__}
    try:
        import jax_flash

        info["jax_flash"] = getattr(jax_flash, "__version__", "unknown")
    except ImportError:
        pass
    return info


def plot(rows: list[dict], path: str, implementations=IMPLEMENTATIONS) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    head_dims = sorted({r["head_dim"] for r in rows})
    fig, axes = plt.subplots(2 * 2, len(head_dims), figsize=(5 * len(head_dims), 14), squeeze=False)
    for col, head_dim in enumerate(head_dims):
        for causal_index, causal in enumerate((False, True)):
            for pass_index, key in enumerate(("fwd_tflops", "bwd_tflops")):
                ax = axes[2 * causal_index + pass_index][col]
                for implementation in implementations:
                    points = sorted((r["seqlen"], r[key]) for r in rows
                                    if r["impl"] == implementation and r.get("feature", "none") == "none"
                                    and r["head_dim"] == head_dim and r["causal"] == causal and r[key] is not None)
                    if points:
                        ax.plot(*zip(*points), marker="o", label=implementation)
                ax.set_xscale("log", base=2)
                ax.set_title(f"d={head_dim} {'causal' if causal else 'non-causal'} {key.split('_')[0]}")
                ax.set_xlabel("seqlen")
                ax.set_ylabel("TFLOP/s")
                ax.grid(True, alpha=0.3)
                ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--impls", nargs="+", default=None, choices=IMPLEMENTATIONS + FLOAT32_IMPLEMENTATIONS)
    parser.add_argument("--float32", action="store_true",
                        help="float32 inputs: jax_flash tf32/highest vs XLA float32 default/highest")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--forward-only", action="store_true", help="skip the backward timings")
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure each cell this many times, the implementations taking turns; keep each one's best")
    parser.add_argument("--features", nargs="+", default=["none"], choices=FEATURES,
                        help="padding_mask: a [batch, 1, 1, seqlen] boolean key-padding mask on every implementation; "
                             "dropout: rate 0.1, softcap: 50 (the Hopper forward's transforms form), on jax_flash only "
                             "(jax.nn has neither; the others run without)")
    parser.add_argument("--memory", action="store_true", help="also the 128k peak-memory comparison")
    parser.add_argument("--memory-only", action="store_true", help="only the peak-memory comparison")
    parser.add_argument("--memory-seqlen", type=int, default=131072)
    parser.add_argument("--out-dir", default=RESULTS_DIR)
    parser.add_argument("--tag", default="", help="suffix of the results file name (several runs on one day)")
    parser.add_argument("--memory-child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        print(json.dumps(peak_memory_child(args.memory_child[0], int(args.memory_child[1]))))
        return

    import jax

    if args.impls is None:
        args.impls = list(FLOAT32_IMPLEMENTATIONS if args.float32 else IMPLEMENTATIONS)
    gpu = jax.devices()[0].device_kind
    date = datetime.date.today().isoformat()
    os.makedirs(args.out_dir, exist_ok=True)
    kind = "attention_float32" if args.float32 else "attention"
    stem = os.path.join(args.out_dir, f"{kind}_{gpu.replace(' ', '_')}_{date}" + (f"_{args.tag}" if args.tag else ""))

    def write(rows, memory=()):  # after every row, so that a run cut short still leaves its results
        result = {"gpu": gpu, "date": date, "versions": versions(), "rows": rows}
        if memory:
            result["peak_memory"] = list(memory)
        with open(stem + ".json", "w") as f:
            json.dump(result, f, indent=1)

    rows = []
    for head_dim in ([] if args.memory_only else args.head_dims):
        for causal in (False, True):
            for seqlen in args.seqlens:
                for feature in args.features:
                    def measure_one(implementation):
                        return measure(implementation, head_dim, seqlen, causal, args.reps, args.forward_only,
                                       feature)

                    for r in measure_cell(args.impls, args.rounds, measure_one):
                        rows.append(r)
                        fwd = f"{r['fwd_tflops']:.1f}" if r["fwd_tflops"] else "-"
                        bwd = f"{r['bwd_tflops']:.1f}" if r["bwd_tflops"] else "-"
                        print(f"d={head_dim:3d} causal={int(causal)} seqlen={seqlen:5d} {feature:12s} "
                              f"{r['impl']:22s} fwd {fwd:>6s} bwd {bwd:>6s} {r.get('note', '')}"
                              f"{r.get('error', '')}", flush=True)
                    write(rows)
    memory = run_memory_benchmark(args.memory_seqlen) if args.memory or args.memory_only else []

    write(rows, memory)
    if not rows:
        print(f"wrote {stem}.json")
        return
    try:
        plot(rows, stem + ".png", args.impls)
    except ImportError as error:  # matplotlib is optional
        print(f"no plot: {error}")
    print_ratio_table(rows, "xla_f32_highest" if args.float32 else "cudnn", args.impls)
    if args.float32:
        print_ratio_table(rows, "xla_f32_default", args.impls)
    print(f"wrote {stem}.json and .png")


def print_ratio_table(rows: list[dict], baseline: str = "cudnn", implementations=IMPLEMENTATIONS) -> None:
    """jax_flash / baseline per cell, fwd and bwd."""
    def lookup(impl, r):
        for other in rows:
            if (other["impl"] == impl and other["head_dim"] == r["head_dim"] and other["seqlen"] == r["seqlen"]
                    and other["causal"] == r["causal"] and other.get("feature") == r.get("feature")):
                return other
        return None

    print(f"ratio to {baseline} (fwd / bwd):")
    for r in rows:
        if not r["impl"].startswith("jax_flash") or r["impl"] not in implementations:
            continue
        ref = lookup(baseline, r)
        if ref is None:
            continue
        ratio = lambda key: (f"{r[key] / ref[key]:.2f}" if r[key] and ref[key] else "-")
        print(f"  {r['impl']:15s} d={r['head_dim']:3d} causal={int(r['causal'])} seqlen={r['seqlen']:5d} "
              f"{r.get('feature', 'none')}: {ratio('fwd_tflops')} / {ratio('bwd_tflops')}"
              + (f" ({baseline} without {r['feature']})" if r.get("feature") in JAX_FLASH_ONLY_FEATURES else ""))


if __name__ == "__main__":
    main()
