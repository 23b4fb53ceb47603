"""Tests of the layers: FPropMeta against reality, gradients, Params text, and each layer's own
semantics (dropout masks, batch norm statistics, window shapes, the loss)."""

from unittest import mock

import pytest
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

from gpipe_tf import test_utils
from gpipe_tf.layers import base_layer
from gpipe_tf.layers import basic
from gpipe_tf.layers import conv
from gpipe_tf.layers import embedding
from gpipe_tf.layers import fprop_context
from gpipe_tf.layers import losses
from gpipe_tf.layers import normalization
from gpipe_tf.layers import pooling
from gpipe_tf.layers import sequential
from gpipe_tf.nested_map import NestedMap

pytestmark = pytest.mark.unit


def _Normal(shape, seed=0, mean=0.0, stddev=1.0):
    return tf.random.stateless_normal(shape, [seed, 7], mean=mean, stddev=stddev)


def _Images(n=2, h=7, w=7, c=3, seed=0):
    return _Normal([n, h, w, c], seed)


def _Conv(name='conv', filter_shape=(3, 3, 3, 4), **kwargs):
    return conv.Conv2DLayer.Params().Set(name=name, filter_shape=filter_shape, **kwargs)


def _Xent(**kwargs):
    return losses.SoftmaxCrossEntropyLayer.Params().Set(
            name='xent', input_dim=4, num_classes=5, **kwargs)


def _XentInputs(with_weights=True):
    inputs = NestedMap(features=_Normal([2, 3, 4], seed=1),
                       labels=tf.constant([[0, 1, 4], [2, 2, 3]], tf.int32))
    if with_weights:
        inputs.weights = tf.constant([[1.0, 0.5, 2.0], [0.0, 1.0, 1.0]])
    return inputs


# Every layer, as (name, params factory, inputs factory); the inputs are the FProp arguments.
_CASES = [
        ('_dense', lambda: basic.DenseLayer.Params().Set(
                name='dense', input_dim=3, output_dim=4, activation='tanh'),
         lambda: (_Normal([2, 5, 3]),)),
        ('_activation', lambda: basic.ActivationLayer.Params().Set(name='act', activation='gelu'),
         lambda: (_Normal([2, 3]),)),
        ('_identity', lambda: basic.IdentityLayer.Params().Set(name='id'),
         lambda: (_Normal([2, 3]),)),
        ('_dropout', lambda: basic.DropoutLayer.Params().Set(name='drop', keep_prob=0.5),
         lambda: (_Normal([4, 8]),)),
        ('_conv', lambda: _Conv(filter_stride=(2, 2), activation='relu'),
         lambda: (_Images(),)),
        ('_conv_dilated', lambda: _Conv(dilation_rate=(2, 2), padding='VALID', has_bias=False),
         lambda: (_Images(),)),
        ('_depthwise', lambda: conv.DepthwiseConv2DLayer.Params().Set(
                name='dw', filter_shape=(3, 3, 3, 2), filter_stride=(2, 2), padding='VALID'),
         lambda: (_Images(),)),
        ('_separable', lambda: conv.SeparableConv2DLayer.Params().Set(
                name='sep', filter_shape=(3, 3, 3, 5), channel_multiplier=2, activation='relu6'),
         lambda: (_Images(),)),
        ('_batch_norm', lambda: normalization.BatchNormLayer.Params().Set(name='bn', dim=3),
         lambda: (_Images(h=5, w=5),)),
        ('_layer_norm', lambda: normalization.LayerNormLayer.Params().Set(name='ln', input_dim=4),
         lambda: (_Normal([2, 3, 4]),)),
        ('_max_pool', lambda: pooling.Pooling2DLayer.Params().Set(
                name='pool', window_shape=(3, 3), window_stride=(2, 2), padding='SAME'),
         lambda: (_Images(),)),
        ('_avg_pool', lambda: pooling.Pooling2DLayer.Params().Set(name='pool', pooling_type='AVG'),
         lambda: (_Images(),)),
        ('_global_avg_pool', lambda: pooling.GlobalPoolingLayer.Params().Set(
                name='gpool', keepdims=True),
         lambda: (_Images(),)),
        ('_global_max_pool', lambda: pooling.GlobalPoolingLayer.Params().Set(
                name='gpool', pooling_type='MAX'),
         lambda: (_Images(),)),
        ('_embedding', lambda: embedding.EmbeddingLayer.Params().Set(
                name='emb', vocab_size=10, embedding_dim=4, scale_sqrt_depth=True),
         lambda: (tf.constant([[1, 2, 3], [9, 0, 1]]),)),
        ('_softmax_xent', lambda: _Xent(label_smoothing=0.1, logits_clip=10.0),
         lambda: (_XentInputs(),)),
        ('_sequential_repeat', lambda: sequential.SequentialLayer.Params().Set(
                name='seq', repeat=2, sub=[
                        _Conv(filter_shape=(3, 3, 4, 4)),
                        normalization.BatchNormLayer.Params().Set(name='bn', dim=4),
                        basic.ActivationLayer.Params().Set(name='relu')]),
         lambda: (_Images(h=5, w=5, c=4),)),
        ('_sequential_cnn', lambda: sequential.SequentialLayer.Params().Set(
                name='cnn', sub=[
                        _Conv(filter_shape=(3, 3, 3, 8), filter_stride=(2, 2)),
                        normalization.BatchNormLayer.Params().Set(name='bn', dim=8),
                        basic.ActivationLayer.Params().Set(name='relu'),
                        pooling.Pooling2DLayer.Params().Set(name='pool', padding='SAME'),
                        pooling.GlobalPoolingLayer.Params().Set(name='gpool'),
                        basic.DenseLayer.Params().Set(name='logits', input_dim=8, output_dim=5)]),
         lambda: (_Images(h=9, w=9),)),
]


