"""A schedule's actions (`pipeline/actions.py`): what each needs the results of."""

import pytest
import tensorflow as tf

from gpipe_tf.pipeline import actions
from gpipe_tf.pipeline.actions import Action

pytestmark = pytest.mark.unit


class DependenciesTest(tf.test.TestCase):

    def testAForwardNeedsThePreviousStagesForward(self):
        self.assertEqual(actions.Dependencies(Action('F', 0, 3), 4), [])
        self.assertEqual(actions.Dependencies(Action('F', 2, 3), 4), [Action('F', 1, 3)])

    def testABackwardNeedsItsForwardAndTheNextStagesBackward(self):
        self.assertEqual(actions.Dependencies(Action('B', 1, 3), 4),
                         [Action('F', 1, 3), Action('B', 2, 3)])
        self.assertEqual(actions.Dependencies(Action('B', 3, 3), 4), [Action('F', 3, 3)])
        self.assertEqual(actions.Dependencies(Action('I', 1, 3), 4, backward_kind='I'),
                         [Action('F', 1, 3), Action('I', 2, 3)])

    def testAWeightGradientNeedsOnlyItsInputGradient(self):
        self.assertEqual(actions.Dependencies(Action('W', 1, 3), 4), [Action('I', 1, 3)])


if __name__ == '__main__':
    tf.test.main()
