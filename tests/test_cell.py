"""A cell's traced forward and re-materializing backward (`pipeline/cell.py`): outputs and
gradients equal a hand-derived numpy oracle and the backward without re-materialization, in eager
mode, a tf.function and a tf.compat.v1 graph; the forward is re-run during backprop, after the
incoming gradient exists; each function is traced once; stateless dropout draws the same mask on
recompute; and the small nest helpers."""

import time

import numpy as np
import pytest
import tensorflow as tf
from absl.testing import parameterized

from gpipe_tf import test_utils
from gpipe_tf.layers import base_layer
from gpipe_tf.layers import basic
from gpipe_tf.layers import fprop_context
from gpipe_tf.layers import sequential
from gpipe_tf.nested_map import NestedMap
from gpipe_tf.pipeline import cell as cell_lib
from gpipe_tf.pipeline import leaves

pytestmark = pytest.mark.unit

DEVICES = test_utils.ConfigureVirtualCpus()
DEVICE = DEVICES[3]
BATCH, DIM = 4, 3
TOLERANCE = 1e-12  # float64 throughout.

EVENTS = []  # What ran, in the order it ran: 'fwd', 'recompute' (a cell forward) or 'dy'.
TRACES = []  # One entry per Python call of FProp, i.e. per trace of a function calling it.


class ScaledDense(base_layer.BaseLayer):
    """`scale * tanh(x @ w + b)`, with `scale` a non-trainable variable. Records each run in
    EVENTS and each trace in TRACES, and reports sum(y) as a training statistic. A NestedMap
    input {x, ids, unused} gives NestedMap {y, ids}: `ids` (int) passes through, `unused` is
    ignored."""

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Set(dtype=tf.float64)
        return p

    def __init__(self, params):
        super().__init__(params)
        self.CreateVariable('w', base_layer.WeightParams((DIM, DIM)))
        self.CreateVariable('b', base_layer.WeightParams(
            (DIM,), base_layer.WeightInit.Gaussian(0.5)))
        self.CreateVariable('scale', base_layer.WeightParams(
            (), base_layer.WeightInit.Constant(1.5), trainable=False))

    def FProp(self, theta, inputs):
        x = inputs.x if isinstance(inputs, NestedMap) else inputs
        scopes = tf.compat.v1.get_default_graph().get_name_scope().split('/')
        kind = 'recompute' if cell_lib.RECOMPUTE_SCOPE in scopes else 'fwd'
        TRACES.append(kind)

        def Record(unused_x):
            EVENTS.append(kind)
            return 0

        done = tf.py_function(Record, [x], tf.int32)  # Runs once x exists; y waits for it.
        with tf.control_dependencies([done]):
            y = theta.scale * tf.tanh(tf.matmul(x, theta.w) + theta.b)
        self.AddUpdate(NestedMap(output_sum=tf.reduce_sum(y)))
        return NestedMap(y=y, ids=inputs.ids) if isinstance(inputs, NestedMap) else y


def MakeCell(name='cell'):
    """A pipeline cell of one ScaledDense layer (its theta is keyed by the layer's name)."""
    return cell_lib.Cell([ScaledDense.Params().Set(name=name).Instantiate()], name)


def NumpyCell(cell, x, dy):
    """Oracle: (y, [d_b, None, d_w] in tf.nest order of theta, d_x) by hand."""
    layer = cell.sequence[0].vars
    w, b, scale = layer.w.numpy(), layer.b.numpy(), layer.scale.numpy()
    t = np.tanh(x @ w + b)
    g = dy * scale * (1.0 - t ** 2)
    return scale * t, [g.sum(0), None, x.T @ g], g @ w.T


def RandomArrays(seed, shape=(BATCH, DIM)):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(shape), rng.standard_normal(shape)


def Ids(value):
    return tf.constant(value, tf.int64)


def RunV1(sess, fetches):
    """`sess.run(fetches)` for fetches with None leaves, which stay None."""
    flat = tf.nest.flatten(fetches)
    values = iter(sess.run([x for x in flat if x is not None]))
    return tf.nest.pack_sequence_as(fetches, [None if x is None else next(values) for x in flat])


def AncestorNames(function_def, name):
    """Names (nodes and arguments) `name` depends on, through data and control inputs, inside a
    FunctionDef."""
    inputs = {node.name: [i.lstrip('^').split(':')[0] for i in node.input]
              for node in function_def.node_def}
    seen, stack = set(), [name]
    while stack:
        for parent in inputs.get(stack.pop(), []):
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return seen


