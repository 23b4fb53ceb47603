"""Transformer models as flat layer lists for PipeliningLayer: a decoder-only LM (the GPipe
paper's Transformer-L, §3) and a multilingual encoder-decoder (its T(L, H, A), §5).

A pipeline passes ONE value between layers, here a NestedMap whose every leaf has the batch
dimension first, so a model is a list of layers that each take and return such a NestedMap:

  LM  (`LmLayers`):
    input      NestedMap(ids [B,T] int32, paddings [B,T], labels [B,T] int32, weights [B,T])
    embedding  -> NestedMap(vec [B,T,D], paddings, labels, weights)
    layer_i    (causal TransformerLayer) -> the same structure
    softmax    -> NestedMap(per_example_loss [B,T], weight [B,T], correct [B,T])

  MT  (`MtLayers`):
    input      NestedMap(src_ids [B,S] int32, src_paddings [B,S], tgt_ids [B,T] int32,
                         tgt_paddings [B,T], tgt_labels [B,T] int32, tgt_weights [B,T])
    embedding  -> NestedMap(vec [B,S,D], paddings [B,S], tgt_vec [B,T,D], tgt_paddings,
                            tgt_labels, tgt_weights)
    encoder_i  (TransformerLayer; tgt_* pass through) -> the same structure
    hand_off   -> NestedMap(vec=tgt_vec, paddings=tgt_paddings, encoder_vec=LN(vec),
                            encoder_paddings=paddings, labels=tgt_labels, weights=tgt_weights)
    decoder_i  (causal TransformerLayer with cross-attention) -> the same structure
    softmax    -> NestedMap(per_example_loss [B,T], weight [B,T], correct [B,T])

Paddings are Lingvo's (1.0 at padded positions). `weights` are the loss weights: 0 at padded
positions, and they pass through to the output `weight` unchanged. The pipeline's output has no
scalars and no [B,T,V] logits (too big to concatenate over micro-batches); `ReduceLoss` computes
loss = sum(per_example_loss * weight) / sum(weight) after the pipeline.

Multilingual translation (GPipe §5, after Johnson et al. 2017): one vocabulary, and one embedding
table, shared by all languages and by the source and target sides. The vocabulary includes one
token per target language (`<2de>`, ...); the input pipeline prepends the target language's token
to every source sentence, so one model serves every language pair and nothing in the model is
language-specific.

Weight sharing. The source and target share the embedding table exactly: the first layer embeds
both sides, and the target's embeddings travel through the encoder cells as `tgt_vec` to the
hand-off layer. (Embedding the target in the hand-off layer would need the table on two cells.)
By default the softmax has weights of its own: the paper's parameter counts match two vocab x D
matrices (embedding, softmax), e.g. 282.2M for Transformer-L with 3 layers. With
`share_embedding_and_softmax` the softmax's projection is the token table itself (tied, as
GPT-2's): the pipeline's `tied_weights` give the last cell the embedding's variable, read on the
first cell's device, and its gradient is the sum of the two cells' (`layers/tied_weights.py`).

The paper's trainability fixes for deep models: the feed-forward layers' initialisation is scaled
down by the number of Transformer layers (`ffn_init_scale`), and the softmax logits are clipped to
[-c, c] (`logits_clip`).
"""

from __future__ import annotations

import math

import numpy as np
import tensorflow as tf

from gpipe_tf import hyperparams
from gpipe_tf.layers import attention
from gpipe_tf.layers import base_layer
from gpipe_tf.layers import basic
from gpipe_tf.layers import embedding
from gpipe_tf.layers import losses
from gpipe_tf.layers import normalization
from gpipe_tf.layers.base_layer import BaseLayer, LayerMeta
from gpipe_tf.nested_map import NestedMap
from gpipe_tf.pipeline import pipelining_layer

POSITION_EMBEDDINGS = ('sinusoidal', 'learned')
LM_INPUT_KEYS = ('ids', 'paddings', 'labels', 'weights')
MT_INPUT_KEYS = ('src_ids', 'src_paddings', 'tgt_ids', 'tgt_paddings', 'tgt_labels',
                 'tgt_weights')
# FLOPs per logit of the arg-max that finds the predicted token (one comparison).
_ARGMAX_FLOPS_PER_LOGIT = 1


