"""The GPipe schedule unrolled into the graph: one step's forward and backward walks.

`UnrolledSchedule.Forward` walks `schedule.ForwardTicks`, calling cell k's traced forward on
micro-batch t - k at tick t under cell k's device, and keeps only what each cell's backward needs:
its input (re-materializing cells) or a tape of its forward (cells that keep activations).
`Backward` walks `schedule.BackwardTicks`, running every cell's backward under its device and
summing its weight gradients over the micro-batches there.
"""

from __future__ import annotations

import tensorflow as tf

from gpipe_tf.pipeline import microbatch
from gpipe_tf.pipeline import recompute
from gpipe_tf.pipeline import schedule


def OpScope(cell: int, micro_batch: int, part: str) -> str:
    """The name scope of one (cell, micro-batch) piece of the schedule: `part` is 'fwd', 'bwd'
    or 'grad_sum'. Traces read (cell, micro-batch, kind) back from op names through it
    (`perf/trace.py`); a re-materializing backward's recompute is under a further 'recompute'
    scope (`recompute.RECOMPUTE_SCOPE`)."""
    return f'cell_{cell}_mb_{micro_batch}_{part}'


def _Done(tensors, device: str) -> list:
    """Ops that run once `tensors` exist, for control dependencies on them.

    A control dependency on a function call's output waits for the call's stateful ops only,
    once the call is inlined (measured: a traced step ran a cell's micro-batches out of order),
    so the wait is on identities of the values themselves.
    """
    with tf.device(device), tf.name_scope('done'):
        return [tf.identity(x) for x in tf.nest.flatten(tensors) if x is not None]


def AssignNest(assign, cell: int, nest):
    """Every tensor of `nest` (None leaves stay None) assigned to logical device `cell`.

    Args:
      assign: a function (tensor, k) -> tensor (`PipeliningLayer.Params().logical_device_fn`),
        or None, which returns `nest` itself.
      cell: k, the logical device.
      nest: tensors, IndexedSlices (made dense) or None, in any tf.nest structure.
    """
    if assign is None:
        return nest
    # Sparse gradients (IndexedSlices) are made dense, as the gradient sums make them anyway.
    return tf.nest.map_structure(
        lambda x: None if x is None else assign(tf.convert_to_tensor(x), cell), nest)


def _SumStats(per_micro_batch: list) -> list:
    """Sums each layer's training statistics over the micro-batches."""
    if not per_micro_batch or not per_micro_batch[0]:
        return []
    return [tf.nest.map_structure(lambda *xs: tf.add_n(list(xs)), *layer_stats)
            for layer_stats in zip(*per_micro_batch)]


