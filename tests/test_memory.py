"""The memory planner: its parts by hand, the GPipe paper's parameter memory, and measured peak
memory of real steps on virtual CPU devices (a ratio bound)."""

import os
from unittest import mock

os.environ.setdefault('TF_CPU_ALLOCATOR_USE_BFC', 'true')  # Allocation statistics on the CPU.

import tensorflow as tf  # pylint: disable=g-import-not-at-top
from absl.testing import parameterized  # pylint: disable=g-import-not-at-top

from gpipe_tf import model_registry  # pylint: disable=g-import-not-at-top
from gpipe_tf import optimizer  # pylint: disable=g-import-not-at-top
from gpipe_tf import test_utils  # pylint: disable=g-import-not-at-top
from gpipe_tf.layers import basic  # pylint: disable=g-import-not-at-top
from gpipe_tf.perf import memory  # pylint: disable=g-import-not-at-top
from gpipe_tf.perf import pictures  # pylint: disable=g-import-not-at-top
from gpipe_tf.pipeline import plan as plan_lib  # pylint: disable=g-import-not-at-top
from gpipe_tf.pipeline import pipelining_layer  # pylint: disable=g-import-not-at-top

DEVICES = test_utils.ConfigureVirtualCpus()
MIB = 2**20


def _Dense(num_cells=2, m=4, recompute='always', layers=16, width=512, batch=1024):
    return pipelining_layer.PipeliningLayer.Params().Set(
        name='pipe', num_cells=num_cells, num_micro_batches=m, recompute=recompute,
        layer_tpl=[basic.DenseLayer.Params().Set(input_dim=width, output_dim=width,
                                                 activation='relu') for _ in range(layers)],
        input_shapes=[batch, width], devices=DEVICES[:num_cells])


class PlanTest(tf.test.TestCase, parameterized.TestCase):

    def testOneCellOneMicroBatchByHand(self):
        # 4 layers of 512x512 (+ bias): 1 MiB + 2 KiB each; a layer's output on 1024 rows: 2 MiB.
        plan = memory.PlanMemory(_Dense(num_cells=1, m=1, layers=4), slots_per_param=2)
        cell = plan.cells[0]
        params = 4 * (512 * 512 + 512) * 4
        self.assertEqual(cell.params, params)
        self.assertEqual(cell.slots, 2 * params)
        self.assertEqual(cell.gradients, 0)  # M=1: no running sum while the backward runs.
        # The input and the output of the pipeline; four outputs recomputed (8 MiB, more than
        # the weights' gradients), two activation gradients.
        self.assertEqual(cell.stored_activations, 4 * MIB)
        self.assertEqual(cell.working_activations, 8 * MIB + 4 * MIB)
        self.assertEqual(plan.peak_device_bytes, cell.total)
        self.assertEqual(plan.step_bytes, plan.shared_peak_bytes - params - 2 * MIB)  # M=1.

    def testReMaterializationAndMicroBatchesCutActivations(self):
        # With one micro-batch, recomputing it holds what keeping it would: the savings come
        # from keeping M-1 micro-batches' boundaries only.
        activations = lambda m, mode: max(
            c.activations for c in memory.PlanMemory(_Dense(m=m, recompute=mode), 0).cells)
        self.assertEqual(activations(1, 'always'), activations(1, 'never'))
        self.assertLess(activations(8, 'always'), activations(8, 'never'))
        self.assertLess(activations(8, 'always'), activations(1, 'always'))
        self.assertEqual([c.recompute for c in memory.PlanMemory(
            _Dense(num_cells=4, recompute='except_last'), 0).cells], [True] * 3 + [False])

    def testMoreCellsLessMemoryPerDevice(self):
        peaks = [memory.PlanMemory(_Dense(num_cells=k, m=8), 2).peak_device_bytes
                 for k in (1, 2, 4, 8)]
        self.assertEqual(peaks, sorted(peaks, reverse=True))

    def testFitsAndSuggest(self):
        p = _Dense(num_cells=1, m=1, layers=8)
        plan = memory.PlanMemory(p, 2)
        self.assertTrue(plan.Fits(plan.peak_device_bytes))
        self.assertFalse(plan.Fits(plan.peak_device_bytes - 1))
        budget = memory.PlanMemory(p, 2, num_cells=4, num_micro_batches=16).peak_device_bytes
        suggested = memory.SuggestPipeline(p, budget, slots_per_param=2)
        self.assertLessEqual(suggested.num_cells, 4)
        self.assertGreaterEqual(suggested.num_micro_batches, 4 * suggested.num_cells)
        self.assertTrue(suggested.Fits(budget))
        with self.assertRaisesRegex(ValueError, 'does not fit on devices of 1.0 MiB'):
            memory.SuggestPipeline(p, MIB, slots_per_param=2)

    def testFormatNamesEveryCellAndWhetherItFits(self):
        plan = memory.PlanMemory(_Dense(num_cells=2), 1)
        text = plan.Format(device_bytes=plan.cells[1].total)
        self.assertIn('K=2 M=4 batch=1024', text)
        self.assertLen([l for l in text.splitlines() if l.strip().startswith(('0 ', '1 '))], 2)

    @parameterized.parameters(
        (optimizer.SGD.Params(), 0), (optimizer.Momentum.Params(), 1),
        (optimizer.Adam.Params(), 2), (optimizer.RMSProp.Params(), 2),
        (optimizer.RMSProp.Params().Set(momentum=0.0), 1))
    def testSlotsPerParam(self, params, slots):
        self.assertEqual(memory.SlotsPerParam(params), slots)

    def testFromAPlanEqualsFromParamsWithoutPartitioningAgain(self):
        p = _Dense(num_cells=4, m=8)
        pipeline_plan = plan_lib.MakePlan(p, place=False)
        with mock.patch.object(plan_lib, 'MakePlan', side_effect=AssertionError('re-planned')):
            from_plan = memory.FromPlan(pipeline_plan, 2)
            pictured = pictures.Plan(p, 2, pipeline_plan=pipeline_plan)
        self.assertEqual(from_plan, memory.PlanMemory(p, 2))
        self.assertEqual(pictured.memory, from_plan)
        self.assertEqual(pictured.forward_flops, [m.flops for m in pipeline_plan.metas])

    def testBadInput(self):
        with self.assertRaisesRegex(ValueError, 'needs input_shapes'):
            memory.PlanMemory(_Dense().Set(input_shapes=None))
        with self.assertRaisesRegex(ValueError, 'not divisible by num_micro_batches'):
            memory.PlanMemory(_Dense(), num_micro_batches=3)
        with self.assertRaisesRegex(ValueError, 'recompute must be one of'):
            memory.PlanMemory(_Dense(), recompute='sometimes')


