"""AmoebaNet's genotypes and the layers of each cell operation, after TensorFlow's reference.

The genotypes are the reference's `model_specs.py` (tensorflow/tpu, models/official/amoeba_net);
`OperationLayers` builds one operation of a cell as the reference's `_apply_operation` does, as
a list of existing layers' Params; `FactorizedReductionLayer` is its `factorized_reduction`. The
cells, stem and heads that use them are in `gpipe_tf.models.amoebanet.network`.
"""

from __future__ import annotations

import dataclasses
import re

import tensorflow as tf

from gpipe_tf.layers import base_layer
from gpipe_tf.layers import basic
from gpipe_tf.layers import conv
from gpipe_tf.layers import normalization
from gpipe_tf.layers import pooling
from gpipe_tf.layers import sequential
from gpipe_tf.layers.base_layer import BaseLayer, LayerMeta


# ---- genotypes ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CellSpec:
    """One cell type of a genotype, in the reference's encoding (`model_specs.py`).

    Combination i (of 5) applies operations[2i] to state hiddenstate_indices[2i] and
    operations[2i+1] to state hiddenstate_indices[2i+1] and adds the two, giving state i + 2.
    States 0 and 1 are the cell's two inputs. The output concatenates, on channels, the states
    whose used_hiddenstates entry is 0.
    """
    operations: tuple
    hiddenstate_indices: tuple
    used_hiddenstates: tuple


@dataclasses.dataclass(frozen=True)
class Genotype:
    normal: CellSpec
    reduction: CellSpec


GENOTYPES = {
    # The normal cell concatenates states 0, 3, 4 and 6, as the TF reference does (the AmoebaNet
    # paper's figure reads [4, 5, 6]); this is what reproduces GPipe's Table 1 parameter counts.
    'amoeba_net_d': Genotype(
        normal=CellSpec(
            ('1x1', 'max_pool_3x3', 'none', '1x7_7x1', '1x1', '1x7_7x1', 'max_pool_3x3', 'none',
             'avg_pool_3x3', '1x1'),
            (1, 1, 1, 0, 0, 0, 2, 2, 1, 5),
            (0, 1, 1, 0, 0, 1, 0)),
        reduction=CellSpec(
            ('max_pool_2x2', 'max_pool_3x3', 'none', '3x3', '1x7_7x1', 'max_pool_3x3', 'none',
             'max_pool_2x2', 'avg_pool_3x3', '1x1'),
            (0, 0, 2, 1, 2, 2, 3, 1, 2, 3),
            (1, 1, 1, 1, 0, 0, 0))),
    'amoeba_net_b': Genotype(
        normal=CellSpec(
            ('1x1', 'max_pool_3x3', 'none', 'separable_3x3_2', '1x1', 'separable_3x3_2', '1x1',
             'none', 'avg_pool_3x3', '1x1'),
            (1, 1, 1, 0, 1, 0, 2, 2, 1, 5),
            (0, 1, 1, 0, 0, 1, 0)),
        reduction=CellSpec(
            ('max_pool_2x2', 'max_pool_3x3', 'none', '3x3', 'dil_2_separable_5x5_2',
             'max_pool_3x3', 'none', 'separable_3x3_2', 'avg_pool_3x3', '1x1'),
            (0, 0, 2, 1, 2, 2, 3, 1, 4, 3),
            (1, 1, 1, 1, 1, 0, 0))),
}

NUM_COMBINATIONS = 5  # Per cell; see CellSpec.
_POOL_RE = re.compile(r'^(max|avg)_pool_(\d+)x\2$')
_SEPARABLE_RE = re.compile(r'^(?:dil_(\d+)_)?separable_(\d+)x\2_(\d+)$')
# Bottlenecked convolutions: the kernels applied in turn, and the bottleneck width per filter.
_BOTTLENECK_OPS = {'3x3': (((3, 3),), 1 / 4), '1x7_7x1': (((1, 7), (7, 1)), 1 / 4),
                   '1x3_3x1': (((1, 3), (3, 1)), 3 / 8)}


