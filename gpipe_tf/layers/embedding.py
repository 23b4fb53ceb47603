"""Embedding lookup: integer ids to vectors."""

from __future__ import annotations

import math

import tensorflow as tf

from gpipe_tf.layers import base_layer
from gpipe_tf.layers.base_layer import BaseLayer, LayerMeta, WeightParams


class EmbeddingLayer(BaseLayer):
    """Looks up ids of any shape in a [vocab_size, embedding_dim] table: ids.shape + [dim].

    FPropMeta counts the gather as 0 FLOPs (it moves memory, it does no arithmetic); with
    `scale_sqrt_depth` the scaling costs one multiplication per output element.
    """

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('vocab_size', 0, 'Number of rows of the embedding table.')
        p.Define('embedding_dim', 0, 'Size of each embedding vector.')
        p.Define('scale_sqrt_depth', False,
                 'Whether to multiply embeddings by sqrt(embedding_dim).')
        return p

    def __init__(self, params):
        super().__init__(params)
        p = self.p
        if p.vocab_size <= 0 or p.embedding_dim <= 0:
            raise ValueError(f'{self.path}: vocab_size and embedding_dim must be positive, got '
                             f'{p.vocab_size} and {p.embedding_dim}.')
        self.CreateVariable('emb', WeightParams((p.vocab_size, p.embedding_dim)))

    def FProp(self, theta, ids):
        p = self.p
        if not ids.dtype.is_integer:
            raise ValueError(f'{self.path}: expected integer ids, got dtype {ids.dtype.name}.')
        y = tf.gather(theta.emb, ids)
        if p.scale_sqrt_depth:
            y *= math.sqrt(p.embedding_dim)
        return y

    @classmethod
    def FPropMeta(cls, p, ids_shape):
        ids_shape = tf.TensorShape(ids_shape)
        if not ids_shape.is_fully_defined():
            raise ValueError(f'{p.name or cls.__name__}: expected a fully defined ids shape, got '
                             f'{ids_shape}.')
        out = ids_shape.concatenate([p.embedding_dim])
        flops = out.num_elements() if p.scale_sqrt_depth else 0
        table = p.vocab_size * p.embedding_dim
        return LayerMeta(out, flops, table, base_layer.ActivationBytes(out, p),
                         sparse_params=table,
                         sparse_gradient_bytes=SparseGradientBytes(ids_shape.num_elements(),
                                                                   p.embedding_dim, p.dtype))


def SparseGradientBytes(rows: int, width: int, dtype) -> int:
    """The bytes of a gather's gradient of `rows` rows of `width` values of `dtype` (the
    table's): the values, and an index per row (8 bytes: int32 or int64)."""
    return rows * (width * tf.as_dtype(dtype).size + 8)
