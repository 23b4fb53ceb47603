"""The partitioner: optimal contiguous min-max cells, and the histogram heuristic."""

import itertools
import random

import pytest
import tensorflow as tf
from absl.testing import parameterized

from gpipe_tf import errors
from gpipe_tf.pipeline import partition

pytestmark = pytest.mark.unit


def BruteForceMinMax(costs, k):
    n = len(costs)
    return min(max(partition.CellCosts(costs, [0, *cuts, n]))
               for cuts in itertools.combinations(range(1, n), k - 1))


class OptimalBoundariesTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.parameters(
        ([1, 2, 3, 4, 5, 6, 7, 8, 9], 3, [0, 5, 7, 9]),       # 15 | 13 | 17
        ([5, 1, 1, 1, 1, 1], 2, [0, 1, 6]),                    # 5 | 5
        ([1] * 8, 4, [0, 2, 4, 6, 8]),
        ([10, 1, 1, 10], 2, [0, 2, 4]),                        # 11 | 11
        ([3, 3, 3], 3, [0, 1, 2, 3]),
        ([7], 1, [0, 1]),
    )
    def testHandCheckedCases(self, costs, k, expected):
        self.assertEqual(partition.OptimalBoundaries(costs, k), expected)

    def testTiesGoToTheLowerVariance(self):
        # [4, 1, 1, 1, 1] K=3: optimum max 4; [4 | 1 1 | 1 1] (4, 2, 2) beats [4 | 1 | 1 1 1]
        # (4, 1, 3) and [4 | 1 1 1 | 1] (4, 3, 1) on variance.
        self.assertEqual(partition.OptimalBoundaries([4, 1, 1, 1, 1], 3), [0, 1, 3, 5])

    def testMatchesBruteForceOnSmallRandomLists(self):
        rng = random.Random(1)
        for _ in range(300):
            n = rng.randint(1, 9)
            k = rng.randint(1, n)
            costs = [rng.choice([rng.random(), rng.randint(0, 4)]) for _ in range(n)]
            got = max(partition.CellCosts(costs, partition.OptimalBoundaries(costs, k)))
            self.assertAlmostEqual(got, BruteForceMinMax(costs, k), places=9, msg=(costs, k))

    def testNeverWorseThanTheHistogramHeuristic(self):
        rng = random.Random(0)
        for _ in range(1000):
            n = rng.randint(1, 40)
            k = rng.randint(1, n)
            costs = [rng.choice([rng.random() * 100, rng.randint(0, 9), rng.expovariate(0.1)])
                     for _ in range(n)]
            optimal = partition.OptimalBoundaries(costs, k)
            heuristic = partition.HistogramBoundaries(costs, k)
            for b in (optimal, heuristic):
                self.assertEqual(partition.CheckBoundaries(b, n, k), b)
            self.assertLessEqual(max(partition.CellCosts(costs, optimal)),
                                 max(partition.CellCosts(costs, heuristic)) + 1e-9,
                                 msg=(costs, k))

    def testLargeModelsPartitionQuickly(self):
        rng = random.Random(2)
        costs = [rng.random() for _ in range(2000)]
        boundaries = partition.OptimalBoundaries(costs, 64)
        self.assertLen(boundaries, 65)


class OtherPartitionersTest(tf.test.TestCase):

    def testUniformGivesEarlierCellsTheRemainder(self):
        self.assertEqual(partition.UniformBoundaries(10, 4), [0, 3, 6, 8, 10])

    def testHistogramKeepsEveryCellNonEmpty(self):
        self.assertEqual(partition.HistogramBoundaries([100, 0, 0, 0], 4), [0, 1, 2, 3, 4])

    def testRejectsMoreCellsThanLayers(self):
        with self.assertRaisesRegex(ValueError, r'\(3 < 4\)'):
            partition.OptimalBoundaries([1, 2, 3], 4)

    def testRejectsNegativeCosts(self):
        with self.assertRaisesRegex(ValueError, 'non-negative.*-1'):
            partition.OptimalBoundaries([1, -1, 3], 2)

    def testCheckBoundariesNamesTheProblem(self):
        with self.assertRaisesRegex(ValueError, r'\[0, 2, 2, 4\] do not cover the 4 layers'):
            partition.CheckBoundaries([0, 2, 2, 4], 4, 3)

    def testBadBoundariesAreAConfigError(self):
        # A user's partition_method: the trainer reports a ConfigError in one line.
        with self.assertRaisesRegex(errors.ConfigError, r'\[0, 3, 1, 4, 4\] do not cover'):
            partition.CheckBoundaries([0, 3, 1, 4, 4], 4, 4)

    def testReportListsEveryCell(self):
        rows = [partition.ReportRow(k, f'/device:CPU:{k}', [f'l{k}'], 10 * (k + 1), 5, 1024)
                for k in range(3)]
        report = partition.FormatReport(rows)
        self.assertLen(report.splitlines(), 4)
        self.assertIn('/device:CPU:2', report)
        self.assertIn('50.0%', report)
        self.assertIn('1.00KiB', report)  # Bytes in binary units, as the memory tables.


if __name__ == '__main__':
    tf.test.main()
