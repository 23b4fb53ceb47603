"""Weight gradients summed over micro-batches and replicas, dense or sparse.

A gather's gradient (an embedding table's) is `tf.IndexedSlices`: the rows the micro-batch
read and their gradients. Its sum over micro-batches stays one: the rows and values of every
micro-batch concatenated in micro-batch order, which is the mini-batch's own gradient of the
gather, row for row (the micro-batches are consecutive slices of the mini-batch), so an
optimizer with a sparse update (Keras's, the v1 optimizers' `_apply_sparse`) updates the
rows as it would for the un-partitioned layers. Made dense, a 32k x 2048 table's gradient is
256 MiB per cell whatever the batch; its slices are the batch's tokens times 2048.
"""

from __future__ import annotations

import tensorflow as tf

from gpipe_tf.pipeline import unfolded


def Add(total, grad):
    """`total + grad` for gradients of one weight (tensors or IndexedSlices; None: nothing):
    two IndexedSlices are concatenated, a dense one makes the sum dense."""
    if total is None:
        return grad
    if grad is None:
        return total
    if isinstance(total, tf.IndexedSlices) and isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(
            tf.concat([total.values, grad.values], axis=0),
            tf.concat([total.indices, tf.cast(grad.indices, total.indices.dtype)], axis=0),
            total.dense_shape)
    return tf.convert_to_tensor(total) + tf.convert_to_tensor(grad)


def AddAll(grads: list):
    """The sum of a list of gradients of one weight (`Add`); None for an empty list."""
    total = None
    for grad in grads:
        total = Add(total, grad)
    return total


def Zero(weight, like):
    """A gradient of `weight` (a tensor of the weight's static shape) that adds nothing, of
    the kind of `like`: IndexedSlices of no rows, or zeros filled when the step runs
    (`unfolded`)."""
    if isinstance(like, tf.IndexedSlices):
        shape = weight.shape
        return tf.IndexedSlices(
            unfolded.Zeros([0] + shape[1:].as_list(), like.values.dtype),
            tf.zeros([0], like.indices.dtype),
            tf.constant(shape.as_list(), (like.dense_shape.dtype if like.dense_shape is not None
                                          else tf.int64)))
    return unfolded.Zeros(weight.shape, like.dtype)


def Placed(grad, device_fn):
    """`grad` with `device_fn` (tensor -> tensor: an XLA logical device's annotation) applied
    to it, or to the values of IndexedSlices, which stay IndexedSlices."""
    if grad is None:
        return None
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(device_fn(grad.values), grad.indices, grad.dense_shape)
    return device_fn(tf.convert_to_tensor(grad))
