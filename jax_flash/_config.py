"""Static (hashable) description of a call: everything the kernels take as attributes."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax


@dataclasses.dataclass(frozen=True)
class ScoreConfig:
    """Score pipeline and masking settings, passed to the kernels as custom-call attributes.

    Query row ``i`` sits at key column ``diag(i) = i + diagonal_offset`` plus, when ``align_to_sequence_end``,
    ``kv_len - q_len`` of its sequence (FlashAttention's bottom-right convention). ``causal`` keeps
    ``j <= diag(i)``; the window keeps ``diag(i) - window_left <= j <= diag(i) + window_right`` (-1: unbounded).
    """

    softmax_scale: float
    softcap: float = 0.0
    causal: bool = False
    align_to_sequence_end: bool = True
    diagonal_offset: int = 0
    window_left: int = -1
    window_right: int = -1
    deterministic: bool = False


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
