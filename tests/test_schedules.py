"""Every schedule keeps the contract (docs/architecture.md's invariant 6): loss, outputs and
gradients of a pipeline run by gpipe, 1f1b, interleaved 1F1B or zero-bubble equal the same layers
run in sequence on the whole batch, in eager mode, in a tf.function and in a v1 graph; batch norm's
moving statistics are the same under every schedule; and each device runs its actions in its list's
order."""

import re

import numpy as np
import tensorflow as tf
from absl.testing import parameterized

from gpipe_tf import errors
from gpipe_tf import test_utils
from gpipe_tf.layers import basic
from gpipe_tf.layers import conv
from gpipe_tf.layers import fprop_context
from gpipe_tf.layers import normalization
from gpipe_tf.models.transformer import network as transformer_network
from gpipe_tf.nested_map import NestedMap
from gpipe_tf.pipeline import pipelining_layer
from gpipe_tf.pipeline import schedule as schedule_lib

DEVICES = test_utils.ConfigureVirtualCpus()
BATCH, DIM, NUM_BLOCKS = 8, 4, 4
RTOL = 1e-5
# (name, schedule, K devices, v, M, R): each kind with counts that exercise it.
CASES = [
    ('gpipe', 'gpipe', 2, 1, 4, 1),
    ('1f1b', '1f1b', 3, 1, 4, 1),
    ('interleaved', 'interleaved_1f1b', 2, 2, 4, 1),
    ('zero_bubble', 'zero_bubble', 3, 1, 4, 1),
    ('1f1b_replicas', '1f1b', 2, 1, 2, 2),
    ('zero_bubble_v', 'zero_bubble_v', 2, 2, 4, 1),  # Cells 0-3 on devices 0, 1, 1, 0.
]


def Layers(batch_norm=False):
    layers = []
    for i in range(NUM_BLOCKS):
        layers.append(basic.DenseLayer.Params().Set(name=f'dense_{i}', input_dim=DIM,
                                                    output_dim=DIM, activation='tanh'))
        if batch_norm:
            layers.append(normalization.BatchNormLayer.Params().Set(name=f'bn_{i}', dim=DIM))
        layers.append(basic.DropoutLayer.Params().Set(name=f'dropout_{i}', keep_prob=0.75))
    return layers


def AssertMovingStatisticsAsGpipe(test, layer, x, loss_inputs, k, v, m, r):
    """Batch norm's moving statistics of `layer`, after its step, equal those of the same
    pipeline run by gpipe (unrolled) for one step on the same data."""
    reference = Pipeline('gpipe', k, v, m, r, batch_norm=True).Instantiate()
    PipelineStep(reference, x, loss_inputs)
    want = {t.name: t.numpy() for t in reference.variables if 'moving' in t.name}
    test.assertNotEmpty(want)
    for var in layer.variables:
        if 'moving' in var.name:
            test.assertAllClose(var.numpy(), want[var.name], rtol=RTOL, msg=var.name)


# gpipe unrolled is test_pipeline's (its K x M x recompute grid in every mode); here it is the
# batch-norm reference. The same cases run as a loop over the schedule's clock (`unroll=False`).
LOOPED = [(f'{case[0]}_looped',) + case[1:] + (False,) for case in CASES]
UNROLLED = [case + (True,) for case in CASES]


def Pipeline(kind, k, v, m, r, batch_norm=False, **overrides):
    return pipelining_layer.PipeliningLayer.Params().Set(
        name='model', layer_tpl=Layers(batch_norm), num_cells=k, virtual_stages=v,
        num_micro_batches=m, num_replicas=r, schedule=kind, input_shapes=[BATCH, DIM],
        devices=DEVICES[:k * r], partition_method='uniform', random_seed=3).Set(**overrides)


def Data():
    x = tf.random.stateless_normal([BATCH, DIM], [1, 2])
    target = tf.random.stateless_normal([BATCH, DIM], [3, 4])
    weights = tf.constant([1.0, 0.0, 2.0, 1.0, 0.5, 1.0, 3.0, 1.0])
    return x, NestedMap(target=target, weights=weights)


def LossFn(outputs, loss_inputs):
    """A weighted mean over examples, as a task's loss: (value, weight)."""
    per_example = tf.reduce_sum(tf.square(outputs - loss_inputs.target), axis=1)
    total = tf.reduce_sum(loss_inputs.weights)
    return tf.math.divide_no_nan(tf.reduce_sum(per_example * loss_inputs.weights), total), total


def PipelineStep(layer, x, loss_inputs):
    """(loss, outputs, gradients w.r.t. x and every trainable variable), training, step 5."""
    with tf.GradientTape() as tape, fprop_context.Scope(step=5):
        tape.watch(x)
        outputs, loss, _ = layer.FPropLoss(layer.theta, x, LossFn, loss_inputs)
    return loss, outputs, tape.gradient(loss, [x] + list(layer.trainable_variables))


