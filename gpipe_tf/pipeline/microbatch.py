"""Splitting a mini-batch into micro-batches and putting the outputs back together."""

from __future__ import annotations

import tensorflow as tf

from gpipe_tf.pipeline import leaves


def StaticBatchSize(inputs, batch_dim: int) -> int | None:
    """The static size of `batch_dim` shared by every input, or None if unknown.

    Raises:
      ValueError: if inputs disagree on the batch size, or a rank is too small.
      TypeError: for an input that is not a tensor or an array.
    """
    sizes = set()
    for x in leaves.Present(inputs):
        if not hasattr(x, 'shape'):
            raise TypeError(f'Inputs to split into micro-batches must be tensors or arrays; got '
                            f'{type(x).__name__} {x!r:.60}.')
        shape = tf.TensorShape(x.shape)  # Also NumPy arrays' tuples.
        if shape.rank is not None and not -shape.rank <= batch_dim < shape.rank:
            raise ValueError(f'Input of shape {shape} has no batch_dim {batch_dim}.')
        sizes.add(shape[batch_dim] if shape.rank is not None else None)
    known = {s for s in sizes if s is not None}
    if len(known) > 1:
        raise ValueError(f'Inputs disagree on the batch size along batch_dim {batch_dim}: '
                         f'{sorted(known)}.')
    return known.pop() if known else None


def RunBatchSize(inputs, batch_dim: int):
    """The examples of `inputs` along `batch_dim`: an int where known statically, else an int64
    scalar tensor (the batch is known only when the step runs)."""
    size = StaticBatchSize(inputs, batch_dim)
    if size is None:
        size = tf.shape(leaves.Present(inputs)[0], out_type=tf.int64)[batch_dim]
    return size


def Sizes(batch_size, num_micro_batches: int):
    """The examples of each of M micro-batches of a batch of `batch_size`: as equal as they can
    be, the first N mod M one larger (a batch smaller than M leaves the last ones empty). An
    int batch gives a list of ints; a tensor batch an int64 tensor of shape [M]."""
    if isinstance(batch_size, int):
        size, larger = divmod(batch_size, num_micro_batches)
        return [size + 1] * larger + [size] * (num_micro_batches - larger)
    batch_size = tf.cast(batch_size, tf.int64)
    size, larger = batch_size // num_micro_batches, batch_size % num_micro_batches
    return size + tf.cast(tf.range(num_micro_batches, dtype=tf.int64) < larger, tf.int64)


def Starts(batch_size, num_micro_batches: int) -> list:
    """Per micro-batch of `Sizes`, the index in the batch of its first example (ints, or int64
    scalar tensors for a tensor batch)."""
    if isinstance(batch_size, int):
        sizes = Sizes(batch_size, num_micro_batches)
        return [sum(sizes[:m]) for m in range(num_micro_batches)]
    batch_size = tf.cast(batch_size, tf.int64)
    size, larger = batch_size // num_micro_batches, batch_size % num_micro_batches
    return [m * size + tf.minimum(tf.constant(m, tf.int64), larger)
            for m in range(num_micro_batches)]


