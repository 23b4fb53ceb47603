"""PipeliningLayer's contract: the same outputs and gradients as the un-partitioned layers."""

import re

import numpy as np
import tensorflow as tf
from absl.testing import parameterized

from gpipe_tf import errors
from gpipe_tf import test_utils
from gpipe_tf.layers import base_layer
from gpipe_tf.layers import basic
from gpipe_tf.layers import embedding
from gpipe_tf.layers import fprop_context
from gpipe_tf.layers import normalization
from gpipe_tf.nested_map import NestedMap
from gpipe_tf.pipeline import devices as devices_lib
from gpipe_tf.pipeline import pipelining_layer
from gpipe_tf.pipeline import plan as plan_lib

DEVICES = test_utils.ConfigureVirtualCpus()
TOLERANCE = 1e-5
BATCH, DIM, NUM_LAYERS = 16, 8, 8


def DenseStack(num_layers=NUM_LAYERS, dim=DIM):
    return [basic.DenseLayer.Params().Set(input_dim=dim, output_dim=dim, activation='tanh')
            for _ in range(num_layers)]


def PipelineParams(num_cells, num_micro_batches, recompute='always', layers=None, **kw):
    return pipelining_layer.PipeliningLayer.Params().Set(
        name='pipe', layer_tpl=layers or DenseStack(), num_cells=num_cells,
        num_micro_batches=num_micro_batches, recompute=recompute,
        input_shapes=[BATCH, DIM], devices=DEVICES[:4], **kw)


def V1OutputsAndGrads(make_layer, make_inputs, num_micro_batches_ref=1):
    def Build():
        layer = make_layer()
        inputs = make_inputs()
        xs = test_utils.FloatLeaves(inputs) + list(layer.trainable_variables)
        y = layer(inputs)
        y_ref = test_utils.Unpartitioned(layer, inputs, num_micro_batches_ref)
        return ([y, tf.compat.v1.gradients(test_utils.SquareLoss(y), xs)],
                [y_ref, tf.compat.v1.gradients(test_utils.SquareLoss(y_ref), xs)])
    return test_utils.RunV1(Build)


def RandomInputs(shape=(BATCH, DIM)):
    return tf.random.stateless_normal(shape, [7, 11])


# K x M x recompute mode: every (K, M), (K, mode) and (M, mode) pair once (pairwise, 12 cases),
# and the largest pipeline in the default mode: 13 of the full product's 36 cases. Every defect
# benchmarks/grid_defects.py seeds that fails the full product fails this grid too; pairwise
# alone missed one that needs K=4, M=8 and a re-materializing cell at once: the 13th case.
GRID = [(k, m, plan_lib.RECOMPUTE_MODES[(i + j) % 3])
        for i, k in enumerate([1, 2, 4]) for j, m in enumerate([1, 2, 4, 8])] + [(4, 8, 'always')]


