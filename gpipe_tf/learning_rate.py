"""Learning-rate schedules configured by Params: `Value(step)` is a multiplier of the task's
base learning rate (Lingvo's convention), computed with TF ops so it works on a step tensor.

    p = learning_rate.ExponentialDecay.Params().Set(decay_rate=0.97, decay_steps=1000,
                                                     warmup_steps=500)
    lr = base_learning_rate * p.Instantiate().Value(global_step)
"""

from __future__ import annotations

import tensorflow as tf

from gpipe_tf import hyperparams


class Constant:
    """Multiplier 1 (after an optional linear warm-up)."""

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = hyperparams.InstantiableParams(cls)
        p.Define('warmup_steps', 0, 'Steps of linear warm-up: the multiplier is scaled by '
                 '(step + 1) / warmup_steps until it reaches 1.')
        return p

    def __init__(self, params: hyperparams.Params):
        if params.warmup_steps < 0:
            raise ValueError(f'warmup_steps must be >= 0, got {params.warmup_steps}.')
        self.params = params.Copy()

    @property
    def p(self) -> hyperparams.Params:
        return self.params

    def _Decay(self, step: tf.Tensor) -> tf.Tensor:
        del step
        return tf.constant(1.0)

    def Value(self, step) -> tf.Tensor:
        """The multiplier at `step` (an int or int tensor)."""
        step = tf.cast(step, tf.float32)
        value = self._Decay(step)
        if self.p.warmup_steps:
            value *= tf.minimum(1.0, (step + 1.0) / float(self.p.warmup_steps))
        return value


class ExponentialDecay(Constant):
    """decay_rate ** (step / decay_steps), floored to whole periods with `staircase`; the
    AmoebaNet recipe is 0.97 every 2.4 epochs, after a warm-up."""

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('decay_rate', 0.97, 'Factor per decay period.')
        p.Define('decay_steps', 1000, 'Steps per decay period.')
        p.Define('staircase', True, 'Decay in whole periods.')
        p.Define('min_value', 0.0, 'Lower bound of the decay (the warm-up scales it further).')
        return p

    def __init__(self, params):
        super().__init__(params)
        if params.decay_steps <= 0 or params.decay_rate <= 0:
            raise ValueError(f'decay_steps and decay_rate must be positive, got '
                             f'{params.decay_steps} and {params.decay_rate}.')

    def _Decay(self, step):
        periods = step / float(self.p.decay_steps)
        if self.p.staircase:
            periods = tf.floor(periods)
        return tf.maximum(tf.pow(float(self.p.decay_rate), periods), self.p.min_value)


class CosineDecay(Constant):
    """Half a cosine from 1 down to `min_value` over `total_steps`, then `min_value`."""

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('total_steps', 1000, 'Steps of the decay.')
        p.Define('min_value', 0.0, 'Multiplier at the end.')
        return p

    def __init__(self, params):
        super().__init__(params)
        if params.total_steps <= 0:
            raise ValueError(f'total_steps must be positive, got {params.total_steps}.')

    def _Decay(self, step):
        progress = tf.minimum(step / float(self.p.total_steps), 1.0)
        cosine = 0.5 * (1.0 + tf.cos(3.141592653589793 * progress))
        return self.p.min_value + (1.0 - self.p.min_value) * cosine
