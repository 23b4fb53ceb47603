"""Multi-head attention and the pre-layer-norm Transformer block that GPipe pipelines.

Paddings follow Lingvo: a float tensor, 1.0 at padded positions and 0.0 at real ones (a position
counts as padded when its padding is > 0.5). Attention never attends to a padded key; padded query
positions still produce outputs, which the loss is expected to ignore.

Dropout is stateless (`basic.DropoutLayer`, seeded by `BaseLayer.StepSeed()`), so a pipeline's
re-materialized forward draws exactly the masks of the first forward.
"""

from __future__ import annotations

import tensorflow as tf

from gpipe_tf.layers import base_layer
from gpipe_tf.layers import basic
from gpipe_tf.layers import normalization
from gpipe_tf.layers.base_layer import BaseLayer, LayerMeta, WeightParams
from gpipe_tf.nested_map import NestedMap

# FLOPs per attention logit of the softmax: max, subtract, exp, sum, divide.
_SOFTMAX_FLOPS_PER_LOGIT = 5
# FLOPs per attention logit of masking (one select), charged when any mask applies.
_MASK_FLOPS_PER_LOGIT = 1


def _Shape(shape, layer: str, rank: int, what: str) -> tf.TensorShape:
    shape = tf.TensorShape(shape)
    if shape.rank != rank:
        raise ValueError(f'{layer}: expected {what} of rank {rank}, got shape {shape}.')
    return shape


def _DropoutMeta(keep_prob: float, shape: tf.TensorShape, dtype) -> LayerMeta:
    """DropoutLayer's cost when it drops anything; nothing at keep_prob 1 (it is the identity)."""
    if keep_prob == 1.0:
        return LayerMeta(shape)
    return basic.DropoutLayer.FPropMeta(
        basic.DropoutLayer.Params().Set(keep_prob=keep_prob, dtype=dtype), shape)


