"""Static (hashable) description of a call: everything the kernels take as attributes."""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import os
from collections.abc import Callable
from typing import NamedTuple, TypeVar

import jax
import jax.numpy as jnp


# Query rows of the Hopper forward's standard tile (sm80's 64 divides it): what GQA packing, the split-KV forward and
# the key-mask conversion count a call's query tiles in.
TILE_ROWS = 128


def switch_on(variable: str, default: bool = True) -> bool:
    """An on/off environment switch, read when a call is traced: ``1`` is on, ``0`` off, unset or empty
    ``default``."""
    value = os.environ.get(variable, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{variable} must be 0 or 1, not {value!r}")
    return default if value == "" else value == "1"


@functools.cache
def gpus_are_hopper() -> bool:
    """Whether this process has GPUs and all of them are of compute capability 9.x: where the Hopper float32 paths'
    switches (``_ffi_calls``) default to on, for the calls lowered for CUDA (``per_platform``). On other GPUs their
    workspaces and operand scaling would be work for nothing, and the TF32 mode's backward on float16 operands has no
    kernel there."""
    try:
        devices = jax.devices("gpu")
    except RuntimeError:  # no GPU backend in this process
        return False
    return bool(devices) and all(str(getattr(d, "compute_capability", "")).startswith("9") for d in devices)


# The default of the Hopper paths' unset switches inside a ``per_platform`` branch; None outside one.
_hopper_paths_default: contextvars.ContextVar[bool | None] = contextvars.ContextVar("jax_flash_hopper_paths_default",
                                                                                    default=None)


def hopper_switch_on(variable: str) -> bool:
    """``switch_on(variable)``, where unset on in a call lowered for CUDA in a process whose GPUs are all Hoppers and
    off elsewhere (``per_platform`` tells a call's platform; outside it, ``gpus_are_hopper`` alone decides)."""
    if os.environ.get(variable, ""):
        return switch_on(variable)
    default = _hopper_paths_default.get()
    return gpus_are_hopper() if default is None else default


_T = TypeVar("_T")


def per_platform(trace: Callable[[], _T], switches: tuple[str, ...]) -> _T:
    """``trace()`` (the custom calls of one float32 call) traced twice, once for CUDA with the unset ``switches``
    (``hopper_switch_on``) on and once for every other platform with them off: a call that runs on the CPU of a
    machine with Hopper GPUs stays the CPU reference, exact in float32 (the TF32 mode's float16 operands would round
    its inputs, and the parts workspaces would go unused). ``jax.lax.platform_dependent`` lowers only the branch of
    the platform that runs it. One trace where no GPU is a Hopper (the defaults are off everywhere; gpus_are_hopper
    starts the GPU backend once) or where every switch is set (the branches would be the same)."""
    if not gpus_are_hopper() or all(os.environ.get(variable, "") for variable in switches):
        return trace()

    def with_default(default: bool) -> Callable[[], _T]:
        def branch() -> _T:
            token = _hopper_paths_default.set(default)
            try:
                return trace()
            finally:
                _hopper_paths_default.reset(token)
        return branch

    return jax.lax.platform_dependent(cuda=with_default(True), default=with_default(False))


KEY_MASK_FORM_ENV = "JAX_FLASH_KEY_MASK_FORM"


def key_masks_stay_dense() -> bool:
    """``JAX_FLASH_KEY_MASK_FORM`` (read when a call is traced): unset, empty or ``segments`` (the default) runs a
    converted key-only mask as kv lengths and segment ids (``_key_masks``); ``dense`` as kv lengths plus the mask
    itself, which GQA packing and the split-KV forward then carry along (the kernels' dense form reads mask elements
    only in key tiles the mask's block summary marks partial, where segment ids are compared in every tile). Not yet
    measured on a GPU, hence not the default."""
    value = os.environ.get(KEY_MASK_FORM_ENV, "")
    if value not in ("", "segments", "dense"):
        raise ValueError(f"{KEY_MASK_FORM_ENV} must be segments or dense, not {value!r}")
    return value == "dense"


@dataclasses.dataclass(frozen=True)
class ScoreConfig:
    """Score pipeline and masking settings, passed to the kernels as custom-call attributes.

    Query row ``i`` sits at key column ``diag(i) = i + diagonal_offset`` plus, when ``align_to_sequence_end``,
    ``kv_len - q_len`` of its sequence (FlashAttention's bottom-right convention). ``causal`` keeps
    ``j <= diag(i)``; the window keeps ``diag(i) - window_left <= j <= diag(i) + window_right`` (-1: unbounded).
    ``dropout_rate`` needs ``DenseOperands.dropout_seeds``. ``allow_tf32``: float32 inputs may be multiplied on
    TF32 tensor cores on the GPU (float32 accumulation); False keeps every product in float32. ``packed_heads``
    (forward calls only, set by ``_gqa_packing``; a power of two): query rows per position, row ``i`` being position
    ``i // packed_heads`` for the position masks; 1 where no mask reads a position. ``kv_chunks`` (forward calls
    only, set by ``_kv_split``): each sequence's keys arrive as that many consecutive batch rows of ``seqlen_k`` keys
    each, with ``kv_seqlens`` counted from each row's first key (unclamped), so that the masks read whole-sequence
    key positions.
    """

    softmax_scale: float
    softcap: float = 0.0
    causal: bool = False
    align_to_sequence_end: bool = True
    diagonal_offset: int = 0
    window_left: int = -1
    window_right: int = -1
    deterministic: bool = False
    dropout_rate: float = 0.0
    allow_tf32: bool = False
    packed_heads: int = 1
    kv_chunks: int = 1


class MaskOperands(NamedTuple):
    """Per-batch operands in the kernels' normalised form: a zero-size last axis means "absent".

    Attributes:
      alibi_slopes: ``[B, Hq]`` or ``[B, 0]`` float32.
      q_seqlens: ``[B, 1]`` or ``[B, 0]`` int32.
      kv_seqlens: ``[B, 1]`` or ``[B, 0]`` int32.
      q_segment_ids: ``[B, Sq]`` or ``[B, 0]`` int32.
      kv_segment_ids: ``[B, Sk]`` or ``[B, 0]`` int32.
    """

    alibi_slopes: jax.Array
    q_seqlens: jax.Array
    kv_seqlens: jax.Array
    q_segment_ids: jax.Array
    kv_segment_ids: jax.Array


class DenseOperands(NamedTuple):
    """Bias, boolean mask and dropout seeds in the kernels' normalised form (absent: a zero-size last axis).

    Attributes:
      bias: ``[B|1, Hq|1, Sq|1, Sk|1]`` float32 (size-1 axes broadcast, read with stride 0), or ``[1, 1, 1, 0]``.
      mask: likewise, bool (True = visible), or ``[1, 1, 1, 0]``.
      dropout_seeds: ``[B, 2]`` uint32 Philox keys, one per batch row, or ``[B, 0]``.
    """

    bias: jax.Array
    mask: jax.Array
    dropout_seeds: jax.Array

    @staticmethod
    def absent(batch: int) -> "DenseOperands":
        return DenseOperands(jnp.zeros((1, 1, 1, 0), jnp.float32), jnp.zeros((1, 1, 1, 0), jnp.bool_),
                             jnp.zeros((batch, 0), jnp.uint32))

    @property
    def has_bias(self) -> bool:
        return self.bias.shape[-1] != 0

    @property
    def has_mask(self) -> bool:
        return self.mask.shape[-1] != 0

    @property
    def has_key_only_mask(self) -> bool:
        """A mask that is the same for every head and query row: static shape ``[B|1, 1, 1, Sk]``."""
        return self.has_mask and self.mask.shape[1:3] == (1, 1)