class EquivalenceTest(tf.test.TestCase, parameterized.TestCase):
    """Outputs and gradients equal the un-partitioned layers for every K, M and recompute mode."""

    @parameterized.parameters(*GRID)
    def testTfFunctionMatchesUnpartitioned(self, k, m, mode):
        layer = PipelineParams(k, m, mode).Instantiate()
        x = RandomInputs()
        got = tf.function(lambda x: test_utils.OutputsAndGrads(layer, layer, x))(x)
        want = test_utils.OutputsAndGrads(lambda x: test_utils.Unpartitioned(layer, x), layer, x)
        self.assertLess(test_utils.MaxRelativeError(got, want), TOLERANCE)

    @parameterized.parameters(*GRID)
    def testV1GraphMatchesUnpartitioned(self, k, m, mode):
        got, want = V1OutputsAndGrads(lambda: PipelineParams(k, m, mode).Instantiate(),
                                      RandomInputs)
        self.assertLess(test_utils.MaxRelativeError(got, want), TOLERANCE)

    @parameterized.parameters((2, 4, 'always'), (4, 8, 'never'), (3, 2, 'except_last'))
    def testEagerMatchesUnpartitioned(self, k, m, mode):
        layer = PipelineParams(k, m, mode).Instantiate()
        x = RandomInputs()
        got = test_utils.OutputsAndGrads(layer, layer, x)
        want = test_utils.OutputsAndGrads(lambda x: test_utils.Unpartitioned(layer, x), layer, x)
        self.assertLess(test_utils.MaxRelativeError(got, want), TOLERANCE)

    def testExplicitCellsMatchUnpartitioned(self):
        stack = DenseStack(6)
        layer = pipelining_layer.PipeliningLayer.Params().Set(
            name='pipe', cell_tpl=[stack[:1], stack[1:5], stack[5]], num_micro_batches=4,
            devices=DEVICES[:3]).Instantiate()
        self.assertEqual([len(c.sequence) for c in layer.cells], [1, 4, 1])
        x = RandomInputs()
        got = tf.function(lambda x: test_utils.OutputsAndGrads(layer, layer, x))(x)
        want = test_utils.OutputsAndGrads(lambda x: test_utils.Unpartitioned(layer, x), layer, x)
        self.assertLess(test_utils.MaxRelativeError(got, want), TOLERANCE)

    def testBeforeLayersRunAheadOnTheFirstDevice(self):
        stack = DenseStack(4)
        layer = PipelineParams(2, 4, layers=stack[1:]).Set(
            before_tpl=[stack[0].Copy().Set(name='before')]).Instantiate()
        self.assertEqual([l.p.name for l in layer.Layers()][0], 'before')
        self.assertEqual(layer.Layers()[0].vars.w.device, layer.Layers()[1].vars.w.device)
        x = RandomInputs()
        got = tf.function(lambda x: test_utils.OutputsAndGrads(layer, layer, x))(x)
        want = test_utils.OutputsAndGrads(lambda x: test_utils.Unpartitioned(layer, x), layer, x)
        self.assertLess(test_utils.MaxRelativeError(got, want), TOLERANCE)

    def testMicroBatchSizeSetsTheNumberOfMicroBatches(self):
        layer = PipelineParams(2, None).Set(micro_batch_size=4).Instantiate()
        x = RandomInputs()
        got = tf.function(lambda x: test_utils.OutputsAndGrads(layer, layer, x))(x)
        want = test_utils.OutputsAndGrads(lambda x: test_utils.Unpartitioned(layer, x), layer, x)
        self.assertLess(test_utils.MaxRelativeError(got, want), TOLERANCE)
        graph = tf.function(layer).get_concrete_function(x).graph
        forward_calls = [op for op in graph.get_operations()
                         if test_utils.CellScope(op.name) == (0, 'fwd')
                         and op.type.endswith('PartitionedCall')]
        self.assertLen(forward_calls, BATCH // 4)

    def testDevicesMayBeAFunctionOfTheStage(self):
        layer = PipelineParams(3, 1).Set(devices=lambda k: DEVICES[2 - k]).Instantiate()
        self.assertEqual(layer.devices, [DEVICES[2], DEVICES[1], DEVICES[0]])
        for k, cell in enumerate(layer.cells):
            for v in cell.variables:
                self.assertEqual(tf.DeviceSpec.from_string(v.device).device_index, 2 - k)

    def testSparseEmbeddingGradientsAreSummedOverMicroBatches(self):
        layers = [embedding.EmbeddingLayer.Params().Set(vocab_size=50, embedding_dim=DIM)]
        layers += DenseStack(3)
        layer = pipelining_layer.PipeliningLayer.Params().Set(
            name='pipe', layer_tpl=layers, num_cells=2, num_micro_batches=4,
            input_shapes=[BATCH, 5], devices=DEVICES[:2]).Instantiate()
        ids = tf.random.stateless_uniform([BATCH, 5], [3, 4], maxval=50, dtype=tf.int32)
        got = tf.function(lambda x: test_utils.OutputsAndGrads(layer, layer, x))(ids)
        want = test_utils.OutputsAndGrads(lambda x: test_utils.Unpartitioned(layer, x), layer,
                                          ids)
        got = tf.nest.map_structure(tf.convert_to_tensor, got)
        want = tf.nest.map_structure(tf.convert_to_tensor, want)
        self.assertLess(test_utils.MaxRelativeError(got, want), TOLERANCE)

    def testInferenceMatchesUnpartitioned(self):
        layer = PipelineParams(4, 4).Instantiate()
        x = RandomInputs()
        with fprop_context.Scope(training=False):
            got = tf.function(layer)(x)
            want = test_utils.Unpartitioned(layer, x)
        self.assertLess(test_utils.MaxRelativeError(got, want), TOLERANCE)


class NestedInputLayer(base_layer.BaseLayer):
    """Test layer: NestedMap(x, bias, ids) -> same structure; x mixes in bias, ids pass through."""

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('dim', DIM, 'Feature size.')
        return p

    def __init__(self, params):
        super().__init__(params)
        self.CreateVariable('w', base_layer.WeightParams((self.p.dim, self.p.dim)))

    def FProp(self, theta, inputs):
        x = tf.tanh(tf.einsum('...d,de->...e', inputs.x, theta.w) + inputs.bias)
        return NestedMap(x=x, bias=inputs.bias * 0.5, ids=inputs.ids + 1)

    @classmethod
    def FPropMeta(cls, p, shapes):
        return base_layer.LayerMeta(shapes, 2 * shapes.x.num_elements() * p.dim, p.dim * p.dim,
                                    base_layer.OutputBytes(shapes, p.dtype))


class StructuredInputTest(tf.test.TestCase, parameterized.TestCase):

    def _Inputs(self, batch_dim):
        shape = [BATCH, 3, DIM] if batch_dim == 0 else [3, BATCH, DIM]
        ids_shape = shape[:2]
        return NestedMap(x=tf.random.stateless_normal(shape, [1, 2]),
                         bias=tf.random.stateless_normal(shape, [3, 4]),
                         ids=tf.zeros(ids_shape, tf.int32))

    def _Layer(self, batch_dim, mode, unroll='auto'):
        shape = [BATCH, 3, DIM] if batch_dim == 0 else [3, BATCH, DIM]
        return pipelining_layer.PipeliningLayer.Params().Set(
            name='pipe', layer_tpl=[NestedInputLayer.Params() for _ in range(4)], num_cells=2,
            num_micro_batches=4, batch_dim=batch_dim, recompute=mode, devices=DEVICES[:2],
            input_shapes={'x': shape, 'bias': shape, 'ids': shape[:2]},
            unroll=unroll).Instantiate()

    # unroll=False: the loop reads micro-batches from views of the inputs and their gradients
    # (batch_dim 0) or from stacked copies (batch_dim 1); it runs where recompute is 'always'.
    @parameterized.parameters(*[(batch_dim, mode, True) for batch_dim in (0, 1)
                                for mode in plan_lib.RECOMPUTE_MODES],
                              (0, 'always', False), (1, 'always', False))
    def testNestedMapInputsInTfFunction(self, batch_dim, mode, unroll):
        layer = self._Layer(batch_dim, mode, unroll)
        inputs = self._Inputs(batch_dim)
        got = tf.function(lambda x: test_utils.OutputsAndGrads(layer, layer, x))(inputs)
        want = test_utils.OutputsAndGrads(lambda x: test_utils.Unpartitioned(layer, x), layer, inputs)
        self.assertIsInstance(got[0], NestedMap)
        self.assertAllEqual(got[0].ids, tf.fill(got[0].ids.shape, 4))
        self.assertLess(test_utils.MaxRelativeError(got, want), TOLERANCE)

    @parameterized.parameters(0, 1)
    def testNestedMapInputsInV1Graph(self, batch_dim):
        got, want = V1OutputsAndGrads(lambda: self._Layer(batch_dim, 'always'),
                                      lambda: self._Inputs(batch_dim))
        self.assertLess(test_utils.MaxRelativeError(got, want), TOLERANCE)


class DropoutTest(tf.test.TestCase, parameterized.TestCase):
    """Dropout: micro-batch m of step s draws the mask of a standalone pass at (s, m)."""

    def _Layer(self, mode):
        layers = []
        for _ in range(4):
            layers += [basic.DenseLayer.Params().Set(input_dim=DIM, output_dim=DIM),
                       basic.DropoutLayer.Params().Set(keep_prob=0.7)]
        return PipelineParams(2, 4, mode, layers=layers).Instantiate()

    @parameterized.parameters(*plan_lib.RECOMPUTE_MODES)
    def testPipelineEqualsReferenceWithSameSeeds(self, mode):
        layer = self._Layer(mode)
        x = RandomInputs()
        with fprop_context.Scope(step=3):
            got = tf.function(lambda x: test_utils.OutputsAndGrads(layer, layer, x))(x)
        want = test_utils.OutputsAndGrads(lambda x: test_utils.Unpartitioned(layer, x, 4, step=3), layer, x)
        self.assertLess(test_utils.MaxRelativeError(got, want), TOLERANCE)
        # The masks really drop: a different step gives a different output.
        with fprop_context.Scope(step=4):
            other = layer(x)
        self.assertGreater(float(tf.reduce_max(tf.abs(other - got[0]))), 1e-3)


class BatchNormTest(tf.test.TestCase, parameterized.TestCase):
    """Batch norm: per-micro-batch statistics in training; moving statistics updated once per
    step from all M micro-batches, equal to a full-batch update."""

    def _Layer(self, mode, num_micro_batches):
        return PipelineParams(3, num_micro_batches, mode,
                              layers=test_utils.BatchNormStack(3, DIM)).Instantiate()

    def _ExpectedMovingStats(self, layer, x, num_micro_batches):
        """Moving statistics after one full-batch update from the inputs each BN layer saw."""
        expected = {}
        chunks = tf.split(x, num_micro_batches)
        seen = {}
        for m, h in enumerate(chunks):
            with fprop_context.Scope(update_collector=fprop_context.UpdateCollector()):
                for l in layer.Layers():
                    if isinstance(l, normalization.BatchNormLayer):
                        seen.setdefault(l.path, []).append(h)
                    h = l.FProp(l.theta, h)
        for l in layer.Layers():
            if isinstance(l, normalization.BatchNormLayer):
                mean, var = tf.nn.moments(tf.concat(seen[l.path], 0), [0])
                decay = l.p.decay
                expected[l.path] = (decay * l.vars.moving_mean + (1 - decay) * mean,
                                    decay * l.vars.moving_variance + (1 - decay) * var)
        return expected

    @parameterized.product(mode=plan_lib.RECOMPUTE_MODES, m=[1, 4])
    def testTrainingMatchesPerMicroBatchReferenceAndUpdatesOnce(self, mode, m):
        layer = self._Layer(mode, m)
        x = RandomInputs() * 3.0 + 1.0
        want = test_utils.OutputsAndGrads(lambda x: test_utils.Unpartitioned(layer, x, m), layer, x)
        expected = self._ExpectedMovingStats(layer, x, m)
        got = tf.function(lambda x: test_utils.OutputsAndGrads(layer, layer, x))(x)
        self.assertLess(test_utils.MaxRelativeError(got, want), TOLERANCE)
        for l in layer.Layers():
            if l.path in expected:
                self.assertLess(test_utils.MaxRelativeError(
                    (l.vars.moving_mean, l.vars.moving_variance), expected[l.path]), TOLERANCE)

    def testV1GraphUpdatesMovingStatistics(self):
        def Build():
            layer = self._Layer('always', 4)
            y = layer(RandomInputs())
            updates = tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)
            bn = [l for l in layer.Layers() if isinstance(l, normalization.BatchNormLayer)]
            self.assertLen(updates, 3)
            with tf.control_dependencies(updates + [y]):
                return [tf.identity(l.vars.moving_mean) for l in bn]
        means = test_utils.RunV1(Build)
        for mean in means:
            self.assertGreater(float(np.abs(mean).max()), 0.0)


