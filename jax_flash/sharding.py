"""Multi-device partitioning of the two custom calls, so ``jax_flash.attention`` under ``jax.jit`` with sharded
inputs runs on each device's shard without gathering q/k/v.

``forward`` and ``backward`` have the signatures of ``_ffi_calls.forward``/``backward`` and wrap them in
``jax.experimental.custom_partitioning`` (a Shardy ``sharding_rule`` plus the GSPMD callbacks, whichever
partitioner jax uses). What each sharded axis becomes:

- batch: independent rows, runs locally.
- heads: runs locally when the mesh axes divide the key/value heads; query heads follow their key/value head
  (grouped-query attention keeps a group on one device). With a single key/value head (multi-query attention)
  the query heads shard alone, keys/values stay replicated and dK/dV are summed over the head axes. Otherwise
  heads are gathered.
- head_dim: always gathered (the kernels contract over it).
- query sequence, keys/values replicated: runs locally; each shard's diagonal (causal, window, ALiBi) is shifted
  to its global position (``lax.switch`` over static offsets); dK/dV are summed over the sequence axes.
- key/value sequence: ring attention over those mesh axes (``jax_flash._ring``), queries sharded the same way.
  NamedSharding shards contiguously, which leaves a causal ring unbalanced (device 0 sees one block, the last
  device all of them, and every step waits for the slowest); so for causal masks the shards are first moved
  into the zigzag layout (``jax_flash._relayout``: two ``ppermute``s of half a shard each, small next to the
  ring's quadratic work) and the results moved back.

Bias and boolean mask (``[B|1, Hq|1, Sq|1, Sk|1]``): each full batch/head/query axis is sharded like the queries'
(so every device reads exactly its block), a size-1 (broadcast) axis is replicated, and the key axis is never
sharded: in a ring every device cuts the travelling key/value block's columns out of its whole key axis. dbias
comes back sharded like the bias; the shards of a broadcast axis each hold a partial sum over their own rows,
which are summed (``psum``) over the mesh axes sharding that role.

Dropout draws its bits from the element's position in the *local* call (``(h * Sq + i) * Sk + j`` with the
shard's own head index and lengths, keyed by its batch row's seed, see ``jax_flash._dropout``). Only batch
sharding keeps that position global (the seeds are sharded with the batch), so calls with dropout shard the
batch alone and gather heads and sequences: the same bits as the unsharded call, never different ones.

What cannot run locally is resharded explicitly through the returned operand shardings (the partitioner inserts
the collectives), never computed wrongly: a sequence axis that does not divide evenly, or sequence sharding when
``q_seqlens``/``kv_seqlens`` combine with a bottom-right-aligned causal/window/ALiBi mask (each sequence's
diagonal then depends on its lengths, see ``_block_plan.position_mask``).

The custom calls have no batching rule, so ``jax.custom_batching.custom_vmap`` folds a vmapped axis into the
batch axis first (``jax_flash._folding``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_flash import _ffi_calls, _folding, _relayout, _ring
from jax_flash._block_plan import position_mask
from jax_flash._config import DenseOperands, MaskOperands, ScoreConfig
from jax_flash.sequence_layout import LayoutName, SequenceLayout

Axes = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class _Call:
    """Static part of one call (hashable): the config, which mask and dense operands are present (the dense ones
    with their shapes), global sizes, and whether the backward returns dbias."""

    config: ScoreConfig
    present: tuple[str, ...]
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    dense: tuple[tuple[str, tuple[int, ...]], ...] = ()
    want_dbias: bool = False

    @property
    def dropout(self) -> bool:
        return any(name == "dropout_seeds" for name, _ in self.dense)

    @property
    def sequence_shardable(self) -> bool:
        return position_mask(self.config, seqlen_q=self.seqlen_q, seqlen_k=self.seqlen_k,
                             has_alibi="alibi_slopes" in self.present,
                             has_seqlens="q_seqlens" in self.present or "kv_seqlens" in self.present) is not None

    def masks(self, batch: int, present: Sequence[jax.Array]) -> MaskOperands:
        """Rebuilds the normalised operands, absent ones as ``[batch, 0]``."""
        given = dict(zip(self.present, present))
        return MaskOperands(*(given.get(name, jnp.zeros((batch, 0), jnp.float32 if name == "alibi_slopes"
                                                        else jnp.int32))
                              for name in MaskOperands._fields))

    def dense_operands(self, batch: int, present: Sequence[jax.Array]) -> DenseOperands:
        """Rebuilds the dense operands from the arrays after the mask operands, absent ones as placeholders."""
        given = dict(zip((name for name, _ in self.dense), present[len(self.present):]))
        return DenseOperands.absent(batch)._replace(**given)

    def bias_shape(self) -> tuple[int, ...]:
        return dict(self.dense)["bias"]


def _call(q: jax.Array, k: jax.Array, masks: MaskOperands, dense: DenseOperands, config: ScoreConfig,
          want_dbias: bool = False) -> tuple[_Call, tuple[jax.Array, ...]]:
    present = tuple(name for name, x in zip(MaskOperands._fields, masks) if x.shape[-1])
    dense_present = tuple(name for name, x in zip(DenseOperands._fields, dense) if x.shape[-1])
    call = _Call(config, present, q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2],
                 tuple((name, getattr(dense, name).shape) for name in dense_present), want_dbias)
    return call, tuple(getattr(masks, name) for name in present) + tuple(getattr(dense, name)
                                                                       for name in dense_present)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Mesh axes per role: batch, query heads, key/value heads (``heads``, or none for multi-query attention),
    query sequence, key/value sequence. ``kv_seq`` non-empty means a ring over it, and then ``q_seq == kv_seq``."""

    batch: Axes = ()
    heads: Axes = ()
    kv_heads: Axes = ()
    q_seq: Axes = ()
    kv_seq: Axes = ()

    def query(self) -> P:
        return P(self.batch or None, self.q_seq or None, self.heads or None, None)

    def kv(self) -> P:
        return P(self.batch or None, self.kv_seq or None, self.kv_heads or None, None)

    def lse(self) -> P:
        return P(self.batch or None, self.heads or None, self.q_seq or None)

    def mask(self, name: str) -> P:
        rest = {"alibi_slopes": self.heads, "q_segment_ids": self.q_seq, "kv_segment_ids": self.kv_seq}.get(name)
        return P(self.batch or None, rest or None)

    def dense(self, name: str, shape: tuple[int, ...]) -> P:
        """Bias/mask: full axes like the queries', broadcast axes and the key axis replicated; seeds by batch."""
        if name == "dropout_seeds":
            return P(self.batch or None, None)
        return P(*((axes or None) if size != 1 else None for axes, size in zip(self._dense_roles(), shape)))

    def broadcast_axes(self, shape: tuple[int, ...]) -> Axes:
        """Mesh axes over which a bias of ``shape`` is replicated although the call is sharded: its gradient's
        partial sums meet there."""
        return tuple(a for axes, size in zip(self._dense_roles(), shape) if size == 1 for a in axes)

    def _dense_roles(self) -> tuple[Axes, ...]:
        return (self.batch, self.heads, self.q_seq, ())


