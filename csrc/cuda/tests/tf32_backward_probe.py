"""Where the Hopper TF32 backward (JAX_FLASH_CUDA_KERNEL_F32_BACKWARD=sm90) goes wrong, if it does: for the cases of
tests/test_cuda.py's test_float32_tf32_backward_on_sm90, the max error of dq, dk and dv against the float64
reference for the Hopper passes, the mma.sync kernels and XLA at "tensorfloat32", and for the Hopper error the
(batch, seq, head) position of the worst element and how many elements are 10x past XLA's worst error.
Run from the repository root on the GPU machine: python3 csrc/cuda/tests/tf32_backward_probe.py [head_dim ...]"""
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "tests"))
from attention_cases import Case, feature_kwargs, grads, oracle_grads  # noqa: E402

CASES = (((1000, 1000), (8, 2), "causal"), ((300, 777), (4, 4), "none"), ((1, 4100), (8, 1), "none"),
         ((129, 70), (2, 1), "causal"), ((200, 200), (4, 2), "window"), ((150, 190), (4, 2), "seqlens"),
         ((160, 160), (2, 2), "segments"), ((256, 256), (2, 2), "none"))
head_dims = [int(a) for a in sys.argv[1:]] or [64, 128, 36, 100]


def gradients(family, on_gpu, kwargs):
    os.environ["JAX_FLASH_CUDA_KERNEL_F32_BACKWARD"] = family
    try:
        return [np.asarray(g, np.float64) for g in grads(*on_gpu, float32_precision="tf32", **kwargs)]
    except Exception as error:  # noqa: BLE001 - a refusal or a launch error is a result here
        return str(error).splitlines()[0][:160]


for head_dim in head_dims:
    for (sq, sk), (hq, hkv), feature in CASES:
        case = Case(batch=2, seqlen_q=sq, seqlen_k=sk, heads_q=hq, heads_kv=hkv, head_dim=head_dim,
                    dtype=jnp.float32, seed=head_dim + sk)
        q, k, v = case.inputs()
        d_o = jax.random.normal(jax.random.key(case.seed + 99), q.shape, jnp.float32)
        kwargs = feature_kwargs(feature, case)
        gpu = jax.devices("gpu")[0]
        on_gpu = [jax.device_put(x, gpu) for x in (q, k, v, d_o)]
        kwargs_gpu = {n: jax.device_put(a, gpu) if isinstance(a, jax.Array) else a for n, a in kwargs.items()}
        reference = oracle_grads(q, k, v, d_o, **kwargs)
        hopper = gradients("sm90", on_gpu, kwargs_gpu)
        mma_sync = gradients("sm80", on_gpu, kwargs_gpu)
        with jax.default_matmul_precision("tensorfloat32"):
            xla = [np.asarray(g, np.float64) for g in grads(*on_gpu, implementation="xla", **kwargs_gpu)]
        print(f"d={head_dim} {sq}x{sk} heads {hq}/{hkv} {feature}", flush=True)
        if isinstance(hopper, str):
            print(f"  sm90 failed: {hopper}")
        for i, name in enumerate(("dq", "dk", "dv")):
            ref = reference[i]
            scale = max(1.0, float(np.abs(ref).max()))
            e_xla = np.abs(xla[i] - ref).max() / scale
            e_80 = np.abs(mma_sync[i] - ref).max() / scale if not isinstance(mma_sync, str) else float("nan")
            line = f"  {name}: xla {e_xla:.2e} sm80 {e_80:.2e}"
            if not isinstance(hopper, str):
                err = np.abs(hopper[i] - ref) / scale
                err = np.where(np.isnan(err), np.inf, err)
                worst = np.unravel_index(np.argmax(err), err.shape)
                bad = err > 10 * max(e_xla, 1e-4)
                rows = np.unique(np.nonzero(bad)[1]) if bad.any() else []
                line += (f" sm90 {err.max():.2e} at {tuple(int(w) for w in worst)} bad {int(bad.sum())}/{bad.size}"
                         f" nan {int(np.isnan(hopper[i]).sum())} rows {list(rows[:6])}..{list(rows[-3:])}")
            print(line, flush=True)
print("probe done")
