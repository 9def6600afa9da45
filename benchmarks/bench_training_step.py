"""A full jitted training step of a small Flax decoder: jax_flash attention vs cuDNN (issue #7).

The model is the examples' decoder (``examples/decoder_lm.py``: pre-norm blocks of causal self-attention through
``jax_flash.flax_layers.nnx.MultiHeadAttention`` and a 4x GELU MLP, float32 parameters, bfloat16 compute on GPU).
Only its ``attention_fn`` changes between implementations, so every one starts from the same parameters
(same seed; attention holds none) and sees the same batches:
  jax_flash  jax_flash's Flax ``attention_fn`` (the CUDA kernels on GPU, the CPU kernels on CPU)
  cudnn      ``jax.nn.dot_product_attention(implementation="cudnn")`` (GPU only; skipped with a message on CPU)
  xla        ``jax.nn.dot_product_attention(implementation="xla")`` (materialises the scores; slow at 4k but fits)
One step, all under one ``jax.jit``: draw ``[batch, seq_len + 1]`` random tokens, next-token cross-entropy,
``jax.value_and_grad``, ``optax.adamw`` update (parameters and optimizer state donated).

Timing: the first call (compile + one step) is timed apart; then ``--trials`` trials of ``--steps`` steps, each
ended by ``jax.block_until_ready``; the step time is the median over trials of the trial's mean. Correctness:
the loss at initialisation, its gradient norm and the loss after one update are compared with jax_flash's
(relative difference, dtype tolerance); the script exits 1 if they disagree.

GPU (H200: about 60 s for jax_flash + cudnn, compiles included; add xla with --impls for ~20 s more):
    python benchmarks/bench_training_step.py
CPU smoke run (seconds): python benchmarks/bench_training_step.py --quick
Writes benchmarks/results/training_step_<device>_<date>.json (--out-dir to change).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(_HERE), "examples"))  # decoder_lm: the examples' one model
sys.path.insert(0, _HERE)  # bench_attention: the shared results header

from bench_attention import versions  # noqa: E402
from decoder_lm import DecoderLM, ModelConfig  # noqa: E402
from jax_flash import flax_layers  # noqa: E402

IMPLEMENTATIONS = ("jax_flash", "cudnn", "xla")
RESULTS_DIR = os.path.join(_HERE, "results")
# Relative loss / gradient-norm agreement with jax_flash. bfloat16: attention outputs are rounded to 8 bits of
# mantissa by every implementation, in different places; the mean loss over >= 16k tokens averages that out,
# the gradient norm less so. float32 (CPU): only summation order differs.
QUICK_DEFAULTS = {"seq_len": 128, "batch_size": 2, "d_model": 64, "num_heads": 2, "num_layers": 2,
                  "vocab_size": 256, "steps": 2, "trials": 2}
TOLERANCE = {"bfloat16": {"loss": 1e-2, "grad_norm": 5e-2}, "float32": {"loss": 1e-4, "grad_norm": 1e-3}}


def jax_nn_attention_fn(implementation: str) -> Callable[..., jax.Array]:
    """A Flax ``attention_fn`` (the arguments nnx passes) that calls ``jax.nn.dot_product_attention`` itself."""

    def attention_fn(query, key, value, bias=None, mask=None, dropout_rng=None, dropout_rate=0.0,
                     broadcast_dropout=True, deterministic=False, dtype=None, precision=None, module=None,
                     is_causal=False):
        del dropout_rng, broadcast_dropout, dtype, precision  # no dropout here; q, k, v come in the compute dtype
        if bias is not None or mask is not None or module is not None or (dropout_rate > 0.0 and not deterministic):
            raise NotImplementedError("the benchmark's jax.nn attention takes no bias, mask, dropout or sown weights")
        return jax.nn.dot_product_attention(query, key, value, is_causal=is_causal, implementation=implementation)

    return attention_fn


def attention_fn(implementation: str) -> Callable[..., jax.Array]:
    if implementation == "jax_flash":
        return flax_layers.dot_product_attention
    if implementation in ("cudnn", "xla"):
        return jax_nn_attention_fn(implementation)
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")


def build_model(config: ModelConfig, implementation: str, seed: int = 0) -> DecoderLM:
    """The decoder with ``implementation``'s attention; equal seeds give equal parameters for every one."""
    return DecoderLM(config, attention_fn(implementation), nnx.Rngs(seed))