def ReferenceStep(layer, x, loss_inputs, num_micro_batches=1):
    """The same with the pipeline's layers in sequence on the whole batch (batch norm per
    micro-batch when num_micro_batches > 1)."""
    with tf.GradientTape() as tape:
        tape.watch(x)
        outputs = test_utils.Unpartitioned(layer, x, num_micro_batches, step=5)
        loss, _ = LossFn(outputs, loss_inputs)
    return loss, outputs, tape.gradient(loss, [x] + list(layer.trainable_variables))


def V1StepAndReference(*pipeline_args, **overrides):
    """(PipelineStep's results, ReferenceStep's) of `Pipeline(*pipeline_args, **overrides)`,
    built in a tf.compat.v1 graph and run in a Session."""
    def Build():
        layer = Pipeline(*pipeline_args, **overrides).Instantiate()
        x, loss_inputs = Data()
        with fprop_context.Scope(step=5):
            outputs, loss, _ = layer.FPropLoss(layer.theta, x, LossFn, loss_inputs)
            ref_outputs = test_utils.Unpartitioned(layer, x, 1, step=5)
        ref_loss, _ = LossFn(ref_outputs, loss_inputs)
        sources = [x] + list(layer.trainable_variables)
        return ((loss, outputs, tf.compat.v1.gradients(loss, sources)),
                (ref_loss, ref_outputs, tf.compat.v1.gradients(ref_loss, sources)))

    return test_utils.RunV1(Build)


class ScheduleContractTest(tf.test.TestCase, parameterized.TestCase):

    def assertSameStep(self, got, want, rtol=RTOL, d_x_rtol=RTOL):
        names = ['loss', 'outputs', 'd_x'] + [f'grad {i}' for i in range(len(got[2]) - 1)]
        for name, a, b in zip(names, [got[0], got[1]] + list(got[2]),
                              [want[0], want[1]] + list(want[2])):
            self.assertLessEqual(test_utils.MaxRelativeError(a, b),
                            d_x_rtol if name == 'd_x' else rtol, msg=name)

    @parameterized.named_parameters(*UNROLLED[1:4], *UNROLLED[5:], *LOOPED[2:3], *LOOPED[5:])
    def testEagerEqualsTheLayersInSequence(self, kind, k, v, m, r, unroll):
        layer = Pipeline(kind, k, v, m, r, unroll=unroll).Instantiate()
        x, loss_inputs = Data()
        self.assertSameStep(PipelineStep(layer, x, loss_inputs),
                            ReferenceStep(layer, x, loss_inputs))

    @parameterized.named_parameters(*UNROLLED[1:], *LOOPED[1:])
    def testFunctionEqualsTheLayersInSequence(self, kind, k, v, m, r, unroll):
        layer = Pipeline(kind, k, v, m, r, unroll=unroll).Instantiate()
        x, loss_inputs = Data()
        got = tf.function(lambda x: PipelineStep(layer, x, loss_inputs))(x)
        self.assertSameStep(got, ReferenceStep(layer, x, loss_inputs))

    @parameterized.named_parameters(*UNROLLED[1:4], *LOOPED[:1], *LOOPED[3:4], *LOOPED[5:])
    def testV1GraphEqualsTheLayersInSequence(self, kind, k, v, m, r, unroll):
        self.assertSameStep(*V1StepAndReference(kind, k, v, m, r, unroll=unroll))

    @parameterized.named_parameters(*UNROLLED[1:4], *UNROLLED[5:], *LOOPED[1:2], *LOOPED[5:])
    def testBatchNormStatisticsAndGradientsEqualGPipes(self, kind, k, v, m, r, unroll):
        x, loss_inputs = Data()
        steps, statistics = {}, {}
        # gpipe unrolled is the reference of every other schedule and executor.
        for name, run_kind, run_unroll in (('reference', 'gpipe', True),
                                           ('tested', kind, unroll)):
            layer = Pipeline(run_kind, k, v, m, r, batch_norm=True,
                             unroll=run_unroll).Instantiate()
            steps[name] = PipelineStep(layer, x, loss_inputs)
            # Batch norm normalizes each micro-batch: the oracle runs M micro-batches. With
            # two examples per micro-batch batch norm is ill-conditioned, and float32
            # summation order shows at up to 6e-5 of the largest gradient (under gpipe too).
            self.assertSameStep(steps[name], ReferenceStep(layer, x, loss_inputs, m),
                                rtol=1e-4, d_x_rtol=1e-4)
            statistics[name] = {v.name: v.numpy() for v in layer.variables
                                if 'moving' in v.name}
        # Eagerly, the same ops run on the same values in another order: bit for bit. A split
        # backward runs the pruned parts of the cell's traced gradient (`residuals`): the
        # sums' order differs.
        exact = 1e-4 if kind.startswith('zero_bubble') else 1e-30
        self.assertSameStep(steps['tested'], steps['reference'], rtol=exact, d_x_rtol=exact)
        self.assertNotEmpty(statistics['reference'])
        for name, value in statistics['reference'].items():
            self.assertAllClose(statistics['tested'][name], value, rtol=RTOL, msg=name)

    def testEvalLossIsTheWholeBatchLoss(self):
        layer = Pipeline('1f1b', 3, 1, 4, 1).Instantiate()
        x, loss_inputs = Data()
        with fprop_context.Scope(training=False):
            outputs, loss, weight = layer.FPropLoss(layer.theta, x, LossFn, loss_inputs)
            ref = test_utils.Unpartitioned(layer, x)
        self.assertLess(test_utils.MaxRelativeError(outputs, ref), RTOL)
        self.assertAllClose(loss, LossFn(ref, loss_inputs)[0], rtol=RTOL)
        self.assertAllClose(weight, tf.reduce_sum(loss_inputs.weights))


