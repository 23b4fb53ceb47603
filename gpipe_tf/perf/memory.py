"""Plans a pipeline's memory per device from Params alone: parameters, gradients, optimizer slots
and activations, with and without re-materialization.

The model follows what the graph keeps alive (`pipeline/executor.py`, `pipeline/recompute.py`):

* Cell k's device holds its variables, the running sum of its weight gradients (and, from the
  second micro-batch on, the micro-batch's gradient being added to it), and the optimizer's slots (`slots_per_param` copies: Adam and RMSProp with momentum keep 2, Momentum 1,
  SGD 0; the GPipe paper's 12 bytes per parameter is one slot).
* A re-materializing cell keeps only its input for every micro-batch (the whole mini-batch of
  boundary activations) until its backward; while it runs the backward of one micro-batch it
  holds that micro-batch's recomputed activations (`activation_bytes / M`), which its weight
  gradients replace layer by layer, and two activation gradients (the incoming one and the one
  computed from it; counted at the cell's largest layer output). Peak: O(N + (L/K)(N/M)).
* A cell that keeps its activations ('never', and the last cell under 'except_last') holds its
  input and every layer's output for the whole mini-batch, plus the two activation gradients of
  one micro-batch while its backward runs.
* The last cell also holds the pipeline's output for the mini-batch (the loss reads it).

`activation_bytes` is the layers' own FPropMeta estimate of what their backward keeps alive.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from gpipe_tf import optimizer as optimizer_lib
from gpipe_tf import units
from gpipe_tf.layers import base_layer
from gpipe_tf.layers import sequential
from gpipe_tf.pipeline import plan as plan_lib

# The parts of a device's memory, in the order the plots stack them.
COMPONENTS = ('params', 'gradients', 'slots', 'stored_activations', 'working_activations')

# Optimizer slot variables per parameter.
_SLOTS = {optimizer_lib.SGD: 0, optimizer_lib.Momentum: 1, optimizer_lib.Adam: 2}


def SlotsPerParam(optimizer_params) -> int:
    """How many slot variables per parameter an optimizer (its Params) keeps.

    Raises:
      ValueError: for an optimizer this planner does not know.
    """
    cls = optimizer_params.cls
    if issubclass(cls, optimizer_lib.RMSProp):
        return 2 if optimizer_params.momentum else 1
    for known, slots in _SLOTS.items():
        if issubclass(cls, known):
            return slots
    raise ValueError(f'No slot count known for optimizer {cls.__name__}; expected one of '
                     f'{sorted(c.__name__ for c in list(_SLOTS) + [optimizer_lib.RMSProp])}.')


@dataclasses.dataclass(frozen=True)
class CellMemory:
    """Bytes one cell's device needs at its peak (the backward of one micro-batch).

    Attributes:
      cell: the cell index (device k runs cell k).
      params: its variables.
      gradients: the running sum of its weight gradients at the peak.
      slots: the optimizer's slot variables for its weights.
      stored_activations: activations kept from the forward for the micro-batches whose backward
        has not run: the cell's input (and, without re-materialization, every layer's output; for
        the last cell, the pipeline's output).
      working_activations: what the backward of one micro-batch adds: the larger of its
        recomputed activations (re-materializing cells) and its weight gradients, which replace
        them layer by layer, plus two activation gradients.
      recompute: whether the cell re-materializes its forward.
      before_backward: bytes it holds from the end of its forward until its backward starts.
      after_backward: bytes it holds once its backward is done (weights, gradients, slots).
      during_backward: per micro-batch i, the bytes it holds while running i's backward, less
        the working set.
      working_by_micro_batch: per micro-batch i, the working set of i's backward.
    """
    cell: int
    params: int
    gradients: int
    slots: int
    stored_activations: int
    working_activations: int
    recompute: bool
    before_backward: int
    after_backward: int
    during_backward: tuple[int, ...]
    working_by_micro_batch: tuple[int, ...]

    @property
    def total(self) -> int:
        return sum(getattr(self, name) for name in COMPONENTS)

    @property
    def activations(self) -> int:
        return self.stored_activations + self.working_activations


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Per-cell memory of a pipeline for one mini-batch of `batch_size` in M micro-batches."""
    cells: list[CellMemory]
    num_micro_batches: int
    batch_size: int
    slots_per_param: int
    input_bytes: int  # The pipeline's input, one mini-batch (part of cell 0's stored activations).

    @property
    def num_cells(self) -> int:
        return len(self.cells)

    @property
    def peak_device_bytes(self) -> int:
        """The most any one device needs: what must fit on each accelerator."""
        return max(c.total for c in self.cells)

    @property
    def shared_peak_bytes(self) -> int:
        """Peak when every cell shares one memory (virtual devices on one host), walking the
        backward schedule: at tick t cell k runs micro-batch t - (K - 1 - k); cells whose
        backward has not started hold `before_backward`, finished ones `after_backward`, and
        the running ones their `during_backward` plus their working sets: every device
        computes at once."""
        num, m = self.num_cells, self.num_micro_batches
        peak = 0
        for tick in range(m + num - 1):
            held, working = 0, 0
            for c in self.cells:
                i = tick - (num - 1 - c.cell)
                if i < 0:
                    held += c.before_backward
                elif i >= m:
                    held += c.after_backward
                else:
                    held += c.during_backward[i]
                    working += c.working_by_micro_batch[i]
            peak = max(peak, held + working)
        return peak

    @property
    def step_bytes(self) -> int:
        """`shared_peak_bytes` less what exists before a step starts (the variables, and the
        input batch when the cells keep it as it is): what one step allocates at its peak."""
        # With M > 1 the cells keep split copies of the input, not the input itself.
        existing_input = self.input_bytes if self.num_micro_batches == 1 else 0
        return self.shared_peak_bytes - sum(c.params for c in self.cells) - existing_input

    @property
    def param_bytes(self) -> int:
        """Parameters, gradients and slots of all cells: the paper's 'total param memory'."""
        return sum(c.params + c.gradients + c.slots for c in self.cells)

    def Fits(self, device_bytes: float) -> bool:
        """Whether every cell fits on a device of `device_bytes`."""
        return self.peak_device_bytes <= device_bytes

    def Format(self, device_bytes: float | None = None) -> str:
        """A table, one row per cell, in MiB; with `device_bytes`, whether each one fits."""
        header = ('cell', 'remat') + COMPONENTS + ('total',) + (
            ('fits',) if device_bytes else ())
        rows = [header]
        for c in self.cells:
            row = (str(c.cell), 'yes' if c.recompute else 'no') + tuple(
                units.MiB(getattr(c, name)) for name in COMPONENTS) + (units.MiB(c.total),)
            if device_bytes:
                row += ('yes' if c.total <= device_bytes else 'NO',)
            rows.append(row)
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines = ['  '.join(v.rjust(w) for v, w in zip(r, widths)) for r in rows]
        lines.append(f'K={self.num_cells} M={self.num_micro_batches} batch={self.batch_size}: '
                     f'peak per device {units.MiB(self.peak_device_bytes)} MiB, all devices in one '
                     f'memory {units.MiB(self.shared_peak_bytes)} MiB')
        return '\n'.join(lines)