def _Require(shapes, keys, layer: str) -> NestedMap:
    """The entries `keys` of an input NestedMap (of tensors or shapes), checked to be present."""
    missing = [k for k in keys if k not in shapes]
    if missing:
        raise ValueError(f'{layer}: the input NestedMap lacks {missing}; it has {sorted(shapes)}.')
    return NestedMap({k: shapes[k] for k in keys})


def _DropoutMeta(params, shape: tf.TensorShape) -> LayerMeta:
    """A DropoutLayer's cost, nothing at keep_prob 1 (it is then the identity)."""
    if params.keep_prob == 1.0:
        return LayerMeta(shape)
    return params.cls.FPropMeta(params, shape)


def _SumMetas(out, metas) -> LayerMeta:
    return LayerMeta(out, sum(m.flops for m in metas), sum(m.num_params for m in metas),
                     sum(m.activation_bytes for m in metas),
                     sparse_params=sum(m.sparse_params for m in metas),
                     sparse_gradient_bytes=sum(m.sparse_gradient_bytes for m in metas),
                     tied_params=sum(m.tied_params for m in metas))


def SinusoidalPositions(length, dim: int, dtype=tf.float32) -> tf.Tensor:
    """[length, dim] position signals: sines then cosines of geometric timescales 1 .. 1e4."""
    if dim % 2:
        raise ValueError(f'Sinusoidal positions need an even model_dim, got {dim}.')
    num_timescales = dim // 2
    log_increment = math.log(1e4) / max(num_timescales - 1, 1)
    inv_timescales = tf.constant(np.exp(-log_increment * np.arange(num_timescales)), dtype)
    scaled = tf.cast(tf.range(length), dtype)[:, tf.newaxis] * inv_timescales[tf.newaxis, :]
    return tf.concat([tf.sin(scaled), tf.cos(scaled)], axis=1)


