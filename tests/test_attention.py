"""Tests of multi-head attention and the Transformer block: FPropMeta against reality, a numpy
reference, causal and padding masks, gradients, Params text, and a pipelined stack."""

import numpy as np
import tensorflow as tf
from absl.testing import parameterized

from gpipe_tf import test_utils
from gpipe_tf.layers import attention
from gpipe_tf.layers import base_layer
from gpipe_tf.layers import fprop_context
from gpipe_tf.nested_map import NestedMap
from gpipe_tf.pipeline import pipelining_layer

DEVICES = test_utils.ConfigureVirtualCpus()
TOLERANCE = 1e-5
BATCH, TIME, SOURCE_TIME, DIM, HIDDEN, HEADS = 4, 5, 3, 8, 16, 2


def _Normal(shape, seed=0):
    return tf.random.stateless_normal(shape, [seed, 7])


def _Paddings(lengths, length):
    """[len(lengths), length] float paddings: 0.0 for the first lengths[i] positions, then 1.0."""
    return 1.0 - tf.sequence_mask(lengths, length, tf.float32)


def _Attention(**kwargs):
    return attention.MultiHeadAttentionLayer.Params().Set(
        **{'name': 'atten', 'model_dim': DIM, 'num_heads': HEADS, **kwargs})


def _Transformer(**kwargs):
    return attention.TransformerLayer.Params().Set(
        **{'name': 'block', 'model_dim': DIM, 'hidden_dim': HIDDEN, 'num_heads': HEADS,
           **kwargs})


def _BlockInputs(cross=False, seed=0):
    inputs = NestedMap(vec=_Normal([BATCH, TIME, DIM], seed),
                       paddings=_Paddings([5, 3, 4, 1], TIME))
    if cross:
        inputs.encoder_vec = _Normal([BATCH, SOURCE_TIME, DIM], seed + 1)
        inputs.encoder_paddings = _Paddings([3, 2, 1, 3], SOURCE_TIME)
    return inputs


def _Shapes(inputs):
    return tf.nest.map_structure(lambda t: None if t is None else t.shape, inputs)


def _NumVariables(layer):
    return sum(int(np.prod(v.shape)) for v in layer.variables)


def _NumpyAttention(theta, query, key_value, paddings, causal, num_heads):
    """Textbook multi-head attention in float64 numpy."""
    theta = {k: np.asarray(v, np.float64) for k, v in theta.items() if k != 'atten_dropout'}
    query = np.asarray(query, np.float64)
    key_value = query if key_value is None else np.asarray(key_value, np.float64)
    batch, t, _ = query.shape
    s = key_value.shape[1]

    def Heads(x, name):
        y = x @ theta[f'w_{name}'] + theta.get(f'b_{name}', 0.0)
        return y.reshape(batch, y.shape[1], num_heads, -1).transpose(0, 2, 1, 3)  # [B, H, L, d]

    q, k, v = Heads(query, 'q'), Heads(key_value, 'k'), Heads(key_value, 'v')
    logits = q @ k.transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1])
    masked = np.zeros([batch, 1, t, s], bool)
    if paddings is not None:
        masked |= np.asarray(paddings)[:, None, None, :] > 0.5
    if causal:
        masked |= np.arange(s)[None, :] > np.arange(t)[:, None]
    logits = np.where(masked, -np.inf, logits)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    context = (probs @ v).transpose(0, 2, 1, 3).reshape(batch, t, -1)
    return context @ theta['w_o'] + theta['b_o']


class MultiHeadAttentionTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.named_parameters(
        ('_self', {}, False),
        ('_self_causal_dropout', {'causal': True, 'atten_dropout_keep_prob': 0.8}, False),
        ('_cross_no_bias_wide_heads', {'has_bias': False, 'dim_per_head': 6}, True))
    def testFPropMetaOutShapeMatchesOutput(self, kwargs, cross):
        p = _Attention(**kwargs)
        query = _Normal([BATCH, TIME, DIM])
        key_value = _Normal([BATCH, SOURCE_TIME, DIM], 1) if cross else None
        paddings = _Paddings([3, 1, 2, 3], SOURCE_TIME) if cross else None
        output = p.Instantiate()(query, key_value, paddings)
        meta = p.cls.FPropMeta(p, *_Shapes((query, key_value, paddings)))
        self.assertEqual(meta.out_shapes.as_list(), output.shape.as_list())

    @parameterized.named_parameters(
        ('_bias', {}), ('_no_bias', {'has_bias': False}), ('_dim_per_head', {'dim_per_head': 3}))
    def testFPropMetaNumParamsMatchVariables(self, kwargs):
        p = _Attention(**kwargs)
        meta = p.cls.FPropMeta(p, tf.TensorShape([BATCH, TIME, DIM]))
        self.assertEqual(meta.num_params, _NumVariables(p.Instantiate()))

    def testFlopsFollowTheDocumentedRule(self):
        # B=2, T=3, S=5, D=4, H=2, d=2 (N=4), bias, paddings, no dropout.
        p = _Attention(model_dim=4, num_heads=2)
        meta = p.cls.FPropMeta(p, tf.TensorShape([2, 3, 4]), tf.TensorShape([2, 5, 4]),
                               tf.TensorShape([2, 5]))
        projections = 2 * 2 * (3 + 2 * 5) * 4 * 4 + 2 * 2 * 3 * 4 * 4  # 832 + 192
        biases = 2 * (3 + 5) * 4 + 2 * 3 * 4                          # 64 + 24 (no key bias)
        scaling = 2 * 3 * 4                                           # 24
        logits = 2 * 2 * 3 * 5                                        # 60 logits
        per_logit = 2 * 2 + 1 + 5 + 2 * 2  # q.k, mask, softmax, probs.v
        self.assertEqual(meta.flops, projections + biases + scaling + logits * per_logit)

    @parameterized.named_parameters(
        ('_self', False, False, False), ('_self_padded', False, True, False),
        ('_causal_padded', True, True, False), ('_cross_padded', False, True, True))
    def testMatchesNumpyReference(self, causal, padded, cross):
        p = _Attention(causal=causal, params_init=base_layer.WeightInit.Gaussian(0.5))
        layer = p.Instantiate()
        # Non-zero biases, so the reference checks where each bias is added.
        for seed, name in enumerate(['b_q', 'b_v', 'b_o']):
            layer.vars[name].assign(_Normal(layer.vars[name].shape, seed=seed + 20))
        query = _Normal([BATCH, TIME, DIM])
        kv_time = SOURCE_TIME if cross else TIME
        key_value = _Normal([BATCH, kv_time, DIM], 1) if cross else None
        paddings = _Paddings([kv_time, 1, 2, kv_time - 1], kv_time) if padded else None
        got = layer(query, key_value, paddings)
        want = _NumpyAttention(layer.theta, query, key_value, paddings, causal, HEADS)
        self.assertAllClose(got, want, rtol=1e-5, atol=1e-5)

    def testCausalOutputIgnoresLaterPositions(self):
        layer = _Attention(causal=True).Instantiate()
        x = _Normal([BATCH, TIME, DIM])
        t = 2
        changed = tf.concat([x[:, :t + 1], _Normal([BATCH, TIME - t - 1, DIM], 5)], axis=1)
        self.assertAllClose(layer(x)[:, :t + 1], layer(changed)[:, :t + 1], rtol=1e-6, atol=1e-6)

    def testOutputIgnoresPaddedKeys(self):
        layer = _Attention().Instantiate()
        query = _Normal([BATCH, TIME, DIM])
        key_value = _Normal([BATCH, SOURCE_TIME, DIM], 1)
        paddings = _Paddings([1, 2, 3, 2], SOURCE_TIME)
        changed = tf.where(paddings[:, :, None] > 0.5, _Normal(key_value.shape, 9), key_value)
        self.assertAllClose(layer(query, key_value, paddings), layer(query, changed, paddings),
                            rtol=1e-6, atol=1e-6)

    def testGradientsMatchFiniteDifferences(self):
        layer = _Attention(causal=True, dtype=tf.float64).Instantiate()
        x = tf.cast(_Normal([BATCH, TIME, DIM]), tf.float64)
        paddings = tf.cast(_Paddings([5, 3, 4, 1], TIME), tf.float64)
        test_utils.AssertGradientsMatchFiniteDifferences(self, layer, x, None, paddings)

    def testAttentionDropoutRepeatsForTheSameStepAndExamples(self):
        layer = _Attention(atten_dropout_keep_prob=0.5).Instantiate()
        x = _Normal([BATCH, TIME, DIM])
        with fprop_context.Scope(step=3, first_example=1):
            first, again = layer(x), layer(x)
        with fprop_context.Scope(step=4, first_example=1):
            other = layer(x)
        self.assertAllEqual(first, again)
        self.assertGreater(float(tf.reduce_max(tf.abs(first - other))), 1e-3)

    def testParamsRoundTripThroughText(self):
        p = _Attention(dim_per_head=3, causal=True, atten_dropout_keep_prob=0.9, has_bias=False)
        self.assertEqual(attention.MultiHeadAttentionLayer.Params().FromText(p.ToText()), p)

    def testHeadsThatDoNotDivideModelDimRaise(self):
        with self.assertRaisesRegex(ValueError, r'model_dim \(8\) is not divisible by num_heads '
                                    r'\(3\)'):
            _Attention(num_heads=3).Instantiate()


