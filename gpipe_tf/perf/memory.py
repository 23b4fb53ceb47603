"""Plans a pipeline's memory per device from Params alone: parameters, gradients, optimizer slots
and activations, with and without re-materialization, under the plan's schedule.

The model follows what the graph keeps alive (`pipeline/executor.py`, `pipeline/cell.py`),
walking each stage's actions in the order its device runs them (`pipeline/schedule.py`):

* A tensor a stage gives on unread (a skip to a later stage, `BaseLayer.PassedLeaves`) is
  counted on the stage that reads it, as its input: both executors send it straight there,
  and nothing of it stays on the stages between. (The loop keeps it in a ring on the device
  that made it until that stage's last read, as it keeps every stage's input on the device
  before: counted, as those are, on the reader.)
* Stage s's device holds its variables, the running sum of its weight gradients (from the
  first weight gradient on: a fused backward B allocates it as it frees the micro-batch's
  activations, so the first holds the larger of the two; a sparse gradient, an embedding
  table's, grows by the rows each micro-batch read: `LayerMeta.sparse_gradient_bytes`), and
  the optimizer's slots
  (`slots_per_param` copies: Adam and RMSProp with momentum keep 2, Momentum 1, SGD 0; the GPipe
  paper's 12 bytes per parameter is one slot).
* From its forward until its backward (B, or the input gradient I of a split backward) starts,
  a micro-batch keeps, on a re-materializing stage, only the stage's input; on a stage that
  keeps its activations ('never', the last stage under 'except_last', the last j under
  'except_last_<j>': `plan.RecomputeFlags`), the input and every layer's output. So a stage
  holds as many micro-batches as its schedule lets through its forward before their backward:
  all M under gpipe, at most K - s under 1f1b (`schedule.StoredMicroBatches`).
* While its backward runs, a micro-batch holds its recomputed (or kept) activations, which
  its weight gradients replace layer by layer, and two activation gradients (the incoming one
  and the one computed from it; counted at the stage's largest layer output).
* A split backward's I keeps, for its W, the forward's activations W reads (the forward's
  own on a stage that keeps them; on a re-materializing one, those of the forward I re-runs)
  and the gradient of each layer's output; W, which runs no forward, frees them
  (`pipeline/residuals.py`).
* The last stage also holds the pipeline's output: for the whole mini-batch under a schedule
  that runs every forward first (the loss reads the whole batch), else per micro-batch until
  its backward (the loss is computed per micro-batch).

With v virtual stages per device, a device holds the sum of its stages' peaks.
`activation_bytes` is the layers' own FPropMeta estimate of what their backward keeps alive.

Mixed precision (`fprop_dtype`): parameters, gradients and slots are counted in `dtype`
(float32), activations and the tensors crossing cells in fprop_dtype (half with bfloat16), and a
running backward holds the cell's weights cast to fprop_dtype.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from gpipe_tf import optimizer as optimizer_lib
from gpipe_tf import units
from gpipe_tf.layers import base_layer
from gpipe_tf.layers import sequential
from gpipe_tf.perf import simulator
from gpipe_tf.pipeline import fields
from gpipe_tf.pipeline import plan as plan_lib
from gpipe_tf.pipeline import schedule as schedule_lib

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
    """Bytes one cell's (stage's) device needs for it at its peak.

    Attributes:
      cell: the cell index (stage s, on device s % K).
      params: its variables.
      gradients: the running sum of its weight gradients at the peak.
      slots: the optimizer's slot variables for its weights.
      stored_activations: at the peak, what micro-batches keep from their forward for their
        backward: the cell's input (and, without re-materialization, every layer's output; for
        the last cell, the pipeline's output), and after a split backward's I, what its W needs.
      working_activations: what the running backward of one micro-batch adds: the larger of
        its recomputed activations (re-materializing cells) and its weight gradients, which
        replace them layer by layer, plus two activation gradients (and, with a fprop_dtype,
        the cell's weights cast to it).
      recompute: whether the cell re-materializes its forward.
      before_backward: bytes it holds once the forwards before its first backward are done.
      after_backward: bytes it holds once all its actions are done (weights, gradients, slots).
      during_backward: per backward (B or I) of the cell, in its device's order, the bytes it
        holds while that backward runs, less the working set.
      working_by_micro_batch: per backward, likewise, the working set.
      profile: per action of the cell, in its device's order: the action, the bytes the cell
        holds while it runs (working set included) and once it is done; `MemoryPlan` walks it
        in time for `shared_peak_bytes`.
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
    profile: tuple[tuple[schedule_lib.Action, int, int], ...] = ()

    @property
    def total(self) -> int:
        return sum(getattr(self, name) for name in COMPONENTS)

    @property
    def activations(self) -> int:
        return self.stored_activations + self.working_activations


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Per-cell memory of a pipeline for one mini-batch of `batch_size` in M micro-batches,
    under `schedule` (None: GPipe's, one cell per device)."""
    cells: list[CellMemory]
    num_micro_batches: int
    batch_size: int
    slots_per_param: int
    input_bytes: int  # The pipeline's input, one mini-batch (part of cell 0's stored activations).
    schedule: schedule_lib.Schedule | None = None
    # Whether the pipeline casts its input to fprop_dtype: cell 0 then keeps the cast copy.
    input_cast: bool = False

    @property
    def num_cells(self) -> int:
        return len(self.cells)

    @property
    def num_devices(self) -> int:
        """K: the schedule's devices, each running the cells its placement gives it
        (`DeviceOf`: k, k + K, ..., or in a V under zero_bubble_v)."""
        return self.schedule.num_devices if self.schedule else self.num_cells

    @property
    def device_totals(self) -> list[int]:
        """Per device, the sum of its cells' peaks (a bound: they need not peak together)."""
        totals = [0] * self.num_devices
        for c in self.cells:
            totals[self.DeviceOf(c.cell)] += c.total
        return totals

    def DeviceOf(self, cell: int) -> int:
        """The device of `cell`: the schedule's placement (one cell per device without one)."""
        return self.schedule.DeviceOf(cell) if self.schedule else cell

    @property
    def peak_device_bytes(self) -> int:
        """The most any one device needs: what must fit on each accelerator."""
        return max(self.device_totals)

    @property
    def shared_peak_bytes(self) -> int:
        """Peak when every cell shares one memory (virtual devices on one host): the cells'
        profiles walked in time, at the times of a step of the schedule with balanced cells
        (forward 1, backward 2, split halves 1 each; `simulator.Simulate`), every device
        computing at once.

        Raises:
          ValueError: for cells without a profile (made by hand, not by `FromPlan`).
        """
        if any(not c.profile for c in self.cells):
            raise ValueError('shared_peak_bytes walks the cells\' profiles, which this plan '
                             'lacks (FromPlan makes them).')
        num, m = self.num_cells, self.num_micro_batches
        sched = self.schedule or schedule_lib.Make('gpipe', num, m)
        timeline = simulator.Simulate(simulator.CellCosts(forward=[1.0] * num,
                                                          backward=[2.0] * num),
                                      m, recompute=False, schedule=sched)
        kinds = {name: kind for kind, name in simulator.ACTION_INTERVALS.items()}
        times = {(kinds[i.kind], i.cell, i.micro_batch): (i.start, i.end)
                 for i in timeline.intervals}
        # (time, ends before starts, cell, bytes from then on).
        events = sorted((times[action][at_end], 1 - at_end, c.cell, held)
                        for c in self.cells for action, *helds in c.profile
                        for at_end, held in enumerate(helds))
        current = [c.params + c.slots for c in self.cells]
        peak = sum(current)
        for i, (time, _, cell, held) in enumerate(events):
            current[cell] = held
            if i + 1 == len(events) or events[i + 1][0] != time:
                peak = max(peak, sum(current))
        return peak

    @property
    def step_bytes(self) -> int:
        """`shared_peak_bytes` less what exists before a step starts (the variables, and the
        input batch when the cells keep it as it is): what one step allocates at its peak."""
        # With M > 1 the cells keep split copies of the input, not the input itself; with a
        # fprop_dtype, a cast copy.
        # In inference the cells keep no input: the one that exists is not in the plan.
        training = self.schedule is None or self.schedule.training
        existing_input = (self.input_bytes if training and self.num_micro_batches == 1 and
                          not self.input_cast else 0)
        return self.shared_peak_bytes - sum(c.params for c in self.cells) - existing_input

    @property
    def param_bytes(self) -> int:
        """Parameters, gradients and slots of all cells: the paper's 'total param memory'."""
        return sum(c.params + c.gradients + c.slots for c in self.cells)

    def Fits(self, device_bytes: float) -> bool:
        """Whether every device fits in `device_bytes`."""
        return self.peak_device_bytes <= device_bytes

    def Format(self, device_bytes: float | None = None) -> str:
        """A table, one row per cell, in MiB; with `device_bytes`, whether each one fits (and,
        with several cells per device, one line per device)."""
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
        k = self.num_devices
        if k < self.num_cells:
            for d, total in enumerate(self.device_totals):
                fits = ('' if not device_bytes else
                        ': fits' if total <= device_bytes else ': DOES NOT FIT')
                cells = [str(c.cell) for c in self.cells if self.DeviceOf(c.cell) == d]
                lines.append(f'device {d} (cells {",".join(cells)}): {units.MiB(total)} MiB'
                             f'{fits}')
        counts = f'K={k}' + (f' v={self.num_cells // k}' if k < self.num_cells else '')
        if self.schedule is not None and self.schedule.kind != schedule_lib.DEFAULT_KIND:
            counts += f' schedule={self.schedule.kind}'
        if self.schedule is not None and not self.schedule.training:
            counts += ' inference'
        lines.append(f'{counts} M={self.num_micro_batches} batch={self.batch_size}: '
                     f'peak per device {units.MiB(self.peak_device_bytes)} MiB, all devices in one '
                     f'memory {units.MiB(self.shared_peak_bytes)} MiB')
        return '\n'.join(lines)


def _ScaleBatch(shapes, batch_dim: int, batch_size: int):
    if isinstance(shapes, dict):
        return {k: _ScaleBatch(v, batch_dim, batch_size) for k, v in shapes.items()}
    if fields.IsSeveralShapes(shapes):
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
        p.recompute = recompute  # Checked by the plan (`plan.KeptCells`).
    return p


def PlanMemory(p, slots_per_param: int = 1, num_cells: int | None = None,
               num_micro_batches: int | None = None, batch_size: int | None = None,
               recompute: str | None = None, training: bool = True) -> MemoryPlan:
    """The memory plan of PipeliningLayer Params `p`; no variable is built, no TF op run.

    Args:
      p: PipeliningLayer Params with input_shapes (one mini-batch).
      slots_per_param: optimizer slots per parameter (`SlotsPerParam`).
      num_cells, num_micro_batches, batch_size, recompute: overrides of p's K, M, mini-batch
        size and recompute mode.
      training: False plans inference (`FromPlan`).

    Raises:
      ValueError: for Params without input_shapes, or a K, M or batch that do not fit them.
    """
    p = _Configure(p, num_cells, num_micro_batches, batch_size, recompute)
    return FromPlan(plan_lib.MakePlan(p, place=False), slots_per_param, training)


def FromPlan(pipeline_plan: plan_lib.Plan, slots_per_param: int = 1,
             training: bool = True) -> MemoryPlan:
    """The memory plan of a pipeline's plan (`pipeline.plan.MakePlan`): its cells, M,
    re-materialization and schedule as made there, so a caller holding the plan does not
    partition again.

    With `training` False, the plan of inference under the forward-only schedule (eval,
    decode, an exported model): each cell holds its weights (no gradients, no optimizer
    slots), nothing is kept for a backward, and a running forward holds one micro-batch's
    working set (two of its largest activations, and its weights cast to fprop_dtype); cell 0
    holds the split inputs not yet run, the last cell gathers the pipeline's outputs and joins
    them. With balanced cells: nothing holds a forward-only pipeline's first cells back, so a
    slow cell has micro-batches waiting at its input (up to M).

    Raises:
      ValueError: for a plan of Params without input_shapes.
    """
    p = pipeline_plan.params
    if p.input_shapes is None:
        raise ValueError(f'{p.name}: planning memory needs input_shapes (the shapes of one '
                         'mini-batch of inputs).')
    cells, m, batch = (pipeline_plan.cells, pipeline_plan.num_micro_batches,
                       pipeline_plan.batch_size)
    sched = (pipeline_plan.schedule if training and pipeline_plan.schedule
             else pipeline_plan.Schedule(m, training))
    if not training:
        slots_per_param = 0
    shapes = fields.InputShapes(p)
    # Weights in dtype; activations and the tensors crossing cells in the dtype the layers
    # compute in (half of float32's with a bfloat16 or float16 fprop_dtype).
    bytes_per = tf.as_dtype(p.dtype).size
    activation_dtype = base_layer.FPropDtype(p)
    before_params = before_sparse = before_sparse_bytes = 0
    if p.before_tpl:
        before_meta, _ = sequential.ChainMeta(p.before_tpl, *shapes)
        before_params = before_meta.num_params
        before_sparse = before_meta.sparse_params
        before_sparse_bytes = before_meta.sparse_gradient_bytes
        shapes = base_layer.AsArgs(before_meta.out_shapes)
    num = len(cells)
    plan = []
    for k, layers in enumerate(cells):
        meta, layer_metas = sequential.ChainMeta(layers, *shapes)
        # A skip a cell only carries is sent past it (held by the cell that reads it).
        passed = sequential.ChainPassed(layers)
        input_bytes = base_layer.OutputBytes(
            [s for i, s in enumerate(base_layer.FlattenShapes(shapes)) if i not in passed],
            activation_dtype)
        output_bytes = base_layer.OutputBytes(meta.out_shapes, activation_dtype)
        layer_outputs = [base_layer.OutputBytes(layer.out_shapes, activation_dtype)
                         for layer in layer_metas]
        if k == 0:
            pipeline_input_bytes = input_bytes
        shapes = base_layer.AsArgs(meta.out_shapes)
        remat = pipeline_plan.recompute[k]
        own = (meta.num_params + (before_params if k == 0 else 0)) * bytes_per
        # A tied weight read from another layer's variable (`tied_weights`): its value read
        # here and its dense gradient, counted as on another cell's device; no slots.
        params = own + meta.tied_params * bytes_per
        # The backward holds an activation's gradient and the gradient it computes from it,
        # an inference forward an activation and the next: two of the largest boundary
        # between the cell's layers.
        transient = 2 * max([input_bytes] + layer_outputs) // m
        # Its weights cast to fprop_dtype, as its layers read them.
        weight_copy = (params * activation_dtype.size // bytes_per
                       if activation_dtype != tf.as_dtype(p.dtype) else 0)
        sparse = (meta.sparse_params + (before_sparse if k == 0 else 0)) * bytes_per
        sizes = _MicroBatchBytes(
            params=params, slots=slots_per_param * own, num_micro_batches=m,
            dense_gradients=params - sparse,
            sparse_gradient=(meta.sparse_gradient_bytes +
                             (before_sparse_bytes if k == 0 else 0)) // m,
            # What the forward keeps for the backward: the cell's input, and every layer's
            # output unless re-materializing (less the cell's own output, which is the next
            # cell's input, or the pipeline's output: counted there). Inference keeps none.
            kept=(input_bytes + (0 if remat else max(meta.activation_bytes - output_bytes, 0)))
            // m if training else 0,
            input=input_bytes // m,
            activations=meta.activation_bytes // m,  # Recomputed or kept.
            transient=transient,
            weight_copy=weight_copy,
            # A training forward's working set is smaller than its backward's: not counted.
            forward_working=0 if training else transient + weight_copy,
            # Inference keeps no input for a backward; the first cell's micro-batches that
            # have not run yet still hold their split copies, and the last cell's outputs are
            # joined into the mini-batch's at the end (both with M > 1).
            pending_input=input_bytes // m if not training and k == 0 and m > 1 else 0,
            joins_output=not training and k == num - 1 and m > 1,
            # A split backward's I keeps for W the forward's activations (made at F, or re-made
            # by I when re-materializing) and each layer's output gradient.
            window=(input_bytes + max(meta.activation_bytes - output_bytes, 0)
                    + sum(layer_outputs)) // m,
            output=output_bytes if k == num - 1 else 0,
            whole_batch_loss=sched.forward_first)
        plan.append(_CellMemory(k, remat, sizes, [
            a for a in sched.actions[sched.DeviceOf(k)] if a.stage == k]))
    return MemoryPlan(cells=plan, num_micro_batches=m, batch_size=batch,
                      slots_per_param=slots_per_param, input_bytes=pipeline_input_bytes,
                      schedule=sched, input_cast=p.fprop_dtype is not None)


@dataclasses.dataclass(frozen=True)
class _MicroBatchBytes:
    """A cell's weights, and what one micro-batch holds on it at each point of its life."""
    params: int
    slots: int
    num_micro_batches: int
    dense_gradients: int  # The sum of its dense weight gradients (the weights' size).
    sparse_gradient: int  # What each micro-batch's weight gradients add to its sparse ones.
    kept: int  # From its forward until its backward (B or I) starts.
    input: int  # Its input, while its backward runs.
    activations: int  # Its activations, recomputed or kept, while its backward runs.
    transient: int  # Two activation gradients, while its backward runs.
    weight_copy: int  # Its weights in fprop_dtype, while its backward runs (0 without one).
    forward_working: int  # What a running forward holds (counted in inference only).
    pending_input: int  # Inference: a micro-batch's input until its forward (cell 0).
    joins_output: bool  # Inference: whether the outputs are joined after the last forward.
    window: int  # From a split backward's I to its W.
    output: int  # The pipeline's output for the mini-batch: the last cell's, else 0.
    whole_batch_loss: bool  # Whether the loss reads the whole batch's output at once.


def _CellMemory(cell: int, remat: bool, sizes: _MicroBatchBytes, actions: list) -> CellMemory:
    """Walks the cell's actions in its device's order: what it holds at the start and at the
    end of each, as (gradients, stored, working); the cell's peak is the largest (the first
    of equals)."""
    waiting = window = forwarded = consumed = 0  # consumed: backwards (B or I) done.
    summed = 0  # Micro-batches whose weight gradients were summed (B or W done).
    has_gradients = False

    def Output():
        if sizes.whole_batch_loss:
            alive = forwarded if consumed < sizes.num_micro_batches else 0
        else:
            alive = forwarded - consumed
        return sizes.output * alive // sizes.num_micro_batches

    def Point(working=0, running=False, gradients=None, summing=0):
        """(gradients, stored, working) with `summing` more micro-batches' weight gradients
        being summed."""
        if gradients is None:
            gradients = has_gradients
        # A running backward's micro-batch holds its input; its activations are working.
        waiting_kept = waiting - 1 if running else waiting
        stored = (waiting_kept * sizes.kept + (sizes.input if running else 0)
                  + window * sizes.window + Output())
        if sizes.pending_input:  # The running forward's input is in its working set.
            stored += (sizes.num_micro_batches - forwarded - (1 if working else 0)
                       ) * sizes.pending_input
        if sizes.joins_output and forwarded == sizes.num_micro_batches:
            stored += sizes.output
        grads = (sizes.dense_gradients + (summed + summing) * sizes.sparse_gradient
                 if gradients else 0)
        return grads, stored, working

    base = sizes.params + sizes.slots
    profile, points, backwards = [], [], []
    before_backward = None
    for action in actions:
        backward = action.kind in (schedule_lib.BACKWARD, schedule_lib.INPUT_GRAD)
        if backward:
            if before_backward is None:
                before_backward = sum(points[-1])
            # A fused backward's first weight gradients are allocated as its activations are
            # freed: it holds the larger of the two. A split I computes no weight gradient.
            fused_first = action.kind == schedule_lib.BACKWARD and not has_gradients
            working = (max(sizes.activations, sizes.dense_gradients) if fused_first
                       else sizes.activations) + sizes.transient + sizes.weight_copy
            start = Point(working, running=True)
            backwards.append(start)
        elif action.kind == schedule_lib.WEIGHT_GRAD:
            # The first W allocates the sum as it goes; a sparse one grows by its rows.
            start = Point(gradients=True, summing=1)
        else:
            start = Point(sizes.forward_working if action.kind == schedule_lib.FORWARD else 0)
        if action.kind == schedule_lib.FORWARD:
            waiting += 1
            forwarded += 1
        if backward:
            waiting -= 1
            consumed += 1
        if action.kind == schedule_lib.INPUT_GRAD:
            window += 1
        if action.kind == schedule_lib.WEIGHT_GRAD:
            window -= 1
        if action.kind in (schedule_lib.BACKWARD, schedule_lib.WEIGHT_GRAD):
            has_gradients = True
            summed += 1
        end = Point()
        points += [start, end]
        profile.append((action, base + sum(start), base + sum(end)))
    gradients, stored, working = max(points, key=sum)
    if before_backward is None:  # A forward-only schedule.
        before_backward = sum(points[-1])
    return CellMemory(
        cell=cell, params=sizes.params, gradients=gradients, slots=sizes.slots,
        stored_activations=stored, working_activations=working, recompute=remat,
        before_backward=base + before_backward, after_backward=base + sum(points[-1]),
        during_backward=tuple(base + g + s for g, s, _ in backwards),
        working_by_micro_batch=tuple(w for _, _, w in backwards), profile=tuple(profile))


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
    batch = fields.BatchSize(p)
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
