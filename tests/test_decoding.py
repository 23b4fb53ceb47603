"""Incremental decoding (models/transformer/decoding.py, TransformerLayer.ExtendStep): each step
gives what the full forward gives at that position, and greedy decoding's tokens equal the full
forward's, token for token."""

import numpy as np
import pytest
import tensorflow as tf

from gpipe_tf import model_registry
from gpipe_tf import test_utils
from gpipe_tf.layers import attention
from gpipe_tf.layers import fprop_context
from gpipe_tf.models.transformer import decoding
from gpipe_tf.nested_map import NestedMap

DEVICES = test_utils.ConfigureVirtualCpus()
MT = 'mt.multilingual.TransformerTiny'


def StepsAndFullForward(fprop_dtype=None):
    """A causal decoder block with cross-attention: (its outputs position by position by
    ExtendStep, concatenated; its FProp on the whole sequence; the last cache; the block; its
    input)."""
    batch, length, source, dim = 3, 5, 4, 8
    layer = attention.TransformerLayer.Params().Set(
        name='decoder', model_dim=dim, hidden_dim=16, num_heads=2, causal=True,
        has_cross_attention=True, fprop_dtype=fprop_dtype).Instantiate()
    vec = tf.random.stateless_normal([batch, length, dim], [1, 1])
    encoder_vec = tf.random.stateless_normal([batch, source, dim], [1, 2])
    encoder_paddings = tf.constant([[0, 0, 0, 0], [0, 0, 1, 1], [0, 1, 1, 1]], tf.float32)
    with fprop_context.Scope(training=False):
        full = layer.FProp(layer.theta, NestedMap(
            vec=vec, paddings=tf.zeros([batch, length]), encoder_vec=encoder_vec,
            encoder_paddings=encoder_paddings)).vec
        cache = layer.DecodeCache(layer.theta, batch, length, encoder_vec)
        steps = []
        for t in range(length):
            y, cache = layer.ExtendStep(layer.theta, vec[:, t:t + 1], cache, tf.constant(t),
                                        encoder_paddings)
            steps.append(y)
    return tf.concat(steps, 1), full, cache, layer, vec


@pytest.mark.unit
class ExtendStepTest(tf.test.TestCase):
    """A causal decoder block, position by position, against its FProp on the whole sequence."""

    def testEachPositionEqualsTheFullForward(self):
        steps, full, cache, layer, vec = StepsAndFullForward()
        self.assertAllClose(steps, full, rtol=1e-6, atol=1e-6)
        # The cache holds every position's key, as the full forward projects them.
        keys = layer.self_atten.KeyValueCache(
            layer.theta.self_atten, layer.self_atten_ln.FProp(layer.theta.self_atten_ln, vec))
        self.assertAllClose(cache.self_atten.key, keys.key, rtol=1e-6, atol=1e-6)

    def testBfloat16StepsComputeInBfloat16(self):
        steps, full, cache, _, _ = StepsAndFullForward(tf.bfloat16)
        self.assertEqual(cache.self_atten.key.dtype, tf.bfloat16)
        self.assertEqual((steps.dtype, full.dtype), (tf.bfloat16, tf.bfloat16))
        # One position at a time rounds like the whole sequence but for the order of sums.
        self.assertLess(test_utils.MaxRelativeError(steps, full), 2e-2)