class PlacementTest(tf.test.TestCase, parameterized.TestCase):
    """Every op of cell k, forward and backward, is on device k; each cell runs M micro-batches."""

    @parameterized.parameters(*plan_lib.RECOMPUTE_MODES)
    def testOpsOfEachCellAreOnItsDevice(self, mode):
        k_cells, m = 4, 4
        graph = tf.Graph()
        with graph.as_default():
            layer = PipelineParams(k_cells, m, mode).Instantiate()
            y = layer(RandomInputs())
            grads = tf.compat.v1.gradients(test_utils.SquareLoss(y), list(layer.trainable_variables))
            self.assertNotIn(None, grads)
        library = {f.signature.name: f for f in graph.as_graph_def().library.function}
        devices = [tf.DeviceSpec.from_string(d) for d in layer.devices]
        calls = {(k, kind): 0 for k in range(k_cells) for kind in ('fwd', 'bwd')}
        checked = 0
        for op in graph.get_operations():
            k, kind = test_utils.CellScope(op.name)
            if k is None:
                continue
            self.assertEqual(tf.DeviceSpec.from_string(op.device), devices[k],
                             f'{op.name} ({op.type}) is on {op.device!r}')
            checked += 1
            if op.type in ('PartitionedCall', 'StatefulPartitionedCall'):
                calls[(k, kind)] += 1
                for node in FunctionNodes(library, op.get_attr('f').name):
                    # Ops in a function body without a device run on the call op's device.
                    if node.device:
                        self.assertEqual(tf.DeviceSpec.from_string(node.device), devices[k],
                                         f'{node.name} in {op.name}')
        self.assertGreater(checked, 0)
        for k in range(k_cells):
            self.assertEqual(calls[(k, 'fwd')], m, f'cell {k} forward calls')
            self.assertEqual(calls[(k, 'bwd')], m, f'cell {k} backward calls')

    def testOpsRunOnTheirDevicesAtRunTime(self):
        """Read placement back from a traced v1 Session step (step_stats)."""
        graph = tf.Graph()
        with graph.as_default():
            layer = PipelineParams(4, 4, 'always').Instantiate()
            y = layer(RandomInputs())
            train = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(
                test_utils.SquareLoss(y), var_list=list(layer.trainable_variables))
            config = tf.compat.v1.ConfigProto(device_count={'CPU': len(DEVICES)})
            with tf.compat.v1.Session(graph=graph, config=config) as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                meta = tf.compat.v1.RunMetadata()
                sess.run(train, options=tf.compat.v1.RunOptions(
                    trace_level=tf.compat.v1.RunOptions.FULL_TRACE), run_metadata=meta)
        ran = 0
        for dev_stats in meta.step_stats.dev_stats:
            device = tf.DeviceSpec.from_string(dev_stats.device)
            for node in dev_stats.node_stats:
                k = CellOf(node.node_name)
                # `.../_<n>` nodes are the runtime's send/receive pairs, one on each side.
                if k is None or re.search(r'/_\d+$', node.node_name):
                    continue
                ran += 1
                self.assertEqual(device.device_index, k, f'{node.node_name} ran on '
                                 f'{dev_stats.device}')
        self.assertGreater(ran, 0)