class TransformerEmbeddingLayer(BaseLayer):
    """The first layer: tokens to vectors, `emb[id] * sqrt(D) + position`, then dropout.

    LM: NestedMap(ids, paddings, labels, weights) -> NestedMap(vec, paddings, labels, weights).
    With `translation`: NestedMap(src_ids, src_paddings, tgt_ids, tgt_paddings, tgt_labels,
    tgt_weights) -> NestedMap(vec, paddings, tgt_vec, tgt_paddings, tgt_labels, tgt_weights),
    both sides embedded with the one table (see the module docstring). Positions count from 0 at
    the start of each row; sinusoidal ones have no parameters, learned ones a max_length x D
    table. Padded positions are embedded too; attention and the loss ignore them.
    """

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('vocab_size', 0, 'Number of tokens in the vocabulary.')
        p.Define('model_dim', 0, 'Size D of each embedding vector.')
        p.Define('max_length', 0, 'Longest sequence accepted (rows of the learned positions).')
        p.Define('position_embedding', 'sinusoidal', f'One of {POSITION_EMBEDDINGS}.')
        p.Define('dropout_keep_prob', 1.0, 'Keep probability of dropout on the embeddings.')
        p.Define('translation', False, 'Whether the input is a source/target pair (src_ids, '
                 'tgt_ids, ...) rather than one token stream (ids, ...).')
        p.Define('tied_softmax', False, 'Whether the softmax reads the token table too '
                 '(share_embedding_and_softmax): its gradient is then dense, every row, where a '
                 'gather\'s is the rows read.')
        return p

    @classmethod
    def _ChildParams(cls, p) -> dict:
        layer = p.name or cls.__name__
        if p.vocab_size <= 0 or p.model_dim <= 0 or p.max_length <= 0:
            raise ValueError(f'{layer}: vocab_size, model_dim and max_length must be positive, '
                             f'got {p.vocab_size}, {p.model_dim} and {p.max_length}.')
        if p.position_embedding not in POSITION_EMBEDDINGS:
            raise ValueError(f'{layer}: position_embedding must be one of '
                             f'{POSITION_EMBEDDINGS}, got {p.position_embedding!r}.')
        # Unit-variance embeddings after the sqrt(D) scaling, like the sinusoids' scale.
        children = {'token_emb': embedding.EmbeddingLayer.Params().Set(
            vocab_size=p.vocab_size, embedding_dim=p.model_dim, scale_sqrt_depth=True,
            dtype=p.dtype, params_init=base_layer.WeightInit.Gaussian(p.model_dim ** -0.5))}
        if p.position_embedding == 'learned':
            children['position_emb'] = embedding.EmbeddingLayer.Params().Set(
                vocab_size=p.max_length, embedding_dim=p.model_dim, dtype=p.dtype,
                params_init=p.params_init.Copy())
        # One dropout per stream, so the source's and target's masks differ.
        for name in cls._Streams(p):
            children[f'{name}_dropout'] = basic.DropoutLayer.Params().Set(
                keep_prob=p.dropout_keep_prob, dtype=p.dtype)
        return children

    @classmethod
    def _Streams(cls, p) -> dict:
        """Per embedded stream (named as its output vec): (ids key, paddings key)."""
        if p.translation:
            return {'vec': ('src_ids', 'src_paddings'), 'tgt_vec': ('tgt_ids', 'tgt_paddings')}
        return {'vec': ('ids', 'paddings')}

    @classmethod
    def _CheckIds(cls, p, layer: str, ids, paddings) -> tf.TensorShape:
        ids = tf.TensorShape(ids)
        if ids.rank != 2:
            raise ValueError(f'{layer}: expected ids of rank 2 [batch, time], got shape {ids}.')
        if ids[1] is not None and ids[1] > p.max_length:
            raise ValueError(f'{layer}: sequence length {ids[1]} exceeds max_length '
                             f'{p.max_length}.')
        if not tf.TensorShape(paddings).is_compatible_with(ids):
            raise ValueError(f'{layer}: paddings shape {tf.TensorShape(paddings)} does not '
                             f'match ids shape {ids}.')
        return ids

    def __init__(self, params):
        super().__init__(params)
        for name, child_params in self._ChildParams(self.p).items():
            self.CreateChild(name, child_params)

    def _Embed(self, theta, ids, name: str):
        p = self.p
        vec = self.token_emb.FProp(
            NestedMap(emb=theta.token_emb.emb), ids)
        length = tf.shape(ids)[1]
        if p.position_embedding == 'learned':
            positions = self.position_emb.FProp(
                NestedMap(emb=theta.position_emb.emb), tf.range(length))
        else:
            # Computed in dtype: bfloat16 would round the larger angles to whole radians.
            positions = tf.cast(SinusoidalPositions(length, p.model_dim, p.dtype), vec.dtype)
        dropout = f'{name}_dropout'
        return getattr(self, dropout).FProp(theta[dropout], vec + positions[tf.newaxis])

    def FProp(self, theta, inputs: NestedMap) -> NestedMap:
        p = self.p
        keys = MT_INPUT_KEYS if p.translation else LM_INPUT_KEYS
        inputs = _Require(inputs, keys, self.path)
        out = NestedMap()
        for name, (ids_key, paddings_key) in self._Streams(p).items():
            ids = inputs[ids_key]
            self._CheckIds(p, self.path, ids.shape, inputs[paddings_key].shape)
            if not ids.dtype.is_integer:
                raise ValueError(f'{self.path}: expected integer {ids_key}, got dtype '
                                 f'{ids.dtype.name}.')
            out[name] = self._Embed(theta, ids, name)
        if p.translation:
            out.update(paddings=inputs.src_paddings, tgt_paddings=inputs.tgt_paddings,
                       tgt_labels=inputs.tgt_labels, tgt_weights=inputs.tgt_weights)
        else:
            out.update(paddings=inputs.paddings, labels=inputs.labels, weights=inputs.weights)
        return out

    @classmethod
    def FPropMeta(cls, p, input_shapes) -> LayerMeta:
        """FLOPs per stream: sqrt(D) scaling, position add, dropout; params: the tables."""
        layer = p.name or cls.__name__
        children = cls._ChildParams(p)
        shapes = _Require(input_shapes, MT_INPUT_KEYS if p.translation else LM_INPUT_KEYS,
                          layer)
        shapes = NestedMap({k: tf.TensorShape(v) for k, v in shapes.items()})
        metas = []
        out = NestedMap()
        for name, (ids_key, paddings_key) in cls._Streams(p).items():
            ids = cls._CheckIds(p, layer, shapes[ids_key], shapes[paddings_key])
            token = children['token_emb']
            meta = token.cls.FPropMeta(token, ids)
            vec = meta.out_shapes
            metas += [LayerMeta(vec, meta.flops + vec.num_elements(), 0,
                                2 * base_layer.ActivationBytes(vec, p)),
                      _DropoutMeta(children[f'{name}_dropout'], vec)]
            out[name] = vec
        if p.translation:
            out.update(paddings=shapes.src_paddings, tgt_paddings=shapes.tgt_paddings,
                       tgt_labels=shapes.tgt_labels, tgt_weights=shapes.tgt_weights)
        else:
            out.update(paddings=shapes.paddings, labels=shapes.labels, weights=shapes.weights)
        # The tables' gradients are gathers' (IndexedSlices): the token table's rows are the
        # streams' ids, the positions' those of each stream's length. A token table the softmax
        # reads too (tied_softmax) gets a dense gradient: not among the sparse ones.
        streams = cls._Streams(p).values()
        token_params = p.vocab_size * p.model_dim
        token_rows = sum(shapes[ids_key].num_elements() for ids_key, _ in streams)
        position_params = position_rows = 0
        if p.position_embedding == 'learned':
            position_params = p.max_length * p.model_dim
            position_rows = sum(shapes[ids_key][1] for ids_key, _ in streams)
        sparse_params, sparse_rows = position_params, position_rows
        if not p.tied_softmax:
            sparse_params, sparse_rows = sparse_params + token_params, sparse_rows + token_rows
        total = _SumMetas(out, metas)
        return LayerMeta(out, total.flops, token_params + position_params,
                         total.activation_bytes, sparse_params=sparse_params,
                         sparse_gradient_bytes=embedding.SparseGradientBytes(
                             sparse_rows, p.model_dim, p.dtype))


