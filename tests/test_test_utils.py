"""The tests' own comparison: gpipe_tf.test_utils.MaxRelativeError must not call a NaN or an
infinity equal to a number (numpy's max skips a NaN difference)."""

import numpy as np
import pytest
from absl.testing import absltest

from gpipe_tf import test_utils


@pytest.mark.unit
class MaxRelativeErrorTest(absltest.TestCase):

    def testRelativeToTheLargestExpectedValue(self):
        self.assertAlmostEqual(test_utils.MaxRelativeError(
            [np.array([1.0, 2.1]), np.array(4.0)], [np.array([1.0, 2.0]), np.array(4.0)]), 0.05)

    def testANanOrInfinityWhereANumberIsExpectedIsInfinitelyWrong(self):
        for bad in (np.nan, np.inf, -np.inf):
            with self.subTest(bad=bad):
                self.assertEqual(test_utils.MaxRelativeError(
                    [np.array([1.0, bad])], [np.array([1.0, 2.0])]), float('inf'))
                self.assertEqual(test_utils.MaxRelativeError(
                    [np.array([1.0, 2.0])], [np.array([1.0, bad])]), float('inf'))

    def testTheSameNonFiniteValuesAreEqual(self):
        self.assertEqual(test_utils.MaxRelativeError(
            [np.array([1.0, np.nan, np.inf])], [np.array([1.0, np.nan, np.inf])]), 0.0)
        self.assertEqual(test_utils.MaxRelativeError(
            [np.array([-np.inf])], [np.array([np.inf])]), float('inf'))


if __name__ == '__main__':
    absltest.main()
