"""Emulates, in numpy on the CPU, the attention forward's and backward's GEMMs with operands split into low-precision
parts, and prints how far each scheme's o / lse and dq / dk / dv land from a float64 reference (max |error| / max
|reference|, the float32 exact mode's 1e-5 criterion). For choosing a scheme before writing its kernel; no GPU.

Schemes (by default each GEMM's products are summed in float64, then rounded to float32: the operands' share of
the error; ``--accumulate`` models the accumulator too, below):
- ``float32``: float32 operands, exact products (the floor every scheme shares: float32 softmax and elementwise steps).
- ``tf32``: every operand rounded to TF32 (10 mantissa bits, round to nearest), one product.
- ``tf32x3``: x = hi + lo with hi = tf32(x), lo = tf32(x - hi); lo*hi + hi*lo + hi*hi (the split-TF32 kernels).
- ``fp16x3``: the same with float16 parts (the same 11 + 11 bits, half the bytes, twice the tensor rate), after
  scaling each operand tensor by a power of two that puts its largest magnitude in [2^13, 2^14): P by 2^14,
  dS by a power of two from its bound max|dS| <= max|dP| + max|D| (a kernel would have to pick dS's scale before
  computing it), and the scales divided out of each GEMM's result.

Accumulation (``--accumulate``):
- ``exact``: as above.
- ``truncate``: the tensor cores' float32 accumulation as Fasi et al. measured it on V100 to A100 ("Numerical
  behavior of NVIDIA tensor cores", 2021): each k-step of 8 products joins the accumulator exactly and the sum is
  rounded toward zero, one WGMMA after another over the whole K, in items of ``--item`` rows of K (each item's
  three part products in turn, as the kernels issue them). The split backward as first written: its 1000-query
  causal gradients fail the 1e-5 bound on the H200 in the pattern this reproduces (NOTES, thirty-sixth session).
- ``per-item``: the same within each item (a fresh accumulator), items added to the total in float32 with
  rounding to nearest (split_tf32_mma.h add_partial_sums).
Both apply to every GEMM here; of the kernels, the split backward's passes and the d=64 split forward sum per item
(the d=128 split forward's P V accumulates over all keys, as in ``truncate``).

Run: python benchmarks/emulate_split_products.py [--seqlen-q 1000 --seqlen-k 1000 --head-dim 128 --causal]
"""

from __future__ import annotations

import argparse

import numpy as np


def round_tf32(x: np.ndarray) -> np.ndarray:
    """float32 -> TF32 by rounding the magnitude half away from zero (cvt.rna.tf32.f32), as float32."""
    bits = np.asarray(x, np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)
    return rounded.view(np.float32)


def round_fp16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)


def parts(x: np.ndarray, rounding) -> tuple[np.ndarray, np.ndarray]:
    x = np.asarray(x, np.float32)
    hi = rounding(x)
    lo = rounding(x - hi)
    return hi, lo


def power_of_two_scale(bound: float) -> float:
    """2^k with bound * 2^k in [2^13, 2^14) (1 for a zero bound)."""
    if bound == 0.0 or not np.isfinite(bound):
        return 1.0
    return float(2.0 ** (13 - np.floor(np.log2(bound))))


def round_toward_zero(x: np.ndarray) -> np.ndarray:
    """float64 -> float32, rounded toward zero."""
    x = np.asarray(x, np.float64)
    f = x.astype(np.float32)
    over = np.abs(f.astype(np.float64)) > np.abs(x)
    f[over] = np.nextafter(f[over], np.float32(0))
    return f


K_STEP = 8  # TF32 products per WGMMA k-step