# (name, schedule, K, v, recompute): zero-bubble's split backward keeping the activations, on
# the last cell alone, and re-materializing.
SPLIT_CASES = [(f'{kind}_{recompute}', kind, k, v, recompute)
               for kind, k, v in (('zero_bubble', 3, 1), ('zero_bubble_v', 2, 2))
               for recompute in ('never', 'except_last', 'always')]


def _Forwards(graph, part: str) -> int:
    """The dense layers' forward activations (Tanh ops; their gradients are TanhGrad) that the
    function calls under the name scopes of `part` ('fwd', 'bwd_input', 'bwd_weight') of
    `graph` run, through nested calls."""
    library = {f.signature.name: f for f in graph.as_graph_def().library.function}

    def Count(function_name):
        count = 0
        for node in library[function_name].node_def:
            count += node.op == 'Tanh'
            count += sum(Count(value.func.name) for value in node.attr.values()
                         if value.func.name in library)
        return count

    return sum(Count(op.get_attr('f').name) for op in graph.get_operations()
               if op.type in ('PartitionedCall', 'StatefulPartitionedCall') and
               re.match(rf'cell_\d+_mb_\d+_{part}/', op.name))


class SplitBackwardTest(tf.test.TestCase, parameterized.TestCase):
    """zero_bubble's I and W read one forward's residuals: with recompute 'never' the
    forward's own, re-materializing one re-run before I; W runs no forward."""

    assertSameStep = ScheduleContractTest.assertSameStep

    @parameterized.named_parameters(*SPLIT_CASES)
    def testEveryModeEqualsTheLayersInSequence(self, kind, k, v, recompute):
        x, loss_inputs = Data()
        layer = Pipeline(kind, k, v, 4, 1, recompute=recompute).Instantiate()
        want = ReferenceStep(layer, x, loss_inputs)
        with self.subTest('eager'):
            self.assertSameStep(PipelineStep(layer, x, loss_inputs), want)
        with self.subTest('function'):
            self.assertSameStep(tf.function(lambda x: PipelineStep(layer, x, loss_inputs))(x),
                                want)
        with self.subTest('v1'):
            self.assertSameStep(*V1StepAndReference(kind, k, v, 4, 1, recompute=recompute))

    @parameterized.named_parameters(*SPLIT_CASES)
    def testBatchNormStatisticsAndGradientsEqualGPipes(self, kind, k, v, recompute):
        x, loss_inputs = Data()
        steps, statistics = {}, {}
        for name, run_kind, run_recompute in (('reference', 'gpipe', 'always'),
                                              ('tested', kind, recompute)):
            layer = Pipeline(run_kind, k, v, 4, 1, batch_norm=True,
                             recompute=run_recompute).Instantiate()
            steps[name] = PipelineStep(layer, x, loss_inputs)
            # Batch norm over two examples per micro-batch is ill-conditioned: another order
            # of float32 sums shows at up to 6e-5 (as in ScheduleContractTest's twin). The
            # oracle: the layers in sequence, batch norm per micro-batch.
            self.assertSameStep(steps[name], ReferenceStep(layer, x, loss_inputs, 4),
                                rtol=1e-4, d_x_rtol=1e-4)
            statistics[name] = {v.name: v.numpy() for v in layer.variables
                                if 'moving' in v.name}
        self.assertSameStep(steps['tested'], steps['reference'], rtol=1e-4, d_x_rtol=1e-4)
        self.assertNotEmpty(statistics['reference'])
        for name, value in statistics['reference'].items():
            self.assertAllClose(statistics['tested'][name], value, rtol=RTOL, msg=name)

    @parameterized.parameters(('zero_bubble', 1, 'never'), ('zero_bubble', 1, 'always'),
                              ('zero_bubble_v', 2, 'never'))
    def testUnevenMicroBatchesEqualTheLayersInSequence(self, kind, v, recompute):
        # 6 examples in M=4 micro-batches of 2, 2, 1 and 1: the split parts are traced for
        # each of the two sizes (they were traced for micro-batch 0's and failed to bind).
        x, loss_inputs = Data()
        x, loss_inputs = x[:6], tf.nest.map_structure(lambda t: t[:6], loss_inputs)
        layer = Pipeline(kind, 2, v, 4, 1, recompute=recompute).Instantiate()
        self.assertSameStep(tf.function(lambda x: PipelineStep(layer, x, loss_inputs))(x),
                            ReferenceStep(layer, x, loss_inputs))

    @parameterized.parameters(('never', 0), ('always', 1))
    def testForwardsPerMicroBatch(self, recompute, reruns):
        """Per micro-batch and cell: its forward at F, a re-run before I only when
        re-materializing, none in W."""
        k, m = 2, 4
        layer = Pipeline('zero_bubble', k, 1, m, 1, recompute=recompute).Instantiate()
        x, loss_inputs = Data()
        graph = tf.function(lambda x: PipelineStep(layer, x, loss_inputs)).get_concrete_function(
            x).graph
        self.assertEqual(_Forwards(graph, 'fwd'), m * NUM_BLOCKS)
        self.assertEqual(_Forwards(graph, 'bwd_input'), m * NUM_BLOCKS * reruns)
        self.assertEqual(_Forwards(graph, 'bwd_weight'), 0)


