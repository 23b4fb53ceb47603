"""The Params-only benchmarks: partition quality and Table 2's simulated throughput trend."""

import importlib.util
import os
import sys

from absl.testing import absltest
from absl.testing import parameterized

_BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           'benchmarks')


def _Load(name):
    """A benchmark script as a module: benchmarks/ is a folder of scripts, not a package."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(_BENCHMARKS, f'{name}.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sys.path.insert(0, _BENCHMARKS)  # The scripts import each other, as when run from there.
partition_quality = _Load('partition_quality')
simulated_throughput = _Load('simulated_throughput')

_COSTS = {}  # Per model, its layer costs; FPropMeta of a paper-size model, computed once.


def _Costs(model):
    if model not in _COSTS:
        _COSTS[model] = partition_quality.LayerCosts(partition_quality.PipelineParams(model))
    return _COSTS[model]


class PartitionQualityTest(parameterized.TestCase):

    @parameterized.product(model=list(partition_quality.MODELS), num_cells=[2, 4, 8])
    def testOptimalIsNeverWorseBalancedThanHistogram(self, model, num_cells):
        result = partition_quality.Compare(_Costs(model), num_cells)
        self.assertLessEqual(result['optimal']['balance'], result['histogram']['balance'])
        self.assertGreaterEqual(result['optimal']['balance'], 1.0)

    def testBalanceOfAnEvenSplitIsOne(self):
        self.assertEqual(partition_quality.Balance([1, 2, 2, 1], [0, 2, 4]), 1.0)
        self.assertEqual(partition_quality.Balance([1, 2, 2, 1], [0, 1, 4]), 5 / 3)


class SimulatedThroughputTest(absltest.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        st = simulated_throughput
        cls.rows = st.ThroughputTable(st.PipelineParams('Transformer-48'),
                                      1e12 * st.DEVICE_TFLOPS, 1e9 * st.LINK_GBPS)
        cls.trend = st.Trend(cls.rows)

    def testNormalisedToTwoCellsOneMicroBatch(self):
        first = self.rows[0]
        self.assertEqual((first['k'], first['m'], first['normalised']), (2, 1, 1.0))

    def testTransformerThroughputRisesWithMicroBatchesAtEveryK(self):
        self.assertEqual(self.trend['rises_with_m'], {2: True, 4: True, 8: True})

    def testTransformerThroughputRisesWithCellsAtThirtyTwoMicroBatches(self):
        self.assertTrue(self.trend['rises_with_k'][32])


if __name__ == '__main__':
    absltest.main()
