"""Data- and context-parallel training of a small Flax nnx transformer on jax_flash attention.

The batch is sharded over the mesh axis ``data`` and the sequence over ``seq``, so every device holds a slice of
every activation. Two ways to run attention on the sharded sequence, picked with ``--attention``:

- ``partitioned``: jax_flash's Flax ``attention_fn`` under ``jax.jit``. Its custom partitioning sees the sharded
  sequence and runs ring attention over ``seq`` (contiguous layout); nothing in the model mentions devices.
- ``ring``: ``jax_flash.ring_attention`` inside ``jax.shard_map`` with the zigzag layout, which balances the
  causal mask's work over the ring. Tokens enter the model in zigzag order, carrying their position ids, and the
  loss is a weighted mean over tokens, so the order does not change it.
- ``both``: each in turn from the same initialisation; their losses agree.

The task is synthetic (random tokens, then the same tokens again; the loss counts the second half), so nothing is
downloaded. On a machine without accelerators, fake devices on the CPU::

    python examples/sharded_training.py --cpu-devices 8

On GPUs (all visible ones; ``--seq-shards`` of them along the sequence)::

    python examples/sharded_training.py --seq-shards 2 --seq-len 16384 --batch-size 2 --d-model 1024 \\
        --num-heads 8 --num-kv-heads 4
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flash
from decoder_lm import DecoderLM, ModelConfig
from jax_flash import flax_layers

TOKENS = P("data", "seq")  # [batch, seq_len] and every [batch, seq_len, ...] activation


def zigzag_ring_attention_fn(mesh: Mesh) -> Callable[..., jax.Array]:
    """A Flax ``attention_fn`` running ``jax_flash.ring_attention`` over the ``seq`` axis of ``mesh``.

    The sequence it sees must be in zigzag order (``jax_flash.to_zigzag``); the causal mask follows the original
    positions.
    """

    def attention_fn(query, key, value, mask=None, dropout_rate=0.0, is_causal=False, module=None, **unused):
        del unused  # dtype/precision/dropout plumbing that does not apply to the fused kernels
        if mask is not None or dropout_rate > 0 or module is not None:
            raise NotImplementedError("this example's attention supports neither masks, dropout nor sown weights")
        ring = functools.partial(jax_flash.ring_attention, axis_name="seq", layout="zigzag", causal=is_causal)
        spec = P("data", "seq")
        return jax.shard_map(ring, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)(query, key, value)

    return attention_fn


def copy_batch(key: jax.Array, batch_size: int, seq_len: int, vocab_size: int) -> dict[str, jax.Array]:
    """Inputs, next-token targets and loss weights (second half only), each ``[batch_size, seq_len]``."""
    half = jax.random.randint(key, (batch_size, (seq_len + 2) // 2), 0, vocab_size, jnp.int32)
    stream = jnp.concatenate([half, half], axis=1)[:, :seq_len + 1]
    positions = jnp.broadcast_to(jnp.arange(seq_len), (batch_size, seq_len))
    weights = (positions >= half.shape[1] - 1).astype(jnp.float32)
    return {"tokens": stream[:, :-1], "targets": stream[:, 1:], "positions": positions, "weights": weights}


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, mesh: Mesh,
                    args: argparse.Namespace):
    """A jitted ``(params, opt_state, key) -> (params, opt_state, loss)``."""
    seq_shards = mesh.shape["seq"]
    reorder = ((lambda x: jax_flash.to_zigzag(x, seq_shards)) if args.attention == "ring" else (lambda x: x))

    def loss_fn(params: nnx.State, batch: dict[str, jax.Array]) -> jax.Array:
        logits = nnx.merge(graphdef, params)(batch["tokens"], batch["positions"])
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
        return jnp.sum(losses * batch["weights"]) / jnp.sum(batch["weights"])

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, key):
        # Generated on the devices and laid out like the activations: batch over data, sequence over seq.
        batch = copy_batch(key, args.batch_size, args.seq_len, args.vocab_size)
        batch = {name: jax.lax.with_sharding_constraint(reorder(x), NamedSharding(mesh, TOKENS))
                 for name, x in batch.items()}
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


def train(mesh: Mesh, config: ModelConfig, args: argparse.Namespace) -> tuple[list[float], list[float]]:
    """Trains from seed ``args.seed``; prints the step times; returns the losses and the seconds of each step (the
    first includes compilation)."""
    attention_fn = (zigzag_ring_attention_fn(mesh) if args.attention == "ring"
                    else flax_layers.dot_product_attention)
    graphdef, params = nnx.split(DecoderLM(config, attention_fn, nnx.Rngs(args.seed)))
    # Replicated (this example shards activations only), and committed so that step 1 does not recompile.
    replicated = NamedSharding(mesh, P())
    params = jax.device_put(params, replicated)
    tx = optax.adamw(args.learning_rate)
    opt_state = jax.device_put(tx.init(params), replicated)
    train_step = make_train_step(graphdef, tx, mesh, args)

    losses, seconds = [], []
    for step in range(args.steps):
        start = time.perf_counter()
        params, opt_state, loss = train_step(params, opt_state, jax.random.key(args.seed + 1 + step))
        losses.append(float(loss))  # waits for the step
        seconds.append(time.perf_counter() - start)
        if step % max(1, args.steps // 10) == 0 or step == args.steps - 1:
            print(f"  [{args.attention}] step {step:4d}  loss {losses[-1]:.4f}  {1e3 * seconds[-1]:8.1f} ms")
    print(f"  [{args.attention}] compile + first step {seconds[0]:.1f} s, median step "
          f"{1e3 * statistics.median(seconds[1:]):.1f} ms")
    return losses, seconds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--attention", choices=["partitioned", "ring", "both"], default="both")
    parser.add_argument("--cpu-devices", type=int, default=0,
                        help="fake this many CPU devices (runs on the CPU; for machines without accelerators)")
    parser.add_argument("--seq-shards", type=int, default=0,
                        help="devices along the sequence (mesh axis 'seq'); default: all of 2 or fewer, else half")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--vocab-size", type=int, default=16)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--num-kv-heads", type=int, default=2)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="compute dtype; default bfloat16 on GPU (the CUDA kernels' types), float32 elsewhere")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the first step compiles and is timed apart)")
    return args


def make_mesh(args: argparse.Namespace, devices: list[jax.Device] | None = None) -> Mesh:
    """A ``(data, seq)`` mesh of ``devices`` (default: every visible one), ``args.seq_shards`` along the sequence."""
    devices = devices or jax.devices()
    seq_shards = args.seq_shards or (len(devices) if len(devices) <= 2 else len(devices) // 2)
    if len(devices) % seq_shards or args.batch_size % (len(devices) // seq_shards):
        raise SystemExit(f"{len(devices)} devices: --seq-shards {seq_shards} must divide them, and the rest "
                         f"(data parallel) must divide --batch-size {args.batch_size}")
    if args.seq_len % (2 * seq_shards):
        raise SystemExit(f"--seq-len must be a multiple of 2 x --seq-shards = {2 * seq_shards} (zigzag layout)")
    return Mesh(np.asarray(devices).reshape(len(devices) // seq_shards, seq_shards), ("data", "seq"))


def model_config(args: argparse.Namespace) -> ModelConfig:
    """The model of ``args``; its compute dtype (``args.dtype``, filled in if unset) bfloat16 on GPU, float32
    elsewhere."""
    args.dtype = args.dtype or ("bfloat16" if jax.default_backend() == "gpu" else "float32")
    return ModelConfig(vocab_size=args.vocab_size, seq_len=args.seq_len, d_model=args.d_model,
                       num_layers=args.num_layers, num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
                       dtype=jnp.dtype(args.dtype))


def main() -> None:
    args = parse_args()
    if args.cpu_devices:
        # Read when jax creates its CPU backend, which has not happened yet.
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={args.cpu_devices}")
        jax.config.update("jax_platforms", "cpu")
    mesh = make_mesh(args)
    config = model_config(args)
    print(f"{len(mesh.devices.flat)} x {jax.devices()[0].device_kind}, mesh {dict(mesh.shape)}, {config}")
    modes = ["partitioned", "ring"] if args.attention == "both" else [args.attention]
    losses = {mode: train(mesh, config, argparse.Namespace(**{**vars(args), "attention": mode}))[0] for mode in modes}
    if len(modes) == 2:
        first = abs(losses["partitioned"][0] - losses["ring"][0])
        print(f"first-step loss, partitioned vs ring: {losses['partitioned'][0]:.6f} vs {losses['ring'][0]:.6f} "
              f"(difference {first:.1e})")


if __name__ == "__main__":
    main()