def accumulate(pairs, mode: str = "exact", item: int = 32) -> np.ndarray:
    """sum of a @ b over the (a, b) part pairs under an accumulation model (module docstring). The tensor-core models
    walk K in items of ``item`` rows, each item's pairs in the order given (a kernel's per-item WGMMAs)."""
    if mode == "exact":
        return sum(a.astype(np.float64) @ b.astype(np.float64) for a, b in pairs).astype(np.float32)
    if mode not in ("truncate", "per-item"):
        raise ValueError(f"unknown accumulation {mode!r}")
    depth = pairs[0][0].shape[1]
    total = np.zeros((pairs[0][0].shape[0], pairs[0][1].shape[1]), np.float32)
    for start in range(0, depth, item):
        stop = min(depth, start + item)
        chain = np.zeros_like(total) if mode == "per-item" else total
        for a, b in pairs:
            for k in range(start, stop, K_STEP):
                end = min(k + K_STEP, stop)
                chain = round_toward_zero(chain.astype(np.float64) + a[:, k:end].astype(np.float64) @ b[k:end])
        total = (total + chain).astype(np.float32) if mode == "per-item" else chain
    return total


def matmul(a: np.ndarray, b: np.ndarray, scheme: str, a_bound: float | None = None,
           b_bound: float | None = None, accumulation: str = "exact", item: int = 32) -> np.ndarray:
    """a @ b under a scheme, rounded to float32. The bounds choose fp16x3's scales (default: the operands' max)."""
    a = np.asarray(a, np.float32)
    b = np.asarray(b, np.float32)
    if scheme == "float32":
        return accumulate([(a, b)], accumulation, item)
    if scheme == "tf32":
        return accumulate([(round_tf32(a), round_tf32(b))], accumulation, item)
    if scheme == "tf32x3":
        (ah, al), (bh, bl) = parts(a, round_tf32), parts(b, round_tf32)
        return accumulate([(al, bh), (ah, bl), (ah, bh)], accumulation, item)
    if scheme == "fp16x3":
        sa = power_of_two_scale(np.abs(a).max() if a_bound is None else a_bound)
        sb = power_of_two_scale(np.abs(b).max() if b_bound is None else b_bound)
        (ah, al), (bh, bl) = parts(a * np.float32(sa), round_fp16), parts(b * np.float32(sb), round_fp16)
        product = accumulate([(al, bh), (ah, bl), (ah, bh)], accumulation, item)
        return (product / np.float32(sa * sb)).astype(np.float32)
    raise ValueError(f"unknown scheme {scheme!r}")


def relative_error(x: np.ndarray, reference: np.ndarray) -> float:
    """max |x - reference| / max |reference|: the measure every printed (and tested) error uses."""
    return float(np.abs(x - reference).max() / np.abs(reference).max())


def _scheme_ops(scheme, accumulation="exact", item=32):
    """(matmul, dtype) of a scheme: ``float64``, the reference, multiplies exactly and keeps its softmax and
    elementwise steps in float64; the others round each GEMM as ``matmul`` does and keep them in float32."""
    if scheme == "float64":
        return (lambda a, b, **_: np.asarray(a, np.float64) @ np.asarray(b, np.float64)), np.float64
    return (lambda a, b, **kw: matmul(a, b, scheme, accumulation=accumulation, item=item, **kw)), np.float32


def _scores(q, k, scale, causal, mm, dtype):
    """scale * q k^T, -inf above the bottom-right causal diagonal."""
    sq, sk = q.shape[0], k.shape[0]
    s = (mm(q, k.T) * dtype(scale)).astype(dtype)
    if causal:
        s = np.where(np.arange(sk)[None, :] <= np.arange(sq)[:, None] + (sk - sq), s, -np.inf)
    return s


def forward(q, k, v, scale, causal, scheme, accumulation="exact", item=32):
    """o, lse of one head under a scheme (float32 softmax; P scaled into float16's range by one constant, 2^14)."""
    mm, dtype = _scheme_ops(scheme, accumulation, item)
    s = _scores(q, k, scale, causal, mm, dtype)
    m = s.max(axis=1, keepdims=True)
    p = np.exp(s - m).astype(dtype)
    row_sum = p.sum(axis=1, keepdims=True)
    o = (mm(p, v, a_bound=1.0) / row_sum).astype(dtype)
    return o, (m + np.log(row_sum)).astype(dtype)


