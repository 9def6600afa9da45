"""The two custom calls, as JAX functions of arrays. Result shapes are declared up front (ShapeDtypeStruct),
so eval_shape, jit and jax.export work without running anything; vmap folds mapped axes into the batch
(``broadcast_all``: the handlers accept any number of leading batch axes)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jax_flash import _gqa_packing, _half_operands, _kv_split, _mask_blocks
from jax_flash._config import DenseOperands, MaskOperands, ScoreConfig, hopper_switch_on, per_platform, switch_on
from jax_flash._registration import BACKWARD_TARGET, FORWARD_TARGET


def _score_attributes(config: ScoreConfig) -> dict[str, object]:
    return dict(
        softmax_scale=np.float32(config.softmax_scale),
        softcap=np.float32(config.softcap),
        causal=bool(config.causal),
        align_to_sequence_end=bool(config.align_to_sequence_end),
        diagonal_offset=np.int64(config.diagonal_offset),
        window_left=np.int64(config.window_left),
        window_right=np.int64(config.window_right),
        dropout_rate=np.float32(config.dropout_rate),
        allow_tf32=bool(config.allow_tf32),
    )


def _forward_attributes(config: ScoreConfig) -> dict[str, object]:
    """The forward call's attributes: the score attributes and how its rows map onto the attention (GQA packing's
    ``packed_heads``, split-KV's ``kv_chunks``)."""
    return dict(_score_attributes(config), packed_heads=np.int64(config.packed_heads),
                kv_chunks=np.int64(config.kv_chunks))


def _result(like: jax.Array, shape: tuple[int, ...], dtype: jnp.dtype,
            dims: tuple[int, ...] | None = None) -> jax.core.ShapedArray:
    """A result type carrying ``like``'s sharding typing, which XLA does not infer for custom calls: the mesh
    axes it varies over inside ``shard_map`` (without them, gradients there fail the custom-VJP type check) and,
    on meshes with explicit axes, its sharding, with result dimension ``i`` sharded like ``like``'s ``dims[i]``.
    """
    aval = jax.typeof(like)
    spec = tuple(aval.sharding.spec) + (None,) * (aval.ndim - len(aval.sharding.spec))
    spec = PartitionSpec(*(spec[d] for d in (dims or range(len(shape)))))
    return aval.update(shape=shape, dtype=dtype, sharding=aval.sharding.update(spec=spec))


_LSE_DIMS = (0, 2, 1)  # lse [B, Hq, Sq] is sharded like q [B, Sq, Hq, D]'s dimensions 0, 2, 1
_DQ_WORKSPACE_DIMS = (0, 2, 3)  # dq_accum [B, Hq, tiles * 64 * D] like q's batch, heads and head dim


def _dense_arguments(dense: DenseOperands) -> tuple[jax.Array, ...]:
    """The dense operands in the targets' order, the mask followed by its block summary (``_mask_blocks``)."""
    return dense.bias, dense.mask, _mask_blocks.block_summary(dense.mask), dense.dropout_seeds


def lse_shape(q: jax.Array) -> tuple[int, ...]:
    """``[B, Hq, Sq]`` for ``q`` of shape ``[B, Sq, Hq, D]``."""
    batch, seqlen_q, heads_q, _ = q.shape
    return (batch, heads_q, seqlen_q)


# The TF32 Hopper forward's kernel head dims (csrc/common/tf32_workspace.h): a call with head_dim <= 128 runs on
# the smallest of them that holds it.
_TF32_HEAD_DIMS = (64, 128)


TF32_FORMS_ENV = "JAX_FLASH_TF32_FORMS"


def _uses_tf32_workspace(q: jax.Array, masks: MaskOperands, config: ScoreConfig, dense: DenseOperands) -> bool:
    """Whether a forward call gets the V^T workspace of the Hopper TF32 forward, which the CUDA handler takes as the
    sign to run that kernel on compute capability 9.x (elsewhere, other GPUs or the CPU, the workspace, as large as
    V, goes unused): float32 with allow_tf32, head_dim <= 128 and a multiple of 4 (TMA rows), no dropout, and the
    kernel's forms: common, softcap / ALiBi (transforms) and bias / boolean mask (dense).
    ``JAX_FLASH_TF32_FORMS=0`` (read when the call is traced) keeps it to the common form, sending the others to
    the mma.sync TF32 kernel (on the H200 5-8x slower at 4k: d=128 softcap 40 against 284 TFLOP/s)."""
    return q.dtype == jnp.float32 and config.allow_tf32 and _fits_hopper_float32_forward(q, masks, config, dense)