def _Shapes(inputs):
    return tf.nest.map_structure(lambda t: t.shape, inputs)


class EveryLayerTest(tf.test.TestCase, parameterized.TestCase):
    """Properties every layer has, checked on every layer."""

    @parameterized.named_parameters(*_CASES)
    def testFPropMetaOutShapesMatchOutputs(self, make_params, make_inputs):
        p = make_params()
        inputs = make_inputs()
        outputs = p.Instantiate()(*inputs)
        meta = p.cls.FPropMeta(p, *_Shapes(inputs))
        tf.nest.assert_same_structure(meta.out_shapes, _Shapes(outputs))
        for predicted, actual in zip(tf.nest.flatten(meta.out_shapes),
                                     tf.nest.flatten(_Shapes(outputs))):
            self.assertEqual(predicted.as_list(), actual.as_list())

    @parameterized.named_parameters(*_CASES)
    def testFPropMetaNumParamsMatchVariables(self, make_params, make_inputs):
        p = make_params()
        layer = p.Instantiate()
        built = sum(int(np.prod(v.shape)) for v in layer.variables)
        self.assertEqual(p.cls.FPropMeta(p, *_Shapes(make_inputs())).num_params, built)

    @parameterized.named_parameters(*_CASES)
    def testGradientsMatchFiniteDifferences(self, make_params, make_inputs):
        # Relu, relu6 and max pooling have kinks: the check fails with "not differentiable
        # here" if a seeded input lies within its step (1e-6) of one. These lie 6e-6 or more
        # away (sequential_cnn's max-pool near-tie is the closest).
        p = make_params()
        for layer_params in [p] + dict(p.IterParams()).get('sub', []):
            layer_params.dtype = tf.float64  # Sub-layers do not take their parent's dtype.
        inputs = tf.nest.map_structure(
                lambda t: tf.cast(t, tf.float64) if t.dtype.is_floating else t, make_inputs())
        test_utils.AssertGradientsMatchFiniteDifferences(self, p.Instantiate(), *inputs)

    @parameterized.named_parameters(*_CASES)
    def testParamsRoundTripThroughText(self, make_params, make_inputs):
        del make_inputs
        p = make_params()
        self.assertEqual(p.cls.Params().FromText(p.ToText()), p)


