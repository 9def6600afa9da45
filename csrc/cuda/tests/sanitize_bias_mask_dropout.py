"""A small forward + backward through every kernel of the general variant (bias, boolean mask, dropout; dbias by
stores, atomics and the deterministic dbias kernel), for compute-sanitizer:
  XLA_FLAGS=--xla_gpu_enable_command_buffer= compute-sanitizer --tool memcheck --target-processes application-only \
    python3 <this file>
Prints the sums of the gradients so a run can be compared with another."""

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash

batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim = 2, 70, 90, 4, 2, 64
keys = jax.random.split(jax.random.key(0), 5)
q = jax.random.normal(keys[0], (batch, seqlen_q, heads_q, head_dim), jnp.bfloat16)
k = jax.random.normal(keys[1], (batch, seqlen_k, heads_kv, head_dim), jnp.bfloat16)
v = jax.random.normal(keys[2], (batch, seqlen_k, heads_kv, head_dim), jnp.bfloat16)
mask = jax.random.bernoulli(keys[3], 0.8, (batch, 1, seqlen_q, seqlen_k)).at[0, :, 3].set(False)
for shape, deterministic in (((batch, heads_q, seqlen_q, seqlen_k), False), ((heads_q, seqlen_q, seqlen_k), False),
                             ((heads_q, seqlen_q, seqlen_k), True), ((1, heads_q, 1, seqlen_k), True)):
    bias = jax.random.normal(keys[4], shape, jnp.float32)

    def loss(q_, k_, v_, b_):
        o = jax_flash.attention(q_, k_, v_, bias=b_, mask=mask, dropout_rate=0.2, dropout_rng=jax.random.key(1),
                                causal=True, deterministic=deterministic)
        return jnp.sum(o.astype(jnp.float32) ** 2)

    g = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, bias)
    print(shape, deterministic, [float(jnp.sum(x.astype(jnp.float32))) for x in g],
          all(bool(np.all(np.isfinite(np.asarray(x, np.float32)))) for x in g), flush=True)