# ---- building blocks (lists of existing layers' Params) ----------------------------------------
def DefineBatchNorm(p) -> None:
    """Defines the batch norm settings that BatchNorm reads on a layer's Params."""
    p.Define('batch_norm_decay', 0.9997, 'Decay of the batch norms\' moving averages.')
    p.Define('batch_norm_epsilon', 1e-3, 'Epsilon of the batch norms.')


def _Relu(name: str, p):
    return basic.ActivationLayer.Params().Set(name=name, activation='relu', dtype=p.dtype)


def Conv(name: str, p, kernel, cin: int, cout: int, stride=(1, 1), padding='SAME'):
    """A bias-free Conv2DLayer from cin to cout channels."""
    return conv.Conv2DLayer.Params().Set(
        name=name, dtype=p.dtype, params_init=p.params_init.Copy(),
        filter_shape=(kernel[0], kernel[1], cin, cout), filter_stride=tuple(stride),
        padding=padding, has_bias=False)


def BatchNorm(name: str, p, dim: int):
    """A BatchNormLayer over dim channels, with p's batch norm settings."""
    return normalization.BatchNormLayer.Params().Set(
        name=name, dtype=p.dtype, dim=dim, decay=p.batch_norm_decay,
        epsilon=p.batch_norm_epsilon)


def ReluConvBn(tag: str, p, kernel, cin: int, cout: int, stride=(1, 1)) -> list:
    """ReLU, then Conv, then BatchNorm: the reference's usual unit."""
    return [_Relu(f'relu_{tag}', p), Conv(f'conv_{tag}', p, kernel, cin, cout, stride),
            BatchNorm(f'bn_{tag}', p, cout)]


def Sequence(p, layers: list):
    """A SequentialLayer running `layers` in order."""
    return sequential.SequentialLayer.Params().Set(sub=layers, dtype=p.dtype)


def OperationLayers(op: str, cin: int, filters: int, stride: int, p) -> list:
    """The layers of one cell operation, as the reference's `_apply_operation` builds it.

    Args:
      op: the operation's name in the genotype ('1x1', 'none', 'max_pool_3x3', '1x7_7x1',
        'separable_3x3_2', 'dil_2_separable_5x5_2', ...).
      cin: channels of the state the operation reads.
      filters: channels of the cell's states (the operation's output).
      stride: 2 in a reduction cell on its two inputs, else 1.
      p: Params with dtype, params_init and the batch norm settings.

    Returns:
      Layer Params applied in order; empty for the identity.

    Raises:
      ValueError: for an unknown operation.
    """
    strides = (stride, stride)
    if op in ('none', '1x1'):
        if op == '1x1' or stride > 1 or cin != filters:
            return ReluConvBn('1x1', p, (1, 1), cin, filters, strides)
        return []
    match = _POOL_RE.match(op)
    if match:
        size = int(match.group(2))
        layers = [pooling.Pooling2DLayer.Params().Set(
            name='pool', dtype=p.dtype, pooling_type=match.group(1).upper(),
            window_shape=(size, size), window_stride=strides, padding='SAME')]
        if cin != filters:  # No ReLU here, as in the reference.
            layers += [Conv('conv_1x1', p, (1, 1), cin, filters), BatchNorm('bn_1x1', p, filters)]
        return layers
    match = _SEPARABLE_RE.match(op)
    if match:
        dilation = int(match.group(1) or 1)
        size, repeats = int(match.group(2)), int(match.group(3))
        layers, channels = [], cin
        for i in range(1, repeats + 1):
            layers += [_Relu(f'relu_sep_{i}', p), conv.SeparableConv2DLayer.Params().Set(
                name=f'sep_{i}', dtype=p.dtype, params_init=p.params_init.Copy(),
                filter_shape=(size, size, channels, filters), filter_stride=strides,
                dilation_rate=(dilation, dilation), has_bias=False),
                BatchNorm(f'bn_sep_{i}', p, filters)]
            channels, strides = filters, (1, 1)
        return layers
    if op in _BOTTLENECK_OPS:
        kernels, ratio = _BOTTLENECK_OPS[op]
        width = int(filters * ratio)
        # Too narrow for a bottleneck: the kernels run at full width, as in the reference.
        bottleneck = width >= 1
        layers = []
        if bottleneck:
            layers += ReluConvBn('pre_1x1', p, (1, 1), cin, width)
            cin = width
        else:
            width = filters
        for kernel in kernels:
            # A factorised 1xk / kx1 pair strides along its long side only.
            step = (stride if kernel[0] > 1 else 1, stride if kernel[1] > 1 else 1)
            layers += ReluConvBn(f'{kernel[0]}x{kernel[1]}', p, kernel, cin, width, step)
            cin = width
        if bottleneck:
            layers += ReluConvBn('post_1x1', p, (1, 1), width, filters)
        return layers
    raise ValueError(f'Unknown AmoebaNet operation {op!r}: expected none, 1x1, '
                     f'{sorted(_BOTTLENECK_OPS)}, (max|avg)_pool_KxK or '
                     f'[dil_R_]separable_KxK_N.')