class CostTest(tf.test.TestCase):

    def testOneByOneConvCostsAsMuchAsDense(self):
        shape = tf.TensorShape([2, 5, 5, 3])
        conv_p = _Conv(filter_shape=(1, 1, 3, 4))
        dense_p = basic.DenseLayer.Params().Set(name='dense', input_dim=3, output_dim=4)
        self.assertEqual(conv_p.cls.FPropMeta(conv_p, shape).flops,
                         dense_p.cls.FPropMeta(dense_p, shape).flops)

    def testConvFlopsCountTwoPerMultiplyAdd(self):
        p = _Conv(filter_shape=(3, 3, 2, 4), has_bias=False, padding='VALID')
        meta = p.cls.FPropMeta(p, tf.TensorShape([1, 5, 5, 2]))
        self.assertEqual(meta.flops, 2 * (3 * 3 * 4) * (3 * 3 * 2))

    def testDepthwiseFlopsSumOverTheWindowOnly(self):
        p = conv.DepthwiseConv2DLayer.Params().Set(
                name='dw', filter_shape=(3, 3, 2, 4), has_bias=False, padding='VALID')
        meta = p.cls.FPropMeta(p, tf.TensorShape([1, 5, 5, 2]))
        self.assertEqual(meta.flops, 2 * (3 * 3 * 8) * (3 * 3))

    def testSeparableKeepsBothOutputs(self):
        p = conv.SeparableConv2DLayer.Params().Set(
                name='sep', filter_shape=(3, 3, 4, 8), channel_multiplier=2)
        meta = p.cls.FPropMeta(p, tf.TensorShape([1, 6, 6, 4]))
        self.assertEqual(meta.activation_bytes, 2 * (6 * 6 * 8) * 4)

    def testSeparableCostsItsTwoChildren(self):
        p = conv.SeparableConv2DLayer.Params().Set(
                name='sep', filter_shape=(3, 3, 4, 8), channel_multiplier=2)
        shape = tf.TensorShape([1, 6, 6, 4])
        depthwise = conv.DepthwiseConv2DLayer.Params().Set(
                name='dw', filter_shape=(3, 3, 4, 2), has_bias=False)
        pointwise = _Conv(filter_shape=(1, 1, 8, 8))
        expected = (depthwise.cls.FPropMeta(depthwise, shape).flops +
                    pointwise.cls.FPropMeta(pointwise, tf.TensorShape([1, 6, 6, 8])).flops)
        self.assertEqual(p.cls.FPropMeta(p, shape).flops, expected)


class ChainMetaTest(tf.test.TestCase):
    """ChainMeta computes each distinct layer's FPropMeta once: names do not count."""

    def testEqualLayersAreComputedOnceAndOthersAgain(self):
        dense = lambda i, dim=8: basic.DenseLayer.Params().Set(name=f'dense_{i}', input_dim=8,
                                                              output_dim=dim)
        calls = []
        original = basic.DenseLayer.FPropMeta.__func__

        def Counting(cls, p, *shapes):
            calls.append(p.name)
            return original(cls, p, *shapes)

        with mock.patch.object(basic.DenseLayer, 'FPropMeta', classmethod(Counting)):
            sequential._METAS.clear()  # pylint: disable=protected-access
            total, metas = sequential.ChainMeta([dense(i) for i in range(6)],
                                                tf.TensorShape([4, 8]))
            self.assertEqual(calls, ['dense_0'])
            self.assertEqual(total.flops, 6 * metas[0].flops)
            # Another output size, and another input shape: computed anew.
            sequential.ChainMeta([dense(6, dim=4)], tf.TensorShape([4, 8]))
            sequential.ChainMeta([dense(7)], tf.TensorShape([2, 8]))
            self.assertEqual(calls, ['dense_0', 'dense_6', 'dense_7'])
            self.assertEqual(
                sequential.ChainMeta([dense(8, dim=4)], tf.TensorShape([4, 8]))[0].out_shapes,
                tf.TensorShape([4, 4]))


