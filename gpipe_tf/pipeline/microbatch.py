"""Splitting a mini-batch into micro-batches and putting the outputs back together."""

from __future__ import annotations

import tensorflow as tf


def _Leaves(inputs) -> list:
    return [x for x in tf.nest.flatten(inputs) if x is not None]


def BatchSize(inputs, batch_dim: int) -> int | None:
    """The static size of `batch_dim` shared by every input, or None if unknown.

    Raises:
      ValueError: if inputs disagree on the batch size, or a rank is too small.
    """
    sizes = set()
    for x in _Leaves(inputs):
        shape = x.shape
        if shape.rank is not None and not -shape.rank <= batch_dim < shape.rank:
            raise ValueError(f'Input of shape {shape} has no batch_dim {batch_dim}.')
        sizes.add(shape[batch_dim] if shape.rank is not None else None)
    known = {s for s in sizes if s is not None}
    if len(known) > 1:
        raise ValueError(f'Inputs disagree on the batch size along batch_dim {batch_dim}: '
                         f'{sorted(known)}.')
    return known.pop() if known else None


def NumMicroBatches(batch_size: int, num_micro_batches: int | None,
                    micro_batch_size: int | None) -> int:
    """M from either M or the micro-batch size (neither: M = 1), checked against the batch."""
    if num_micro_batches is None and micro_batch_size is None:
        num_micro_batches = 1
    if num_micro_batches is not None and micro_batch_size is not None:
        raise ValueError('Set exactly one of num_micro_batches and micro_batch_size, got '
                         f'{num_micro_batches} and {micro_batch_size}.')
    if micro_batch_size is not None:
        if micro_batch_size < 1 or batch_size % micro_batch_size:
            raise ValueError(f'Batch size {batch_size} is not divisible by micro_batch_size '
                             f'{micro_batch_size}.')
        return batch_size // micro_batch_size
    if num_micro_batches < 1:
        raise ValueError(f'num_micro_batches must be >= 1, got {num_micro_batches}.')
    if num_micro_batches > batch_size:
        raise ValueError(f'num_micro_batches ({num_micro_batches}) is larger than the batch '
                         f'size ({batch_size}).')
    if batch_size % num_micro_batches:
        raise ValueError(f'Batch size {batch_size} is not divisible by num_micro_batches '
                         f'({num_micro_batches}).')
    return num_micro_batches


def Split(inputs, num_micro_batches: int, batch_dim: int = 0) -> list:
    """Splits every tensor of `inputs` (any nest) into `num_micro_batches` equal parts.

    Returns:
      A list of M nests shaped like `inputs`.
    """
    flat = tf.nest.flatten(inputs)
    parts = [tf.split(x, num_micro_batches, axis=batch_dim) if x is not None
             else [None] * num_micro_batches for x in flat]
    return [tf.nest.pack_sequence_as(inputs, [p[m] for p in parts])
            for m in range(num_micro_batches)]


def Concat(micro_batches: list, batch_dim: int = 0):
    """Concatenates a list of like-structured nests along `batch_dim`.

    Raises:
      ValueError: for an empty list (there is nothing to give the result its structure).
    """
    if not micro_batches:
        raise ValueError('Concat needs at least one micro-batch, got none.')
    flats = [tf.nest.flatten(mb) for mb in micro_batches]
    joined = [tf.concat(list(parts), axis=batch_dim) if parts[0] is not None else None
              for parts in zip(*flats)]
    return tf.nest.pack_sequence_as(micro_batches[0], joined)