def CellOf(name):
    """The cell index an op belongs to, or None."""
    return test_utils.CellScope(name)[0]


def FunctionNodes(library, name, seen=None):
    """All nodes of function `name`, including functions it calls."""
    seen = set() if seen is None else seen
    if name in seen or name not in library:
        return []
    seen.add(name)
    nodes = list(library[name].node_def)
    for node in list(nodes):
        if 'f' in node.attr and node.attr['f'].func.name:
            nodes += FunctionNodes(library, node.attr['f'].func.name, seen)
    return nodes


class MemoryTest(tf.test.TestCase, parameterized.TestCase):
    """Re-materialization cuts a step's measured peak memory (32 layers, K=4, M=8)."""

    def _Peak(self, mode, api):
        layers = [basic.DenseLayer.Params().Set(input_dim=128, output_dim=128, activation='tanh')
                  for _ in range(32)]
        shape = [64, 64, 128]
        p = pipelining_layer.PipeliningLayer.Params().Set(
            name='pipe', layer_tpl=layers, num_cells=4, num_micro_batches=8, recompute=mode,
            input_shapes=shape, devices=DEVICES[:4])
        x_value = np.random.RandomState(0).normal(size=shape).astype(np.float32)
        if api == 'function':
            layer = p.Instantiate()
            step = tf.function(lambda x: tf.gradients(test_utils.SquareLoss(layer(x)), layer.trainable_variables))
            step(x_value)  # Trace and warm up.
            return test_utils.PeakBytesOf(lambda: step(x_value))
        graph = tf.Graph()
        with graph.as_default():
            layer = p.Instantiate()
            x = tf.compat.v1.placeholder(tf.float32, shape)
            grads = tf.compat.v1.gradients(test_utils.SquareLoss(layer(x)), list(layer.trainable_variables))
            config = tf.compat.v1.ConfigProto(device_count={'CPU': len(DEVICES)})
            with tf.compat.v1.Session(graph=graph, config=config) as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                sess.run(grads, {x: x_value})
                return test_utils.PeakBytesOf(lambda: sess.run(grads, {x: x_value}))


    @parameterized.parameters('function', 'v1')
    def testRecomputeCutsPeakMemory(self, api):
        off = self._Peak('never', api)
        on = self._Peak('always', api)
        self.assertLess(on, 0.6 * off, f'peak with recompute {on / 2**20:.1f} MiB vs without '
                        f'{off / 2**20:.1f} MiB')


