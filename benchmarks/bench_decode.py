"""Decoding-shaped attention (one query row per sequence, GQA) on the GPU: jax_flash as it runs by default (GQA
packing and the split-KV forward where they apply), without the split (JAX_FLASH_SPLIT_KV=0, jax_flash/_kv_split.py),
without either (JAX_FLASH_PACK_GQA=0 too, jax_flash/_gqa_packing.py) and with a Flax-style key mask (converted to kv
lengths and segment ids, jax_flash/_key_masks.py, as kv lengths plus the mask, or kept dense), against jax.nn.dot_product_attention (cuDNN, XLA).

Shapes: bf16, batch 8, seqlen_q 1, heads_q 32, heads_kv 32 / 8 / 4 / 1 (G = 1 / 4 / 8 / 32), head_dim 128, seqlen_k
1k..64k, not causal: the one new query sees every cached key (jax.nn's is_causal aligns the diagonal top-left, so
it would hide all but the first key; jax_flash's bottom-right causal would be the same as none here).
``--seqlen-q n`` (n > 1): speculative decoding, n new queries against the cache, causal aligned bottom-right (query
i sees keys up to seqlen_k - n + i): jax_flash's ``causal=True``; jax.nn gets that mask as a boolean ``mask``.
Decoding is memory-bound, so besides the time each row reports the rate at which K and V are read
(bytes of K and V / time, GB/s): the number to compare with the HBM bandwidth (~4.8 TB/s on an H200).
Times: wall clock over `--reps` jitted forward calls after warm-up, median of 3 trials (bench_attention.py).

Run:  python benchmarks/bench_decode.py [--seqlens 1024 4096 16384 65536] [--heads-kv 8 4 1] [--tag TAG]
Writes benchmarks/results/decode_<gpu>_<date>[_<tag>].json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

import bench_attention

# jax_flash variants: (JAX_FLASH_PACK_GQA, JAX_FLASH_SPLIT_KV) while they trace.
JAX_FLASH_SWITCHES = {"jax_flash": ("", ""), "jax_flash_unsplit": ("", "0"), "jax_flash_unpacked": ("0", "0")}
# Flax-style decoding: a [B, 1, 1, Sk] cache mask built at run time from the lengths (here every key), as kv lengths
# and segment ids (the default, jax_flash/_key_masks.py), as kv lengths plus the mask, packed and split with it
# (JAX_FLASH_KEY_MASK_FORM=dense), or kept dense (JAX_FLASH_KEY_MASKS=0): (JAX_FLASH_KEY_MASKS,
# JAX_FLASH_KEY_MASK_FORM) while they trace.
KEY_MASK_SWITCHES = {"jax_flash_keymask": ("", ""), "jax_flash_keymask_denseform": ("", "dense"),
                     "jax_flash_keymask_dense": ("0", "")}
IMPLEMENTATIONS = (*JAX_FLASH_SWITCHES, *KEY_MASK_SWITCHES, "cudnn", "xla")
BATCH, HEADS_Q, HEAD_DIM = 8, 32, 128


def decode_fn(implementation: str, causal: bool = False):
    """A fresh jitted function of (q, k, v, lengths): the switches are read while it traces. ``causal``: the new
    queries are the last rows of the sequence (bottom-right causal)."""
    import functools

    import jax
    import jax.numpy as jnp

    import jax_flash

    attention = functools.partial(jax_flash.attention, causal=causal)

    for variable in ("JAX_FLASH_PACK_GQA", "JAX_FLASH_SPLIT_KV", "JAX_FLASH_KEY_MASKS", "JAX_FLASH_KEY_MASK_FORM"):
        os.environ[variable] = ""
    if implementation.startswith("jax_flash_split"):  # a forced number of key chunks (--splits)
        os.environ["JAX_FLASH_SPLIT_KV"] = implementation[len("jax_flash_split"):]
        return jax.jit(lambda q, k, v, lengths: attention(q, k, v))
    if implementation in JAX_FLASH_SWITCHES:
        os.environ["JAX_FLASH_PACK_GQA"], os.environ["JAX_FLASH_SPLIT_KV"] = JAX_FLASH_SWITCHES[implementation]
        return jax.jit(lambda q, k, v, lengths: attention(q, k, v))
    if implementation in KEY_MASK_SWITCHES:
        os.environ["JAX_FLASH_KEY_MASKS"], os.environ["JAX_FLASH_KEY_MASK_FORM"] = KEY_MASK_SWITCHES[implementation]

        def masked(q, k, v, lengths):
            mask = (jnp.arange(k.shape[1])[None, :] < lengths[:, None])[:, None, None, :]
            return attention(q, k, v, mask=mask)

        return jax.jit(masked)

    def jax_nn(q, k, v, lengths):
        seqlen_q, seqlen_k = q.shape[1], k.shape[1]
        mask = None
        if causal:
            mask = (jnp.arange(seqlen_k)[None, :] <= jnp.arange(seqlen_q)[:, None] + seqlen_k - seqlen_q)[None, None]
        return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation=implementation)

    return jax.jit(jax_nn)


def measure(implementation: str, heads_kv: int, seqlen_k: int, reps: int, seqlen_q: int = 1) -> dict:
    import jax
    import jax.numpy as jnp

    kq, kk, kv = jax.random.split(jax.random.key(seqlen_k + heads_kv), 3)
    q = jax.random.normal(kq, (BATCH, seqlen_q, HEADS_Q, HEAD_DIM), jnp.bfloat16)
    k = jax.random.normal(kk, (BATCH, seqlen_k, heads_kv, HEAD_DIM), jnp.bfloat16)
    v = jax.random.normal(kv, (BATCH, seqlen_k, heads_kv, HEAD_DIM), jnp.bfloat16)
    causal = seqlen_q > 1
    row = {"impl": implementation, "batch": BATCH, "seqlen_q": seqlen_q, "seqlen_k": seqlen_k, "heads_q": HEADS_Q,
           "heads_kv": heads_kv, "head_dim": HEAD_DIM, "causal": causal}
    try:
        fn = decode_fn(implementation, causal)
        # compiled now, under this implementation's switches; the timed calls reuse the executable
        lengths = jnp.full((BATCH,), seqlen_k, jnp.int32)
        jax.block_until_ready(fn(q, k, v, lengths))
        seconds = bench_attention.median_seconds(fn, (q, k, v, lengths), reps)
    except Exception as error:  # noqa: BLE001 - a backend that refuses the shape is a result, not a crash
        row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
        return row
    kv_bytes = 2 * k.size * k.dtype.itemsize
    row.update(us=seconds * 1e6, kv_read_gbps=kv_bytes / seconds / 1e9)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384, 65536])
    parser.add_argument("--heads-kv", type=int, nargs="+", default=[32, 8, 4, 1])
    parser.add_argument("--impls", nargs="+", default=list(IMPLEMENTATIONS), choices=IMPLEMENTATIONS)
    parser.add_argument("--splits", type=int, nargs="*", default=[],
                        help="also time jax_flash with JAX_FLASH_SPLIT_KV forced to each of these (rows "
                             "jax_flash_split<n>; a count that does not divide seqlen_k runs unsplit)")
    parser.add_argument("--seqlen-q", type=int, default=1,
                        help="new queries per sequence; above 1 the calls are causal (speculative decoding)")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--tag", default="")
    parser.add_argument("--out-dir", default=bench_attention.RESULTS_DIR)
    args = parser.parse_args()

    import jax

    gpu = jax.devices()[0].device_kind
    date = datetime.date.today().isoformat()
    path = os.path.join(args.out_dir, f"decode_{gpu.replace(' ', '_')}_{date}" + (f"_{args.tag}" if args.tag else "")
                        + ".json")
    rows = []
    for heads_kv in args.heads_kv:
        for seqlen_k in args.seqlens:
            times = {}
            for implementation in [*args.impls, *(f"jax_flash_split{n}" for n in args.splits)]:
                row = measure(implementation, heads_kv, seqlen_k, args.reps, args.seqlen_q)
                rows.append(row)
                times[implementation] = row.get("us")
                shown = (f"{row['us']:8.1f} us {row['kv_read_gbps']:7.0f} GB/s" if "us" in row
                         else row["error"])
                print(f"G={HEADS_Q // heads_kv:2d} seqlen_k={seqlen_k:6d} {implementation:20s} {shown}", flush=True)
            if times.get("cudnn"):
                for implementation, us in times.items():
                    if us and implementation != "cudnn":
                        print(f"  {implementation:20s} time / cuDNN's: {us / times['cudnn']:.2f}")
            os.makedirs(args.out_dir, exist_ok=True)
            with open(path, "w") as f:  # after every shape, so that a run cut short still leaves its results
                json.dump({"gpu": gpu, "date": date, "versions": bench_attention.versions(), "rows": rows}, f,
                          indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