class GreedyTest(tf.test.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        p = model_registry.GetParams(MT, 'Test')
        p.input.batch_size = 4
        p.model.num_micro_batches = 2
        cls.task = p.Instantiate()
        batch = next(iter(p.input.Instantiate().EvalDataset()))
        cls.src_ids, cls.src_paddings = batch['src_ids'], batch['src_paddings']

    def testTokensEqualTheFullForwardsGreedyDecoding(self):
        for max_steps in (None, 3):
            want = self.task.DecodeByFullForward(self.src_ids, self.src_paddings, max_steps)
            got = self.task.Decode(self.src_ids, self.src_paddings, max_steps)
            self.assertAllEqual(got, want)
        self.assertGreater(len(set(want[0].tolist())), 1)  # Not one token throughout.

    def testTheStepsRunOnTheCellsDevices(self):
        graph = tf.function(lambda s, q: self.task.GreedyIds(s, q), autograph=False
                            ).get_concrete_function(self.src_ids, self.src_paddings).graph
        body = [f for f in graph.as_graph_def().library.function
                if 'while_body' in f.signature.name]
        self.assertLen(body, 1)
        matmuls = [node for node in body[0].node_def
                   if node.op in ('MatMul', 'BatchMatMulV2', 'Einsum')]
        self.assertNotEmpty(matmuls)
        model = self.task.model
        decoder_cells = {k for k, cell in enumerate(model.plan.cells)
                         if any(lp.name.startswith('decoder_') or lp.name == 'softmax'
                                for lp in cell)}
        want = {tf.DeviceSpec.from_string(model.devices[k]).device_index for k in decoder_cells}
        got = {tf.DeviceSpec.from_string(node.device).device_index for node in matmuls}
        self.assertEqual(got, want)
        self.assertGreater(len(want), 1)

    def _Run(self, num_micro_batches, beam_size=None):
        """(greedy ids or beam (ids, scores), the while loop body's MatMul/Einsum count) of an
        IncrementalDecoder of M = `num_micro_batches` in a tf.function."""
        decoder = decoding.IncrementalDecoder(self.task.model, num_micro_batches)
        p, theta = self.task.p, self.task.model.theta
        if beam_size:
            fn = lambda s, q: decoder.Beam(theta, s, q, p.bos_id, p.eos_id, beam_size)
        else:
            fn = lambda s, q: decoder.Greedy(theta, s, q, p.bos_id, p.eos_id)
        fn = tf.function(fn, autograph=False)
        graph = fn.get_concrete_function(self.src_ids, self.src_paddings).graph
        body = [f for f in graph.as_graph_def().library.function
                if 'while_body' in f.signature.name][0]
        matmuls = sum(n.op in ('MatMul', 'BatchMatMulV2', 'Einsum') for n in body.node_def)
        return fn(self.src_ids, self.src_paddings), matmuls

    def testMicroBatchesEachDecodeTheirExamplesWithTheirOwnCaches(self):
        # Batch 4 as 1, 2 (the model's M) or 3 micro-batches (of 1, 1 and 2 examples): the
        # same tokens and scores; each micro-batch's step has its own calls of every layer.
        greedy, matmuls = self._Run(1)
        beam, _ = self._Run(1, beam_size=2)
        for m in (2, 3):
            got, got_matmuls = self._Run(m)
            self.assertAllEqual(got, greedy)
            self.assertEqual(got_matmuls, m * matmuls)
            got_ids, got_scores = self._Run(m, beam_size=2)[0]
            self.assertAllEqual(got_ids, beam[0])
            self.assertAllClose(got_scores, beam[1], rtol=1e-5)
        self.assertEqual(self._Run(None)[1], 2 * matmuls)  # The model's M by default.
        with self.assertRaisesRegex(ValueError, 'num_micro_batches must be >= 1, got 0'):
            decoding.IncrementalDecoder(self.task.model, 0)

    def testBeamOfOneIsGreedyAndItsScoreIsTheTokensLogProbability(self):
        greedy = self.task.Decode(self.src_ids, self.src_paddings)
        self.assertAllEqual(self.task.Decode(self.src_ids, self.src_paddings, beam_size=1),
                            greedy)
        ids, scores = tf.function(
            lambda s, q: self.task.BeamIds(s, q, beam_size=1), autograph=False)(
                self.src_ids, self.src_paddings)
        self.assertAllEqual(ids, greedy)
        self.assertAllClose(scores, self._LogProbability(ids), rtol=1e-4)

    def testWiderBeamsFindHypothesesAtLeastAsLikelyByTheirRanking(self):
        p = self.task.p
        for beam in (2, 4):
            ids, scores = tf.function(
                lambda s, q, beam=beam: self.task.BeamIds(s, q, beam_size=beam),
                autograph=False)(self.src_ids, self.src_paddings)
            ids = ids.numpy()
            # The score is the hypothesis' log-probability under the model.
            self.assertAllClose(scores, self._LogProbability(ids), rtol=1e-4)
            for row in ids:  # Laid out as greedy's: ends at its first </s>, then 0.
                eos = np.flatnonzero(row == p.eos_id)
                if eos.size:
                    self.assertAllEqual(row[eos[0] + 1:], 0)

    def _LogProbability(self, ids):
        """Per row, the sum of log P(token) over its tokens up to and including the first </s>,
        position by position (each step equals the full forward: the greedy test)."""
        ids = np.asarray(ids)
        batch, length = ids.shape
        tgt = np.concatenate([np.full([batch, 1], self.task.p.bos_id), ids[:, :-1]], 1)
        decoder = decoding.IncrementalDecoder(self.task.model)
        theta = self.task.model.theta
        encoded = decoder.Encode(theta, self.src_ids, self.src_paddings)
        caches = decoder.InitialCaches(theta, encoded, length)
        total = np.zeros(batch)
        alive = np.ones(batch, bool)
        for t in range(length):
            logits, caches = decoder.Step(theta, tf.constant(tgt[:, t], tf.int32),
                                          tf.constant(t), caches, encoded, length)
            log_probs = tf.nn.log_softmax(logits).numpy()
            total += np.where(alive, log_probs[np.arange(batch), ids[:, t]], 0.0)
            alive &= ids[:, t] != self.task.p.eos_id
        return total

    def testALanguageModelIsRefused(self):
        p = model_registry.GetParams('lm.TransformerLTiny', 'Test')
        with self.assertRaisesRegex(ValueError, 'encoder-decoder'):
            decoding.IncrementalDecoder(p.Instantiate().model)


if __name__ == '__main__':
    tf.test.main()