def _axes(sharding: object, dim: int) -> Axes:
    """Mesh axes sharding dimension ``dim`` (empty when replicated or unknown)."""
    spec = getattr(sharding, "spec", None)
    if spec is None or dim >= len(spec) or spec[dim] is None:
        return ()
    entry = spec[dim]
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _decide(call: _Call, mesh: Mesh, q_sharding: object, k_sharding: object) -> _Layout:
    """The layout to run in, from the operands' shardings: keeps what can run locally, drops the rest."""
    used: set[str] = set()

    def take(axes: Axes, extent: int) -> Axes:
        shards = math.prod(mesh.shape[a] for a in axes)
        if not axes or used.intersection(axes) or extent % shards:
            return ()
        used.update(axes)
        return axes

    batch = take(_axes(q_sharding, 0) or _axes(k_sharding, 0), call.batch)
    if call.dropout:  # see the module docstring
        return _Layout(batch)
    kv_heads = heads = take(_axes(q_sharding, 2) or _axes(k_sharding, 2), call.heads_kv)
    if not heads and call.heads_kv == 1:
        heads = take(_axes(q_sharding, 2), call.heads_q)
    if not call.sequence_shardable:
        return _Layout(batch, heads, kv_heads)
    kv_seq = _axes(k_sharding, 1)
    if kv_seq and call.seqlen_q % math.prod(mesh.shape[a] for a in kv_seq) == 0:
        kv_seq = take(kv_seq, call.seqlen_k)
    if kv_seq:  # a ring: queries sharded over the same axes
        return _Layout(batch, heads, kv_heads, kv_seq, kv_seq)
    return _Layout(batch, heads, kv_heads, take(_axes(q_sharding, 1), call.seqlen_q))


