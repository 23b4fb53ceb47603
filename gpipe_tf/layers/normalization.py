"""Normalization layers: batch norm (with GPipe's micro-batch semantics) and layer norm.

Under a narrower fprop_dtype (mixed precision) both compute their statistics (batch norm's
mean and variance, layer norm's moments) and their per-channel factors in dtype, float32, from
their weights as they are (not rounded to fprop_dtype), and normalise the activations in their
dtype.
"""

from __future__ import annotations

import tensorflow as tf

from gpipe_tf.layers import base_layer
from gpipe_tf.layers import basic
from gpipe_tf.layers import fprop_context
from gpipe_tf.layers.base_layer import BaseLayer, LayerMeta, WeightParams
from gpipe_tf.nested_map import NestedMap

# Approximate FLOPs per element: statistics (sum, centre, square, sum) and normalisation
# (centre, scale, shift, with gamma folded into the scale).
_NORM_FLOPS_PER_ELEMENT = 7


def _CheckRank2(shape, layer: str, dim: int) -> tf.TensorShape:
    shape = tf.TensorShape(shape)
    if shape.rank is None or shape.rank < 2:
        raise ValueError(f'{layer}: expected an input of rank >= 2, got shape {shape}.')
    basic.LastDim(shape, layer, dim)
    return shape


def _Normalize(x, mean, variance, offset, scale, epsilon):
    """`(x - mean) / sqrt(variance + epsilon) * scale + offset` in x's dtype, its per-channel
    factors computed in the statistics' (`tf.nn.batch_normalization` casts them to x's)."""
    dtype = mean.dtype
    return tf.nn.batch_normalization(x, mean, variance, tf.cast(offset, dtype),
                                     tf.cast(scale, dtype), epsilon)


class BatchNormLayer(BaseLayer):
    """Batch normalization over all axes but the last (channels), as in GPipe.

    Training normalises with the statistics of the batch FProp is given: in a pipeline, one
    micro-batch ("sufficient statistics ... are computed over each micro-batch", GPipe §2.2). It
    reports sufficient statistics, per channel `count` (elements reduced), `sum` and `sum_sq`,
    through `AddUpdate`. A pipeline sums them over its M micro-batches and calls `ApplyUpdate`
    once, so the moving averages take one step per mini-batch towards the mini-batch's mean and
    (biased) variance, exactly as one forward on the whole mini-batch would; outside a pipeline
    the update is applied at once. Evaluation normalises with the moving statistics.
    """

    WEIGHTS_IN_FPROP_DTYPE = False  # Combined with the statistics in dtype (`_Normalize`).

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('dim', 0, 'Number of channels (size of the last dimension).')
        p.Define('decay', 0.997, 'Moving average decay: moving = decay * moving + (1 - decay) * '
                 'batch value.')
        p.Define('epsilon', 1e-3, 'Added to the variance before taking its square root.')
        return p

    def __init__(self, params):
        super().__init__(params)
        p = self.p
        if p.dim <= 0:
            raise ValueError(f'{self.path}: dim must be positive, got {p.dim}.')
        if not 0.0 <= p.decay < 1.0:
            raise ValueError(f'{self.path}: decay must be in [0, 1), got {p.decay}.')
        constant = base_layer.WeightInit.Constant
        self.CreateVariable('beta', WeightParams((p.dim,), constant(0.0)))
        self.CreateVariable('gamma', WeightParams((p.dim,), constant(1.0)))
        self.CreateVariable('moving_mean', WeightParams((p.dim,), constant(0.0), trainable=False))
        self.CreateVariable('moving_variance',
                            WeightParams((p.dim,), constant(1.0), trainable=False))

    def FProp(self, theta, x):
        p = self.p
        _CheckRank2(x.shape, self.path, p.dim)
        if fprop_context.Current().training:
            # Statistics in dtype (float32 under a bfloat16 or float16 fprop_dtype), and so
            # their sums over micro-batches and the moving averages.
            mean, variance = tf.nn.moments(tf.cast(x, p.dtype),
                                           axes=list(range(x.shape.rank - 1)))
            count = tf.cast(tf.reduce_prod(tf.shape(x, out_type=tf.int64)[:-1]), p.dtype)
            # An empty micro-batch (a batch smaller than M) has NaN moments and adds nothing.
            self.AddUpdate(NestedMap(
                    count=tf.stop_gradient(count),
                    sum=tf.stop_gradient(tf.math.multiply_no_nan(mean, count)),
                    sum_sq=tf.stop_gradient(tf.math.multiply_no_nan(
                        variance + tf.square(mean), count))))
        else:
            mean, variance = theta.moving_mean, theta.moving_variance
        return _Normalize(x, mean, variance, theta.beta, theta.gamma, p.epsilon)

    def ApplyUpdate(self, stats: NestedMap):
        """Moves the moving statistics one step towards the mean and variance of `stats`.

        Args:
            stats: NestedMap(count, sum, sum_sq), as FProp reports them or summed over
                micro-batches.

        Returns:
            The grouped assign op (None when executing eagerly).
        """
        decay = self.p.decay
        moving_mean = self.vars.moving_mean
        moving_variance = self.vars.moving_variance
        mean = stats.sum / stats.count
        # E[x^2] - E[x]^2 can come out slightly negative through rounding.
        variance = tf.maximum(stats.sum_sq / stats.count - tf.square(mean), 0.0)
        return tf.group(
                moving_mean.assign(decay * moving_mean + (1.0 - decay) * mean),
                moving_variance.assign(decay * moving_variance + (1.0 - decay) * variance))

    @classmethod
    def FPropMeta(cls, p, x_shape):
        out = _CheckRank2(x_shape, p.name or cls.__name__, p.dim)
        # The gradients of the statistics and of the scale read the input, none the output.
        return LayerMeta(out, _NORM_FLOPS_PER_ELEMENT * out.num_elements(), 4 * p.dim,
                         base_layer.ActivationBytes(out, p), reads_input=True,
                         reads_output=False)


class LayerNormLayer(BaseLayer):
    """Layer normalization over the last dimension, then `* scale + bias`."""

    WEIGHTS_IN_FPROP_DTYPE = False  # Combined with the moments in dtype (`_Normalize`).

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('input_dim', 0, 'Size of the last dimension, which is normalised.')
        p.Define('epsilon', 1e-6, 'Added to the variance before taking its square root.')
        return p

    def __init__(self, params):
        super().__init__(params)
        p = self.p
        if p.input_dim <= 0:
            raise ValueError(f'{self.path}: input_dim must be positive, got {p.input_dim}.')
        constant = base_layer.WeightInit.Constant
        self.CreateVariable('scale', WeightParams((p.input_dim,), constant(1.0)))
        self.CreateVariable('bias', WeightParams((p.input_dim,), constant(0.0)))

    def FProp(self, theta, x):
        p = self.p
        basic.LastDim(x.shape, self.path, p.input_dim)
        mean, variance = tf.nn.moments(tf.cast(x, p.dtype), axes=[-1], keepdims=True)
        return _Normalize(x, mean, variance, theta.bias, theta.scale, p.epsilon)

    @classmethod
    def FPropMeta(cls, p, x_shape):
        basic.LastDim(x_shape, p.name or cls.__name__, p.input_dim)
        out = tf.TensorShape(x_shape)
        return LayerMeta(out, _NORM_FLOPS_PER_ELEMENT * out.num_elements(), 2 * p.input_dim,
                         base_layer.ActivationBytes(out, p))
