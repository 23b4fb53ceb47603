"""A pipeline schedule compiled into the graph: any valid action list, one executor.

`UnrolledSchedule` walks a `schedule.Schedule`'s actions in their build order (`Schedule.order`)
and builds each under its stage's device: F calls the stage's traced forward on a micro-batch
and keeps what its backward needs (its input when re-materializing, else its forward's call,
which B differentiates); B runs the stage's backward (recompute, then gradients); I and W, the
split backward of zero-bubble schedules, run the input gradient and, later, the weight
gradient, as the parts of the cell's traced gradient (`residuals.SplitCell`, which the loop
runs too): F keeps the residuals I reads, or I re-runs the forward once on a re-materializing
stage, and I keeps what W reads. Each device
runs its actions in its list's order: every action waits (a control dependency) for what the
device's previous action produced. Weight gradients are summed over micro-batches on the
stage's device as they come; a sparse one (a gather's IndexedSlices) stays sparse
(`gradient_sums`). A batch known only when the step runs may leave micro-batches empty (fewer
examples than M): each action then runs inside a tf.cond that skips it for no example, so no
layer runs on zero examples; a stage that keeps its activations then keeps them as residuals
(`residuals.SplitCell`), which pass through the tf.cond, instead of differentiating its
forward's call.

What an executor offers, whichever runs the step (this one, or `looped.LoopedSchedule`, which
runs the schedule's clock as a loop), is stated once, as the protocol `Executor`. Two ways to
run a step:
  * `Forward` then `Backward(d_outputs)`: the loss is computed after the pipeline on the whole
    batch, so every forward precedes every backward; for `forward_first` schedules (gpipe) and
    inference.
  * `ForwardBackward(thetas, inputs, loss_fn, loss_inputs)`: the loss is computed per
    micro-batch on the last stage as soon as its forward is done, so backwards can start
    before the last forward (1f1b, interleaved, zero-bubble; any schedule).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Protocol, Sequence

import tensorflow as tf

from gpipe_tf.pipeline import gradient_sums
from gpipe_tf.pipeline import leaves
from gpipe_tf.pipeline import microbatch
from gpipe_tf.pipeline import recompute
from gpipe_tf.pipeline import schedule as schedule_lib
from gpipe_tf.pipeline import unfolded

F, B, I, W = (schedule_lib.FORWARD, schedule_lib.BACKWARD, schedule_lib.INPUT_GRAD,
              schedule_lib.WEIGHT_GRAD)
# The name-scope part of each action kind (`OpScope`).
PARTS = {F: 'fwd', B: 'bwd', I: 'bwd_input', W: 'bwd_weight'}


def OpScope(cell: int, micro_batch: int, part: str) -> str:
    """The name scope of one (cell, micro-batch) piece of the schedule: `part` is 'fwd', 'bwd',
    'bwd_input', 'bwd_weight', 'loss' or 'grad_sum'. Traces read (cell, micro-batch, kind)
    back from op names through it (`perf/trace.py`); a re-materializing backward's recompute is
    under a further 'recompute' scope (`recompute.RECOMPUTE_SCOPE`)."""
    return f'cell_{cell}_mb_{micro_batch}_{part}'


def _Done(tensors, device: str) -> list:
    """Ops that run once `tensors` exist, for control dependencies on them.

    A control dependency on a function call's output waits for the call's stateful ops only,
    once the call is inlined (measured: a traced step ran a cell's micro-batches out of order),
    so the wait is on identities of the values themselves.
    """
    with tf.device(device), tf.name_scope('done'):
        return [tf.identity(x) for x in tf.nest.flatten(tensors) if x is not None]


def CheckForwardFirst(sched: schedule_lib.Schedule) -> None:
    """Raises ValueError unless every forward of `sched` precedes every backward, as a loss
    computed after the pipeline needs."""
    if not sched.forward_first:
        raise ValueError(f'Schedule {sched.kind!r} runs backwards before the last forward: the '
                         'loss must be computed per micro-batch inside the pipeline '
                         '(ForwardBackward).')


def MicroBatchLoss(loss_fn, outputs, loss_inputs, loss_scale=None):
    """The loss of one micro-batch inside the pipeline.

    Args:
      loss_fn: (outputs, loss_inputs) -> (value, weight), a mean over `weight` items.
      outputs, loss_inputs: the micro-batch's.
      loss_scale: None, or a scalar the gradient is taken of the loss times (dynamic loss
        scaling: the backward, in float16, then runs on gradients that large).

    Returns:
      (value * weight, weight, the gradient of value * weight (times loss_scale) w.r.t. the
      float leaves of `outputs`, in their dtypes).
    """
    ys = leaves.FloatLeaves(outputs)
    with tf.GradientTape(watch_accessed_variables=False) as tape:
        tape.watch(ys)
        value, weight = loss_fn(leaves.Identity(outputs), loss_inputs)
        weight = tf.stop_gradient(tf.cast(weight, value.dtype))
        # A micro-batch of no weight (every token padding) may have a NaN mean.
        total = tf.math.multiply_no_nan(value, weight)
        scaled = total if loss_scale is None else total * tf.cast(loss_scale, total.dtype)
    # From a constant 1, the loss's gradient up to its first data-dependent op (a mean's
    # broadcast 1 / N) would be folded into a constant of the outputs' size per micro-batch
    # (`unfolded`): 16 MiB held at a batch of 4096 x 1024 outputs, whatever M.
    seed = unfolded.Scalar(1, scaled.dtype)
    return total, weight, tape.gradient(scaled, ys, output_gradients=seed,
                                        unconnected_gradients=tf.UnconnectedGradients.ZERO)


def AssignNest(assign, cell: int, nest):
    """Every tensor of `nest` (None leaves stay None) assigned to logical device `cell`.

    Args:
      assign: a function (tensor, k) -> tensor (`PipeliningLayer.Params().logical_device_fn`),
        or None, which returns `nest` itself.
      cell: k, the logical device.
      nest: tensors, IndexedSlices (each of their tensors assigned) or None, in any tf.nest
        structure.
    """
    if assign is None:
        return nest
    return tf.nest.map_structure(
        lambda x: gradient_sums.Placed(x, lambda t: assign(t, cell)), nest)


def AssignWeights(assign, cell: int, theta):
    """A cell's theta (weights) assigned to logical device `cell` as `AssignNest` assigns, their
    gradients passed back as they come, assigned alike: an IndexedSlices (a gather's) stays
    sparse, where the gradient of XLA's sharding op would make it dense."""
    if assign is None:
        return theta

    def Assigned(weight):
        @tf.custom_gradient
        def Assign(x):
            def Grad(dy):
                with tf.name_scope(f'cell_{cell}_weight_grad'):
                    return gradient_sums.Placed(dy, lambda g: assign(g, cell))
            return assign(x, cell), Grad
        return Assign(weight)

    return tf.nest.map_structure(lambda x: None if x is None else Assigned(x), theta)


def _SumStats(per_micro_batch: list) -> list:
    """Sums each layer's training statistics over the micro-batches."""
    if not per_micro_batch or not per_micro_batch[0]:
        return []
    return [tf.nest.map_structure(lambda *xs: tf.add_n(list(xs)), *layer_stats)
            for layer_stats in zip(*per_micro_batch)]


class Executor(Protocol):
    """Runs one step of a pipeline of S stages (cells) over M micro-batches, in the order of a
    schedule: what `UnrolledSchedule` and `looped.LoopedSchedule` both are, and what
    `PipeliningLayer` chooses between (`Plan.Loops`). An executor runs one step: `Forward`
    (then, in training, `Backward`), or `ForwardBackward`.

    Args:
      functions: each stage's `recompute.CellFunctions` (which carry its device).
      recomputes: per stage, whether its backward re-materializes its forward.
      sched: the `schedule.Schedule` (its num_stages must be S).
      batch_dim: the dimension micro-batches are split along.
      step: the training step (scalar int64 tensor), for the layers' randomness.
      assign: None, or a function (tensor, k) -> tensor assigning a tensor to logical device k
        (XLA model parallelism); then each cell's inputs, outputs, incoming and outgoing
        gradients are assigned to the cell's logical device: its device in the schedule
        (`Schedule.DeviceOf`; cell % K with v virtual stages).
      first_example: the index in the mini-batch of the first example of the batch this
        schedule runs (a replica's shard starts further on); micro-batch m starts at
        first_example plus the examples before it (`microbatch.Starts`: equal micro-batches
        where M divides the batch). The layers draw their randomness per example from it.
    """

    def __init__(self, functions: Sequence[recompute.CellFunctions], recomputes: Sequence[bool],
                 sched: schedule_lib.Schedule, batch_dim: int, step: tf.Tensor,
                 assign: Callable[[tf.Tensor, int], tf.Tensor] | None = None,
                 first_example: Any = 0) -> None:
        ...

    @property
    def schedule(self) -> schedule_lib.Schedule:
        """The schedule the step runs."""
        ...

    def Forward(self, thetas: list, inputs, training: bool = True) -> tuple[Any, list]:
        """Runs the schedule's forwards (all of them first: the loss comes after).

        Args:
          thetas: per cell, its theta.
          inputs: the mini-batch (tensor or nest of tensors).
          training: whether to run training passes (and record for `Backward`).

        Returns:
          (outputs on the last device, per cell the list of its layers' summed statistics).

        Raises:
          ValueError: for training under a schedule that is not forward-first.
        """

    def Backward(self, d_outputs) -> tuple[list, Any]:
        """Runs the schedule's backwards for gradients `d_outputs` of `Forward`'s outputs.

        Args:
          d_outputs: like the outputs; None for leaves that are not floating point.

        Returns:
          (per cell the flat list of its theta's gradients, None for non-trainable leaves;
          d_inputs like the inputs).
        """

    def ForwardBackward(self, thetas: list, inputs, loss_fn, loss_inputs=None,
                        loss_scale=None) -> tuple[Any, list, tuple, list, Any]:
        """Runs every action of the schedule, the loss per micro-batch on the last stage.

        Args:
          thetas: per cell, its theta.
          inputs: the mini-batch (tensor or nest of tensors).
          loss_fn: (outputs, loss_inputs) of one micro-batch -> (value, weight): a mean over
            `weight` items (a task's `loss` metric); the step's loss is the weighted mean over
            micro-batches, sum(value * weight) / sum(weight).
          loss_inputs: a nest split into micro-batches along batch_dim like the inputs and
            given to loss_fn with each micro-batch's outputs (labels, weights); or None.
          loss_scale: None, or a scalar the gradients are taken of the loss times
            (`MicroBatchLoss`).

        Returns:
          (outputs on the last device, per cell its layers' summed statistics,
          (sum over micro-batches of value * weight, sum of weight),
          per cell the flat gradients of sum(value * weight) (times loss_scale) w.r.t. its
          theta, the gradient of the same w.r.t. the inputs).
        """


class UnrolledSchedule:
    """An `Executor` that adds every action of the schedule to the graph, in its build order.

    Args: as `Executor`; `sched` may also be M, for gpipe's schedule.

    Raises:
      ValueError: for a schedule of another number of stages.
    """

    def __init__(self, functions, recomputes, sched, batch_dim, step, assign=None,
                 first_example=0):
        if isinstance(sched, int):
            sched = schedule_lib.Make('gpipe', len(functions), sched)
        if sched.num_stages != len(functions):
            raise ValueError(f'The schedule has {sched.num_stages} stages; the pipeline has '
                             f'{len(functions)} cells.')
        self._functions = functions
        self._devices = [f.device for f in functions]
        self._recomputes = list(recomputes)
        self._schedule = sched
        self._num_cells = len(functions)
        self._num_micro_batches = sched.num_micro_batches
        self._batch_dim = batch_dim
        self._step = step
        self._assign = assign
        self._first_example = first_example
        self._first_examples = None  # Per micro-batch, set by _Start.
        self._sizes = None  # Per micro-batch its examples (`microbatch.Sizes`), set by _Start.

    @property
    def schedule(self) -> schedule_lib.Schedule:
        return self._schedule

    def _Assign(self, k: int, nest):
        if self._assign is None:
            return nest
        with tf.device(self._devices[k]):
            return AssignNest(self._assign, self._schedule.DeviceOf(k), nest)

    def _Grid(self):
        return [[None] * self._num_micro_batches for _ in range(self._num_cells)]

    # ---- running a step ---------------------------------------------------------------------
    def Forward(self, thetas: list, inputs, training: bool = True):
        """As `Executor.Forward`: (outputs, per cell its summed statistics)."""
        if training:
            CheckForwardFirst(self._schedule)
        self._Start(thetas, inputs, training)
        self._Run([a for a in self._schedule.order if a.kind == F])
        return self._Outputs(), self._Updates()

    def Backward(self, d_outputs):
        """As `Executor.Backward`: (per cell its flat weight gradients, d_inputs)."""
        with tf.device(self._devices[-1]):
            d_acts = microbatch.Split(d_outputs, self._num_micro_batches, self._batch_dim)
        for m, d in enumerate(d_acts):
            self._d_acts[-1][m] = d
        self._last = [[] for _ in range(self._schedule.num_devices)]
        self._Run([a for a in self._schedule.order if a.kind != F])
        return self._Gradients()

    def ForwardBackward(self, thetas: list, inputs, loss_fn, loss_inputs=None,
                        loss_scale=None):
        """As `Executor.ForwardBackward`: (outputs, per cell its summed statistics, (loss
        total, weight), per cell its flat weight gradients, d_inputs)."""
        self._Start(thetas, inputs, training=True)
        m_count = self._num_micro_batches
        with tf.device(self._devices[-1]):
            self._loss_inputs = (microbatch.Split(loss_inputs, m_count, self._batch_dim)
                                 if loss_inputs is not None else [None] * m_count)
        self._loss_fn = loss_fn
        self._loss_scale = loss_scale
        self._Run(self._schedule.order)
        with tf.device(self._devices[-1]), tf.name_scope('loss_sum'):
            total = tf.add_n([v for v, _ in self._losses])
            weight = tf.add_n([w for _, w in self._losses])
        d_thetas, d_inputs = self._Gradients()
        return self._Outputs(), self._Updates(), (total, weight), d_thetas, d_inputs

    # ---- the actions ------------------------------------------------------------------------
    def _Start(self, thetas, inputs, training):
        m_count, batch_dim = self._num_micro_batches, self._batch_dim
        self._training = training
        with tf.device(self._devices[0]):
            first = microbatch.Split(inputs, m_count, batch_dim)
            batch_size = microbatch.RunBatchSize(inputs, batch_dim)
            starts = microbatch.Starts(batch_size, m_count)
            self._first_examples = [tf.cast(self._first_example, tf.int64) + start
                                    for start in starts]
            self._sizes = microbatch.Sizes(batch_size, m_count)
        # A batch known only when the step runs may leave micro-batches empty (fewer examples
        # than M): each action then runs in a tf.cond that skips it for no example
        # (`_UnlessEmpty`). A static batch is split into no empty micro-batch
        # (`schedule.FirstMicroBatches`).
        self._dynamic = not isinstance(batch_size, int)
        self._acts = [first] + self._Grid()  # Stage s's input of micro-batch m: acts[s][m].
        self._stats = self._Grid()
        self._thetas = list(thetas)
        self._inputs = self._Grid()  # Differentiation sources of each (cell, micro-batch).
        self._outputs = self._Grid()
        self._d_acts = self._Grid()  # Gradient of stage s's output of micro-batch m.
        self._d_inputs = [None] * m_count  # Gradient of the pipeline's input, per micro-batch.
        self._d_thetas = [None] * self._num_cells  # Per cell, the running gradient sum.
        self._saved = self._Grid()  # Per (cell, micro-batch), what I keeps for W.
        self._kept = self._Grid()  # Per (cell, micro-batch), the residuals its forward kept.
        # A split backward's forward, I and W: the parts of the cell's traced gradient, joined
        # by residuals (`residuals.SplitCell`), as the loop runs them. Made at a cell's first
        # training forward, for its input's spec.
        self._last = [[] for _ in range(self._schedule.num_devices)]
        self._loss_fn = None  # Set by ForwardBackward: the loss per micro-batch.
        self._loss_scale = None  # Set by ForwardBackward.
        self._loss_inputs = [None] * m_count
        self._losses = [None] * m_count  # Per micro-batch (value * weight, weight).
        # Cells that keep their activations are recorded on a tape for their backward when
        # executing eagerly (nothing else remembers the ops there). A graph differentiates the
        # forward's call op with tf.gradients, and must not record it: a call recorded on a
        # tape returns every intermediate the backward needs as an output, and tf.gradients
        # then feeds each of those a zeros_like gradient, which grappler's constant folding
        # turned into constants of the activations' and weights' sizes per micro-batch, held as
        # long as the step's function lives (576 MiB at K=4, M=32 of 8 x 1024 dense layers,
        # recompute "never"). Unrecorded, the call is rewritten to output them only when its
        # gradient is built, and gets no zeros.
        self._tape = (tf.GradientTape(persistent=True, watch_accessed_variables=False)
                      if tf.executing_eagerly() else None)

    def _Run(self, actions):
        for action in actions:
            k, m = action.stage, action.micro_batch
            device = self._schedule.DeviceOf(k)
            # A device works on one action at a time, in its list's order: each waits for
            # what the device's previous action produced.
            previous = _Done(self._last[device], self._devices[k])
            with tf.control_dependencies(previous), tf.name_scope(
                    OpScope(k, m, PARTS[action.kind])):
                produced, d_theta = {F: self._F, B: self._B, I: self._I, W: self._W}[
                    action.kind](k, m)
            if d_theta is not None:
                self._Sum(k, m, d_theta)
                # The next action also waits for this weight gradient to be summed, so at
                # most one micro-batch's weight gradient per cell is alive.
                produced = [produced, self._d_thetas[k]]
            self._last[device] = produced

    def _UnlessEmpty(self, m, run, carried=lambda built: ()):
        """`run()`'s (carried, new) values, skipped for an empty micro-batch m (a batch known
        only when the step runs, smaller than M): `microbatch.UnlessEmpty`."""
        return microbatch.UnlessEmpty(self._sizes[m], run, carried)

    def _Fused(self, k) -> bool:
        """Whether cell k's training backward differentiates its forward's call (kept
        activations, unsplit backward): not for a batch known only when the step runs, whose
        empty micro-batches are skipped inside a tf.cond that tf.gradients would have to look
        into; its forward then keeps its residuals explicitly (`residuals.SplitCell`), as a
        split backward's does."""
        return (self._training and not self._recomputes[k] and not self._schedule.splits_backward
                and not self._dynamic)

    def _F(self, k, m):
        fn, first = self._functions[k], self._first_examples[m]
        keeps = self._training and not self._recomputes[k]
        if self._Fused(k):
            # Fresh identities as differentiation sources: tf.gradients would otherwise also
            # differentiate the op that produced them (the previous cell's call).
            with self._tape or contextlib.nullcontext(), tf.device(self._devices[k]):
                if m == 0:
                    self._thetas[k] = leaves.Identity(self._thetas[k])
                self._inputs[k][m] = leaves.Identity(self._Assign(k, self._acts[k][m]))
                if self._tape:
                    self._tape.watch(tf.nest.flatten(self._thetas[k]) +
                                     leaves.FloatLeaves(self._inputs[k][m]))
        else:
            self._inputs[k][m] = self._Assign(k, self._acts[k][m])
        last = k == self._num_cells - 1 and self._loss_fn is not None

        def Run():
            kept = None
            with self._tape if self._Fused(k) and self._tape else contextlib.nullcontext():
                if keeps and not self._Fused(k):  # The backward reads the residuals it keeps.
                    outputs, stats, kept = self._Split(k, m).Forward(
                        self._thetas[k], self._inputs[k][m], self._step, first)
                else:
                    outputs, stats = fn.Forward(self._thetas[k], self._inputs[k][m], self._step,
                                                first, training=self._training)
            outputs = self._Assign(k, outputs)
            new = {'outputs': outputs, 'stats': stats, 'kept': kept}
            if last:
                with tf.device(self._devices[k]), tf.name_scope('loss'):
                    new['loss'] = MicroBatchLoss(self._loss_fn, outputs, self._loss_inputs[m],
                                                 self._loss_scale)
            return (), new

        _, new = self._UnlessEmpty(m, Run)
        self._acts[k + 1][m] = self._outputs[k][m] = new['outputs']
        self._stats[k][m] = new['stats']
        self._kept[k][m] = new['kept']
        if last:
            total, weight, self._d_acts[k][m] = new['loss']
            self._losses[m] = (total, weight)
            return [new['outputs'], self._d_acts[k][m]], None
        return new['outputs'], None

    def _IncomingGradient(self, k, m):
        return self._Assign(k, leaves.FloatLeaves(self._d_acts[k][m]))

    def _PassOn(self, k, m, d_x):
        """Hands the input gradient of (k, m) to the previous stage (or the pipeline's input)."""
        d_x = tf.nest.pack_sequence_as(self._inputs[k][m], d_x)
        if k:
            self._d_acts[k - 1][m] = d_x
        else:
            self._d_inputs[m] = d_x

    def _Sum(self, k, m, d_theta):
        # A running sum in schedule order, freed as it goes, instead of one add_n that keeps
        # all M gradients alive. Sparse gradients (an embedding's gather) stay IndexedSlices
        # (`gradient_sums`). The sum is in the variables' dtype (float32) under any
        # fprop_dtype: a cell casts its weights inside its traced function
        # (`BaseLayer.ToFPropDtype`), so each micro-batch's gradient comes back through that
        # cast in the dtype of theta.
        with tf.device(self._devices[k]), tf.name_scope(OpScope(k, m, 'grad_sum')):
            if self._d_thetas[k] is None:
                self._d_thetas[k] = list(d_theta)
            else:
                self._d_thetas[k] = [gradient_sums.Add(a, b)
                                     for a, b in zip(self._d_thetas[k], d_theta)]

    def _NoGradient(self, k):
        """The `carried` of an action that gives cell k's weight gradients (`_UnlessEmpty`):
        for an empty micro-batch, gradients that add nothing, of the kinds the action's are
        (dense zeros, or IndexedSlices of no row)."""
        weights = tf.nest.flatten(self._thetas[k])
        return lambda built: [None if g is None else gradient_sums.Zero(w, g)
                              for w, g in zip(weights, built)]

    def _B(self, k, m):
        def Run():
            d_y = self._IncomingGradient(k, m)
            if self._recomputes[k]:
                d_theta, d_x = self._functions[k].Backward(
                    self._thetas[k], self._inputs[k][m], self._step, self._first_examples[m],
                    d_y)
            elif not self._Fused(k):
                d_theta, d_x = self._Split(k, m).Backward(
                    self._thetas[k], self._kept[k][m], self._step, self._first_examples[m],
                    d_y)
            else:
                with tf.device(self._devices[k]):
                    d_theta, d_x = recompute.Differentiate(
                        self._outputs[k][m], self._thetas[k], self._inputs[k][m], d_y,
                        self._functions[k].trainable, tape=self._tape)
            return self._Assign(k, (d_theta, d_x))

        d_theta, d_x = self._UnlessEmpty(m, Run, self._NoGradient(k))
        self._kept[k][m] = None
        self._PassOn(k, m, d_x)
        # The next action waits for this one's input gradient (the first cell's is left out:
        # nothing may need it, and waiting would force it to be computed).
        return (d_x if k else None), d_theta

    def _Split(self, k, m):
        """Cell k's split for micro-batch m's input: uneven micro-batches (a batch M does not
        divide) come in two sizes, each traced once (`CellFunctions.Split` keeps them)."""
        return self._functions[k].Split(self._thetas[k], leaves.Specs(self._inputs[k][m]),
                                         tf.TensorSpec([], tf.int64))

    def _I(self, k, m):
        def Run():
            d_y = self._IncomingGradient(k, m)
            kept, first = self._kept[k][m], self._first_examples[m]
            if kept is None:
                # A re-materializing stage runs its forward once more, here, when the incoming
                # gradient exists, for the residuals; its statistics were the first forward's.
                with tf.device(self._devices[k]), tf.name_scope(recompute.RECOMPUTE_SCOPE):
                    with tf.control_dependencies(d_y):
                        inputs = leaves.Identity(self._inputs[k][m])
                    _, _, kept = self._Split(k, m).Forward(self._thetas[k], inputs, self._step,
                                                           first)
            d_x, saved = self._Split(k, m).Input(self._thetas[k], kept, self._step, first, d_y)
            return (), (self._Assign(k, d_x), saved)

        _, (d_x, self._saved[k][m]) = self._UnlessEmpty(m, Run)
        self._kept[k][m] = None
        self._PassOn(k, m, d_x)
        return [d_x if k else None, self._saved[k][m]], None

    def _W(self, k, m):
        def Run():
            d_theta = self._Split(k, m).Weight(self._thetas[k], self._saved[k][m], self._step,
                                               self._first_examples[m])
            return self._Assign(k, d_theta), ()

        d_theta, _ = self._UnlessEmpty(m, Run, self._NoGradient(k))
        self._saved[k][m] = None
        return None, d_theta

    # ---- results ----------------------------------------------------------------------------
    def _Joined(self, micro_batches):
        """The micro-batches' nests joined along the batch (`microbatch.Concat`)."""
        return microbatch.Concat(micro_batches, self._batch_dim,
                                 self._sizes if self._dynamic else None)

    def _Outputs(self):
        with tf.device(self._devices[-1]):
            return self._Joined(self._acts[-1])

    def _Updates(self) -> list:
        updates = []
        for k in range(self._num_cells):
            with tf.device(self._devices[k]), tf.name_scope(f'cell_{k}_stats'):
                # A skipped micro-batch's statistics are zeros (`_UnlessEmpty`).
                updates.append(self._Assign(k, _SumStats(self._stats[k])) if self._training
                               else [])
        return updates

    def _Gradients(self):
        with tf.device(self._devices[0]):
            return self._d_thetas, self._Joined(self._d_inputs)
