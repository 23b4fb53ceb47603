"""The schedule simulator: hand-computed timelines, and the invariants of every timeline."""

import collections

import pytest
from absl.testing import absltest
from absl.testing import parameterized

from gpipe_tf.perf import simulator

pytestmark = pytest.mark.unit


def _Uniform(k, f=1.0, b=2.0, r=None, transfer=0.0):
    return simulator.CellCosts(forward=[f] * k, backward=[b] * k,
                               recompute=None if r is None else [r] * k, transfer=transfer)


def _Spans(timeline, kind):
    return {(i.cell, i.micro_batch): (i.start, i.end) for i in timeline.intervals
            if i.kind == kind}


# (name, costs, M, recompute) for the invariant tests: uniform, skewed, with transfers.
_CASES = [
    ('k1', _Uniform(1), 5, False),
    ('k4_m8', _Uniform(4), 8, False),
    ('k4_m8_recompute', _Uniform(4, r=0.5), 8, True),
    ('k3_m4_slow_middle', simulator.CellCosts([1, 3, 1], [2, 6, 2]), 4, True),
    ('k5_m3_transfer', simulator.CellCosts([1, 2, 0.5, 1, 3], [2, 1, 1, 4, 2],
                                           [1, 1, 1, 1, 1], transfer=0.7), 3, True),
    ('k4_m2_slow_transfer', _Uniform(4, transfer=5.0), 2, [True, True, True, False]),
]


