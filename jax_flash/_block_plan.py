"""Static plans for attention between one query shard and one key/value shard of a sharded sequence.

The kernels take the diagonal as a static attribute, but in a ring the pair of shards a device works on depends
on its (traced) index. So every (ring step, query shard) pair gets a plan, built here in Python from the
global positions of the chunks involved: which kernel calls to make, on which local chunks, with which static
diagonal offset, skipping chunk pairs that the causal/window mask hides entirely. Identical plans are shared,
and the ring picks its plan with ``lax.switch`` on a lookup table, so only a few distinct branches get compiled
(three for a causal ring in either layout).
"""

from __future__ import annotations

import dataclasses
import enum

from jax_flash._config import ScoreConfig
from jax_flash.sequence_layout import SequenceLayout


@dataclasses.dataclass(frozen=True)
class PositionMask:
    """The position-dependent part of the scores in global coordinates: query ``i`` sits at key column
    ``i + diagonal``; ``causal``/``window_*`` as in ``ScoreConfig``; ``alibi`` needs the distance to it."""

    causal: bool
    window_left: int
    window_right: int
    diagonal: int
    alibi: bool

    @property
    def positional(self) -> bool:
        return self.causal or self.window_left >= 0 or self.window_right >= 0


def position_mask(config: ScoreConfig, *, seqlen_q: int, seqlen_k: int, has_alibi: bool,
                  has_seqlens: bool) -> PositionMask | None:
    """The global position mask, or ``None`` when the diagonal moves with each sequence's own lengths.

    With ``align_to_sequence_end`` and ``q_seqlens``/``kv_seqlens``, row ``i`` of batch ``b`` sits at
    ``i + kv_len[b] - q_len[b]``: a per-batch shift that a block of a sharded sequence cannot express, because
    the kernels clamp lengths to the block (a block's valid count loses how far past the block the sequence
    goes). Callers must then keep the whole sequence on one device.
    """
    depends_on_diagonal = (config.causal or config.window_left >= 0 or config.window_right >= 0 or has_alibi)
    if config.align_to_sequence_end and has_seqlens and depends_on_diagonal:
        return None
    diagonal = config.diagonal_offset + (seqlen_k - seqlen_q if config.align_to_sequence_end else 0)
    return PositionMask(config.causal, config.window_left, config.window_right, diagonal, has_alibi)


class Visibility(enum.Enum):
    EMPTY = 0
    FULL = 1
    PARTIAL = 2


def visibility(mask: PositionMask, offset: int, len_q: int, len_k: int) -> Visibility:
    """How much of a ``len_q x len_k`` block whose row ``i`` has its diagonal at column ``i + offset`` the
    position mask shows. Interval arithmetic on the band ``i + offset - left <= j <= i + offset + right``."""
    right = 0 if mask.causal else (mask.window_right if mask.window_right >= 0 else None)
    left = mask.window_left if mask.window_left >= 0 else None
    full = ((right is None or len_k - 1 <= offset + right)
            and (left is None or len_q - 1 + offset - left <= 0))
    if full:
        return Visibility.FULL
    # Rows whose band meets [0, len_k): i >= -offset - right and i <= len_k - 1 - offset + left.
    first_row = 0 if right is None else max(0, -offset - right)
    last_row = len_q - 1 if left is None else min(len_q - 1, len_k - 1 - offset + left)
    return Visibility.PARTIAL if first_row <= last_row else Visibility.EMPTY


@dataclasses.dataclass(frozen=True)
class BlockCall:
    """One kernel call: local query chunks ``q_slots`` against local key/value chunks ``kv_slots`` (both
    consecutive), with the given positional mask relative to the block's own row/column numbering."""

    q_slots: tuple[int, ...]
    kv_slots: tuple[int, ...]
    causal: bool = False
    window_left: int = -1
    window_right: int = -1
    diagonal_offset: int = 0


BlockPlan = tuple[BlockCall, ...]  # () when the mask hides the whole block