class MultiHeadAttentionLayer(BaseLayer):
    """Multi-head scaled dot-product attention, `softmax(q k^T / sqrt(d)) v`, projected back.

    FProp(theta, query [B, T, D], key_value [B, S, D] or None (self-attention: the query),
    paddings [B, S] float or None (1.0 masks the key)) returns [B, T, D]. With `causal`, query
    position t attends only to key positions s <= t.

    Variables: `w_q`, `w_k`, `w_v` [D, N] and `w_o` [N, D] with N = num_heads * dim_per_head, and
    with `has_bias` the biases `b_q`, `b_v` [N] and `b_o` [D]. There is no key bias: it would add
    q . b_k to every logit of a query's row, which the softmax cancels, so it would never receive
    a gradient.

    FPropMeta's FLOPs (a multiply-add counts 2), with H heads of size d:
      projections   2*B*T*D*N (query) + 4*B*S*D*N (key, value) + 2*B*T*N*D (output),
                    plus B*T*N + B*S*N + B*T*D for the biases when has_bias;
      query scaling B*T*N (by 1/sqrt(d));
      logits        2*B*H*T*S*d;
      masking       B*H*T*S when paddings are given or causal;
      softmax       5*B*H*T*S (max, subtract, exp, sum, divide);
      dropout       3*B*H*T*S when atten_dropout_keep_prob < 1;
      context       2*B*H*T*S*d (probabilities times values).
    Activation bytes count q, k, v, the probabilities (twice with dropout), the context and the
    output.
    """

    THETA_METHODS = ('ExtendStep', 'KeyValueCache')  # In fprop_dtype, as FProp.

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('model_dim', 0, 'Size D of the query\'s and key_value\'s last dimension.')
        p.Define('num_heads', 1, 'Number H of attention heads.')
        p.Define('dim_per_head', None, 'Size of each head; None means model_dim // num_heads.')
        p.Define('atten_dropout_keep_prob', 1.0,
                 'Keep probability of dropout on the attention probabilities, in (0, 1].')
        p.Define('causal', False, 'Whether query position t attends only to key positions <= t.')
        p.Define('has_bias', True, 'Whether the query, value and output projections add a bias '
                 '(a key bias would be cancelled by the softmax).')
        return p

    @classmethod
    def DimPerHead(cls, p) -> int:
        """The size of one head: `dim_per_head`, or model_dim // num_heads when it is None."""
        layer = p.name or cls.__name__
        if p.model_dim <= 0 or p.num_heads <= 0:
            raise ValueError(f'{layer}: model_dim and num_heads must be positive, got '
                             f'{p.model_dim} and {p.num_heads}.')
        if p.dim_per_head is not None:
            if p.dim_per_head <= 0:
                raise ValueError(f'{layer}: dim_per_head must be None or positive, got '
                                 f'{p.dim_per_head}.')
            return p.dim_per_head
        if p.model_dim % p.num_heads:
            raise ValueError(f'{layer}: model_dim ({p.model_dim}) is not divisible by num_heads '
                             f'({p.num_heads}); set dim_per_head.')
        return p.model_dim // p.num_heads

    @classmethod
    def _CheckShapes(cls, p, layer: str, query, key_value=None, paddings=None):
        """(query shape, key_value shape), checked against each other and the params."""
        query = _Shape(query, layer, 3, 'a query')
        basic.LastDim(query, layer, p.model_dim)
        key_value = query if key_value is None else _Shape(key_value, layer, 3, 'a key_value')
        basic.LastDim(key_value, layer, p.model_dim)
        if not query[:1].is_compatible_with(key_value[:1]):
            raise ValueError(f'{layer}: query shape {query} and key_value shape {key_value} '
                             f'disagree on the batch size.')
        if paddings is not None and not tf.TensorShape(paddings).is_compatible_with(
                key_value[:2]):
            raise ValueError(f'{layer}: paddings shape {tf.TensorShape(paddings)} does not match '
                             f'key_value shape {key_value} without its last dimension.')
        return query, key_value

    def __init__(self, params):
        super().__init__(params)
        p = self.p
        dim = self.DimPerHead(p) * p.num_heads
        for name, shape in (('q', (p.model_dim, dim)), ('k', (p.model_dim, dim)),
                            ('v', (p.model_dim, dim)), ('o', (dim, p.model_dim))):
            self.CreateVariable(f'w_{name}', WeightParams(shape))
            if p.has_bias and name != 'k':
                self.CreateVariable(f'b_{name}', WeightParams(
                    shape[-1:], base_layer.WeightInit.Constant(0.0)))
        self.CreateChild('atten_dropout', basic.DropoutLayer.Params().Set(
            keep_prob=p.atten_dropout_keep_prob, dtype=p.dtype))

    def _Project(self, theta, name: str, x, heads: bool = True):
        """x [B, L, D] times w_<name>: [B, L, H, d] when `heads`, else the output [B, L, D]."""
        p = self.p
        w = theta[f'w_{name}']
        if heads:
            w = tf.reshape(w, [p.model_dim, p.num_heads, self.DimPerHead(p)])
            y = tf.einsum('bld,dhk->blhk', x, w)
        else:
            w = tf.reshape(w, [p.num_heads, self.DimPerHead(p), p.model_dim])
            y = tf.einsum('blhk,hkd->bld', x, w)
        if p.has_bias and name != 'k':
            b = theta[f'b_{name}']
            y += tf.reshape(b, [p.num_heads, -1]) if heads else b
        return y

    def FProp(self, theta, query, key_value=None, paddings=None):
        """Attends from `query` to `key_value` (default: `query`); see the class docstring.

        Args:
          theta: NestedMap of this layer's variable values.
          query: [B, T, D].
          key_value: [B, S, D], or None for self-attention.
          paddings: [B, S] float, 1.0 at keys that must not be attended to; or None.

        Returns:
          [B, T, D].
        """
        p = self.p
        self._CheckShapes(p, self.path, query.shape, None if key_value is None else
                          key_value.shape, None if paddings is None else paddings.shape)
        if key_value is None:
            key_value = query
        q = self._Project(theta, 'q', query) * (self.DimPerHead(p) ** -0.5)
        k = self._Project(theta, 'k', key_value)
        v = self._Project(theta, 'v', key_value)
        logits = tf.einsum('bthk,bshk->bhts', q, k)
        invalid = None
        if paddings is not None:
            invalid = (paddings > 0.5)[:, tf.newaxis, tf.newaxis, :]
        if p.causal:
            later = (tf.range(tf.shape(key_value)[1])[tf.newaxis, :] >
                     tf.range(tf.shape(query)[1])[:, tf.newaxis])
            invalid = later if invalid is None else tf.logical_or(invalid, later)
        if invalid is not None:
            # Finite, as in Lingvo: a query whose keys are all masked then attends uniformly
            # instead of producing NaNs.
            logits = tf.where(invalid, tf.constant(-0.7 * logits.dtype.max, logits.dtype), logits)
        probs = tf.nn.softmax(logits, axis=-1)
        probs = self.atten_dropout.FProp(theta.atten_dropout, probs)
        context = tf.einsum('bhts,bshk->bthk', probs, v)
        return self._Project(theta, 'o', context, heads=False)

    # ---- incremental decoding (inference) -------------------------------------------------------
    def KeyValueCache(self, theta, key_value) -> NestedMap:
        """The projected keys and values of `key_value` [B, S, D]: NestedMap(key, value), each
        [B, S, H, d]. A cross-attention's cache, computed once per source."""
        return NestedMap(key=self._Project(theta, 'k', key_value),
                         value=self._Project(theta, 'v', key_value))

    def EmptyCache(self, batch_size: int, length: int, dtype) -> NestedMap:
        """A self-attention's cache for `length` positions, none decoded yet."""
        shape = [batch_size, length, self.p.num_heads, self.DimPerHead(self.p)]
        return NestedMap(key=tf.zeros(shape, dtype), value=tf.zeros(shape, dtype))

    def ExtendStep(self, theta, query, cache: NestedMap, t, paddings=None,
                   self_attention: bool = True):
        """Attention of one query position `t` (inference: no dropout), as FProp computes it
        for that position.

        Args:
          theta: this layer's variable values.
          query: [B, 1, D], position t's.
          cache: NestedMap(key, value) [B, L, H, d]: for self-attention the positions before t
            (`EmptyCache`, then each step's return); for cross-attention `KeyValueCache`.
          t: the position (scalar int tensor).
          paddings: [B, L] float, 1.0 at keys never attended to; or None.
          self_attention: whether position t's own key and value join the cache (and, with
            `causal`, positions after t are masked).

        Returns:
          (output [B, 1, D], the cache with position t's key and value when self_attention).
        """
        p = self.p
        q = self._Project(theta, 'q', query) * (self.DimPerHead(p) ** -0.5)
        length = cache.key.shape[1] if cache.key.shape[1] is not None else tf.shape(cache.key)[1]
        if self_attention:
            at_t = tf.reshape(tf.one_hot(t, length, dtype=query.dtype), [1, -1, 1, 1])
            cache = NestedMap(
                key=cache.key * (1 - at_t) + self._Project(theta, 'k', query) * at_t,
                value=cache.value * (1 - at_t) + self._Project(theta, 'v', query) * at_t)
        logits = tf.einsum('bthk,bshk->bhts', q, cache.key)
        invalid = None
        if paddings is not None:
            invalid = (paddings > 0.5)[:, tf.newaxis, tf.newaxis, :]
        if self_attention and p.causal:
            later = (tf.range(length) > t)[tf.newaxis, tf.newaxis, tf.newaxis, :]
            invalid = later if invalid is None else tf.logical_or(invalid, later)
        if invalid is not None:
            logits = tf.where(invalid, tf.constant(-0.7 * logits.dtype.max, logits.dtype), logits)
        probs = tf.nn.softmax(logits, axis=-1)
        context = tf.einsum('bhts,bshk->bthk', probs, cache.value)
        return self._Project(theta, 'o', context, heads=False), cache

    @classmethod
    def FPropMeta(cls, p, query_shape, key_value_shape=None, paddings_shape=None):
        layer = p.name or cls.__name__
        query, key_value = cls._CheckShapes(p, layer, query_shape, key_value_shape,
                                            paddings_shape)
        if not (query.is_fully_defined() and key_value.is_fully_defined()):
            raise ValueError(f'{layer}: FPropMeta needs fully defined shapes, got query '
                             f'{query} and key_value {key_value}.')
        batch, t, d_model = query.as_list()
        s = key_value[1]
        heads, d = p.num_heads, cls.DimPerHead(p)
        n = heads * d
        flops = 2 * batch * (t + 2 * s) * d_model * n + 2 * batch * t * n * d_model
        if p.has_bias:
            flops += batch * (t + s) * n + batch * t * d_model
        flops += batch * t * n
        logits = batch * heads * t * s
        flops += 2 * 2 * logits * d
        if paddings_shape is not None or p.causal:
            flops += _MASK_FLOPS_PER_LOGIT * logits
        flops += _SOFTMAX_FLOPS_PER_LOGIT * logits
        probs = tf.TensorShape([batch, heads, t, s])
        dropout = _DropoutMeta(p.atten_dropout_keep_prob, probs, p.dtype)
        flops += dropout.flops
        num_params = 4 * d_model * n + (2 * n + d_model) * int(p.has_bias)
        out = tf.TensorShape([batch, t, d_model])
        kept = [tf.TensorShape([batch, t, n]), tf.TensorShape([batch, s, n]),
                tf.TensorShape([batch, s, n]), probs, tf.TensorShape([batch, t, n]), out]
        activation_bytes = base_layer.ActivationBytes(kept, p) + dropout.activation_bytes
        return LayerMeta(out, flops, num_params, activation_bytes)


