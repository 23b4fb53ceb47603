"""Tests of gpipe_tf.optimizer: each optimizer's steps on a small quadratic against its update
rule computed by hand in numpy, the same steps inside a tf.function, the learning rate as a
callable, and slot variables restored through tf.train.Checkpoint."""

import os
import shutil
import tempfile

import pytest
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

from gpipe_tf import optimizer
from gpipe_tf import test_utils

pytestmark = pytest.mark.unit

DEVICES = test_utils.ConfigureVirtualCpus()

# The quadratic loss(x) = 0.5 * sum(A * x^2) + sum(B * x), whose gradient is A * x + B.
A = np.array([1.0, 2.0, 0.5, 4.0])
B = np.array([0.5, -1.0, 2.0, 0.0])
X0 = np.array([1.0, -2.0, 3.0, 0.25])
LR = 0.1
NUM_STEPS = 3


def _Grad(x):
    return A * x + B


def _Loss(x):
    return 0.5 * tf.reduce_sum(tf.constant(A, tf.float32) * tf.square(x)) + tf.reduce_sum(
        tf.constant(B, tf.float32) * x)


class SgdRule:

    def __init__(self, p):
        del p

    def Step(self, x, g, lr):
        return x - lr * g


class MomentumRule:
    """accum = momentum * accum + g; x -= lr * accum (Nesterov: lr * (g + momentum * accum))."""

    def __init__(self, p):
        self.p, self.accum = p, 0.0

    def Step(self, x, g, lr):
        self.accum = self.p.momentum * self.accum + g
        if self.p.use_nesterov:
            return x - lr * (g + self.p.momentum * self.accum)
        return x - lr * self.accum


class RmsPropRule:
    """TF v1's RMSProp: ms = decay ms + (1 - decay) g^2; mom = momentum mom +
    lr g / sqrt(ms + epsilon); x -= mom. TF v1 starts ms at 1 (its `rms` slot's initializer,
    unlike Keras' 0), and puts epsilon inside the square root."""

    def __init__(self, p):
        self.p, self.ms, self.mom = p, 1.0, 0.0

    def Step(self, x, g, lr):
        p = self.p
        self.ms = p.decay * self.ms + (1.0 - p.decay) * g * g
        self.mom = p.momentum * self.mom + lr * g / np.sqrt(self.ms + p.epsilon)
        return x - self.mom


class AdamRule:
    """Adam with bias correction in TF v1's form: lr_t = lr sqrt(1 - beta2^t) / (1 - beta1^t);
    x -= lr_t m / (sqrt(v) + epsilon) (epsilon is "epsilon hat" of Kingma & Ba, sec. 2)."""

    def __init__(self, p):
        self.p, self.m, self.v, self.t = p, 0.0, 0.0, 0

    def Step(self, x, g, lr):
        p = self.p
        self.t += 1
        self.m = p.beta1 * self.m + (1.0 - p.beta1) * g
        self.v = p.beta2 * self.v + (1.0 - p.beta2) * g * g
        lr_t = lr * np.sqrt(1.0 - p.beta2 ** self.t) / (1.0 - p.beta1 ** self.t)
        return x - lr_t * self.m / (np.sqrt(self.v) + p.epsilon)


_RULES = {optimizer.SGD: SgdRule, optimizer.Momentum: MomentumRule,
          optimizer.RMSProp: RmsPropRule, optimizer.Adam: AdamRule}

# (name, Params; non-default values where a default would hide a term of the rule).
_CASES = [
    ('_sgd', optimizer.SGD.Params),
    ('_momentum', lambda: optimizer.Momentum.Params().Set(momentum=0.8)),
    ('_nesterov', lambda: optimizer.Momentum.Params().Set(momentum=0.8, use_nesterov=True)),
    ('_rmsprop', lambda: optimizer.RMSProp.Params().Set(decay=0.8, momentum=0.5, epsilon=0.1)),
    ('_rmsprop_defaults', optimizer.RMSProp.Params),
    ('_adam', lambda: optimizer.Adam.Params().Set(beta1=0.8, beta2=0.9, epsilon=1e-3)),
]


def _Expected(p, num_steps, lr=LR):
    """x after each of `num_steps` steps of the numpy rule; `lr` a float or a function of the
    step index."""
    rule, x, xs = _RULES[p.cls](p), X0.copy(), []
    for _ in range(num_steps):
        x = rule.Step(x, _Grad(x), lr(len(xs)) if callable(lr) else lr)
        xs.append(x)
    return xs