class DropoutLayerTest(tf.test.TestCase):

    def _Layer(self, keep_prob=0.5):
        return basic.DropoutLayer.Params().Set(name='drop', keep_prob=keep_prob).Instantiate()

    def testSameMaskForSameStepAndExamples(self):
        layer, x = self._Layer(), tf.ones([8, 16])
        with fprop_context.Scope(step=3, first_example=8):
            first = layer(x)
        with fprop_context.Scope(step=3, first_example=8):
            second = layer(x)
        self.assertAllEqual(first, second)

    def testEachExamplesMaskIsTheSameInAnySplitOfTheBatch(self):
        layer, x = self._Layer(), tf.ones([12, 5, 3])
        for batch_dim in (0, 1):
            with self.subTest(batch_dim=repr(batch_dim)):
                x = tf.ones([12, 5, 3]) if batch_dim == 0 else tf.ones([5, 12, 3])
                with fprop_context.Scope(step=3, batch_dim=batch_dim):
                    whole = layer(x)
                for parts in (2, 3, 4, 12):
                    pieces = []
                    for m, piece in enumerate(tf.split(x, parts, batch_dim)):
                        first = m * piece.shape[batch_dim]
                        with fprop_context.Scope(step=3, batch_dim=batch_dim,
                                                 first_example=first):
                            pieces.append(layer(piece))
                    self.assertAllEqual(tf.concat(pieces, batch_dim), whole)

    def testExamplesAtOtherIndicesGetOtherMasks(self):
        layer, x = self._Layer(), tf.ones([8, 16])
        with fprop_context.Scope(step=3, first_example=0):
            first = layer(x)
        with fprop_context.Scope(step=3, first_example=8):
            second = layer(x)
        self.assertNotAllEqual(first, second)

    def testAMaskBroadcastOverTheBatchIsOneForAllExamples(self):
        p = basic.DropoutLayer.Params().Set(name='drop', keep_prob=0.5,
                                            noise_shape_broadcast_dims=[0])
        layer = p.Instantiate()
        with fprop_context.Scope(step=3, first_example=4):
            y = layer(tf.ones([4, 32])).numpy()
        with fprop_context.Scope(step=3, first_example=0):
            z = layer(tf.ones([2, 32])).numpy()
        self.assertAllEqual(y, np.tile(y[:1], [4, 1]))
        self.assertAllEqual(z[0], y[0])

    def testDifferentMaskForAnotherStep(self):
        layer, x = self._Layer(), tf.ones([8, 16])
        with fprop_context.Scope(step=3):
            first = layer(x)
        with fprop_context.Scope(step=4):
            second = layer(x)
        self.assertNotAllEqual(first, second)

    def testIdentityWhenNotTraining(self):
        layer, x = self._Layer(), _Normal([8, 16])
        with fprop_context.Scope(training=False):
            self.assertAllEqual(layer(x), x)

    def testKeepFractionIsNearKeepProb(self):
        y = self._Layer(keep_prob=0.7)(tf.ones([100, 100])).numpy()
        self.assertNear(np.mean(y != 0), 0.7, 0.03)
        self.assertAllClose(y[y != 0], np.full(np.sum(y != 0), 1 / 0.7))


def _BatchNorm(dim=3, decay=0.5):
    return normalization.BatchNormLayer.Params().Set(name='bn', dim=dim, decay=decay)


def _CollectStats(layer, x):
    """The statistics `layer` reports for `x`, collected instead of applied."""
    collector = fprop_context.UpdateCollector()
    with fprop_context.Scope(update_collector=collector):
        layer(x)
    [(reporter, stats)] = collector.Items()
    assert reporter is layer
    return stats


