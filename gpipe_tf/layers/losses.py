"""Loss layers: a softmax classifier with cross-entropy, label smoothing and logit clipping."""

from __future__ import annotations

import tensorflow as tf

from gpipe_tf import errors
from gpipe_tf.layers import base_layer
from gpipe_tf.layers import basic
from gpipe_tf.layers import precision
from gpipe_tf.layers.base_layer import BaseLayer, LayerMeta, WeightParams
from gpipe_tf.nested_map import NestedMap

# Approximate FLOPs per logit of log-softmax (max, subtract, exp, sum, log) and of the
# cross-entropy with smoothed targets (target, multiply-add).
_XENT_FLOPS_PER_LOGIT = 8


class SoftmaxCrossEntropyLayer(BaseLayer):
    """Projects features to logits and computes the softmax cross-entropy with the labels.

    FProp takes NestedMap(features=[..., input_dim] float, labels=[...] int ids, weights=[...]
    float, optional, default 1) and returns NestedMap(
        logits=[..., num_classes],
        per_example_loss=[...]: cross-entropy of each example, unweighted,
        loss=[]: sum(weights * per_example_loss) / sum(weights), so the mean over the batch when
            all weights are 1 (0 when all weights are 0),
        total_weight=[]: sum(weights), to combine the losses of several batches,
        accuracy=[]: weighted fraction of examples whose arg-max logit is the label).

    Under a bfloat16 or float16 fprop_dtype the projection computes in it, the softmax and the
    outputs in float32.

    Label smoothing trains against targets (1 - s) * one_hot + s / num_classes. With
    `logits_clip` = c the logits are clipped to [-c, c], the trainability fix of GPipe §5 (a
    clipped logit passes no gradient while it is beyond c).
    """

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('input_dim', 0, 'Size of the features\' last dimension.')
        p.Define('num_classes', 0, 'Number of classes (logits per example).')
        p.Define('label_smoothing', 0.0, 'Label smoothing s in [0, 1).')
        p.Define('logits_clip', None, 'None, or c > 0: logits are clipped to [-c, c].')
        p.Define('has_bias', True, 'Whether the projection adds a bias.')
        p.Define('tied_weight', False,
                 'Whether the projection\'s weight is another layer\'s table [num_classes, '
                 'input_dim] (a tied embedding): no variable of this layer; the parent puts it '
                 'in theta as `w` (its tied_weights), and logits = features . w^T.')
        return p

    @classmethod
    def _CheckParams(cls, p, layer: str) -> None:
        if p.input_dim <= 0 or p.num_classes <= 0:
            raise ValueError(f'{layer}: input_dim and num_classes must be positive, got '
                             f'{p.input_dim} and {p.num_classes}.')
        if not 0.0 <= p.label_smoothing < 1.0:
            raise ValueError(f'{layer}: label_smoothing must be in [0, 1), got '
                             f'{p.label_smoothing}.')
        if p.logits_clip is not None and not p.logits_clip > 0:
            raise ValueError(f'{layer}: logits_clip must be None or positive, got '
                             f'{p.logits_clip}.')

    @classmethod
    def _CheckShapes(cls, p, layer: str, features, labels, weights=None) -> tf.TensorShape:
        """The examples' shape (features without the last dimension), checked."""
        basic.LastDim(features, layer, p.input_dim)
        examples = tf.TensorShape(features)[:-1]
        for name, shape in (('labels', labels), ('weights', weights)):
            if shape is not None and not examples.is_compatible_with(shape):
                raise ValueError(f'{layer}: {name} shape {tf.TensorShape(shape)} does not match '
                                 f'features shape {tf.TensorShape(features)} without its last '
                                 f'dimension.')
        return examples

    def __init__(self, params):
        super().__init__(params)
        p = self.p
        self._CheckParams(p, self.path)
        if not p.tied_weight:
            self.CreateVariable('w', WeightParams((p.input_dim, p.num_classes)))
        if p.has_bias:
            self.CreateVariable('b', WeightParams((p.num_classes,),
                                                  base_layer.WeightInit.Constant(0.0)))

    def FProp(self, theta, inputs: NestedMap) -> NestedMap:
        p = self.p
        features, labels = inputs.features, inputs.labels
        weights = inputs.get('weights')
        self._CheckShapes(p, self.path, features.shape, labels.shape,
                          None if weights is None else weights.shape)
        if not labels.dtype.is_integer:
            raise ValueError(
                    f'{self.path}: expected integer labels, got dtype {labels.dtype.name}.')
        if p.tied_weight:  # A tied table is [num_classes, input_dim]: a row per class.
            w = theta.get('w')
            if w is None or w.shape != (p.num_classes, p.input_dim):
                raise errors.ConfigError(
                    f'{self.path}: tied_weight=True reads a [num_classes, input_dim] = '
                    f'[{p.num_classes}, {p.input_dim}] table as w, which the parent\'s '
                    'tied_weights give ([consumer, producer] paths); got '
                    f'{"none" if w is None else list(w.shape)}.')
        logits = tf.tensordot(features, theta.w,
                              axes=[[features.shape.rank - 1], [1 if p.tied_weight else 0]])
        if p.has_bias:
            logits += theta.b
        # The softmax and the loss in float32 when the projection computed in bfloat16 or
        # float16 (mixed precision).
        logits = precision.AtLeastFloat32(logits)
        weights = (tf.ones(tf.shape(labels), logits.dtype) if weights is None else
                   tf.cast(weights, logits.dtype))
        if p.logits_clip is not None:
            logits = tf.clip_by_value(logits, -p.logits_clip, p.logits_clip)
        targets = tf.one_hot(labels, p.num_classes, dtype=logits.dtype)
        if p.label_smoothing:
            targets = targets * (1.0 - p.label_smoothing) + p.label_smoothing / p.num_classes
        per_example_loss = tf.nn.softmax_cross_entropy_with_logits(
                labels=tf.stop_gradient(targets), logits=logits)
        total_weight = tf.reduce_sum(weights)
        predictions = tf.argmax(logits, axis=-1, output_type=tf.int64)
        correct = tf.cast(tf.equal(predictions, tf.cast(labels, tf.int64)), weights.dtype)
        return NestedMap(
                logits=logits,
                per_example_loss=per_example_loss,
                loss=tf.math.divide_no_nan(tf.reduce_sum(weights * per_example_loss), total_weight),
                total_weight=total_weight,
                accuracy=tf.math.divide_no_nan(tf.reduce_sum(weights * correct), total_weight))

    @classmethod
    def FPropMeta(cls, p, input_shapes: NestedMap) -> LayerMeta:
        layer = p.name or cls.__name__
        cls._CheckParams(p, layer)
        examples = cls._CheckShapes(p, layer, input_shapes.features, input_shapes.labels,
                                    input_shapes.get('weights'))
        if not examples.is_fully_defined():
            raise ValueError(f'{layer}: expected fully defined shapes, got features shape '
                             f'{tf.TensorShape(input_shapes.features)}.')
        scalar = tf.TensorShape([])
        out = NestedMap(logits=examples.concatenate([p.num_classes]), per_example_loss=examples,
                        loss=scalar, total_weight=scalar, accuracy=scalar)
        rows = examples.num_elements()
        logits = rows * p.num_classes
        flops = 2 * rows * p.input_dim * p.num_classes + logits * int(p.has_bias)
        flops += logits * (_XENT_FLOPS_PER_LOGIT + int(p.logits_clip is not None))
        num_params = (p.input_dim * p.num_classes * int(not p.tied_weight) +
                      p.num_classes * int(p.has_bias))
        loss_dtype = precision.AtLeastFloat32Dtype(base_layer.FPropDtype(p))
        return LayerMeta(out, flops, num_params, base_layer.OutputBytes(out, loss_dtype),
                         tied_params=p.input_dim * p.num_classes * int(p.tied_weight))