# GPipe Table 1, "total param memory" at 12 bytes per parameter (weights, gradient, one RMSProp
# slot). The paper's AmoebaNet column is in GB (1e9 bytes), its Transformer column in GiB; three
# entries fit neither unit (Naive-1 AmoebaNet 1.05GB for 82M parameters, 1.8B -> 24.62GB, and
# Naive-1 Transformer 11.7G for 282.2M) and are left out.
TABLE1_PARAM_MEMORY = [
    ('image.amoebanet.AmoebaNetD_18_416', 3.8e9),
    ('image.amoebanet.AmoebaNetD_18_544', 6.45e9),
    ('image.amoebanet.AmoebaNetD_36_544', 12.53e9),
    ('lm.TransformerL_13', 8.8 * 2**30),
    ('lm.TransformerL_103', 59.5 * 2**30),
    ('lm.TransformerL_415', 235.1 * 2**30),
    ('lm.TransformerL_1663', 937.9 * 2**30),
]


class PaperTable1Test(parameterized.TestCase):

    @parameterized.parameters(*TABLE1_PARAM_MEMORY)
    def testTotalParamMemoryMatchesThePaper(self, name, paper_bytes):
        p = model_registry.GetParams(name, 'Train').model
        plan = memory.PlanMemory(p, slots_per_param=1)
        # The paper counts the gradient once per weight: a plan with M=1 has no second copy.
        ours = sum(3 * c.params for c in plan.cells)
        self.assertLess(abs(ours / paper_bytes - 1), 0.02, f'{name}: {ours} vs {paper_bytes}')


class MeasuredTest(tf.test.TestCase, parameterized.TestCase):
    """What a train step allocates at its peak, measured, against the plan (within 20%)."""

    @parameterized.parameters((1, 1, 'always'), (1, 8, 'always'), (2, 4, 'always'),
                              (4, 8, 'always'), (1, 8, 'never'), (2, 4, 'never'),
                              (4, 8, 'except_last'))
    def testPlannedStepMemoryIsWithin20PercentOfMeasured(self, k, m, recompute):
        p = _Dense(num_cells=k, m=m, recompute=recompute)
        layer = p.Instantiate()
        x = tf.random.stateless_normal([1024, 512], [1, 2])
        measured = test_utils.StepBytes(layer, x)
        planned = memory.PlanMemory(p, slots_per_param=0).step_bytes
        print(f'K={k} M={m} {recompute}: planned {planned / MIB:.1f} MiB, measured '
              f'{measured / MIB:.1f} MiB: {planned / measured:.3f}')
        self.assertBetween(planned / measured, 0.8, 1.2,
                           f'planned {planned / MIB:.1f} MiB, measured {measured / MIB:.1f} MiB')


if __name__ == '__main__':
    tf.test.main()
