"""Splitting a mini-batch into micro-batches and gathering them back (`pipeline/microbatch.py`):
the batch size of a nest, the choice of M, and Split/Concat against numpy's split/concatenate
(uneven splits against np.array_split), padding to a multiple of M for inference."""

import numpy as np
import pytest
import tensorflow as tf
from absl.testing import parameterized

from gpipe_tf.nested_map import NestedMap
from gpipe_tf.pipeline import microbatch

pytestmark = pytest.mark.unit


def Arange(shape, dtype=np.float64):
    return np.arange(np.prod(shape), dtype=dtype).reshape(shape)


class BatchSizeTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.parameters((0, 6), (1, 4), (2, 3), (-1, 3))
    def testIsTheSizeOfBatchDim(self, batch_dim, expected):
        x = tf.zeros([6, 4, 3])
        self.assertEqual(microbatch.StaticBatchSize(x, batch_dim), expected)

    def testNoneLeavesAreIgnored(self):
        inputs = NestedMap(x=tf.zeros([8, 2]), mask=None, ids=tf.zeros([8], tf.int32))
        self.assertEqual(microbatch.StaticBatchSize(inputs, 0), 8)

    def testIsNoneWhenTheBatchDimIsUnknown(self):
        sizes = []

        @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32)])
        def Traced(x):
            sizes.append(microbatch.StaticBatchSize((x, None), 0))
            return x

        Traced.get_concrete_function()
        self.assertEqual(sizes, [None])

    def testUnknownSizesDoNotHideAKnownOne(self):
        sizes = []

        @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32),
                                      tf.TensorSpec(None, tf.float32)])
        def Traced(x, y):
            sizes.append(microbatch.StaticBatchSize([x, y, tf.zeros([5, 3])], 0))
            return x

        Traced.get_concrete_function()
        self.assertEqual(sizes, [5])

    def testEmptyNestHasNoBatchSize(self):
        self.assertIsNone(microbatch.StaticBatchSize(NestedMap(), 0))
        self.assertIsNone(microbatch.StaticBatchSize([None, None], 0))

    def testDisagreementNamesTheSizesAndTheDim(self):
        inputs = [tf.zeros([4, 6]), tf.zeros([2, 6]), tf.zeros([3, 6])]
        self.assertEqual(microbatch.StaticBatchSize(inputs, 1), 6)
        with self.assertRaisesRegex(ValueError, r'batch_dim 0: \[2, 3, 4\]'):
            microbatch.StaticBatchSize(inputs, 0)

    def testRankTooSmallNamesTheShapeAndTheDim(self):
        with self.assertRaisesRegex(ValueError, r'shape \(4, 6\) has no batch_dim 2'):
            microbatch.StaticBatchSize([tf.zeros([4, 6, 2]), tf.zeros([4, 6])], 2)
        with self.assertRaisesRegex(ValueError, r'shape \(\) has no batch_dim 0'):
            microbatch.StaticBatchSize(tf.constant(1.0), 0)
        with self.assertRaisesRegex(ValueError, r'shape \(4, 3\) has no batch_dim -3'):
            microbatch.StaticBatchSize([tf.zeros([4, 3])], -3)

    def testALeafThatIsNoTensorNamesItsType(self):
        with self.assertRaisesRegex(TypeError, r"must be tensors or arrays; got str 'abc'"):
            microbatch.StaticBatchSize([tf.zeros([4, 2]), 'abc'], 0)

    def testANegativeBatchDimCountsFromTheEnd(self):
        self.assertEqual(microbatch.StaticBatchSize([tf.zeros([4, 3])], -1), 3)


class SplitTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.product(batch_dim=[0, 1, 2], m=[1, 2, 4])
    def testEqualsNumpySplit(self, batch_dim, m):
        x = Arange([4, 8, 4])
        parts = microbatch.Split(tf.constant(x), m, batch_dim)
        expected = np.split(x, m, axis=batch_dim)
        self.assertLen(parts, m)
        for part, want in zip(parts, expected):
            self.assertAllEqual(part, want)

    def testSplitsEveryLeafOfANestAndKeepsItsStructure(self):
        x, ids = Arange([6, 2]), Arange([6], np.int32)
        pair = (Arange([6, 3, 2]), Arange([6]))
        inputs = NestedMap(x=tf.constant(x), ids=tf.constant(ids), mask=None,
                           pair=tuple(tf.constant(a) for a in pair))
        parts = microbatch.Split(inputs, 3)
        self.assertLen(parts, 3)
        for m, part in enumerate(parts):
            self.assertIsInstance(part, NestedMap)
            self.assertIsInstance(part.pair, tuple)
            self.assertIsNone(part.mask)
            self.assertEqual(part.ids.dtype, tf.int32)
            self.assertAllEqual(part.x, np.split(x, 3)[m])
            self.assertAllEqual(part.ids, np.split(ids, 3)[m])
            self.assertAllEqual(part.pair[0], np.split(pair[0], 3)[m])
            self.assertAllEqual(part.pair[1], np.split(pair[1], 3)[m])

    @parameterized.parameters((5, 2), (7, 3), (3, 4), (1, 4), (10, 4))
    def testAnUnevenSplitEqualsNumpyArraySplit(self, batch, m):
        # np.array_split makes the first N mod M parts one larger, and parts past N empty.
        x = Arange([batch, 2])
        got = microbatch.Split(tf.constant(x), m)
        want = np.array_split(x, m)
        self.assertLen(got, m)
        for g, w in zip(got, want):
            self.assertAllEqual(g.shape, w.shape)
            self.assertAllEqual(g, w)

    @parameterized.parameters((5, 2), (3, 4), (8, 4))
    def testSizesAndStartsAgreeWithNumpyForIntAndTensorBatches(self, batch, m):
        want = [len(p) for p in np.array_split(np.arange(batch), m)]
        starts = list(np.cumsum([0] + want[:-1]))
        self.assertEqual(microbatch.Sizes(batch, m), want)
        self.assertEqual(microbatch.Starts(batch, m), starts)
        self.assertAllEqual(microbatch.Sizes(tf.constant(batch, tf.int64), m), want)
        self.assertAllEqual(microbatch.Starts(tf.constant(batch, tf.int64), m), starts)

    def testSplitsNumpyLeaves(self):
        x = Arange([6, 2])
        for got, want in zip(microbatch.Split({'x': x}, 3), np.split(x, 3)):
            self.assertAllEqual(got['x'], want)

    @parameterized.parameters((5, 2), (3, 4), (8, 4))
    def testPaddedRepeatsTheLastExampleAndUnpaddedUndoesIt(self, batch, m):
        x = Arange([batch, 3])
        padded, size = microbatch.Padded(NestedMap(x=tf.constant(x), mask=None), m)
        self.assertEqual(size, batch)
        rows = -(-batch // m) * m
        want = np.concatenate([x, np.repeat(x[-1:], rows - batch, 0)])
        self.assertAllEqual(padded.x, want)
        self.assertIsNone(padded.mask)
        self.assertAllEqual(microbatch.Unpadded(padded, size).x, x)

    def testUnevenSplitAndPaddingOfAnUnknownBatchInsideAFunction(self):
        @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float64)])
        def SplitAndPad(x):
            padded, size = microbatch.Padded(x, 4)
            return ([tf.reduce_sum(p, 0) for p in microbatch.Split(x, 4)],
                    [tf.shape(p)[0] for p in microbatch.Split(x, 4)],
                    microbatch.Unpadded(padded * 2, size), tf.shape(padded)[0])

        x = Arange([6, 3])
        sums, sizes, doubled, rows = SplitAndPad(tf.constant(x))
        want = np.array_split(x, 4)
        self.assertAllEqual(sizes, [len(w) for w in want])
        for got, w in zip(sums, want):
            self.assertAllEqual(got, w.sum(0))
        self.assertAllEqual(doubled, 2 * x)
        self.assertEqual(int(rows), 8)

    def testWorksOnAnUnknownBatchInsideAFunction(self):
        @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float64)])
        def SplitSums(x):
            return [tf.reduce_sum(p, 0) for p in microbatch.Split(x, 2)]

        x = Arange([6, 3])
        expected = [p.sum(0) for p in np.split(x, 2)]
        for got, want in zip(SplitSums(tf.constant(x)), expected):
            self.assertAllEqual(got, want)


