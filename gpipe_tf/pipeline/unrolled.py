"""The unrolled executor: every action of a schedule added to the graph, any valid action list.

`UnrolledSchedule` walks a `schedule.Schedule`'s actions in their build order (`Schedule.order`)
and builds each under its stage's device: F calls the stage's traced forward on a micro-batch
and keeps what its backward needs (its input when re-materializing, else its forward's call,
which B differentiates); B runs the stage's backward (recompute, then gradients); I and W, the
split backward of zero-bubble schedules, run the input gradient and, later, the weight
gradient, as the parts of the cell's traced gradient (`cell.CellSplit`, which the loop
runs too): F keeps the residuals I reads, or I re-runs the forward once on a re-materializing
stage, and I keeps what W reads. Each device
runs its actions in its list's order: every action waits (a control dependency) for what the
device's previous action produced. Weight gradients are summed over micro-batches on the
stage's device as they come; a sparse one (a gather's IndexedSlices) stays sparse
(`gradient_sums`). A batch known only when the step runs may leave micro-batches empty (fewer
examples than M): each action then runs inside a tf.cond that skips it for no example, so no
layer runs on zero examples; a stage that keeps its activations then keeps them as residuals
(`cell.CellSplit`), which pass through the tf.cond, instead of differentiating its
forward's call.

A tensor a stage gives on unread (`Cell.passed_leaves`: a skip from stage 0 to stage 3 that
stages 1 and 2 only carry) is not given to those stages: their calls take None in its place,
and the reader's forward takes the tensor stage 0 made, so TensorFlow sends it from device 0 to
device 3 and nothing of it goes to devices 1 and 2; its gradient goes from stage 3's backward to
stage 0's the same way.
"""

from __future__ import annotations

import contextlib

import tensorflow as tf

from gpipe_tf.pipeline import cell as cell_lib
from gpipe_tf.pipeline import executor
from gpipe_tf.pipeline import gradient_sums
from gpipe_tf.pipeline import leaves
from gpipe_tf.pipeline import microbatch
from gpipe_tf.pipeline import schedule as schedule_lib

F, B, I, W = (schedule_lib.FORWARD, schedule_lib.BACKWARD, schedule_lib.INPUT_GRAD,
              schedule_lib.WEIGHT_GRAD)


def _Done(tensors, device: str) -> list:
    """Ops that run once `tensors` exist, for control dependencies on them.

    A control dependency on a function call's output waits for the call's stateful ops only,
    once the call is inlined (measured: a traced step ran a cell's micro-batches out of order),
    so the wait is on identities of the values themselves.
    """
    with tf.device(device), tf.name_scope('done'):
        return [tf.identity(x) for x in tf.nest.flatten(tensors) if x is not None]


def _SumStats(per_micro_batch: list) -> list:
    """Sums each layer's training statistics over the micro-batches."""
    if not per_micro_batch or not per_micro_batch[0]:
        return []
    return [tf.nest.map_structure(lambda *xs: tf.add_n(list(xs)), *layer_stats)
            for layer_stats in zip(*per_micro_batch)]


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
        # Per cell, the input leaves it gives on unread (a skip a stage only carries): sent
        # from the cell that made them straight to the one that reads them (`_Read`, `_Given`).
        self._passed = [f.cell.passed_leaves for f in functions]
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
            return executor.AssignNest(self._assign, self._schedule.DeviceOf(k), nest)

    def _Grid(self):
        return [[None] * self._num_micro_batches for _ in range(self._num_cells)]

    # ---- running a step ---------------------------------------------------------------------
    def Forward(self, thetas: list, inputs, training: bool = True):
        """As `Executor.Forward`: (outputs, per cell its summed statistics)."""
        if training:
            executor.CheckForwardFirst(self._schedule)
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
        # by residuals (`cell.CellSplit`), as the loop runs them. Made at a cell's first
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
                    executor.OpScope(k, m, executor.PARTS[action.kind])):
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
        into; its forward then keeps its residuals explicitly (`cell.CellSplit`), as a
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
                self._inputs[k][m] = leaves.Identity(self._Assign(k, self._Read(k, m)))
                if self._tape:
                    self._tape.watch(tf.nest.flatten(self._thetas[k]) +
                                     leaves.FloatLeaves(self._inputs[k][m]))
        else:
            self._inputs[k][m] = self._Assign(k, self._Read(k, m))
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
                    new['loss'] = executor.MicroBatchLoss(self._loss_fn, self._Given(k, m, outputs),
                                                          self._loss_inputs[m],
                                                          self._loss_scale)
            return (), new

        _, new = self._UnlessEmpty(m, Run)
        self._outputs[k][m] = new['outputs']
        self._acts[k + 1][m] = self._Given(k, m, new['outputs'])
        self._stats[k][m] = new['stats']
        self._kept[k][m] = new['kept']
        if last:
            total, weight, self._d_acts[k][m] = new['loss']
            self._losses[m] = (total, weight)
            return [new['outputs'], self._d_acts[k][m]], None
        return new['outputs'], None

    def _Read(self, k, m):
        """Cell k's input of micro-batch m as the cell reads it: None for the leaves it gives
        on unread, which do not go to its device."""
        return leaves.WithNone(self._acts[k][m], self._passed[k])

    def _Given(self, k, m, outputs):
        """What cell k gives on for micro-batch m: its outputs, with the input leaves it passes
        unread in their place (the tensors themselves, on the device that made them)."""
        return leaves.PassedOn(outputs, self._acts[k][m], self._passed[k])

    def _IncomingGradient(self, k, m):
        """The gradients of cell k's float outputs of micro-batch m, those it gave on unread
        apart (`_PassOn` hands them back)."""
        return self._Assign(k, leaves.FloatLeaves(
            leaves.WithNone(self._d_acts[k][m], self._passed[k].values())))

    def _PassOn(self, k, m, d_x):
        """Hands the input gradient of (k, m) to the previous stage (or the pipeline's input):
        the cell's, and for each input leaf it gave on unread, its output leaf's gradient."""
        if self._passed[k]:
            d_y = tf.nest.flatten(self._d_acts[k][m])
            d_x = list(d_x)
            for i, o in self._passed[k].items():
                d_x[i] = d_y[o]
        d_x = tf.nest.pack_sequence_as(self._acts[k][m], d_x)
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
        with tf.device(self._devices[k]), tf.name_scope(executor.OpScope(k, m, 'grad_sum')):
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
                    d_theta, d_x = cell_lib.Differentiate(
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
                with tf.device(self._devices[k]), tf.name_scope(cell_lib.RECOMPUTE_SCOPE):
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
