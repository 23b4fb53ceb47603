"""Optimizers configured by Params, built on TensorFlow's `tf.compat.v1.train` optimizers.

The v1 optimizers serve both training programs: inside a `tf.function` and in a v1 graph run by
a `Session`. Their slot variables are created next to the variables they serve (so on each cell's
device), and `tf.train.Checkpoint` saves and restores them.

    p = optimizer.RMSProp.Params().Set(decay=0.9, momentum=0.9, epsilon=1.0)
    opt = p.Instantiate().Create(learning_rate)   # a float, a tensor or a callable
"""

from __future__ import annotations

import tensorflow as tf

from gpipe_tf import hyperparams


class BaseOptimizer:
    """Params-configured factory of one `tf.compat.v1.train.Optimizer`."""

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = hyperparams.InstantiableParams(cls)
        p.Define('name', cls.__name__, 'Name of the optimizer (prefix of its slot variables).')
        return p

    def __init__(self, params: hyperparams.Params):
        self.params = params.Copy()

    @property
    def p(self) -> hyperparams.Params:
        return self.params

    def Create(self, learning_rate) -> tf.compat.v1.train.Optimizer:
        raise NotImplementedError(f'{type(self).__name__}.Create')


class SGD(BaseOptimizer):
    """Plain gradient descent."""

    def Create(self, learning_rate):
        return tf.compat.v1.train.GradientDescentOptimizer(learning_rate, name=self.p.name)


class Momentum(BaseOptimizer):
    """Gradient descent with (optionally Nesterov) momentum."""

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('momentum', 0.9, 'Momentum coefficient.', check=hyperparams.Number())
        p.Define('use_nesterov', False, 'Nesterov momentum.')
        return p

    def Create(self, learning_rate):
        return tf.compat.v1.train.MomentumOptimizer(
            learning_rate, self.p.momentum, use_nesterov=self.p.use_nesterov, name=self.p.name)


class RMSProp(BaseOptimizer):
    """RMSProp; the defaults are the AmoebaNet reference recipe the GPipe paper trained with."""

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('decay', 0.9, 'Discount of the running mean of squared gradients.',
                 check=hyperparams.Number(at_least=0, at_most=1))
        p.Define('momentum', 0.9, 'Momentum coefficient.', check=hyperparams.Number())
        p.Define('epsilon', 1.0, 'Added to the denominator.',
                 check=hyperparams.Number(at_least=0))
        return p

    def Create(self, learning_rate):
        return tf.compat.v1.train.RMSPropOptimizer(
            learning_rate, decay=self.p.decay, momentum=self.p.momentum,
            epsilon=self.p.epsilon, name=self.p.name)


class Adam(BaseOptimizer):
    """Adam."""

    @classmethod
    def Params(cls):
        p = super().Params()
        # A beta of 1 divides by 1 - beta ** t = 0 in the bias correction.
        p.Define('beta1', 0.9, 'Decay of the first moment.',
                 check=hyperparams.Number(at_least=0, less_than=1))
        p.Define('beta2', 0.999, 'Decay of the second moment.',
                 check=hyperparams.Number(at_least=0, less_than=1))
        # 0 would make 0 / 0 of a parameter whose gradients have all been 0.
        p.Define('epsilon', 1e-8, 'Added to the denominator.',
                 check=hyperparams.Number(greater_than=0))
        return p

    def Create(self, learning_rate):
        return tf.compat.v1.train.AdamOptimizer(
            learning_rate, beta1=self.p.beta1, beta2=self.p.beta2, epsilon=self.p.epsilon,
            name=self.p.name)