class AnyBatchSizeTest(tf.test.TestCase, parameterized.TestCase):
    """A batch M does not divide, one smaller than M, and one known only when the step runs:
    micro-batches as equal as they can be, the first ones larger (the sizes written out here),
    with the contract unchanged."""

    def _Layers(self, batch_norm):
        layers = []
        for _ in range(3):
            layers += [basic.DenseLayer.Params().Set(input_dim=DIM, output_dim=DIM,
                                                     activation='tanh'),
                       basic.DropoutLayer.Params().Set(keep_prob=0.7)]
            if batch_norm:
                layers.append(normalization.BatchNormLayer.Params().Set(dim=DIM))
        # Not batch norm last: a square loss of its output would be nearly constant.
        return layers + [basic.DenseLayer.Params().Set(input_dim=DIM, output_dim=DIM)]

    @staticmethod
    def _Step(fn, layer, x):
        # A loss away from zero mean: batch norm makes the sums over the batch that the
        # last biases' gradients are ~0 otherwise (a relative error of rounding).
        return test_utils.OutputsAndGrads(fn, layer, x,
                                          loss_fn=lambda y: tf.reduce_sum(tf.square(y - 1.0)))

    def _Pipeline(self, m, mode, batch_norm=True, **kw):
        return PipelineParams(3, m, mode, layers=self._Layers(batch_norm)).Set(
            input_shapes=None, partition_method='uniform', **kw)

    @parameterized.parameters(
        # Batch norm on micro-batches of 4 or more (on fewer, rounding dominates its
        # gradients); dense and dropout down to empty micro-batches.
        (15, 4, [4, 4, 4, 3], 'never', True),
        (18, 4, [5, 5, 4, 4], 'always', True),
        (3, 4, [1, 1, 1, 0], 'except_last', False),
        (1, 4, [1, 0, 0, 0], 'always', False),
        # unroll=False: a training step on a batch M does not divide runs unrolled.
        (22, 4, [6, 6, 5, 5], 'always', True, False))
    def testUnevenMicroBatchesMatchTheLayersPerMicroBatch(self, batch, m, sizes, mode,
                                                          batch_norm, unroll=True):
        layer = self._Pipeline(m, mode, batch_norm, unroll=unroll).Instantiate()
        x = RandomInputs((batch, DIM)) * 2.0 + 0.5
        with fprop_context.Scope(step=3):
            got = tf.function(lambda x: self._Step(layer, layer, x))(x)
        want = self._Step(
            lambda x: test_utils.Unpartitioned(layer, x, sizes, step=3), layer, x)
        self.assertLess(test_utils.MaxRelativeError(got, want), TOLERANCE)

    @parameterized.parameters(True, False)
    def testBatchKnownOnlyWhenTheStepRuns(self, unroll):
        layer = self._Pipeline(4, 'always', unroll=unroll).Instantiate()
        step = tf.function(lambda x: self._Step(layer, layer, x),
                           input_signature=[tf.TensorSpec([None, DIM])])
        # Unrolled and looped alike: equal micro-batches, and uneven ones (the loop slices
        # them out of the batch when the step runs), from one trace.
        for batch, sizes in ((16, 4), (24, 4), (15, [4, 4, 4, 3]), (18, [5, 5, 4, 4])):
            x = RandomInputs((batch, DIM)) + 0.5
            got = step(x)
            want = self._Step(
                lambda x: test_utils.Unpartitioned(layer, x, sizes), layer, x)
            self.assertLess(test_utils.MaxRelativeError(got, want), TOLERANCE, (batch, unroll))
        self.assertEqual(step.experimental_get_tracing_count(), 1)

    @parameterized.parameters(True, False)
    def testEmptyMicroBatchesOfABatchKnownOnlyWhenTheStepRuns(self, unroll):
        # 3 examples in M = 4: micro-batches of 1, 1, 1 and 0; the empty one adds nothing.
        layer = self._Pipeline(4, 'except_last', batch_norm=False, unroll=unroll).Instantiate()
        step = tf.function(lambda x: self._Step(layer, layer, x),
                           input_signature=[tf.TensorSpec([None, DIM])])
        x = RandomInputs((3, DIM)) + 0.5
        got = step(x)
        want = self._Step(lambda x: test_utils.Unpartitioned(layer, x, [1, 1, 1, 0]), layer, x)
        self.assertLess(test_utils.MaxRelativeError(got, want), TOLERANCE)
        self.assertTrue(all(np.isfinite(g).all() for g in tf.nest.flatten(got)))

    def testTheLoopSplitsABatchKnownOnlyWhenItRunsAlongBatchDim(self):
        # [time, batch, dim] with batch_dim 1: 6 examples in micro-batches of 2, 2, 1 and 1,
        # joined along the batch.
        layer = self._Pipeline(4, 'never', batch_norm=False, unroll=False,
                               batch_dim=1).Instantiate()
        step = tf.function(lambda x: self._Step(layer, layer, x),
                           input_signature=[tf.TensorSpec([2, None, DIM])])
        x = RandomInputs((2, 6, DIM)) + 0.5
        with fprop_context.Scope(step=2):
            got = step(x)
            want = self._Step(lambda x: test_utils.Unpartitioned(layer, x, [2, 2, 1, 1], step=2),
                              layer, x)
        self.assertEqual(got[0].shape, (2, 6, DIM))
        self.assertLess(test_utils.MaxRelativeError(got, want), TOLERANCE)

    @parameterized.parameters(True, False)
    def testInferenceOnAnyBatchEqualsTheWholeBatch(self, unroll):
        layer = self._Pipeline(4, 'always', unroll=unroll).Instantiate()
        infer = tf.function(lambda x: layer(x), input_signature=[tf.TensorSpec([None, DIM])])
        for batch in (1, 3, 5, 16):
            x = RandomInputs((batch, DIM))
            with fprop_context.Scope(training=False):
                got = infer(x)
                want = test_utils.Unpartitioned(layer, x)
            self.assertEqual(got.shape, (batch, DIM))
            self.assertLess(test_utils.MaxRelativeError(got, want), TOLERANCE, (batch, unroll))

    def testMovingStatisticsWeighUnevenMicroBatchesByExamples(self):
        layer = self._Pipeline(4, 'never', batch_norm=True).Instantiate()
        x = RandomInputs((6, DIM)) * 3.0 + 1.0
        parts, seen = tf.split(x, [2, 2, 1, 1]), {}
        for m, h in enumerate(parts):
            with fprop_context.Scope(update_collector=fprop_context.UpdateCollector(),
                                     first_example=[0, 2, 4, 5][m]):
                for l in layer.Layers():
                    if isinstance(l, normalization.BatchNormLayer):
                        seen.setdefault(l.path, []).append(h)
                    h = l.FProp(l.theta, h)
        expected = {}
        for l in layer.Layers():
            if isinstance(l, normalization.BatchNormLayer):
                mean, var = np.mean(tf.concat(seen[l.path], 0), 0), np.var(tf.concat(seen[l.path], 0), 0)
                expected[l.path] = (l.p.decay * l.vars.moving_mean.numpy() + (1 - l.p.decay) * mean,
                                    l.p.decay * l.vars.moving_variance.numpy() + (1 - l.p.decay) * var)
        tf.function(layer)(x)
        self.assertLen(expected, 3)
        for l in layer.Layers():
            if l.path in expected:
                self.assertAllClose(l.vars.moving_mean, expected[l.path][0], atol=1e-5)
                self.assertAllClose(l.vars.moving_variance, expected[l.path][1], atol=1e-5)

    @staticmethod
    def _ForwardCalls(graph) -> set:
        """The (cell, micro-batch) pairs whose forward call op is in `graph`."""
        calls = set()
        for op in graph.get_operations():
            match = re.match(r'(?:replica_(\d+)/)?cell_(\d+)_mb_(\d+)_fwd/', op.name)
            if match and op.type in ('PartitionedCall', 'StatefulPartitionedCall'):
                calls.add((int(match[1] or 0), int(match[2]), int(match[3])))
        return calls

    @parameterized.parameters(True, False)
    def testAStaticBatchSmallerThanMRunsNoEmptyMicroBatch(self, unroll):
        # 3 examples, M = 4: three micro-batches of one example, no fourth (empty) one.
        layer = self._Pipeline(4, 'always', batch_norm=False, unroll=unroll).Instantiate()
        x = RandomInputs((3, DIM)) + 0.5
        step = tf.function(lambda x: self._Step(layer, layer, x))
        got = step(x)
        want = self._Step(lambda x: test_utils.Unpartitioned(layer, x, [1, 1, 1]), layer, x)
        self.assertLess(test_utils.MaxRelativeError(got, want), TOLERANCE)
        if unroll:
            self.assertEqual(self._ForwardCalls(step.get_concrete_function(x).graph),
                             {(0, k, m) for k in range(3) for m in range(3)})

    def testFewerExamplesThanReplicasRunOnFewerReplicas(self):
        # 1 example, R = 2: replica 1 would have none; replica 0 runs it alone.
        layer = self._Pipeline(2, 'always', batch_norm=False, num_replicas=2,
                               devices=DEVICES[:6]).Instantiate()
        x = RandomInputs((1, DIM)) + 0.5
        step = tf.function(lambda x: self._Step(layer, layer, x))
        got = step(x)
        want = self._Step(lambda x: test_utils.Unpartitioned(layer, x), layer, x)
        self.assertLess(test_utils.MaxRelativeError(got, want), TOLERANCE)
        self.assertEqual(self._ForwardCalls(step.get_concrete_function(x).graph),
                         {(0, k, 0) for k in range(3)})

    @parameterized.parameters(True, False)
    def testAnEmptyShardOfABatchKnownOnlyWhenItRunsIsSkipped(self, unroll):
        # 1 example, R = 2, M = 2, traced with an unknown batch: replica 1's shard is empty.
        layer = self._Pipeline(2, 'always', batch_norm=False, num_replicas=2, unroll=unroll,
                               devices=DEVICES[:6]).Instantiate()
        step = tf.function(lambda x: self._Step(layer, layer, x),
                           input_signature=[tf.TensorSpec([None, DIM])])
        for batch in (1, 3):
            x = RandomInputs((batch, DIM)) + 0.5
            got = step(x)
            want = self._Step(lambda x: test_utils.Unpartitioned(layer, x, [1] * batch),
                              layer, x)
            self.assertLess(test_utils.MaxRelativeError(got, want), TOLERANCE, batch)

    def testReplicasSplitUnevenlyToo(self):
        # R = 2 shards of 8 and 7 examples, each in M = 2 micro-batches: 4, 4 and 4, 3.
        layer = self._Pipeline(2, 'always', num_replicas=2, devices=DEVICES[:6]).Instantiate()
        x = RandomInputs((15, DIM)) + 0.5
        with fprop_context.Scope(step=1):
            got = tf.function(lambda x: self._Step(layer, layer, x))(x)
        want = self._Step(
            lambda x: test_utils.Unpartitioned(layer, x, [4, 4, 4, 3], step=1), layer, x)
        self.assertLess(test_utils.MaxRelativeError(got, want), TOLERANCE)


