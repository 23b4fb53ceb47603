"""example_random: each example's values depend on (seed, its index) alone."""

import numpy as np
import pytest
import tensorflow as tf

from gpipe_tf.layers import example_random
from gpipe_tf.layers import fprop_context

SEED = tf.constant([5, 7], tf.int64)

pytestmark = pytest.mark.unit


class UniformTest(tf.test.TestCase):

    def testAnyPieceOfTheBatchEqualsTheSameRowsOfTheWholeBatch(self):
        # Per-example sizes that Philox's 4 values per counter step do and do not divide.
        for rest in ([], [1], [3], [4], [5, 3], [2, 2]):
            with self.subTest(rest=repr(rest)):
                whole = example_random.Uniform(SEED, [12] + rest).numpy()
                for first, size in ((0, 12), (1, 5), (3, 1), (7, 5), (11, 1)):
                    piece = example_random.Uniform(SEED, [size] + rest, first_example=first)
                    self.assertAllEqual(piece, whole[first:first + size])

    def testTheBatchDimensionMayBeAnyDimension(self):
        whole = example_random.Uniform(SEED, [4, 6, 3], batch_dim=0).numpy()
        moved = example_random.Uniform(SEED, [6, 4, 3], batch_dim=1).numpy()
        self.assertAllEqual(np.transpose(moved, [1, 0, 2]), whole)
        last = example_random.Uniform(SEED, [6, 3, 2], batch_dim=-1, first_example=2).numpy()
        self.assertAllEqual(np.transpose(last, [2, 0, 1]), whole[2:])

    def testTheContextGivesTheFirstExampleAndBatchDimension(self):
        whole = example_random.Uniform(SEED, [3, 8]).numpy()
        with fprop_context.Scope(first_example=1, batch_dim=1):
            piece = example_random.Uniform(SEED, [8, 2]).numpy()
        self.assertAllEqual(piece.T, whole[1:])

    def testInsideATfFunctionWithTensorOffsets(self):
        fn = tf.function(lambda first: example_random.Uniform(SEED, [2, 6], first_example=first))
        whole = example_random.Uniform(SEED, [8, 6]).numpy()
        self.assertAllEqual(fn(tf.constant(6, tf.int64)), whole[6:])

    def testValuesAreUniformAndSeedsDiffer(self):
        values = example_random.Uniform(SEED, [1000, 10]).numpy()
        self.assertBetween(values.min(), 0.0, 0.01)
        self.assertBetween(values.max(), 0.99, 1.0)
        self.assertNear(values.mean(), 0.5, 0.01)
        other = example_random.Uniform(tf.constant([5, 8], tf.int64), [1000, 10]).numpy()
        self.assertLess(np.mean(values == other), 0.001)

    def testAShapeWithoutABatchDimensionIsRefused(self):
        with self.assertRaisesRegex(ValueError, 'static rank >= 1'):
            example_random.Uniform(SEED, tf.constant([], tf.int32))


if __name__ == '__main__':
    tf.test.main()