# ---- factorized reduction -----------------------------------------------------------------------
def SumMetas(out, metas: list, flops: int = 0, activation_bytes: int = 0) -> LayerMeta:
    """A LayerMeta with out_shapes `out` costing the metas plus flops and activation_bytes."""
    return LayerMeta(out, sum(m.flops for m in metas) + flops,
                     sum(m.num_params for m in metas),
                     sum(m.activation_bytes for m in metas) + activation_bytes)


class FactorizedReductionLayer(BaseLayer):
    """Halves height and width without dropping positions: ReLU, then two 1x1 stride-2 paths,
    one on the input and one on it shifted by one pixel (zero padded at the bottom and right),
    each with half the output channels, concatenated and batch-normalised (the reference's
    `factorized_reduction` with its preceding ReLU)."""

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('input_dim', 0, 'Input channels.')
        p.Define('output_dim', 0, 'Output channels; even.')
        DefineBatchNorm(p)
        return p

    @classmethod
    def _ChildParams(cls, p, layer: str) -> dict:
        if p.input_dim <= 0 or p.output_dim <= 0 or p.output_dim % 2:
            raise ValueError(f'{layer}: input_dim must be positive and output_dim positive and '
                             f'even, got {p.input_dim} and {p.output_dim}.')
        half = p.output_dim // 2
        return {'path1_conv': Conv('path1_conv', p, (1, 1), p.input_dim, half, (2, 2), 'VALID'),
                'path2_conv': Conv('path2_conv', p, (1, 1), p.input_dim, half, (2, 2), 'VALID'),
                'bn': BatchNorm('bn', p, p.output_dim)}

    def __init__(self, params):
        super().__init__(params)
        for name, child in self._ChildParams(self.p, self.path).items():
            self.CreateChild(name, child)

    def FProp(self, theta, x):
        x = tf.nn.relu(x)
        path1 = self.path1_conv.FProp(theta.path1_conv, x)
        shifted = tf.pad(x, [[0, 0], [0, 1], [0, 1], [0, 0]])[:, 1:, 1:, :]
        path2 = self.path2_conv.FProp(theta.path2_conv, shifted)
        return self.bn.FProp(theta.bn, tf.concat([path1, path2], axis=-1))

    @classmethod
    def FPropMeta(cls, p, x_shape):
        layer = p.name or cls.__name__
        children = cls._ChildParams(p, layer)
        path = children['path1_conv'].cls.FPropMeta(children['path1_conv'], x_shape)
        out = path.out_shapes[:-1].concatenate([p.output_dim])
        bn = children['bn'].cls.FPropMeta(children['bn'], out)
        relu_flops = tf.TensorShape(x_shape).num_elements()
        meta = SumMetas(out, [path, path, bn], relu_flops, base_layer.ActivationBytes(x_shape, p))
        # It starts with a ReLU, which reads its output, and ends with batch norm.
        return dataclasses.replace(meta, reads_input=False, reads_output=False)