def plan_block(q_starts: tuple[int, ...], kv_starts: tuple[int, ...], len_q: int, len_k: int,
               mask: PositionMask) -> BlockPlan:
    """Kernel calls covering the visible part of one (query shard, key/value shard) block.

    Args:
      q_starts: global start of each local query chunk (increasing); chunks have ``len_q`` rows.
      kv_starts: likewise for the key/value chunks, of ``len_k`` columns.
      mask: the global position mask.
    """
    all_q, all_kv = tuple(range(len(q_starts))), tuple(range(len(kv_starts)))
    if not mask.positional and not mask.alibi:
        return (BlockCall(all_q, all_kv),)
    # Same chunks on both sides and the diagonal through the chunk corners: local positions are an increasing
    # function of global ones on both sides, so "j <= i" is the same test locally, one causal call.
    if (mask.causal and mask.window_left < 0 and not mask.alibi and mask.diagonal == 0
            and q_starts == kv_starts and len_q == len_k):
        return (BlockCall(all_q, all_kv, causal=True),)

    offsets = {(a, b): q_start - kv_start + mask.diagonal
               for a, q_start in enumerate(q_starts) for b, kv_start in enumerate(kv_starts)}
    seen = {pair: visibility(mask, offset, len_q, len_k) for pair, offset in offsets.items()}
    calls: list[BlockCall] = []
    if mask.alibi:
        # ALiBi needs each pair's own diagonal, so no merging; fully visible pairs just drop the mask.
        for (a, b), kind in seen.items():
            if kind is Visibility.FULL:
                calls.append(BlockCall((a,), (b,), diagonal_offset=offsets[a, b]))
            elif kind is Visibility.PARTIAL:
                calls.append(_masked_call(a, b, offsets[a, b], mask))
        return tuple(calls)
    # Fully visible pairs need no positions: query chunks that see the same set of key chunks fully share
    # one call over the concatenated chunks (a whole causal zigzag step is one call this way).
    groups: dict[tuple[int, ...], list[int]] = {}
    for a in all_q:
        full_kv = tuple(b for b in all_kv if seen[a, b] is Visibility.FULL)
        if full_kv:
            groups.setdefault(full_kv, []).append(a)
    for kv_slots, q_slots in groups.items():
        calls.extend(BlockCall(run, kv_run) for run in _consecutive_runs(q_slots)
                     for kv_run in _consecutive_runs(list(kv_slots)))
    calls.extend(_masked_call(a, b, offsets[a, b], mask) for (a, b), kind in seen.items()
                 if kind is Visibility.PARTIAL)
    return tuple(calls)


def _masked_call(q_slot: int, kv_slot: int, offset: int, mask: PositionMask) -> BlockCall:
    return BlockCall((q_slot,), (kv_slot,), mask.causal, mask.window_left, mask.window_right, offset)


def _consecutive_runs(slots: list[int]) -> list[tuple[int, ...]]:
    """Splits sorted slot indices into runs of consecutive ones (a call needs a contiguous local slice)."""
    runs: list[list[int]] = []
    for slot in slots:
        if runs and runs[-1][-1] + 1 == slot:
            runs[-1].append(slot)
        else:
            runs.append([slot])
    return [tuple(run) for run in runs]


@dataclasses.dataclass(frozen=True)
class RingSchedule:
    """Plans for every ring step and query shard.

    At step ``s`` query shard ``r`` holds the key/value shard ``(r - s) mod kv_layout.num_shards`` (blocks move
    one device forward per step). ``table[s][r]`` indexes ``plans``. Hashable, so it can be a static argument.
    """

    plans: tuple[BlockPlan, ...]
    table: tuple[tuple[int, ...], ...]  # [steps][q_layout.num_shards]

    @property
    def steps(self) -> int:
        return len(self.table)


def ring_schedule(q_layout: SequenceLayout, kv_layout: SequenceLayout, mask: PositionMask) -> RingSchedule:
    """Plans of a ring over ``kv_layout.num_shards`` steps (1: key/value replicated, no ring)."""
    steps = kv_layout.num_shards
    if steps > 1 and steps != q_layout.num_shards:
        raise ValueError(f"a ring needs as many query shards as key/value shards, got {q_layout.num_shards} "
                         f"and {steps}")
    plans: dict[BlockPlan, int] = {}
    table = []
    for step in range(steps):
        row = []
        for shard in range(q_layout.num_shards):
            source = (shard - step) % steps
            plan = plan_block(q_layout.chunk_starts(shard), kv_layout.chunk_starts(source), q_layout.chunk_len,
                              kv_layout.chunk_len, mask)
            row.append(plans.setdefault(plan, len(plans)))
        table.append(tuple(row))
    return RingSchedule(tuple(plans), tuple(table))