class CellFunctionsTest(tf.test.TestCase, parameterized.TestCase):

    def setUp(self):
        super().setUp()
        EVENTS.clear()
        TRACES.clear()

    def assertGradsEqual(self, got, want):
        self.assertLen(got, len(want))
        for g, w in zip(got, want):
            if w is None:
                self.assertIsNone(g)
            else:
                self.assertLess(test_utils.MaxRelativeError(g, w), TOLERANCE)

    def testForwardEqualsTheCellAndReportsItsStatistics(self):
        cell = MakeCell()
        functions = cell_lib.CellFunctions(cell, DEVICE)
        x, dy = RandomArrays(0)
        outputs, stats = functions.Forward(cell.theta, tf.constant(x), Ids(0), Ids(0))
        y_ref = NumpyCell(cell, x, dy)[0]
        self.assertLess(test_utils.MaxRelativeError(outputs, y_ref), TOLERANCE)
        self.assertLen(stats, 1)
        self.assertAllClose(stats[0].output_sum, y_ref.sum(), rtol=TOLERANCE)
        self.assertEqual(functions.update_layers, cell.sequence)
        self.assertEqual(functions.trainable, [True, False, True])  # b, scale, w.
        self.assertEqual(EVENTS, ['fwd'])

    def testEvalForwardReportsNoUpdateLayers(self):
        cell = MakeCell()
        functions = cell_lib.CellFunctions(cell, DEVICE)
        x, dy = RandomArrays(1)
        outputs, _ = functions.Forward(cell.theta, tf.constant(x), Ids(0), Ids(0),
                                       training=False)
        self.assertLess(test_utils.MaxRelativeError(outputs, NumpyCell(cell, x, dy)[0]),
                        TOLERANCE)
        self.assertIsNone(functions.update_layers)

    @parameterized.named_parameters(('eager', 'eager'), ('function', 'function'),
                                    ('v1_graph', 'v1_graph'))
    def testBackwardEqualsTheGradientsWithoutRecompute(self, mode):
        x, dy = RandomArrays(2)

        def Build(cell):
            functions = cell_lib.CellFunctions(cell, DEVICE)
            theta = cell.theta
            with tf.GradientTape(persistent=True, watch_accessed_variables=False) as tape:
                sources = leaves.Identity([theta, tf.constant(x)])
                tape.watch(tf.nest.flatten(sources))
                kept, _ = functions.Forward(*sources, Ids(0), Ids(0))
            # Without recompute: differentiate the forward that ran (as the executor does).
            without = cell_lib.Differentiate(
                kept, *sources, [tf.constant(dy)], functions.trainable,
                tape=tape if tf.executing_eagerly() else None)
            return kept, without, functions.Backward(theta, tf.constant(x), Ids(0), Ids(0),
                                                     [tf.constant(dy)])

        if mode == 'eager':
            cell = MakeCell()
            results = Build(cell)
        elif mode == 'function':
            cell = MakeCell()
            results = tf.function(lambda: Build(cell), autograph=False)()
        else:
            graph = tf.Graph()
            with graph.as_default():
                cell = MakeCell()
                fetches = Build(cell)
                with tf.compat.v1.Session(graph=graph) as sess:
                    sess.run(tf.compat.v1.global_variables_initializer())
                    results = RunV1(sess, fetches)
            cell = MakeCell()  # The same path and seed: the same initial values.
        y_ref, d_theta_ref, d_x_ref = NumpyCell(cell, x, dy)
        kept, without, with_recompute = results
        self.assertLess(test_utils.MaxRelativeError(kept, y_ref), TOLERANCE)
        for d_theta, d_x in (without, with_recompute):
            self.assertGradsEqual(d_theta, d_theta_ref)
            self.assertGradsEqual(d_x, [d_x_ref])

    def testRecomputeRunsInBackpropAfterTheIncomingGradientInAV1Graph(self):
        # The incoming gradient is late (a real loss waits for the forward; this one sleeps
        # too): a recompute that did not wait for it would be ready, and run, before it.
        x, dy = RandomArrays(3)

        def LateGradient(y, dy):
            time.sleep(0.05)
            EVENTS.append('dy')
            return dy * tf.reduce_sum(y) ** 0

        graph = tf.Graph()
        with graph.as_default():
            cell = MakeCell()
            functions = cell_lib.CellFunctions(cell, DEVICE)
            theta = cell.theta
            y, _ = functions.Forward(theta, tf.constant(x), Ids(0), Ids(0))
            d_y = tf.py_function(LateGradient, [y, tf.constant(dy)], tf.float64)
            d_theta, d_x = functions.Backward(theta, tf.constant(x), Ids(0), Ids(0), [d_y])
            with tf.compat.v1.Session(graph=graph) as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                self.assertEqual(EVENTS, [])
                outputs = sess.run(y)
                self.assertEqual(EVENTS, ['fwd'])  # The forward alone recomputes nothing.
                EVENTS.clear()
                d_x = sess.run(d_x)
        self.assertEqual(EVENTS, ['fwd', 'dy', 'recompute'])
        cell = MakeCell()
        y_ref, _, d_x_ref = NumpyCell(cell, x, dy)
        self.assertLess(test_utils.MaxRelativeError(outputs, y_ref), TOLERANCE)
        self.assertLess(test_utils.MaxRelativeError(d_x, [d_x_ref]), TOLERANCE)

    def testTheBackwardFunctionsRecomputeWaitsOnTheIncomingGradient(self):
        cell = MakeCell()
        functions = cell_lib.CellFunctions(cell, DEVICE)
        x, dy = RandomArrays(4)
        graph = tf.function(
            lambda: functions.Backward(cell.theta, tf.constant(x), Ids(0), Ids(0),
                                       [tf.constant(dy)]),
            autograph=False).get_concrete_function().graph
        library = {f.signature.name: f for f in graph.as_graph_def().library.function}
        backward = [f for name, f in library.items() if '_Backward' in name]
        self.assertLen(backward, 1)
        backward = backward[0]
        d_outputs = backward.signature.input_arg[-1].name  # The last argument: [dy].
        self.assertStartsWith(d_outputs, 'd_outputs')
        recomputed = [node for node in backward.node_def
                      if node.name.startswith(f'{cell_lib.RECOMPUTE_SCOPE}/')
                      and node.op in ('MatMul', 'Tanh', 'EagerPyFunc')]
        self.assertLen(recomputed, 3)
        for node in recomputed:
            self.assertIn(d_outputs, AncestorNames(backward, node.name), node.name)
        # The call is on the cell's device, and no op of the body names a device of its own:
        # the call's device places them all (cells of one structure share the traced body).
        calls = [op for op in graph.get_operations() if op.type in ('PartitionedCall',
                                                                   'StatefulPartitionedCall')]
        self.assertLen(calls, 1)
        want = tf.DeviceSpec.from_string(DEVICE)
        got = tf.DeviceSpec.from_string(calls[0].device)
        self.assertEqual((got.device_type, got.device_index),
                         (want.device_type, want.device_index))
        computed = [node for node in backward.node_def
                    if node.name.startswith((f'{cell_lib.RECOMPUTE_SCOPE}/', 'gradients/'))]
        self.assertGreater(len(computed), 10)
        # (The test's py_function recorder is pinned to the host by TensorFlow.)
        self.assertEqual([node.name for node in computed
                          if node.device and node.op != 'EagerPyFunc'], [])

    def testEachFunctionIsTracedOnceAndRunsOncePerCall(self):
        cell = MakeCell()
        functions = cell_lib.CellFunctions(cell, DEVICE)
        x, dy = RandomArrays(5)
        step, theta = Ids(7), cell.theta
        for m in range(3):
            functions.Forward(theta, tf.constant(x), step, Ids(m))
        for m in range(3):
            d_theta, d_x = functions.Backward(theta, tf.constant(x), step, Ids(m),
                                              [tf.constant(dy)])
        self.assertEqual(TRACES, ['fwd', 'recompute'])
        self.assertEqual(EVENTS, ['fwd'] * 3 + ['recompute'] * 3)
        _, d_theta_ref, d_x_ref = NumpyCell(cell, x, dy)
        self.assertGradsEqual(d_theta, d_theta_ref)
        self.assertGradsEqual(d_x, [d_x_ref])

    def testNestInputsGetNoneForIntegersAndZerosWhenUnused(self):
        cell = MakeCell()
        functions = cell_lib.CellFunctions(cell, DEVICE)
        x, dy = RandomArrays(6)
        inputs = NestedMap(x=tf.constant(x), ids=tf.constant([3, 1, 4, 1], tf.int32),
                           unused=tf.ones([BATCH], tf.float64))
        outputs, _ = functions.Forward(cell.theta, inputs, Ids(0), Ids(0))
        self.assertAllEqual(outputs.ids, [3, 1, 4, 1])
        d_theta, d_inputs = functions.Backward(cell.theta, inputs, Ids(0), Ids(0),
                                               [tf.constant(dy)])
        y_ref, d_theta_ref, d_x_ref = NumpyCell(cell, x, dy)
        self.assertLess(test_utils.MaxRelativeError(outputs.y, y_ref), TOLERANCE)
        self.assertGradsEqual(d_theta, d_theta_ref)
        self.assertLen(d_inputs, 3)  # ids, unused, x: tf.nest's sorted keys.
        self.assertIsNone(d_inputs[0])
        self.assertAllEqual(d_inputs[1], np.zeros(BATCH))
        self.assertLess(test_utils.MaxRelativeError(d_inputs[2], d_x_ref), TOLERANCE)


