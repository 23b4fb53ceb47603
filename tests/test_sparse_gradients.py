"""A gather's weight gradient (an embedding table's) stays sparse through the pipeline: the
IndexedSlices of the rows every micro-batch read, summed over micro-batches and replicas, equal
to the un-partitioned layers' own gradient of the table, under every schedule, recompute mode
and executor."""

import numpy as np
import pytest
import tensorflow as tf
from absl.testing import parameterized

from gpipe_tf import test_utils
from gpipe_tf.layers import basic
from gpipe_tf.layers import embedding
from gpipe_tf.layers import fprop_context
from gpipe_tf.nested_map import NestedMap
from gpipe_tf.pipeline import gradient_sums
from gpipe_tf.pipeline import pipelining_layer


DEVICES = test_utils.ConfigureVirtualCpus()
BATCH, TIME, VOCAB, DIM = 8, 3, 11, 4
TOLERANCE = 1e-5
# (schedule, K, v, M, R, recompute, unroll): every kind, both executors, both ways a cell
# keeps what its backward reads, and replicas.
CASES = [
    ('gpipe', 2, 1, 4, 1, 'always', True),
    ('gpipe', 2, 1, 4, 1, 'never', True),
    ('1f1b', 2, 1, 4, 2, 'always', True),
    ('1f1b', 2, 1, 4, 1, 'never', False),
    ('interleaved_1f1b', 2, 2, 4, 1, 'always', False),
    ('zero_bubble', 2, 1, 4, 1, 'never', True),
    ('zero_bubble', 2, 1, 4, 1, 'always', False),
    ('zero_bubble_v', 2, 2, 4, 1, 'never', False),
]


def Layers():
    """An embedding first (its table's gradient is a gather's), then dense layers."""
    return [embedding.EmbeddingLayer.Params().Set(name='emb', vocab_size=VOCAB,
                                                  embedding_dim=DIM)] + [
        basic.DenseLayer.Params().Set(name=f'dense_{i}', input_dim=DIM, output_dim=DIM,
                                      activation='tanh') for i in range(3)]


def Pipeline(kind, k, v, m, r, recompute, unroll):
    return pipelining_layer.PipeliningLayer.Params().Set(
        name='model', layer_tpl=Layers(), num_cells=k, virtual_stages=v, num_micro_batches=m,
        num_replicas=r, schedule=kind, recompute=recompute, unroll=unroll,
        devices=DEVICES[:k * r], partition_method='uniform', random_seed=2).Instantiate()


def Data(batch=BATCH):
    ids = tf.random.stateless_uniform([batch, TIME], [4, 5], maxval=VOCAB, dtype=tf.int32)
    target = tf.random.stateless_normal([batch, TIME, DIM], [6, 7])
    return ids, NestedMap(target=target)


def LossFn(outputs, loss_inputs):
    """A mean over examples, as a task's loss: (value, weight)."""
    examples = tf.cast(tf.shape(outputs)[0], tf.float32)
    total = tf.reduce_sum(tf.square(outputs - loss_inputs.target))
    return tf.math.divide_no_nan(total, examples), examples


def PipelineGradients(layer, ids, loss_inputs):
    with tf.GradientTape() as tape, fprop_context.Scope(step=1):
        _, loss, _ = layer.FPropLoss(layer.theta, ids, LossFn, loss_inputs)
    return tape.gradient(loss, list(layer.trainable_variables))


def ReferenceGradients(layer, ids, loss_inputs):
    """The un-partitioned layers' gradients (no pipeline code runs)."""
    with tf.GradientTape() as tape:
        outputs = test_utils.Unpartitioned(layer, ids, step=1)
        loss, _ = LossFn(outputs, loss_inputs)
    return tape.gradient(loss, list(layer.trainable_variables))


