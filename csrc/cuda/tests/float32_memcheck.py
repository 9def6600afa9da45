"""Small float32 grid for compute-sanitizer: forward and backward of both float32 modes on odd shapes (partial
tiles, head dims that are not multiples of 4 or 8, GQA/MQA, masks). Run as
  XLA_FLAGS=--xla_gpu_enable_command_buffer= compute-sanitizer --tool memcheck --target-processes application-only \
    python3 float32_memcheck.py
(or --tool racecheck: device_run.sh's f32_memcheck and f32_racecheck stages). On a Hopper GPU the float32 paths'
defaults apply (jax_flash/_config.py gpus_are_hopper): the "highest" forwards of the common-form cases run the
split-TF32 kernel, their backwards the float16-parts passes at head dims 72..128 (multiples of 8: d=128 segments,
300 x 777 and the causal 104) and the split-TF32 passes below; the "tf32" backwards at head dims 64..128 (multiples of
8) run on scaled float16 operands (the 16-bit Hopper backward's float32-gradient forms). Set
JAX_FLASH_SM90_SPLIT_TF32, _SPLIT_TF32_BACKWARD, _HIGHEST_BACKWARD_FP16 and _TF32_BACKWARD_FP16 to 0 for the exact
SIMT and TF32 kernels instead.
Prints one line per case; finite outputs are checked so that a silent failure still shows. Arguments, if any, are
the indices of the runs to make (0 .. 2 * len(CASES) - 1, in the order below; `--count` prints how many there are):
device_run.sh's F32_CASES, and its F32_EACH=1 runs each index under its own sanitizer process, so that a crash in one
(s41: the sanitized process ended on SIGSEGV mid-grid) names its case and spares the rest."""
import itertools
import sys

import jax.numpy as jnp

from sanitizer_case import run_case

CASES = [  # batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, kwargs
    (1, 1, 1, 1, 1, 7, {}),
    (2, 17, 65, 4, 2, 40, {"causal": True}),
    (1, 70, 33, 4, 1, 100, {"window_size": (5, 3), "softcap": 2.0}),
    (2, 129, 130, 2, 2, 64, {"q_seqlens": jnp.array([100, 3], jnp.int32), "kv_seqlens": jnp.array([7, 130], jnp.int32),
                             "alibi_slopes": jnp.array([0.1, 0.2], jnp.float32)}),
    (1, 40, 40, 2, 2, 128, {"q_segment_ids": jnp.repeat(jnp.arange(4, dtype=jnp.int32), 10)[None],
                            "kv_segment_ids": jnp.repeat(jnp.arange(4, dtype=jnp.int32), 10)[None]}),
    # Many key tiles per row block, both consumer warpgroups of the Hopper TF32 backward busy: where its dQ pass
    # once released a K stage before its loads had landed (thirteenth session).
    (1, 300, 777, 2, 2, 128, {}),
    (1, 200, 600, 4, 2, 64, {"causal": True}),
    (2, 70, 90, 4, 2, 104, {"causal": True}),  # the float16-parts passes' zero-padded head dim, GQA, partial tiles
]

RUNS = list(itertools.product(CASES, ("highest", "tf32")))

if __name__ == "__main__":
    if sys.argv[1:] == ["--count"]:
        print(len(RUNS))
        sys.exit(0)
    for index in [int(arg) for arg in sys.argv[1:]] or range(len(RUNS)):
        (b, sq, sk, hq, hkv, d, kwargs), mode = RUNS[index]
        print(f"run {index}:", end=" ", flush=True)  # before the run: a crash inside it still names it
        run_case(mode, b, sq, sk, hq, hkv, d, jnp.float32, float32_precision=mode, **kwargs)
    print("float32 memcheck grid done")
