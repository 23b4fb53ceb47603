"""Tests of the Transformer LM and multilingual models (models/transformer/network.py) and their
registered params (params/lm.py, params/mt/multilingual.py): parameter counts against the GPipe
paper, FPropMeta against reality, pipelined gradients against un-pipelined ones, training, the
causal and padding masks, and the paper's two trainability fixes."""

import math

import numpy as np
import tensorflow as tf
from absl.testing import parameterized

from gpipe_tf import model_registry
from gpipe_tf import test_utils
from gpipe_tf.layers import attention
from gpipe_tf.layers import base_layer
from gpipe_tf.layers import fprop_context
from gpipe_tf.layers import sequential
from gpipe_tf.models.transformer import network as transformer_model
from gpipe_tf.nested_map import NestedMap
from gpipe_tf.params import lm
from gpipe_tf.params.mt import multilingual
from gpipe_tf.pipeline import pipelining_layer

DEVICES = test_utils.ConfigureVirtualCpus()
TOLERANCE = 1e-5
LM_TINY = 'lm.TransformerLTiny'
MT_TINY = 'mt.multilingual.TransformerTiny'
TINY = (('_lm', LM_TINY), ('_mt', MT_TINY))


# ---- parameter counts ----------------------------------------------------------------------------
def _Attention(d, n):
    return 4 * d * n + 2 * n + d  # Q, K, V, O; biases on Q, V (n each) and O (d).


def _Ffn(d, h):
    return 2 * d * h + h + d


def LmCount(num_layers, d=2048, h=8192, heads=32, vocab=32000):
    """Closed form: embedding, layers (attention, 2 layer norms, FFN), final LN, softmax."""
    layer = _Attention(d, 64 * heads) + 2 * 2 * d + _Ffn(d, h)
    return vocab * d + num_layers * layer + 2 * d + d * vocab + vocab


def MtCount(num_layers, h, heads, d=1024, vocab=65536):
    """Closed form: shared embedding, encoder, encoder LN, decoder, final LN, softmax."""
    n = 64 * heads
    encoder = _Attention(d, n) + 2 * 2 * d + _Ffn(d, h)
    decoder = 2 * _Attention(d, n) + 3 * 2 * d + _Ffn(d, h)
    return vocab * d + num_layers * (encoder + decoder) + 2 * 2 * d + d * vocab + vocab


# key: (closed-form count, the paper's count or None, relative tolerance against the paper).
PAPER_MODELS = {
    'lm.TransformerL_3': (LmCount(3), 282.2e6, 0.01),
    'lm.TransformerL_13': (LmCount(13), 785.8e6, 0.01),
    'lm.TransformerL_103': (LmCount(103), 5.3e9, 0.01),
    'lm.TransformerL_415': (LmCount(415), 21.0e9, 0.01),
    'lm.TransformerL_1663': (LmCount(1663), 83.9e9, 0.01),
    'lm.Transformer48': (LmCount(48), None, None),
    'mt.multilingual.T_6_8192_16': (MtCount(6, 8192, 16), 400e6, 0.05),
    'mt.multilingual.T_24_8192_16': (MtCount(24, 8192, 16), 1.3e9, 0.05),
    'mt.multilingual.T_12_16384_32': (MtCount(12, 16384, 32), 1.3e9, 0.05),
    'mt.multilingual.T_32_16384_32': (MtCount(32, 16384, 32), 3e9, 0.05),
    'mt.multilingual.T_64_16384_32': (MtCount(64, 16384, 32), 6e9, 0.05),
}
# The paper's partition counts (Table 1's Naive-1/Pipeline-K columns, §5's model list).
PAPER_PARTITIONS = {
    'lm.TransformerL_3': 1, 'lm.TransformerL_13': 1, 'lm.TransformerL_103': 8,
    'lm.TransformerL_415': 32, 'lm.TransformerL_1663': 128,
    'mt.multilingual.T_24_8192_16': 4, 'mt.multilingual.T_12_16384_32': 2,
    'mt.multilingual.T_32_16384_32': 8, 'mt.multilingual.T_64_16384_32': 16,
}


