"""Basic layers: dense projection, activations, dropout, identity."""

from __future__ import annotations

import tensorflow as tf

from gpipe_tf.layers import base_layer
from gpipe_tf.layers import example_random
from gpipe_tf.layers import fprop_context
from gpipe_tf.layers.base_layer import BaseLayer, LayerMeta, WeightParams

# Elementwise activations, with the FLOPs FPropMeta charges per element.
ACTIVATIONS = {
    'none': (lambda x: x, 0),
    'relu': (tf.nn.relu, 1),
    'relu6': (tf.nn.relu6, 2),
    'gelu': (tf.nn.gelu, 8),
    'sigmoid': (tf.sigmoid, 4),
    'tanh': (tf.tanh, 4),
    'swish': (tf.nn.swish, 5),
}


def CheckActivation(name: str) -> None:
    if name not in ACTIVATIONS:
        raise ValueError(f'Unknown activation {name!r}; expected one of {sorted(ACTIVATIONS)}.')


def LastDim(shape: tf.TensorShape, layer: str, expected: int | None = None) -> int:
    """The last dimension of `shape`, checked against `expected` when both are known."""
    shape = tf.TensorShape(shape)
    if shape.rank is None or shape.rank < 1:
        raise ValueError(f'{layer}: expected an input of rank >= 1, got shape {shape}.')
    if expected is not None and shape[-1] is not None and shape[-1] != expected:
        raise ValueError(f'{layer}: expected input last dimension {expected}, got shape {shape}.')
    return shape[-1]


class DenseLayer(BaseLayer):
    """Projection `act(x @ w + b)` over the last dimension."""

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('input_dim', 0, 'Size of the input\'s last dimension.')
        p.Define('output_dim', 0, 'Size of the output\'s last dimension.')
        p.Define('activation', 'none', f'Activation: one of {sorted(ACTIVATIONS)}.')
        p.Define('has_bias', True, 'Whether to add a bias.')
        p.Define('bias_init', 0.0, 'Initial value of the bias.')
        return p

    def __init__(self, params):
        super().__init__(params)
        p = self.p
        if p.input_dim <= 0 or p.output_dim <= 0:
            raise ValueError(f'{self.path}: input_dim and output_dim must be positive, got '
                             f'{p.input_dim} and {p.output_dim}.')
        CheckActivation(p.activation)
        self.CreateVariable('w', WeightParams((p.input_dim, p.output_dim)))
        if p.has_bias:
            self.CreateVariable(
                'b', WeightParams((p.output_dim,), base_layer.WeightInit.Constant(p.bias_init)))

    def FProp(self, theta, x):
        p = self.p
        LastDim(x.shape, self.path, p.input_dim)
        if x.shape.rank == 2:
            y = tf.matmul(x, theta.w)
        else:  # One matmul over all leading dimensions.
            y = tf.reshape(tf.matmul(tf.reshape(x, [-1, p.input_dim]), theta.w),
                           tf.concat([tf.shape(x)[:-1], [p.output_dim]], 0))
        if p.has_bias:
            y += theta.b
        return ACTIVATIONS[p.activation][0](y)

    @classmethod
    def FPropMeta(cls, p, x_shape):
        LastDim(x_shape, p.name or cls.__name__, p.input_dim)
        if not tf.TensorShape(x_shape).is_fully_defined():
            raise ValueError(f'{p.name or cls.__name__}: FPropMeta needs a fully defined input '
                             f'shape, got {x_shape}.')
        out = tf.TensorShape(x_shape)[:-1].concatenate([p.output_dim])
        rows = tf.TensorShape(x_shape)[:-1].num_elements()
        flops = 2 * rows * p.input_dim * p.output_dim
        flops += out.num_elements() * (int(p.has_bias) + ACTIVATIONS[p.activation][1])
        # The weight gradient reads the input; an activation's gradient reads its output (or
        # its input, of the same size: gelu, swish).
        return LayerMeta(out, flops, p.input_dim * p.output_dim + p.output_dim * p.has_bias,
                         base_layer.ActivationBytes(out, p), reads_input=True,
                         reads_output=p.activation != 'none')


class ActivationLayer(BaseLayer):
    """An elementwise activation."""

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('activation', 'relu', f'Activation: one of {sorted(ACTIVATIONS)}.')
        return p

    def __init__(self, params):
        super().__init__(params)
        CheckActivation(self.p.activation)

    def FProp(self, theta, x):
        return ACTIVATIONS[self.p.activation][0](x)

    @classmethod
    def FPropMeta(cls, p, x_shape):
        out = tf.TensorShape(x_shape)
        # Its gradient reads its output (or its input, of the same size: gelu, swish).
        return LayerMeta(out, out.num_elements() * ACTIVATIONS[p.activation][1], 0,
                         base_layer.ActivationBytes(out, p), reads_input=False,
                         reads_output=p.activation != 'none')


class IdentityLayer(BaseLayer):
    """Returns its inputs unchanged."""

    def FProp(self, theta, *inputs):
        return inputs[0] if len(inputs) == 1 else inputs

    @classmethod
    def FPropMeta(cls, p, *input_shapes):
        out = input_shapes[0] if len(input_shapes) == 1 else tuple(input_shapes)
        return LayerMeta(out, 0, 0, 0)


class DropoutLayer(BaseLayer):
    """Inverted dropout whose mask is a pure function of (seed, layer, step, example).

    Each example's mask is drawn from its index in the mini-batch (`example_random.Uniform`), so
    it is the same whether the example is in the whole batch or in any micro-batch or replica's
    shard (M and R do not change it); being stateless, a re-materialized forward draws exactly
    the first forward's mask. A mask broadcast along the batch dimension is one for the step.
    """

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('keep_prob', 1.0, 'Probability of keeping an element, in (0, 1].')
        p.Define('noise_shape_broadcast_dims', None,
                 'Dimensions where the mask is broadcast (e.g. [1] for one mask per sequence).')
        return p

    def __init__(self, params):
        super().__init__(params)
        if not 0.0 < self.p.keep_prob <= 1.0:
            raise ValueError(f'{self.path}: keep_prob must be in (0, 1], got {self.p.keep_prob}.')

    def FProp(self, theta, x):
        p = self.p
        if p.keep_prob == 1.0 or not fprop_context.Current().training:
            return x
        shape = tf.shape(x)
        if p.noise_shape_broadcast_dims:
            shape = tf.tensor_scatter_nd_update(
                shape, [[d] for d in p.noise_shape_broadcast_dims],
                tf.ones([len(p.noise_shape_broadcast_dims)], shape.dtype))
        batch_dim = fprop_context.Current().batch_dim % x.shape.rank
        if batch_dim in [d % x.shape.rank for d in p.noise_shape_broadcast_dims or []]:
            uniform = tf.random.stateless_uniform(shape, self.StepSeed())
        else:
            uniform = example_random.Uniform(self.StepSeed(), shape)
        keep = tf.cast(uniform < p.keep_prob, x.dtype)
        return x * keep / p.keep_prob

    @classmethod
    def FPropMeta(cls, p, x_shape):
        out = tf.TensorShape(x_shape)
        return LayerMeta(out, 3 * out.num_elements(), 0, base_layer.ActivationBytes(out, p))
