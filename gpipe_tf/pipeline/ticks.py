"""The clock a looped executor runs a schedule on: ticks, the lanes of a tick, and the switch
tables that replay them.

`Ticks` puts a schedule's per-device lists on a clock: at each tick every device runs its next
actions, one per lane (`Lane`), in its list's order, each after what it needs. `Switches` gives,
per device and lane, the branches of one `tf.switch_case` and, per tick, the branch to take and
the micro-batch to run it on: the tables `looped.LoopedSchedule` reads with each device's own
count of the ticks.
"""

from __future__ import annotations

from typing import NamedTuple

from gpipe_tf.pipeline.schedule import (ACTION_KINDS, WEIGHT_GRAD, Action, Schedule,
                                        ScheduleError)


def Lane(action: Action) -> tuple[int, bool]:
    """The lane of a looped tick that `action` runs in (`Ticks`): per stage, its W actions in
    one and its other actions in another, the W lane first."""
    return action.stage, action.kind != WEIGHT_GRAD


def Ticks(sched: Schedule, kinds=ACTION_KINDS) -> list[list[tuple[Action, ...]]]:
    """The schedule's actions of `kinds` on a clock: at each tick every device runs its next
    actions, in its list's order, while each needs only what finished at earlier ticks (actions
    of other kinds count as done) and runs in a lane (`Lane`) after the lanes of the actions
    before it in the tick; a device with none ready idles. A looped executor runs one tick per
    iteration, a switch per lane of each device. A zero-bubble W and the forward or input
    gradient listed after it share a tick where both are ready: ZB-H1 at K=32, M=128 runs 319
    ticks, where one action per device and tick ran 415 (fill-drain: 318).

    Returns:
      Per tick, per device, the actions it runs (none, or one per lane, in lane order).
    """
    lists = [[a for a in device if a.kind in kinds] for device in sched.actions]
    position = [0] * sched.num_devices
    finished = set()
    ticks = []
    while any(position[d] < len(lists[d]) for d in range(sched.num_devices)):
        tick = []
        for d, actions in enumerate(lists):
            taken = []
            while position[d] < len(actions):
                action = actions[position[d]]
                if taken and Lane(action) <= Lane(taken[-1]) or not all(
                        dep in finished or dep.kind not in kinds for dep in sched.Needs(action)):
                    break
                taken.append(action)
                position[d] += 1
            tick.append(tuple(taken))
        if not any(tick):
            raise ScheduleError(f'the {kinds} actions of the schedule cannot all run.')
        finished.update(a for actions in tick for a in actions)
        ticks.append(tick)
    return ticks


class LaneSwitch(NamedTuple):
    """A device's switch over one lane's actions.

    Attributes:
      lane: the lane (`Lane`).
      branches: the (kind, stage) pairs the lane runs, in order: branch i + 1 runs branches[i],
        branch 0 idles.
      index: per tick, the branch taken.
      micro_batches: per tick, the micro-batch the branch runs on (0 when idle).
    """
    lane: tuple
    branches: tuple
    index: tuple
    micro_batches: tuple


def Switches(ticks, num_devices: int) -> list[list[LaneSwitch]]:
    """Per device, a switch per lane it runs actions in, in lane order (the order a tick runs
    them in), replaying `ticks` (`Ticks`); a device with no action has none."""
    pairs = [{} for _ in range(num_devices)]  # Per device and lane, its (kind, stage) pairs.
    for lane, d, pair in sorted((Lane(a), d, (a.kind, a.stage)) for tick in ticks
                                for d, actions in enumerate(tick) for a in actions):
        lane_pairs = pairs[d].setdefault(lane, [])
        if pair not in lane_pairs:
            lane_pairs.append(pair)
    switches = []
    for d, lanes in enumerate(pairs):
        runs = [{Lane(a): a for a in tick[d]} for tick in ticks]
        switches.append([LaneSwitch(
            lane, tuple(branches),
            tuple(1 + branches.index((run[lane].kind, run[lane].stage)) if lane in run else 0
                  for run in runs),
            tuple(run[lane].micro_batch if lane in run else 0 for run in runs))
            for lane, branches in lanes.items()])
    return switches
