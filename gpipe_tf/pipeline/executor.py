"""What runs a pipeline's schedule, whichever executor: the protocol `Executor`, the helpers
both executors share (op scopes, the per-micro-batch loss, logical-device assignment), and the
one choice between them (`Choose`), which `PipeliningLayer` and the reports both read.

Two executors implement the protocol: `unrolled.UnrolledSchedule` adds every action to the
graph in its build order; `looped.LoopedSchedule` runs the schedule's clock as a while loop,
so the graph does not grow with M. Two ways to run a step:
  * `Forward` then `Backward(d_outputs)`: the loss is computed after the pipeline on the whole
    batch, so every forward precedes every backward; for `forward_first` schedules (gpipe) and
    inference.
  * `ForwardBackward(thetas, inputs, loss_fn, loss_inputs)`: the loss is computed per
    micro-batch on the last stage as soon as its forward is done, so backwards can start
    before the last forward (1f1b, interleaved, zero-bubble; any schedule).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol, Sequence

import tensorflow as tf

from gpipe_tf.pipeline import cell as cell_lib
from gpipe_tf.pipeline import gradient_sums
from gpipe_tf.pipeline import leaves
from gpipe_tf.pipeline import schedule as schedule_lib
from gpipe_tf.pipeline import unfolded

F, B, I, W = (schedule_lib.FORWARD, schedule_lib.BACKWARD, schedule_lib.INPUT_GRAD,
              schedule_lib.WEIGHT_GRAD)
# unroll='auto' runs the schedule as a loop from this many cell calls per forward (v K M): the
# unrolled graph's optimization grows with them, while below it the unrolled step is the faster
# one (measured: docs/schedules.md, "Build cost").
LOOP_FROM_CELL_CALLS = 64
# The name-scope part of each action kind (`OpScope`).
PARTS = {F: 'fwd', B: 'bwd', I: 'bwd_input', W: 'bwd_weight'}


@dataclasses.dataclass(frozen=True)
class Choice:
    """Which executor runs a step, and why."""
    loops: bool  # `looped.LoopedSchedule`; else `unrolled.UnrolledSchedule`.
    reason: str

    def __str__(self) -> str:
        return f'{"a loop over its clock" if self.loops else "unrolled"}: {self.reason}'


def Choose(plan, num_micro_batches: int, training: bool = True, even: bool = True) -> Choice:
    """The executor of a step of a pipeline's `plan` (`plan.Plan`) over its v K cells and
    M = `num_micro_batches`, from its Params' `unroll`: True unrolls; False loops; 'auto' loops
    from LOOP_FROM_CELL_CALLS cell calls (v K M). Whatever `unroll` says, a logical_device_fn
    unrolls (XLA's sharding annotations are not tried inside a loop; `plan.MakePlan` refuses
    unroll=False with one), and so does a training step whose static batch M does not divide
    (`even` False: the loop splits a static batch into equal micro-batches; inference pads it)."""
    p = plan.params
    if p.unroll is True:
        return Choice(False, 'unroll=True')
    if p.logical_device_fn is not None:
        return Choice(False, 'a logical_device_fn: XLA sharding is not tried inside a loop')
    if training and not even:
        return Choice(False, f'a training batch that M={num_micro_batches} does not divide')
    if p.unroll is False:
        return Choice(True, 'unroll=False')
    calls = plan.num_cells * num_micro_batches
    if calls >= LOOP_FROM_CELL_CALLS:
        return Choice(True, f"unroll='auto', {calls} cell calls >= {LOOP_FROM_CELL_CALLS}")
    return Choice(False, f"unroll='auto', {calls} cell calls < {LOOP_FROM_CELL_CALLS}")


def OpScope(cell: int, micro_batch: int, part: str) -> str:
    """The name scope of one (cell, micro-batch) piece of the schedule: `part` is 'fwd', 'bwd',
    'bwd_input', 'bwd_weight', 'loss' or 'grad_sum'. Traces read (cell, micro-batch, kind)
    back from op names through it (`perf/trace.py`); a re-materializing backward's recompute is
    under a further 'recompute' scope (`cell_lib.RECOMPUTE_SCOPE`)."""
    return f'cell_{cell}_mb_{micro_batch}_{part}'


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


class Executor(Protocol):
    """Runs one step of a pipeline of S stages (cells) over M micro-batches, in the order of a
    schedule: what `unrolled.UnrolledSchedule` and `looped.LoopedSchedule` both are, and
    what `PipeliningLayer` chooses between (`Choose`). An executor runs one step: `Forward`
    (then, in training, `Backward`), or `ForwardBackward`.

    Args:
      functions: each stage's `cell_lib.CellFunctions` (which carry its device).
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

    def __init__(self, functions: Sequence[cell_lib.CellFunctions], recomputes: Sequence[bool],
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


