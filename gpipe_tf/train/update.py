"""One synchronous update from a task's loss: regularisation, gradients, clipping, apply.

Shared by the training programs (`tf.function`, v1 graph, and a tf.distribute strategy's
replicas). The pipeline's gradients are the sum over its micro-batches (PipeliningLayer's custom
gradient), so this applies the one update per mini-batch that GPipe prescribes; under a strategy
the replicas' gradients are first combined into the whole batch's (`GlobalBatchGradients`).
"""

from __future__ import annotations

import tensorflow as tf

from gpipe_tf import errors
from gpipe_tf import loss_scale as loss_scale_lib
from gpipe_tf.nested_map import NestedMap


def LossScaleFor(task) -> loss_scale_lib.DynamicLossScale | None:
    """The dynamic loss scale (`task.train.loss_scale`) when a layer of `task` computes in
    float16 (its fprop_dtype); None otherwise (bfloat16 has float32's range and needs none)."""
    if not any(layer.p.fprop_dtype is not None and tf.as_dtype(layer.p.fprop_dtype) ==
               tf.float16 for layer in task.Descendants()):
        return None
    return task.p.train.loss_scale.Instantiate()


def LearningRateFn(train_params, global_step: tf.Variable):
    """A callable giving the learning rate at `global_step` (base rate times the schedule)."""
    schedule = train_params.lr_schedule.Instantiate()
    base = float(train_params.learning_rate)
    return lambda: base * schedule.Value(global_step)


def ClipGradients(grads: list, clip_norm: float) -> tuple[list, tf.Tensor]:
    """Clips to a global norm (0: no clipping); returns (grads, the global norm before)."""
    norm = tf.linalg.global_norm(grads)
    if clip_norm:
        grads, _ = tf.clip_by_global_norm(grads, clip_norm, use_norm=norm)
    return grads, norm


_Scale = loss_scale_lib.ScaleGradient


def GlobalBatchGradients(grads: list, weight, replica_context) -> list:
    """Under a tf.distribute strategy: the gradient of the whole batch's loss, the same on every
    replica.

    Each replica's loss is the weighted mean over its shard (weights: examples, or tokens of a
    sequence model, so shards may weigh differently); the batch's loss is the mean weighted by
    the shards' total weights. So each replica's gradient is scaled by its share of the total
    weight, and the scaled gradients are summed over replicas. (A loss term that is the same on
    every replica, like weight decay, keeps its gradient: the shares sum to 1.)
    """
    weight = tf.cast(weight, tf.float32)
    share = tf.math.divide_no_nan(
        weight, replica_context.all_reduce(tf.distribute.ReduceOp.SUM, weight))
    return replica_context.all_reduce(tf.distribute.ReduceOp.SUM,
                                      [_Scale(g, share) for g in grads])


def Update(task, optimizer, global_step: tf.Variable, metrics: NestedMap, grads_fn,
           loss_scale: loss_scale_lib.StepScale | None = None):
    """Builds the update; returns (train_op or None in eager, metrics with `total_loss`,
    `grad_norm` added, and `loss_scale` with loss scaling).

    Args:
      grads_fn: (total_loss, variables) -> gradients (a tape's or tf.compat.v1.gradients).
      loss_scale: None, or the step's dynamic loss scale (float16 compute): the gradients are
        those of the loss times it, divided by it before clipping; if any is not finite the
        update is skipped (the global step still advances) and the scale shrinks.

    Raises:
      errors.ConfigError: for loss scaling under a tf.distribute strategy.
    """
    variables = task.trainable_variables
    loss, weight = metrics.loss
    total_loss = loss + task.RegularizationLoss()
    grads = grads_fn(total_loss if loss_scale is None else total_loss * loss_scale.value,
                     variables)
    missing = [v.name for v, g in zip(variables, grads) if g is None]
    if missing:
        raise ValueError(f'The loss does not depend on trainable variables {missing[:5]}'
                         f'{" ..." if len(missing) > 5 else ""}; every trainable variable needs '
                         'a gradient.')
    replica_context = tf.distribute.get_replica_context()
    replicas = replica_context.num_replicas_in_sync if replica_context else 1
    if replicas > 1:
        if loss_scale is not None:
            # The skip is a tf.cond around apply_gradients, whose merge_call across a
            # strategy's replicas refuses to run inside it (tried: "`merge_call` called while
            # defining a new graph or a tf.function").
            raise errors.ConfigError(
                'float16 training (dynamic loss scaling) does not run under a tf.distribute '
                'strategy: use fprop_dtype bfloat16, which needs no loss scaling.')
        grads = GlobalBatchGradients(grads, weight, replica_context)
    finite = None
    if loss_scale is not None:
        grads, finite = loss_scale.Unscale(grads)
    grads, norm = ClipGradients(grads, task.p.train.clip_gradient_norm_to_value)
    if replicas > 1:
        # v1 optimizers sum the replicas' gradients in apply_gradients (a second all-reduce,
        # of equal values: clipping needs the global gradient first), so each hands 1/R.
        grads = [_Scale(g, 1.0 / replicas) for g in grads]
    apply = lambda: optimizer.apply_gradients(zip(grads, variables), global_step=global_step)
    if loss_scale is None:
        train_op = apply()
    else:
        train_op = loss_scale.Apply(finite, apply, lambda: global_step.assign_add(1))
    out = NestedMap(metrics)
    out.total_loss = (total_loss, weight)
    out.grad_norm = (norm, tf.constant(1.0))
    if loss_scale is not None:
        out.loss_scale = (loss_scale.value, tf.constant(1.0))
    return train_op, out