class BatchNormLayerTest(tf.test.TestCase):

    def testTrainingOutputIsNormalisedPerChannel(self):
        layer = _BatchNorm().Instantiate()
        y = layer(_Normal([4, 5, 5, 3], mean=3.0, stddev=2.0)).numpy()
        self.assertAllClose(y.mean(axis=(0, 1, 2)), np.zeros(3), atol=1e-5)
        self.assertAllClose(y.var(axis=(0, 1, 2)), np.ones(3), atol=1e-3)

    def testSummedHalfStatisticsUpdateEqualsWholeBatchUpdate(self):
        x = _Normal([8, 3, 3, 3], mean=3.0, stddev=2.0)
        whole, halves = _BatchNorm().Instantiate(), _BatchNorm().Instantiate()
        whole.ApplyUpdate(_CollectStats(whole, x))
        summed = tf.nest.map_structure(tf.add, _CollectStats(halves, x[:4]),
                                       _CollectStats(halves, x[4:]))
        halves.ApplyUpdate(summed)
        self.assertAllClose(halves.vars.moving_mean, whole.vars.moving_mean, rtol=1e-5, atol=0)
        self.assertAllClose(halves.vars.moving_variance, whole.vars.moving_variance, rtol=1e-5,
                            atol=0)

    def testUpdateMovesTowardsBatchMeanAndBiasedVariance(self):
        x = _Normal([8, 3, 3, 3], mean=3.0, stddev=2.0)
        layer = _BatchNorm(decay=0.75).Instantiate()
        layer.ApplyUpdate(_CollectStats(layer, x))
        reduced = x.numpy().reshape(-1, 3)
        self.assertAllClose(layer.vars.moving_mean, 0.25 * reduced.mean(0), rtol=1e-5)
        self.assertAllClose(layer.vars.moving_variance, 0.75 + 0.25 * reduced.var(0), rtol=1e-5)

    def testCollectorDefersTheUpdate(self):
        layer = _BatchNorm().Instantiate()
        stats = _CollectStats(layer, _Normal([4, 3], mean=3.0))
        self.assertEqual(float(stats.count), 4.0)
        self.assertAllEqual(layer.vars.moving_mean, np.zeros(3))
        self.assertAllEqual(layer.vars.moving_variance, np.ones(3))

    def testEvalUsesMovingStatistics(self):
        layer = _BatchNorm().Instantiate()
        layer.vars.moving_mean.assign([1.0, 2.0, 3.0])
        layer.vars.moving_variance.assign([4.0, 1.0, 0.25])
        layer.vars.gamma.assign([1.0, 2.0, 3.0])
        layer.vars.beta.assign([0.5, 0.0, -0.5])
        x = _Normal([4, 3])
        with fprop_context.Scope(training=False):
            y = layer(x)
        expected = ((x.numpy() - [1.0, 2.0, 3.0]) / np.sqrt(np.array([4.0, 1.0, 0.25]) + 1e-3) *
                    [1.0, 2.0, 3.0] + [0.5, 0.0, -0.5])
        self.assertAllClose(y, expected, rtol=1e-5)

    def testEvalReportsNoUpdate(self):
        layer = _BatchNorm().Instantiate()
        collector = fprop_context.UpdateCollector()
        with fprop_context.Scope(training=False, update_collector=collector):
            layer(_Normal([4, 3]))
        self.assertLen(collector, 0)

    def testEagerTrainingOutsideCollectorUpdatesMovingStatistics(self):
        layer = _BatchNorm(decay=0.5).Instantiate()
        x = _Normal([16, 3], mean=3.0)
        layer(x)
        self.assertAllClose(layer.vars.moving_mean, 0.5 * x.numpy().mean(0), rtol=1e-5)

    def testTfFunctionTrainingUpdatesMovingStatistics(self):
        layer = _BatchNorm(decay=0.5).Instantiate()
        x = _Normal([16, 3], mean=3.0)
        tf.function(layer)(x)
        self.assertAllClose(layer.vars.moving_mean, 0.5 * x.numpy().mean(0), rtol=1e-5)

    def testGraphModeUpdateGoesToUpdateOps(self):
        x_value = _Normal([16, 3], mean=3.0).numpy()
        with tf.Graph().as_default() as graph:
            layer = _BatchNorm(decay=0.5).Instantiate()
            layer(tf.constant(x_value))
            [update] = graph.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)
            with tf.compat.v1.Session() as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                sess.run(update)
                moving_mean = sess.run(layer.vars.moving_mean)
        self.assertAllClose(moving_mean, 0.5 * x_value.mean(0), rtol=1e-5)


