"""One case of the sanitizer grids (float32_memcheck.py, head_dim_memcheck.py): fresh random q/k/v/dO, forward and
backward of jax_flash.attention through JAX, one printed line, and a failure if any output is not finite (so that
a kernel that silently wrote nothing still shows under compute-sanitizer)."""
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash


def run_case(label, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype, **kwargs):
    keys = jax.random.split(jax.random.key(seqlen_q * 7 + head_dim), 4)
    q, d_o = (jax.random.normal(key, (batch, seqlen_q, heads_q, head_dim), dtype) for key in (keys[0], keys[3]))
    k, v = (jax.random.normal(key, (batch, seqlen_k, heads_kv, head_dim), dtype) for key in keys[1:3])
    start = time.monotonic()
    o, vjp = jax.vjp(lambda q_, k_, v_: jax_flash.attention(q_, k_, v_, **kwargs), q, k, v)
    o.block_until_ready()
    # Each phase's time (compilation and the sanitized kernels): under a sanitizer some runs take minutes, and a run
    # cut off by its time limit should still say which phase it was in.
    print(f"forward {time.monotonic() - start:.0f} s,", end=" ", flush=True)
    start = time.monotonic()
    grads = jax.block_until_ready(vjp(d_o))
    print(f"backward {time.monotonic() - start:.0f} s:", end=" ", flush=True)
    outputs = [np.asarray(x.astype(jnp.float32)) for x in (o, *grads)]
    finite = all(bool(np.all(np.isfinite(x))) for x in outputs)
    print(f"b={batch} sq={seqlen_q} sk={seqlen_k} hq={heads_q} hkv={heads_kv} d={head_dim} {label}: finite={finite} "
          f"max|o|={float(np.max(np.abs(outputs[0]))):.3g}", flush=True)
    assert finite
