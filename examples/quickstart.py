"""jax_flash in one page: forward and backward on whatever device JAX has, checked against XLA attention.

Run:  python examples/quickstart.py
"""

import time

import jax
import jax.numpy as jnp

import jax_flash


def timed(fn, *args, repeats=5):
    """Median wall time of a jitted function after a warm-up call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main():
    device = jax.devices()[0]
    on_gpu = device.platform == "gpu"
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    batch, seqlen, heads_q, heads_kv, head_dim = (4, 4096, 16, 4, 128) if on_gpu else (2, 1024, 8, 2, 64)
    print(f"device: {device.device_kind} ({device.platform}), dtype {jnp.dtype(dtype).name}, "
          f"q [{batch}, {seqlen}, {heads_q}, {head_dim}], k/v heads {heads_kv}, causal")

    kq, kk, kv, kg = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(kq, (batch, seqlen, heads_q, head_dim), dtype)
    k = jax.random.normal(kk, (batch, seqlen, heads_kv, head_dim), dtype)
    v = jax.random.normal(kv, (batch, seqlen, heads_kv, head_dim), dtype)
    d_o = jax.random.normal(kg, q.shape, dtype)

    def forward(implementation):
        return jax.jit(lambda q_, k_, v_: jax_flash.attention(q_, k_, v_, causal=True, implementation=implementation))

    def backward(implementation):
        loss = lambda q_, k_, v_: jnp.sum((forward(implementation)(q_, k_, v_) * d_o).astype(jnp.float32))
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

    o_flash, o_xla = forward(None)(q, k, v), forward("xla")(q, k, v)
    g_flash, g_xla = backward(None)(q, k, v), backward("xla")(q, k, v)

    def relative_error(a, b):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))

    print(f"forward : |o_flash - o_xla| / |o_xla| = {relative_error(o_flash, o_xla):.2e}")
    for name, a, b in zip(("dq", "dk", "dv"), g_flash, g_xla):
        print(f"backward: |{name}_flash - {name}_xla| / |{name}_xla| = {relative_error(a, b):.2e}")

    flops = 4 * batch * heads_q * seqlen * seqlen * head_dim / 2  # causal: half the score matrix
    for name, implementation in (("jax_flash", None), ("xla", "xla")):
        t_fwd = timed(forward(implementation), q, k, v)
        t_bwd = timed(backward(implementation), q, k, v)
        print(f"{name:>9}: forward {t_fwd * 1e3:8.2f} ms ({flops / t_fwd / 1e9:8.1f} GFLOP/s), "
              f"forward+backward {t_bwd * 1e3:8.2f} ms")


if __name__ == "__main__":
    main()