class InPlace:
    """A mini-batch whose micro-batches are read where they lie, by index (an int, or a loop's
    int32 scalar), as a looped schedule reads them: no split into M tensors up front.

    For a batch M divides statically, each tensor is viewed stacked, [M, micro-batch...]
    (`View`; along batch_dim 0 a reshape, which shares the mini-batch's buffer), and micro-batch
    m is the view's element m. For a batch known only when the step runs, micro-batch m is the
    examples [start_m, start_m + size_m) along batch_dim, of `Sizes`' sizes (the first N mod M
    one larger, the last ones empty when N < M).

    Args:
      inputs: the mini-batch (any nest; None leaves allowed), whose batch this reads.
      num_micro_batches: M.
      batch_dim: the batch dimension of every tensor.

    Raises:
      ValueError: for a static batch M does not divide (the loop's micro-batches are then of
        one shape; `PipeliningLayer` unrolls such a training step instead).
    """

    def __init__(self, inputs, num_micro_batches: int, batch_dim: int):
        self._num_micro_batches = num_micro_batches
        self._batch_dim = batch_dim
        batch_size = RunBatchSize(inputs, batch_dim)
        if isinstance(batch_size, int):
            if batch_size % num_micro_batches:
                raise ValueError(f'The looped schedule splits a static batch into micro-batches '
                                 f'of one shape: a batch of {batch_size} examples does not split '
                                 f'into {num_micro_batches}.')
            self.sizes = self._starts = None
            self._size = batch_size // num_micro_batches
        else:
            # Per micro-batch, its examples and the index of its first (int64 [M]).
            self.sizes = Sizes(batch_size, num_micro_batches)
            self._starts = tf.cumsum(self.sizes, exclusive=True)

    def View(self, x):
        """Mini-batch tensor `x` as `Slice` reads it: stacked for a static batch, else `x`."""
        if self.sizes is not None:
            return x
        m_count, batch_dim = self._num_micro_batches, self._batch_dim
        if batch_dim % x.shape.rank:
            return tf.stack(tf.split(x, m_count, axis=batch_dim))
        shape = tf.shape(x)
        stacked = tf.reshape(x, tf.concat([[m_count, shape[0] // m_count], shape[1:]], axis=0))
        size = x.shape[0]
        stacked.set_shape([m_count, None if size is None else size // m_count] + x.shape[1:])
        return stacked

    def Slice(self, x, m):
        """Micro-batch m of `x`, a tensor as `View` gives it."""
        if self.sizes is None:
            return x[m]
        start = self._starts[m]
        index = [slice(None)] * x.shape.rank
        index[self._batch_dim] = slice(start, start + self.sizes[m])
        return x[tuple(index)]

    def Start(self, m):
        """The index in the mini-batch of micro-batch m's first example (int64)."""
        if self._starts is None:
            return tf.cast(m, tf.int64) * self._size
        return self._starts[m]


def Split(inputs, num_micro_batches: int, batch_dim: int = 0) -> list:
    """Splits every tensor of `inputs` (any nest) into `num_micro_batches` parts along
    `batch_dim`: equal parts where M divides the batch, else the sizes of `Sizes` (the batch
    read when the step runs if it is not known statically).

    Returns:
      A list of M nests shaped like `inputs`.
    """
    flat = tf.nest.flatten(inputs)
    batch_size = RunBatchSize(inputs, batch_dim) if leaves.Present(inputs) else 0
    if isinstance(batch_size, int) and batch_size % num_micro_batches == 0:
        sizes = num_micro_batches  # Equal parts: tf.split's own static shapes.
    else:
        sizes = Sizes(batch_size, num_micro_batches)
    parts = [tf.split(x, sizes, axis=batch_dim, num=num_micro_batches) if x is not None
             else [None] * num_micro_batches for x in flat]
    return [tf.nest.pack_sequence_as(inputs, [p[m] for p in parts])
            for m in range(num_micro_batches)]


def UnlessEmpty(size, run, carried):
    """What `run()` gives for a micro-batch of `size` examples (an int, or an int64 scalar
    tensor for a batch known only when the step runs), without running it when there are none:
    a batch smaller than M leaves micro-batches empty, and a layer may not run on zero examples
    (a convolution of an empty batch fails; a reduction over none is NaN).

    Args:
      size: the micro-batch's examples.
      run: () -> (carried values, new values): what the action updates (running sums) and
        what it makes (outputs, residuals, gradients), nests of tensors or IndexedSlices.
      carried: (the carried values `run` built) -> the carried values as they are, which an
        empty micro-batch leaves unchanged; it reads only the structure of what it is given.

    Returns:
      (carried, new): `run()`'s, or for no example the carried values unchanged and zeros in
      place of the new ones, of their shapes with every unknown dimension (the batch's) 0. A
      static size runs `run` (a static batch is split into no empty micro-batch:
      `schedule.FirstMicroBatches`).
    """
    if isinstance(size, int):
        return run()
    built = []

    def Run():
        built.append(run())
        return leaves.Present(built[0])

    def Skip():
        changed, new = built[0]
        return leaves.Present((carried(changed), tf.nest.map_structure(_NoExamples, new)))

    results = tf.cond(size > 0, Run, Skip)
    values = iter(results or [])
    return tf.nest.map_structure(lambda x: None if x is None else next(values), built[0])


def _NoExamples(x):
    """Zeros like `x` with every dimension unknown statically made 0 (None stays None)."""
    if x is None:
        return None
    if x.shape.rank is None:
        return tf.zeros([0], x.dtype)
    return tf.zeros([0 if d is None else d for d in x.shape.as_list()], x.dtype)


def Padded(inputs, num_micro_batches: int, batch_dim: int = 0):
    """`inputs` with their last example repeated until M divides the batch (examples that are
    real values, so a layer computes nothing undefined on them), and the original batch size.
    Only for inference, where each example's output depends on that example alone.

    Returns:
      (the padded nest, the batch size before padding: an int or an int64 scalar tensor).
    """
    batch_size = RunBatchSize(inputs, batch_dim)
    if isinstance(batch_size, int) and batch_size % num_micro_batches == 0:
        return inputs, batch_size
    padded = -(-batch_size // num_micro_batches) * num_micro_batches
    index = tf.minimum(tf.range(padded, dtype=tf.int64), tf.cast(batch_size, tf.int64) - 1)
    return tf.nest.map_structure(
        lambda x: None if x is None else tf.gather(x, index, axis=batch_dim), inputs), batch_size


def Unpadded(outputs, batch_size, batch_dim: int = 0):
    """The first `batch_size` examples of `outputs` (`Padded`'s inverse)."""
    index = tf.range(batch_size, dtype=tf.int64)
    return tf.nest.map_structure(
        lambda x: None if x is None else tf.gather(x, index, axis=batch_dim), outputs)


def Concat(micro_batches: list, batch_dim: int = 0, sizes=None):
    """Concatenates a list of like-structured nests along `batch_dim`.

    Args:
      micro_batches: the nests.
      batch_dim: the dimension to concatenate along.
      sizes: None, or for micro-batches some of which may have been skipped as empty when the
        step ran (`UnlessEmpty`), their examples (an int64 tensor of shape [M]): a skipped
        one's zeros have 0 in every dimension unknown statically, which another dimension than
        the batch's may be, so it is then replaced by the first micro-batch without examples.

    Raises:
      ValueError: for an empty list (there is nothing to give the result its structure).
    """
    if not micro_batches:
        raise ValueError('Concat needs at least one micro-batch, got none.')
    flats = [tf.nest.flatten(mb) for mb in micro_batches]
    joined = []
    for parts in zip(*flats):
        if parts[0] is None:
            joined.append(None)
            continue
        if sizes is not None and not all(_OthersKnown(x.shape, batch_dim) for x in parts):
            first = parts[0]
            parts = [first] + [
                tf.cond(sizes[m] > 0, lambda x=x: x,
                        lambda: tf.gather(first, tf.zeros([0], tf.int32), axis=batch_dim))
                for m, x in enumerate(parts[1:], 1)]
        joined.append(tf.concat(list(parts), axis=batch_dim))
    return tf.nest.pack_sequence_as(micro_batches[0], joined)


def _OthersKnown(shape: tf.TensorShape, batch_dim: int) -> bool:
    """Whether every dimension of `shape` but the batch's is known statically."""
    if shape.rank is None:
        return False
    return all(d is not None for i, d in enumerate(shape.as_list())
               if i != batch_dim % shape.rank)