class ForwardOnlyScheduleTest(tf.test.TestCase, parameterized.TestCase):
    """Inference (eval, decode, an exported model) runs the forward-only schedule: the
    training schedule's forwards, nothing recorded for a backward."""

    @parameterized.named_parameters(*UNROLLED[:4], *LOOPED[:3], *LOOPED[5:])
    def testOutputsEqualTheLayersInInferenceMode(self, kind, k, v, m, r, unroll):
        # Batch norm's moving statistics and dropout make inference differ from training.
        layer = Pipeline(kind, k, v, m, r, batch_norm=True, unroll=unroll).Instantiate()
        for var in layer.variables:
            if 'moving' in var.name:
                var.assign(tf.random.stateless_uniform(var.shape, [5, len(var.name)],
                                                       0.5, 1.5))
        x, _ = Data()
        step = tf.function(lambda x: layer(x))
        with fprop_context.Scope(training=False):
            outputs = step(x)
            reference = test_utils.Unpartitioned(layer, x)
        with fprop_context.Scope(training=True, step=5):
            training = test_utils.Unpartitioned(layer, x, m, step=5)
        self.assertLess(test_utils.MaxRelativeError(outputs, reference), RTOL)
        self.assertGreater(test_utils.MaxRelativeError(training, reference), 1e-2)
        # No backward: the graph has no gradient and no backward cell function.
        with fprop_context.Scope(training=False):
            graph = step.get_concrete_function(x).graph
        names = [op.name for op in graph.get_operations()]
        functions = [f.signature.name for f in graph.as_graph_def().library.function]
        self.assertEmpty([n for n in names + functions if re.search(r'bwd|[Gg]radient', n)])
        if unroll:
            sched = schedule_lib.Make(kind, k, m, v, training=False)
            calls = [n for n in names if re.match(r'cell_\d+_mb_\d+_fwd/', n)]
            self.assertLen(calls, len(sched.order))

    def testBatchNormStatisticsDoNotChange(self):
        layer = Pipeline('1f1b', 3, 1, 4, 1, batch_norm=True).Instantiate()
        before = [v.numpy() for v in layer.variables]
        with fprop_context.Scope(training=False):
            layer(Data()[0])
        for b, v in zip(before, layer.variables):
            self.assertAllEqual(b, v.numpy(), msg=v.name)


# The loop with cells that keep their activations (`residuals`: the forward hands what the
# backward reads on in TensorArrays); 'always' is ScheduleContractTest's LOOPED grid.
# (Replicas are ScheduleContractTest's: each replica's pipeline is the same.)
LOOPED_KEEPING = [(f'{case[0]}_{recompute}',) + case[1:] + (recompute,) for case in CASES
                  for recompute in ('never', 'except_last')
                  if case[5] == 1 and (recompute == 'never' or
                                       case[0] in ('1f1b', 'zero_bubble'))]


def _RecomputeOps(graph) -> int:
    """The ops under a re-materializing forward's name scope, in `graph` and its functions."""
    graph_def = graph.as_graph_def()
    nodes = list(graph_def.node) + [n for f in graph_def.library.function for n in f.node_def]
    return sum('recompute/' in n.name for n in nodes)