def _ScaleBatch(shapes, batch_dim: int, batch_size: int):
    if isinstance(shapes, dict):
        return {k: _ScaleBatch(v, batch_dim, batch_size) for k, v in shapes.items()}
    if shapes and isinstance(shapes[0], (list, tuple, dict)):
        return [_ScaleBatch(s, batch_dim, batch_size) for s in shapes]
    shape = list(shapes)
    shape[batch_dim] = batch_size
    return shape


def _Configure(p, num_cells, num_micro_batches, batch_size, recompute):
    """A copy of pipeline Params `p` with the given overrides (None keeps p's value)."""
    if p.input_shapes is None:
        raise ValueError(f'{p.name}: planning memory needs input_shapes (the shapes of one '
                         'mini-batch of inputs).')
    p = p.Copy()
    if batch_size is not None:
        p.input_shapes = _ScaleBatch(p.input_shapes, p.batch_dim, batch_size)
    if num_cells is not None:
        if p.layer_tpl is None:
            raise ValueError(f'{p.name}: num_cells can only be changed for layer_tpl pipelines, '
                             'not explicit cell_tpl cells.')
        p.num_cells = num_cells
    if num_micro_batches is not None:
        p.num_micro_batches, p.micro_batch_size = num_micro_batches, None
    if recompute is not None:
        p.recompute = recompute
    if p.recompute not in plan_lib.RECOMPUTE_MODES:
        raise ValueError(f'recompute must be one of {plan_lib.RECOMPUTE_MODES}, got '
                         f'{p.recompute!r}.')
    return p


def PlanMemory(p, slots_per_param: int = 1, num_cells: int | None = None,
               num_micro_batches: int | None = None, batch_size: int | None = None,
               recompute: str | None = None) -> MemoryPlan:
    """The memory plan of PipeliningLayer Params `p`; no variable is built, no TF op run.

    Args:
      p: PipeliningLayer Params with input_shapes (one mini-batch).
      slots_per_param: optimizer slots per parameter (`SlotsPerParam`).
      num_cells, num_micro_batches, batch_size, recompute: overrides of p's K, M, mini-batch
        size and recompute mode.

    Raises:
      ValueError: for Params without input_shapes, or a K, M or batch that do not fit them.
    """
    p = _Configure(p, num_cells, num_micro_batches, batch_size, recompute)
    return FromPlan(plan_lib.MakePlan(p, place=False), slots_per_param)