def make_train_step(model: DecoderLM, tx: optax.GradientTransformation, batch_size: int, seed: int = 0):
    """Returns ``(step_fn, params, opt_state)``; ``step_fn(params, opt_state, step)`` is jitted and returns
    ``(params, opt_state, step + 1, loss, grad_norm)``, ``loss`` and ``grad_norm`` before the update.

    The batch of step ``step`` is drawn inside the step from ``seed`` and ``step``, so the host stays out of the
    timing and every implementation sees the same tokens.
    """
    graphdef, params = nnx.split(model)
    seq_len, vocab_size = model.position_embed.num_embeddings, model.token_embed.num_embeddings
    data_key = jax.random.key(seed + 1)

    def loss_fn(params: nnx.State, tokens: jax.Array) -> jax.Array:
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        positions = jnp.broadcast_to(jnp.arange(seq_len), inputs.shape)
        logits = nnx.merge(graphdef, params)(inputs, positions)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step_fn(params, opt_state, step):
        tokens = jax.random.randint(jax.random.fold_in(data_key, step), (batch_size, seq_len + 1), 0, vocab_size)
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, step + 1, loss, global_norm(grads)

    return step_fn, params, tx.init(params)


def global_norm(tree) -> jax.Array:
    """The float32 Euclidean norm of all leaves (written out: optax renamed its helper between versions)."""
    return jnp.sqrt(sum(jnp.sum(jnp.square(leaf.astype(jnp.float32))) for leaf in jax.tree.leaves(tree)))


def optimizer(learning_rate: float = 1e-3) -> optax.GradientTransformation:
    return optax.adamw(learning_rate, weight_decay=0.01)


def first_two_steps(step_fn, params, opt_state) -> tuple[nnx.State, optax.OptState, jax.Array, dict]:
    """The first step (timed with its compilation) and the second; returns the state after them and a row with
    ``compile_and_first_step_s``, ``loss_init``, ``grad_norm_init`` and ``loss_after_one_step``."""
    start = time.perf_counter()
    params, opt_state, step, loss_init, grad_norm_init = jax.block_until_ready(
        step_fn(params, opt_state, jnp.int32(0)))
    compile_s = time.perf_counter() - start
    params, opt_state, step, loss_after, _ = step_fn(params, opt_state, step)
    return params, opt_state, step, {"compile_and_first_step_s": compile_s, "loss_init": float(loss_init),
                                     "grad_norm_init": float(grad_norm_init),
                                     "loss_after_one_step": float(loss_after)}


def measure(config: ModelConfig, implementation: str, args: argparse.Namespace) -> dict:
    """Compiles, runs the two checked steps, then times ``args.trials`` x ``args.steps`` steps."""
    step_fn, params, opt_state = make_train_step(build_model(config, implementation, args.seed), optimizer(),
                                                 args.batch_size, args.seed)
    params, opt_state, step, first = first_two_steps(step_fn, params, opt_state)
    row = {"impl": implementation, **first}
    trial_ms = []
    for _ in range(args.trials):
        start = time.perf_counter()
        for _ in range(args.steps):
            params, opt_state, step, loss, _ = step_fn(params, opt_state, step)
        jax.block_until_ready((params, opt_state, loss))
        trial_ms.append(1e3 * (time.perf_counter() - start) / args.steps)
    row["trial_step_ms"] = trial_ms
    row["step_ms"] = statistics.median(trial_ms)
    row["tokens_per_s"] = args.batch_size * config.seq_len / (row["step_ms"] / 1e3)
    return row


