"""The plan (`pipeline/plan.py`): K, M, cells, costs, re-materialization and the device mesh,
made once from Params; every check Params allow happens when it is made, before any variable or
graph; the layer, the memory planner and the trainer read the same plan."""


import pytest
import tensorflow as tf
from absl.testing import parameterized

from gpipe_tf import errors
from gpipe_tf import test_utils
from gpipe_tf.layers import basic
from gpipe_tf.perf import memory
from gpipe_tf.pipeline import executor
from gpipe_tf.pipeline import fields
from gpipe_tf.pipeline import pipelining_layer
from gpipe_tf.pipeline import plan as plan_lib
from gpipe_tf.pipeline import schedule

pytestmark = pytest.mark.unit

DEVICES = test_utils.ConfigureVirtualCpus()
BATCH, DIM = 16, 4


def _Loops(plan, num_micro_batches: int) -> bool:
    """Whether a training step of `plan`'s pipeline over M micro-batches runs as a loop."""
    return executor.Choose(plan, num_micro_batches).loops


def _Params(num_layers=6, **kwargs):
    layers = [basic.DenseLayer.Params().Set(input_dim=DIM, output_dim=DIM, activation='tanh')
              for _ in range(num_layers)]
    return pipelining_layer.PipeliningLayer.Params().Set(
        name='pipe', layer_tpl=layers, input_shapes=[BATCH, DIM], **kwargs)