class InPlaceTest(tf.test.TestCase, parameterized.TestCase):
    """Micro-batches read in place, against numpy's split (even) and array_split (uneven)."""

    @parameterized.parameters((0, 2), (0, 3), (1, 2), (2, 4))
    def testAStaticBatchsMicroBatchesEqualNumpySplit(self, batch_dim, m):
        x = Arange([12, 8, 4])
        batch = microbatch.InPlace(tf.constant(x), m, batch_dim)
        view = batch.View(tf.constant(x))
        size = x.shape[batch_dim] // m
        for i, expected in enumerate(np.split(x, m, axis=batch_dim)):
            self.assertAllEqual(batch.Slice(view, i), expected)
            self.assertEqual(int(batch.Start(i)), i * size)
        self.assertIsNone(batch.sizes)

    @parameterized.parameters((7, 3), (2, 4), (8, 4))
    def testABatchKnownWhenTheStepRunsSplitsAsNumpyArraySplit(self, n, m):
        x = Arange([n, 3])

        @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float64)])
        def Parts(x):
            batch = microbatch.InPlace(x, m, 0)
            view = batch.View(x)
            return ([batch.Slice(view, tf.constant(i)) for i in range(m)],
                    [batch.Start(tf.constant(i)) for i in range(m)], batch.sizes)

        parts, starts, sizes = Parts(x)
        expected = np.array_split(x, m)
        for got, want in zip(parts, expected):
            self.assertAllEqual(got, want)
        self.assertAllEqual(sizes, [len(e) for e in expected])
        self.assertAllEqual(starts, np.cumsum([0] + [len(e) for e in expected])[:-1])

    def testAStaticBatchMDoesNotDivideIsRefusedWithTheCounts(self):
        with self.assertRaisesRegex(ValueError, 'a batch of 7 examples does not split into 2'):
            microbatch.InPlace(tf.zeros([7, 3]), 2, 0)


class ConcatTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.parameters(0, 1, 2)
    def testEqualsNumpyConcatenate(self, batch_dim):
        rng = np.random.default_rng(batch_dim)
        sizes = [1, 3, 2]
        parts = []
        for size in sizes:
            shape = [2, 3, 4]
            shape[batch_dim] = size
            parts.append(rng.standard_normal(shape))
        got = microbatch.Concat([tf.constant(p) for p in parts], batch_dim)
        self.assertAllEqual(got, np.concatenate(parts, axis=batch_dim))

    def testConcatenatesEveryLeafOfANest(self):
        parts = [NestedMap(x=Arange([2, 3]) + 10 * m, ids=Arange([2], np.int32) + m, mask=None)
                 for m in range(3)]
        got = microbatch.Concat([p.Transform(lambda a: None if a is None else tf.constant(a))
                                 for p in parts])
        self.assertIsInstance(got, NestedMap)
        self.assertIsNone(got.mask)
        self.assertAllEqual(got.x, np.concatenate([p.x for p in parts]))
        self.assertAllEqual(got.ids, np.concatenate([p.ids for p in parts]))

    @parameterized.product(batch_dim=[0, 1], m=[1, 2, 3, 6])
    def testUndoesSplit(self, batch_dim, m):
        inputs = (tf.constant(Arange([6, 6, 2])), [tf.constant(Arange([6, 6], np.int64)), None])
        parts = microbatch.Split(inputs, m, batch_dim)
        back = microbatch.Concat(parts, batch_dim)
        tf.nest.assert_same_structure(back, inputs)
        self.assertAllEqual(back[0], inputs[0])
        self.assertAllEqual(back[1][0], inputs[1][0])
        self.assertIsNone(back[1][1])

    def testNothingToConcatenateRaises(self):
        with self.assertRaisesRegex(ValueError, 'at least one micro-batch'):
            microbatch.Concat([])

    def testGathersInListOrder(self):
        parts = [tf.fill([2, 1], float(m)) for m in (3, 0, 2)]
        self.assertAllEqual(microbatch.Concat(parts)[:, 0], [3, 3, 0, 0, 2, 2])


if __name__ == '__main__':
    tf.test.main()