class LoopedKeepingTest(tf.test.TestCase, parameterized.TestCase):
    """The loop runs every recompute mode: a cell that keeps its activations runs no forward
    again, and every schedule still equals the layers in sequence."""

    assertSameStep = ScheduleContractTest.assertSameStep

    @parameterized.named_parameters(*LOOPED_KEEPING)
    def testFunctionWithBatchNormEqualsTheLayersInSequence(self, kind, k, v, m, r, recompute):
        x, loss_inputs = Data()
        layer = Pipeline(kind, k, v, m, r, batch_norm=True, recompute=recompute,
                         unroll=False).Instantiate()
        got = tf.function(lambda x: PipelineStep(layer, x, loss_inputs))(x)
        # Batch norm per micro-batch of two examples: float32 order shows at up to 6e-5.
        self.assertSameStep(got, ReferenceStep(layer, x, loss_inputs, m), rtol=1e-4,
                            d_x_rtol=1e-4)
        AssertMovingStatisticsAsGpipe(self, layer, x, loss_inputs, k, v, m, r)

    @parameterized.named_parameters(*LOOPED_KEEPING)
    def testV1GraphEqualsTheLayersInSequence(self, kind, k, v, m, r, recompute):
        self.assertSameStep(*V1StepAndReference(kind, k, v, m, r, unroll=False,
                                                recompute=recompute))

    def testEagerEqualsTheLayersInSequence(self):
        layer = Pipeline('zero_bubble', 3, 1, 4, 1, recompute='never', unroll=False).Instantiate()
        x, loss_inputs = Data()
        self.assertSameStep(PipelineStep(layer, x, loss_inputs),
                            ReferenceStep(layer, x, loss_inputs))

    @parameterized.parameters('1f1b', 'zero_bubble_v')
    def testConvolutionsWhoseFilterGradientHasNoStaticShape(self, kind):
        # Inside the loop's switch_case TF cannot infer a convolution's filter gradient's
        # shape: the gradient sums must keep their own, or the loop refuses them.
        layers = [conv.Conv2DLayer.Params().Set(name=f'conv_{i}', filter_shape=(1, 1, 2, 2),
                                                activation='tanh') for i in range(4)]
        layer = pipelining_layer.PipeliningLayer.Params().Set(
            name='model', layer_tpl=layers, num_cells=2, virtual_stages=2 if kind ==
            'zero_bubble_v' else 1, num_micro_batches=4, schedule=kind, recompute='never',
            unroll=False, input_shapes=[BATCH, 3, 3, 2], devices=DEVICES[:2],
            partition_method='uniform', random_seed=3).Instantiate()
        x = tf.random.stateless_normal([BATCH, 3, 3, 2], [1, 2])
        loss_inputs = NestedMap(target=tf.zeros([BATCH, 3, 3, 2]),
                                weights=Data()[1].weights)

        def Loss(outputs, loss_inputs):  # LossFn's, per micro-batch of images.
            per_example = tf.reduce_sum(tf.square(outputs - loss_inputs.target), axis=[1, 2, 3])
            total = tf.reduce_sum(loss_inputs.weights)
            return tf.math.divide_no_nan(tf.reduce_sum(per_example * loss_inputs.weights),
                                         total), total

        def Step(x):
            with tf.GradientTape() as tape, fprop_context.Scope(step=5):
                tape.watch(x)
                _, loss, _ = layer.FPropLoss(layer.theta, x, Loss, loss_inputs)
            return loss, tape.gradient(loss, [x] + list(layer.trainable_variables))

        loss, grads = tf.function(Step)(x)
        with tf.GradientTape() as tape:
            tape.watch(x)
            want_loss, _ = Loss(test_utils.Unpartitioned(layer, x, 1, step=5), loss_inputs)
        want = tape.gradient(want_loss, [x] + list(layer.trainable_variables))
        self.assertAllClose(loss, want_loss, rtol=RTOL)
        for got, expected in zip(grads, want):
            self.assertAllClose(got, expected, rtol=1e-4, atol=1e-6)

    @parameterized.parameters('1f1b', 'zero_bubble')
    def testNeverRunsNoForwardAgain(self, kind):
        x, loss_inputs = Data()
        ops = {}
        for recompute in ('never', 'always'):
            layer = Pipeline(kind, 2, 1, 4, 1, recompute=recompute, unroll=False).Instantiate()
            ops[recompute] = _RecomputeOps(tf.function(
                lambda x, layer=layer: PipelineStep(layer, x, loss_inputs)
            ).get_concrete_function(x).graph)
        self.assertEqual(ops['never'], 0)
        self.assertGreater(ops['always'], 0)


# The loop on a batch known only when the step runs (Keras retraces `fit`'s last, partial batch
# so), which M = 4 need not divide: (name, schedule, K, v, recompute).
# recompute='except_last_<j>' at K=4, j=2: cells 0 and 1 re-materialize, cells 2 and 3 keep
# their activations; (name, schedule, unroll).
KEPT_CELLS = [(f'{kind}_{"unrolled" if unroll else "looped"}', kind, unroll)
              for kind in ('gpipe', '1f1b') for unroll in (True, False)]


