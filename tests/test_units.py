"""Tests of gpipe_tf.units: one unit system for every printed size."""

import pytest
from absl.testing import absltest
from absl.testing import parameterized

from gpipe_tf import units

pytestmark = pytest.mark.unit


class UnitsTest(parameterized.TestCase):

    @parameterized.parameters(
        (None, '?'), (0, '0'), (999, '999'), (1000, '1.00K'), (139260, '139.26K'),
        (2.5e9, '2.50G'), (8.39e13, '83.90T'), (-2000, '-2.00K'))
    def testCountsUseDecimalPrefixes(self, value, text):
        self.assertEqual(units.Count(value), text)

    @parameterized.parameters(
        (None, '?'), (0, '0B'), (1000, '1000B'), (1024, '1.00KiB'), (16384, '16.00KiB'),
        (3 * 2**20, '3.00MiB'), (2**30 + 2**29, '1.50GiB'), (2**41, '2.00TiB'))
    def testBytesUseBinaryPrefixes(self, value, text):
        self.assertEqual(units.Bytes(value), text)

    def testMibHasOneDecimalAndNoUnit(self):
        self.assertEqual(units.MiB(2**20), '1.0')
        self.assertEqual(units.MiB(2.6 * 2**20), '2.6')
        self.assertEqual(units.MiB(0), '0.0')


if __name__ == '__main__':
    absltest.main()