class BadInputTest(tf.test.TestCase):

    def testBothMicroBatchSettings(self):
        # Refused when the plan is made, before any variable.
        with self.assertRaisesRegex(ValueError, 'Set exactly one of num_micro_batches and '
                                    'micro_batch_size, got 4 and 4'):
            PipelineParams(2, 4).Set(micro_batch_size=4).Instantiate()

    def testMoreCellsThanLayers(self):
        with self.assertRaisesRegex(ValueError, r'num_cells \(9\) is larger than the number of '
                                    r'layers \(8\)'):
            PipelineParams(9, 1).Instantiate()

    def testTooFewDevicesWithoutRoundRobin(self):
        with self.assertRaisesRegex(ValueError, r'4 cells need 4 devices, but only 2'):
            PipelineParams(4, 1).Set(devices=DEVICES[:2], round_robin=False).Instantiate()

    def testRoundRobinSharesDevices(self):
        layer = PipelineParams(4, 1).Set(devices=DEVICES[:2], round_robin=True).Instantiate()
        self.assertEqual(layer.devices, [DEVICES[0], DEVICES[1], DEVICES[0], DEVICES[1]])

    def testBoundariesThatDoNotCoverTheLayers(self):
        with self.assertRaisesRegex(ValueError, r'boundaries \[0, 3, 7\] do not cover the 8'):
            PipelineParams(2, 1).Set(partition_method=[0, 3, 7]).Instantiate()

    def testCellOutputDoesNotFitNextCell(self):
        layers = DenseStack(4)
        layers[2] = basic.DenseLayer.Params().Set(name='wide_in', input_dim=2 * DIM,
                                                  output_dim=DIM)
        with self.assertRaisesRegex(ValueError, r'cell 0 \(layer_000, layer_001\) outputs .*'
                                    r'cell 1 \(wide_in, layer_003\) cannot take'):
            PipelineParams(2, 1, layers=layers).Set(partition_method='uniform').Instantiate()

    def testFlopsPartitionNeedsInputShapes(self):
        with self.assertRaisesRegex(ValueError, 'needs input_shapes'):
            PipelineParams(2, 1).Set(input_shapes=None).Instantiate()


