"""The embedding lookup: Megatron's vocab-parallel gather forward, and a backward whose scatter-add
reduce-scatters onto the table's own shards instead of all-reducing a whole table.

Forward: the table (gathered over its `embed` shards) as [S, V/S, D] split over its S vocab shards;
each shard looks up the ids in its range (zeros elsewhere) and the sum over shards is one
all-reduce. A plain jnp.take from the vocab-split table crashes XLA's SPMD gather partitioning in
JAX 0.11 on data x fsdp x tensor meshes ("Check failed: partition_group_list.num_replica_groups() * ...").

Backward (`custom_vjp`): d table = the scatter-add of d rows at the ids. Left to autodiff it is one
scatter summed over every batch and sequence shard, which XLA all-reduces whole over those axes and
then slices to the table's shard (mixtral-8x7b's pod, fsdp x expert: all-reduce 1.49x the formula
on 2.3% of the step's bytes, issue 39 section 3). Here each batch and sequence shard scatters into its
own table, G x Q of them, and `summed_over_shards` sums them as the head's gradient is summed
(meshtrain/ops/loss.py): a reduce-scatter over fsdp x context, an all-reduce of the shard over the rest.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from meshtrain.parallel.sharding import constrain, shard_count, summed_over_shards


def vocab_shards(vocab: int) -> int:
    """S, the vocab shards the lookup splits the table into: 1 unsplit or split unevenly (XLA pads)."""
    S = shard_count("vocab")
    return 1 if vocab % S else S


def lookup(table_VxD, tokens_BxL):
    """The table's rows at the tokens, [B, L, D]."""
    V = table_VxD.shape[0]
    return _lookup(table_VxD, tokens_BxL, V, vocab_shards(V))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _lookup(table_VxD, tokens_BxL, V: int, S: int):
    if S == 1:
        return jnp.take(constrain(table_VxD, ("vocab", None)), tokens_BxL, axis=0)
    D = table_VxD.shape[1]
    table_SxVsxD = constrain(table_VxD.reshape(S, V // S, D), ("vocab", None, None))
    local_SxBxL = constrain(tokens_BxL[None] - (jnp.arange(S) * (V // S))[:, None, None], ("vocab", "batch", None))
    mine_SxBxL = (local_SxBxL >= 0) & (local_SxBxL < V // S)
    rows_SxBxLxD = jax.vmap(lambda t, i: jnp.take(t, i, axis=0))(table_SxVsxD, jnp.where(mine_SxBxL, local_SxBxL, 0))
    return jnp.sum(jnp.where(mine_SxBxL[..., None], rows_SxBxLxD, 0), axis=0)


def _lookup_fwd(table_VxD, tokens_BxL, V: int, S: int):
    return _lookup(table_VxD, tokens_BxL, V, S), tokens_BxL


def _lookup_bwd(V: int, S: int, tokens_BxL, drows_BxLxD):
    (B, L), D = tokens_BxL.shape, drows_BxLxD.shape[-1]
    # G batch shards (b rows each) and Q sequence shards (l positions each), N = b x l tokens a shard
    G, Q = math.gcd(B, shard_count("batch")), math.gcd(L, shard_count("seq"))
    by_shard = lambda a: jnp.swapaxes(a.reshape(G, B // G, Q, L // Q, *a.shape[2:]), 1, 2).reshape(
        G, Q, B * L // (G * Q), *a.shape[2:])
    # each vocab shard's row of each token; V/S (dropped) where another shard holds it
    local_SxGxQxN = by_shard(tokens_BxL)[None] - (jnp.arange(S) * (V // S))[:, None, None, None]
    ids_SxGxQxN = jnp.where((local_SxGxQxN >= 0) & (local_SxGxQxN < V // S), local_SxGxQxN, V // S)
    ids_SxGxQxN = constrain(ids_SxGxQxN, ("vocab", "batch", "seq", None))
    drows_GxQxNxD = constrain(by_shard(drows_BxLxD), ("batch", "seq", None, None))
    scatter = lambda i_N, d_NxD: jnp.zeros((V // S, D), d_NxD.dtype).at[i_N].add(d_NxD, mode="drop")
    per_shard = jax.vmap(jax.vmap(scatter))  # over G and Q
    dtable_SxGxQxVsxD = jax.vmap(per_shard, in_axes=(0, None))(ids_SxGxQxN, drows_GxQxNxD)
    dtable_GxQxSxVsxD = constrain(jnp.moveaxis(dtable_SxGxQxVsxD, 0, 2), ("batch", "seq", "vocab", None, None))
    dtable_SxVsxD = summed_over_shards(dtable_GxQxSxVsxD, ("vocab", None, "embed"))
    return constrain(dtable_SxVsxD.reshape(V, D), ("vocab", "embed")), None


_lookup.defvjp(_lookup_fwd, _lookup_bwd)
