"""The schedule simulator: hand-computed timelines, and the invariants of every timeline."""

import collections

import pytest
from absl.testing import absltest
from absl.testing import parameterized

from gpipe_tf.perf import simulator
from gpipe_tf.pipeline import plan as plan_lib
from gpipe_tf.pipeline import schedule

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

    @parameterized.parameters('gpipe', '1f1b', 'zero_bubble')
    def testKeepingMoreLastCellsNeverLengthensTheStep(self, kind):
        # recompute='except_last_<j>' for j = 0 ('always') .. 4 ('never'), uneven cells.
        costs = simulator.CellCosts(forward=[1, 3, 2, 1], backward=[2, 6, 4, 2])
        steps = [simulator.Simulate(costs, 8, plan_lib.RecomputeFlags(plan_lib.KeepLast(j), 4),
                                    schedule.Make(kind, 4, 8)).makespan for j in range(5)]
        self.assertEqual(steps, sorted(steps, reverse=True))
        self.assertLess(steps[4], steps[0])
        if kind == 'gpipe':
            # By hand: the backward's critical path is cells 3 and 2 on the last micro-batch,
            # then cell 1 (the slowest) on all eight back to back, then cell 0; keeping cells
            # 2 and 3's activations spares only their re-runs on that first micro-batch.
            self.assertEqual(steps[0] - steps[2], 2 + 1)

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


def _Schedule(kind, k, m, v=1):
    return schedule.Make(kind, k, m, v)


def _Actions(timeline):
    """(kind, stage, micro-batch) -> (start, end) of each action; a recompute joins its B or I."""
    kinds = {name: kind for kind, name in simulator.ACTION_INTERVALS.items()}
    spans = {}
    recomputes = _Spans(timeline, 'recompute')
    for i in timeline.intervals:
        if i.kind != 'recompute':
            start = recomputes.get((i.cell, i.micro_batch), (i.start,))[0] if i.kind in (
                'backward', 'input_grad') else i.start
            spans[(kinds[i.kind], i.cell, i.micro_batch)] = (start, i.end)
    return spans


# (name, kind, K, M, v, costs, recompute) for the invariant tests of every schedule.
_SCHEDULE_CASES = [
    ('gpipe_v2', 'gpipe', 2, 3, 2, simulator.CellCosts([1, 2, 0.5, 1], [2, 1, 1, 3],
                                                       transfer=0.3), True),
    ('1f1b', '1f1b', 4, 6, 1, simulator.CellCosts([1, 3, 1, 2], [2, 6, 2, 1], transfer=0.5),
     [True, True, True, False]),
    ('1f1b_m_below_k', '1f1b', 4, 2, 1, _Uniform(4, transfer=0.25), False),
    ('interleaved', 'interleaved_1f1b', 2, 4, 3,
     simulator.CellCosts([1, 2, 1, 0.5, 1, 2], [2, 2, 1, 1, 3, 2], transfer=0.2), True),
    ('zero_bubble', 'zero_bubble', 3, 5, 1,
     simulator.CellCosts([1, 2, 1], [2, 3, 2], [0.5, 1, 1], transfer=0.4, weight_fraction=0.3),
     True),
    ('zero_bubble_v', 'zero_bubble_v', 2, 5, 2,
     simulator.CellCosts([1, 2, 1, 0.5], [2, 3, 2, 1], transfer=0.4, weight_fraction=0.4),
     True),
]