def _fits_hopper_float32_forward(q: jax.Array, masks: MaskOperands, config: ScoreConfig,
                                 dense: DenseOperands) -> bool:
    """What the Hopper TF32 and split-TF32 forwards both take: head_dim <= 128 and a multiple of 4 (TMA rows), no
    dropout, and the common form, or unless ``JAX_FLASH_TF32_FORMS=0`` also the transforms and dense forms."""
    if not _fits_hopper_float32_tiles(q, config):
        return False
    return _is_common_form(masks, config, dense) or switch_on(TF32_FORMS_ENV, default=True)


def _fits_hopper_float32_tiles(q: jax.Array, config: ScoreConfig) -> bool:
    """What every Hopper float32 kernel (TF32 and split TF32, forward and backward) needs of a call: head_dim <= 128
    and a multiple of 4 (TMA rows), no dropout."""
    head_dim = q.shape[-1]
    return head_dim <= _TF32_HEAD_DIMS[-1] and head_dim % 4 == 0 and config.dropout_rate == 0


def _is_common_form(masks: MaskOperands, config: ScoreConfig, dense: DenseOperands) -> bool:
    """A call of the Hopper forward's common form: no bias, mask, softcap or ALiBi, a positive scale."""
    return (not dense.has_bias and not dense.has_mask and config.softcap == 0
            and masks.alibi_slopes.shape[-1] == 0 and config.softmax_scale > 0)


SPLIT_TF32_ENV = "JAX_FLASH_SM90_SPLIT_TF32"


def _uses_split_tf32_workspace(q: jax.Array, masks: MaskOperands, config: ScoreConfig,
                               dense: DenseOperands) -> bool:
    """Whether a forward call gets the split-TF32 workspace, which the CUDA handler takes as the sign to run the
    split-TF32 Hopper forward on compute capability 9.x (csrc/common/tf32_workspace.h: each float32 operand as two
    TF32 parts, three TF32 products per product, about float32's accuracy; elsewhere the workspace goes unused):
    float32 with ``float32_precision="highest"``, ``JAX_FLASH_SM90_SPLIT_TF32`` on (read when the call is traced;
    unset: on for CUDA where every GPU is a Hopper, ``_config.per_platform``), head_dim <= 128 and a multiple of 4, no
    dropout; softcap, ALiBi, bias and mask too unless ``JAX_FLASH_TF32_FORMS=0`` (as for the TF32 forward)."""
    return (q.dtype == jnp.float32 and not config.allow_tf32 and hopper_switch_on(SPLIT_TF32_ENV)
            and _fits_hopper_float32_forward(q, masks, config, dense))


SPLIT_TF32_BACKWARD_ENV = "JAX_FLASH_SM90_SPLIT_TF32_BACKWARD"


def _uses_split_tf32_backward_workspace(q: jax.Array, masks: MaskOperands, config: ScoreConfig,
                                        dense: DenseOperands) -> bool:
    """Whether a backward call gets the split-TF32 workspace (in its ``dq_accum`` slot, which float32 calls use for
    nothing else), which the CUDA handler takes as the sign to run the Hopper TF32 backward passes in split TF32 on
    compute capability 9.x (csrc/cuda/sm90/split_tf32_backward_launch.h; elsewhere it goes unused): float32 with
    ``float32_precision="highest"``, ``JAX_FLASH_SM90_SPLIT_TF32_BACKWARD`` on (read when the backward is traced;
    unset: on for CUDA where every GPU is a Hopper), head_dim <= 128 and a multiple of 4, and the common form those
    passes have (no bias, mask, dropout, softcap or ALiBi, a positive scale)."""
    return (q.dtype == jnp.float32 and not config.allow_tf32
            and hopper_switch_on(SPLIT_TF32_BACKWARD_ENV)
            and _fits_hopper_float32_tiles(q, config) and _is_common_form(masks, config, dense))


FLOAT16_PARTS_BACKWARD_ENV = "JAX_FLASH_SM90_HIGHEST_BACKWARD_FP16"

