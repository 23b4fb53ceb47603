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
                 '(step + 1) / warmup_steps until it reaches 1.',
                 check=hyperparams.Integer(at_least=0))
        return p

    def __init__(self, params: hyperparams.Params):
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
        p.Define('decay_rate', 0.97, 'Factor per decay period.',
                 check=hyperparams.Number(greater_than=0))
        # decay_steps is checked on construction, in a message that shows the rate too.
        p.Define('decay_steps', 1000, 'Steps per decay period.')
        p.Define('staircase', True, 'Decay in whole periods.')
        p.Define('min_value', 0.0, 'Lower bound of the decay (the warm-up scales it further).',
                 check=hyperparams.Number(at_least=0))
        return p

    def __init__(self, params):
        super().__init__(params)
        if not hyperparams.Number(greater_than=0).Accepts(params.decay_steps):
            raise ValueError(f'decay_steps must be a finite number > 0, got '
                             f'{params.decay_steps!r} (the period of decay_rate '
                             f'{params.decay_rate}).')

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
        p.Define('total_steps', 1000, 'Steps of the decay.',
                 check=hyperparams.Number(greater_than=0))
        p.Define('min_value', 0.0, 'Multiplier at the end.', check=hyperparams.Number(at_least=0))
        return p

    def _Decay(self, step):
        progress = tf.minimum(step / float(self.p.total_steps), 1.0)
        cosine = 0.5 * (1.0 + tf.cos(3.141592653589793 * progress))
        return self.p.min_value + (1.0 - self.p.min_value) * cosine
