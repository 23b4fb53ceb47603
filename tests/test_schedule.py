"""Pipeline schedules: per-device action lists, their validation, memory and bubbles."""

import fractions

import pytest
import tensorflow as tf
from absl.testing import parameterized

from gpipe_tf.pipeline import schedule
from gpipe_tf.pipeline.schedule import Action

pytestmark = pytest.mark.unit

_DEVICE_COUNTS = (1, 2, 3, 4, 8)
_MICRO_BATCH_COUNTS = (1, 2, 4, 5, 8, 32)
# Unit costs of the bubble simulation: a backward twice a forward, split into equal I and W.
_COSTS = {'F': 1, 'B': 2, 'I': 1, 'W': 1}
# The executor's, re-materializing: B and I re-run the forward first; W runs none.
_REMAT_COSTS = {'F': 1, 'B': 3, 'I': 2, 'W': 1}


def _GridCases():
    """(kind, K, M, v) for every kind over the grid, leaving out what the kind rejects."""
    cases = []
    for k in _DEVICE_COUNTS:
        for m in _MICRO_BATCH_COUNTS:
            cases += [('gpipe', k, m, 1), ('gpipe', k, m, 2), ('1f1b', k, m, 1),
                      ('zero_bubble', k, m, 1), ('zero_bubble_v', k, m, 2)]
            if m % k == 0:
                cases += [('interleaved_1f1b', k, m, 2), ('interleaved_1f1b', k, m, 3)]
    return cases


def _Grid(*kinds):
    return [case for case in _GridCases() if case[0] in kinds]


_SPLIT_KINDS = ('zero_bubble', 'zero_bubble_v')


def _Device(kind, stage, k):
    """Stage's device, written out here: in a V for zero_bubble_v (stage s on device s, then
    back from device K-1 to 0), else s % K."""
    if kind == 'zero_bubble_v':
        return stage if stage < k else 2 * k - 1 - stage
    return stage % k


def _OneStagePerDevice(*devices):
    """Hand-written lists where device d runs stage d: 'F0 F1 B0' is F, F, B of micro-batches
    0, 1 and 0."""
    return tuple(tuple(Action(token[0], d, int(token[1:])) for token in text.split())
                 for d, text in enumerate(devices))


def _Needs(action, num_stages, split):
    """What an action waits for, written out here rather than taken from the module: a forward
    the previous stage's forward; a backward (B or I) its own forward and the next stage's
    backward (I where backwards are split); a W its I."""
    kind, s, m = action
    if kind == 'F':
        return [('F', s - 1, m)] if s > 0 else []
    if kind == 'W':
        return [('I', s, m)]
    return [('F', s, m)] + ([('I' if split else 'B', s + 1, m)] if s + 1 < num_stages else [])


def _Makespan(sched, costs=None):
    """An event simulation: walking `sched.order`, each action starts when its device is free
    and what it needs has finished, and costs `costs` (default `_COSTS`) divided by v (a
    stage's share of a device's work). Exact, in fractions."""
    costs = costs or _COSTS
    v = sched.virtual_stages
    free = [fractions.Fraction(0)] * sched.num_devices
    end = {}
    for a in sched.order:
        device = _Device(sched.kind, a.stage, sched.num_devices)
        start = max([free[device]] +
                    [end[dep] for dep in _Needs(a, sched.num_stages, sched.splits_backward)])
        end[tuple(a)] = free[device] = start + fractions.Fraction(costs[a.kind], v)
    return max(free)


def _IdleTime(sched):
    """Idle time of each device: every device has 3M units of work (F + B, or F + I + W, per
    micro-batch, over v stages costing 1/v each)."""
    return _Makespan(sched) - 3 * sched.num_micro_batches


def _TotalIdleTime(sched, costs):
    """Idle time of all devices together under `costs`."""
    work = sum(fractions.Fraction(costs[a.kind], sched.virtual_stages)
               for device in sched.actions for a in device)
    return sched.num_devices * _Makespan(sched, costs) - work


def _ZeroBubbleV(k, m, rematerializing):
    """zero_bubble_v's schedule for stages that all re-materialize, or none."""
    return schedule.Make('zero_bubble_v', k, m, 2, recomputes=[rematerializing] * (2 * k))


# Per mode, whether its stages re-materialize, and the executor's costs then.
_MODES = {'always': (True, _REMAT_COSTS), 'never': (False, _COSTS)}


