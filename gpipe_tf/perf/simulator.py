"""Predicts a GPipe step's timeline from per-cell costs, walking the graph builder's schedule.

The model follows `pipeline/executor.py`: cell k runs on device k; its forward of micro-batch m
waits for cell k-1's forward of m plus one boundary transfer; the backward starts once the last
forward is done (the loss needs every output); cell k's backward of m (a recompute of its forward,
then its gradients, when re-materializing) waits for cell k+1's backward of m plus one transfer.
Each device runs one op at a time, in the order `schedule.ForwardTicks` then
`schedule.BackwardTicks` list them. The backward's order is the graph's (control dependencies
serialize a cell's micro-batches); forwards are not so ordered, but a cell's micro-batches cost
the same, so running them in another order only renames them. Transfers occupy the link, not a
device.

Because ticks are in dependency order, one walk of them settles every start time exactly; no
event queue is needed.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Sequence

from gpipe_tf.pipeline import schedule

KINDS = ('forward', 'recompute', 'backward')


@dataclasses.dataclass(frozen=True)
class CellCosts:
    """Seconds per micro-batch of each cell's work, and of one boundary hop.

    Attributes:
      forward: per cell, its forward pass on one micro-batch.
      backward: per cell, its gradient computation on one micro-batch (recompute excluded).
      recompute: per cell, its re-materialized forward; None means equal to `forward`.
      transfer: one hop across a cell boundary (an activation forward, a gradient backward).
    """
    forward: Sequence[float]
    backward: Sequence[float]
    recompute: Sequence[float] | None = None
    transfer: float = 0.0

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

    @property
    def num_cells(self) -> int:
        return len(self.forward)


class Interval(NamedTuple):
    """One op on one device: cell `cell` working on `micro_batch`, from `start` to `end`."""
    device: int
    cell: int
    micro_batch: int
    kind: str  # One of KINDS.
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class Timeline:
    """A simulated step.

    Attributes:
      intervals: every op, in the order the schedule issues them.
      makespan: the end of the last op (the step starts at 0).
      busy: per device, the seconds it computes.
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


def IdealUtilisation(num_micro_batches: int, num_cells: int) -> float:
    """M / (M + K - 1): the utilisation of balanced cells with free transfers."""
    schedule.BubbleFraction(num_micro_batches, num_cells)  # Validates M and K.
    return num_micro_batches / (num_micro_batches + num_cells - 1)


def CostsFromFlops(flops_per_cell: Sequence[float], device_flops_per_sec: float,
                   backward_factor: float = 2.0, transfer: float = 0.0) -> CellCosts:
    """CellCosts from each cell's forward FLOPs on one micro-batch.

    Args:
      flops_per_cell: per cell, forward FLOPs per micro-batch (e.g. FPropMeta's flops on the
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


def Simulate(costs: CellCosts, num_micro_batches: int,
             recompute: bool | Sequence[bool]) -> Timeline:
    """Simulates one training step of the GPipe schedule.

    Args:
      costs: per-cell costs; K = costs.num_cells.
      num_micro_batches: M.
      recompute: whether cells re-materialize their forward in the backward; a bool for all
        cells or one per cell (the pipeline's 'except_last' is [True] * (K - 1) + [False]).

    Returns:
      The Timeline, device k running cell k.

    Raises:
      ValueError: for M < 1 or a recompute list whose length is not K.
    """
    num_cells = costs.num_cells
    if isinstance(recompute, bool):
        recompute = [recompute] * num_cells
    elif len(recompute) != num_cells:
        raise ValueError(f'recompute needs one flag per cell, got {len(recompute)} flags for '
                         f'{num_cells} cells.')
    # Raises on M < 1.
    forward_ticks = schedule.ForwardTicks(num_micro_batches, num_cells)
    backward_ticks = schedule.BackwardTicks(num_micro_batches, num_cells)
    recompute_costs = costs.forward if costs.recompute is None else costs.recompute
    free = [0.0] * num_cells  # Per device, when it finishes its last issued op.
    busy = [0.0] * num_cells
    intervals = []

    def Run(cell, micro_batch, kind, ready, seconds):
        start = max(free[cell], ready)
        free[cell] = start + seconds
        busy[cell] += seconds
        intervals.append(Interval(cell, cell, micro_batch, kind, start, free[cell]))
        return free[cell]

    forward_end = {}
    for tick in forward_ticks:
        for k, m in tick:
            ready = 0.0 if k == 0 else forward_end[(k - 1, m)] + costs.transfer
            forward_end[(k, m)] = Run(k, m, 'forward', ready, costs.forward[k])
    loss_ready = forward_end[(num_cells - 1, num_micro_batches - 1)]
    backward_end = {}
    for tick in backward_ticks:
        for k, m in tick:
            ready = (loss_ready if k == num_cells - 1
                     else backward_end[(k + 1, m)] + costs.transfer)
            if recompute[k]:
                ready = Run(k, m, 'recompute', ready, recompute_costs[k])
            backward_end[(k, m)] = Run(k, m, 'backward', ready, costs.backward[k])
    return Timeline(intervals=intervals, makespan=max(free), busy=busy)