def _ring_spec(call: _Call, mesh: Mesh, layout: _Layout) -> _ring.RingSpec:
    """Zigzag for a causal ring whose shards halve evenly (see the module docstring), else contiguous."""
    q_shards = math.prod(mesh.shape[a] for a in layout.q_seq)
    kv_shards = math.prod(mesh.shape[a] for a in layout.kv_seq)
    balance = (call.config.causal and kv_shards > 1
               and call.seqlen_q % (2 * q_shards) == 0 and call.seqlen_k % (2 * kv_shards) == 0)
    name: LayoutName = "zigzag" if balance else "contiguous"
    spec = _ring.ring_spec(call.config, SequenceLayout(name, q_shards, call.seqlen_q),
                           SequenceLayout(name, kv_shards, call.seqlen_k),
                           has_alibi="alibi_slopes" in call.present,
                           has_seqlens="q_seqlens" in call.present or "kv_seqlens" in call.present)
    assert spec is not None, "_decide only shards sequences that ring_spec supports"
    return spec


def _relayout_functions(spec: _ring.RingSpec, layout: _Layout):
    """``(into, back)``: move a contiguous per-device sequence shard (sequence along ``axis``) into the spec's
    layout and back; identities for the contiguous layout."""
    if spec.q_layout.name == "contiguous":
        return (lambda x, axis=1: x), (lambda x, axis=1: x)
    shards = spec.q_layout.num_shards
    return (functools.partial(_relayout.to_zigzag, axis_name=layout.q_seq, num_shards=shards),
            functools.partial(_relayout.from_zigzag, axis_name=layout.q_seq, num_shards=shards))


def _relayout_masks(masks: MaskOperands, into) -> MaskOperands:
    move = lambda ids: into(ids) if ids.shape[-1] else ids
    return masks._replace(q_segment_ids=move(masks.q_segment_ids), kv_segment_ids=move(masks.kv_segment_ids))


def _named(mesh: Mesh, *specs: P) -> tuple[NamedSharding, ...]:
    return tuple(NamedSharding(mesh, spec) for spec in specs)


def _mask_shardings(call: _Call, mesh: Mesh, layout: _Layout) -> tuple[NamedSharding, ...]:
    return _named(mesh, *(layout.mask(name) for name in call.present),
                  *(layout.dense(name, shape) for name, shape in call.dense))


# Shardy factors. Query and key/value heads are separate factors: tying them as a compound "(hk g)" lets Shardy
# split a mesh axis into sub-axes (e.g. 4 devices over 2 key/value heads), which NamedSharding cannot express;
# _decide relates them instead. "qn"/"kn" are the size-1 length axes.
_QUERY, _KV, _LSE = "b sq hq d", "b sk hk d", "b hq sq"
_MASKS = {"alibi_slopes": "b hq", "q_seqlens": "b qn", "kv_seqlens": "b kn", "q_segment_ids": "b sq",
          "kv_segment_ids": "b sk"}
_SEEDS = "b sd"
_DENSE_FULL, _DENSE_BROADCAST = ("b", "hq", "sq", "sk"), ("b1", "h1", "q1", "k1")


