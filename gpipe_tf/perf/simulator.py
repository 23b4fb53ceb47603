"""Predicts a pipeline step's timeline from per-stage costs, walking the executor's schedule.

A schedule (`pipeline/schedule.py`) lists, per device, the actions it runs in order: forwards
F, fused backwards B, and split backwards I (input gradient) and W (weight gradient); stage s
runs on device s % K (in a V under zero_bubble_v). The model follows the executor:

* F(s, m) waits for F(s-1, m) plus one boundary transfer.
* The last stage's backward of m waits for the loss: with a schedule that runs every forward
  first (gpipe) the loss reads the whole batch, so it waits for the last stage's every
  forward; with any other, the loss is computed per micro-batch, right after F(S-1, m).
* B(s, m) or I(s, m) waits for F(s, m) and for the backward of (s+1, m) plus one transfer. A
  re-materializing stage first re-runs its forward (a 'recompute' interval) and then computes
  its gradients: B all of them, I those of its input (the backward less `weight_fraction`).
* W(s, m) waits for I(s, m) and computes the weight gradients (the backward's
  `weight_fraction`) from what I kept: it runs no forward (`pipeline/residuals.py`).

A boundary between consecutive stages on two devices costs one hop; between two stages of one
device (the turn of zero_bubble_v's V, or K = 1) it costs nothing: the executor passes the
tensor on without a copy. Each device runs one action at a time, in its list's order; an action
starts when its device is free and its inputs have arrived. Transfers occupy the link, not a
device. The loss itself is free.

Because `Schedule.order` lists every action after its dependencies and keeps each device's
order, one walk of it settles every start time exactly; no event queue is needed.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Sequence

from gpipe_tf.pipeline import schedule as schedule_lib

# The kinds of intervals of a fused backward (as the GPipe executor and measured traces have
# them), and those of a split one. A split backward's I is preceded by a 'recompute' interval
# too when its stage re-materializes; its W re-runs nothing.
KINDS = ('forward', 'recompute', 'backward')
SPLIT_KINDS = ('input_grad', 'weight_grad')
# The interval kind of each action kind (a recompute before a B or I is an interval of its own).
ACTION_INTERVALS = {schedule_lib.FORWARD: 'forward', schedule_lib.BACKWARD: 'backward',
                  schedule_lib.INPUT_GRAD: 'input_grad', schedule_lib.WEIGHT_GRAD: 'weight_grad'}


@dataclasses.dataclass(frozen=True)
class CellCosts:
    """Seconds per micro-batch of each stage's (cell's) work, and of one boundary hop.

    Attributes:
      forward: per stage, its forward pass on one micro-batch.
      backward: per stage, its gradient computation on one micro-batch (recompute excluded):
        input and weight gradients together.
      recompute: per stage, its re-materialized forward; None means equal to `forward`.
      transfer: one hop across a stage boundary (an activation forward, a gradient backward).
      weight_fraction: the share of `backward` that is weight gradients (a split backward's
        W; its I computes the rest).
    """
    forward: Sequence[float]
    backward: Sequence[float]
    recompute: Sequence[float] | None = None
    transfer: float = 0.0
    weight_fraction: float = 0.5

    def __post_init__(self):
        lists = {'forward': self.forward, 'backward': self.backward}
        if self.recompute is not None:
            lists['recompute'] = self.recompute
        lengths = {name: len(costs) for name, costs in lists.items()}
        if len(set(lengths.values())) != 1 or not len(self.forward):
            raise ValueError(f'Cost lists must be non-empty and of equal length (one per cell), '
                             f'got lengths {lengths}.')
        for name, value in [('transfer', self.transfer)] + [
                (f'{name}[{k}]', c) for name, costs in lists.items() for k, c in enumerate(costs)]:
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f'Costs must be finite and >= 0, got {name} = {value}.')
        if not 0 <= self.weight_fraction <= 1:
            raise ValueError(f'weight_fraction must be in [0, 1], got {self.weight_fraction}.')

    @property
    def num_cells(self) -> int:
        """S, the stages (K, or v K with v virtual stages per device)."""
        return len(self.forward)


class Interval(NamedTuple):
    """One op on one device: stage `cell` working on `micro_batch`, from `start` to `end`."""
    device: int
    cell: int
    micro_batch: int
    kind: str  # One of KINDS or SPLIT_KINDS.
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class Timeline:
    """A simulated step.

    Attributes:
      intervals: every op, in the order the schedule issues them (`Schedule.order`).
      makespan: the end of the last op (the step starts at 0).
      busy: per device (K of them), the seconds it computes.
    """
    intervals: list[Interval]
    makespan: float
    busy: list[float]

    @property
    def utilisation(self) -> float:
        """Fraction of device time spent computing: sum(busy) / (K * makespan)."""
        if self.makespan == 0:
            return 1.0
        return sum(self.busy) / (len(self.busy) * self.makespan)

    @property
    def bubble(self) -> float:
        return 1.0 - self.utilisation

    @property
    def idle(self) -> float:
        """Device seconds spent waiting: K * makespan - sum(busy)."""
        return len(self.busy) * self.makespan - sum(self.busy)


def _CheckCounts(num_micro_batches: int, num_devices: int) -> None:
    if num_micro_batches < 1 or num_devices < 1:
        raise ValueError(f'M (micro-batches) and K (devices) must be >= 1, got '
                         f'{num_micro_batches} and {num_devices}.')


def IdealUtilisation(num_micro_batches: int, num_devices: int, kind: str = 'gpipe',
                     virtual_stages: int = 1) -> float:
    """The utilisation of balanced stages with free transfers and a backward twice the forward:
    M / (M + K - 1) for gpipe and 1f1b, v M / (v M + K - 1) for interleaved_1f1b, and for
    zero_bubble and zero_bubble_v (no closed form) its simulated step with F, I and W of equal
    cost and no re-materialization (zero_bubble_v: each of a device's two stages half its
    share).

    Raises:
      ValueError: for M, K or v below 1, or a kind that is not one of `schedule.KINDS`.
    """
    _CheckCounts(num_micro_batches, num_devices)
    if schedule_lib.Kind(kind).ideal_bubble is not None:
        return 1.0 - schedule_lib.IdealBubble(kind, num_devices, num_micro_batches,
                                              virtual_stages)
    sched = schedule_lib.Make(kind, num_devices, num_micro_batches, virtual_stages,
                              recomputes=[False] * (num_devices * virtual_stages))
    # A device's share of the layers, split over its v stages.
    share = 1.0 / sched.virtual_stages
    costs = CellCosts(forward=[share] * sched.num_stages,
                      backward=[2.0 * share] * sched.num_stages)
    return Simulate(costs, num_micro_batches, recompute=False, schedule=sched).utilisation


def CostsFromFlops(flops_per_cell: Sequence[float], device_flops_per_sec: float,
                   backward_factor: float = 2.0, transfer: float = 0.0) -> CellCosts:
    """CellCosts from each stage's forward FLOPs on one micro-batch.

    Args:
      flops_per_cell: per stage, forward FLOPs per micro-batch (e.g. FPropMeta's flops on the
        mini-batch divided by M).
      device_flops_per_sec: the FLOP rate every device sustains.
      backward_factor: the backward's cost as a multiple of the forward's.
      transfer: seconds per boundary hop.

    Raises:
      ValueError: for a rate that is not positive or a negative factor or cost.
    """
    if not device_flops_per_sec > 0 or not backward_factor >= 0:
        raise ValueError(f'device_flops_per_sec must be > 0 and backward_factor >= 0, got '
                         f'{device_flops_per_sec} and {backward_factor}.')
    forward = [flops / device_flops_per_sec for flops in flops_per_cell]
    return CellCosts(forward=forward, backward=[backward_factor * f for f in forward],
                     recompute=list(forward), transfer=transfer)


def Simulate(costs: CellCosts, num_micro_batches: int, recompute: bool | Sequence[bool],
             schedule: schedule_lib.Schedule | None = None) -> Timeline:
    """Simulates one training step of a schedule.

    Args:
      costs: per-stage costs; S = costs.num_cells stages.
      num_micro_batches: M.
      recompute: whether stages re-materialize their forward in the backward; a bool for all
        stages or one per stage (the pipeline's: `plan.RecomputeFlags`; 'except_last_<j>'
        is [True] * (S - j) + [False] * j).
        A split backward (zero_bubble) re-materializing re-runs the forward once, before I;
        its W never re-runs it.
      schedule: the schedule to walk, of S stages and M micro-batches; None: GPipe's
        (`schedule.Make('gpipe', S, M)`), one stage per device.

    Returns:
      The Timeline over the schedule's K devices, stage s on `schedule.DeviceOf(s)`.

    Raises:
      ValueError: for M < 1, a recompute list whose length is not S, or a schedule of another
        S or M.
    """
    num_stages = costs.num_cells
    if isinstance(recompute, bool):
        recompute = [recompute] * num_stages
    elif len(recompute) != num_stages:
        raise ValueError(f'recompute needs one flag per cell, got {len(recompute)} flags for '
                         f'{num_stages} cells.')
    _CheckCounts(num_micro_batches, num_stages)
    if schedule is None:
        schedule = schedule_lib.Make('gpipe', num_stages, num_micro_batches)
    elif (schedule.num_stages, schedule.num_micro_batches) != (num_stages, num_micro_batches):
        raise ValueError(f'The schedule has {schedule.num_stages} stages and '
                         f'{schedule.num_micro_batches} micro-batches; the costs have '
                         f'{num_stages} stages and M is {num_micro_batches}.')
    recompute_costs = costs.forward if costs.recompute is None else costs.recompute
    fraction = costs.weight_fraction
    free = [0.0] * schedule.num_devices  # Per device, when it finishes its last issued op.
    busy = [0.0] * schedule.num_devices
    intervals = []

    def Run(stage, micro_batch, kind, ready, seconds):
        device = schedule.DeviceOf(stage)
        start = max(free[device], ready)
        free[device] = start + seconds
        busy[device] += seconds
        intervals.append(Interval(device, stage, micro_batch, kind, start, free[device]))
        return free[device]

    last = num_stages - 1
    # The last stage's forwards, for a loss on the whole batch.
    last_forwards = [a for a in schedule.order
                     if a.kind == schedule_lib.FORWARD and a.stage == last]
    end = {}  # Action -> when it finishes.
    for action in schedule.order:
        kind, s, m = action
        # What it needs, plus one hop for what comes from another device.
        device = schedule.DeviceOf(s)
        ready = max([0.0] + [end[dep] + (costs.transfer if schedule.DeviceOf(dep.stage) != device
                                         else 0.0)
                             for dep in schedule.Needs(action)])
        if kind == schedule_lib.FORWARD:
            end[action] = Run(s, m, 'forward', ready, costs.forward[s])
            continue
        if kind == schedule_lib.WEIGHT_GRAD:
            end[action] = Run(s, m, 'weight_grad', ready, fraction * costs.backward[s])
            continue
        if s == last and schedule.forward_first:
            ready = max(end[f] for f in last_forwards)
        if recompute[s]:
            ready = Run(s, m, 'recompute', ready, recompute_costs[s])
        seconds = costs.backward[s] * (1.0 if kind == schedule_lib.BACKWARD else 1.0 - fraction)
        end[action] = Run(s, m, ACTION_INTERVALS[kind], ready, seconds)
    return Timeline(intervals=intervals, makespan=max(free), busy=busy)