class MakeTest(tf.test.TestCase, parameterized.TestCase):
    """Every kind over a grid of K and M: what each device runs, and in what order."""

    @parameterized.parameters(*_GridCases())
    def testEveryStageRunsEachMicroBatchsForwardAndBackwardOnceOnItsDevice(self, kind, k, m, v):
        sched = schedule.Make(kind, k, m, v)
        backward_kinds = ('I', 'W') if kind in _SPLIT_KINDS else ('B',)
        expected = [(kind_, s, mb) for s in range(v * k) for mb in range(m)
                    for kind_ in ('F',) + backward_kinds]
        ran = [(tuple(a), d) for d, device in enumerate(sched.actions) for a in device]
        self.assertCountEqual([a for a, _ in ran], expected)
        for (_, stage, _), device in ran:
            self.assertEqual(device, _Device(kind, stage, k))
            self.assertEqual(sched.DeviceOf(stage), device)

    @parameterized.parameters(*_GridCases())
    def testOrderRunsEveryActionOnceAfterWhatItNeedsAndInEachDevicesOrder(self, kind, k, m, v):
        sched = schedule.Make(kind, k, m, v)
        position = {tuple(a): i for i, a in enumerate(sched.order)}
        self.assertLen(position, len(sched.order))
        self.assertCountEqual(sched.order, [a for device in sched.actions for a in device])
        for a in sched.order:
            for dep in _Needs(a, v * k, kind in _SPLIT_KINDS):
                self.assertLess(position[dep], position[tuple(a)], f'{a} runs before {dep}')
        for device in sched.actions:
            on_device = set(device)
            self.assertEqual([a for a in sched.order if a in on_device], list(device))

    @parameterized.parameters(*_GridCases())
    def testForwardOnlyKeepsTheTrainingForwardsInOrder(self, kind, k, m, v):
        training = schedule.Make(kind, k, m, v)
        inference = schedule.Make(kind, k, m, v, training=False)
        self.assertEqual(inference.actions,
                         tuple(tuple(a for a in device if a.kind == 'F')
                               for device in training.actions))
        self.assertFalse(inference.training)
        self.assertTrue(training.training)
        self.assertTrue(inference.forward_first)
        self.assertFalse(inference.splits_backward)

    def testGPipeRunsEveryForwardThenEveryBackward(self):
        self.assertEqual(schedule.Make('gpipe', 2, 3).actions,
                         _OneStagePerDevice('F0 F1 F2 B0 B1 B2', 'F0 F1 F2 B0 B1 B2'))

    def testGPipeRunsADevicesStagesInTurnAndTheLastStagesBackwardFirst(self):
        self.assertEqual(schedule.Make('gpipe', 2, 2, 2).actions, (
            (Action('F', 0, 0), Action('F', 0, 1), Action('F', 2, 0), Action('F', 2, 1),
             Action('B', 2, 0), Action('B', 2, 1), Action('B', 0, 0), Action('B', 0, 1)),
            (Action('F', 1, 0), Action('F', 1, 1), Action('F', 3, 0), Action('F', 3, 1),
             Action('B', 3, 0), Action('B', 3, 1), Action('B', 1, 0), Action('B', 1, 1))))

    def testOneFOneBWarmsUpKMinusOneMinusDThenAlternatesThenDrains(self):
        # Device d: K-1-d forwards, then F and B in turn, then the backwards left.
        self.assertEqual(schedule.Make('1f1b', 3, 4).actions,
                         _OneStagePerDevice('F0 F1 F2 B0 F3 B1 B2 B3',
                                            'F0 F1 B0 F2 B1 F3 B2 B3',
                                            'F0 B0 F1 B1 F2 B2 F3 B3'))

    def testOneFOneBWarmUpIsCutAtM(self):
        # K=4, M=2: devices 0 and 1 would warm up with 3 and 2 forwards; there are only 2.
        self.assertEqual(schedule.Make('1f1b', 4, 2).actions,
                         _OneStagePerDevice('F0 F1 B0 B1', 'F0 F1 B0 B1', 'F0 F1 B0 B1',
                                            'F0 B0 F1 B1'))

    def testInterleavedWalksMicroBatchGroupsThroughTheChunks(self):
        # K=2, M=2, v=2: forwards go chunk 0 then chunk 1 per group of K micro-batches, backwards
        # chunk 1 then chunk 0; device d warms up with 2 (K-1-d) + (v-1) K forwards (4 and 2).
        self.assertEqual(schedule.Make('interleaved_1f1b', 2, 2, 2).actions, (
            (Action('F', 0, 0), Action('F', 0, 1), Action('F', 2, 0), Action('F', 2, 1),
             Action('B', 2, 0), Action('B', 2, 1), Action('B', 0, 0), Action('B', 0, 1)),
            (Action('F', 1, 0), Action('F', 1, 1), Action('F', 3, 0), Action('B', 3, 0),
             Action('F', 3, 1), Action('B', 3, 1), Action('B', 1, 0), Action('B', 1, 1))))

    def testInterleavedWithOneVirtualStageIsOneFOneB(self):
        self.assertEqual(schedule.Make('interleaved_1f1b', 3, 5, 1).actions,
                         schedule.Make('1f1b', 3, 5).actions)

    def testZeroBubbleFillsTheWaitsWithWeightGradients(self):
        # K=2, M=2 by hand, unit costs. t=0: d0 F0. t=1: d0 F1, d1 F0. t=2: d1 I0 (d0 waits
        # for it). t=3: d0 I0, d1 F1. t=4: d0 W0 (I1 waits on d1), d1 I1. t=5: d0 I1, d1 W0.
        # t=6: d0 W1, d1 W1.
        self.assertEqual(schedule.Make('zero_bubble', 2, 2).actions,
                         _OneStagePerDevice('F0 F1 I0 W0 I1 W1', 'F0 I0 F1 I1 W0 W1'))

    @parameterized.parameters(*_Grid('zero_bubble'))
    def testZeroBubbleKeepsOneFOneBsOrderOfForwardsAndInputGradients(self, kind, k, m, v):
        zero_bubble = schedule.Make(kind, k, m, v)
        one_f_one_b = schedule.Make('1f1b', k, m)
        self.assertEqual(
            [[(a.kind, a.micro_batch) for a in device if a.kind != 'W']
             for device in zero_bubble.actions],
            [[('I' if a.kind == 'B' else 'F', a.micro_batch) for a in device]
             for device in one_f_one_b.actions])

    @parameterized.parameters(*_GridCases())
    def testForwardFirstMeansNoBackwardBeforeADevicesLastForward(self, kind, k, m, v):
        sched = schedule.Make(kind, k, m, v)
        expected = all(
            all(a.kind == 'F' for a in device[:max(i for i, a in enumerate(device)
                                                   if a.kind == 'F')])
            for device in sched.actions)
        self.assertEqual(sched.forward_first, expected)
        if kind == 'gpipe':
            self.assertTrue(sched.forward_first)
        elif k >= 2 and m >= 2:
            self.assertFalse(sched.forward_first)

    @parameterized.parameters(*_GridCases())
    def testOnlyZeroBubbleSplitsTheBackward(self, kind, k, m, v):
        self.assertEqual(schedule.Make(kind, k, m, v).splits_backward, kind in _SPLIT_KINDS)

    @parameterized.parameters(*_Grid('zero_bubble_v'))
    def testZeroBubbleVRunsTheStagesOfAVOnEachDevice(self, kind, k, m, v):
        sched = schedule.Make(kind, k, m, v)
        self.assertEqual(sched.placement, 'v')
        for d, device in enumerate(sched.actions):
            self.assertEqual({a.stage for a in device}, {d, 2 * k - 1 - d})

    @parameterized.parameters(1, 3)
    def testZeroBubbleVNeedsTwoVirtualStages(self, v):
        with self.assertRaisesRegex(schedule.ScheduleError, 'zero_bubble_v runs two stages per '
                                    f'device, in a V: virtual_stages must be 2, got {v}'):
            schedule.Make('zero_bubble_v', 2, 4, v)

    @parameterized.parameters((2, 5), (3, 4), (4, 2), (8, 12))
    def testInterleavedRejectsMNotAMultipleOfK(self, k, m):
        with self.assertRaisesRegex(schedule.ScheduleError,
                                    rf'M \({m}\) must be a multiple of K \({k}\)'):
            schedule.Make('interleaved_1f1b', k, m, 2)

    @parameterized.parameters(('gpipe', 0, 2, 1, 'got 0, 2 and 1'),
                              ('1f1b', 2, 0, 1, 'got 2, 0 and 1'),
                              ('interleaved_1f1b', 2, 2, 0, 'got 2, 2 and 0'),
                              ('zero_bubble', -1, 4, 1, 'got -1, 4 and 1'))
    def testRejectsCountsBelowOne(self, kind, k, m, v, values):
        with self.assertRaisesRegex(schedule.ScheduleError, 'must be >= 1, ' + values):
            schedule.Make(kind, k, m, v)

    def testRejectsUnknownKinds(self):
        with self.assertRaisesRegex(schedule.ScheduleError,
                                    "must be one of .*'zero_bubble'.*got 'pipedream'"):
            schedule.Make('pipedream', 2, 4)

    @parameterized.parameters('1f1b', 'zero_bubble')
    def testRejectsVirtualStagesWithoutInterleaving(self, kind):
        with self.assertRaisesRegex(schedule.ScheduleError,
                                    f"virtual_stages > 1 .*got '{kind}' with virtual_stages=2"):
            schedule.Make(kind, 2, 4, 2)