class MakePlanTest(parameterized.TestCase):

    def testCellsCoverTheLayersInOrder(self):
        plan = plan_lib.MakePlan(_Params(num_cells=3), place=False)
        self.assertEqual(plan.num_cells, 3)
        names = [lp.name for cell in plan.cells for lp in cell]
        self.assertEqual(names, [f'layer_{i:03d}' for i in range(6)])
        self.assertEqual([len(cell) for cell in plan.cells], [2, 2, 2])  # Equal FLOPs.
        self.assertEqual(sum(meta.num_params for meta in plan.metas), 6 * (DIM * DIM + DIM))

    @parameterized.parameters(
        (None, None, 1), (4, None, 4), (None, 2, 8), (None, 16, 1), (16, None, 16))
    def testOneRuleForM(self, num_micro_batches, micro_batch_size, expected):
        plan = plan_lib.MakePlan(_Params(num_micro_batches=num_micro_batches,
                                         micro_batch_size=micro_batch_size), place=False)
        self.assertEqual((plan.batch_size, plan.num_micro_batches), (BATCH, expected))

    def testWithoutInputShapesMComesFromTheBatchGiven(self):
        p = _Params(micro_batch_size=2, partition_method='uniform').Set(input_shapes=None)
        self.assertIsNone(plan_lib.MakePlan(p, place=False).num_micro_batches)
        self.assertEqual(plan_lib.NumMicroBatches(p, 32), 16)
        with self.assertRaisesRegex(errors.ConfigError, 'not divisible by micro_batch_size'):
            plan_lib.NumMicroBatches(p, 7)


    def testMIsPerReplica(self):
        plan = plan_lib.MakePlan(_Params(num_replicas=2, micro_batch_size=2), place=False)
        self.assertEqual((plan.num_replicas, plan.num_micro_batches), (2, 4))

    @parameterized.parameters(('always', [True, True, True]), ('never', [False] * 3),
                              ('except_last', [True, True, False]),
                              ('except_last_1', [True, True, False]),
                              ('except_last_2', [True, False, False]),
                              ('except_last_0', [True] * 3), ('except_last_3', [False] * 3))
    def testRecomputeFlags(self, mode, expected):
        self.assertEqual(plan_lib.MakePlan(_Params(num_cells=3, recompute=mode),
                                           place=False).recompute, expected)

    def testKeptCellsCountVirtualStages(self):
        p = _Params(num_cells=2, virtual_stages=2, schedule='interleaved_1f1b',
                    num_micro_batches=4, recompute='except_last_3')
        self.assertEqual(plan_lib.MakePlan(p, place=False).recompute,
                         [True, False, False, False])

    def testKeptCellsReadFromAParamsOverrideText(self):
        p = _Params(num_cells=3).FromText("recompute : 'except_last_2'\n")
        self.assertEqual(p.recompute, 'except_last_2')
        self.assertIn("recompute : 'except_last_2'", p.ToText())
        self.assertEqual(plan_lib.MakePlan(p, place=False).recompute, [True, False, False])

    @parameterized.named_parameters(
        ('more_than_the_cells', 'except_last_4',
         r"^pipe: recompute='except_last_4' keeps the activations of the last 4 cells, but the "
         r"pipeline has 3 \(num_cells x virtual_stages\); expected 'except_last_<j>' with "
         r'0 <= j <= 3\.$'),
        ('not_a_count', 'except_last_two',
         r"^pipe: recompute must be one of \('always', 'except_last', 'never'\) or "
         r"'except_last_<j>' \(the last j cells keep their activations, the others "
         r"re-materialize; 0 <= j <= the number of cells\), got 'except_last_two'\.$"),
        ('negative', 'except_last_-1', r"got 'except_last_-1'\.$"),
        ('leading_zero', 'except_last_02', r"got 'except_last_02'\.$"),
        ('a_bare_count', 2, r'got 2\.$'),
    )
    def testKeptCellsMistakesAreOneLine(self, mode, pattern):
        with self.assertRaisesRegex(errors.ConfigError, pattern) as raised:
            plan_lib.MakePlan(_Params(num_cells=3, recompute=mode), place=False)
        self.assertNotIn('\n', str(raised.exception))

    @parameterized.named_parameters(
        ('more_cells_than_layers', dict(num_cells=7),
         r'num_cells \(7\) is larger than the number of layers \(6\)'),
        ('m_does_not_divide', dict(num_micro_batches=3),
         r'Batch size 16 is not divisible by num_micro_batches \(3\)'),
        ('m_larger_than_batch', dict(num_micro_batches=32),
         r'num_micro_batches \(32\) is larger than the batch size \(16\)'),
        ('replicas_do_not_divide', dict(num_replicas=3),
         r'batch size 16 is not divisible by num_replicas \(3\)'),
        ('unknown_recompute', dict(recompute='sometimes'), r'recompute must be one of'),
        ('both_m_and_size', dict(num_micro_batches=2, micro_batch_size=8),
         r'Set exactly one of num_micro_batches and micro_batch_size'),
    )
    def testMistakesAreRefusedWhenThePlanIsMade(self, kwargs, pattern):
        graph = tf.Graph()
        with graph.as_default():
            with self.assertRaisesRegex(errors.ConfigError, pattern):
                plan_lib.MakePlan(_Params(**kwargs), place=False)
        self.assertEmpty(graph.get_operations())

    def testCellsThatDoNotChainAreRefused(self):
        p = _Params(num_cells=2, partition_method='uniform')
        p.layer_tpl[3].input_dim = DIM + 1
        with self.assertRaisesRegex(errors.ConfigError, r'cell 0 \(layer_000, layer_001, '
                                    r'layer_002\) outputs .* which cell 1 .* cannot take'):
            plan_lib.MakePlan(p, place=False)
        p.partition_method = 'flops'  # Costs need the chain too.
        with self.assertRaisesRegex(errors.ConfigError, r'pipe: the layers do not chain: '
                                    r'layer_003: expected input last dimension 5'):
            plan_lib.MakePlan(p, place=False)

    def testUnplacedPlanHasNoMeshAndPlacingDoesNotRepartition(self):
        p = _Params(num_cells=2, num_replicas=2, devices=DEVICES[:4])
        plan = plan_lib.MakePlan(p, place=False)
        self.assertIsNone(plan.mesh)
        placed = plan.Placed()
        self.assertEqual(placed.mesh, [DEVICES[0:2], DEVICES[2:4]])
        self.assertEqual(placed.devices, DEVICES[0:2])
        self.assertIs(placed.cells, plan.cells)

    def testPlacingChecksTheDevicesExist(self):
        p = _Params(num_cells=2, devices=['/device:CPU:0', '/device:CPU:99'])
        self.assertEqual(plan_lib.MakePlan(p).mesh, [['/device:CPU:0', '/device:CPU:99']])
        with self.assertRaisesRegex(errors.ConfigError, r'/device:CPU:99 \(stage 1 of replica 0\)'):
            plan_lib.MakePlan(p, check_devices=True)

    @parameterized.parameters((2, 1, 2, False), (4, 1, 8, False), (4, 1, 16, True),
                              (2, 2, 8, False), (2, 2, 16, True), (8, 1, 8, True))
    def testTheDefaultLoopsFromTheThresholdOfCellCalls(self, k, v, m, loops):
        p = _Params(num_layers=8, num_cells=k, virtual_stages=v, num_micro_batches=m,
                    schedule='gpipe' if v == 1 else 'interleaved_1f1b')
        self.assertEqual(p.unroll, 'auto')
        plan = plan_lib.MakePlan(p, place=False)
        self.assertEqual(_Loops(plan, m), loops)
        self.assertEqual(k * v * m >= executor.LOOP_FROM_CELL_CALLS, loops)

    def testUnrollTakesTrueFalseOrAuto(self):
        for value in ('yes', 1, 0, None):
            with self.subTest(repr(value)):
                with self.assertRaisesRegex(
                        ValueError, r"unroll must be one of \(True, False, 'auto'\), got "):
                    _Params().Set(unroll=value)

    def testTrueAndFalseAreKeptWhereTheLoopCanRun(self):
        looping = plan_lib.MakePlan(_Params(num_cells=2, unroll=False), place=False)
        self.assertTrue(_Loops(looping, 2))
        p = _Params(num_layers=8, num_cells=8, num_micro_batches=16, unroll=True)
        self.assertFalse(_Loops(plan_lib.MakePlan(p, place=False), 16))
        for mode in plan_lib.RECOMPUTE_MODES:
            with self.subTest(mode):
                # 'auto' loops from LOOP_FROM_CELL_CALLS cell calls whatever the mode.
                p = _Params(num_layers=8, num_cells=8, num_micro_batches=16, unroll='auto',
                            recompute=mode)
                self.assertTrue(_Loops(plan_lib.MakePlan(p, place=False), 16))
                self.assertFalse(_Loops(plan_lib.MakePlan(p, place=False), 4))
        p = _Params(num_layers=8, num_cells=8, num_micro_batches=16, unroll='auto',
                    logical_device_fn=lambda x, k: x)
        self.assertFalse(_Loops(plan_lib.MakePlan(p, place=False), 16))
        # An explicit unroll=False the loop cannot honour is refused, naming why.
        with self.assertRaisesRegex(errors.ConfigError,
                                    'unroll=False runs the schedule as a loop.*logical_device_fn'):
            plan_lib.MakePlan(p.Set(unroll=False), place=False)

    def testATrainingBatchMDoesNotDivideUnrollsAndSaysWhy(self):
        p = _Params(num_layers=8, num_cells=8, num_micro_batches=16, unroll=False)
        plan = plan_lib.MakePlan(p, place=False)
        uneven = executor.Choose(plan, 16, training=True, even=False)
        self.assertFalse(uneven.loops)
        self.assertEqual(str(uneven), 'unrolled: a training batch that M=16 does not divide')
        self.assertTrue(executor.Choose(plan, 16, training=False, even=False).loops)
        auto = plan_lib.MakePlan(p.Set(unroll='auto'), place=False)
        self.assertEqual(str(executor.Choose(auto, 4)),
                         "unrolled: unroll='auto', 32 cell calls < 64")

    def testATimedPartitionTakesTheCostsItsCallerMeasured(self):
        p = _Params(num_layers=4, num_cells=2, partition_method='time')
        with self.assertRaisesRegex(errors.ConfigError, r"partition_method='time' partitions on "
                                    r"the layers' measured costs, which a plan does not measure"):
            plan_lib.MakePlan(p, place=False)
        # Optimal min-max on the costs given: the heavy first layer alone in cell 0.
        plan = plan_lib.MakePlan(p, place=False, layer_costs=[9.0, 1.0, 1.0, 1.0])
        self.assertEqual([len(cell) for cell in plan.cells], [1, 3])
        self.assertEqual(plan.boundaries, [0, 1, 4])
        plan = plan_lib.MakePlan(p, place=False, layer_costs=[1.0, 1.0, 1.0, 9.0])
        self.assertEqual([len(cell) for cell in plan.cells], [3, 1])
        with self.assertRaisesRegex(errors.ConfigError, 'layer_costs has 3 costs for 4 layers'):
            plan_lib.MakePlan(p, place=False, layer_costs=[1.0, 1.0, 1.0])

    def testZeroBubbleVPlacesItsCellsInAV(self):
        p = _Params(num_layers=8, num_cells=2, virtual_stages=2, schedule='zero_bubble_v',
                    num_micro_batches=4, devices=DEVICES[:2])
        plan = plan_lib.MakePlan(p)
        self.assertEqual(plan.mesh, [[DEVICES[0], DEVICES[1], DEVICES[1], DEVICES[0]]])
        cells = memory.FromPlan(plan).cells
        self.assertEqual(memory.FromPlan(plan).device_totals,
                         [cells[0].total + cells[3].total, cells[1].total + cells[2].total])
        text = memory.FromPlan(plan).Format()
        self.assertIn('device 0 (cells 0,3)', text)
        self.assertIn('device 1 (cells 1,2)', text)
        # Keeping the activations, its split backward differentiates the forward's own ops.
        self.assertEqual(plan_lib.MakePlan(p.Copy().Set(recompute='never')).recompute,
                         [False] * 4)

    @parameterized.parameters(('always', [True] * 8), ('never', [False] * 8),
                              ('except_last', [True] * 7 + [False]))
    def testTheScheduleIsOrderedForTheRecomputeModesCosts(self, mode, flags):
        p = _Params(num_layers=8, num_cells=4, virtual_stages=2, schedule='zero_bubble_v',
                    num_micro_batches=16, recompute=mode)
        made = plan_lib.MakePlan(p, place=False).Schedule(16)
        self.assertEqual(made.actions,
                         schedule.Make('zero_bubble_v', 4, 16, 2, recomputes=flags).actions)

    def testIsPipeline(self):
        self.assertTrue(pipelining_layer.IsPipeline(_Params()))
        self.assertFalse(pipelining_layer.IsPipeline(basic.DenseLayer.Params()))
        self.assertFalse(pipelining_layer.IsPipeline(None))


