"""`--mode=check`: one batch through the configured pipeline and through the same layers
un-partitioned, so a user can trust a configuration (a tuned one, say) on their own model before
a long run.

The reference shares nothing with the pipeline but its layers: their FProp chained directly
(`unpartitioned.Unpartitioned`: no cells, devices, schedule, executor, micro-batch split or
re-materialization), the task's loss computed on their outputs as the task computes it
(`ComputeMetrics`), and gradients by a tf.GradientTape over the pipeline's own variables, so a
bug in the pipeline machinery cannot agree with itself. Both compute the training loss and
every trainable variable's gradient on the same batch; the check prints the losses, the
gradient norms and the worst per-variable gradient difference (relative to that variable's
largest gradient), and fails when it exceeds the tolerance.

Layers that normalise over the batch (batch norm in training) compute their statistics per
micro-batch in the pipeline, so for a model holding one the reference runs the pipeline's
micro-batches (each replica's shard in M parts) in sequence through the layers, and the output
says so. Dropout and drop-path draw their masks per example from (step, example index), so they
agree at any M.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow as tf

from gpipe_tf import errors
from gpipe_tf.layers import fprop_context
from gpipe_tf.layers import normalization
from gpipe_tf.pipeline import pipelining_layer
from gpipe_tf.pipeline import plan as plan_lib
from gpipe_tf.pipeline import unpartitioned

# The largest relative difference that passes: float32 sums in another order; with a half
# precision fprop_dtype, its rounding.
TOLERANCE = 1e-4
HALF_TOLERANCE = 2e-2
# The training step both run: the layers' random masks are drawn for it.
_STEP = 0


class ParityError(errors.EnvironmentFault):
    """The pipeline's gradients differ from the un-partitioned layers' beyond the tolerance."""


@dataclasses.dataclass(frozen=True)
class Parity:
    """One batch through the pipeline and the reference."""
    loss: float
    reference_loss: float
    grad_norm: float
    reference_grad_norm: float
    worst_variable: str
    worst_difference: float  # max |g - g_ref| of that variable, over its max |g_ref|.
    worst_absolute: float
    num_variables: int
    reference_micro_batches: int  # 1, or the pipeline's R x M for a model with batch norm.

    def Format(self) -> str:
        rows = [('', 'pipelined', 'un-partitioned', 'difference'),
                ('loss', f'{self.loss:.7g}', f'{self.reference_loss:.7g}',
                 f'{abs(self.loss - self.reference_loss):.3g}'),
                ('gradient norm', f'{self.grad_norm:.7g}', f'{self.reference_grad_norm:.7g}',
                 f'{abs(self.grad_norm - self.reference_grad_norm):.3g}')]
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = ['  '.join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
        lines.append(f'worst per-variable gradient difference ({self.num_variables} variables): '
                     f'{self.worst_difference:.3g} of its largest gradient '
                     f'({self.worst_absolute:.3g} absolute), {self.worst_variable}')
        return '\n'.join(lines)


def NormalisesOverTheBatch(task) -> bool:
    """Whether a layer of the built task computes statistics over the batch (batch norm)."""
    return any(isinstance(m, normalization.BatchNormLayer) for m in task.submodules)


def _EvenSizes(num_examples: int, num_parts: int) -> list[int]:
    # The pipeline's rule for splitting a batch (into replicas' shards, a shard into
    # micro-batches), written out here rather than taken from `microbatch`: the reference shares
    # no pipeline code.
    size, larger = divmod(num_examples, num_parts)
    return [size + 1] * larger + [size] * (num_parts - larger)


def ReferenceMicroBatches(task, batch_size: int) -> list[int]:
    """The sizes of the parts the reference runs the batch in, one after another: the whole
    batch, or, for a task that normalises over the batch, the pipeline's micro-batches (each
    replica's shard in M parts), whose statistics batch norm computes."""
    p = task.model.p
    if not NormalisesOverTheBatch(task):
        return [batch_size]
    m = plan_lib.NumMicroBatches(p, batch_size, equal=False)
    return [size for shard in _EvenSizes(batch_size, p.num_replicas)
            for size in _EvenSizes(shard, m)]


def ReferenceLoss(task, batch, micro_batch_sizes: list[int]) -> tf.Tensor:
    """The task's training loss with its model's layers chained directly
    (`unpartitioned.Unpartitioned`) on the parts `micro_batch_sizes` of the batch, reduced as
    the task reduces its model's outputs (`ComputeMetrics`, on the whole batch: its weighted
    mean is what the pipeline's per-micro-batch losses combine to)."""
    outputs = unpartitioned.Unpartitioned(task.model, task.ModelInputs(batch),
                                          micro_batch_sizes, step=_STEP)
    return task.ComputeMetrics(batch, outputs).loss[0]


