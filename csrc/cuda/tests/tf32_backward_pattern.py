"""Pattern of a Hopper TF32 backward error (JAX_FLASH_CUDA_KERNEL_F32_BACKWARD=sm90) against the mma.sync TF32
kernels (=sm80) on the same inputs, all on the GPU: per case, whether two sm90 runs are bit-identical (a race
shows as a difference), and the worst relative difference of dq per (batch, head, 64-row group) and of dk / dv.
Shapes separate the suspects: key tiles per row block, partial query / key tiles, causal diagonals, both consumer
warpgroups busy or one. Run from the repository root on the GPU machine."""
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "tests"))
from attention_cases import Case, grads  # noqa: E402

CASES = [  # seqlen_q, seqlen_k, batch, heads_q, heads_kv, causal
    (256, 256, 1, 1, 1, False), (256, 1024, 1, 1, 1, False), (256, 777, 1, 1, 1, False),
    (128, 777, 1, 1, 1, False), (64, 777, 1, 1, 1, False), (300, 768, 1, 1, 1, False),
    (256, 256, 1, 1, 1, True), (1000, 1000, 1, 1, 1, True), (1000, 1000, 1, 1, 1, False),
    (300, 777, 2, 4, 4, False), (1000, 1000, 1, 8, 2, True),
]


def run(family, args):
    os.environ["JAX_FLASH_CUDA_KERNEL_F32_BACKWARD"] = family
    out = grads(*args[:4], float32_precision="tf32", causal=args[4])
    return [np.asarray(g, np.float64) for g in out]


for head_dim in [int(a) for a in sys.argv[1:]] or [64, 128]:
    for sq, sk, b, hq, hkv, causal in CASES:
        case = Case(batch=b, seqlen_q=sq, seqlen_k=sk, heads_q=hq, heads_kv=hkv, head_dim=head_dim, seed=sq + sk)
        q, k, v = case.inputs()
        d_o = jax.random.normal(jax.random.key(5), q.shape, jnp.float32)
        args = (q, k, v, d_o, causal)
        first, second, mma_sync = run("sm90", args), run("sm90", args), run("sm80", args)
        same = all(np.array_equal(x, y) for x, y in zip(first, second))
        rel = [np.abs(x - y) / max(1e-30, np.abs(y).max()) for x, y in zip(first, mma_sync)]
        groups = []
        for bi in range(b):
            for h in range(hq):
                for g in range(0, sq, 64):
                    e = rel[0][bi, g:g + 64, h].max()
                    if e > 1e-2:
                        groups.append(f"b{bi}h{h}r{g}:{e:.2f}")
        print(f"d={head_dim} {sq}x{sk} b{b} h{hq}/{hkv} causal={int(causal)}: repeat-identical={same} "
              f"dq {rel[0].max():.1e} dk {rel[1].max():.1e} dv {rel[2].max():.1e} | bad dq groups "
              f"{len(groups)}: {' '.join(groups[:24])}", flush=True)
print("pattern done")