class KindTableTest(tf.test.TestCase, parameterized.TestCase):
    """The table of kinds (`schedule.SCHEDULE_KINDS`) against what the lists it makes do."""

    def testKindsAreTheTablesNamesInItsOrder(self):
        self.assertEqual(schedule.KINDS,
                         ('gpipe', '1f1b', 'interleaved_1f1b', 'zero_bubble', 'zero_bubble_v'))
        self.assertEqual(tuple(k.name for k in schedule.SCHEDULE_KINDS.values()), schedule.KINDS)
        for name in schedule.KINDS:
            self.assertIs(schedule.Kind(name), schedule.SCHEDULE_KINDS[name])

    def testKindNamesTheKindsForAnUnknownName(self):
        with self.assertRaisesRegex(schedule.ScheduleError,
                                    "must be one of .*'zero_bubble_v'.*got 'pipedream'"):
            schedule.Kind('pipedream')

    @parameterized.parameters(*_GridCases())
    def testMakeValidatesTheKindsOwnLists(self, kind, k, m, v):
        sched = schedule.Make(kind, k, m, v)
        made = schedule.Kind(kind).make(k, m, v, (True,) * (v * k))
        self.assertEqual(sched.actions, tuple(tuple(Action(*a) for a in d) for d in made))
        self.assertEqual(sched.kind, kind)

    @parameterized.parameters(*_GridCases())
    def testSplitsBackwardExactlyWhereTheListsHoldInputAndWeightGradients(self, kind, k, m, v):
        kinds = {a.kind for device in schedule.Make(kind, k, m, v).actions for a in device}
        split = bool(kinds & {'I', 'W'})
        self.assertEqual(split, 'B' not in kinds)
        self.assertEqual(schedule.Kind(kind).splits_backward, split)
        self.assertEqual(split, kind in _SPLIT_KINDS)

    @parameterized.parameters(*[case for case in _GridCases() if case[1] >= 2 and case[2] >= 2])
    def testLossInsideExactlyWhereADeviceStartsABackwardBeforeItsLastForward(self, kind, k, m,
                                                                              v):
        early = False
        for device in schedule.Make(kind, k, m, v).actions:
            last_forward = max(i for i, a in enumerate(device) if a.kind == 'F')
            early = early or any(a.kind != 'F' for a in device[:last_forward])
        self.assertEqual(schedule.Kind(kind).loss_inside_pipeline, early)
        self.assertEqual(early, kind != 'gpipe')

    @parameterized.parameters(*_GridCases())
    def testPlacementIsWhereTheListsRunEachStage(self, kind, k, m, v):
        placement = schedule.Kind(kind).placement
        self.assertIn(placement, schedule.PLACEMENTS)
        self.assertEqual(schedule.Placement(kind), placement)
        for d, device in enumerate(schedule.Make(kind, k, m, v).actions):
            for a in device:
                # Written out: in a V, stage s on device s, then back from K-1 to 0.
                expected = (a.stage % k if placement == 'round' else
                            a.stage if a.stage < k else 2 * k - 1 - a.stage)
                self.assertEqual(d, expected, a)
        self.assertEqual(placement == 'v', kind == 'zero_bubble_v')

    @parameterized.parameters(*schedule.KINDS)
    def testTakesExactlyTheVirtualStagesTheTableAllows(self, kind):
        allowed = schedule.Kind(kind).virtual_stages
        for v in (1, 2, 3, 4):
            takes = allowed is None or allowed == v
            if takes:
                self.assertEqual(schedule.Make(kind, 2, 4, v).virtual_stages, v)
            else:
                with self.assertRaisesRegex(schedule.ScheduleError, f'virtual_stages.*{v}'):
                    schedule.Make(kind, 2, 4, v)
        searched = schedule.Kind(kind).searched_virtual_stages
        self.assertEqual(schedule.Make(kind, 2, 4, searched).virtual_stages, searched)
        self.assertEqual(searched, 2 if kind in ('interleaved_1f1b', 'zero_bubble_v') else 1)

    def testAClosedFormBubbleForEveryKindButTheSplitOnes(self):
        for kind in schedule.KINDS:
            closed = schedule.Kind(kind).ideal_bubble is not None
            self.assertEqual(closed, kind not in _SPLIT_KINDS, kind)
            if not closed:
                with self.assertRaisesRegex(schedule.ScheduleError, 'no closed-form bubble'):
                    schedule.IdealBubble(kind, 4, 8)

    def testTheHelpNamesEveryKind(self):
        text = schedule.KindsHelp()
        for kind in schedule.KINDS:
            self.assertIn(f'{kind} (', text)