class PaperSizeTest(tf.test.TestCase, parameterized.TestCase):

    def testParamCountsFromParamsAloneMatchThePaper(self):
        graph = tf.Graph()
        with graph.as_default():
            counts = {key: transformer_model.PipelineMeta(
                model_registry.GetParams(key, 'Train').model).num_params for key in PAPER_MODELS}
        self.assertEmpty(graph.get_operations(), 'FPropMeta created TF ops')
        for key, (exact, paper, tolerance) in PAPER_MODELS.items():
            with self.subTest(key=key):
                self.assertEqual(counts[key], exact)
                if paper is not None:
                    self.assertLess(abs(counts[key] - paper) / paper, tolerance,
                                    f'{key}: {counts[key]:,} vs the paper\'s {paper:,.0f}')

    def testPartitionsFollowThePaper(self):
        for key, num_cells in PAPER_PARTITIONS.items():
            with self.subTest(key=key):
                self.assertEqual(model_registry.GetParams(key, 'Train').model.num_cells, num_cells)
        naive = model_registry.GetParams('lm.TransformerL_3', 'Train').model
        self.assertEqual((naive.num_micro_batches, naive.recompute), (1, 'never'))

    def testPipelineParamsWrapTheLayerListLikeAmoebaNet(self):
        for make, layers, shapes, model in (
                (transformer_model.LmPipelineParams, transformer_model.LmLayers,
                 transformer_model.LmInputShapes(8, 16),
                 transformer_model.LmParams().Set(max_length=16)),
                (transformer_model.MtPipelineParams, transformer_model.MtLayers,
                 transformer_model.MtInputShapes(8, 16, 16),
                 transformer_model.MtParams().Set(max_length=16))):
            with self.subTest(make=make.__name__):
                p = make(model, batch_size=8, num_cells=2, num_micro_batches=4,
                         recompute='never')
                self.assertIs(p.cls, pipelining_layer.PipeliningLayer)
                self.assertEqual((p.num_cells, p.num_micro_batches, p.recompute),
                                 (2, 4, 'never'))
                self.assertEqual(p.input_shapes, shapes)
                self.assertEqual([l.ToText() for l in p.layer_tpl],
                                 [l.ToText() for l in layers(model)])

    def testDeepModelsScaleFfnInitByTheNumberOfLayers(self):
        layers = model_registry.GetParams('mt.multilingual.T_64_16384_32', 'Train').model.layer_tpl
        blocks = [p for p in layers if p.cls is attention.TransformerLayer]
        self.assertLen(blocks, 128)
        self.assertEqual({p.ffn_init_scale for p in blocks}, {1.0 / 128})


# ---- the tiny models -----------------------------------------------------------------------------
def TinyTask(key, **overrides):
    """(task Params, input Params) of a registered model, class attributes overridden."""
    cls = model_registry.GetClass(key)
    if overrides:
        cls = type(cls.__name__, (cls,), overrides)
    task = cls().Pipeline()
    task.devices = DEVICES[:task.num_cells]
    return task, cls().Train()


def SyntheticBatch(key, input_params, step=0):
    return (lm if key.startswith('lm') else multilingual).SyntheticBatch(input_params, step)


def Loss(outputs):
    return transformer_model.ReduceLoss(outputs).loss


def Reference(layer, inputs, num_micro_batches=1, step=0):
    """The pipeline's layers run one after another on each micro-batch (M=1: the whole batch),
    without devices, re-materialization or pipeline code (as in test_pipeline)."""
    flat = [tf.split(x, num_micro_batches) for x in tf.nest.flatten(inputs)]
    outputs = []
    for m in range(num_micro_batches):
        args = (tf.nest.pack_sequence_as(inputs, [parts[m] for parts in flat]),)
        with fprop_context.Scope(step=step, first_example=m * int(flat[0][m].shape[0])):
            for l in layer.Layers():
                args = base_layer.AsArgs(l.FProp(l.theta, *args))
        outputs.append(args[0])
    return tf.nest.map_structure(lambda *xs: tf.concat(xs, 0), *outputs)


def LossesAndGrads(fn, layer, inputs):
    """(per_example_loss, d loss / d trainable variables)."""
    with tf.GradientTape() as tape:
        outputs = fn(inputs)
        loss = Loss(outputs)
    return outputs.per_example_loss, tape.gradient(loss, list(layer.trainable_variables))


def NumVariables(layer):
    return sum(int(np.prod(v.shape)) for v in layer.variables)


class TinyModelTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.named_parameters(*TINY)
    def testFPropMetaCountsTheVariablesBuilt(self, key):
        task, _ = TinyTask(key)
        self.assertEqual(transformer_model.PipelineMeta(task).num_params,
                         NumVariables(task.Instantiate()))

    @parameterized.named_parameters(*TINY)
    def testFPropMetaPredictsEveryLayersOutputShapes(self, key):
        task, input_params = TinyTask(key)
        layer = task.Instantiate()
        inputs = SyntheticBatch(key, input_params)
        _, metas = sequential.ChainMeta([l.p for l in layer.Layers()],
                                        tf.nest.map_structure(lambda t: t.shape, inputs))
        args = inputs
        for l, meta in zip(layer.Layers(), metas):
            args = l.FProp(l.theta, args)
            with self.subTest(layer=l.path):
                self.assertIsInstance(args, NestedMap)
                self.assertEqual(sorted(args), sorted(meta.out_shapes))
                for name, value in args.items():
                    self.assertEqual(value.shape.as_list(), meta.out_shapes[name].as_list(),
                                     f'{l.path}: {name}')
        batch, length = input_params.batch_size, input_params.max_length
        self.assertEqual(sorted(args), ['correct', 'per_example_loss', 'predictions', 'weight'])
        for value in args.values():
            self.assertEqual(value.shape.as_list(), [batch, length])

    @parameterized.named_parameters(*TINY)
    def testPipelinedGradientsEqualUnpipelined(self, key):
        # Without dropout: the reference runs the whole batch at once (dropout's per-micro-batch
        # masks are checked below).
        task, input_params = TinyTask(key, DROPOUT_KEEP_PROB=1.0)
        self.assertGreaterEqual(task.num_cells, 2)
        self.assertGreaterEqual(task.num_micro_batches, 4)
        layer = task.Instantiate()
        inputs = SyntheticBatch(key, input_params)
        # Eagerly: the cells are traced functions either way, and an outer tf.function would
        # add seconds of tracing (test_pipeline covers tf.function and v1 graphs).
        got = LossesAndGrads(layer, layer, inputs)
        want = LossesAndGrads(lambda x: Reference(layer, x), layer, inputs)
        self.assertLess(test_utils.MaxRelativeError(got, want), TOLERANCE)

    @parameterized.named_parameters(*TINY)
    def testPipelinedDropoutMatchesPerMicroBatchReference(self, key):
        task, input_params = TinyTask(key, DROPOUT_KEEP_PROB=0.8)
        layer = task.Instantiate()
        inputs = SyntheticBatch(key, input_params)
        with fprop_context.Scope(step=3):
            got = LossesAndGrads(layer, layer, inputs)
        want = LossesAndGrads(
            lambda x: Reference(layer, x, task.num_micro_batches, step=3), layer, inputs)
        self.assertLess(test_utils.MaxRelativeError(got, want), TOLERANCE)
        with fprop_context.Scope(step=4):
            other = Reference(layer, inputs, task.num_micro_batches, step=4).per_example_loss
        self.assertGreater(float(tf.reduce_max(tf.abs(other - got[0]))), 1e-3)

    @parameterized.named_parameters(*TINY)
    def testTrainingStepsLowerTheLoss(self, key):
        task, input_params = TinyTask(key)
        layer = task.Instantiate()
        optimizer = tf.keras.optimizers.Adam(3e-3)
        inputs = SyntheticBatch(key, input_params)

        def Step(x):
            with tf.GradientTape() as tape:
                loss = Loss(layer(x))
            variables = list(layer.trainable_variables)
            optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
            return loss

        losses = [float(Step(inputs)) for _ in range(12)]
        self.assertTrue(all(np.isfinite(losses)), losses)
        self.assertLess(losses[-1], losses[0] - 0.5, losses)

    @parameterized.named_parameters(*TINY)
    def testParamsRoundTripThroughText(self, key):
        task, _ = TinyTask(key)
        self.assertEqual(pipelining_layer.PipeliningLayer.Params().FromText(task.ToText()), task)


class MaskTest(tf.test.TestCase):

    def testLmLossAtEarlierPositionsIgnoresLaterTokens(self):
        task, input_params = TinyTask(LM_TINY)
        layer = task.Instantiate()
        inputs = lm.SyntheticBatch(input_params)
        t = 10
        changed = inputs.copy()
        changed.ids = tf.concat([inputs.ids[:, :t + 1], tf.reverse(inputs.ids[:, t + 1:], [1])],
                                axis=1)
        self.assertNotAllEqual(changed.ids, inputs.ids)
        got = Reference(layer, changed).per_example_loss
        want = Reference(layer, inputs).per_example_loss
        self.assertAllClose(got[:, :t + 1], want[:, :t + 1], rtol=1e-6, atol=1e-6)
        self.assertGreater(float(tf.reduce_max(tf.abs(got[:, t + 1:] - want[:, t + 1:]))), 1e-4)

    def testMtLossIgnoresLaterTargetsAndPaddedSourceTokens(self):
        task, input_params = TinyTask(MT_TINY)
        layer = task.Instantiate()
        inputs = multilingual.SyntheticBatch(input_params)
        want = Reference(layer, inputs).per_example_loss
        t = 5
        changed = inputs.copy()
        changed.tgt_ids = tf.concat([inputs.tgt_ids[:, :t + 1],
                                     tf.reverse(inputs.tgt_ids[:, t + 1:], [1])], axis=1)
        padded = inputs.src_paddings > 0.5
        changed.src_ids = tf.where(padded, 7, inputs.src_ids)
        self.assertTrue(bool(tf.reduce_any(padded)))
        got = Reference(layer, changed).per_example_loss
        self.assertAllClose(got[:, :t + 1], want[:, :t + 1], rtol=1e-6, atol=1e-6)