_BLOCK_CASES = [
    ('_encoder', {}),
    ('_causal_gelu_dropout', {'causal': True, 'ffn_activation': 'gelu',
                              'residual_dropout_keep_prob': 0.9, 'atten_dropout_keep_prob': 0.8,
                              'relu_dropout_keep_prob': 0.7}),
    ('_decoder_cross', {'causal': True, 'has_cross_attention': True}),
]


class TransformerLayerTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.named_parameters(*_BLOCK_CASES)
    def testFPropMetaOutShapesMatchOutputs(self, kwargs):
        p = _Transformer(**kwargs)
        inputs = _BlockInputs(p.has_cross_attention)
        outputs = p.Instantiate()(inputs)
        meta = p.cls.FPropMeta(p, _Shapes(inputs))
        tf.nest.assert_same_structure(meta.out_shapes, _Shapes(outputs))
        for predicted, actual in zip(tf.nest.flatten(meta.out_shapes),
                                     tf.nest.flatten(_Shapes(outputs))):
            self.assertEqual(predicted.as_list(), actual.as_list())

    @parameterized.named_parameters(*_BLOCK_CASES)
    def testFPropMetaNumParamsMatchVariables(self, kwargs):
        p = _Transformer(**kwargs)
        meta = p.cls.FPropMeta(p, _Shapes(_BlockInputs(p.has_cross_attention)))
        self.assertEqual(meta.num_params, _NumVariables(p.Instantiate()))

    def testCrossAttentionAddsOneAttentionAndLayerNorm(self):
        self_only = _Transformer().Instantiate()
        cross = _Transformer(has_cross_attention=True).Instantiate()
        extra = 4 * DIM * DIM + 3 * DIM + 2 * DIM  # Q/K/V/O with Q/V/O biases, layer norm.
        self.assertEqual(_NumVariables(cross) - _NumVariables(self_only), extra)

    def testEveryEntryButVecPassesThrough(self):
        inputs = _BlockInputs(cross=True)
        inputs.target_ids = tf.zeros([BATCH, TIME], tf.int32)
        outputs = _Transformer(has_cross_attention=True).Instantiate()(inputs)
        self.assertCountEqual(outputs.keys(), inputs.keys())
        for key in inputs:
            if key != 'vec':
                self.assertIs(outputs[key], inputs[key])

    def testCausalOutputIgnoresLaterPositions(self):
        layer = _Transformer(causal=True).Instantiate()
        inputs = _BlockInputs()
        inputs.paddings = tf.zeros([BATCH, TIME])
        t = 1
        changed = inputs.copy()
        changed.vec = tf.concat([inputs.vec[:, :t + 1], _Normal([BATCH, TIME - t - 1, DIM], 5)],
                                axis=1)
        self.assertAllClose(layer(inputs).vec[:, :t + 1], layer(changed).vec[:, :t + 1],
                            rtol=1e-6, atol=1e-6)

    def testRealPositionsIgnorePaddedPositions(self):
        layer = _Transformer().Instantiate()
        inputs = _BlockInputs()
        padded = inputs.paddings[:, :, None] > 0.5
        changed = inputs.copy()
        changed.vec = tf.where(padded, _Normal(inputs.vec.shape, 9), inputs.vec)
        real = tf.logical_not(padded)
        self.assertAllClose(tf.where(real, layer(inputs).vec, 0.0),
                            tf.where(real, layer(changed).vec, 0.0), rtol=1e-6, atol=1e-6)

    def testCrossAttentionIgnoresPaddedEncoderPositions(self):
        layer = _Transformer(has_cross_attention=True).Instantiate()
        inputs = _BlockInputs(cross=True)
        changed = inputs.copy()
        changed.encoder_vec = tf.where(inputs.encoder_paddings[:, :, None] > 0.5,
                                       _Normal(inputs.encoder_vec.shape, 9), inputs.encoder_vec)
        self.assertAllClose(layer(inputs).vec, layer(changed).vec, rtol=1e-6, atol=1e-6)

    @parameterized.named_parameters(*_BLOCK_CASES)
    def testGradientsMatchFiniteDifferences(self, kwargs):
        # The feed-forward relu has a kink: the check fails with "not differentiable here" if
        # a seeded input lies within its step (1e-6) of it.
        layer = _Transformer(dtype=tf.float64, **kwargs).Instantiate()
        inputs = _BlockInputs(layer.p.has_cross_attention).Transform(
            lambda t: tf.cast(t, tf.float64))
        test_utils.AssertGradientsMatchFiniteDifferences(self, layer, inputs)

    @parameterized.named_parameters(*_BLOCK_CASES)
    def testParamsRoundTripThroughText(self, kwargs):
        p = _Transformer(ffn_init_scale=0.25, **kwargs)
        self.assertEqual(attention.TransformerLayer.Params().FromText(p.ToText()), p)

    def testFfnInitScaleScalesOnlyTheFeedForwardWeights(self):
        plain = _Transformer().Instantiate()
        scaled = _Transformer(ffn_init_scale=0.25).Instantiate()
        self.assertAllClose(scaled.vars.ffn_in.w, 0.25 * plain.vars.ffn_in.w)
        self.assertAllClose(scaled.vars.ffn_out.w, 0.25 * plain.vars.ffn_out.w)
        self.assertAllEqual(scaled.vars.self_atten.w_q, plain.vars.self_atten.w_q)

    def testMissingEncoderInputsRaise(self):
        layer = _Transformer(has_cross_attention=True).Instantiate()
        with self.assertRaisesRegex(ValueError, r"block: the input NestedMap lacks "
                                    r"\['encoder_vec', 'encoder_paddings'\]"):
            layer(_BlockInputs())