class ValidateTest(tf.test.TestCase, parameterized.TestCase):
    """`FromLists` rejects what cannot run, naming the action."""

    def testAcceptsAValidCustomScheduleAndOrdersIt(self):
        sched = schedule.FromLists([[('F', 0, 0), ('B', 0, 0)], [('F', 1, 0), ('B', 1, 0)]], 1)
        self.assertEqual(sched.kind, 'custom')
        self.assertEqual(sched.order, (Action('F', 0, 0), Action('F', 1, 0), Action('B', 1, 0),
                                       Action('B', 0, 0)))

    def testAcceptsOneStageSplittingItsBackwardWhileTheNextDoesNot(self):
        sched = schedule.FromLists(_OneStagePerDevice('F0 I0 W0', 'F0 B0'), 1)
        self.assertEqual(sched.order, (Action('F', 0, 0), Action('F', 1, 0), Action('B', 1, 0),
                                       Action('I', 0, 0), Action('W', 0, 0)))

    @parameterized.named_parameters(
        ('MissingForward', ('F0 B0', 'B0'),
         r'F\(stage 1, micro-batch 0\) is missing from device 1'),
        ('MissingBackward', ('F0', 'F0 B0'),
         r'B\(stage 0, micro-batch 0\) is missing from device 0'),
        ('RepeatedAction', ('F0 F0 B0', 'F0 B0'),
         r'F\(stage 0, micro-batch 0\) appears twice \(devices 0 and 0\)'),
        ('MicroBatchOutOfRange', ('F0 B0 F1', 'F0 B0'),
         r'device 0: F\(stage 0, micro-batch 1\) is out of range: 2 stages, 1 micro-batches'),
        ('InputGradientWithoutWeightGradient', ('F0 I0', 'F0 B0'),
         r'W\(stage 0, micro-batch 0\) is missing: stage 0 splits'),
        ('WeightGradientWithoutInputGradient', ('F0 W0', 'F0 B0'),
         r'I\(stage 0, micro-batch 0\) is missing: stage 0 splits'),
        ('BackwardBesideItsSplit', ('F0 I0 W0 B0', 'F0 B0'),
         r'B\(stage 0, micro-batch 0\) repeats the I and W of the same micro-batch'),
    )
    def testRejectsOneStagePerDeviceLists(self, devices, message):
        with self.assertRaisesRegex(schedule.ScheduleError, message):
            schedule.FromLists(_OneStagePerDevice(*devices), 1)

    def testRejectsAnActionOnTheWrongDevice(self):
        lists = [[('F', 0, 0), ('F', 1, 0), ('B', 0, 0)], [('B', 1, 0)]]
        with self.assertRaisesRegex(
                schedule.ScheduleError,
                r'F\(stage 1, micro-batch 0\) is on device 0; stage 1 runs on device 1'):
            schedule.FromLists(lists, 1)

    def testAVPlacesTheSecondArmBackwards(self):
        # K=2, v=2 in a V: stages 0 and 3 on device 0, 1 and 2 on device 1.
        v_lists = [[('F', 0, 0), ('F', 3, 0), ('B', 3, 0), ('B', 0, 0)],
                   [('F', 1, 0), ('F', 2, 0), ('B', 2, 0), ('B', 1, 0)]]
        sched = schedule.FromLists(v_lists, 1, 2, placement='v')
        self.assertEqual([sched.DeviceOf(s) for s in range(4)], [0, 1, 1, 0])
        with self.assertRaisesRegex(schedule.ScheduleError, r'F\(stage 3, micro-batch 0\) is on '
                                    r'device 0; stage 3 runs on device 1'):
            schedule.FromLists(v_lists, 1, 2)  # Round: stage s on device s % 2.
        with self.assertRaisesRegex(schedule.ScheduleError, 'virtual_stages must be 2, got 1'):
            schedule.FromLists([[('F', 0, 0), ('B', 0, 0)]], 1, 1, placement='v')
        with self.assertRaisesRegex(schedule.ScheduleError, "placement must be one of .*'zigzag'"):
            schedule.FromLists(v_lists, 1, 2, placement='zigzag')

    def testRejectsAStageOutOfRange(self):
        lists = [[('F', 0, 0), ('B', 0, 0), ('F', 2, 0)], [('F', 1, 0), ('B', 1, 0)]]
        with self.assertRaisesRegex(
                schedule.ScheduleError,
                r'device 0: F\(stage 2, micro-batch 0\) is out of range: 2 stages'):
            schedule.FromLists(lists, 1)

    def testRejectsAnUnknownActionKind(self):
        with self.assertRaisesRegex(schedule.ScheduleError,
                                    r'X\(stage 0, micro-batch 0\) has an unknown kind'):
            schedule.FromLists([[('F', 0, 0), ('X', 0, 0)]], 1)

    def testRejectsADeadlockNamingTheWaitingActions(self):
        # Device 0 waits at B0 for device 1's B0, which runs after F1, which waits for
        # device 0's F1, which runs after B0.
        lists = _OneStagePerDevice('F0 B0 F1 B1', 'F1 F0 B0 B1')
        with self.assertRaisesRegex(
                schedule.ScheduleError,
                r'the schedule deadlocks: '
                r'device 0 waits at B\(stage 0, micro-batch 0\) for B\(stage 1, micro-batch 0\); '
                r'device 1 waits at F\(stage 1, micro-batch 1\) for F\(stage 0, micro-batch 1\)'):
            schedule.FromLists(lists, 2)

    def testADeadlockOfSplitBackwardsNamesTheInputGradientWaitedFor(self):
        lists = _OneStagePerDevice('F0 I0 F1 I1 W0 W1', 'F1 F0 I0 W0 I1 W1')
        with self.assertRaisesRegex(
                schedule.ScheduleError,
                r'device 0 waits at I\(stage 0, micro-batch 0\) for I\(stage 1, micro-batch 0\); '
                r'device 1 waits at F\(stage 1, micro-batch 1\) for F\(stage 0, micro-batch 1\)'):
            schedule.FromLists(lists, 2)

    def testRejectsADeadlockOnOneDevice(self):
        with self.assertRaisesRegex(
                schedule.ScheduleError,
                r'deadlocks: device 0 waits at B\(stage 0, micro-batch 0\) for '
                r'F\(stage 0, micro-batch 0\)'):
            schedule.FromLists(_OneStagePerDevice('B0 F0'), 1)

    def testRejectsNoDevicesAndNoMicroBatches(self):
        with self.assertRaisesRegex(schedule.ScheduleError, 'must be >= 1, got 0, 1 and 1'):
            schedule.FromLists([], 1)
        with self.assertRaisesRegex(schedule.ScheduleError, 'must be >= 1, got 1, 0 and 1'):
            schedule.FromLists([[]], 0)


class StoredMicroBatchesTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.parameters(*_Grid('gpipe'))
    def testGPipeStoresEveryMicroBatchOnEveryStage(self, kind, k, m, v):
        self.assertEqual(schedule.StoredMicroBatches(schedule.Make(kind, k, m, v)), [m] * (v * k))

    @parameterized.parameters(*_Grid('1f1b'))
    def testOneFOneBStoresKMinusStageMicroBatchesAtMost(self, kind, k, m, v):
        self.assertEqual(schedule.StoredMicroBatches(schedule.Make(kind, k, m, v)),
                         [min(k - stage, m) for stage in range(k)])

    @parameterized.parameters(*_Grid('zero_bubble_v'))
    def testZeroBubbleVStoresAtMostTwoKMicroBatchesPerStage(self, kind, k, m, v):
        self.assertLessEqual(max(schedule.StoredMicroBatches(schedule.Make(kind, k, m, v))),
                             min(m, 2 * k))

    @parameterized.parameters(*_Grid('zero_bubble'))
    def testZeroBubbleStoresNoMoreThanKMicroBatches(self, kind, k, m, v):
        stored = schedule.StoredMicroBatches(schedule.Make(kind, k, m, v))
        self.assertLen(stored, k)
        self.assertLessEqual(max(stored), min(k, m))

    def testStoredCountsRiseAtForwardsAndFallAtBackwards(self):
        # Stage 0 holds micro-batches 0, 1 and 2 before its first backward; stage 1 two.
        sched = schedule.FromLists(_OneStagePerDevice('F0 F1 F2 B0 B1 B2', 'F0 F1 B0 F2 B1 B2'), 3)
        self.assertEqual(schedule.StoredMicroBatches(sched), [3, 2])

    def testASplitBackwardFreesAtItsWeightGradient(self):
        sched = schedule.FromLists(_OneStagePerDevice('F0 I0 F1 W0 I1 W1', 'F0 I0 F1 I1 W0 W1'),
                                   2)
        self.assertEqual(schedule.StoredMicroBatches(sched), [2, 2])