def _PipelineLoss(task, batch) -> tf.Tensor:
    return task.FPropTower(batch)['loss'][0]


def _Gradients(task, batch, loss_fn) -> tuple[float, list[np.ndarray]]:
    """(loss, per trainable variable of the task its gradient) of `loss_fn(task, batch)`, in
    training on step _STEP."""
    variables = task.trainable_variables

    @tf.function(autograph=False)
    def Run(batch):
        with tf.GradientTape() as tape:
            with fprop_context.Scope(training=True, step=tf.constant(_STEP, tf.int64),
                                     first_example=0):
                loss = loss_fn(task, batch)
        return loss, tape.gradient(loss, variables,
                                   unconnected_gradients=tf.UnconnectedGradients.ZERO)

    loss, grads = Run(batch)
    return float(loss), [tf.convert_to_tensor(g).numpy() for g in grads]


def Compare(task_params) -> Parity:
    """Builds the task and computes, on the input's first training batch, its loss and
    gradients through the pipeline and through the pipeline's layers chained directly (the
    same variables; for a task that normalises over the batch, on the same micro-batches)."""
    task = task_params.Instantiate()
    batch = next(iter(task_params.input.Instantiate().TrainDataset(start_step=0)))
    batch_dim = task.model.p.batch_dim
    batch_size = int(tf.nest.flatten(task.ModelInputs(batch))[0].shape[batch_dim])
    sizes = ReferenceMicroBatches(task, batch_size)
    # The reference first: the pipeline's step then applies batch norm's moving statistics
    # (which training reads neither way, but the reference then runs on untouched variables).
    reference_loss, reference_grads = _Gradients(
        task, batch, lambda task, batch: ReferenceLoss(task, batch, sizes))
    loss, grads = _Gradients(task, batch, _PipelineLoss)
    worst = ('', -1.0, 0.0)
    for variable, g, reference_g in zip(task.trainable_variables, grads, reference_grads):
        absolute = float(np.max(np.abs(g - reference_g))) if g.size else 0.0
        scale = float(np.max(np.abs(reference_g))) if g.size else 0.0
        relative = absolute / scale if scale else absolute
        if relative > worst[1]:
            worst = (variable.name, relative, absolute)

    def Norm(gs):
        return float(np.sqrt(sum(np.sum(np.square(g, dtype=np.float64)) for g in gs)))

    return Parity(loss, reference_loss, Norm(grads), Norm(reference_grads), worst[0], worst[1],
                  worst[2], len(grads), len(sizes))


def Run(task_params, name: str, plan=None) -> Parity:
    """Prints the comparison of task Params' pipeline (devices set up) with its layers
    un-partitioned. `plan` is the run's (`setup.CheckPlan`), where given, else made here; it
    names K, M and the batch in the first line.

    Raises:
      errors.ConfigError: for a model that is not a pipeline.
      ParityError: for gradients that differ beyond the tolerance.
    """
    p = task_params.model
    if not pipelining_layer.IsPipeline(p):
        raise errors.ConfigError(f'{name}: --mode=check compares a PipeliningLayer model with '
                                 f'its layers un-partitioned; got {p.cls.__name__}.')
    pipeline_plan = plan if plan is not None else plan_lib.MakePlan(p)
    print(f'check: {name}, K={pipeline_plan.num_devices} M={pipeline_plan.num_micro_batches} '
          f'{p.schedule}{" v=" + str(p.virtual_stages) if p.virtual_stages > 1 else ""} '
          f'recompute={p.recompute}, against its layers un-partitioned (their FProp chained, '
          f'no pipeline code), on one batch of '
          f'{pipeline_plan.batch_size}', flush=True)
    parity = Compare(task_params)
    m = parity.reference_micro_batches
    print('the un-partitioned layers run ' + (
        'the whole batch at once' if m == 1 else f'the same {m} micro-batches in sequence '
        '(batch norm\'s statistics are per micro-batch)'), flush=True)
    print(parity.Format(), flush=True)
    tolerance = HALF_TOLERANCE if p.fprop_dtype is not None else TOLERANCE
    if parity.worst_difference > tolerance:
        raise ParityError(f'{name}: the pipeline\'s gradients differ from its layers\' '
                          f'un-partitioned by {parity.worst_difference:.3g} of the largest '
                          f'(tolerance {tolerance:g}), worst at {parity.worst_variable}.')
    print(f'parity: the pipeline computes what its layers do un-partitioned (worst '
          f'{parity.worst_difference:.2g} <= {tolerance:g})', flush=True)
    return parity
