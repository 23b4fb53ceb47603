"""The pipeline's pictures, from its Params (the plan) or from a traced step (the measurement).

The plan pictures need no variable and no TF op, so they can be drawn for models far larger than
the machine drawing them:

* 'cell_costs': each cell's forward FLOPs on one mini-batch; the pipeline runs at the pace of
  its costliest cell.
* 'timeline_predicted': the step `simulator.Simulate` predicts from those FLOPs under the plan's
  schedule (`plan.schedule`, the one the executor runs). Params give no device speed, so the
  time axis is at a nominal FLOP rate (the title says which); the shape of the schedule, its
  bubble and its utilisation do not depend on it.
* 'memory': each device's peak memory (`memory.PlanMemory`) with the optimizer's slots.

'timeline_measured' is drawn from the op events of one traced training step (`trace.py`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from matplotlib.figure import Figure

from gpipe_tf.perf import memory as memory_lib
from gpipe_tf.perf import plot
from gpipe_tf.perf import simulator
from gpipe_tf.perf import trace
from gpipe_tf.pipeline import pipelining_layer
from gpipe_tf.pipeline import plan as plan_lib
from gpipe_tf.pipeline import schedule as schedule_lib

# The FLOP rate the predicted timeline is drawn at: a round number, not any device's.
NOMINAL_FLOPS_PER_SEC = 1e12
PLAN_FIGURES = ('cell_costs', 'timeline_predicted', 'memory')
# Above this many cells only every n-th bar is labelled: a label per bar would overlap.
_MAX_CELL_LABELS = 32


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
    """What the plan pictures show.

    Attributes:
      forward_flops: per cell, its forward FLOPs on one mini-batch (layers in before_tpl, which
        run ahead of the pipeline, are not counted).
      memory: the per-device memory plan; it also fixes M, each cell's re-materialization and
        the schedule.
    """
    forward_flops: list[float]
    memory: memory_lib.MemoryPlan

    @property
    def num_cells(self) -> int:
        return len(self.forward_flops)

    @property
    def num_micro_batches(self) -> int:
        return self.memory.num_micro_batches

    @property
    def schedule(self) -> schedule_lib.Schedule:
        """The training schedule (the memory plan's; GPipe's for a memory plan without one)."""
        return self.memory.schedule or schedule_lib.Make('gpipe', self.num_cells,
                                                         self.num_micro_batches)

    @property
    def recompute(self) -> list[bool]:
        """Per cell, whether it re-materializes (the plan's `plan.RecomputeFlags`: 'always'
        all, 'never' none, 'except_last_<j>' all but the last j)."""
        return [cell.recompute for cell in self.memory.cells]


def PipelineParams(params):
    """The PipeliningLayer Params of task Params (their `model`) or of pipeline Params.

    Raises:
      ValueError: if the model is not a PipeliningLayer.
    """
    model = params.model if 'model' in params and 'train' in params else params
    if not pipelining_layer.IsPipeline(model):
        found = 'None' if model is None else model.cls.__name__
        raise ValueError(f'The pipeline pictures need a PipeliningLayer model; got {found}.')
    return model


def Plan(params, slots_per_param: int | None = None,
         pipeline_plan: plan_lib.Plan | None = None) -> PipelinePlan:
    """The plan of task Params (a PipeliningLayer `model`) or of PipeliningLayer Params; no
    variable is built, no TF op run.

    Args:
      params: task Params or PipeliningLayer Params, with input_shapes.
      slots_per_param: optimizer slots per parameter; None: those of the task's optimizer
        (`memory.SlotsPerParam`), or 1 (the GPipe paper's count) for pipeline Params.
      pipeline_plan: the pipeline's plan (`plan.MakePlan`) when the caller has made it already;
        None: made here.

    Raises:
      ValueError: for a model that is not a PipeliningLayer, Params without input_shapes, or an
        optimizer whose slot count is not known.
    """
    model = PipelineParams(params)
    is_task = model is not params
    if model.input_shapes is None:
        where = 'model.input_shapes' if is_task else 'input_shapes'
        raise ValueError(f'{model.name}: the plan pictures need {where} (the shapes of one '
                         'mini-batch of inputs) to estimate each cell\'s FLOPs and memory.')
    if slots_per_param is None:
        slots_per_param = memory_lib.SlotsPerParam(params.train.optimizer) if is_task else 1
    if pipeline_plan is None:
        pipeline_plan = plan_lib.MakePlan(model, place=False)
    return PipelinePlan(forward_flops=[float(meta.flops) for meta in pipeline_plan.metas],
                        memory=memory_lib.FromPlan(pipeline_plan, slots_per_param))


def PredictedTimeline(plan: PipelinePlan,
                      device_flops_per_sec: float = NOMINAL_FLOPS_PER_SEC) -> simulator.Timeline:
    """The simulated step of `plan` under its schedule on devices of `device_flops_per_sec`,
    transfers free."""
    m = plan.num_micro_batches
    costs = simulator.CostsFromFlops([flops / m for flops in plan.forward_flops],
                                     device_flops_per_sec)
    return simulator.Simulate(costs, m, plan.recompute, plan.schedule)


def _Rate(flops_per_sec: float) -> str:
    for scale, unit in ((1e15, 'PFLOP/s'), (1e12, 'TFLOP/s'), (1e9, 'GFLOP/s')):
        if flops_per_sec >= scale:
            return f'{flops_per_sec / scale:g} {unit}'
    return f'{flops_per_sec:g} FLOP/s'


def _CellLabels(num_cells: int) -> list[str] | None:
    """Tick labels for cell bars: the default 'cell k' while they fit, else every n-th k."""
    if num_cells <= _MAX_CELL_LABELS:
        return None
    every = math.ceil(num_cells / _MAX_CELL_LABELS)
    return [str(k) if k % every == 0 else '' for k in range(num_cells)]


def Figures(plan: PipelinePlan, name: str, device_bytes: float | None = None,
            device_flops_per_sec: float = NOMINAL_FLOPS_PER_SEC) -> dict[str, Figure]:
    """The plan pictures of `plan`, keyed by `PLAN_FIGURES`.

    Args:
      plan: from `Plan`.
      name: the model's name, for the titles.
      device_bytes: an accelerator's memory, drawn as a line on the memory picture.
      device_flops_per_sec: the rate the predicted timeline runs at.
    """
    k, m, sched = plan.num_cells, plan.num_micro_batches, plan.schedule
    # Titles put the model's name on a line of its own: the figures append their summaries.
    return {
        'cell_costs': plot.CellCostFigure(
            plan.forward_flops, unit='forward FLOPs per mini-batch',
            title=f'{name}\ncost per cell', labels=_CellLabels(k)),
        'timeline_predicted': plot.TimelineFigure(
            PredictedTimeline(plan, device_flops_per_sec),
            title=f'{name}\npredicted step, time at a nominal {_Rate(device_flops_per_sec)} '
                  'per device',
            ideal_utilisation=simulator.IdealUtilisation(m, sched.num_devices, sched.kind,
                                                         sched.virtual_stages)),
        'memory': plot.MemoryFigure(plan.memory, device_bytes, title=f'{name}\nplanned memory'),
    }


def PlanFigures(params, name: str, device_bytes: float | None = None) -> dict[str, Figure]:
    """The plan pictures ('cell_costs', 'timeline_predicted', 'memory') of task Params or
    PipeliningLayer Params, from Params alone.

    Args:
      params: task Params (with a PipeliningLayer `model`) or PipeliningLayer Params, with
        input_shapes.
      name: the model's name, for the titles.
      device_bytes: an accelerator's memory, drawn as a line on the memory picture.

    Raises:
      ValueError: for a model that is not a PipeliningLayer, or Params without input_shapes.
    """
    return Figures(Plan(params), name, device_bytes)


def MeasuredTimelineFigure(events: Sequence[trace.OpEvent], num_cells: int,
                           num_micro_batches: int, title: str = '',
                           sched: schedule_lib.Schedule | None = None) -> Figure:
    """The timeline of one traced step (its op events), with the ideal utilisation of its
    schedule (default: gpipe's, one cell per device).

    Raises:
      ValueError: if no event is a pipeline op, or one names a cell >= num_cells.
    """
    num_devices = sched.num_devices if sched is not None else num_cells
    ideal = (simulator.IdealUtilisation(num_micro_batches, num_devices, sched.kind,
                                        sched.virtual_stages)
             if sched is not None else simulator.IdealUtilisation(num_micro_batches, num_cells))
    return plot.TimelineFigure(
        trace.MeasuredTimeline(list(events), num_cells, num_devices=num_devices,
                               device_of=sched.DeviceOf if sched is not None else None),
        title=title,
        ideal_utilisation=ideal)