class SparseGradientTest(tf.test.TestCase, parameterized.TestCase):

    def assertSparseAsUnpartitioned(self, layer, got, want):
        tables = [i for i, v in enumerate(layer.trainable_variables) if 'emb' in v.name]
        self.assertLen(tables, 1)
        for i in tables:
            self.assertIsInstance(want[i], tf.IndexedSlices)  # The oracle's is sparse too.
            self.assertIsInstance(got[i], tf.IndexedSlices)
            # The batch's rows, each read once per position: the un-partitioned gradient's.
            self.assertAllEqual(tf.sort(got[i].indices), tf.sort(want[i].indices))
        self.assertLess(test_utils.MaxRelativeError(got, want), TOLERANCE)

    @parameterized.parameters(*CASES)
    def testInATfFunction(self, kind, k, v, m, r, recompute, unroll):
        layer = Pipeline(kind, k, v, m, r, recompute, unroll)
        ids, loss_inputs = Data()
        got = tf.function(PipelineGradients)(layer, ids, loss_inputs)
        self.assertSparseAsUnpartitioned(layer, got, ReferenceGradients(layer, ids, loss_inputs))

    @parameterized.parameters(('1f1b', True), ('zero_bubble', False), ('gpipe', False))
    def testOnABatchKnownOnlyWhenItRunsAndSmallerThanM(self, kind, unroll):
        # 3 examples, M=4: the empty micro-batch adds no row.
        layer = Pipeline(kind, 2, 1, 4, 1, 'always', unroll)
        ids, loss_inputs = Data(3)
        step = tf.function(lambda ids, target: PipelineGradients(
            layer, ids, NestedMap(target=target)), input_signature=[
                tf.TensorSpec([None, TIME], tf.int32), tf.TensorSpec([None, TIME, DIM])])
        got = step(ids, loss_inputs.target)
        self.assertSparseAsUnpartitioned(layer, got, ReferenceGradients(layer, ids, loss_inputs))

    @parameterized.parameters(('always', True), ('never', True), ('always', False))
    def testWithTheLossAfterThePipeline(self, recompute, unroll):
        # FProp, then the loss on the whole batch (gpipe): the pipeline's custom gradient
        # hands the table's slices back through the tape.
        layer = Pipeline('gpipe', 2, 1, 4, 2, recompute, unroll)
        ids, loss_inputs = Data()

        @tf.function
        def Step(ids):
            with tf.GradientTape() as tape, fprop_context.Scope(step=1):
                loss, _ = LossFn(layer.FProp(layer.theta, ids), loss_inputs)
            return tape.gradient(loss, list(layer.trainable_variables))

        self.assertSparseAsUnpartitioned(layer, Step(ids),
                                         ReferenceGradients(layer, ids, loss_inputs))

    def testEagerly(self):
        layer = Pipeline('1f1b', 2, 1, 4, 1, 'never', True)
        ids, loss_inputs = Data()
        got = PipelineGradients(layer, ids, loss_inputs)
        self.assertSparseAsUnpartitioned(layer, got, ReferenceGradients(layer, ids, loss_inputs))

    def testAnOptimizerStepAsUnpartitioned(self):
        # Momentum's sparse update moves only the rows read: a dense gradient of the table
        # would move the others too, through their momentum.
        # The second step reads none of the first step's rows.
        ids, loss_inputs = Data()
        batches = [(ids % 5, loss_inputs), (5 + ids % 6, loss_inputs)]
        results = []
        for pipelined in (True, False):
            layer = Pipeline('1f1b', 2, 1, 4, 1, 'always', True)
            optimizer = tf.compat.v1.train.MomentumOptimizer(0.5, 0.9)
            step = PipelineGradients if pipelined else ReferenceGradients
            for batch_ids, batch_loss_inputs in batches:
                grads = step(layer, batch_ids, batch_loss_inputs)
                optimizer.apply_gradients(zip(grads, layer.trainable_variables))
            results.append([v.numpy() for v in layer.trainable_variables])
        self.assertLess(test_utils.MaxRelativeError(*results), TOLERANCE)


@pytest.mark.unit
class GradientSumsTest(tf.test.TestCase):

    def testSlicesConcatenateInOrder(self):
        a = tf.IndexedSlices(tf.constant([[1.0], [2.0]]), tf.constant([3, 1]), tf.constant([5, 1]))
        b = tf.IndexedSlices(tf.constant([[4.0]]), tf.constant([3], tf.int64), tf.constant([5, 1]))
        total = gradient_sums.Add(a, b)
        self.assertIsInstance(total, tf.IndexedSlices)
        self.assertAllEqual(total.indices, [3, 1, 3])
        self.assertAllEqual(total.values, [[1.0], [2.0], [4.0]])
        self.assertAllEqual(tf.convert_to_tensor(total), [[0.0], [2.0], [0.0], [5.0], [0.0]])

    def testADenseGradientMakesTheSumDense(self):
        a = tf.IndexedSlices(tf.constant([[1.0]]), tf.constant([0]), tf.constant([2, 1]))
        total = gradient_sums.Add(a, tf.constant([[1.0], [1.0]]))
        self.assertNotIsInstance(total, tf.IndexedSlices)
        self.assertAllEqual(total, [[2.0], [1.0]])

    def testNoneAddsNothing(self):
        x = tf.constant([1.0])
        self.assertIs(gradient_sums.Add(None, x), x)
        self.assertIs(gradient_sums.Add(x, None), x)
        self.assertIsNone(gradient_sums.AddAll([]))

    def testZeroIsOfTheKindOfItsLike(self):
        weight = tf.ones([5, 2])
        like = tf.IndexedSlices(tf.ones([1, 2]), tf.constant([4]), tf.constant([5, 2]))
        zero = gradient_sums.Zero(weight, like)
        self.assertIsInstance(zero, tf.IndexedSlices)
        self.assertAllEqual(tf.convert_to_tensor(zero), np.zeros([5, 2]))
        self.assertAllEqual(gradient_sums.Zero(weight, tf.ones([5, 2])), np.zeros([5, 2]))


if __name__ == '__main__':
    tf.test.main()