class SchedulesTest(parameterized.TestCase):
    """Schedules other than GPipe's: closed-form bubbles with unit costs, and invariants."""

    @parameterized.product(kind=['gpipe', '1f1b'], k_m=[(1, 3), (2, 1), (4, 8), (4, 2), (3, 7)])
    def testUnitCostsGiveTheClosedFormBubble(self, kind, k_m):
        k, m = k_m
        timeline = simulator.Simulate(_Uniform(k), m, False, _Schedule(kind, k, m))
        self.assertAlmostEqual(timeline.bubble, (k - 1) / (m + k - 1))
        self.assertAlmostEqual(timeline.utilisation, simulator.IdealUtilisation(m, k, kind))

    @parameterized.parameters((2, 4, 2), (4, 8, 2), (4, 4, 3), (3, 6, 4))
    def testInterleavedBubbleShrinksWithVirtualStages(self, k, m, v):
        # Each of the v K stages costs 1/v of a device's share (forward 1, backward 2).
        timeline = simulator.Simulate(_Uniform(v * k, f=1 / v, b=2 / v), m, False,
                                      _Schedule('interleaved_1f1b', k, m, v))
        self.assertAlmostEqual(timeline.bubble, (k - 1) / (v * m + k - 1))
        self.assertAlmostEqual(timeline.utilisation,
                               simulator.IdealUtilisation(m, k, 'interleaved_1f1b', v))

    def testInterleavedStagesAddUpOnTheirDevice(self):
        # K=2, v=2: device 0 runs stages 0 and 2, device 1 stages 1 and 3.
        costs = simulator.CellCosts([1, 2, 3, 4], [10, 20, 30, 40], [0.5, 0.5, 0.5, 0.5])
        timeline = simulator.Simulate(costs, 4, [True, True, True, False],
                                      _Schedule('interleaved_1f1b', 2, 4, 2))
        self.assertEqual(timeline.busy, [4 * (1 + 10 + 0.5 + 3 + 30 + 0.5),
                                         4 * (2 + 20 + 0.5 + 4 + 40)])
        self.assertEqual({(i.cell, i.device) for i in timeline.intervals},
                         {(0, 0), (1, 1), (2, 0), (3, 1)})

    @parameterized.parameters((2, 4), (3, 6), (4, 8), (4, 16), (8, 16))
    def testZeroBubbleIdlesAThirdOfOneFOneB(self, k, m):
        # Forward 1, backward 2 split in halves: F = I = W = 1. recompute=False models the
        # ideal split (the ZB paper's), whose I and W re-run nothing; the executor's
        # zero_bubble re-materializes every stage (see the next test).
        one_f_one_b = simulator.Simulate(_Uniform(k), m, False, _Schedule('1f1b', k, m))
        zero_bubble = simulator.Simulate(_Uniform(k), m, False, _Schedule('zero_bubble', k, m))
        self.assertEqual(one_f_one_b.idle, k * (k - 1) * 3.0)
        self.assertEqual(zero_bubble.idle, one_f_one_b.idle / 3)
        self.assertEqual(zero_bubble.busy, one_f_one_b.busy)
        self.assertEqual({i.end - i.start for i in zero_bubble.intervals}, {1.0})

    def testZeroBubbleVStagesAddUpOnTheirDeviceInAV(self):
        # K=2 in a V: device 0 runs stages 0 and 3, device 1 stages 1 and 2.
        costs = simulator.CellCosts([1, 2, 3, 4], [10, 20, 30, 40], weight_fraction=0.5)
        timeline = simulator.Simulate(costs, 4, False, _Schedule('zero_bubble_v', 2, 4, 2))
        self.assertEqual(timeline.busy, [4 * (1 + 10 + 4 + 40), 4 * (2 + 20 + 3 + 30)])
        self.assertEqual({(i.cell, i.device) for i in timeline.intervals},
                         {(0, 0), (1, 1), (2, 1), (3, 0)})

    def testTheVsTurnOnOneDeviceCostsNoTransfer(self):
        # K=2: device 1 runs F(1, 0) then F(2, 0), and I(2, 0) then I(1, 0), each pair across
        # a boundary inside the device; only boundaries between devices wait 100 s.
        costs = simulator.CellCosts([1, 1, 1, 1], [2, 2, 2, 2], transfer=100.0,
                                    weight_fraction=0.5)
        spans = _Actions(simulator.Simulate(costs, 4, False, _Schedule('zero_bubble_v', 2, 4, 2)))
        self.assertEqual(spans[('F', 1, 0)], (101.0, 102.0))
        self.assertEqual(spans[('F', 2, 0)], (102.0, 103.0))
        self.assertEqual(spans[('I', 1, 0)][0], spans[('I', 2, 0)][1])

    # At M = 32 (K = 4 and 8) zero_bubble_v's lists idle more than zero_bubble's with these
    # costs (24 against 12 at K = 4): its steady state leaves gaps that grow with M.
    @parameterized.parameters((2, 4), (4, 8), (8, 16))
    def testZeroBubbleVIdlesLessThanZeroBubbleKeepingActivations(self, k, m):
        # The paper's costs, recompute 'never': forward 1, backward 2 split in halves
        # (F = I = W = 1); each of ZB-V's 2K stages is half a device's share.
        def Costs(stages, share):
            return simulator.CellCosts([share] * stages, [2 * share] * stages,
                                       weight_fraction=0.5)
        zero_bubble_v = simulator.Simulate(Costs(2 * k, 0.5), m, False,
                                           _Schedule('zero_bubble_v', k, m, 2))
        zero_bubble = simulator.Simulate(Costs(k, 1.0), m, False, _Schedule('zero_bubble', k, m))
        self.assertLessEqual(zero_bubble_v.idle, zero_bubble.idle / 2)
        self.assertAlmostEqual(sum(zero_bubble_v.busy), sum(zero_bubble.busy))

    def testSplitBackwardCostsOfAReMaterializingStage(self):
        # I = recompute + backward (1 - weight_fraction), drawn as a recompute then an I;
        # W = backward * weight_fraction: it re-runs no forward.
        costs = simulator.CellCosts([1.0, 1.0], [4.0, 4.0], [0.5, 0.5], weight_fraction=0.25)
        timeline = simulator.Simulate(costs, 3, True, _Schedule('zero_bubble', 2, 3))
        durations = collections.defaultdict(set)
        for i in timeline.intervals:
            durations[i.kind].add(i.end - i.start)
        self.assertEqual(dict(durations), {'forward': {1.0}, 'recompute': {0.5},
                                           'input_grad': {3.0}, 'weight_grad': {1.0}})
        self.assertEqual(timeline.busy, [3 * (1 + 0.5 + 3 + 1)] * 2)
        for (cell, m), (start, _) in _Spans(timeline, 'input_grad').items():
            self.assertEqual(start, _Spans(timeline, 'recompute')[(cell, m)][1])

    @parameterized.product(kind=['gpipe', '1f1b', 'zero_bubble'],
                           k_m=[(1, 3), (2, 1), (4, 8), (3, 7)])
    def testForwardOnlyRunsTheForwardsAlone(self, kind, k_m):
        # Inference: M forwards per stage, the last one ending (M + K - 1) f after the start,
        # plus a hop per boundary; the bubble is GPipe's.
        k, m = k_m
        sched = schedule.Make(kind, k, m, training=False)
        timeline = simulator.Simulate(_Uniform(k, transfer=0.5), m, True, sched)
        self.assertCountEqual(_Actions(timeline),
                              [('F', s, b) for s in range(k) for b in range(m)])
        self.assertEqual(timeline.makespan, (m + k - 1) * 1.0 + (k - 1) * 0.5)
        self.assertAlmostEqual(timeline.bubble, 1 - m * k / (k * timeline.makespan))

    def testOneFOneBComputesTheLossPerMicroBatch(self):
        # K=2, M=2, f=1, b=2. Device 0: F0 F1 B0 B1; device 1: F0 B0 F1 B1. B(1, 0) starts
        # right after F(1, 0), not after the last forward as GPipe's does.
        timeline = simulator.Simulate(_Uniform(2), 2, False, _Schedule('1f1b', 2, 2))
        self.assertEqual(_Actions(timeline), {
            ('F', 0, 0): (0, 1), ('F', 0, 1): (1, 2), ('F', 1, 0): (1, 2),
            ('B', 1, 0): (2, 4), ('B', 0, 0): (4, 6), ('F', 1, 1): (4, 5),
            ('B', 1, 1): (5, 7), ('B', 0, 1): (7, 9)})
        self.assertEqual(timeline.makespan, 9)

    def testTheDefaultScheduleIsGPipes(self):
        costs = simulator.CellCosts([1, 3, 1], [2, 6, 2], transfer=0.5)
        self.assertEqual(simulator.Simulate(costs, 4, [True, False, True]),
                         simulator.Simulate(costs, 4, [True, False, True],
                                            _Schedule('gpipe', 3, 4)))

    @parameterized.named_parameters(*_SCHEDULE_CASES)
    def testDependenciesAndDeviceOrderHold(self, kind, k, m, v, costs, recompute):
        sched = _Schedule(kind, k, m, v)
        timeline = simulator.Simulate(costs, m, recompute, sched)
        spans, last = _Actions(timeline), costs.num_cells - 1
        self.assertCountEqual(spans, sched.order)

        def Hop(s, other):  # A boundary costs a transfer between two devices only.
            return costs.transfer if sched.DeviceOf(s) != sched.DeviceOf(other) else 0.0

        for action, (start, _) in spans.items():
            kind_, s, b = action
            if kind_ == 'F' and s > 0:
                self.assertGreaterEqual(start, spans[('F', s - 1, b)][1] + Hop(s, s - 1))
            if kind_ in 'BI':
                self.assertGreaterEqual(start, spans[('F', s, b)][1])
                if s < last:
                    self.assertGreaterEqual(start,
                                            spans[(kind_, s + 1, b)][1] + Hop(s, s + 1))
            if kind_ == 'W':
                self.assertGreaterEqual(start, spans[('I', s, b)][1])
        for device, actions in enumerate(sched.actions):
            ends = [spans[a] for a in actions]
            for (_, end), (next_start, _) in zip(ends, ends[1:]):
                self.assertLessEqual(end, next_start)
            self.assertAlmostEqual(timeline.busy[device], sum(
                i.end - i.start for i in timeline.intervals if i.device == device))
        self.assertLen(timeline.busy, k)
        self.assertEqual(timeline.makespan, max(i.end for i in timeline.intervals))

    def testIdealUtilisationOfEachKind(self):
        self.assertEqual(simulator.IdealUtilisation(8, 4, '1f1b'), 8 / 11)
        self.assertAlmostEqual(simulator.IdealUtilisation(8, 4, 'interleaved_1f1b', 2), 16 / 19)
        # ZB-H1 idles a third of 1F1B's 3 (K - 1) per device: 3 / (24 + 3).
        self.assertEqual(simulator.IdealUtilisation(8, 4, 'zero_bubble'), 24 / 27)

    def testRejectsAScheduleOfOtherCounts(self):
        with self.assertRaisesRegex(ValueError, 'schedule has 4 stages and 8 micro-batches; '
                                                'the costs have 2 stages and M is 8'):
            simulator.Simulate(_Uniform(2), 8, False, _Schedule('1f1b', 4, 8))
        with self.assertRaisesRegex(ValueError, 'weight_fraction must be in'):
            simulator.CellCosts([1], [1], weight_fraction=1.5)


if __name__ == '__main__':
    absltest.main()
