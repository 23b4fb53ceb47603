"""Pooling of NHWC images: windowed (max or average) and global over height and width.

FLOPs count one operation (a comparison or an addition) per window element of every output,
plus one division per output for averages.
"""

from __future__ import annotations

import tensorflow as tf

from gpipe_tf.layers import base_layer
from gpipe_tf.layers import conv
from gpipe_tf.layers.base_layer import BaseLayer, LayerMeta

POOLING_TYPES = ('MAX', 'AVG')


def CheckPoolingType(pooling_type: str, layer: str) -> None:
    """Raises ValueError unless `pooling_type` is one of POOLING_TYPES."""
    if pooling_type not in POOLING_TYPES:
        raise ValueError(f'{layer}: unknown pooling_type {pooling_type!r}; expected one of '
                         f'{POOLING_TYPES}.')


class Pooling2DLayer(BaseLayer):
    """Max or average pooling over windows of height and width.

    Average pooling with SAME padding divides by the number of input positions inside each
    window, not counting padding (as `tf.nn.avg_pool2d`).
    """

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('pooling_type', 'MAX', f'One of {POOLING_TYPES}.')
        p.Define('window_shape', (2, 2), 'Window (height, width).')
        p.Define('window_stride', (2, 2), 'Stride (height, width).')
        p.Define('padding', 'VALID', f'Padding: one of {conv.PADDINGS}.')
        return p

    @classmethod
    def _CheckParams(cls, p, layer: str) -> None:
        CheckPoolingType(p.pooling_type, layer)
        conv.CheckPositiveInts(p.window_shape, 2, 'window_shape', layer)
        conv.CheckPositiveInts(p.window_stride, 2, 'window_stride', layer)
        conv.CheckPadding(p.padding, layer)

    def __init__(self, params):
        super().__init__(params)
        self._CheckParams(self.p, self.path)

    def FProp(self, theta, x):
        p = self.p
        if x.shape.rank != 4:
            raise ValueError(f'{self.path}: expected an NHWC input, got shape {x.shape}.')
        pool = tf.nn.max_pool2d if p.pooling_type == 'MAX' else tf.nn.avg_pool2d
        return pool(x, ksize=list(p.window_shape), strides=list(p.window_stride),
                    padding=p.padding)

    @classmethod
    def FPropMeta(cls, p, x_shape):
        layer = p.name or cls.__name__
        cls._CheckParams(p, layer)
        n, h, w, c = conv.ImageShape(x_shape, layer)
        (kh, kw), (sh, sw) = p.window_shape, p.window_stride
        try:
            out = tf.TensorShape([n, conv.OutputSize(h, kh, sh, p.padding),
                                  conv.OutputSize(w, kw, sw, p.padding), c])
        except ValueError as e:
            raise ValueError(f'{layer}: {e}') from None
        flops = out.num_elements() * (kh * kw + int(p.pooling_type == 'AVG'))
        # Max pooling's gradient reads its input and output (where the maxima were); average
        # pooling's only the input's static shape.
        is_max = p.pooling_type == 'MAX'
        return LayerMeta(out, flops, 0, base_layer.ActivationBytes(out, p), reads_input=is_max,
                         reads_output=is_max)


class GlobalPoolingLayer(BaseLayer):
    """Max or average over height and width: [N, H, W, C] -> [N, C] (or [N, 1, 1, C])."""

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('pooling_type', 'AVG', f'One of {POOLING_TYPES}.')
        p.Define('keepdims', False, 'Whether to keep height and width as size-1 dimensions.')
        return p

    def __init__(self, params):
        super().__init__(params)
        CheckPoolingType(self.p.pooling_type, self.path)

    def FProp(self, theta, x):
        p = self.p
        if x.shape.rank != 4:
            raise ValueError(f'{self.path}: expected an NHWC input, got shape {x.shape}.')
        reduce = tf.reduce_max if p.pooling_type == 'MAX' else tf.reduce_mean
        return reduce(x, axis=[1, 2], keepdims=p.keepdims)

    @classmethod
    def FPropMeta(cls, p, x_shape):
        layer = p.name or cls.__name__
        CheckPoolingType(p.pooling_type, layer)
        n, h, w, c = conv.ImageShape(x_shape, layer)
        out = tf.TensorShape([n, 1, 1, c] if p.keepdims else [n, c])
        flops = n * h * w * c + n * c * int(p.pooling_type == 'AVG')
        return LayerMeta(out, flops, 0, base_layer.ActivationBytes(out, p))