def _StepFn(opt, var):
    def Step():
        with tf.GradientTape() as tape:
            loss = _Loss(var)
        opt.apply_gradients([(tape.gradient(loss, var), var)])
    return Step


class OptimizerTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.named_parameters(*_CASES)
    def testStepsEqualTheUpdateRuleByHand(self, params_fn):
        p = params_fn()
        var = tf.Variable(X0, dtype=tf.float32)
        opt = p.Instantiate().Create(LR)
        step = _StepFn(opt, var)
        for i, expected in enumerate(_Expected(p, NUM_STEPS)):
            step()
            self.assertAllClose(var.numpy(), expected, rtol=1e-5, atol=1e-6, msg=f'step {i + 1}')

    @parameterized.named_parameters(*_CASES)
    def testStepsInsideTfFunctionEqualTheUpdateRule(self, params_fn):
        p = params_fn()
        var = tf.Variable(X0, dtype=tf.float32)
        step = tf.function(_StepFn(p.Instantiate().Create(LR), var))
        for i, expected in enumerate(_Expected(p, NUM_STEPS)):
            step()
            self.assertAllClose(var.numpy(), expected, rtol=1e-5, atol=1e-6, msg=f'step {i + 1}')

    @parameterized.named_parameters(*_CASES)
    def testCallableLearningRateIsReadAtEveryStep(self, params_fn):
        p = params_fn()
        var = tf.Variable(X0, dtype=tf.float32)
        step_count = tf.Variable(0.0)
        opt = p.Instantiate().Create(lambda: LR / (1.0 + step_count))
        step = _StepFn(opt, var)
        for i, expected in enumerate(_Expected(p, NUM_STEPS, lr=lambda s: LR / (1.0 + s))):
            step()
            step_count.assign_add(1.0)
            self.assertAllClose(var.numpy(), expected, rtol=1e-5, atol=1e-6, msg=f'step {i + 1}')

    @parameterized.named_parameters(*_CASES)
    def testCheckpointRestoresSlotsSoTheThirdStepMatches(self, params_fn):
        p = params_fn()
        logdir = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, logdir, ignore_errors=True)

        var = tf.Variable(X0, dtype=tf.float32)
        opt = p.Instantiate().Create(LR)
        step = _StepFn(opt, var)
        step()
        step()
        path = tf.train.Checkpoint(var=var, opt=opt).save(os.path.join(logdir, 'ckpt'))
        step()
        uninterrupted = var.numpy()

        fresh_var = tf.Variable(np.zeros_like(X0), dtype=tf.float32)
        fresh_opt = p.Instantiate().Create(LR)
        status = tf.train.Checkpoint(var=fresh_var, opt=fresh_opt).restore(path)
        fresh_step = _StepFn(fresh_opt, fresh_var)
        fresh_step()  # Creates the slots, which take their values from the checkpoint.
        status.assert_consumed()
        self.assertAllClose(fresh_var.numpy(), uninterrupted, rtol=1e-6, atol=1e-7)
        self.assertAllClose(uninterrupted, _Expected(p, 3)[-1], rtol=1e-5, atol=1e-6)

    @parameterized.named_parameters(*_CASES)
    def testSlotVariablesAreNamedAfterTheOptimizer(self, params_fn):
        p = params_fn().Set(name='my_opt')
        var = tf.Variable(X0, dtype=tf.float32, name='x')
        opt = p.Instantiate().Create(LR)
        _StepFn(opt, var)()
        if p.cls is not optimizer.SGD:
            self.assertNotEmpty(opt.get_slot_names())
        for slot in opt.get_slot_names():
            self.assertIn('my_opt', opt.get_slot(var, slot).name)

    def testCreateReturnsTfV1Optimizers(self):
        for cls in (optimizer.SGD, optimizer.Momentum, optimizer.RMSProp, optimizer.Adam):
            self.assertIsInstance(cls.Params().Instantiate().Create(0.1),
                                  tf.compat.v1.train.Optimizer, cls.__name__)

    def testBaseOptimizerCreateNamesTheClass(self):
        with self.assertRaisesRegex(NotImplementedError, 'BaseOptimizer'):
            optimizer.BaseOptimizer.Params().Instantiate().Create(0.1)


if __name__ == '__main__':
    tf.test.main()
