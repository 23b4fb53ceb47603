"""Dynamic loss scaling for float16 compute (Params-configured, like `optimizer`).

float16 keeps 5 exponent bits: gradients below 2^-24 flush to zero. The loss is multiplied by a
scale S before the backward, so the gradients computed in float16 are S times larger, and the
float32 gradients are divided by S before the update. One check per step over every gradient
decides: if any is not finite (the backward overflowed), the update is skipped (the weights and
the optimizer's slots stay as they were; the global step still counts it) and S is halved; after
`growth_interval` finite steps in a row S doubles. The rule of tf.keras's LossScaleOptimizer
(initial 2^15, growth every 2000 steps, factor 2, S never below 1). bfloat16 has float32's
exponent range and needs none.

    scaling = loss_scale.DynamicLossScale.Params().Instantiate()   # its variables
    step = scaling.ForStep()                    # the scale this step's loss is multiplied by
    ...
    train_op = step.Apply(finite, apply_fn, skip_fn)   # the update, or the skip; and the scale's

Its two variables (the scale, the finite steps since the last change) are saved with the
checkpoint: a resumed run continues with the scale it had.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from gpipe_tf import hyperparams


class DynamicLossScale(tf.Module):
    """The loss scale of float16 training and its update rule (see the module docstring)."""

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = hyperparams.InstantiableParams(cls)
        p.Define('initial_scale', 2.0 ** 15, 'The scale of the first step.',
                 check=hyperparams.Number(at_least=1))
        p.Define('growth_interval', 2000,
                 'Finite steps in a row after which the scale doubles.',
                 check=hyperparams.Integer(at_least=1))
        return p

    def __init__(self, params: hyperparams.Params):
        super().__init__(name='loss_scale')
        self.params = params.Copy()
        self.scale = tf.Variable(float(params.initial_scale), dtype=tf.float32,
                                 trainable=False, name='scale')
        self.good_steps = tf.Variable(0, dtype=tf.int64, trainable=False, name='good_steps')

    def ForStep(self) -> 'StepScale':
        """This step's scale: one read of it, which the loss, the gradients' unscaling and the
        scale's update share."""
        return StepScale(self, self.scale.read_value())

    def UpdateOp(self, scale: tf.Tensor, finite: tf.Tensor):
        """Assigns the next step's scale from this step's `scale` and whether its gradients
        were `finite` (a scalar bool)."""
        good_steps = self.good_steps + 1
        grow = good_steps >= self.params.growth_interval
        next_scale = tf.where(finite, tf.where(grow, scale * 2.0, scale),
                              tf.maximum(scale / 2.0, 1.0))
        next_good_steps = tf.where(tf.logical_and(finite, tf.logical_not(grow)), good_steps,
                                   tf.zeros_like(good_steps))
        return tf.group(self.scale.assign(next_scale), self.good_steps.assign(next_good_steps))


@dataclasses.dataclass(frozen=True)
class StepScale:
    """One step's loss scale: the state it was read from, and the value read.

    Attributes:
      state: the DynamicLossScale.
      value: the scale (a float32 scalar tensor) the step's loss is multiplied by.
    """
    state: DynamicLossScale
    value: tf.Tensor

    def Unscale(self, grads: list) -> tuple[list, tf.Tensor]:
        """(the gradients (tensors or IndexedSlices) of the scaled loss divided by the scale,
        whether all are finite: one scalar bool over every gradient)."""
        inverse = 1.0 / self.value
        unscaled, checks = [], []
        for grad in grads:
            # On the gradient's device (each cell's): one bool per gradient travels.
            with tf.device(_Values(grad).device):
                unscaled.append(ScaleGradient(grad, inverse))
                checks.append(tf.reduce_all(tf.math.is_finite(_Values(unscaled[-1]))))
        return unscaled, tf.reduce_all(tf.stack(checks))

    def Apply(self, finite: tf.Tensor, apply_fn, skip_fn):
        """The step's update: `apply_fn()` when `finite`, else `skip_fn()`; and the scale's
        update. Returns an op (None when executing eagerly)."""

        def Branch(fn):
            def Run():
                with tf.control_dependencies(_Ops(fn())):
                    return tf.constant(True)
            return Run

        done = tf.cond(finite, Branch(apply_fn), Branch(skip_fn))
        with tf.control_dependencies([done]):
            return self.state.UpdateOp(self.value, finite)


def _Ops(result) -> list:
    """An update's result as control inputs (none when executing eagerly)."""
    return [] if result is None or tf.executing_eagerly() else [result]


def _Values(grad):
    return grad.values if isinstance(grad, tf.IndexedSlices) else grad


def ScaleGradient(grad, factor):
    """`grad` (a tensor, IndexedSlices or None) times `factor`, in the gradient's dtype."""
    if grad is None:
        return None
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values * tf.cast(factor, grad.values.dtype), grad.indices,
                                grad.dense_shape)
    return grad * tf.cast(factor, grad.dtype)