class HandOffLayer(BaseLayer):
    """Between the encoder and the decoder: the encoder's output becomes the decoder's memory.

    NestedMap(vec, paddings, tgt_vec, tgt_paddings, tgt_labels, tgt_weights) ->
    NestedMap(vec=tgt_vec, paddings=tgt_paddings, encoder_vec=layer_norm(vec),
              encoder_paddings=paddings, labels=tgt_labels, weights=tgt_weights).
    The layer norm is the final one of the pre-LN encoder stack. The target was embedded by the
    first layer with the shared table, so this layer only moves it into `vec`.
    """

    INPUT_KEYS = ('vec', 'paddings', 'tgt_vec', 'tgt_paddings', 'tgt_labels', 'tgt_weights')

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('model_dim', 0, 'Size D of the encoder\'s and decoder\'s vectors.')
        return p

    @classmethod
    def _LayerNormParams(cls, p):
        return normalization.LayerNormLayer.Params().Set(input_dim=p.model_dim, dtype=p.dtype)

    def __init__(self, params):
        super().__init__(params)
        self.CreateChild('encoder_ln', self._LayerNormParams(self.p))

    @classmethod
    def _HandOff(cls, inputs: NestedMap, encoder_vec) -> NestedMap:
        return NestedMap(vec=inputs.tgt_vec, paddings=inputs.tgt_paddings,
                         encoder_vec=encoder_vec, encoder_paddings=inputs.paddings,
                         labels=inputs.tgt_labels, weights=inputs.tgt_weights)

    def FProp(self, theta, inputs: NestedMap) -> NestedMap:
        inputs = _Require(inputs, self.INPUT_KEYS, self.path)
        basic.LastDim(inputs.tgt_vec.shape, self.path, self.p.model_dim)
        return self._HandOff(inputs, self.encoder_ln.FProp(theta.encoder_ln, inputs.vec))

    @classmethod
    def FPropMeta(cls, p, input_shapes) -> LayerMeta:
        layer = p.name or cls.__name__
        shapes = _Require(input_shapes, cls.INPUT_KEYS, layer)
        shapes = NestedMap({k: tf.TensorShape(v) for k, v in shapes.items()})
        basic.LastDim(shapes.tgt_vec, layer, p.model_dim)
        ln = cls._LayerNormParams(p)
        meta = ln.cls.FPropMeta(ln, shapes.vec)
        return _SumMetas(cls._HandOff(shapes, meta.out_shapes), [meta])