def _dense_factors(shape: tuple[int, ...]) -> str:
    """Bias/mask factors: the queries' and keys' where full, size-1 factors of their own where broadcast."""
    return " ".join(full if size != 1 else one for full, one, size in zip(_DENSE_FULL, _DENSE_BROADCAST, shape))


def _operand_factors(call: _Call) -> list[str]:
    return ([_MASKS[name] for name in call.present]
            + [_SEEDS if name == "dropout_seeds" else _dense_factors(shape) for name, shape in call.dense])


def _sharding_rule(operands: Sequence[str], results: Sequence[str], call: _Call) -> tuple[str, dict[str, object]]:
    """Shardy rule: factors shared by name; head_dim never sharded, sequence factors only where ``_decide`` can
    shard them (the ``partition`` callback has the last word either way)."""
    rule = ", ".join(operands) + " -> " + ", ".join(results)
    replicated = {"d", "qn", "kn", "sd", *_DENSE_BROADCAST} | (set() if call.sequence_shardable else {"sq", "sk"})
    if call.dropout:
        replicated |= {"hq", "hk", "sq", "sk"}
    # In order of first appearance: Shardy wants these factor indices sorted and jax passes them through as is.
    factors = dict.fromkeys(rule.replace(",", " ").split())
    return rule, {"need_replication_factors": tuple(f for f in factors if f in replicated)}


# ---------------------------------------------------------------------------------------------------------------
# Forward: (q, k, v, *masks, *dense) -> (o, lse)


def _forward_impl(call: _Call, q: jax.Array, k: jax.Array, v: jax.Array,
                  *present: jax.Array) -> tuple[jax.Array, jax.Array]:
    batch = q.shape[0]
    return _ffi_calls.forward(q, k, v, call.masks(batch, present), call.config, call.dense_operands(batch, present))


_forward_op = custom_partitioning(_forward_impl, static_argnums=(0,))


def _relayout_dense(dense: DenseOperands, into) -> DenseOperands:
    """Moves the full query axes of the bias and mask like the queries (their key axes stay whole)."""
    move = lambda x: into(x, axis=2) if x.shape[-1] and x.shape[2] != 1 else x
    return dense._replace(bias=move(dense.bias), mask=move(dense.mask))


def _forward_local(call: _Call, mesh: Mesh, layout: _Layout, q: jax.Array, k: jax.Array, v: jax.Array,
                   *present: jax.Array) -> tuple[jax.Array, jax.Array]:
    masks, dense = call.masks(q.shape[0], present), call.dense_operands(q.shape[0], present)
    if not layout.q_seq:
        return _ffi_calls.forward(q, k, v, masks, call.config, dense)
    spec = _ring_spec(call, mesh, layout)
    into, back = _relayout_functions(spec, layout)
    o, lse = _ring.ring_forward(into(q), into(k), into(v), _relayout_masks(masks, into), spec, layout.q_seq,
                                _relayout_dense(dense, into))
    return back(o), back(lse, axis=2)


def _forward_partition(call: _Call, mesh: Mesh, arg_shapes, result_shape):
    del result_shape
    layout = _decide(call, mesh, arg_shapes[0].sharding, arg_shapes[1].sharding)
    args = _named(mesh, layout.query(), layout.kv(), layout.kv()) + _mask_shardings(call, mesh, layout)
    results = _named(mesh, layout.query(), layout.lse())
    return mesh, functools.partial(_forward_local, call, mesh, layout), results, args


def _forward_infer(call: _Call, mesh: Mesh, arg_shapes, result_shape):
    del result_shape
    layout = _decide(call, mesh, arg_shapes[0].sharding, arg_shapes[1].sharding)
    return _named(mesh, layout.query(), layout.lse())


def _output_layout(o_sharding: object) -> _Layout:
    """The layout a consumer of ``o`` asks for (head_dim aside)."""
    return _Layout(_axes(o_sharding, 0), _axes(o_sharding, 2), _axes(o_sharding, 1))


def _forward_propagate_user(call: _Call, mesh: Mesh, user_shape):
    del call
    layout = _output_layout(user_shape[0].sharding)
    return _named(mesh, layout.query(), layout.lse())