class StatelessDropoutTest(tf.test.TestCase):
    """The recompute draws the first forward's mask: dropout is drawn from (layer, step,
    example), the first example's index being what the cell functions pass on."""

    KEEP_PROB = 0.5

    def _Cell(self):
        return cell_lib.Cell([sequential.SequentialLayer.Params().Set(
            name='cell', dtype=tf.float64, sub=[
                basic.DenseLayer.Params().Set(name='dense', input_dim=DIM, output_dim=DIM,
                                              dtype=tf.float64),
                basic.DropoutLayer.Params().Set(name='dropout', keep_prob=self.KEEP_PROB,
                                                dtype=tf.float64)]).Instantiate()], 'cell')

    def testBackwardUsesTheForwardsMask(self):
        cell = self._Cell()
        functions = cell_lib.CellFunctions(cell, DEVICE)
        x, dy = RandomArrays(7, shape=(8, DIM))
        step, theta = Ids(3), cell.theta
        y, _ = functions.Forward(theta, tf.constant(x), step, Ids(1))
        d_theta, d_x = functions.Backward(theta, tf.constant(x), step, Ids(1), [tf.constant(dy)])
        # Oracle: the mask read off the forward's output, gradients by hand.
        w, b = cell.vars.cell.dense.w.numpy(), cell.vars.cell.dense.b.numpy()
        h = x @ w + b
        mask = (y.numpy() != 0).astype(np.float64)
        self.assertBetween(mask.mean(), 0.2, 0.8)
        self.assertLess(test_utils.MaxRelativeError(y, h * mask / self.KEEP_PROB), TOLERANCE)
        g = dy * mask / self.KEEP_PROB
        self.assertLess(test_utils.MaxRelativeError(d_theta, [g.sum(0), x.T @ g]), TOLERANCE)
        self.assertLess(test_utils.MaxRelativeError(d_x, [g @ w.T]), TOLERANCE)
        # The mask is the standalone layer's under the same (step, first example), and that of
        # a micro-batch starting elsewhere differs (so a recompute with the wrong seed would be
        # seen).
        with fprop_context.Scope(step=3, first_example=1):
            self.assertAllEqual(cell.FProp(theta, tf.constant(x)), y)
        other, _ = functions.Forward(theta, tf.constant(x), step, Ids(2))
        self.assertNotAllEqual(other.numpy() != 0, mask.astype(bool))


