"""Tests of gpipe_tf.learning_rate: the multiplier's exact values at chosen steps (warm-up ramp,
staircase and continuous decay, the min_value floor, cosine endpoints), on Python ints, step
tensors and inside tf.function, and the errors for bad Params."""

import math

import pytest
import numpy as np
import tensorflow as tf

from gpipe_tf import learning_rate
from gpipe_tf import test_utils

pytestmark = pytest.mark.unit

DEVICES = test_utils.ConfigureVirtualCpus()


def _Values(p, steps):
    schedule = p.Instantiate()
    return [float(schedule.Value(step)) for step in steps]


class ConstantTest(tf.test.TestCase):

    def testIsOneWithoutWarmup(self):
        self.assertAllClose(_Values(learning_rate.Constant.Params(), [0, 1, 10, 10**6]),
                            [1.0] * 4)

    def testWarmupRampsLinearlyToOneAtWarmupSteps(self):
        # Step s runs at (s + 1) / warmup_steps: the first step is not wasted at rate 0, and
        # step warmup_steps - 1 is the first at the full rate.
        p = learning_rate.Constant.Params().Set(warmup_steps=4)
        self.assertAllClose(_Values(p, [0, 1, 2, 3, 4, 5, 1000]),
                            [0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0])

    def testWarmupIsLinearInTheStep(self):
        p = learning_rate.Constant.Params().Set(warmup_steps=100)
        values = np.array(_Values(p, range(0, 100, 7)))
        self.assertAllClose(np.diff(values), np.full(len(values) - 1, 0.07), atol=1e-6)
        self.assertAllLessEqual(values, 1.0)

    def testAcceptsStepTensorsAndVariables(self):
        schedule = learning_rate.Constant.Params().Set(warmup_steps=10).Instantiate()
        self.assertAllClose(schedule.Value(tf.constant(4, tf.int64)), 0.5)
        self.assertAllClose(schedule.Value(tf.constant(4, tf.int32)), 0.5)
        self.assertAllClose(schedule.Value(tf.Variable(4, dtype=tf.int64)), 0.5)

    def testWorksInsideTfFunctionOnAChangingStep(self):
        step = tf.Variable(0, dtype=tf.int64)
        schedule = learning_rate.ExponentialDecay.Params().Set(
            decay_rate=0.5, decay_steps=2, warmup_steps=2).Instantiate()
        value = tf.function(lambda: schedule.Value(step))
        got = []
        for _ in range(6):
            got.append(float(value()))
            step.assign_add(1)
        self.assertAllClose(got, [0.5, 1.0, 0.5, 0.5, 0.25, 0.25])

    def testNegativeWarmupIsAnErrorStatingTheValue(self):
        with self.assertRaisesRegex(ValueError, r'warmup_steps.*-3'):
            learning_rate.Constant.Params().Set(warmup_steps=-3).Instantiate()
        with self.assertRaisesRegex(ValueError, r'warmup_steps.*-1'):
            learning_rate.CosineDecay.Params().Set(warmup_steps=-1).Instantiate()


class ExponentialDecayTest(tf.test.TestCase):

    def _Params(self, **kwargs):
        return learning_rate.ExponentialDecay.Params().Set(
            **{'decay_rate': 0.5, 'decay_steps': 10, **kwargs})

    def testStaircaseDecaysInWholePeriods(self):
        self.assertAllClose(_Values(self._Params(staircase=True), [0, 5, 9, 10, 19, 20, 25, 35]),
                            [1.0, 1.0, 1.0, 0.5, 0.5, 0.25, 0.25, 0.125])

    def testContinuousDecayFollowsTheExponential(self):
        steps = [0, 5, 10, 15, 25, 37]
        self.assertAllClose(_Values(self._Params(staircase=False), steps),
                            [0.5 ** (s / 10) for s in steps], rtol=1e-6)

    def testStaircaseIsTheDefault(self):
        self.assertAllClose(_Values(self._Params(), [15]), [0.5])

    def testMinValueFloorsTheDecay(self):
        p = self._Params(staircase=False, min_value=0.2)
        # 0.5 ** 2 = 0.25 is above the floor; 0.5 ** 3 = 0.125 and later are not.
        self.assertAllClose(_Values(p, [0, 20, 30, 100, 10**6]), [1.0, 0.25, 0.2, 0.2, 0.2])

    def testWarmupMultipliesTheDecay(self):
        p = self._Params(staircase=True, warmup_steps=20)
        self.assertAllClose(_Values(p, [0, 9, 10, 19, 20, 30]),
                            [1 / 20, 10 / 20, 0.5 * 11 / 20, 0.5, 0.25, 0.125])

    def testNonPositiveDecayIsAnErrorStatingTheValues(self):
        with self.assertRaisesRegex(ValueError, r'decay_steps.*\b0\b.*0\.5'):
            self._Params(decay_steps=0).Instantiate()
        with self.assertRaisesRegex(ValueError, r'-5'):
            self._Params(decay_steps=-5).Instantiate()
        with self.assertRaisesRegex(ValueError, r'decay_rate.*-0\.97'):
            self._Params(decay_rate=-0.97).Instantiate()
        with self.assertRaisesRegex(ValueError, r'decay_rate.*\b0\.0\b'):
            self._Params(decay_rate=0.0).Instantiate()


class CosineDecayTest(tf.test.TestCase):

    def _Params(self, **kwargs):
        return learning_rate.CosineDecay.Params().Set(**{'total_steps': 100, **kwargs})

    def testEndpointsAndMiddle(self):
        self.assertAllClose(_Values(self._Params(), [0, 50, 100]), [1.0, 0.5, 0.0], atol=1e-6)

    def testFollowsHalfACosineDownToMinValue(self):
        steps = [0, 10, 25, 50, 75, 90, 100]
        expected = [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / 100)) for s in steps]
        self.assertAllClose(_Values(self._Params(min_value=0.1), steps), expected, rtol=1e-6)

    def testStaysAtMinValueAfterTotalSteps(self):
        self.assertAllClose(_Values(self._Params(min_value=0.05), [100, 101, 150, 200, 10**6]),
                            [0.05] * 5)

    def testIsMonotonicallyNonIncreasing(self):
        values = _Values(self._Params(min_value=0.05), range(0, 130, 3))
        self.assertAllLessEqual(np.diff(values), 1e-7)

    def testWarmupMultipliesTheCosine(self):
        p = self._Params(min_value=0.0, warmup_steps=10)

        def cosine(step):
            return 0.5 * (1 + math.cos(math.pi * step / 100))

        self.assertAllClose(_Values(p, [0, 4, 9, 50]),
                            [cosine(0) / 10, cosine(4) / 2, cosine(9), cosine(50)], rtol=1e-6)

    def testNonPositiveTotalStepsIsAnErrorStatingTheValue(self):
        with self.assertRaisesRegex(ValueError, r'total_steps.*\b0\b'):
            self._Params().Set(total_steps=0).Instantiate()
        with self.assertRaisesRegex(ValueError, r'total_steps.*-10'):
            self._Params().Set(total_steps=-10).Instantiate()


class ParamsTest(tf.test.TestCase):

    def testInstantiateCopiesTheParams(self):
        p = learning_rate.CosineDecay.Params().Set(total_steps=100)
        schedule = p.Instantiate()
        p.total_steps = 10
        self.assertAllClose(schedule.Value(50), 0.5, atol=1e-6)

    def testUnknownParamIsAnError(self):
        with self.assertRaises(AttributeError):
            learning_rate.ExponentialDecay.Params().Set(decay_step=10)


if __name__ == '__main__':
    tf.test.main()
