"""Tests of BaseInput's checks of the split it loads (its batching is tested through the image and
text inputs)."""

import pytest
import numpy as np
import tensorflow as tf

from gpipe_tf import errors
from gpipe_tf.input import base_input
from gpipe_tf.nested_map import NestedMap

pytestmark = pytest.mark.unit


class _ArrayInput(base_input.BaseInput):
    """A split of the examples `values`."""

    def __init__(self, params, values):
        super().__init__(params)
        self._values = np.asarray(values)

    def _LoadExamples(self):
        return NestedMap(x=self._values)


def _Input(values, **kwargs):
    return _ArrayInput.Params().Set(name='toy', **kwargs).Instantiate(values=values)


class BaseInputTest(tf.test.TestCase):

    def testAnEmptySplitIsAnInputError(self):
        with self.assertRaisesRegex(errors.InputError, 'toy: the split has no examples; expected '
                                    'at least one'):
            _Input([]).Examples()

    def testNumExamplesBeyondTheSplitIsAConfigErrorStatingBoth(self):
        with self.assertRaisesRegex(errors.ConfigError, 'toy: num_examples=4 but the split has 3 '
                                    'examples; expected at most 3'):
            _Input([1, 2, 3], num_examples=4).Examples()
        self.assertEqual(_Input([1, 2, 3], num_examples=3).NumExamples(), 3)


if __name__ == '__main__':
    tf.test.main()