class TransformerLayer(BaseLayer):
    """One pre-layer-norm Transformer block: NestedMap in, NestedMap of the same structure out.

    Input NestedMap:
      vec: [B, T, D] float.
      paddings: [B, T] float, 1.0 at padded positions (required, all zeros when nothing is
        padded, so every block has one contract).
      encoder_vec: [B, S, D] and encoder_paddings: [B, S], only with has_cross_attention.

    The block computes
      x += dropout(self_atten(layer_norm(x), paddings))
      x += dropout(cross_atten(layer_norm(x), encoder_vec, encoder_paddings))  (cross attention)
      x += dropout(ffn_out(dropout(act(ffn_in(layer_norm(x))))))
    and returns the input NestedMap with `vec` replaced. Every other entry (paddings, the encoder
    outputs, or anything a pipeline carries past this block) passes through unchanged; all of
    them must have the batch dimension to travel through a pipeline. A stack of pre-LN blocks
    wants a final layer norm on `vec`, which the model adds after the last block.

    `ffn_init_scale` multiplies the scale of the FFN weights' initialisation (the GPipe paper
    scales the FFN layers' initialisation down by the number of layers for trainability).
    """

    THETA_METHODS = ('ExtendStep', 'DecodeCache')  # In fprop_dtype, as FProp.

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('model_dim', 0, 'Size D of vec\'s last dimension.')
        p.Define('hidden_dim', 0, 'Size of the feed-forward network\'s hidden layer.')
        p.Define('num_heads', 1, 'Number of attention heads.')
        p.Define('dim_per_head', None,
                 'Size of each attention head; None means model_dim // num_heads.')
        p.Define('causal', False, 'Whether self-attention is causal (decoder-only LM style).')
        p.Define('has_cross_attention', False,
                 'Whether the block attends to encoder_vec after self-attention (decoder).')
        p.Define('residual_dropout_keep_prob', 1.0,
                 'Keep probability of dropout on each sub-layer\'s output before the residual add.')
        p.Define('atten_dropout_keep_prob', 1.0,
                 'Keep probability of dropout on the attention probabilities.')
        p.Define('relu_dropout_keep_prob', 1.0,
                 'Keep probability of dropout on the feed-forward hidden activations.')
        p.Define('ffn_activation', 'relu',
                 'Activation of the feed-forward hidden layer: one of '
                 f'{sorted(basic.ACTIVATIONS)}.')
        p.Define('ffn_init_scale', 1.0,
                 'Multiplies the initialisation scale of the feed-forward weights (GPipe uses '
                 '1 / num_layers).')
        return p

    @classmethod
    def _ChildParams(cls, p) -> dict:
        """The children's Params by name, in the order FProp applies them."""
        layer = p.name or cls.__name__
        if p.model_dim <= 0 or p.hidden_dim <= 0:
            raise ValueError(f'{layer}: model_dim and hidden_dim must be positive, got '
                             f'{p.model_dim} and {p.hidden_dim}.')
        if not p.ffn_init_scale > 0:
            raise ValueError(f'{layer}: ffn_init_scale must be positive, got '
                             f'{p.ffn_init_scale}.')
        basic.CheckActivation(p.ffn_activation)

        def LayerNorm():
            return normalization.LayerNormLayer.Params().Set(input_dim=p.model_dim,
                                                             dtype=p.dtype)

        def Attention(causal):
            return MultiHeadAttentionLayer.Params().Set(
                model_dim=p.model_dim, num_heads=p.num_heads, dim_per_head=p.dim_per_head,
                causal=causal, atten_dropout_keep_prob=p.atten_dropout_keep_prob, dtype=p.dtype,
                params_init=p.params_init.Copy())

        def Dropout(keep_prob):
            return basic.DropoutLayer.Params().Set(keep_prob=keep_prob, dtype=p.dtype)

        def Dense(input_dim, output_dim, activation='none'):
            init = p.params_init.Copy()
            init.scale = init.scale * p.ffn_init_scale
            return basic.DenseLayer.Params().Set(input_dim=input_dim, output_dim=output_dim,
                                                 activation=activation, dtype=p.dtype,
                                                 params_init=init)

        children = {
            'self_atten_ln': LayerNorm(),
            'self_atten': Attention(p.causal),
            'self_atten_dropout': Dropout(p.residual_dropout_keep_prob),
        }
        if p.has_cross_attention:
            children.update({
                'cross_atten_ln': LayerNorm(),
                'cross_atten': Attention(False),
                'cross_atten_dropout': Dropout(p.residual_dropout_keep_prob),
            })
        children.update({
            'ffn_ln': LayerNorm(),
            'ffn_in': Dense(p.model_dim, p.hidden_dim, p.ffn_activation),
            'relu_dropout': Dropout(p.relu_dropout_keep_prob),
            'ffn_out': Dense(p.hidden_dim, p.model_dim),
            'ffn_dropout': Dropout(p.residual_dropout_keep_prob),
        })
        return children

    @classmethod
    def _CheckShapes(cls, p, layer: str, shapes) -> NestedMap:
        """The input shapes as a NestedMap, the entries the block reads as TensorShapes."""
        required = ['vec', 'paddings']
        if p.has_cross_attention:
            required += ['encoder_vec', 'encoder_paddings']
        missing = [k for k in required if k not in shapes]
        if missing:
            raise ValueError(f'{layer}: the input NestedMap lacks {missing}; it has '
                             f'{sorted(shapes)}.')
        shapes = NestedMap(shapes)
        for key in required:
            shapes[key] = tf.TensorShape(shapes[key])
        vec = _Shape(shapes.vec, layer, 3, 'vec')
        basic.LastDim(vec, layer, p.model_dim)
        if not shapes.paddings.is_compatible_with(vec[:2]):
            raise ValueError(f'{layer}: paddings shape {shapes.paddings} does not match vec '
                             f'shape {vec} without its last dimension.')
        if p.has_cross_attention:
            encoder_vec = _Shape(shapes.encoder_vec, layer, 3, 'encoder_vec')
            basic.LastDim(encoder_vec, layer, p.model_dim)
            if not vec[:1].is_compatible_with(encoder_vec[:1]):
                raise ValueError(f'{layer}: vec shape {vec} and encoder_vec shape '
                                 f'{encoder_vec} disagree on the batch size.')
            if not shapes.encoder_paddings.is_compatible_with(encoder_vec[:2]):
                raise ValueError(f'{layer}: encoder_paddings shape {shapes.encoder_paddings} '
                                 f'does not match encoder_vec shape {encoder_vec} without its '
                                 f'last dimension.')
        return shapes

    def __init__(self, params):
        super().__init__(params)
        for name, child_params in self._ChildParams(self.p).items():
            self.CreateChild(name, child_params)

    def _Residual(self, theta, name: str, x, y):
        dropout = f'{name}_dropout'
        return x + getattr(self, dropout).FProp(theta[dropout], y)

    def FProp(self, theta, inputs: NestedMap) -> NestedMap:
        """Applies the block to `inputs.vec`; see the class docstring.

        Args:
          theta: NestedMap of this layer's and its children's variable values.
          inputs: NestedMap(vec, paddings[, encoder_vec, encoder_paddings], ...).

        Returns:
          `inputs` with `vec` replaced by the block's output.
        """
        self._CheckShapes(self.p, self.path, tf.nest.map_structure(lambda t: t.shape, inputs))
        x = inputs.vec
        y = self.self_atten_ln.FProp(theta.self_atten_ln, x)
        y = self.self_atten.FProp(theta.self_atten, y, None, inputs.paddings)
        x = self._Residual(theta, 'self_atten', x, y)
        if self.p.has_cross_attention:
            y = self.cross_atten_ln.FProp(theta.cross_atten_ln, x)
            y = self.cross_atten.FProp(theta.cross_atten, y, inputs.encoder_vec,
                                       inputs.encoder_paddings)
            x = self._Residual(theta, 'cross_atten', x, y)
        y = self.ffn_ln.FProp(theta.ffn_ln, x)
        y = self.ffn_in.FProp(theta.ffn_in, y)
        y = self.relu_dropout.FProp(theta.relu_dropout, y)
        y = self.ffn_out.FProp(theta.ffn_out, y)
        x = self._Residual(theta, 'ffn', x, y)
        outputs = inputs.copy()
        outputs.vec = x
        return outputs

    def DecodeCache(self, theta, batch_size: int, length: int, encoder_vec=None) -> NestedMap:
        """The state `ExtendStep` starts from: an empty self-attention cache of `length`
        positions and, with cross-attention, the encoder's projected keys and values."""
        cache = NestedMap(self_atten=self.self_atten.EmptyCache(
            batch_size, length,
            base_layer.FPropDtype(self.p) if encoder_vec is None else encoder_vec.dtype))
        if self.p.has_cross_attention:
            cache.cross_atten = self.cross_atten.KeyValueCache(theta.cross_atten, encoder_vec)
        return cache

    def ExtendStep(self, theta, vec, cache: NestedMap, t, encoder_paddings=None):
        """The block at one target position `t` in inference (incremental decoding): what
        FProp gives at position t of a causal block, from the positions before it (`cache`).

        Args:
          vec: [B, 1, D], position t's input.
          cache: `DecodeCache`, then each step's returned cache.
          t: the position (scalar int tensor).
          encoder_paddings: [B, S], with cross-attention.

        Returns:
          (vec [B, 1, D], the cache with position t).
        """
        x = vec
        y = self.self_atten_ln.FProp(theta.self_atten_ln, x)
        y, self_cache = self.self_atten.ExtendStep(theta.self_atten, y, cache.self_atten, t)
        x = x + y
        cache = NestedMap(cache, self_atten=self_cache)
        if self.p.has_cross_attention:
            y = self.cross_atten_ln.FProp(theta.cross_atten_ln, x)
            y, _ = self.cross_atten.ExtendStep(theta.cross_atten, y, cache.cross_atten, t,
                                               encoder_paddings, self_attention=False)
            x = x + y
        y = self.ffn_ln.FProp(theta.ffn_ln, x)
        y = self.ffn_out.FProp(theta.ffn_out, self.ffn_in.FProp(theta.ffn_in, y))
        return x + y, cache

    @classmethod
    def FPropMeta(cls, p, input_shapes) -> LayerMeta:
        """Sums the children's costs and the residual adds (one FLOP per element of vec each)."""
        layer = p.name or cls.__name__
        children = cls._ChildParams(p)
        shapes = cls._CheckShapes(p, layer, input_shapes)
        vec = shapes.vec
        if not vec.is_fully_defined():
            raise ValueError(f'{layer}: FPropMeta needs a fully defined vec shape, got {vec}.')
        hidden = vec[:-1].concatenate([p.hidden_dim])
        metas = []

        def Add(name, *args):
            metas.append(children[name].cls.FPropMeta(children[name], *args))

        def AddDropout(name, shape):
            metas.append(_DropoutMeta(children[name].keep_prob, shape, p.dtype))

        Add('self_atten_ln', vec)
        Add('self_atten', vec, None, shapes.paddings)
        AddDropout('self_atten_dropout', vec)
        if p.has_cross_attention:
            Add('cross_atten_ln', vec)
            Add('cross_atten', vec, shapes.encoder_vec, shapes.encoder_paddings)
            AddDropout('cross_atten_dropout', vec)
        Add('ffn_ln', vec)
        Add('ffn_in', vec)
        AddDropout('relu_dropout', hidden)
        Add('ffn_out', hidden)
        AddDropout('ffn_dropout', vec)
        num_residuals = 3 if p.has_cross_attention else 2
        out = NestedMap(shapes)
        return LayerMeta(
            out,
            sum(m.flops for m in metas) + num_residuals * vec.num_elements(),
            sum(m.num_params for m in metas),
            sum(m.activation_bytes for m in metas) +
            num_residuals * base_layer.ActivationBytes(vec, p))