def _RecomputingCells(graph) -> list[int]:
    """The cells whose backward calls (under `executor.OpScope`'s 'cell_<k>_mb_<m>_bwd') run
    a function that re-materializes (ops under the 'recompute' scope), through nested calls."""
    library = {f.signature.name: f for f in graph.as_graph_def().library.function}

    def Recomputes(function_name):
        return any('recompute/' in node.name or
                   any(Recomputes(value.func.name) for value in node.attr.values()
                       if value.func.name in library)
                   for node in library[function_name].node_def)

    cells = set()
    for op in graph.get_operations():
        match = re.match(r'cell_(\d+)_mb_\d+_bwd/', op.name)
        if (match and op.type in ('PartitionedCall', 'StatefulPartitionedCall') and
                Recomputes(op.get_attr('f').name)):
            cells.add(int(match.group(1)))
    return sorted(cells)


class KeptCellsTest(tf.test.TestCase, parameterized.TestCase):
    """The last j cells keep their activations and the others re-materialize
    (recompute='except_last_<j>'), and the pipeline still equals the layers in sequence."""

    assertSameStep = ScheduleContractTest.assertSameStep

    @parameterized.named_parameters(*KEPT_CELLS)
    def testFunctionWithBatchNormEqualsTheLayersInSequence(self, kind, unroll):
        x, loss_inputs = Data()
        layer = Pipeline(kind, 4, 1, 4, 1, batch_norm=True, recompute='except_last_2',
                         unroll=unroll).Instantiate()
        self.assertEqual(layer.plan.recompute, [True, True, False, False])
        got = tf.function(lambda x: PipelineStep(layer, x, loss_inputs))(x)
        # Batch norm per micro-batch of two examples: float32 order shows at up to 6e-5.
        self.assertSameStep(got, ReferenceStep(layer, x, loss_inputs, 4), rtol=1e-4,
                            d_x_rtol=1e-4)
        AssertMovingStatisticsAsGpipe(self, layer, x, loss_inputs, 4, 1, 4, 1)

    @parameterized.named_parameters(*KEPT_CELLS)
    def testV1GraphEqualsTheLayersInSequence(self, kind, unroll):
        self.assertSameStep(*V1StepAndReference(kind, 4, 1, 4, 1, unroll=unroll,
                                                recompute='except_last_2'))

    def testOnlyTheFirstCellsRunTheirForwardAgain(self):
        x, loss_inputs = Data()
        for mode, cells in (('except_last_2', [0, 1]), ('except_last_3', [0]),
                            ('always', [0, 1, 2, 3]), ('never', [])):
            layer = Pipeline('1f1b', 4, 1, 4, 1, recompute=mode, unroll=True).Instantiate()
            graph = tf.function(lambda x, layer=layer: PipelineStep(layer, x, loss_inputs)
                                ).get_concrete_function(x).graph
            self.assertEqual(_RecomputingCells(graph), cells, mode)


LOOPED_RUN_TIME_BATCH = [
    ('gpipe', 'gpipe', 2, 1, 'always'), ('1f1b', '1f1b', 3, 1, 'never'),
    ('zero_bubble_never', 'zero_bubble', 3, 1, 'never'),
    ('zero_bubble_always', 'zero_bubble', 3, 1, 'always'),
    ('zero_bubble_v', 'zero_bubble_v', 2, 2, 'never')]
# The same, unrolled (whose empty micro-batches' batch-norm gradients were NaN in the sums).
RUN_TIME_BATCH = ([case + (False,) for case in LOOPED_RUN_TIME_BATCH] +
                  [(f'{name}_unrolled', *case, True) for name, *case in (
                      ('gpipe', 'gpipe', 2, 1, 'always'), ('1f1b', '1f1b', 3, 1, 'never'),
                      ('zero_bubble', 'zero_bubble', 3, 1, 'always'))])


def MovingStatistics(layer, x, sizes, step=5):
    """Each batch norm's moving statistics after one training step on `x` in micro-batches of
    `sizes`, computed here: the micro-batches run through the layers in sequence, and each
    batch norm moves one step of its decay towards the mean and (biased) variance of every
    example it normalized (its moving statistics by name)."""
    seen, first = {}, 0
    for part in tf.split(x, sizes):
        h = part
        with fprop_context.Scope(step=step, first_example=first,
                                 update_collector=fprop_context.UpdateCollector()):
            for l in layer.Layers():
                if isinstance(l, normalization.BatchNormLayer):
                    seen.setdefault(l.path, (l, []))[1].append(h.numpy())
                h = l.FProp(l.theta, h)
        first += part.shape[0]
    moving = {}
    for l, parts in seen.values():
        examples, decay = np.concatenate(parts), l.p.decay
        for var, value in ((l.vars.moving_mean, examples.mean(0)),
                           (l.vars.moving_variance, examples.var(0))):
            moving[var.name] = decay * var.numpy() + (1 - decay) * value
    return moving