# ---- pipelined stacks --------------------------------------------------------------------------
def _Pipeline(cross=False, **kwargs):
    blocks = [_Transformer(has_cross_attention=cross, **kwargs).Set(name=f'block_{i}')
              for i in range(4)]
    input_shapes = {'vec': [BATCH, TIME, DIM], 'paddings': [BATCH, TIME]}
    if cross:
        input_shapes.update(encoder_vec=[BATCH, SOURCE_TIME, DIM],
                            encoder_paddings=[BATCH, SOURCE_TIME])
    return pipelining_layer.PipeliningLayer.Params().Set(
        name='pipe', layer_tpl=blocks, num_cells=2, num_micro_batches=2,
        input_shapes=input_shapes, devices=DEVICES[:2]).Instantiate()


class PipelinedTransformerTest(tf.test.TestCase, parameterized.TestCase):
    """A 4-block stack in a K=2, M=2 pipeline equals the blocks run one after another."""

    @parameterized.named_parameters(('_causal', False), ('_decoder_cross', True))
    def testPipelineMatchesSequentialBlocks(self, cross):
        layer = _Pipeline(cross, causal=True, ffn_init_scale=0.25)
        inputs = _BlockInputs(cross)
        got = tf.function(lambda x: test_utils.OutputsAndGrads(layer, layer, x))(inputs)
        want = test_utils.OutputsAndGrads(lambda x: test_utils.Unpartitioned(layer, x), layer, inputs)
        self.assertLess(test_utils.MaxRelativeError(got, want), TOLERANCE)

    def testPipelineWithDropoutMatchesPerMicroBatchReference(self):
        layer = _Pipeline(residual_dropout_keep_prob=0.9, atten_dropout_keep_prob=0.8,
                          relu_dropout_keep_prob=0.7)
        inputs = _BlockInputs()
        with fprop_context.Scope(step=5):
            got = tf.function(lambda x: test_utils.OutputsAndGrads(layer, layer, x))(inputs)
        want = test_utils.OutputsAndGrads(lambda x: test_utils.Unpartitioned(layer, x, 2, step=5), layer, inputs)
        self.assertLess(test_utils.MaxRelativeError(got, want), TOLERANCE)


if __name__ == '__main__':
    tf.test.main()