def _forward_rule(call: _Call, mesh, operand_types, result_types):
    del mesh, operand_types, result_types
    return _sharding_rule([_QUERY, _KV, _KV] + _operand_factors(call), [_QUERY, _LSE], call)


_forward_op.def_partition(
    partition=_forward_partition,
    infer_sharding_from_operands=_forward_infer,
    propagate_user_sharding=_forward_propagate_user,
    sharding_rule=_forward_rule,
)


# ---------------------------------------------------------------------------------------------------------------
# Backward: (q, k, v, o, lse, d_o, d_lse, *masks, *dense) -> (dq, dk, dv[, dbias])


def _backward_impl(call: _Call, q: jax.Array, k: jax.Array, v: jax.Array, o: jax.Array, lse: jax.Array,
                   d_o: jax.Array, d_lse: jax.Array, *present: jax.Array) -> tuple[jax.Array, ...]:
    batch = q.shape[0]
    return _ffi_calls.backward(q, k, v, o, lse, d_o, d_lse, call.masks(batch, present), call.config,
                               call.dense_operands(batch, present), want_dbias=call.want_dbias)


_backward_op = custom_partitioning(_backward_impl, static_argnums=(0,))


def _backward_local(call: _Call, mesh: Mesh, layout: _Layout, q: jax.Array, k: jax.Array, v: jax.Array,
                    o: jax.Array, lse: jax.Array, d_o: jax.Array, d_lse: jax.Array,
                    *present: jax.Array) -> tuple[jax.Array, ...]:
    masks, dense = call.masks(q.shape[0], present), call.dense_operands(q.shape[0], present)
    if layout.q_seq:
        spec = _ring_spec(call, mesh, layout)
        into, back = _relayout_functions(spec, layout)
        grads = _ring.ring_backward(into(q), into(k), into(v), into(o), into(lse, axis=2), into(d_o),
                                    into(d_lse, axis=2), _relayout_masks(masks, into), spec, layout.q_seq,
                                    _relayout_dense(dense, into), want_dbias=call.want_dbias)
        dbias = [_relayout_dense(dense._replace(bias=g), back).bias for g in grads[3:]]
        grads = (back(grads[0]), back(grads[1]), back(grads[2]), *dbias)
    else:
        grads = _ffi_calls.backward(q, k, v, o, lse, d_o, d_lse, masks, call.config, dense,
                                    want_dbias=call.want_dbias)
    dq, dk, dv, *dbias = grads
    if layout.heads and not layout.kv_heads:
        # Multi-query: every head shard's queries used the one replicated key/value head.
        dk, dv = (lax.psum(g.astype(jnp.float32), layout.heads).astype(g.dtype) for g in (dk, dv))
    # Each shard summed its own rows over the bias's broadcast axes: the shards sharing the bias add up.
    shared = layout.broadcast_axes(call.bias_shape()) if dbias else ()
    return (dq, dk, dv, *(lax.psum(g, shared) if shared else g for g in dbias))


def _backward_results(call: _Call, mesh: Mesh, layout: _Layout) -> tuple[NamedSharding, ...]:
    query, kv = layout.query(), layout.kv()
    dbias = (layout.dense("bias", call.bias_shape()),) if call.want_dbias else ()
    return _named(mesh, query, kv, kv, *dbias)


def _backward_partition(call: _Call, mesh: Mesh, arg_shapes, result_shape):
    del result_shape
    layout = _decide(call, mesh, arg_shapes[0].sharding, arg_shapes[1].sharding)
    query, kv, lse = layout.query(), layout.kv(), layout.lse()
    args = _named(mesh, query, kv, kv, query, lse, query, lse) + _mask_shardings(call, mesh, layout)
    local = functools.partial(_backward_local, call, mesh, layout)
    return mesh, local, _backward_results(call, mesh, layout), args


def _backward_infer(call: _Call, mesh: Mesh, arg_shapes, result_shape):
    del result_shape
    return _backward_results(call, mesh, _decide(call, mesh, arg_shapes[0].sharding, arg_shapes[1].sharding))