class NumMicroBatchesTest(parameterized.TestCase):
    """M for a batch, by hand: the divisors a plan accepts, the batches a step splits."""

    def _M(self, batch, m=None, size=None, replicas=1, equal=True):
        return plan_lib.NumMicroBatches(
            _Params(num_micro_batches=m, micro_batch_size=size, num_replicas=replicas),
            batch, equal=equal)

    def testNeitherGivenMeansOne(self):
        self.assertEqual(self._M(7), 1)
        self.assertEqual(self._M(None, equal=False), 1)

    def testAPlanAcceptsExactlyTheDivisorsOfTheBatch(self):
        for batch in range(1, 13):
            for m in range(1, 15):
                if batch % m == 0:
                    self.assertEqual(self._M(batch, m), m)
                else:
                    with self.assertRaises(errors.ConfigError, msg=(batch, m)):
                        self._M(batch, m)

    def testMicroBatchSizeGivesBatchOverSize(self):
        for batch in range(1, 13):
            for size in range(1, 15):
                for equal in (True, False):
                    if batch % size == 0:
                        self.assertEqual(self._M(batch, size=size, equal=equal), batch // size)
                    else:
                        with self.assertRaises(errors.ConfigError, msg=(batch, size)):
                            self._M(batch, size=size, equal=equal)

    def testAStepSplitsAnyBatchIntoM(self):
        for batch in (None, 1, 3, 7, 10):
            self.assertEqual(self._M(batch, 4, replicas=2, equal=False), 4)

    def testMIsPerReplica(self):
        self.assertEqual(self._M(16, size=2, replicas=2), 4)
        self.assertEqual(self._M(16, 8, replicas=2), 8)
        with self.assertRaisesRegex(errors.ConfigError, r'\(8\) is larger than the batch size '
                                    r'\(4\)'):
            self._M(8, 8, replicas=2)

    @parameterized.named_parameters(
        ('both', 8, 2, 4, 1, r'exactly one of num_micro_batches and micro_batch_size, got 2 '
                          r'and 4'),
        ('size_not_divisor', 8, None, 3, 1, r'Batch size 8 is not divisible by '
                                            r'micro_batch_size 3'),
        ('m_larger_than_batch', 4, 5, None, 1, r'\(5\) is larger than the batch size \(4\)'),
        ('m_not_divisor', 10, 4, None, 1,
         r'Batch size 10 is not divisible by num_micro_batches \(4\)'),
        ('replicas_not_divisor', 9, 1, None, 2, r'batch size 9 is not divisible by '
                                                r'num_replicas \(2\)'),
    )
    def testErrorsStateTheValues(self, batch, m, size, replicas, message):
        with self.assertRaisesRegex(errors.ConfigError, message):
            self._M(batch, m, size, replicas)

    def testAStepOfAnUnknownBatchNeedsNumMicroBatches(self):
        with self.assertRaisesRegex(errors.ConfigError, 'micro_batch_size \\(2\\) gives M '
                                    'from the batch size, which must then be known'):
            self._M(None, size=2, equal=False)


class ParamsMistakesTest(parameterized.TestCase):
    """A value of the wrong kind in the Params is a ConfigError naming the field, the value
    and what is expected, when the plan is made: not a TypeError from deep inside."""

    @parameterized.named_parameters(
        ('one_params', lambda: _Params().layer_tpl[0],
         r'^pipe: layer_tpl must be a list of layer Params, got Params of DenseLayer; for one '
         r'layer, put its Params in a list: layer_tpl=\[params\]\.$'),
        ('a_number', lambda: 3, r'^pipe: layer_tpl must be a list of layer Params, got int 3\.$'),
    )
    def testLayerTplThatIsNoList(self, value, pattern):
        with self.assertRaisesRegex(errors.ConfigError, pattern):
            plan_lib.MakePlan(_Params().Set(layer_tpl=value()), place=False)

    def testLayerTplEntryThatIsNoLayerParamsIsNamedByIndex(self):
        p = _Params(num_cells=2)
        p.layer_tpl = [p.layer_tpl[0], 'dense', p.layer_tpl[1]]
        with self.assertRaisesRegex(errors.ConfigError,
                                    r"^pipe: layer_tpl\[1\] is str 'dense'; expected a layer's "
                                    r'Params'):
            plan_lib.MakePlan(p, place=False)

    def testBeforeTplAndCellTplAreCheckedAlike(self):
        p = _Params()
        with self.assertRaisesRegex(errors.ConfigError, r'^pipe: before_tpl must be a list'):
            plan_lib.MakePlan(p.Copy().Set(before_tpl=p.layer_tpl[0]), place=False)
        with self.assertRaisesRegex(errors.ConfigError, r'^pipe: cell_tpl must be a list of '
                                    r'cells.*got Params of DenseLayer'):
            plan_lib.MakePlan(p.Copy().Set(layer_tpl=None, cell_tpl=p.layer_tpl[0]),
                              place=False)
        with self.assertRaisesRegex(errors.ConfigError, r"^pipe: cell_tpl\[1\] is int 7; expected "
                                    r"a layer's Params or a list of them\.$"):
            plan_lib.MakePlan(p.Copy().Set(layer_tpl=None, cell_tpl=[p.layer_tpl[:2], 7]),
                              place=False)

    @parameterized.parameters(2, -3, 5)
    def testBatchDimBeyondTheInputsRankNamesBoth(self, batch_dim):
        with self.assertRaisesRegex(errors.ConfigError,
                                    rf'^pipe: batch_dim={batch_dim} is not a dimension of '
                                    r'input_shapes \[16, 4\] \(rank 2\): expected -2 <= '
                                    r'batch_dim < 2\.$'):
            plan_lib.MakePlan(_Params(batch_dim=batch_dim, partition_method='uniform'),
                              place=False)

    @parameterized.parameters(('abc',), ('16,4',), (16,), ([16, '4'],), ({'x': 'abc'},))
    def testInputShapesThatAreNoShapes(self, shapes):
        with self.assertRaisesRegex(errors.ConfigError,
                                    r'^pipe: input_shapes must be the shape of one mini-batch '
                                    r'as a list of ints \(e\.g\. \[128, 64\]\), a dict'):
            plan_lib.MakePlan(_Params(partition_method='uniform').Set(input_shapes=shapes),
                              place=False)

    def testShapesOfSeveralInputsAndDictsStillRead(self):
        p = _Params().Set(input_shapes=[[BATCH, DIM], {'a': (BATCH, 2)}])
        self.assertEqual(fields.InputShapes(p)[0], tf.TensorShape([BATCH, DIM]))
        self.assertEqual(fields.InputShapes(p)[1].a, tf.TensorShape([BATCH, 2]))
        self.assertEqual(fields.BatchSize(p), BATCH)

    def testBoundariesThatDoNotCoverTheLayersAreAConfigError(self):
        with self.assertRaisesRegex(errors.ConfigError, r'boundaries \[0, 3, 1, 4, 6\] do not '
                                    r'cover the 6 layers in 4 non-empty cells'):
            plan_lib.MakePlan(_Params(num_cells=4, partition_method=[0, 3, 1, 4, 6]),
                              place=False)

    def testAScheduleThatIsNoneIsRefusedWithoutInputShapes(self):
        p = _Params(partition_method='uniform', schedule='zb').Set(input_shapes=None)
        with self.assertRaisesRegex(errors.ConfigError,
                                    r"^pipe: schedule must be one of \('gpipe', .*got 'zb'\.$"):
            plan_lib.MakePlan(p, place=False)

    @parameterized.named_parameters(
        ('a_string', '/device:CPU:0',
         r"got str '/device:CPU:0' \(for every stage on one device, write "
         r"\['/device:CPU:0'\]\)\.$"),
        ('a_function_of_no_string', lambda k: 42,
         r'the devices function returned int 42 for stage 0 of replica 0; expected a device '
         r'string'),
    )
    def testDevicesOfTheWrongKindWhenPlaced(self, devices, pattern):
        with self.assertRaisesRegex(errors.ConfigError, pattern):
            plan_lib.MakePlan(_Params(num_cells=2, devices=devices), check_devices=True)


class ConsumersReadThePlanTest(tf.test.TestCase):

    def testTheLayerBuildsThePlansCellsOnThePlansDevices(self):
        p = _Params(num_cells=3, devices=DEVICES[:3])
        plan = plan_lib.MakePlan(p)
        layer = p.Instantiate()
        self.assertEqual(layer.plan, plan)
        self.assertEqual([[l.p.name for l in cell.sequence] for cell in layer.cells],
                         [[lp.name for lp in cell] for cell in plan.cells])
        self.assertEqual(layer.devices, plan.devices)

    def testMemoryPlanTakesMFromMicroBatchSize(self):
        # micro_batch_size=4 on a batch of 16: M = 4 (a `num_micro_batches or 1` would say 1).
        self.assertEqual(memory.PlanMemory(_Params(micro_batch_size=4)).num_micro_batches, 4)


if __name__ == '__main__':
    tf.test.main()
