"""Small bf16 grid of chosen head dims for compute-sanitizer: forward and backward through JAX on odd shapes
(partial tiles, GQA/MQA, causal with an offset, window, seqlens, segments, softcap). The standalone check has no
head-dim filter, so this covers builds of a few head dims (JAX_FLASH_CUDA_HEAD_DIMS). Run as
  XLA_FLAGS=--xla_gpu_enable_command_buffer= compute-sanitizer --tool memcheck --target-processes application-only \
    python3 head_dim_memcheck.py 96 192
One line per case (sanitizer_case.py)."""
import sys

import jax.numpy as jnp

from sanitizer_case import run_case

CASES = [  # batch, seqlen_q, seqlen_k, heads_q, heads_kv, kwargs
    (1, 1, 1, 2, 2, {}),
    (2, 77, 150, 6, 2, {"causal": True}),
    (1, 130, 200, 4, 1, {"window_size": (20, 5), "softcap": 5.0}),
    (2, 129, 130, 2, 2, {"q_seqlens": jnp.array([100, 3], jnp.int32), "kv_seqlens": jnp.array([7, 130], jnp.int32)}),
    (1, 40, 40, 2, 2, {"q_segment_ids": jnp.repeat(jnp.arange(4, dtype=jnp.int32), 10)[None],
                       "kv_segment_ids": jnp.repeat(jnp.arange(4, dtype=jnp.int32), 10)[None]}),
    (1, 300, 777, 4, 2, {}),
]

head_dims = [int(a) for a in sys.argv[1:]] or [96, 192]
for d in head_dims:
    for b, sq, sk, hq, hkv, kwargs in CASES:
        run_case(str(sorted(kwargs)), b, sq, sk, hq, hkv, d, jnp.bfloat16, **kwargs)
print("head-dim memcheck grid done")
