"""`--mode=check`: one batch through the configured pipeline and through the same layers
un-partitioned, so a user can trust a configuration (a tuned one, say) on their own model before
a long run.

The reference is the same task with its pipeline as one cell on the first device, one
micro-batch, the gpipe schedule and no re-materialization, holding the pipeline's very weights
(restored from them by name, as a re-partitioned checkpoint is). Both compute the training loss
and every trainable variable's gradient on the same batch; the check prints the losses, the
gradient norms and the worst per-variable gradient difference (relative to that variable's
largest gradient), and fails when it exceeds the tolerance.

Layers that normalise over the batch (batch norm in training) compute their statistics per
micro-batch in the pipeline, so for a model holding one the reference runs the pipeline's M
micro-batches in sequence on its one cell: it then checks the partition, the schedule, the
re-materialization and the placement, and the header says so.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile

import numpy as np
import tensorflow as tf

from gpipe_tf import errors
from gpipe_tf.layers import fprop_context
from gpipe_tf.layers import normalization
from gpipe_tf.pipeline import plan as plan_lib

# The largest relative difference that passes: float32 sums in another order; with a half
# precision fprop_dtype, its rounding.
TOLERANCE = 1e-4
HALF_TOLERANCE = 2e-2


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
    reference_micro_batches: int  # 1, or M for a model with batch norm.

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


def ReferenceParams(task_params, device: str, num_micro_batches: int = 1):
    """The task with its pipeline as one cell of `num_micro_batches` on `device`, gpipe, no
    re-materialization."""
    reference = task_params.Copy()
    model = reference.model
    model.Set(num_cells=1, num_micro_batches=num_micro_batches,
              micro_batch_size=None, schedule='gpipe',
              virtual_stages=1, recompute='never', partition_method='uniform',
              num_replicas=1, devices=[device])
    if 'cell_tpl' in model and model.cell_tpl is not None:
        layers = [lp for cell in model.cell_tpl
                  for lp in (cell if isinstance(cell, (list, tuple)) else [cell])]
        model.Set(cell_tpl=None, layer_tpl=layers)
    return reference


def _Gradients(task, batch):
    @tf.function(autograph=False)
    def Run(batch):
        with tf.GradientTape() as tape:
            with fprop_context.Scope(training=True, step=tf.constant(0, tf.int64),
                                     first_example=0):
                loss = task.FPropTower(batch)['loss'][0]
        variables = task.trainable_variables
        return loss, tape.gradient(loss, variables,
                                   unconnected_gradients=tf.UnconnectedGradients.ZERO)
    loss, grads = Run(batch)
    return float(loss), {v.name: g.numpy() for v, g in zip(task.trainable_variables, grads)}


def Compare(task_params) -> Parity:
    """Builds the task and its reference (of the pipeline's M micro-batches for a task that
    normalises over the batch, else of one), gives the reference the task's weights, and
    computes both on the input's first training batch."""
    task = task_params.Instantiate()  # Its variables exist once it is built.
    plan = task.model.plan
    m = plan.num_micro_batches if NormalisesOverTheBatch(task) else 1
    reference = ReferenceParams(task_params, plan.devices[0], m).Instantiate()
    scratch = tempfile.mkdtemp(prefix='gpipe_check_')
    try:
        path = tf.train.Checkpoint(task=task).write(os.path.join(scratch, 'weights'))
        tf.train.Checkpoint(task=reference).read(path).assert_existing_objects_matched()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    batch = next(iter(task_params.input.Instantiate().TrainDataset(start_step=0)))
    loss, grads = _Gradients(task, batch)
    reference_loss, reference_grads = _Gradients(reference, batch)
    if sorted(grads) != sorted(reference_grads):
        missing = sorted(set(grads) ^ set(reference_grads))[:3]
        raise ParityError(f'the pipeline and the un-partitioned layers hold different variables '
                          f'({", ".join(missing)}).')
    worst = ('', -1.0, 0.0)
    for name, g in grads.items():
        reference_g = reference_grads[name]
        absolute = float(np.max(np.abs(g - reference_g))) if g.size else 0.0
        scale = float(np.max(np.abs(reference_g))) if g.size else 0.0
        relative = absolute / scale if scale else absolute
        if relative > worst[1]:
            worst = (name, relative, absolute)

    def Norm(gs):
        return float(np.sqrt(sum(np.sum(np.square(g, dtype=np.float64)) for g in gs.values())))

    return Parity(loss, reference_loss, Norm(grads), Norm(reference_grads), worst[0], worst[1],
                  worst[2], len(grads), m)


def Run(task_params, name: str, plan=None) -> Parity:
    """Prints the comparison of task Params' pipeline (devices set up) with its layers
    un-partitioned. The pipeline takes `plan`, the run's (`setup.CheckPlan`), where given,
    instead of making it again.

    Raises:
      errors.ConfigError: for a model that is not a pipeline.
      ParityError: for gradients that differ beyond the tolerance.
    """
    p = task_params.model
    if not plan_lib.IsPipeline(p):
        raise errors.ConfigError(f'{name}: --mode=check compares a PipeliningLayer model with '
                                 f'its layers un-partitioned; got {p.cls.__name__}.')
    pipeline_plan = plan if plan is not None else plan_lib.MakePlan(p)
    print(f'check: {name}, K={pipeline_plan.num_devices} M={pipeline_plan.num_micro_batches} '
          f'{p.schedule}{" v=" + str(p.virtual_stages) if p.virtual_stages > 1 else ""} '
          f'recompute={p.recompute}, against its layers un-partitioned, on one batch of '
          f'{pipeline_plan.batch_size}', flush=True)
    with plan_lib.HandOn(pipeline_plan):
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