def relative_difference(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def compare(rows: list[dict], dtype: str) -> dict:
    """Every timed implementation against jax_flash: step-time ratio and loss / gradient-norm agreement."""
    by_impl = {r["impl"]: r for r in rows if "step_ms" in r}
    comparison = {}
    if "jax_flash" not in by_impl:
        return comparison
    flash = by_impl["jax_flash"]
    tolerance = TOLERANCE[dtype]
    for name, other in by_impl.items():
        if name == "jax_flash":
            continue
        diffs = {key: relative_difference(flash[key], other[key])
                 for key in ("loss_init", "grad_norm_init", "loss_after_one_step")}
        comparison[name] = {
            "step_time_ratio_jax_flash_over_" + name: flash["step_ms"] / other["step_ms"],
            "relative_difference": diffs,
            "agree": (diffs["loss_init"] <= tolerance["loss"] and diffs["loss_after_one_step"] <= tolerance["loss"]
                      and diffs["grad_norm_init"] <= tolerance["grad_norm"]),
        }
    return comparison


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    on_gpu = jax.default_backend() == "gpu"
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impls", nargs="+", choices=IMPLEMENTATIONS, default=None,
                        help="default: jax_flash cudnn on GPU, jax_flash xla on CPU")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=4, help="default: 4 x 4096 = 16k tokens per step")
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--num-heads", type=int, default=8, help="head_dim = d_model / num_heads (default 128)")
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--dtype", choices=sorted(TOLERANCE), default="bfloat16" if on_gpu else "float32",
                        help="compute dtype (parameters stay float32); default bfloat16 on GPU, float32 on CPU")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per trial")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="CPU smoke defaults (size flags given still apply): " + ", ".join(
                            f"{name.replace('_', '-')} {value}" for name, value in QUICK_DEFAULTS.items()))
    parser.add_argument("--out-dir", default=RESULTS_DIR)
    if "--quick" in (sys.argv[1:] if argv is None else argv):
        parser.set_defaults(**QUICK_DEFAULTS)
    args = parser.parse_args(argv)
    if args.impls is None:
        args.impls = ["jax_flash", "cudnn"] if on_gpu else ["jax_flash", "xla"]
    if args.d_model % args.num_heads:
        parser.error("--d-model must be a multiple of --num-heads")
    if args.steps < 1 or args.trials < 1:
        parser.error("--steps and --trials must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = ModelConfig(vocab_size=args.vocab_size, seq_len=args.seq_len, d_model=args.d_model,
                         num_layers=args.num_layers, num_heads=args.num_heads, num_kv_heads=args.num_heads,
                         dtype=jnp.dtype(args.dtype))
    device = jax.devices()[0].device_kind
    date = datetime.date.today().isoformat()
    tokens = args.batch_size * args.seq_len
    print(f"backend={jax.default_backend()} device={device} tokens/step={tokens} "
          f"head_dim={args.d_model // args.num_heads} {config}", flush=True)

    rows = []
    for implementation in args.impls:
        if implementation == "cudnn" and jax.default_backend() != "gpu":
            rows.append({"impl": "cudnn", "skipped": f"cuDNN needs a GPU; the backend is {jax.default_backend()}"})
            print(f"{'cudnn':>9}: skipped, {rows[-1]['skipped']}", flush=True)
            continue
        try:
            rows.append(measure(config, implementation, args))
        except Exception as error:  # noqa: BLE001 - an implementation that cannot run is recorded, not fatal
            rows.append({"impl": implementation, "error": f"{type(error).__name__}: "
                                                          f"{str(error).splitlines()[0][:300]}"})
            print(f"{implementation:>9}: {rows[-1]['error']}", flush=True)
            continue
        r = rows[-1]
        print(f"{implementation:>9}: compile+1st step {r['compile_and_first_step_s']:6.1f} s | step "
              f"{r['step_ms']:8.2f} ms (trials {', '.join(f'{t:.2f}' for t in r['trial_step_ms'])}) | "
              f"{r['tokens_per_s']:10.0f} tokens/s | loss {r['loss_init']:.5f} -> {r['loss_after_one_step']:.5f}",
              flush=True)

    comparison = compare(rows, args.dtype)
    for name, c in comparison.items():
        ratio = c["step_time_ratio_jax_flash_over_" + name]
        diffs = ", ".join(f"{key} {value:.2e}" for key, value in c["relative_difference"].items())
        print(f"step time jax_flash / {name} = {ratio:.3f} ({'jax_flash' if ratio < 1 else name} faster); "
              f"relative difference {diffs}: {'agree' if c['agree'] else 'DISAGREE'} "
              f"(tolerance {TOLERANCE[args.dtype]})")

    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, f"training_step_{device.replace(' ', '_')}_{date}.json")
    result = {"gpu": device, "date": date,
              "versions": {**versions(), "flax": _version("flax"), "optax": optax.__version__},
              "config": {"seq_len": args.seq_len, "batch_size": args.batch_size, "tokens_per_step": tokens,
                         "d_model": args.d_model, "num_heads": args.num_heads,
                         "head_dim": args.d_model // args.num_heads, "num_layers": args.num_layers,
                         "mlp_width": 4 * args.d_model, "vocab_size": args.vocab_size, "causal": True,
                         "compute_dtype": args.dtype, "param_dtype": "float32", "optimizer": "optax.adamw(1e-3)",
                         "steps_per_trial": args.steps, "trials": args.trials,
                         "JAX_FLASH_CUDA_KERNEL": os.environ.get("JAX_FLASH_CUDA_KERNEL"),
                         "JAX_FLASH_CUDA_KERNEL_BACKWARD": os.environ.get("JAX_FLASH_CUDA_KERNEL_BACKWARD")},
              "rows": rows, "comparison": comparison}
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")
    failed = any("error" in r for r in rows) or not all(c["agree"] for c in comparison.values())
    return 1 if failed else 0


def _version(package: str) -> str:
    import importlib.metadata

    return importlib.metadata.version(package)


if __name__ == "__main__":
    sys.exit(main())