class UnrolledSchedule:
    """One step of a pipeline of K cells over M micro-batches.

    Args:
      functions: each cell's `recompute.CellFunctions` (which carry its device).
      recomputes: per cell, whether its backward re-materializes its forward.
      num_micro_batches: M.
      batch_dim: the dimension micro-batches are split along.
      step: the training step (scalar int64 tensor), for the layers' randomness.
      assign: None, or a function (tensor, k) -> tensor assigning a tensor to logical device k
        (XLA model parallelism); then each cell's inputs, outputs, incoming and outgoing
        gradients are assigned to the cell's logical device.
      first_example: the index in the mini-batch of the first example of the batch this
        schedule runs (a replica's shard starts further on); micro-batch m of n examples starts
        at first_example + m n. The layers draw their randomness per example from it.
    """

    def __init__(self, functions, recomputes, num_micro_batches, batch_dim, step, assign=None,
                 first_example=0):
        self._functions = functions
        self._devices = [f.device for f in functions]
        self._recomputes = list(recomputes)
        self._num_cells = len(functions)
        self._num_micro_batches = num_micro_batches
        self._batch_dim = batch_dim
        self._step = step
        self._assign = assign
        self._first_example = first_example
        self._first_examples = None  # Per micro-batch, set by Forward.

    def _Assign(self, k: int, nest):
        if self._assign is None:
            return nest
        with tf.device(self._devices[k]):
            return AssignNest(self._assign, k, nest)

    def _Grid(self):
        return [[None] * self._num_micro_batches for _ in range(self._num_cells)]

    def Forward(self, thetas: list, inputs, training: bool = True):
        """Runs the forward schedule.

        Args:
          thetas: per cell, its theta.
          inputs: the mini-batch (tensor or nest of tensors).
          training: whether to run training passes (and record for `Backward`).

        Returns:
          (outputs on the last device, per cell the list of its layers' summed statistics).
        """
        m_count, batch_dim = self._num_micro_batches, self._batch_dim
        with tf.device(self._devices[0]):
            acts = [microbatch.Split(inputs, m_count, batch_dim)] + self._Grid()
            size = microbatch.BatchSize(acts[0][0], batch_dim)
            if size is None:  # Not known statically.
                size = tf.shape(tf.nest.flatten(acts[0][0])[0], out_type=tf.int64)[batch_dim]
            self._first_examples = [tf.cast(self._first_example, tf.int64) + m * size
                                    for m in range(m_count)]
        stats = self._Grid()
        self._thetas = list(thetas)
        self._inputs = self._Grid()  # Differentiation sources of each (cell, micro-batch).
        self._outputs = self._Grid()
        # Cells that keep their activations are recorded on a tape for their backward (eager
        # mode needs it; graph mode differentiates the recorded ops with tf.gradients).
        self._tape = tf.GradientTape(persistent=True, watch_accessed_variables=False)
        for tick in schedule.ForwardTicks(m_count, self._num_cells):
            for k, m in tick:
                fn, first = self._functions[k], self._first_examples[m]
                # A device works on one micro-batch at a time, in the schedule's order: the
                # forward of micro-batch m waits for the cell's forward of m - 1.
                previous = _Done(acts[k + 1][m - 1], self._devices[k]) if m else []
                with tf.control_dependencies(previous), tf.name_scope(OpScope(k, m, 'fwd')):
                    if not training or self._recomputes[k]:
                        self._inputs[k][m] = self._Assign(k, acts[k][m])
                        outputs, stats[k][m] = fn.Forward(
                            thetas[k], self._inputs[k][m], self._step, first, training=training)
                        acts[k + 1][m] = self._Assign(k, outputs)
                        continue
                    # Fresh identities as differentiation sources: tf.gradients would otherwise
                    # also differentiate the op that produced them (the previous cell's call).
                    with self._tape, tf.device(self._devices[k]):
                        if m == 0:
                            self._thetas[k] = recompute.Identity(thetas[k])
                        self._inputs[k][m] = recompute.Identity(self._Assign(k, acts[k][m]))
                        self._tape.watch(tf.nest.flatten(self._thetas[k]) +
                                         recompute.FloatLeaves(self._inputs[k][m]))
                        outputs, stats[k][m] = fn.Forward(
                            self._thetas[k], self._inputs[k][m], self._step, first)
                        acts[k + 1][m] = self._Assign(k, outputs)
                self._outputs[k][m] = acts[k + 1][m]
        updates = []
        for k in range(self._num_cells):
            with tf.device(self._devices[k]), tf.name_scope(f'cell_{k}_stats'):
                updates.append(self._Assign(k, _SumStats(stats[k])) if training else [])
        with tf.device(self._devices[-1]):
            return microbatch.Concat(acts[-1], batch_dim), updates

    def Backward(self, d_outputs):
        """Runs the backward schedule for gradients `d_outputs` of `Forward`'s outputs.

        Args:
          d_outputs: like the outputs; None for leaves that are not floating point.

        Returns:
          (per cell the flat list of its theta's gradients, None for non-trainable leaves;
          d_inputs like the inputs).
        """
        m_count, batch_dim = self._num_micro_batches, self._batch_dim
        with tf.device(self._devices[-1]):
            d_acts = microbatch.Split(d_outputs, m_count, batch_dim)
        d_thetas = [None] * self._num_cells  # Per cell, the running gradient sum.
        d_inputs = [None] * self._num_cells  # Per cell, its last micro-batch's input gradient.
        for tick in schedule.BackwardTicks(m_count, self._num_cells):
            for k, m in tick:
                # A device works on one micro-batch at a time: the backward of the next
                # micro-batch waits for the last one's weight gradient to be summed, so at most
                # one micro-batch's weight gradient per cell is alive, and for its input
                # gradient (cell 0's is left out: nothing may need it, and waiting would force
                # it to be computed).
                previous = _Done([d_thetas[k], d_inputs[k] if k else None], self._devices[k])
                with tf.control_dependencies(previous), tf.name_scope(OpScope(k, m, 'bwd')):
                    d_y = self._Assign(k, recompute.FloatLeaves(d_acts[m]))
                    if self._recomputes[k]:
                        d_theta, d_x = self._functions[k].Backward(
                            self._thetas[k], self._inputs[k][m], self._step,
                            self._first_examples[m], d_y)
                    else:
                        with tf.device(self._devices[k]):
                            d_theta, d_x = recompute.Differentiate(
                                self._outputs[k][m], self._thetas[k], self._inputs[k][m], d_y,
                                self._functions[k].trainable,
                                tape=self._tape if tf.executing_eagerly() else None)
                    d_theta, d_x = self._Assign(k, (d_theta, d_x))
                # A running sum in schedule order, freed as it goes, instead of one add_n
                # that keeps all M gradients alive. Sparse gradients (an embedding's gather)
                # are made dense: summed over micro-batches they mostly are.
                with tf.device(self._devices[k]), tf.name_scope(OpScope(k, m, 'grad_sum')):
                    d_theta = [None if g is None else tf.convert_to_tensor(g) for g in d_theta]
                    d_thetas[k] = d_theta if d_thetas[k] is None else [
                        None if a is None else a + b for a, b in zip(d_thetas[k], d_theta)]
                d_inputs[k] = d_x
                d_acts[m] = tf.nest.pack_sequence_as(self._inputs[k][m], d_x)
        with tf.device(self._devices[0]):
            return d_thetas, microbatch.Concat(d_acts, batch_dim)
