"""The looped executor's clock (`pipeline/ticks.py`): ticks, their lanes, and the switch tables
that replay them."""

import pytest
import tensorflow as tf
from absl.testing import parameterized

from gpipe_tf.pipeline import schedule
from gpipe_tf.pipeline import ticks

pytestmark = pytest.mark.unit


class TicksTest(tf.test.TestCase, parameterized.TestCase):
    """The clock a looped executor runs: per tick and device, at most one action per lane."""

    def assertTicksRunEachDevicesListInOrder(self, sched, kinds):
        clock = ticks.Ticks(sched, kinds)
        tick_of = {}
        for t, tick in enumerate(clock):
            self.assertLen(tick, sched.num_devices)
            for d, actions in enumerate(tick):
                lanes = [ticks.Lane(a) for a in actions]
                self.assertEqual(lanes, sorted(set(lanes)), msg=f'tick {t}, device {d}')
                for action in actions:
                    self.assertEqual(sched.DeviceOf(action.stage), d)
                    tick_of[action] = t
        # Each device's list, in its order (a tick's actions in lane order).
        ran = [[a for tick in clock for a in tick[d]] for d in range(sched.num_devices)]
        self.assertEqual(ran, [[a for a in device if a.kind in kinds] for device in sched.actions])
        # What each action needs, stated from `Dependencies` (not the schedule's `Needs`, which
        # `Ticks` itself walks).
        backward = 'I' if sched.splits_backward else 'B'
        for action, t in tick_of.items():
            for dep in schedule.Dependencies(action, sched.num_stages, backward):
                if dep.kind in kinds:
                    self.assertLess(tick_of[dep], t, msg=f'{action} before {dep}')
        return clock

    @parameterized.product(kind=['gpipe', '1f1b', 'zero_bubble'], k=[1, 2, 4], m=[1, 3, 8])
    def testEachDeviceRunsItsListInOrderAfterWhatEachActionNeeds(self, kind, k, m):
        sched = schedule.Make(kind, k, m)
        for kinds in (schedule.ACTION_KINDS, ('F',)):
            self.assertTicksRunEachDevicesListInOrder(sched, kinds)

    @parameterized.product(kind=['interleaved_1f1b', 'zero_bubble_v'], k=[1, 2, 3], m=[6, 12])
    def testVirtualStagesTicksRunEachDevicesListInOrder(self, kind, k, m):
        self.assertTicksRunEachDevicesListInOrder(schedule.Make(kind, k, m, 2),
                                                  schedule.ACTION_KINDS)

    def testOneLaneOfOneStageRunsOneActionATick(self):
        for kind in ('gpipe', '1f1b'):
            clock = ticks.Ticks(schedule.Make(kind, 4, 8))
            self.assertLen(clock, 2 * (8 + 4 - 1))
            self.assertTrue(all(len(actions) <= 1 for tick in clock for actions in tick))

    def testAWeightGradientSharesATickWithTheNextActionOfItsDevice(self):
        # ZB-H1's W fills the slot its device's next F or I leaves: as many ticks as 1F1B's
        # (one more at K=4, M=8), where one action per tick ran 3 M + bubble.
        sched = schedule.Make('zero_bubble', 4, 8)
        clock = self.assertTicksRunEachDevicesListInOrder(sched, schedule.ACTION_KINDS)
        self.assertLessEqual(len(clock), 2 * (8 + 4 - 1) + 1)
        shared = [actions for tick in clock for actions in tick if len(actions) == 2]
        self.assertTrue(shared)
        for w, other in shared:
            self.assertEqual(w.kind, 'W')
            self.assertIn(other.kind, ('F', 'I'))

    def testGPipeForwardClockIsTheTicksOfThePaper(self):
        # At tick t, cell k works on micro-batch t - k: M + K - 1 ticks.
        clock = ticks.Ticks(schedule.Make('gpipe', 3, 4), ('F',))
        self.assertLen(clock, 4 + 3 - 1)
        for t, tick in enumerate(clock):
            for k, actions in enumerate(tick):
                if 0 <= t - k < 4:
                    self.assertEqual(actions, (schedule.Action('F', k, t - k),))
                else:
                    self.assertEqual(actions, ())


class SwitchesTest(tf.test.TestCase, parameterized.TestCase):
    """Per device and lane, a switch's branches and per-tick tables: replayed, they give back
    each tick's actions."""

    @parameterized.parameters(('gpipe', 4, 8, 1), ('1f1b', 3, 5, 1), ('zero_bubble', 4, 8, 1),
                              ('interleaved_1f1b', 2, 4, 2), ('zero_bubble_v', 3, 6, 2))
    def testReplayingTheTablesGivesBackEachTicksActions(self, kind, k, m, v):
        sched = schedule.Make(kind, k, m, v)
        clock = ticks.Ticks(sched)
        switches = ticks.Switches(clock, k)
        self.assertLen(switches, k)
        for d, device in enumerate(switches):
            for switch in device:
                self.assertLen(switch.index, len(clock))
                self.assertLen(switch.micro_batches, len(clock))
            for t, tick in enumerate(clock):
                # What the device's switches run at tick t, in the order they run.
                ran = tuple(
                    schedule.Action(*switch.branches[switch.index[t] - 1],
                                    switch.micro_batches[t])
                    for switch in device if switch.index[t])
                self.assertEqual(ran, tick[d], msg=f'device {d}, tick {t}')

    def testASwitchPerLaneInLaneOrderEachWithTheLanesActionsOnly(self):
        # ZB-H1 at K=2: each device runs its stage's W lane, then its F and I lane.
        switches = ticks.Switches(ticks.Ticks(schedule.Make('zero_bubble', 2, 4)), 2)
        for d, device in enumerate(switches):
            self.assertEqual([switch.lane for switch in device], [(d, False), (d, True)])
            self.assertEqual(device[0].branches, (('W', d),))
            self.assertEqual(device[1].branches, (('F', d), ('I', d)))

    def testADeviceThatRunsNothingHasNoSwitch(self):
        clock = [[(schedule.Action('F', 0, 0),), ()], [(), (schedule.Action('F', 1, 0),)]]
        self.assertEqual(ticks.Switches(clock[:1], 2)[1], [])
        self.assertLen(ticks.Switches(clock, 2)[1], 1)

if __name__ == '__main__':
    tf.test.main()