class TransformerSoftmaxLayer(BaseLayer):
    """The last layer: final layer norm, projection to the vocabulary, label-smoothed
    cross-entropy with logits clipped to [-logits_clip, logits_clip].

    NestedMap(vec [B,T,D], labels [B,T] int, weights [B,T], ...) ->
    NestedMap(per_example_loss [B,T] (unweighted), weight [B,T] (= weights),
              correct [B,T] (1.0 where the arg-max token is the label),
              predictions [B,T] (the arg-max token, labels' dtype; greedy decoding reads it)).
    The projection has its own weights, or with `tied_embedding` reads the embedding's token
    table (see the module docstring on sharing).
    """

    INPUT_KEYS = ('vec', 'labels', 'weights')

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('model_dim', 0, 'Size D of vec\'s last dimension.')
        p.Define('vocab_size', 0, 'Number of tokens (logits per position).')
        p.Define('label_smoothing', 0.0, 'Label smoothing s in [0, 1).')
        p.Define('logits_clip', None, 'None, or c > 0: logits are clipped to [-c, c].')
        p.Define('tied_embedding', False,
                 'Whether the projection is the embedding\'s token table [vocab, D], read from '
                 'the embedding layer (the pipeline\'s tied_weights; LmParams\' '
                 'share_embedding_and_softmax), instead of a weight of its own.')
        return p

    @classmethod
    def _ChildParams(cls, p) -> dict:
        return {
            'final_ln': normalization.LayerNormLayer.Params().Set(
                input_dim=p.model_dim, dtype=p.dtype),
            'softmax': losses.SoftmaxCrossEntropyLayer.Params().Set(
                input_dim=p.model_dim, num_classes=p.vocab_size,
                label_smoothing=p.label_smoothing, logits_clip=p.logits_clip, dtype=p.dtype,
                params_init=p.params_init.Copy(), tied_weight=p.tied_embedding),
        }

    def __init__(self, params):
        super().__init__(params)
        for name, child_params in self._ChildParams(self.p).items():
            self.CreateChild(name, child_params)

    def FProp(self, theta, inputs: NestedMap) -> NestedMap:
        inputs = _Require(inputs, self.INPUT_KEYS, self.path)
        x = self.final_ln.FProp(theta.final_ln, inputs.vec)
        out = self.softmax.FProp(theta.softmax, NestedMap(
            features=x, labels=inputs.labels, weights=inputs.weights))
        predictions = tf.argmax(out.logits, axis=-1, output_type=inputs.labels.dtype)
        correct = tf.cast(tf.equal(predictions, inputs.labels), x.dtype)
        return NestedMap(per_example_loss=out.per_example_loss, weight=inputs.weights,
                         correct=correct, predictions=predictions)

    @classmethod
    def FPropMeta(cls, p, input_shapes) -> LayerMeta:
        layer = p.name or cls.__name__
        shapes = _Require(input_shapes, cls.INPUT_KEYS, layer)
        shapes = NestedMap({k: tf.TensorShape(v) for k, v in shapes.items()})
        children = cls._ChildParams(p)
        ln = children['final_ln']
        softmax = children['softmax']
        ln_meta = ln.cls.FPropMeta(ln, shapes.vec)
        softmax_meta = softmax.cls.FPropMeta(softmax, NestedMap(
            features=ln_meta.out_shapes, labels=shapes.labels, weights=shapes.weights))
        examples = softmax_meta.out_shapes.per_example_loss
        out = NestedMap(per_example_loss=examples, weight=shapes.weights, correct=examples,
                        predictions=examples)
        argmax = LayerMeta(out, _ARGMAX_FLOPS_PER_LOGIT * examples.num_elements() * p.vocab_size,
                           0, base_layer.ActivationBytes(examples, p))
        return _SumMetas(out, [ln_meta, softmax_meta, argmax])


# ---- model builders ------------------------------------------------------------------------------
def _CommonParams() -> hyperparams.Params:
    p = hyperparams.Params()
    p.Define('vocab_size', 32000, 'Number of tokens in the (shared) vocabulary.')
    p.Define('model_dim', 2048, 'Model dimension D.')
    p.Define('hidden_dim', 8192, 'Hidden size of each feed-forward network.')
    p.Define('num_heads', 32, 'Attention heads per attention layer.')
    p.Define('dim_per_head', 64, 'Size of each attention head.')
    p.Define('max_length', 1024, 'Longest sequence the model accepts.')
    p.Define('position_embedding', 'sinusoidal', f'One of {POSITION_EMBEDDINGS}.')
    p.Define('input_dropout_keep_prob', 1.0, 'Keep probability of dropout on the embeddings.')
    p.Define('residual_dropout_keep_prob', 1.0,
             'Keep probability of dropout on each sub-layer\'s output before the residual add.')
    p.Define('atten_dropout_keep_prob', 1.0,
             'Keep probability of dropout on the attention probabilities.')
    p.Define('relu_dropout_keep_prob', 1.0,
             'Keep probability of dropout on the feed-forward hidden activations.')
    p.Define('ffn_activation', 'relu', 'Activation of the feed-forward hidden layer.')
    p.Define('ffn_init_scale', None,
             'Multiplies the feed-forward weights\' initialisation; None means 1 / the number of '
             'Transformer layers (GPipe §5: "scale down the initialization of all FFN layers by '
             'the number of layers").')
    p.Define('label_smoothing', 0.0, 'Label smoothing s in [0, 1).')
    p.Define('logits_clip', None, 'None, or c > 0: softmax logits are clipped to [-c, c] '
             '(GPipe §5).')
    p.Define('share_embedding_and_softmax', False,
             'Whether the softmax\'s projection is the token embedding table (tied, as GPT-2\'s): '
             'one variable in the first cell, read by the last; False keeps the paper\'s '
             'parameter counts (two vocab x D matrices).')
    return p


