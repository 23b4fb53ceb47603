"""Constants the step's graph computes each time instead of holding.

TensorFlow's constant folding (grappler's, and the function runtime's own) replaces every
tensor computed from constants alone, up to 10 MiB each, by a constant kept in memory for as
long as the graph lives. A step's zeros and ones are such tensors: the zero gradient sums a
looped schedule starts from (the size of the weights), the 1 a micro-batch's backward starts
from, which a mean's gradient broadcasts to the size of the outputs, per micro-batch. Made here,
they start from a scalar the optimizers cannot see through (a stateful copy) and cost a fill
per step. XLA, which has no such copy, compiles the step whole and keeps its own constants.
"""

from __future__ import annotations

import tensorflow as tf
# Whether a step is being compiled by XLA is not public API; tf.function reads it this way.
from tensorflow.python.ops import control_flow_util  # pylint: disable=g-direct-tensorflow-import


def Scalar(value, dtype) -> tf.Tensor:
    """`value` as a scalar of `dtype` that no graph optimizer folds."""
    x = tf.constant(value, tf.float32)
    if not control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
        x = tf.raw_ops.DeepCopy(x=x)  # Stateful: neither folder evaluates it.
    return tf.cast(x, dtype)


def Zeros(shape, dtype) -> tf.Tensor:
    """tf.zeros(shape, dtype), filled when the step runs."""
    return tf.fill(shape, Scalar(0, dtype))


def ZerosLike(x: tf.Tensor) -> tf.Tensor:
    """tf.zeros_like(x), filled when the step runs (x's static shape if it is known)."""
    shape = x.shape if x.shape.is_fully_defined() else tf.shape(x)
    return Zeros(shape, x.dtype)