# The float16-parts backward's kernel head dim (csrc/cuda/generate_instantiations.py SM90_FLOAT16_PARTS_HEAD_DIMS).
# Calls up to head_dim 64 keep split TF32 (1.1-2.2x XLA's "highest" there on the H200, 1.3x on an H100), rather than
# running half-empty tiles.
_FLOAT16_PARTS_HEAD_DIM = 128
_FLOAT16_PARTS_MIN_HEAD_DIM = 72


def _uses_float16_parts_backward(q: jax.Array, k: jax.Array, masks: MaskOperands, config: ScoreConfig,
                                 dense: DenseOperands) -> bool:
    """Whether a float32 backward with ``float32_precision="highest"`` runs on float16 hi and lo parts of operands
    scaled by powers of two (``_half_operands``; csrc/cuda/sm90/float16_parts_backward_launch.h: the 16-bit Hopper
    backward with three products per product, about float32's accuracy): ``JAX_FLASH_SM90_HIGHEST_BACKWARD_FP16`` on
    (read when the backward is traced; unset: on for CUDA where every GPU is a Hopper; it comes before split TF32),
    head_dim a multiple of 8 from 72 to 128, the common form (no bias, mask, dropout, softcap or ALiBi, a positive
    scale), non-empty sequences. The call then carries the float16-parts workspace in its ``dq_accum`` slot, which the
    CUDA handler takes as the sign to run those kernels on compute capability 9.x (elsewhere the exact kernels run the
    same scaled operands); on the CPU the reference handler does."""
    head_dim = q.shape[-1]
    return (q.dtype == jnp.float32 and not config.allow_tf32
            and hopper_switch_on(FLOAT16_PARTS_BACKWARD_ENV)
            and _FLOAT16_PARTS_MIN_HEAD_DIM <= head_dim <= _FLOAT16_PARTS_HEAD_DIM and head_dim % 8 == 0
            and config.dropout_rate == 0 and _is_common_form(masks, config, dense)
            and q.shape[-3] > 0 and k.shape[-3] > 0)


def backward_parts_workspace_shape(q: jax.Array, k: jax.Array) -> tuple[int, int, int]:
    """``[B, Hkv, per_head]`` (float32 for split TF32, float16 for float16 parts) holding Q's, dO's, K's and V's hi
    and lo parts (csrc/common/tf32_workspace.h backward_parts_per_head): per (batch row, KV head) four times its
    query heads' ``G * Sq * D`` and its own ``Sk * D``."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    _, seqlen_k, heads_kv, _ = k.shape
    group = heads_q // heads_kv
    return (batch, heads_kv, 4 * (group * seqlen_q * head_dim + seqlen_k * head_dim))


def split_tf32_workspace_shape(q: jax.Array, k: jax.Array) -> tuple[int, int, int]:
    """``[B, Hkv, per_head]`` float32 holding V^T's, Q's and K's hi and lo parts (csrc/common/tf32_workspace.h
    split_tf32_per_head): per (batch row, KV head) twice V^T's ``D' * Sk'`` floats, its query heads' ``G * Sq * D``
    and its own ``Sk * D``."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    _, _, vt_per_head = tf32_workspace_shape(q, k)
    _, seqlen_k, heads_kv, _ = k.shape
    group = heads_q // heads_kv
    return (batch, heads_kv, 2 * (vt_per_head + group * seqlen_q * head_dim + seqlen_k * head_dim))