class EmbeddingTest(tf.test.TestCase):

    def _Layer(self, **kwargs):
        model = lm.TransformerLTiny().ModelParams().Set(**kwargs)
        return transformer_model.LmLayers(model)[0]

    def testLearnedPositionsAddAMaxLengthTable(self):
        p = self._Layer(position_embedding='learned')
        layer = p.Instantiate()
        inputs = lm.SyntheticBatch(lm.TransformerLTiny().Train())
        meta = p.cls.FPropMeta(p, tf.nest.map_structure(lambda t: t.shape, inputs))
        self.assertEqual(meta.num_params, (256 + 32) * 64)
        self.assertEqual(meta.num_params, NumVariables(layer))
        self.assertEqual(layer(inputs).vec.shape.as_list(), meta.out_shapes.vec.as_list())

    def testLearnedPositionsGradientsMatchFiniteDifferences(self):
        # Small sizes, in float64: 7 tokens of dimension 4, 6 positions, sequences of 5.
        layer = self._Layer(position_embedding='learned', vocab_size=7, model_dim=4,
                            max_length=6).Set(dtype=tf.float64).Instantiate()
        ids = tf.constant([[1, 6, 2, 0, 3], [5, 5, 4, 1, 2]])
        inputs = NestedMap(ids=ids, paddings=tf.zeros([2, 5], tf.float64), labels=ids,
                           weights=tf.ones([2, 5], tf.float64))
        numeric = test_utils.AssertGradientsMatchFiniteDifferences(self, layer, inputs)
        # Position t feeds only the outputs at t: the last row (t = 5) is beyond the sequence.
        positions = numeric[[v.name for v in layer.trainable_variables].index(
            layer.vars.position_emb.emb.name)]
        self.assertTrue(np.all(np.abs(positions[:5]).sum(axis=1) > 0), positions)
        self.assertAllEqual(positions[5], np.zeros(4))

    def testSequencesLongerThanMaxLengthRaise(self):
        p = self._Layer(max_length=8)
        with self.assertRaisesRegex(ValueError, 'sequence length 32 exceeds max_length 8'):
            p.cls.FPropMeta(p, NestedMap(
                {k: tf.TensorShape([2, 32]) for k in transformer_model.LM_INPUT_KEYS}))


class TrainabilityFixTest(tf.test.TestCase):

    def testLogitsClipBoundsTheLoss(self):
        clip = 0.5
        losses = {}
        for logits_clip in (clip, None):
            task, input_params = TinyTask(LM_TINY, LOGITS_CLIP=logits_clip)
            layer = task.Instantiate()
            softmax = layer.Layers()[-1].softmax
            softmax.vars.w.assign(softmax.vars.w * 100.0)
            losses[logits_clip] = Reference(layer, lm.SyntheticBatch(input_params))
        # With logits in [-c, c]: loss <= log(V e^c) + c.
        bound = math.log(256) + 2 * clip
        self.assertLess(float(tf.reduce_max(losses[clip].per_example_loss)), bound + 1e-4)
        self.assertGreater(float(tf.reduce_max(losses[None].per_example_loss)), 3 * bound)

    def testFfnInitIsScaledByTheNumberOfLayers(self):
        model = lm.TransformerLTiny().ModelParams()
        self.assertEqual(model.num_layers, 4)
        scaled = transformer_model.LmLayers(model)[1].Instantiate()
        plain = transformer_model.LmLayers(model.Set(ffn_init_scale=1.0))[1].Instantiate()
        self.assertAllClose(scaled.vars.ffn_in.w, plain.vars.ffn_in.w / 4)
        self.assertAllClose(scaled.vars.ffn_out.w, plain.vars.ffn_out.w / 4)
        self.assertAllEqual(scaled.vars.self_atten.w_q, plain.vars.self_atten.w_q)


if __name__ == '__main__':
    tf.test.main()