def FromPlan(pipeline_plan: plan_lib.Plan, slots_per_param: int = 1) -> MemoryPlan:
    """The memory plan of a pipeline's plan (`pipeline.plan.MakePlan`): its cells, M and
    re-materialization as partitioned there, so a caller holding the plan does not partition
    again.

    Raises:
      ValueError: for a plan of Params without input_shapes.
    """
    p = pipeline_plan.params
    if p.input_shapes is None:
        raise ValueError(f'{p.name}: planning memory needs input_shapes (the shapes of one '
                         'mini-batch of inputs).')
    cells, m, batch = (pipeline_plan.cells, pipeline_plan.num_micro_batches,
                       pipeline_plan.batch_size)
    shapes = plan_lib.InputShapes(p)
    bytes_per = tf.as_dtype(p.dtype).size
    before_params = 0
    if p.before_tpl:
        before_meta, _ = sequential.ChainMeta(p.before_tpl, *shapes)
        before_params = before_meta.num_params
        shapes = base_layer.AsArgs(before_meta.out_shapes)
    num = len(cells)
    plan = []
    for k, layers in enumerate(cells):
        meta, layer_metas = sequential.ChainMeta(layers, *shapes)
        input_bytes = base_layer.OutputBytes(shapes, p.dtype)
        output_bytes = base_layer.OutputBytes(meta.out_shapes, p.dtype)
        if k == 0:
            pipeline_input_bytes = input_bytes
        shapes = base_layer.AsArgs(meta.out_shapes)
        # The backward of one micro-batch holds an activation's gradient and the gradient it
        # computes from it: two of the largest boundary between the cell's layers.
        largest = max([input_bytes] + [base_layer.OutputBytes(layer.out_shapes, p.dtype)
                                       for layer in layer_metas])
        remat = pipeline_plan.recompute[k]
        params = (meta.num_params + (before_params if k == 0 else 0)) * bytes_per
        slots = slots_per_param * params
        # What the forward keeps for the backward, per micro-batch: the cell's input, and every
        # layer's output unless re-materializing (less the cell's own output, which is the next
        # cell's input, or the pipeline's output: counted there).
        kept = (input_bytes + (0 if remat else max(meta.activation_bytes - output_bytes, 0))) // m
        output = output_bytes if k == num - 1 else 0
        activations = meta.activation_bytes // m  # One micro-batch's, recomputed or kept.
        transient = 2 * largest // m  # Two activation gradients of one micro-batch.
        # The peak is at the backward of the first micro-batch, whose weight gradients are
        # allocated as its activations are freed layer by layer (so it holds the larger of the
        # two), or of the second, when the gradient sum exists and each new weight gradient is
        # added to it as soon as it is computed. The running micro-batch's activations count as
        # working, its input as stored.
        stored_first = (m - 1) * kept + input_bytes // m + output
        candidates = [(0, stored_first, max(activations, params) + transient)]
        if m > 1:
            candidates.append((params, stored_first - kept, activations + transient))
        gradients, stored, working = max(candidates, key=sum)
        plan.append(CellMemory(
            cell=k, params=params, gradients=gradients, slots=slots, stored_activations=stored,
            working_activations=working, recompute=remat,
            before_backward=params + slots + m * kept + output, after_backward=2 * params + slots,
            during_backward=tuple(params + slots + (params if i else 0) + stored_first - i * kept
                                  for i in range(m)),
            working_by_micro_batch=tuple(
                (max(activations, params) if i == 0 else activations) + transient
                for i in range(m))))
    return MemoryPlan(cells=plan, num_micro_batches=m, batch_size=batch,
                      slots_per_param=slots_per_param, input_bytes=pipeline_input_bytes)


def _Divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def SuggestPipeline(p, device_bytes: float, slots_per_param: int = 1,
                    max_cells: int | None = None) -> MemoryPlan:
    """The smallest K, with the smallest M >= 4K that divides the batch (or, if none does, the
    largest that does), whose plan fits on devices of `device_bytes`.

    Raises:
      ValueError: if no K up to `max_cells` (default: the number of layers) fits.
    """
    if p.layer_tpl is None:
        raise ValueError(f'{p.name}: suggesting K needs layer_tpl (layers to partition).')
    max_cells = max_cells or len(p.layer_tpl)
    batch = plan_lib.BatchSize(p)
    divisors = _Divisors(batch)
    best = None
    for k in range(1, max_cells + 1):
        m = next((d for d in divisors if d >= 4 * k), divisors[-1])
        plan = PlanMemory(p, slots_per_param, num_cells=k, num_micro_batches=m)
        if plan.Fits(device_bytes):
            return plan
        if best is None or plan.peak_device_bytes < best.peak_device_bytes:
            best = plan
    raise ValueError(
        f'{p.name} does not fit on devices of {units.MiB(device_bytes)} MiB with up to {max_cells} '
        f'cells: the best, K={best.num_cells} M={best.num_micro_batches}, needs '
        f'{units.MiB(best.peak_device_bytes)} MiB on its largest cell.')
