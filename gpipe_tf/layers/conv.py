"""Convolutions over NHWC images: standard, depthwise and depthwise-separable.

Window geometry follows TensorFlow's: `OutputSize` is the arithmetic `tf.nn.convolution` and
`tf.nn.pool` use, so `FPropMeta` predicts the shapes `FProp` produces. FLOPs count every output
position's full window, padded positions included (a multiply-add counts 2).
"""

from __future__ import annotations

import tensorflow as tf

from gpipe_tf.layers import base_layer
from gpipe_tf.layers import basic
from gpipe_tf.layers import sequential
from gpipe_tf.layers.base_layer import BaseLayer, LayerMeta, WeightParams

PADDINGS = ('SAME', 'VALID')


def CheckPadding(padding: str, layer: str) -> None:
    """Raises ValueError unless `padding` is one of PADDINGS."""
    if padding not in PADDINGS:
        raise ValueError(f'{layer}: unknown padding {padding!r}; expected one of {PADDINGS}.')


def CheckPositiveInts(value, length: int, what: str, layer: str) -> tuple:
    """`value` as a tuple, checked to be `length` positive ints."""
    if (not isinstance(value, (tuple, list)) or len(value) != length or
            not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        raise ValueError(f'{layer}: {what} must be {length} positive ints, got {value!r}.')
    return tuple(value)


def OutputSize(in_size: int, window: int, stride: int, padding: str, dilation: int = 1) -> int:
    """Output length of a window sliding over `in_size` positions, as TensorFlow computes it.

    SAME pads so that every stride-th position yields an output: ceil(in / stride). VALID keeps only
    windows that fit inside the input; a dilated window spans (window - 1) * dilation + 1 positions.

    Raises:
        ValueError: if a VALID window is larger than the input.
    """
    if padding == 'SAME':
        return -(-in_size // stride)
    span = (window - 1) * dilation + 1
    if in_size < span:
        raise ValueError(f'VALID window spanning {span} does not fit input size {in_size}.')
    return (in_size - span) // stride + 1


def ImageShape(shape, layer: str, channels: int | None = None) -> tuple[int, int, int, int]:
    """(batch, height, width, channels) of a fully defined NHWC shape, channels checked."""
    shape = tf.TensorShape(shape)
    if shape.rank != 4 or not shape.is_fully_defined():
        raise ValueError(f'{layer}: expected a fully defined NHWC shape, got {shape}.')
    if channels is not None and shape[-1] != channels:
        raise ValueError(f'{layer}: expected {channels} input channels, got shape {shape}.')
    return tuple(shape.as_list())


class _WindowConvLayer(BaseLayer):
    """What Conv2DLayer and DepthwiseConv2DLayer share: the window, the bias, the activation.

    Subclasses define how a filter shape maps to channels, and the convolution op.
    """

    _FILTER_SHAPE_DOC = 'Filter shape (height, width, in_channels, ...).'

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('filter_shape', (0, 0, 0, 0), cls._FILTER_SHAPE_DOC)
        p.Define('filter_stride', (1, 1), 'Stride (height, width).')
        p.Define('dilation_rate', (1, 1),
                 'Dilation (height, width); TensorFlow needs stride 1 where it is > 1.')
        p.Define('padding', 'SAME', f'Padding: one of {PADDINGS}.')
        p.Define('activation', 'none', f'Activation: one of {sorted(basic.ACTIVATIONS)}.')
        p.Define('has_bias', True, 'Whether to add a bias per output channel.')
        p.Define('bias_init', 0.0, 'Initial value of the bias.')
        return p

    @classmethod
    def _CheckParams(cls, p, layer: str) -> None:
        CheckPositiveInts(p.filter_shape, 4, 'filter_shape', layer)
        strides = CheckPositiveInts(p.filter_stride, 2, 'filter_stride', layer)
        dilations = CheckPositiveInts(p.dilation_rate, 2, 'dilation_rate', layer)
        if max(strides) > 1 and max(dilations) > 1:
            raise ValueError(f'{layer}: filter_stride {strides} > 1 cannot be combined with '
                             f'dilation_rate {dilations} > 1.')
        CheckPadding(p.padding, layer)
        basic.CheckActivation(p.activation)

    @classmethod
    def _OutChannels(cls, filter_shape) -> int:
        raise NotImplementedError(cls.__name__)

    @classmethod
    def _FanInChannels(cls, filter_shape) -> int:
        """Input channels each output sums over."""
        raise NotImplementedError(cls.__name__)

    def _Convolve(self, x: tf.Tensor, w: tf.Tensor) -> tf.Tensor:
        raise NotImplementedError(type(self).__name__)

    def __init__(self, params):
        super().__init__(params)
        p = self.p
        self._CheckParams(p, self.path)
        self.CreateVariable('w', WeightParams(tuple(p.filter_shape)))
        if p.has_bias:
            self.CreateVariable('b', WeightParams((self._OutChannels(p.filter_shape),),
                                                  base_layer.WeightInit.Constant(p.bias_init)))

    def FProp(self, theta, x):
        p = self.p
        if x.shape.rank != 4:
            raise ValueError(f'{self.path}: expected an NHWC input, got shape {x.shape}.')
        basic.LastDim(x.shape, self.path, p.filter_shape[2])
        y = self._Convolve(x, theta.w)
        if p.has_bias:
            y += theta.b
        return basic.ACTIVATIONS[p.activation][0](y)

    @classmethod
    def FPropMeta(cls, p, x_shape):
        layer = p.name or cls.__name__
        cls._CheckParams(p, layer)
        kh, kw, cin, _ = p.filter_shape
        n, h, w, _ = ImageShape(x_shape, layer, cin)
        try:
            out_h = OutputSize(h, kh, p.filter_stride[0], p.padding, p.dilation_rate[0])
            out_w = OutputSize(w, kw, p.filter_stride[1], p.padding, p.dilation_rate[1])
        except ValueError as e:
            raise ValueError(f'{layer}: {e}') from None
        out_c = cls._OutChannels(p.filter_shape)
        out = tf.TensorShape([n, out_h, out_w, out_c])
        outputs = out.num_elements()
        window_fan_in = kh * kw * cls._FanInChannels(p.filter_shape)
        flops = 2 * outputs * window_fan_in
        flops += outputs * (int(p.has_bias) + basic.ACTIVATIONS[p.activation][1])
        num_params = kh * kw * cin * p.filter_shape[3] + out_c * int(p.has_bias)
        # The filter's gradient reads the input; an activation's gradient reads its output.
        return LayerMeta(out, flops, num_params, base_layer.ActivationBytes(out, p),
                         reads_input=True, reads_output=p.activation != 'none')


class Conv2DLayer(_WindowConvLayer):
    """2-D convolution `act(conv(x, w) + b)` of NHWC inputs.

    The filter has shape `filter_shape` = (height, width, in_channels, out_channels).
    """

    _FILTER_SHAPE_DOC = 'Filter shape (height, width, in_channels, out_channels).'

    @classmethod
    def _OutChannels(cls, filter_shape) -> int:
        return filter_shape[3]

    @classmethod
    def _FanInChannels(cls, filter_shape) -> int:
        return filter_shape[2]

    def _Convolve(self, x, w):
        p = self.p
        return tf.nn.convolution(x, w, strides=list(p.filter_stride), padding=p.padding,
                                 dilations=list(p.dilation_rate))


class DepthwiseConv2DLayer(_WindowConvLayer):
    """Depthwise 2-D convolution: each input channel is convolved with its own filters.

    The filter has shape `filter_shape` = (height, width, in_channels, channel_multiplier); the
    output has in_channels * channel_multiplier channels (input channel i gives outputs
    i * channel_multiplier ... (i + 1) * channel_multiplier - 1, as `tf.nn.depthwise_conv2d`).
    """

    _FILTER_SHAPE_DOC = 'Filter shape (height, width, in_channels, channel_multiplier).'

    @classmethod
    def _OutChannels(cls, filter_shape) -> int:
        return filter_shape[2] * filter_shape[3]

    @classmethod
    def _FanInChannels(cls, filter_shape) -> int:
        return 1

    def _Convolve(self, x, w):
        p = self.p
        return tf.nn.depthwise_conv2d(x, w, strides=[1, *p.filter_stride, 1], padding=p.padding,
                                      dilations=list(p.dilation_rate))


class SeparableConv2DLayer(BaseLayer):
    """Depthwise-separable convolution: a depthwise convolution, then a 1x1 pointwise one.

    Built from two children, `depthwise` (the window, no bias, no activation) and `pointwise`
    (1x1, with the bias and the activation), so its variables are `depthwise.w`, `pointwise.w`
    and `pointwise.b`.
    """

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('filter_shape', (0, 0, 0, 0),
                 'Filter shape (height, width, in_channels, out_channels).')
        p.Define('channel_multiplier', 1,
                 'Depthwise outputs per input channel; the pointwise input has '
                 'in_channels * channel_multiplier channels.')
        p.Define('filter_stride', (1, 1), 'Stride (height, width) of the depthwise window.')
        p.Define('dilation_rate', (1, 1),
                 'Dilation (height, width) of the depthwise window; needs stride 1 where > 1.')
        p.Define('padding', 'SAME', f'Padding of the depthwise window: one of {PADDINGS}.')
        p.Define('activation', 'none', f'Activation: one of {sorted(basic.ACTIVATIONS)}.')
        p.Define('has_bias', True, 'Whether to add a bias per output channel.')
        p.Define('bias_init', 0.0, 'Initial value of the bias.')
        return p

    @classmethod
    def _ChildParams(cls, p, layer: str) -> list:
        """Params of the depthwise and the pointwise child, in the order they are applied."""
        kh, kw, cin, cout = CheckPositiveInts(p.filter_shape, 4, 'filter_shape', layer)
        if (not isinstance(p.channel_multiplier, int) or isinstance(p.channel_multiplier, bool)
                or p.channel_multiplier < 1):
            raise ValueError(
                f'{layer}: channel_multiplier must be a positive int, got '
                f'{p.channel_multiplier!r}.')
        depthwise = DepthwiseConv2DLayer.Params().Set(
                name='depthwise', dtype=p.dtype, params_init=p.params_init.Copy(),
                random_seed=p.random_seed, filter_shape=(kh, kw, cin, p.channel_multiplier),
                filter_stride=tuple(p.filter_stride), dilation_rate=tuple(p.dilation_rate),
                padding=p.padding, has_bias=False)
        pointwise = Conv2DLayer.Params().Set(
                name='pointwise', dtype=p.dtype, params_init=p.params_init.Copy(),
                random_seed=p.random_seed, filter_shape=(1, 1, cin * p.channel_multiplier, cout),
                activation=p.activation, has_bias=p.has_bias, bias_init=p.bias_init)
        return [depthwise, pointwise]

    def __init__(self, params):
        super().__init__(params)
        depthwise, pointwise = self._ChildParams(self.p, self.path)
        self.CreateChild('depthwise', depthwise)
        self.CreateChild('pointwise', pointwise)

    def FProp(self, theta, x):
        y = self.depthwise.FProp(theta.depthwise, x)
        return self.pointwise.FProp(theta.pointwise, y)

    @classmethod
    def FPropMeta(cls, p, x_shape):
        layer = p.name or cls.__name__
        children = cls._ChildParams(p, layer)
        for child in children:
            child.name = f'{layer}.{child.name}'
        return sequential.ChainMeta(children, x_shape)[0]