class LayerNormLayerTest(tf.test.TestCase):

    def testOutputIsNormalisedOverLastDim(self):
        layer = normalization.LayerNormLayer.Params().Set(name='ln', input_dim=16).Instantiate()
        y = layer(_Normal([3, 16], mean=2.0, stddev=3.0)).numpy()
        self.assertAllClose(y.mean(-1), np.zeros(3), atol=1e-5)
        self.assertAllClose(y.var(-1), np.ones(3), atol=1e-4)


class WindowShapeTest(tf.test.TestCase, parameterized.TestCase):
    """Output sizes for SAME and VALID with stride 2 and odd sizes, against TensorFlow."""

    # Input [1, 7, 9, 4], window 3x3, stride 2.
    _EXPECTED = {'SAME': [4, 5], 'VALID': [3, 4]}

    def _CheckShape(self, p, x, expected_hw, channels):
        y = p.Instantiate()(x)
        self.assertEqual(y.shape.as_list(), [1, *expected_hw, channels])
        self.assertEqual(p.cls.FPropMeta(p, x.shape).out_shapes.as_list(), y.shape.as_list())

    @parameterized.parameters('SAME', 'VALID')
    def testConv(self, padding):
        p = _Conv(filter_shape=(3, 3, 4, 6), filter_stride=(2, 2), padding=padding)
        self._CheckShape(p, _Images(1, 7, 9, 4), self._EXPECTED[padding], 6)

    @parameterized.parameters('SAME', 'VALID')
    def testDepthwise(self, padding):
        p = conv.DepthwiseConv2DLayer.Params().Set(
                name='dw', filter_shape=(3, 3, 4, 2), filter_stride=(2, 2), padding=padding)
        self._CheckShape(p, _Images(1, 7, 9, 4), self._EXPECTED[padding], 8)

    @parameterized.parameters('SAME', 'VALID')
    def testSeparable(self, padding):
        p = conv.SeparableConv2DLayer.Params().Set(
                name='sep', filter_shape=(3, 3, 4, 5), filter_stride=(2, 2), padding=padding)
        self._CheckShape(p, _Images(1, 7, 9, 4), self._EXPECTED[padding], 5)

    @parameterized.parameters(('MAX', 'SAME'), ('MAX', 'VALID'), ('AVG', 'SAME'), ('AVG', 'VALID'))
    def testPooling(self, pooling_type, padding):
        p = pooling.Pooling2DLayer.Params().Set(
                name='pool', pooling_type=pooling_type, window_shape=(3, 3),
                window_stride=(2, 2), padding=padding)
        self._CheckShape(p, _Images(1, 7, 9, 4), self._EXPECTED[padding], 4)

    @parameterized.parameters(('SAME', [7, 9]), ('VALID', [3, 5]))
    def testDilatedConv(self, padding, expected_hw):
        p = _Conv(filter_shape=(3, 3, 4, 6), dilation_rate=(2, 2), padding=padding)
        self._CheckShape(p, _Images(1, 7, 9, 4), expected_hw, 6)

    def testOutputSizeAgreesWithTensorFlowEverywhere(self):
        for padding in conv.PADDINGS:
            for size in range(1, 9):
                for window in range(1, 4):
                    for stride, dilation in ((1, 1), (2, 1), (3, 1), (1, 2), (1, 3)):
                        if padding == 'VALID' and (window - 1) * dilation + 1 > size:
                            continue
                        y = tf.nn.convolution(tf.ones([1, size, 1, 1]),
                                              tf.ones([window, 1, 1, 1]), strides=[stride, 1],
                                              padding=padding, dilations=[dilation, 1])
                        self.assertEqual(
                                conv.OutputSize(size, window, stride, padding, dilation),
                                y.shape[1], (padding, size, window, stride, dilation))

    def testAvgPoolingExcludesPadding(self):
        p = pooling.Pooling2DLayer.Params().Set(
                name='pool', pooling_type='AVG', window_shape=(3, 3), window_stride=(2, 2),
                padding='SAME')
        self.assertAllClose(p.Instantiate()(tf.ones([1, 5, 5, 1])), tf.ones([1, 3, 3, 1]))