def tf32_workspace_shape(q: jax.Array, k: jax.Array) -> tuple[int, int, int]:
    """``[B, Hkv, D' * Sk']`` float32: V^T with the head dim D' of the kernel (64 or 128) and Sk' = seqlen_k in whole
    8-key chunks (csrc/common/tf32_workspace.h)."""
    batch, seqlen_k, heads_kv, head_dim = k.shape
    kernel_head_dim = next(d for d in _TF32_HEAD_DIMS if d >= head_dim)
    return (batch, heads_kv, kernel_head_dim * (-(-seqlen_k // 8) * 8))


def _forward_call(q: jax.Array, k: jax.Array, v: jax.Array, masks: MaskOperands, config: ScoreConfig,
                  dense: DenseOperands) -> tuple[jax.Array, jax.Array]:
    workspace: jax.ShapeDtypeStruct | jax.core.ShapedArray
    if _uses_tf32_workspace(q, masks, config, dense):
        workspace = _result(k, tf32_workspace_shape(q, k), jnp.float32, dims=(0, 2, 3))
    elif _uses_split_tf32_workspace(q, masks, config, dense):
        workspace = _result(k, split_tf32_workspace_shape(q, k), jnp.float32, dims=(0, 2, 3))
    else:
        workspace = jax.ShapeDtypeStruct((0,), jnp.float32)
    results = (_result(q, q.shape, q.dtype), _result(q, lse_shape(q), jnp.float32, dims=_LSE_DIMS), workspace)
    call = jax.ffi.ffi_call(FORWARD_TARGET, results, vmap_method="broadcast_all")
    o, lse, _ = call(q, k, v, *masks, *_dense_arguments(dense), **_forward_attributes(config))
    return o, lse


def forward(q: jax.Array, k: jax.Array, v: jax.Array, masks: MaskOperands, config: ScoreConfig,
            dense: DenseOperands | None = None) -> tuple[jax.Array, jax.Array]:
    """Runs the forward kernel. Returns ``(o [B, Sq, Hq, D], lse [B, Hq, Sq] float32)``. Short GQA calls run
    with the query heads of each KV head packed into the query rows (``_gqa_packing``); calls with few query tiles
    against many keys run their keys in chunks, merged by lse (``_kv_split``). A float32 call is traced per platform
    (``per_platform``: the Hopper paths are for CUDA only)."""
    dense = DenseOperands.absent(q.shape[0]) if dense is None else dense

    def trace() -> tuple[jax.Array, jax.Array]:
        return _forward_calls(q, k, v, masks, config, dense)
    return per_platform(trace, HOPPER_PATH_SWITCHES) if q.dtype == jnp.float32 else trace()


def _forward_calls(q: jax.Array, k: jax.Array, v: jax.Array, masks: MaskOperands, config: ScoreConfig,
                   dense: DenseOperands) -> tuple[jax.Array, jax.Array]:
    """``forward``'s custom calls, routed by the switches as they stand in this trace."""
    group = _gqa_packing.group_to_pack(q, k, masks, config, dense)
    if group > 1:
        q, masks, config = _gqa_packing.pack(q, masks, config, group)
    splits = _kv_split.splits_for(q, k, masks, config, dense)
    if splits > 1:
        o, lse = _kv_split.split_forward(_forward_call, q, k, v, masks, config, dense, splits)
    else:
        o, lse = _forward_call(q, k, v, masks, config, dense)
    return _gqa_packing.unpack(o, lse, group) if group > 1 else (o, lse)


FUSED_DQ_ENV = "JAX_FLASH_FUSED_DQ"


def fused_dq_requested() -> bool:
    """Whether the backward may sum dQ inside its dK/dV pass (float32 reductions into a workspace, see
    ``dq_workspace_shape``) instead of a separate dQ pass that recomputes S and dP. ``JAX_FLASH_FUSED_DQ`` (read
    when a backward is traced): unset or ``1`` (the default: measured faster on the H200 for both kernel families,
    benchmarks/NOTES.md), ``0`` for the separate pass.
    """
    return switch_on(FUSED_DQ_ENV)


# The one switch for fused dQ at head_dim 64: 64 fuses it. The Hopper one-reduction-per-item form measured at
# least as fast as the separate dQ pass at d=64 through JAX (sixth session, seqlen 1k/4k/16k: non-causal 266/362/395
# against 251/362/386 TFLOP/s, causal 157/290/376 against 147/270/345); 65 would keep d=64 on the separate pass.
# sm80 fuses d=64 too (not measured there).
_FUSED_DQ_MIN_HEAD_DIM = 64

# Query rows of one tile of the dq_accum workspace: csrc/common/dq_workspace.h kDqWorkspaceTileRows.
_DQ_WORKSPACE_TILE_ROWS = 64


def _uses_fused_dq(q: jax.Array, masks: MaskOperands, config: ScoreConfig, dense: DenseOperands) -> bool:
    """Whether a backward call gets the dq_accum workspace: only where the kernels can use it, i.e. a call without
    bias or dropout (the sm80 general variant forms dbias in its dQ pass; the Hopper backward runs neither),
    non-deterministic (the order of float adds is not reproducible), half precision (float32 has its own kernels),
    with _FUSED_DQ_MIN_HEAD_DIM <= head_dim <= 128: where it measured faster (d=64 and d=128). sm80's d=256
    gained nothing (164 vs 162 TFLOP/s) and the Hopper backward has no d=256 fused form, so wider head dims keep the
    separate pass and get no workspace. Softcap, ALiBi and boolean-mask calls get it: the Hopper backward's
    transforms and masked forms fuse dQ like its common form (csrc/cuda/sm90/backward_form.h); where they run the
    sm80 backward (its general variant, which keeps the dQ pass) the workspace goes unused."""
    unfusable = config.dropout_rate > 0 or dense.has_bias
    return (fused_dq_requested() and not config.deterministic and q.dtype != jnp.float32 and not unfusable
            and _FUSED_DQ_MIN_HEAD_DIM <= q.shape[-1] <= 128)


def dq_workspace_shape(q: jax.Array) -> tuple[int, int, int]:
    """``[B, Hq, ceil(Sq / 64) * 64 * D]`` float32 for ``q`` of shape ``[B, Sq, Hq, D]``: the dq_accum workspace
    (csrc/common/dq_workspace.h). The kernels lay it out tile-major, whole 64-row query tiles in an order of their
    own inside each tile, so only its size matters here."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    tiles = -(-seqlen_q // _DQ_WORKSPACE_TILE_ROWS)
    return (batch, heads_q, tiles * _DQ_WORKSPACE_TILE_ROWS * head_dim)


# csrc/common/dq_workspace.h kDkdvTailMaxSlots, kDkdvTailSlotFloats and the 128-key blocks they count.
_DKDV_TAIL_MAX_SLOTS = 256
_DKDV_TAIL_SLOT_FLOATS = 2 * 128 * 128
_DKDV_TAIL_BLOCK_KEYS = 128


def _uses_dkdv_tail(masks: MaskOperands, config: ScoreConfig, dense: DenseOperands) -> bool:
    """Whether a fused-dQ backward also gets the ``dkdv_tail`` workspace: only the calls whose last wave the sm80
    fused pass can split, i.e. its common variant (no softcap, ALiBi or boolean mask: those run its general variant,
    csrc/cuda/sm80/score_tile.h ``needs_general_variant``) where every key block sees the same query tiles (no
    causal, window or sequence lengths: csrc/cuda/sm80/backward_launch.h ``key_blocks_see_every_query_tile``); the
    others would leave it unused."""
    return (not config.causal and config.window_left < 0 and config.window_right < 0 and config.softcap == 0
            and masks.alibi_slopes.shape[-1] == 0 and not dense.has_mask
            and masks.q_seqlens.shape[-1] == 0 and masks.kv_seqlens.shape[-1] == 0)


def dkdv_tail_shape(k: jax.Array) -> tuple[int]:
    """``[floats]`` float32, declared beside ``dq_accum``: slots of float32 dK and dV for the key blocks of the
    last wave that the sm80 fused dK/dV pass splits across SMs (csrc/cuda/sm80/dkdv_tail_plan.h), at most
    256 slots of 128 KiB (csrc/common/dq_workspace.h ``dkdv_tail_elements``). Adding this result changed the
    backward call's signature: modules serialised with ``jax.export`` before it must be exported again."""
    batch, seqlen_k, heads_kv, _ = k.shape
    blocks = batch * heads_kv * -(-seqlen_k // _DKDV_TAIL_BLOCK_KEYS)
    return (min(blocks, _DKDV_TAIL_MAX_SLOTS) * _DKDV_TAIL_SLOT_FLOATS,)


HALF_OPERANDS_BACKWARD_ENV = "JAX_FLASH_SM90_TF32_BACKWARD_FP16"
# The switches whose unset default is on for CUDA where every GPU is a Hopper (hopper_switch_on, per_platform).
HOPPER_PATH_SWITCHES = (SPLIT_TF32_ENV, SPLIT_TF32_BACKWARD_ENV, FLOAT16_PARTS_BACKWARD_ENV, HALF_OPERANDS_BACKWARD_ENV)

# The 16-bit Hopper backward's head dims (csrc/cuda/generate_instantiations.py SM90_BACKWARD_HEAD_DIMS, all built with
# float32 gradients): a call runs on the smallest that holds it; softcap, ALiBi and masks only up to 128
# (csrc/cuda/sm90/backward_form.h has_transforms_form).
_HALF_OPERANDS_MAX_HEAD_DIM = 256
_HALF_OPERANDS_MAX_FORMS_HEAD_DIM = 128


def _uses_half_operands_backward(q: jax.Array, k: jax.Array, masks: MaskOperands, config: ScoreConfig,
                                 dense: DenseOperands) -> bool:
    """Whether a float32 backward in the TF32 mode runs on float16 operands scaled by powers of two (``_half_operands``:
    TF32's significant bits at the 16-bit tensor cores' rate, float32 gradients): ``JAX_FLASH_SM90_TF32_BACKWARD_FP16``
    on (read when the backward is traced; unset: on for CUDA where every GPU is a Hopper, since elsewhere no kernel
    takes such a call), and what the 16-bit Hopper backward takes (csrc/cuda/dispatch.cu sm90_backward_refusal):
    head_dim a multiple of 8 up to 256, no bias or dropout, a positive scale, non-empty sequences; softcap, ALiBi and
    boolean masks up to head_dim 128, within those forms' 32-bit offsets (ALiBi distances below 2^30, mask strides below
    2^23). Deterministic calls and JAX_FLASH_FUSED_DQ=0 take its separate dQ pass. On the GPU those kernels need compute
    capability 9.x (elsewhere the call fails with the handler's error); on the CPU the reference handler runs the same
    scaled float16 operands."""
    head_dim = q.shape[-1]
    seqlen_q, seqlen_k = q.shape[-3], k.shape[-3]
    has_alibi = masks.alibi_slopes.shape[-1] > 0
    per_element = has_alibi or dense.has_mask or config.softcap != 0
    alibi_fits = not has_alibi or abs(config.diagonal_offset) + 2 * (seqlen_q + seqlen_k) < 2 ** 30
    mask_fits = not dense.has_mask or seqlen_k + 1 < 2 ** 23  # query stride + key stride at most
    return (q.dtype == jnp.float32 and config.allow_tf32 and hopper_switch_on(HALF_OPERANDS_BACKWARD_ENV)
            and head_dim % 8 == 0 and head_dim <= _HALF_OPERANDS_MAX_HEAD_DIM
            and (not per_element or head_dim <= _HALF_OPERANDS_MAX_FORMS_HEAD_DIM)
            and config.dropout_rate == 0 and not dense.has_bias and config.softmax_scale > 0
            and seqlen_q > 0 and seqlen_k > 0  # TMA descriptors need data
            and alibi_fits and mask_fits)


def backward(q: jax.Array, k: jax.Array, v: jax.Array, o: jax.Array, lse: jax.Array, d_o: jax.Array,
             d_lse: jax.Array, masks: MaskOperands, config: ScoreConfig, dense: DenseOperands | None = None,
             want_dbias: bool = False) -> tuple[jax.Array, ...]:
    """Runs the backward kernels. Returns ``(dq, dk, dv)`` shaped like ``(q, k, v)``, and ``dbias`` (float32,
    shaped like the bias, summed over its broadcast axes) after them when ``want_dbias``.

    Three extra results are workspaces the kernels need; XLA allocates them, so their memory lives as long as the
    queued kernels: ``rowsum(dO * O) - dlse`` (float32, one per query row), ``dq_accum``, in which the
    backward sums dQ over key tiles inside its dK/dV pass (see ``fused_dq_requested``), and with it
    ``dkdv_tail`` (``dkdv_tail_shape``); empty placeholders otherwise. On a float32 call ``dq_accum`` is instead
    a parts workspace: split TF32's where ``_uses_split_tf32_backward_workspace``, float16 parts' (of operands
    scaled by ``_half_operands``) where ``_uses_float16_parts_backward``. Float32 calls in the TF32 mode may run on
    scaled float16 operands instead (``_uses_half_operands_backward``). A float32 call is traced per platform
    (``per_platform``: those paths are for CUDA only).
    """
    dense = DenseOperands.absent(q.shape[0]) if dense is None else dense

    def trace() -> tuple[jax.Array, ...]:
        return _backward_calls(q, k, v, o, lse, d_o, d_lse, masks, config, dense, want_dbias)
    return per_platform(trace, HOPPER_PATH_SWITCHES) if q.dtype == jnp.float32 else trace()


def _backward_calls(q: jax.Array, k: jax.Array, v: jax.Array, o: jax.Array, lse: jax.Array, d_o: jax.Array,
                    d_lse: jax.Array, masks: MaskOperands, config: ScoreConfig, dense: DenseOperands,
                    want_dbias: bool) -> tuple[jax.Array, ...]:
    """``backward``'s custom calls, routed by the switches as they stand in this trace."""
    def scaled_backward(scheme: _half_operands.Scheme) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The backward on operands scaled for ``scheme``, whose call takes the scheme's softmax scale."""
        scaled_config = dataclasses.replace(config, softmax_scale=scheme.softmax_scale(config.softmax_scale))

        def float32_gradients(q_: jax.Array, k_: jax.Array, v_: jax.Array, o_: jax.Array, lse_: jax.Array,
                              d_o_: jax.Array, d_lse_: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
            dq, dk, dv, _ = _backward_call(q_, k_, v_, o_, lse_, d_o_, d_lse_, masks, scaled_config, dense, False,
                                           jnp.dtype(jnp.float32))
            return dq, dk, dv
        return _half_operands.backward(float32_gradients, q, k, v, o, lse, d_o, d_lse, scheme)

    # Neither scaled route takes a bias, so neither wants dbias.
    if _uses_half_operands_backward(q, k, masks, config, dense):
        return scaled_backward(_half_operands.FLOAT16_OPERANDS)
    if _uses_float16_parts_backward(q, k, masks, config, dense):
        return scaled_backward(_half_operands.FLOAT16_PARTS)
    dq, dk, dv, dbias = _backward_call(q, k, v, o, lse, d_o, d_lse, masks, config, dense, want_dbias,
                                       jnp.dtype(q.dtype))
    return (dq, dk, dv, dbias) if want_dbias else (dq, dk, dv)


def _backward_call(q: jax.Array, k: jax.Array, v: jax.Array, o: jax.Array, lse: jax.Array, d_o: jax.Array,
                   d_lse: jax.Array, masks: MaskOperands, config: ScoreConfig, dense: DenseOperands,
                   want_dbias: bool, gradient_dtype: np.dtype) -> tuple[jax.Array, ...]:
    """The backward custom call: ``(dq, dk, dv, dbias)``, the gradients of ``gradient_dtype`` (q's, or float32
    for float16 operands), dbias a placeholder unless ``want_dbias``."""
    dbias_shape = dense.bias.shape if want_dbias else (1, 1, 1, 0)
    fused_dq = _uses_fused_dq(q, masks, config, dense)
    dq_accum: jax.ShapeDtypeStruct | jax.core.ShapedArray
    if fused_dq:
        dq_accum = _result(q, dq_workspace_shape(q), jnp.float32, dims=_DQ_WORKSPACE_DIMS)
    elif _uses_float16_parts_backward(q, k, masks, config, dense):
        dq_accum = _result(k, backward_parts_workspace_shape(q, k), jnp.float16, dims=(0, 2, 3))
    elif _uses_split_tf32_backward_workspace(q, masks, config, dense):
        dq_accum = _result(k, backward_parts_workspace_shape(q, k), jnp.float32, dims=(0, 2, 3))
    else:
        dq_accum = jax.ShapeDtypeStruct((0,), jnp.float32)
    results = (
        _result(q, q.shape, gradient_dtype),
        _result(k, k.shape, gradient_dtype),
        _result(v, v.shape, gradient_dtype),
        _result(q, lse_shape(q), jnp.float32, dims=_LSE_DIMS),
        dq_accum,
        # Sharded like k's head dim, which no mesh axis splits: every device gets whole slots.
        (_result(k, dkdv_tail_shape(k), jnp.float32, dims=(3,)) if fused_dq and _uses_dkdv_tail(masks, config, dense)
         else jax.ShapeDtypeStruct((0,), jnp.float32)),
        jax.ShapeDtypeStruct(dbias_shape, jnp.float32),
    )
    call = jax.ffi.ffi_call(BACKWARD_TARGET, results, vmap_method="broadcast_all")
    dq, dk, dv, _, _, _, dbias = call(q, k, v, o, lse, d_o.astype(q.dtype), d_lse.astype(jnp.float32), *masks,
                                      *_dense_arguments(dense), **_score_attributes(config),
                                      deterministic=bool(config.deterministic))
    return dq, dk, dv, dbias
