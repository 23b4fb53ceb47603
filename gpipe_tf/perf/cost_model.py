"""What a layer, and a pipeline's step, cost: the cost model the tuner (`tuner`) scores
configurations on.

Layer costs come from a `Costs`, per micro-batch size: measured on the device (`MeasuredCosts`,
the costs `partition_method='time'` uses) or estimated from FLOPs at a nominal rate
(`FlopsCosts`, for models no device here can run: their predicted steps rank configurations but
are not seconds of any device), either of them scaled by one number fitted to measured steps
of the pipeline itself (`Calibrated`). A plan's step is simulated (`Simulated`, by
`simulator.Simulate`) on the per-cell sums of its layers' costs and what a step costs besides
them (`Overheads`). Boundary transfers are not modelled (free), as between virtual devices of
one host.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Callable, Sequence

from gpipe_tf.layers import sequential
from gpipe_tf.perf import measured_costs
from gpipe_tf.perf import simulator
from gpipe_tf.pipeline import fields

# The FLOP rate of FLOPs-estimated costs: ranks configurations, is no device's.
NOMINAL_FLOPS_PER_SEC = 1e12


@dataclasses.dataclass(frozen=True)
class LayerSeconds:
    """One layer's seconds on one micro-batch: forward, backward (all gradients), and the
    backward's input gradient (zero-bubble's I; its W is the rest)."""
    forward: float
    backward: float
    input_grad: float

    def Step(self, recompute: bool) -> float:
        return self.forward * (2 if recompute else 1) + self.backward


@dataclasses.dataclass(frozen=True)
class Overheads:
    """What a step costs besides its layers' work: `action_s` per action (one call of a cell's
    forward or backward part on a micro-batch; a backward split into I and W is two), and
    `call_s`, what each layer's forward of the costs includes besides its work (each layer was
    timed as a call of its own: `Simulated` takes it out)."""
    action_s: float = 0.0
    call_s: float = 0.0


class Costs:
    """Per-layer costs on one micro-batch of a given size: `Of(micro_batch_size)` -> (the
    before_tpl layers', the body layers'). `measured` says whether they are seconds measured
    on a device or an estimate; `Overheads`, what a step costs besides its layers' work."""
    measured: bool = False
    description: str = ''

    def Of(self, micro_batch_size: int) -> tuple[list[LayerSeconds], list[LayerSeconds]]:
        raise NotImplementedError

    def Overheads(self, micro_batch_size: int) -> Overheads:  # pylint: disable=unused-argument
        """What a step costs besides its layers' work (nothing in an estimate)."""
        return Overheads()


class FlopsCosts(Costs):
    """Seconds at `flops_per_sec` from each layer's forward FLOPs (`FPropMeta`), the backward
    twice the forward and split evenly into input and weight gradients."""

    def __init__(self, p, flops_per_sec: float = NOMINAL_FLOPS_PER_SEC):
        self.description = f'estimated from FLOPs at {flops_per_sec:.0e} FLOP/s'
        self._rate = flops_per_sec
        self._batch = fields.BatchSize(p)
        before = fields.BeforeLayers(p)
        shapes = fields.InputShapes(p)
        self._before = ([m.flops for m in sequential.ChainMeta(before, *shapes)[1]]
                        if before else [])
        layers = fields.BodyLayers(p)
        self._layers = [m.flops for m in
                        sequential.ChainMeta(layers, *fields.BodyInputShapes(p))[1]]

    def Of(self, micro_batch_size):
        def Seconds(flops):
            forward = flops * micro_batch_size / self._batch / self._rate
            return LayerSeconds(forward, 2 * forward, forward)
        return [Seconds(f) for f in self._before], [Seconds(f) for f in self._layers]


class MeasuredCosts(Costs):
    """Seconds measured on the pipeline's first device (`measured_costs.PipelineLayerCosts`),
    once per micro-batch size, cached in `p.costs_file`."""
    measured = True

    def __init__(self, p, progress: Callable | None = None):
        self.description = 'measured on ' + measured_costs.DescribeDevice(
            measured_costs.FirstDevice(p))
        self._p, self._progress, self._memo, self._calls = p, progress, {}, {}

    def Of(self, micro_batch_size):
        if micro_batch_size not in self._memo:
            before, layers = measured_costs.PipelineLayerCosts(self._p, micro_batch_size,
                                                               self._progress)
            self._memo[micro_batch_size] = tuple(
                [LayerSeconds(c.forward_s, c.backward_s, c.input_grad_s) for c in costs]
                for costs in (before, layers))
            self._calls[micro_batch_size] = statistics.median(
                c.call_s for c in list(before) + list(layers))
        return self._memo[micro_batch_size]

    def Overheads(self, micro_batch_size):
        """A call's own cost, measured with the layers (their median), taken as each
        action's: each layer's forward was timed as a call of its own, the pipeline runs a
        cell's layers in one call per action, so `Simulated` takes it out of every layer's
        forward and charges it once per action. (`Calibrated` replaces it with what an action of
        the pipeline itself costs.)"""
        self.Of(micro_batch_size)
        call = self._calls[micro_batch_size]
        return Overheads(action_s=call, call_s=call)


class Calibrated(Costs):
    """`costs` times `scale`, fitted to measured steps of the pipeline itself (`tuner.Calibrate`):
    every layer's seconds and every overhead. A layer timed alone on one device is not the layer
    inside the pipeline's graph (no call of its own, other ops beside it that may share the
    device's cores, other caches)."""

    def __init__(self, costs: Costs, scale: float, description: str):
        self._costs, self.scale = costs, scale
        self.measured = costs.measured
        self.description = f'{costs.description}, {description}'

    def Of(self, micro_batch_size):
        return tuple([LayerSeconds(self.scale * c.forward, self.scale * c.backward,
                                   self.scale * c.input_grad) for c in costs]
                     for costs in self._costs.Of(micro_batch_size))

    def Overheads(self, micro_batch_size):
        overheads = self._costs.Overheads(micro_batch_size)
        return Overheads(*(self.scale * getattr(overheads, field.name)
                           for field in dataclasses.fields(Overheads)))


def Simulated(pipeline_plan, boundaries: Sequence[int], before: Sequence[LayerSeconds],
              layers: Sequence[LayerSeconds],
              overheads: Overheads = Overheads()) -> simulator.Timeline:
    """The simulated actions of a plan whose cells hold the layers between `boundaries` (the
    before layers in cell 0): each cell's forward is its layers' work (their forwards less
    `overheads.call_s` each) and one action's cost, its backward theirs and one action's (a
    split one, two)."""
    forward, backward, input_grad, counts = [], [], [], []
    for k in range(len(boundaries) - 1):
        cell = list(layers[boundaries[k]:boundaries[k + 1]]) + (list(before) if k == 0 else [])
        counts.append(len(cell))
        forward.append(sum(c.forward for c in cell))
        backward.append(sum(c.backward for c in cell))
        input_grad.append(sum(c.input_grad for c in cell))
    total = sum(backward)
    weight_fraction = min(max(1 - sum(input_grad) / total, 0.0), 1.0) if total else 0.5
    backward_calls = 2 if pipeline_plan.schedule.splits_backward else 1
    action_s = overheads.action_s
    work = [max(f - layers_in * overheads.call_s, 0.0) for f, layers_in in zip(forward, counts)]
    return simulator.Simulate(
        simulator.CellCosts(forward=[w + action_s for w in work],
                            backward=[b + backward_calls * action_s for b in backward],
                            recompute=work, weight_fraction=weight_fraction),
        pipeline_plan.num_micro_batches, pipeline_plan.recompute, pipeline_plan.schedule)