class EmbeddingLayerTest(tf.test.TestCase):

    def testLooksUpScaledRows(self):
        layer = embedding.EmbeddingLayer.Params().Set(
                name='emb', vocab_size=10, embedding_dim=4, scale_sqrt_depth=True).Instantiate()
        ids = np.array([[1, 2], [9, 1]])
        table = layer.vars.emb.numpy()
        self.assertAllClose(layer(tf.constant(ids)), table[ids] * 2.0)


def _XentReference(logits, labels, weights, num_classes, label_smoothing):
    targets = np.eye(num_classes)[labels] * (1 - label_smoothing) + label_smoothing / num_classes
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    per_example = -(targets * log_probs).sum(-1)
    return per_example, (weights * per_example).sum() / weights.sum()


class SoftmaxCrossEntropyLayerTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.parameters(0.0, 0.2)
    def testLossMatchesNumpyReference(self, label_smoothing):
        layer = _Xent(label_smoothing=label_smoothing).Instantiate()
        inputs = _XentInputs()
        out = layer(inputs)
        features, weights = inputs.features.numpy(), inputs.weights.numpy()
        logits = features @ layer.vars.w.numpy() + layer.vars.b.numpy()
        per_example, loss = _XentReference(logits, inputs.labels.numpy(), weights, 5,
                                           label_smoothing)
        self.assertAllClose(out.logits, logits, rtol=1e-5)
        self.assertAllClose(out.per_example_loss, per_example, rtol=1e-5)
        self.assertAllClose(out.loss, loss, rtol=1e-5)
        self.assertAllClose(out.total_weight, weights.sum())
        correct = logits.argmax(-1) == inputs.labels.numpy()
        self.assertAllClose(out.accuracy, (weights * correct).sum() / weights.sum())

    def testLossIsMeanOverBatchWithoutWeights(self):
        out = _Xent().Instantiate()(_XentInputs(with_weights=False))
        self.assertAllClose(out.loss, tf.reduce_mean(out.per_example_loss))
        self.assertAllClose(out.total_weight, 6.0)

    def testLogitsClipBoundsLogits(self):
        layer = _Xent(logits_clip=1.5, params_init=base_layer.WeightInit.Gaussian(10.0))
        out = layer.Instantiate()(_XentInputs())
        self.assertLessEqual(float(tf.reduce_max(tf.abs(out.logits))), 1.5)
        self.assertAllClose(tf.reduce_max(tf.abs(out.logits)), 1.5)