class SimulatorTest(parameterized.TestCase):

    def testOneCellRunsAllForwardsThenAllBackwards(self):
        timeline = simulator.Simulate(_Uniform(1), 5, recompute=False)
        self.assertEqual(timeline.makespan, 5 * (1 + 2))
        self.assertEqual(timeline.utilisation, 1.0)
        self.assertEqual(timeline.bubble, 0.0)

    def testOneCellWithRecomputeAddsTheRecomputeToEachMicroBatch(self):
        timeline = simulator.Simulate(_Uniform(1, r=1.0), 5, recompute=True)
        self.assertEqual(timeline.makespan, 5 * (1 + 1 + 2))

    def testTwoCellsOneMicroBatchIdleHalfTheTime(self):
        timeline = simulator.Simulate(_Uniform(2), 1, recompute=False)
        self.assertEqual(timeline.intervals, [
            (0, 0, 0, 'forward', 0, 1), (1, 1, 0, 'forward', 1, 2),
            (1, 1, 0, 'backward', 2, 4), (0, 0, 0, 'backward', 4, 6)])
        self.assertEqual(timeline.makespan, 6)
        self.assertEqual(timeline.busy, [3, 3])
        self.assertEqual(timeline.bubble, 0.5)

    def testBalancedCellsReachTheIdealUtilisationExactly(self):
        timeline = simulator.Simulate(_Uniform(4), 8, recompute=False)
        forward_end = max(end for _, end in _Spans(timeline, 'forward').values())
        self.assertEqual(forward_end, (8 + 4 - 1) * 1.0)
        self.assertEqual(timeline.makespan - forward_end, (8 + 4 - 1) * 2.0)
        self.assertEqual(timeline.utilisation, 8 / 11)
        self.assertEqual(timeline.utilisation, simulator.IdealUtilisation(8, 4))

    def testRecomputeMakesEachBackwardSlotCostRecomputePlusBackward(self):
        timeline = simulator.Simulate(_Uniform(4, r=1.0), 8, recompute=True)
        self.assertEqual(timeline.makespan, 11 * 1.0 + 11 * (1.0 + 2.0))
        self.assertEqual(timeline.utilisation, simulator.IdealUtilisation(8, 4))

    def testRecomputeDefaultsToTheForwardCost(self):
        timeline = simulator.Simulate(_Uniform(4, f=1.5), 8, recompute=True)
        self.assertEqual(timeline.makespan, 11 * 1.5 + 11 * (1.5 + 2.0))

    def testPerCellRecomputeFlags(self):
        # 'except_last': cell 1's backward needs no recompute, cell 0's recomputes first.
        timeline = simulator.Simulate(_Uniform(2), 1, recompute=[True, False])
        self.assertEqual([(i.cell, i.kind, i.start, i.end) for i in timeline.intervals[2:]], [
            (1, 'backward', 2, 4), (0, 'recompute', 4, 5), (0, 'backward', 5, 7)])

    def testTransfersByHand(self):
        # K=2, M=2, f=1, b=2, transfer 0.5: cell 1 waits 0.5 for each activation, cell 0 for
        # each gradient.
        timeline = simulator.Simulate(_Uniform(2, transfer=0.5), 2, recompute=False)
        self.assertEqual(_Spans(timeline, 'forward'), {
            (0, 0): (0, 1), (0, 1): (1, 2), (1, 0): (1.5, 2.5), (1, 1): (2.5, 3.5)})
        self.assertEqual(_Spans(timeline, 'backward'), {
            (1, 0): (3.5, 5.5), (1, 1): (5.5, 7.5), (0, 0): (6, 8), (0, 1): (8, 10)})
        self.assertEqual(timeline.makespan, 3 * (1 + 2) + 2 * (2 - 1) * 0.5)

    @parameterized.parameters(False, True)
    def testTransfersAddKMinusOneHopsPerPhase(self, recompute):
        slot = 1.0 + (1.0 if recompute else 0.0) + 2.0
        no_transfer = simulator.Simulate(_Uniform(4), 8, recompute=recompute)
        timeline = simulator.Simulate(_Uniform(4, transfer=0.25), 8, recompute=recompute)
        self.assertEqual(no_transfer.makespan, 11 * slot)
        self.assertEqual(timeline.makespan, 11 * slot + 2 * 3 * 0.25)
        self.assertLess(timeline.utilisation, simulator.IdealUtilisation(8, 4))

    def testSlowestCellDominates(self):
        # Forward: cell 1 (3 s) paces the pipe, 1 + 4 * 3 + 1 = 14. Backward from 14: cell 2
        # ends m=0 at 16, cell 1 (6 s) runs 16..40, cell 0 ends 2 s after it: 42.
        costs = simulator.CellCosts(forward=[1, 3, 1], backward=[2, 6, 2])
        timeline = simulator.Simulate(costs, 4, recompute=False)
        self.assertEqual(_Spans(timeline, 'forward')[(2, 3)], (13, 14))
        self.assertEqual(_Spans(timeline, 'backward')[(1, 3)], (34, 40))
        self.assertEqual(timeline.makespan, 42)
        self.assertEqual(timeline.busy, [12, 36, 12])
        self.assertEqual(timeline.utilisation, 60 / (3 * 42))
        self.assertGreater(timeline.bubble, 1 - simulator.IdealUtilisation(4, 3))

    def testIdealUtilisation(self):
        self.assertEqual(simulator.IdealUtilisation(8, 4), 8 / 11)
        self.assertEqual(simulator.IdealUtilisation(3, 1), 1.0)

    def testCostsFromFlops(self):
        costs = simulator.CostsFromFlops([2e9, 4e9], 1e9, backward_factor=2.0, transfer=0.1)
        self.assertEqual(costs, simulator.CellCosts(
            forward=[2.0, 4.0], backward=[4.0, 8.0], recompute=[2.0, 4.0], transfer=0.1))

    @parameterized.named_parameters(*_CASES)
    def testIntervalsLieWithinTheStep(self, costs, m, recompute):
        timeline = simulator.Simulate(costs, m, recompute)
        for interval in timeline.intervals:
            self.assertBetween(interval.start, 0, interval.end)
            self.assertLessEqual(interval.end, timeline.makespan)
        self.assertEqual(timeline.makespan, max(i.end for i in timeline.intervals))

    @parameterized.named_parameters(*_CASES)
    def testADeviceRunsOneOpAtATime(self, costs, m, recompute):
        by_device = collections.defaultdict(list)
        for interval in simulator.Simulate(costs, m, recompute).intervals:
            by_device[interval.device].append((interval.start, interval.end))
        for spans in by_device.values():
            spans.sort()
            for (_, end), (next_start, _) in zip(spans, spans[1:]):
                self.assertLessEqual(end, next_start)

    @parameterized.named_parameters(*_CASES)
    def testEveryOpRunsExactlyOnce(self, costs, m, recompute):
        k = costs.num_cells
        flags = [recompute] * k if isinstance(recompute, bool) else recompute
        expected = [(c, b, kind) for c in range(k) for b in range(m)
                    for kind in ('forward', 'recompute', 'backward')
                    if kind != 'recompute' or flags[c]]
        timeline = simulator.Simulate(costs, m, recompute)
        self.assertCountEqual([(i.cell, i.micro_batch, i.kind) for i in timeline.intervals],
                              expected)
        self.assertEqual([i.device for i in timeline.intervals],
                         [i.cell for i in timeline.intervals])

    @parameterized.named_parameters(*_CASES)
    def testDependenciesHold(self, costs, m, recompute):
        timeline = simulator.Simulate(costs, m, recompute)
        k, t = costs.num_cells, costs.transfer
        forward, backward = _Spans(timeline, 'forward'), _Spans(timeline, 'backward')
        recomputes = _Spans(timeline, 'recompute')
        loss_ready = forward[(k - 1, m - 1)][1]
        for (c, b), (start, _) in forward.items():
            if c > 0:
                self.assertGreaterEqual(start, forward[(c - 1, b)][1] + t)
        for (c, b), (start, _) in backward.items():
            if (c, b) in recomputes:
                self.assertGreaterEqual(start, recomputes[(c, b)][1])
                start = recomputes[(c, b)][0]
            self.assertGreaterEqual(start, loss_ready)
            if c < k - 1:
                self.assertGreaterEqual(start, backward[(c + 1, b)][1] + t)
            if b > 0:
                self.assertGreaterEqual(start, backward[(c, b - 1)][1])

    @parameterized.named_parameters(*_CASES)
    def testBusyMatchesTheIntervals(self, costs, m, recompute):
        timeline = simulator.Simulate(costs, m, recompute)
        for device, busy in enumerate(timeline.busy):
            self.assertAlmostEqual(busy, sum(i.end - i.start for i in timeline.intervals
                                             if i.device == device))
        self.assertAlmostEqual(timeline.bubble, 1 - timeline.utilisation)

    def testRejectsMismatchedLengths(self):
        with self.assertRaisesRegex(ValueError, r"got lengths \{'forward': 3, 'backward': 2\}"):
            simulator.CellCosts(forward=[1, 1, 1], backward=[1, 1])
        with self.assertRaisesRegex(ValueError, "'recompute': 1"):
            simulator.CellCosts(forward=[1, 1], backward=[1, 1], recompute=[1])
        with self.assertRaisesRegex(ValueError, 'got 3 flags for 2 cells'):
            simulator.Simulate(_Uniform(2), 4, recompute=[True] * 3)

    def testRejectsNegativeCosts(self):
        with self.assertRaisesRegex(ValueError, r'got backward\[1\] = -2'):
            simulator.CellCosts(forward=[1, 1], backward=[1, -2])
        with self.assertRaisesRegex(ValueError, 'got transfer = -0.5'):
            _Uniform(2, transfer=-0.5)
        with self.assertRaisesRegex(ValueError, 'got 0 and 2.0'):
            simulator.CostsFromFlops([1e9], 0, backward_factor=2.0)

    def testRejectsNoMicroBatches(self):
        with self.assertRaisesRegex(ValueError, 'must be >= 1, got 0 and 2'):
            simulator.Simulate(_Uniform(2), 0, recompute=False)
        with self.assertRaisesRegex(ValueError, 'must be >= 1, got 0 and 4'):
            simulator.IdealUtilisation(0, 4)


if __name__ == '__main__':
    absltest.main()