def LmParams() -> hyperparams.Params:
    """Hyperparameters of a decoder-only Transformer LM (defaults: the paper's Transformer-L)."""
    p = _CommonParams()
    p.Define('num_layers', 3, 'Number of (causal) Transformer layers.')
    return p


def MtParams() -> hyperparams.Params:
    """Hyperparameters of an encoder-decoder Transformer (defaults: the paper's T(6, 8192, 16))."""
    p = _CommonParams()
    p.Set(vocab_size=65536, model_dim=1024, hidden_dim=8192, num_heads=16)
    p.Define('num_encoder_layers', 6, 'Number of encoder Transformer layers.')
    p.Define('num_decoder_layers', 6, 'Number of decoder Transformer layers (with '
             'cross-attention).')
    return p


def NumTransformerLayers(p) -> int:
    """Transformer layers of the model of LmParams() or MtParams() `p`."""
    if 'num_layers' in p:
        return p.num_layers
    return p.num_encoder_layers + p.num_decoder_layers


def _FfnInitScale(p) -> float:
    if p.ffn_init_scale is not None:
        return p.ffn_init_scale
    return 1.0 / max(NumTransformerLayers(p), 1)


def _EmbeddingParams(p, translation: bool):
    return TransformerEmbeddingLayer.Params().Set(
        name='embedding', vocab_size=p.vocab_size, model_dim=p.model_dim,
        max_length=p.max_length, position_embedding=p.position_embedding,
        dropout_keep_prob=p.input_dropout_keep_prob, translation=translation,
        tied_softmax=p.share_embedding_and_softmax)


def _TransformerLayerParams(p, name: str, causal: bool, cross: bool):
    return attention.TransformerLayer.Params().Set(
        name=name, model_dim=p.model_dim, hidden_dim=p.hidden_dim, num_heads=p.num_heads,
        dim_per_head=p.dim_per_head, causal=causal, has_cross_attention=cross,
        residual_dropout_keep_prob=p.residual_dropout_keep_prob,
        atten_dropout_keep_prob=p.atten_dropout_keep_prob,
        relu_dropout_keep_prob=p.relu_dropout_keep_prob, ffn_activation=p.ffn_activation,
        ffn_init_scale=_FfnInitScale(p))


def _SoftmaxParams(p):
    return TransformerSoftmaxLayer.Params().Set(
        name='softmax', model_dim=p.model_dim, vocab_size=p.vocab_size,
        label_smoothing=p.label_smoothing, logits_clip=p.logits_clip,
        tied_embedding=p.share_embedding_and_softmax)


# The tie of share_embedding_and_softmax: the softmax's projection reads the token table.
TIED_SOFTMAX = ['softmax.softmax.w', 'embedding.token_emb.emb']


def TiedWeights(p) -> list:
    """The `tied_weights` of a PipeliningLayer (or SequentialLayer) of `p`'s layers."""
    return [list(TIED_SOFTMAX)] if p.share_embedding_and_softmax else []


def LmLayers(p) -> list:
    """The flat layer list of LM `p` (LmParams()): embedding, num_layers causal Transformer
    layers `layer_<i>`, softmax."""
    if p.num_layers < 1:
        raise ValueError(f'num_layers must be >= 1, got {p.num_layers}.')
    return ([_EmbeddingParams(p, translation=False)] +
            [_TransformerLayerParams(p, f'layer_{i}', causal=True, cross=False)
             for i in range(p.num_layers)] +
            [_SoftmaxParams(p)])