_BAD_INPUTS = [
        ('_dense_meta_wrong_input_dim', lambda: basic.DenseLayer.FPropMeta(
                basic.DenseLayer.Params().Set(name='d', input_dim=3, output_dim=4),
                tf.TensorShape([2, 5])), r'expected input last dimension 3, got shape \(2, 5\)'),
        ('_dense_unknown_activation', lambda: basic.DenseLayer.Params().Set(
                name='d', input_dim=3, output_dim=4, activation='rleu').Instantiate(),
         r"Unknown activation 'rleu'"),
        ('_conv_unknown_activation', lambda: _Conv(activation='rleu').Instantiate(),
         r"Unknown activation 'rleu'"),
        ('_conv_meta_wrong_channels', lambda: conv.Conv2DLayer.FPropMeta(
                _Conv(), tf.TensorShape([1, 5, 5, 2])),
         r'conv: expected 3 input channels, got shape \(1, 5, 5, 2\)'),
        ('_conv_fprop_wrong_channels', lambda: _Conv().Instantiate()(_Images(c=2)),
         r'conv: expected input last dimension 3'),
        ('_conv_fprop_not_nhwc', lambda: _Conv().Instantiate()(_Normal([5, 3])),
         r'expected an NHWC input, got shape \(5, 3\)'),
        ('_conv_unknown_padding', lambda: _Conv(padding='same').Instantiate(),
         r"unknown padding 'same'"),
        ('_conv_bad_filter_shape', lambda: _Conv(filter_shape=(3, 3, 4)).Instantiate(),
         r'filter_shape must be 4 positive ints, got \(3, 3, 4\)'),
        ('_conv_stride_with_dilation', lambda: _Conv(
                filter_stride=(2, 2), dilation_rate=(2, 2)).Instantiate(),
         r'filter_stride \(2, 2\) > 1 cannot be combined with dilation_rate \(2, 2\)'),
        ('_conv_meta_valid_window_too_large', lambda: conv.Conv2DLayer.FPropMeta(
                _Conv(filter_shape=(5, 5, 3, 4), padding='VALID'), tf.TensorShape([1, 3, 3, 3])),
         r'conv: VALID window spanning 5 does not fit input size 3'),
        ('_pooling_meta_valid_window_too_large', lambda: pooling.Pooling2DLayer.FPropMeta(
                pooling.Pooling2DLayer.Params().Set(name='pool', window_shape=(3, 3)),
                tf.TensorShape([1, 2, 5, 1])),
         r'pool: VALID window spanning 3 does not fit input size 2'),
        ('_separable_bad_multiplier', lambda: conv.SeparableConv2DLayer.Params().Set(
                name='sep', filter_shape=(3, 3, 3, 4), channel_multiplier=0).Instantiate(),
         r'channel_multiplier must be a positive int, got 0'),
        ('_separable_meta_wrong_channels', lambda: conv.SeparableConv2DLayer.FPropMeta(
                conv.SeparableConv2DLayer.Params().Set(name='sep', filter_shape=(3, 3, 3, 4)),
                tf.TensorShape([1, 5, 5, 2])), r'sep.depthwise: expected 3 input channels'),
        ('_pooling_unknown_type', lambda: pooling.Pooling2DLayer.Params().Set(
                name='pool', pooling_type='mean').Instantiate(),
         r"unknown pooling_type 'mean'; expected one of \('MAX', 'AVG'\)"),
        ('_global_pooling_meta_not_nhwc', lambda: pooling.GlobalPoolingLayer.FPropMeta(
                pooling.GlobalPoolingLayer.Params(), tf.TensorShape([2, 3])),
         r'expected a fully defined NHWC shape, got \(2, 3\)'),
        ('_batch_norm_wrong_dim', lambda: _BatchNorm(dim=4).Instantiate()(_Normal([2, 3])),
         r'bn: expected input last dimension 4, got shape \(2, 3\)'),
        ('_batch_norm_rank_1', lambda: _BatchNorm(dim=3).Instantiate()(_Normal([3])),
         r'bn: expected an input of rank >= 2, got shape \(3,\)'),
        ('_layer_norm_meta_wrong_dim', lambda: normalization.LayerNormLayer.FPropMeta(
                normalization.LayerNormLayer.Params().Set(name='ln', input_dim=4),
                tf.TensorShape([2, 3])), r'ln: expected input last dimension 4'),
        ('_embedding_float_ids', lambda: embedding.EmbeddingLayer.Params().Set(
                name='emb', vocab_size=4, embedding_dim=2).Instantiate()(tf.zeros([2])),
         r'emb: expected integer ids, got dtype float32'),
        ('_xent_labels_shape', lambda: _Xent().Instantiate()(NestedMap(
                features=_Normal([2, 3, 4]), labels=tf.zeros([2], tf.int32))),
         r'labels shape \(2,\) does not match features shape \(2, 3, 4\)'),
        ('_xent_negative_clip', lambda: _Xent(logits_clip=-1.0).Instantiate(),
         r'logits_clip must be None or positive, got -1.0'),
        ('_dropout_bad_keep_prob', lambda: basic.DropoutLayer.Params().Set(
                name='drop', keep_prob=0.0).Instantiate(),
         r'keep_prob must be in \(0, 1\], got 0.0'),
]


class BadInputTest(tf.test.TestCase, parameterized.TestCase):
    """Bad configurations and inputs fail with a ValueError that names the values."""

    @parameterized.named_parameters(*_BAD_INPUTS)
    def testRaisesClearValueError(self, fn, regex):
        with self.assertRaisesRegex(ValueError, regex):
            fn()


if __name__ == '__main__':
    tf.test.main()
