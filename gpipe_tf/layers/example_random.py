"""Randomness drawn per example, so that splitting a batch does not change it.

A dropout mask drawn for a whole tensor depends on the tensor's shape: drawn per micro-batch, row i
of micro-batch m would get other values than row m * n + i of the whole batch, and a run would
depend on M and R. Here the values of example i are those at positions [i P, (i + 1) P) of one
counter-based (Philox) stream of the seed, P being the values per example: a micro-batch whose
first example is e starts the stream at e P (Philox makes 4 values per counter step, so the
counter starts at e P // 4 and the first e P % 4 values are dropped). So example i's values depend
on (seed, i) alone: the same in the whole batch, in any micro-batch or replica shard holding it,
and in a re-materialized forward.

The index of an example is its index in the mini-batch: `fprop_context.Current().first_example`
(set by the pipeline for each micro-batch and replica shard; 0 for a whole batch) plus its row.
"""

from __future__ import annotations

import tensorflow as tf

from gpipe_tf.layers import fprop_context

_PHILOX = tf.random.Algorithm.PHILOX.value
_VALUES_PER_COUNTER = 4  # Philox 4x32: four 32-bit values per counter step, one per float32.


def Uniform(seed, shape, first_example=None, batch_dim: int | None = None) -> tf.Tensor:
    """float32 values in [0, 1) of `shape`, each example's drawn from (seed, its index).

    Args:
      seed: a [2] integer seed (e.g. `BaseLayer.StepSeed()`).
      shape: the shape (a list or 1-D int tensor of static length), batch dimension included.
      first_example: the mini-batch index of this batch's first example; default: the current
        context's (`fprop_context.Current().first_example`).
      batch_dim: the batch dimension of `shape`; default: the current context's.
    """
    ctx = fprop_context.Current()
    first_example = ctx.first_example if first_example is None else first_example
    batch_dim = ctx.batch_dim if batch_dim is None else batch_dim
    shape = tf.cast(tf.convert_to_tensor(shape), tf.int64)
    rank = shape.shape[0]
    if rank is None or rank == 0:
        raise ValueError(f'per-example values need a shape of static rank >= 1, got {shape}.')
    batch_dim %= rank
    # Batch dimension first: each example's values are contiguous in the stream.
    perm = [batch_dim] + [d for d in range(rank) if d != batch_dim]
    batch_first = tf.gather(shape, perm)
    per_example = tf.reduce_prod(batch_first[1:])
    start = tf.cast(first_example, tf.int64) * per_example
    mixed = tf.random.stateless_uniform([2], tf.cast(seed, tf.int64), minval=None, maxval=None,
                                        dtype=tf.int64)
    key = tf.bitcast(mixed[:1], tf.uint64)
    counter = tf.bitcast(tf.stack([start // _VALUES_PER_COUNTER, mixed[1]]), tf.uint64)
    lead = start % _VALUES_PER_COUNTER
    stream = tf.raw_ops.StatelessRandomUniformV2(
        shape=tf.reshape(lead + batch_first[0] * per_example, [1]), key=key, counter=counter,
        alg=_PHILOX, dtype=tf.float32)
    values = tf.reshape(stream[lead:], batch_first)
    inverse = [perm.index(d) for d in range(rank)]
    return values if batch_dim == 0 else tf.transpose(values, inverse)