class RunTimeBatchTest(tf.test.TestCase, parameterized.TestCase):
    """Both executors on a batch known only when the step runs split it alike: the first
    N mod M micro-batches one larger, the last ones empty when N < M (an empty one adds
    nothing). Loss, gradients and batch norm's moving statistics equal the layers in sequence
    on those micro-batches."""

    assertSameStep = ScheduleContractTest.assertSameStep

    @parameterized.named_parameters(*RUN_TIME_BATCH)
    def testUnevenMicroBatchesWithBatchNormEqualTheLayersInSequence(self, kind, k, v,
                                                                     recompute, unroll):
        layer = Pipeline(kind, k, v, 4, 1, batch_norm=True, recompute=recompute,
                         unroll=unroll).Instantiate()
        step = tf.function(
            lambda x, target, weights: PipelineStep(
                layer, x, NestedMap(target=target, weights=weights)),
            input_signature=[tf.TensorSpec([None, DIM]), tf.TensorSpec([None, DIM]),
                             tf.TensorSpec([None])])
        x, loss_inputs = Data()
        for n, sizes in ((6, [2, 2, 1, 1]), (3, [1, 1, 1, 0])):
            with self.subTest(examples=n):
                x_n, loss_inputs_n = x[:n], tf.nest.map_structure(lambda t: t[:n], loss_inputs)
                moving = MovingStatistics(layer, x_n, sizes)
                got = step(x_n, loss_inputs_n.target, loss_inputs_n.weights)
                self.assertTrue(all(np.isfinite(t).all() for t in tf.nest.flatten(got)),
                                'a loss or gradient is not finite')
                # Batch norm over one or two examples: float32 order shows at up to 6e-5.
                self.assertSameStep(got, ReferenceStep(layer, x_n, loss_inputs_n, sizes),
                                    rtol=1e-4, d_x_rtol=1e-4)
                self.assertLen(moving, 2 * NUM_BLOCKS)
                for var in layer.variables:
                    if 'moving' in var.name:
                        self.assertAllClose(var.numpy(), moving[var.name], rtol=RTOL,
                                            msg=var.name)
        self.assertEqual(step.experimental_get_tracing_count(), 1)


class EmbeddingCellTest(tf.test.TestCase, parameterized.TestCase):
    """A cell whose input is token ids beside float leaves it only passes on (a Transformer LM's
    embedding cell): its weight gradient reads the ids and an output's gradient that no input
    gradient depends on, so zero-bubble's W is given both (they were left out of its residuals,
    and pruning W failed)."""

    @parameterized.parameters(('zero_bubble', 1, True), ('zero_bubble', 1, False),
                              ('zero_bubble_v', 2, False))
    def testLossAndGradientsEqualTheLayersInSequence(self, kind, v, unroll):
        model = transformer_network.LmParams().Set(
            vocab_size=16, model_dim=8, hidden_dim=16, num_heads=2, dim_per_head=4,
            num_layers=2, max_length=6, residual_dropout_keep_prob=1.0,
            atten_dropout_keep_prob=1.0)
        layer = transformer_network.LmPipelineParams(model, BATCH, 2, 4, 'never').Set(
            schedule=kind, virtual_stages=v, unroll=unroll, devices=DEVICES[:2],
            partition_method='uniform', random_seed=3).Instantiate()
        seqs = tf.random.stateless_uniform([BATCH, 6], [5, 6], maxval=16, dtype=tf.int32)
        batch = NestedMap(ids=seqs, labels=tf.roll(seqs, -1, axis=1),
                          paddings=tf.zeros([BATCH, 6]), weights=tf.ones([BATCH, 6]))

        def Loss(outputs, _):
            reduced = transformer_network.ReduceLoss(outputs)
            return reduced.loss, reduced.total_weight

        @tf.function
        def Step():
            with tf.GradientTape() as tape, fprop_context.Scope(step=5):
                _, loss, _ = layer.FPropLoss(layer.theta, batch, Loss, None)
            return loss, tape.gradient(loss, layer.trainable_variables)

        loss, grads = Step()
        with tf.GradientTape() as tape:
            want_loss, _ = Loss(test_utils.Unpartitioned(layer, batch, 1, step=5), None)
        want = tape.gradient(want_loss, layer.trainable_variables)
        self.assertAllClose(loss, want_loss, rtol=RTOL)
        for var, got, expected in zip(layer.trainable_variables, grads, want):
            self.assertAllClose(tf.convert_to_tensor(got), tf.convert_to_tensor(expected),
                                rtol=1e-4, atol=1e-6, msg=var.name)


