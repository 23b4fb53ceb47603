"""The GPipe clock: ticks, and the bubble fraction the paper states."""

import pytest
import tensorflow as tf
from absl.testing import parameterized

from gpipe_tf.pipeline import schedule

pytestmark = pytest.mark.unit


class ScheduleTest(tf.test.TestCase, parameterized.TestCase):

    def testForwardTicksRunCellKOnMicroBatchTMinusK(self):
        self.assertEqual(schedule.ForwardTicks(3, 2),
                         [[(0, 0)], [(0, 1), (1, 0)], [(0, 2), (1, 1)], [(1, 2)]])

    def testBackwardTicksStartAtTheLastCell(self):
        self.assertEqual(schedule.BackwardTicks(3, 2),
                         [[(1, 0)], [(1, 1), (0, 0)], [(1, 2), (0, 1)], [(0, 2)]])

    @parameterized.product(m=[1, 2, 5, 8], k=[1, 3, 4])
    def testEveryCellRunsEveryMicroBatchOnceInOrder(self, m, k):
        for ticks in (schedule.ForwardTicks(m, k), schedule.BackwardTicks(m, k)):
            self.assertLen(ticks, m + k - 1)
            pairs = [pair for tick in ticks for pair in tick]
            self.assertCountEqual(pairs, [(c, b) for c in range(k) for b in range(m)])
            for cell in range(k):
                self.assertEqual([b for c, b in pairs if c == cell], list(range(m)))

    def testForwardDependenciesComeFromEarlierTicks(self):
        tick_of = {pair: t for t, tick in enumerate(schedule.ForwardTicks(6, 4)) for pair in tick}
        for (cell, mb), t in tick_of.items():
            if cell > 0:
                self.assertLess(tick_of[(cell - 1, mb)], t)

    @parameterized.parameters((2, 1, 0.50), (2, 4, 0.20), (2, 32, 0.03), (4, 1, 0.75),
                              (4, 4, 0.43), (4, 32, 0.09), (8, 1, 0.875), (8, 4, 0.64),
                              (8, 32, 0.18))
    def testBubbleFractionMatchesThePapersTable(self, k, m, expected):
        self.assertAlmostEqual(schedule.BubbleFraction(m, k), expected, delta=0.005)

    def testRejectsEmptySchedules(self):
        with self.assertRaisesRegex(ValueError, 'must be >= 1, got 0 and 2'):
            schedule.ForwardTicks(0, 2)


if __name__ == '__main__':
    tf.test.main()