class ArrayLikeInputTest(tf.test.TestCase):

    def testANestedListOfNumbersIsTakenAsATensor(self):
        # As Keras layers take array-likes: the same outputs as for the tensor of its values.
        layer = PipelineParams(2, 2).Instantiate()
        x = RandomInputs()
        self.assertAllClose(layer(x.numpy().tolist()), layer(x), atol=0, rtol=0)


class ScheduleAtCallTest(tf.test.TestCase):

    def testAScheduleMistakeFoundAtTheCallNamesTheLayerOnce(self):
        # Without input_shapes M is known only at the call, where the schedule is made.
        layer = PipelineParams(2, 3).Set(
            schedule='interleaved_1f1b', virtual_stages=2, input_shapes=None,
            partition_method='uniform').Instantiate()
        with self.assertRaisesRegex(errors.ConfigError,
                                    r'^pipe: interleaved_1f1b sends micro-batches round in '
                                    r'groups of K: M \(3\) must be a multiple of K \(2\)\.$'):
            layer(RandomInputs((6, DIM)))


class MissingDeviceTest(tf.test.TestCase):
    """A device that is not present is an error at construction, not a silent move to CPU:0."""

    def assertMissing(self, device, stage, replica, make_layer):
        present = ', '.join(d.name for d in tf.config.list_logical_devices())
        with self.assertRaisesRegex(
                ValueError, f'^PipeliningLayer devices: {re.escape(device)} \\(stage {stage} of '
                f'replica {replica}\\) is not a device of this process; devices present: '
                f'{re.escape(present)}.$'):
            make_layer()

    def testACpuIndexBeyondThoseConfigured(self):
        missing = f'/device:CPU:{len(DEVICES) + 1}'
        self.assertMissing(missing, 1, 0, PipelineParams(2, 1).Set(
            devices=[DEVICES[len(DEVICES) - 1], missing]).Instantiate)

    def testAGpuThatIsNotThere(self):
        missing = f'/device:GPU:{len(tf.config.list_logical_devices("GPU"))}'
        self.assertMissing(missing, 0, 0, PipelineParams(2, 1).Set(
            devices=[missing, DEVICES[1]]).Instantiate)

    def testEveryReplicaIsChecked(self):
        missing = f'/job:localhost/replica:0/task:0/device:CPU:{len(DEVICES)}'
        self.assertMissing(missing, 1, 1, PipelineParams(2, 1).Set(
            num_replicas=2, devices=[DEVICES[:2], [DEVICES[2], missing]]).Instantiate)

    def testAV1GraphIsCheckedToo(self):
        with tf.Graph().as_default():
            self.assertMissing('/device:CPU:99', 0, 0, PipelineParams(2, 1).Set(
                devices=['/device:CPU:99', DEVICES[1]]).Instantiate)

    def testPresentDevicesInAnySpellingAreAccepted(self):
        layer = PipelineParams(4, 1).Set(devices=[
            DEVICES[0], 'CPU:1', '/cpu:2',
            '/job:localhost/replica:0/task:0/device:CPU:3']).Instantiate()
        self.assertEqual(layer.num_cells, 4)

    def testDevicesOfOtherJobsAreLeftToTheCluster(self):
        devices = ['/job:worker/task:0/device:CPU:0', '/job:worker/task:1/device:CPU:9']
        with tf.Graph().as_default():  # Graph-mode variables need no connected worker.
            layer = PipelineParams(2, 1).Set(devices=devices).Instantiate()
        self.assertEqual(layer.devices, devices)

    def testCheckDevicesAgainstAGivenList(self):
        available = ['/job:worker/replica:0/task:0/device:CPU:0',
                     '/job:worker/replica:0/task:1/device:CPU:0']
        devices_lib.CheckDevices([['/job:worker/task:0/device:CPU:0',
                                '/job:worker/task:1/device:CPU:0']], available)
        devices_lib.CheckDevices([['', '/device:TPU_REPLICATED_CORE:0']], available)
        with self.assertRaisesRegex(
                ValueError, r'/job:worker/task:2/device:CPU:0 \(stage 1 of replica 0\) is not '
                'among the devices available: /job:worker/replica:0/task:0/device:CPU:0, '
                '/job:worker/replica:0/task:1/device:CPU:0.$'):
            devices_lib.CheckDevices([['/job:worker/task:1/device:CPU:0',
                                    '/job:worker/task:2/device:CPU:0']], available)

    def testADeviceStringThatDoesNotParseIsAConfigErrorNamingItsStage(self):
        with self.assertRaisesRegex(errors.ConfigError, r"^Device 'd' of stage 1, replica 0 is "
                                    r'not a device string: .*Expected one such as'):
            devices_lib.CheckDevices([['/device:CPU:0', 'd']])


if __name__ == '__main__':
    tf.test.main()
