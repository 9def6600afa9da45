"""Train a small decoder-only transformer (Flax nnx) with jax_flash attention.

The task is synthetic, generated on the device each step, so nothing is
downloaded: every sequence is random tokens followed by the same tokens
again. The loss is counted on the second half only, so it starts
near ``log(vocab_size)`` and falls towards 0 once attention learns to look
half a sequence back.

``--attention`` picks the attention inside the same ``nnx.MultiHeadAttention``
layers (identical parameters): ``jax_flash`` (this library's kernels), ``flax``
(Flax's default ``attention_fn``, i.e. ``jax.nn.dot_product_attention``'s XLA
path) or ``cudnn`` (``jax.nn.dot_product_attention(implementation="cudnn")``,
GPU only, float16/bfloat16). Give several (or ``all``: those the backend has)
to train each in turn from the same initialisation and get a table of step
times.

On CPU, the defaults train in well under a minute::

    python examples/train_flax_lm.py

On a GPU, the step-time comparison at sequence length 4096::

    python examples/train_flax_lm.py --attention all --seq-len 4096 \\
        --batch-size 8 --d-model 512 --num-heads 8 --num-kv-heads 8 \\
        --num-layers 4 --steps 60
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from tqdm import tqdm

from decoder_lm import DecoderLM, ModelConfig
from jax_flash import flax_layers

ATTENTION_FNS: dict[str, Callable[..., jax.Array]] = {
    "jax_flash": flax_layers.dot_product_attention,
    "flax": nnx.dot_product_attention,
    "cudnn": functools.partial(flax_layers.dot_product_attention, implementation="cudnn"),
}


def copy_batch(key: jax.Array, batch_size: int, length: int, vocab_size: int) -> jax.Array:
    """``[batch_size, length]`` int32: ``ceil(length / 2)`` random tokens, then them again."""
    half = jax.random.randint(key, (batch_size, (length + 1) // 2), 0, vocab_size, jnp.int32)
    return jnp.concatenate([half, half], axis=1)[:, :length]


def copy_loss(model: DecoderLM, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Mean next-token cross-entropy and accuracy over the predictable (second) half.

    Args:
      model: the language model.
      tokens: ``[batch, seq_len + 1]`` from ``copy_batch``; the model reads the
        first ``seq_len`` and predicts the last ``seq_len``.
    """
    inputs = tokens[:, :-1]
    logits = model(inputs, jnp.broadcast_to(jnp.arange(inputs.shape[1]), inputs.shape))
    first_repeat = (tokens.shape[1] + 1) // 2
    logits, targets = logits[:, first_repeat - 1 :], tokens[:, first_repeat:]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    accuracy = (logits.argmax(-1) == targets).mean()
    return loss, accuracy


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, args: argparse.Namespace):
    """A jitted ``(params, opt_state, key) -> (params, opt_state, loss, accuracy)``."""

    def loss_fn(params: nnx.State, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        return copy_loss(nnx.merge(graphdef, params), tokens)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, key):
        # Generating the batch inside the step keeps the host out of the timing.
        tokens = copy_batch(key, args.batch_size, args.seq_len + 1, args.vocab_size)
        (loss, accuracy), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, accuracy

    return train_step


@dataclasses.dataclass
class RunResult:
    """One training run: timings (the first step includes compilation) and losses."""

    attention: str
    compile_and_first_step_s: float
    median_step_ms: float
    first_loss: float
    final_loss: float
    final_accuracy: float


def train(attention: str, config: ModelConfig, args: argparse.Namespace) -> RunResult:
    """Trains one model from seed ``args.seed`` and times every step."""
    model = DecoderLM(config, ATTENTION_FNS[attention], nnx.Rngs(args.seed))
    graphdef, params = nnx.split(model)
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.learning_rate, args.steps // 10 + 1, args.steps)
    tx = optax.adamw(schedule, weight_decay=0.01)
    opt_state = tx.init(params)
    train_step = make_train_step(graphdef, tx, args)
    data_key = jax.random.key(args.seed + 1)

    step_seconds, losses = [], []
    progress = tqdm(range(args.steps), desc=f"{attention:>9}", dynamic_ncols=True, mininterval=0.5)
    for step in progress:
        start = time.perf_counter()
        params, opt_state, loss, accuracy = train_step(params, opt_state, jax.random.fold_in(data_key, step))
        loss = float(loss)  # waits for the step, so the wall time is the step's
        step_seconds.append(time.perf_counter() - start)
        losses.append(loss)
        progress.set_postfix(loss=f"{loss:.3f}", acc=f"{float(accuracy):.2f}",
                             step_ms=f"{1e3 * step_seconds[-1]:.1f}")
    return RunResult(
        attention=attention,
        compile_and_first_step_s=step_seconds[0],
        median_step_ms=1e3 * statistics.median(step_seconds[1:]),
        first_loss=losses[0],
        final_loss=statistics.fmean(losses[-10:]),
        final_accuracy=float(accuracy),
    )


def parse_args() -> argparse.Namespace:
    on_gpu = jax.default_backend() == "gpu"
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--attention", nargs="+", default=["jax_flash"],
                        choices=[*ATTENTION_FNS, "all"], help="one or more attention implementations")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64, help="tokens the model reads per sequence")
    parser.add_argument("--vocab-size", type=int, default=16)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--num-kv-heads", type=int, default=2, help="fewer than --num-heads: GQA")
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16" if on_gpu else "float32",
                        help="compute dtype (parameters stay float32); default bfloat16 on GPU, float32 on CPU")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if "is_causal" not in inspect.signature(nnx.MultiHeadAttention.__call__).parameters:
        parser.error("needs Flax >= 0.12.8, whose nnx.MultiHeadAttention takes is_causal and num_kv_heads")
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the first step compiles and is timed apart)")
    if "all" in args.attention:
        args.attention = list(ATTENTION_FNS) if on_gpu else ["jax_flash", "flax"]
    if "cudnn" in args.attention and not on_gpu:
        parser.error("--attention cudnn needs a GPU backend")
    return args


def main() -> None:
    args = parse_args()
    config = ModelConfig(
        vocab_size=args.vocab_size, seq_len=args.seq_len, d_model=args.d_model, num_layers=args.num_layers,
        num_heads=args.num_heads, num_kv_heads=args.num_kv_heads, dtype=jnp.dtype(args.dtype),
    )
    print(f"backend={jax.default_backend()} device={jax.devices()[0].device_kind} {config}")
    results = [train(attention, config, args) for attention in args.attention]

    print(f"\n{'attention':>9} | {'compile+1st step s':>18} | {'median step ms':>14} | "
          f"{'loss first -> last':>18} | {'copy acc':>8}")
    for r in results:
        print(f"{r.attention:>9} | {r.compile_and_first_step_s:>18.2f} | {r.median_step_ms:>14.2f} | "
              f"{r.first_loss:>8.3f} -> {r.final_loss:<7.3f} | {r.final_accuracy:>8.2f}")


if __name__ == "__main__":
    main()