class BubbleTest(tf.test.TestCase, parameterized.TestCase):
    """Bubbles of the built lists, by the event simulation above, against the closed forms."""

    def testTheSimulationOfOneFOneBByHand(self):
        # K=2, M=1: F on device 0 (0-1), F on device 1 (1-2), B on device 1 (2-4), B on
        # device 0 (4-6).
        self.assertEqual(_Makespan(schedule.Make('1f1b', 2, 1)), 6)

    @parameterized.parameters(*[case for case in _Grid('gpipe', '1f1b') if case[3] == 1])
    def testGPipeAndOneFOneBIdleKMinusOneOverMPlusKMinusOne(self, kind, k, m, v):
        sched = schedule.Make(kind, k, m, v)
        makespan = _Makespan(sched)
        self.assertEqual(_IdleTime(sched) / makespan, fractions.Fraction(k - 1, m + k - 1))
        self.assertAlmostEqual(schedule.IdealBubble(kind, k, m), float((k - 1) / (m + k - 1)))
        self.assertAlmostEqual(schedule.IdealBubble(kind, k, m),
                               float(_IdleTime(sched) / makespan), delta=1e-12)

    @parameterized.parameters(*_Grid('interleaved_1f1b'))
    def testInterleavedIdlesKMinusOneOverVMPlusKMinusOne(self, kind, k, m, v):
        sched = schedule.Make(kind, k, m, v)
        bubble = _IdleTime(sched) / _Makespan(sched)
        self.assertEqual(bubble, fractions.Fraction(k - 1, v * m + k - 1))
        self.assertAlmostEqual(schedule.IdealBubble(kind, k, m, v), float(bubble), delta=1e-12)

    @parameterized.parameters(*[case for case in _Grid('zero_bubble')
                                if case[1] >= 2 and case[2] >= case[1]])
    def testZeroBubbleIdlesAThirdOfOneFOneBWhenMIsAtLeastK(self, kind, k, m, v):
        zero_bubble = _IdleTime(schedule.Make(kind, k, m, v))
        one_f_one_b = _IdleTime(schedule.Make('1f1b', k, m))
        self.assertEqual(one_f_one_b, 3 * (k - 1))
        self.assertAlmostEqual(float(zero_bubble / one_f_one_b), 1 / 3, delta=1e-9)

    @parameterized.parameters(*_Grid('zero_bubble'))
    def testZeroBubbleNeverIdlesMoreThanOneFOneB(self, kind, k, m, v):
        self.assertLessEqual(_IdleTime(schedule.Make(kind, k, m, v)),
                             _IdleTime(schedule.Make('1f1b', k, m)))

    @parameterized.parameters(*[(mode, k, m) for mode in _MODES for k in range(1, 9)
                                for m in range(1, 33)])
    def testZeroBubbleVIdlesNoMoreThanOneFOneBUnderTheExecutorsCosts(self, mode, k, m):
        rematerializing, costs = _MODES[mode]
        self.assertLessEqual(_TotalIdleTime(_ZeroBubbleV(k, m, rematerializing), costs),
                             _TotalIdleTime(schedule.Make('1f1b', k, m), costs))

    @parameterized.parameters(*[(k, m) for k in range(1, 9) for m in range(k, 33)])
    def testZeroBubbleVIdlesNoMoreThanZeroBubbleWithoutReMaterialization(self, k, m):
        self.assertLessEqual(_TotalIdleTime(_ZeroBubbleV(k, m, False), _COSTS),
                             _TotalIdleTime(schedule.Make('zero_bubble', k, m), _COSTS))

    def testReMaterializingZeroBubbleVIdlesUnderHalfOfZeroBubbleOverMAtLeastK(self):
        # At a few M near 2K (K=7, M=16; K=8, M=18) it idles up to 11% more than zero_bubble.
        cases = [(k, m) for k in range(1, 9) for m in range(k, 33)]
        self.assertLess(2 * sum(_TotalIdleTime(_ZeroBubbleV(k, m, True), _REMAT_COSTS)
                                for k, m in cases),
                        sum(_TotalIdleTime(schedule.Make('zero_bubble', k, m), _REMAT_COSTS)
                            for k, m in cases))

    @parameterized.parameters(*[(mode, k) for mode in _MODES for k in (2, 4, 8)])
    def testZeroBubbleVIdlesAThirdOrHalfOfZeroBubbleAtM32(self, mode, k):
        rematerializing, costs = _MODES[mode]
        share = 3 if rematerializing else 2
        self.assertLessEqual(share * _TotalIdleTime(_ZeroBubbleV(k, 32, rematerializing), costs),
                             _TotalIdleTime(schedule.Make('zero_bubble', k, 32), costs))

    @parameterized.parameters(*[(mode, k, m) for mode in _MODES for k in (2, 4, 8)
                                for m in (16, 32)])
    def testZeroBubbleVIsOrderedForItsModesCosts(self, mode, k, m):
        rematerializing, costs = _MODES[mode]
        own = _TotalIdleTime(_ZeroBubbleV(k, m, rematerializing), costs)
        other = _TotalIdleTime(_ZeroBubbleV(k, m, not rematerializing), costs)
        if (k, m) == (8, 32):  # Elsewhere the two lists tie at some counts.
            self.assertLess(own, other)
        self.assertLessEqual(own, other)

    def testAStageThatKeepsItsActivationsChangesZeroBubbleVsOrder(self):
        # 'except_last': the last stage's I runs no forward, so it is ready sooner.
        except_last = schedule.Make('zero_bubble_v', 4, 16, 2, recomputes=[True] * 7 + [False])
        self.assertNotEqual(except_last.actions, schedule.Make('zero_bubble_v', 4, 16, 2).actions)

    def testMakeRejectsRecomputesNotOfOneFlagPerStage(self):
        with self.assertRaisesRegex(schedule.ScheduleError,
                                    r'one flag per stage, 8 \(K=4 x v=2\), got 4'):
            schedule.Make('zero_bubble_v', 4, 16, 2, recomputes=[True] * 4)

    def testZeroBubbleHasNoClosedForm(self):
        with self.assertRaisesRegex(schedule.ScheduleError, "no closed-form bubble.*'zero_bubble'"):
            schedule.IdealBubble('zero_bubble', 4, 8)

    def testIdealBubbleRejectsCountsBelowOne(self):
        with self.assertRaisesRegex(schedule.ScheduleError, 'must be >= 1, got 4, 0 and 1'):
            schedule.IdealBubble('1f1b', 4, 0)

    @parameterized.parameters((2, 1, 0.50), (2, 4, 0.20), (2, 32, 0.03), (4, 1, 0.75),
                              (4, 4, 0.43), (4, 32, 0.09), (8, 1, 0.875), (8, 4, 0.64),
                              (8, 32, 0.18))
    def testBubbleFractionMatchesThePapersTable(self, k, m, expected):
        self.assertAlmostEqual(schedule.BubbleFraction(m, k), expected, delta=0.005)


if __name__ == '__main__':
    tf.test.main()