def _backward_propagate_user(call: _Call, mesh: Mesh, user_shape):
    return _backward_results(call, mesh, _output_layout(user_shape[0].sharding))


def _backward_rule(call: _Call, mesh, operand_types, result_types):
    del mesh, operand_types, result_types
    operands = [_QUERY, _KV, _KV, _QUERY, _LSE, _QUERY, _LSE] + _operand_factors(call)
    dbias = [_dense_factors(call.bias_shape())] if call.want_dbias else []
    return _sharding_rule(operands, [_QUERY, _KV, _KV] + dbias, call)


_backward_op.def_partition(
    partition=_backward_partition,
    infer_sharding_from_operands=_backward_infer,
    propagate_user_sharding=_backward_propagate_user,
    sharding_rule=_backward_rule,
)


# ---------------------------------------------------------------------------------------------------------------
# Public entry points, with vmap support.


def forward(q: jax.Array, k: jax.Array, v: jax.Array, masks: MaskOperands, config: ScoreConfig,
            dense: DenseOperands | None = None) -> tuple[jax.Array, jax.Array]:
    """``_ffi_calls.forward`` that partitions under ``jit`` with sharded operands; same shapes and results."""
    dense = DenseOperands.absent(q.shape[0]) if dense is None else dense

    @jax.custom_batching.custom_vmap
    def run(q, k, v, masks, dense):
        call, present = _call(q, k, masks, dense, config)
        return _forward_op(call, q, k, v, *present)

    @run.def_vmap
    def _(axis_size, in_batched, q, k, v, masks, dense):
        batch = q.shape[1 if in_batched[0] else 0]
        o, lse = forward(*_folding.fold_all(axis_size, in_batched[:4], (q, k, v, masks)), config,
                         _folding.fold_dense(axis_size, batch, in_batched[4], dense))
        return (_folding.unfold(o, axis_size), _folding.unfold(lse, axis_size)), (True, True)

    return run(q, k, v, masks, dense)


def backward(q: jax.Array, k: jax.Array, v: jax.Array, o: jax.Array, lse: jax.Array, d_o: jax.Array,
             d_lse: jax.Array, masks: MaskOperands, config: ScoreConfig, dense: DenseOperands | None = None,
             want_dbias: bool = False) -> tuple[jax.Array, ...]:
    """``_ffi_calls.backward`` that partitions under ``jit`` with sharded operands; same shapes and results."""
    dense = DenseOperands.absent(q.shape[0]) if dense is None else dense

    @jax.custom_batching.custom_vmap
    def run(q, k, v, o, lse, d_o, d_lse, masks, dense):
        call, present = _call(q, k, masks, dense, config, want_dbias)
        return _backward_op(call, q, k, v, o, lse, d_o.astype(q.dtype), d_lse.astype(jnp.float32), *present)

    @run.def_vmap
    def _(axis_size, in_batched, *args):
        *arrays, dense = args
        dense_batched = in_batched[-1]
        if want_dbias and not dense_batched.bias:
            # Each example needs its own dbias (vmap of grad): a shared bias is copied per example, so the
            # kernels do not sum its gradient over the folded batch. (grad of vmap then sums the copies.)
            dense = dense._replace(bias=jnp.broadcast_to(dense.bias, (axis_size, *dense.bias.shape)))
            dense_batched = dense_batched._replace(bias=True)
        batch = arrays[0].shape[1 if in_batched[0] else 0]
        grads = backward(*_folding.fold_all(axis_size, in_batched[:-1], arrays), config,
                         _folding.fold_dense(axis_size, batch, dense_batched, dense), want_dbias)
        unfolded = tuple(_folding.unfold(g, axis_size) for g in grads[:3])
        if not want_dbias:
            return unfolded, (True,) * 3
        dbias, batched = _folding.unfold_dbias(grads[3], dense.bias, dense_batched.bias, axis_size)
        return (*unfolded, dbias), (True,) * 3 + (batched,)

    return run(q, k, v, o, lse, d_o, d_lse, masks, dense)