def MtLayers(p) -> list:
    """The flat layer list of encoder-decoder `p` (MtParams()): embedding, encoder layers
    `encoder_<i>`, hand_off, decoder layers `decoder_<i>` (causal, cross-attention), softmax."""
    if p.num_encoder_layers < 1 or p.num_decoder_layers < 1:
        raise ValueError(f'num_encoder_layers and num_decoder_layers must be >= 1, got '
                         f'{p.num_encoder_layers} and {p.num_decoder_layers}.')
    return ([_EmbeddingParams(p, translation=True)] +
            [_TransformerLayerParams(p, f'encoder_{i}', causal=False, cross=False)
             for i in range(p.num_encoder_layers)] +
            [HandOffLayer.Params().Set(name='hand_off', model_dim=p.model_dim)] +
            [_TransformerLayerParams(p, f'decoder_{i}', causal=True, cross=True)
             for i in range(p.num_decoder_layers)] +
            [_SoftmaxParams(p)])


def LmInputShapes(batch_size: int, length: int) -> dict:
    """PipeliningLayer.input_shapes of an LM batch."""
    return {key: [batch_size, length] for key in LM_INPUT_KEYS}


def MtInputShapes(batch_size: int, source_length: int, target_length: int) -> dict:
    """PipeliningLayer.input_shapes of a translation batch."""
    return {key: [batch_size, source_length if key.startswith('src') else target_length]
            for key in MT_INPUT_KEYS}


def LmPipelineParams(p, batch_size: int, num_cells: int, num_micro_batches: int,
                     recompute: str = 'always', name: str = 'lm') -> hyperparams.Params:
    """PipeliningLayer Params running the LM of `LmParams()` p in K cells (as AmoebaNet's
    `PipelineParams`): embedding, the Transformer layers, softmax; input_shapes for batches of
    `batch_size` sequences of p.max_length tokens."""
    return pipelining_layer.PipeliningLayer.Params().Set(
        name=name, layer_tpl=LmLayers(p), num_cells=num_cells,
        num_micro_batches=num_micro_batches, recompute=recompute, tied_weights=TiedWeights(p),
        input_shapes=LmInputShapes(batch_size, p.max_length),
        input_dtypes={key: 'int32' for key in LM_INPUT_KEYS if key in ('ids', 'labels')})


def MtPipelineParams(p, batch_size: int, num_cells: int, num_micro_batches: int,
                     recompute: str = 'always', name: str = 'mt') -> hyperparams.Params:
    """PipeliningLayer Params running the encoder-decoder of `MtParams()` p in K cells (as
    AmoebaNet's `PipelineParams`); input_shapes for batches of `batch_size` pairs of
    p.max_length tokens."""
    return pipelining_layer.PipeliningLayer.Params().Set(
        name=name, layer_tpl=MtLayers(p), num_cells=num_cells,
        num_micro_batches=num_micro_batches, recompute=recompute, tied_weights=TiedWeights(p),
        input_shapes=MtInputShapes(batch_size, p.max_length, p.max_length),
        input_dtypes={key: 'int32' for key in MT_INPUT_KEYS if key.endswith(('ids', 'labels'))})


def PipelineMeta(pipeline_params) -> LayerMeta:
    """FPropMeta of a PipeliningLayer's Params on its `input_shapes`: Params and shapes only,
    no variables and no TF ops, so it serves the paper-size models."""
    if not isinstance(pipeline_params.input_shapes, dict):
        raise ValueError(f'Expected input_shapes as a dict of shapes, got '
                         f'{pipeline_params.input_shapes!r}.')
    shapes = NestedMap({k: tf.TensorShape(v) for k, v in pipeline_params.input_shapes.items()})
    return pipeline_params.cls.FPropMeta(pipeline_params, shapes)


def ReduceLoss(outputs: NestedMap) -> NestedMap:
    """The task's reduction of the softmax layer's outputs (after the pipeline).

    Returns:
      NestedMap(loss = sum(per_example_loss * weight) / sum(weight), total_weight = sum(weight),
      accuracy = weighted mean of correct); 0 where sum(weight) is 0.
    """
    total_weight = tf.reduce_sum(outputs.weight)
    return NestedMap(
        loss=tf.math.divide_no_nan(tf.reduce_sum(outputs.per_example_loss * outputs.weight),
                                   total_weight),
        total_weight=total_weight,
        accuracy=tf.math.divide_no_nan(tf.reduce_sum(outputs.correct * outputs.weight),
                                       total_weight))