def backward(q, k, v, d_o, scale, causal, scheme, accumulation="exact", item=32):
    """dq, dk, dv of one head under a scheme (float32 softmax and elementwise steps, as the kernels)."""
    mm, dtype = _scheme_ops(scheme, accumulation, item)
    s = _scores(q, k, scale, causal, mm, dtype)
    # o and lse from the float64 forward: the backward's inputs, not what is being measured.
    o, lse = (x.astype(dtype) for x in forward(q, k, v, scale, causal, "float64"))
    p = np.exp(s - lse).astype(dtype)
    dp = mm(d_o, v.T)
    d = (d_o.astype(dtype) * o).sum(axis=1, keepdims=True).astype(dtype)
    ds = (p * (dp - d)).astype(dtype)
    # P lies in [0, 1]; dS is bounded by max|dP| + max|D| (P <= 1).
    ds_bound = float(np.abs(dp).max() + np.abs(d).max())
    dv = mm(p.T, d_o, a_bound=1.0)
    dk = mm(ds.T, q, a_bound=ds_bound) * dtype(scale)
    dq = mm(ds, k, a_bound=ds_bound) * dtype(scale)
    return dq, dk, dv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlen-q", type=int, default=1000)
    parser.add_argument("--seqlen-k", type=int, default=1000)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--input-scale", type=float, default=1.0, help="multiplies q, k, v and dO")
    parser.add_argument("--row-spread", type=float, default=0.0,
                        help="multiplies each row of q, k, v and dO by 10^u, u uniform in [-spread, spread]")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--accumulate", choices=("exact", "truncate", "per-item"), default="exact",
                        help="the accumulator's model (module docstring)")
    parser.add_argument("--item", type=int, default=32,
                        help="rows of K per item (a kernel's per-item WGMMAs) for --accumulate truncate / per-item")
    parser.add_argument("--schemes", nargs="+", default=["float32", "tf32", "tf32x3", "fp16x3"],
                        choices=["float32", "tf32", "tf32x3", "fp16x3"])
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    shape_q, shape_k = (args.seqlen_q, args.head_dim), (args.seqlen_k, args.head_dim)
    q, d_o = (rng.standard_normal(shape_q, dtype=np.float32) * args.input_scale for _ in range(2))
    k, v = (rng.standard_normal(shape_k, dtype=np.float32) * args.input_scale for _ in range(2))
    if args.row_spread:
        q, d_o, k, v = (x * (10.0 ** rng.uniform(-args.row_spread, args.row_spread, (x.shape[0], 1))).astype(np.float32)
                        for x in (q, d_o, k, v))
    scale = 1.0 / np.sqrt(args.head_dim)
    reference = backward(q, k, v, d_o, scale, args.causal, "float64")
    forward_reference = forward(q, k, v, scale, args.causal, "float64")
    print(f"sq={args.seqlen_q} sk={args.seqlen_k} d={args.head_dim} causal={args.causal} "
          f"input scale {args.input_scale:g} row spread {args.row_spread:g} accumulate {args.accumulate}"
          f"{f' (items of {args.item})' if args.accumulate != 'exact' else ''}: max|error| / max|float64| of o, lse"
          " | dq, dk, dv")
    for scheme in args.schemes:
        outputs = forward(q, k, v, scale, args.causal, scheme, args.accumulate, args.item)
        grads = backward(q, k, v, d_o, scale, args.causal, scheme, args.accumulate, args.item)
        errors = [relative_error(g, r) for g, r in zip((*outputs, *grads), (*forward_reference, *reference))]
        print(f"  {scheme:7s} " + "  ".join(f"{e:.2e}" for e in errors[:2]) + " | "
              + "  ".join(f"{e:.2e}" for e in errors[2:]))


if __name__ == "__main__":
    main()