class LoopedGraphSizeTest(tf.test.TestCase):

    def testLoopedGraphCallsTheCellsAsOftenAtEveryM(self):
        for kind in ('1f1b', 'zero_bubble'):
            with self.subTest(kind):
                self._CheckCallsAtEveryM(kind)

    def _CheckCallsAtEveryM(self, kind):
        x, loss_inputs = Data()
        calls = {}
        for unroll in (True, False):
            for m in (2, 8):
                layer = Pipeline(kind, 2, 1, m, 1, unroll=unroll).Instantiate()
                graph_def = tf.function(lambda x: PipelineStep(layer, x, loss_inputs)
                                        ).get_concrete_function(x).graph.as_graph_def()
                nodes = list(graph_def.node) + [
                    n for f in graph_def.library.function for n in f.node_def]
                calls[unroll, m] = sum(
                    n.op in ('PartitionedCall', 'StatefulPartitionedCall') for n in nodes)
        self.assertEqual(calls[False, 2], calls[False, 8])
        self.assertGreater(calls[True, 8], 3 * calls[True, 2] // 2)


class AutoUnrollTest(tf.test.TestCase):
    """unroll='auto' (the default; `test_plan.py` has its rule) builds a loop from
    LOOP_FROM_CELL_CALLS cell calls per forward, read back from the graph."""

    def testTheGraphHasALoopFromTheThreshold(self):
        x = tf.zeros([16, DIM])
        for m, loops in ((8, False), (16, True)):
            with self.subTest(m=m):
                layer = Pipeline('gpipe', 4, 1, m, 1, input_shapes=[16, DIM],
                                 devices=DEVICES[:4]).Instantiate()
                graph_def = tf.function(
                    lambda x: tf.gradients(layer(x), x)).get_concrete_function(x).graph.as_graph_def()
                ops = {n.op for n in graph_def.node} | {
                    n.op for f in graph_def.library.function for n in f.node_def}
                self.assertEqual(bool(ops & {'While', 'StatelessWhile'}), loops)


class ScheduleErrorsTest(tf.test.TestCase):

    def testFPropTrainingUnderA1F1BScheduleAsksForFPropLoss(self):
        layer = Pipeline('1f1b', 2, 1, 2, 1).Instantiate()
        with self.assertRaisesRegex(errors.ConfigError, 'FPropLoss'):
            layer(Data()[0])

    def testInterleavedNeedsMAMultipleOfK(self):
        with self.assertRaisesRegex(errors.ConfigError, r'M \(2\) must be a multiple of K \(4\)'):
            pipelining_layer.PipeliningLayer.Params().Set(
                name='model', layer_tpl=Layers(), num_cells=4, virtual_stages=2,
                num_micro_batches=2, schedule='interleaved_1f1b', input_shapes=[BATCH, DIM],
                partition_method='uniform').Instantiate()

    def testUnknownScheduleNamesTheChoices(self):
        with self.assertRaisesRegex(errors.ConfigError, "one of .*'1f1b'.*got 'pipedream'"):
            Pipeline('pipedream', 2, 1, 2, 1).Instantiate()


class ScheduleOrderTest(tf.test.TestCase, parameterized.TestCase):
    """Read from the traced graph: each action's calls on its stage's device (one, but for a
    split backward's per-layer forward and gradients), and each device's actions chained (data
    or control dependencies) in its list's order."""

    @parameterized.named_parameters(*CASES[1:4], *CASES[5:])
    def testEachDeviceRunsItsActionsInListOrder(self, kind, k, v, m, r):
        layer = Pipeline(kind, k, v, m, r).Instantiate()
        x, loss_inputs = Data()
        graph = tf.function(lambda x: PipelineStep(layer, x, loss_inputs)).get_concrete_function(
            x).graph
        parts = {'fwd': 'F', 'bwd': 'B', 'bwd_input': 'I', 'bwd_weight': 'W'}
        calls = {}
        for op in graph.get_operations():
            if op.type in ('PartitionedCall', 'StatefulPartitionedCall'):
                match = re.match(r'cell_(\d+)_mb_(\d+)_(fwd|bwd|bwd_input|bwd_weight)/', op.name)
                if match:
                    action = schedule_lib.Action(parts[match[3]], int(match[1]), int(match[2]))
                    calls.setdefault(action, []).append(op)
        sched = layer.plan.schedule
        self.assertCountEqual(calls, [a for device in sched.actions for a in device])
        for action, ops in calls.items():
            if not sched.splits_backward:
                self.assertLen(ops, 1, str(action))
            for op in ops:
                self.assertEqual(op.device, DEVICES[sched.DeviceOf(action.stage)], op.name)
        for d, actions in enumerate(sched.actions):
            for before, after in zip(actions, actions[1:]):
                for op in calls[after]:
                    self.assertNotEmpty(set(calls[before]) & set(test_utils.Ancestors(op)),
                                        msg=f'device {d}: {op.name} does not wait for {before}')


if __name__ == '__main__':
    tf.test.main()