class SharedTraceTest(tf.test.TestCase):
    """Cells of one structure share one trace, yet each computes with its own weights, seeds
    and device."""

    def _Cell(self, name, keep_prob=0.5):
        dense = basic.DenseLayer.Params().Set(name='dense', input_dim=DIM, output_dim=DIM,
                                              dtype=tf.float64)
        dropout = basic.DropoutLayer.Params().Set(name='dropout', keep_prob=keep_prob,
                                                  dtype=tf.float64)
        return cell_lib.Cell([sequential.SequentialLayer.Params().Set(
            name=name, dtype=tf.float64, sub=[dense, dropout]).Instantiate()], name)

    def _Run(self, keep_prob):
        shared = {}
        cells = [self._Cell(f'layer_{i}', keep_prob) for i in range(3)]
        functions = [cell_lib.CellFunctions(c, DEVICES[i], shared=shared)
                     for i, c in enumerate(cells)]
        other = cell_lib.CellFunctions(self._Cell('layer_9', keep_prob=0.7), DEVICE,
                                       shared=shared)
        self.assertLen(shared, 2)  # keep_prob differs: a structure of its own.
        x, dy = RandomArrays(8, shape=(8, DIM))
        step = Ids(5)

        @tf.function(autograph=False)
        def Run():
            return [(fn.Forward(c.theta, tf.constant(x), step, Ids(2)),
                     fn.Backward(c.theta, tf.constant(x), step, Ids(2), [tf.constant(dy)]))
                    for fn, c in zip(functions + [other], cells + [other.cell])]

        results = Run()
        graph = Run.get_concrete_function().graph
        names = {f.signature.name for f in graph.as_graph_def().library.function}
        calls = [op for op in graph.get_operations() if 'PartitionedCall' in op.type]
        self.assertCountEqual([tf.DeviceSpec.from_string(op.device).device_index
                               for op in calls], [0, 0, 1, 1, 2, 2, 3, 3])
        masks = []
        for c, ((y, _), (d_theta, d_x)) in zip(cells + [other.cell], results):
            with fprop_context.Scope(step=5, first_example=2):
                alone = c.FProp(c.theta, tf.constant(x)).numpy()
            masks.append(y.numpy() != 0)
            self.assertAllEqual(alone != 0, masks[-1])
            self.assertAllClose(alone, y, rtol=TOLERANCE, atol=0)
            # Gradients by hand from the layer's own weights and the mask its output shows.
            w = c.sequence[0].vars.dense.w.numpy()
            keep = 0.7 if c is other.cell else keep_prob
            g = dy * masks[-1] / keep
            self.assertLess(test_utils.MaxRelativeError(d_theta, [g.sum(0), x.T @ g]),
                            TOLERANCE)
            self.assertLess(test_utils.MaxRelativeError(d_x, [g @ w.T]), TOLERANCE)
        return names, masks

    def testEqualCellsWithoutRandomnessShareATraceAndKeepTheirOwnWeights(self):
        names, _ = self._Run(keep_prob=1.0)
        self.assertLen([n for n in names if '_fwd' in n], 2)
        self.assertLen([n for n in names if '_Backward' in n], 2)

    def testCellsThatDrawRandomNumbersTraceTheirOwnWithTheirOwnSeeds(self):
        names, masks = self._Run(keep_prob=0.5)
        self.assertLen([n for n in names if '_fwd' in n], 4)
        self.assertLen([n for n in names if '_Backward' in n], 4)
        self.assertNotAllEqual(masks[0], masks[1])  # Each layer's own seed.


class DifferentiateTest(tf.test.TestCase, parameterized.TestCase):
    """Differentiate by tape (eager) and by tf.gradients (graph) against y = x @ w."""

    @parameterized.named_parameters(('tape', True), ('gradients', False))
    def testLinearMapGradients(self, use_tape):
        rng = np.random.default_rng(8)
        x, w, v, dy = (rng.standard_normal(s) for s in ((4, 3), (3, 2), (2,), (4, 2)))
        theta = [tf.constant(w), tf.constant(v)]  # v: not trainable.
        inputs = NestedMap(x=tf.constant(x), n=tf.constant([1, 2, 3, 4]))

        def Run():
            with tf.GradientTape(persistent=True) as tape:
                tape.watch(theta + [inputs.x])
                y = tf.matmul(inputs.x, theta[0]) + theta[1]
            return cell_lib.Differentiate(
                y, theta, inputs, [tf.constant(dy)], [True, False],
                tape=tape if use_tape else None)

        d_theta, d_inputs = Run() if use_tape else tf.function(Run, autograph=False)()
        self.assertLen(d_theta, 2)
        self.assertAllClose(d_theta[0], x.T @ dy, rtol=TOLERANCE, atol=0)
        self.assertIsNone(d_theta[1])
        self.assertLen(d_inputs, 2)  # n, x.
        self.assertIsNone(d_inputs[0])
        self.assertAllClose(d_inputs[1], dy @ w.T, rtol=TOLERANCE, atol=0)


class NestHelpersTest(tf.test.TestCase):

    def testFloatLeavesKeepFloatsInNestOrder(self):
        a, b = tf.constant([1.0]), tf.constant([2.0], tf.float64)
        nest = NestedMap(z=a, y=tf.constant([1]), x=[None, b], w=tf.constant(True))
        self.assertEqual(leaves.FloatLeaves(nest), [b, a])
        self.assertTrue(leaves.IsFloat(tf.constant(1.0, tf.bfloat16)))
        self.assertFalse(leaves.IsFloat(None))
        self.assertFalse(leaves.IsFloat(tf.constant(1)))

    def testIdentityKeepsStructureValuesAndNone(self):
        nest = NestedMap(x=tf.constant([1.0, 2.0]), n=None, ids=(tf.constant([4]),))
        got = leaves.Identity(nest)
        tf.nest.assert_same_structure(got, nest)
        self.assertIsNone(got.n)
        self.assertAllEqual(got.x, [1.0, 2.0])
        self.assertAllEqual(got.ids[0], [4])

    def testWithFloatLeavesFillsFloatsInOrderAndNoneElsewhere(self):
        nest = [tf.constant(1.0), tf.constant(2), None, tf.constant([3.0])]
        self.assertEqual(leaves.WithFloatLeaves(nest, ['a', 'b']), ['a', None, None, 'b'])


if __name__ == '__main__':
    tf.test.main()
