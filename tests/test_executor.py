"""The unrolled schedule (`pipeline/executor.py`): outputs and gradients equal the cells run in
sequence on the whole batch (a numpy oracle), each cell runs every micro-batch exactly once per step
in its schedule's order (docs/architecture.md's invariant 4, recorded as the ops run and read from
the graph's dependencies), statistics are summed over micro-batches, and op names follow `OpScope`."""

import inspect
import re

import numpy as np
import pytest
import tensorflow as tf
from absl.testing import parameterized

from gpipe_tf import test_utils
from gpipe_tf.layers import base_layer
from gpipe_tf.layers import fprop_context
from gpipe_tf.nested_map import NestedMap
from gpipe_tf.pipeline import cell as cell_lib
from gpipe_tf.pipeline import executor
from gpipe_tf.pipeline import looped
from gpipe_tf.pipeline import schedule
from gpipe_tf.pipeline import unrolled

pytestmark = pytest.mark.unit

DEVICES = test_utils.ConfigureVirtualCpus()
DIM = 3
TOLERANCE = 1e-12  # float64 throughout.

# (cell, kind, micro-batch) of every cell forward as it runs; kind is 'fwd', or 'recompute' for
# the forward a re-materializing backward re-runs.
EVENTS = []


class RecordingDense(base_layer.BaseLayer):
    """`tanh(x @ w + b)` that appends (cell, kind, micro-batch) to EVENTS when it runs, and
    reports the sum of its input as a training statistic. A NestedMap input transforms its `x`
    and passes the rest through."""

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('dim', DIM, 'Input and output size.')
        p.Define('cell_index', 0, 'The cell this layer is, for EVENTS.')
        p.Define('record', True, 'Whether to record to EVENTS (a stateful op) at all.')
        p.Set(dtype=tf.float64)
        return p

    def __init__(self, params):
        super().__init__(params)
        self.CreateVariable('w', base_layer.WeightParams((self.p.dim, self.p.dim)))
        self.CreateVariable('b', base_layer.WeightParams(
            (self.p.dim,), base_layer.WeightInit.Gaussian(0.5)))

    def FProp(self, theta, inputs):
        x = inputs.x if isinstance(inputs, NestedMap) else inputs
        scopes = tf.compat.v1.get_default_graph().get_name_scope().split('/')
        kind = 'recompute' if cell_lib.RECOMPUTE_SCOPE in scopes else 'fwd'
        cell = self.p.cell_index

        batch_dim = fprop_context.Current().batch_dim

        def Record(first_example, x):
            micro_batch = int(first_example) // int(x.shape[batch_dim])
            EVENTS.append((cell, kind, micro_batch))
            return first_example

        done = []
        if self.p.record:  # Takes x so that it runs once the cell's input exists; y waits.
            done = [tf.py_function(
                Record, [tf.cast(fprop_context.Current().first_example, tf.int64), x], tf.int64)]
        with tf.control_dependencies(done):
            y = tf.tanh(tf.tensordot(x, theta.w, 1) + theta.b)
        self.AddUpdate(NestedMap(input_sum=tf.reduce_sum(x)))
        return NestedMap(inputs, x=y) if isinstance(inputs, NestedMap) else y


def MakeCells(num_cells, record=True):
    return [cell_lib.Cell([RecordingDense.Params().Set(name=f'layer_{k}', cell_index=k,
                                                       record=record).Instantiate()], f'cell_{k}')
            for k in range(num_cells)]


def V1Session(graph):
    return tf.compat.v1.Session(
        graph=graph, config=tf.compat.v1.ConfigProto(device_count={'CPU': len(DEVICES)}))


def MakeSchedule(cells, recomputes, num_micro_batches, batch_dim=0, assign=None):
    functions = [cell_lib.CellFunctions(cell, DEVICES[k]) for k, cell in enumerate(cells)]
    return unrolled.UnrolledSchedule(functions, recomputes, num_micro_batches, batch_dim,
                                     tf.constant(0, tf.int64), assign)


def Values(cells):
    """Each cell's (w, b) as numpy arrays."""
    return [(c.sequence[0].vars.w.numpy(), c.sequence[0].vars.b.numpy()) for c in cells]


def NumpyChain(params, x, dy):
    """Oracle: the cells in sequence on the whole batch, and hand-derived gradients of the loss
    sum(dy * y**2) / 2 (so the outputs' gradient is dy * y).

    Returns:
      (outputs, each cell's input, per cell [d_b, d_w] (tf.nest order of theta), d_x).
    """
    acts = [x]
    for w, b in params:
        acts.append(np.tanh(np.tensordot(acts[-1], w, 1) + b))
    d_thetas, g = [None] * len(params), dy * acts[-1]
    for k in reversed(range(len(params))):
        w, _ = params[k]
        g = g * (1.0 - acts[k + 1] ** 2)
        rows_in, rows_g = acts[k].reshape(-1, w.shape[0]), g.reshape(-1, w.shape[1])
        d_thetas[k] = [rows_g.sum(0), rows_in.T @ rows_g]
        g = np.tensordot(g, w.T, 1)
    return acts[-1], acts[:-1], d_thetas, g


def CellOrders(sched, kind):
    """Per cell, the micro-batches its `kind` actions handle, in its device's list order."""
    return [[a.micro_batch for a in sched.actions[sched.DeviceOf(cell)]
             if (a.kind, a.stage) == (kind, cell)] for cell in range(sched.num_stages)]


def RandomArrays(shape, seed):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(shape), rng.standard_normal(shape)


def ForwardBackward(run, cells, x, dy, training=True):
    """One step of `run`: the forward, and the backward of the loss sum(dy * y**2) / 2, whose
    gradient dy * y waits for every forward, as a real loss's does."""
    outputs, updates = run.Forward([c.theta for c in cells], x, training=training)
    if not training:
        return outputs, updates, None, None
    d_thetas, d_x = run.Backward(dy * outputs)
    return outputs, updates, d_thetas, d_x


class ExecutorValuesTest(tf.test.TestCase, parameterized.TestCase):

    def setUp(self):
        super().setUp()
        EVENTS.clear()

    def assertMatchesOracle(self, params, x, dy, outputs, updates, d_thetas, d_x):
        y_ref, acts_ref, d_thetas_ref, d_x_ref = NumpyChain(params, x, dy)
        self.assertLess(test_utils.MaxRelativeError(outputs, y_ref), TOLERANCE)
        self.assertLess(test_utils.MaxRelativeError(d_x, d_x_ref), TOLERANCE)
        for k, (got, want) in enumerate(zip(d_thetas, d_thetas_ref)):
            self.assertLess(test_utils.MaxRelativeError(got, want), TOLERANCE, msg=f'cell {k}')
        for k, cell_updates in enumerate(updates):
            self.assertLen(cell_updates, 1)
            self.assertAllClose(cell_updates[0].input_sum, acts_ref[k].sum(), rtol=TOLERANCE)

    @parameterized.named_parameters(
        ('k1_m1_always', 1, 1, [True]),
        ('k2_m4_never', 2, 4, [False, False]),
        ('k3_m2_except_last', 3, 2, [True, True, False]),
        ('k3_m4_mixed', 3, 4, [False, True, False]),
    )
    def testEagerEqualsTheCellsInSequenceOnTheWholeBatch(self, k, m, recomputes):
        cells = MakeCells(k)
        x, dy = RandomArrays([8, DIM], seed=k * 10 + m)
        run = MakeSchedule(cells, recomputes, m)
        self.assertMatchesOracle(Values(cells), x, dy, *ForwardBackward(run, cells, x, dy))

    @parameterized.named_parameters(
        ('always', [True, True]), ('never', [False, False]), ('except_last', [True, False]))
    def testFunctionEqualsTheCellsInSequenceOnTheWholeBatch(self, recomputes):
        cells = MakeCells(2)
        x, dy = RandomArrays([8, DIM], seed=1)

        @tf.function(autograph=False)
        def Step(x, dy):
            return ForwardBackward(MakeSchedule(cells, recomputes, 4), cells, x, dy)

        self.assertMatchesOracle(Values(cells), x, dy, *Step(x, dy))

    def testV1GraphEqualsTheCellsInSequenceOnTheWholeBatch(self):
        x, dy = RandomArrays([6, DIM], seed=2)
        graph = tf.Graph()
        with graph.as_default():
            cells = MakeCells(3)
            fetches = ForwardBackward(MakeSchedule(cells, [True, False, True], 3), cells,
                                      tf.constant(x), tf.constant(dy))
            with V1Session(graph) as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                results, params = sess.run(
                    (fetches, [(c.sequence[0].vars.w, c.sequence[0].vars.b) for c in cells]))
        self.assertMatchesOracle(params, x, dy, *results)

    def testSplitsAlongBatchDim(self):
        cells = MakeCells(2)
        x, dy = RandomArrays([2, 6, DIM], seed=3)  # [time, batch, dim], batch_dim 1.
        run = MakeSchedule(cells, [True, False], 3, batch_dim=1)
        # Time (2) is not divisible by M (3): only a split along the batch runs at all.
        self.assertMatchesOracle(Values(cells), x, dy, *ForwardBackward(run, cells, x, dy))
        self.assertCountEqual([e for e in EVENTS if e[0] == 0], [(0, 'fwd', m) for m in range(3)]
                              + [(0, 'recompute', m) for m in range(3)])

    def testEvalForwardEqualsTheCellsInSequenceAndReportsNoUpdates(self):
        cells = MakeCells(3)
        x, dy = RandomArrays([4, DIM], seed=4)
        run = MakeSchedule(cells, [False, True, False], 2)
        outputs, updates, _, _ = ForwardBackward(run, cells, x, dy, training=False)
        self.assertLess(test_utils.MaxRelativeError(outputs, NumpyChain(Values(cells), x, dy)[0]),
                        TOLERANCE)
        self.assertEqual(updates, [[], [], []])
        self.assertCountEqual(EVENTS, [(k, 'fwd', m) for k in range(3) for m in range(2)])

    def testIntegerLeavesPassThroughAndGetNoGradient(self):
        cells = MakeCells(2)
        x, dy = RandomArrays([4, DIM], seed=5)
        ids = np.arange(4, dtype=np.int32) * 7
        for recomputes in ([True, True], [False, False]):
            run = MakeSchedule(cells, recomputes, 2)
            inputs = NestedMap(x=tf.constant(x), ids=tf.constant(ids))
            outputs, _ = run.Forward([c.theta for c in cells], inputs)
            d_thetas, d_inputs = run.Backward(NestedMap(x=dy * outputs.x, ids=None))
            y_ref, _, d_thetas_ref, d_x_ref = NumpyChain(Values(cells), x, dy)
            self.assertAllEqual(outputs.ids, ids)
            self.assertLess(test_utils.MaxRelativeError(outputs.x, y_ref), TOLERANCE)
            self.assertIsNone(d_inputs.ids)
            self.assertLess(test_utils.MaxRelativeError(d_inputs.x, d_x_ref), TOLERANCE)
            self.assertLess(test_utils.MaxRelativeError(d_thetas, d_thetas_ref), TOLERANCE)

    def testAssignSeesEveryCellAndChangesNoValue(self):
        cells = MakeCells(2)
        x, dy = RandomArrays([4, DIM], seed=6)
        assigned = set()

        def Assign(tensor, k):
            assigned.add(k)
            return tf.identity(tensor)

        @tf.function(autograph=False)
        def Step(x, dy):
            return ForwardBackward(MakeSchedule(cells, [True, False], 2, assign=Assign),
                                   cells, x, dy)

        self.assertMatchesOracle(Values(cells), x, dy, *Step(x, dy))
        self.assertEqual(assigned, {0, 1})


def _ProtocolMembers():
    """The methods and properties `executor.Executor` states, the constructor included."""
    return {name: value for name, value in vars(executor.Executor).items()
            if (callable(value) or isinstance(value, property)) and
            (name == '__init__' or not name.startswith('_'))}


def _Parameters(function):
    """(name, kind, default) of each parameter: what a caller relies on (annotations aside)."""
    return [(q.name, q.kind, q.default) for q in inspect.signature(function).parameters.values()]


class ExecutorProtocolTest(tf.test.TestCase, parameterized.TestCase):
    """Both executors offer what `executor.Executor` states, with the same parameters."""

    def testTheProtocolStatesTheConstructorTheScheduleAndTheThreeWaysToRun(self):
        self.assertEqual(set(_ProtocolMembers()),
                         {'__init__', 'schedule', 'Forward', 'Backward', 'ForwardBackward'})

    @parameterized.parameters(unrolled.UnrolledSchedule, looped.LoopedSchedule)
    def testHasEveryMemberWithTheProtocolsParameters(self, cls):
        for name, stated in _ProtocolMembers().items():
            offered = inspect.getattr_static(cls, name, None)
            self.assertIsNotNone(offered, f'{cls.__name__} has no {name}')
            self.assertIsNot(offered, stated, f'{cls.__name__} inherits {name}')
            if isinstance(stated, property):
                self.assertIsInstance(offered, property, f'{cls.__name__}.{name}')
            else:
                self.assertEqual(_Parameters(offered), _Parameters(stated),
                                 f'{cls.__name__}.{name}')


class AssignNestTest(tf.test.TestCase):

    def testNoneAssignReturnsTheNestItself(self):
        nest = NestedMap(x=tf.zeros([2]))
        self.assertIs(executor.AssignNest(None, 3, nest), nest)

    def testAssignsEveryLeafToTheCellKeepingSlicesSparseAndNone(self):
        calls = []

        def Assign(tensor, k):
            calls.append(k)
            return tensor * 2.0

        slices = tf.IndexedSlices(tf.constant([[1.0, 2.0]]), tf.constant([1]), tf.constant([3, 2]))
        got = executor.AssignNest(Assign, 5, [tf.constant([1.0, -1.0]), None, slices])
        self.assertEqual(calls, [5, 5])
        self.assertAllEqual(got[0], [2.0, -2.0])
        self.assertIsNone(got[1])
        self.assertIsInstance(got[2], tf.IndexedSlices)
        self.assertAllEqual(got[2].indices, [1])
        self.assertAllEqual(tf.convert_to_tensor(got[2]), [[0.0, 0.0], [2.0, 4.0], [0.0, 0.0]])


class ExecutionOrderTest(tf.test.TestCase, parameterized.TestCase):
    """Invariant 4 (docs/architecture.md): each cell runs exactly M micro-batches per step, in
    schedule order."""

    def setUp(self):
        super().setUp()
        EVENTS.clear()

    # In a tf.function the recording makes every cell call stateful, and automatic control
    # dependencies then serialize them in build order; a v1 graph adds none, so there the order
    # is the executor's own (and testTracedGraphChainsEachCellsCallsInScheduleOrder checks the
    # dependencies it builds on stateless cells).
    @parameterized.named_parameters(('eager', 'eager'), ('function', 'function'),
                                    ('v1_graph', 'v1_graph'))
    def testEachCellRunsEveryMicroBatchOnceInScheduleOrder(self, mode):
        k, m, recomputes = 3, 4, [True, False, True]
        x, dy = RandomArrays([8, DIM], seed=7)

        def Step(cells, x, dy):
            return ForwardBackward(MakeSchedule(cells, recomputes, m), cells, x, dy)

        if mode == 'eager':
            Step(MakeCells(k), tf.constant(x), tf.constant(dy))
        elif mode == 'function':
            cells = MakeCells(k)
            step = tf.function(lambda x, dy: Step(cells, x, dy), autograph=False)
            step.get_concrete_function(tf.constant(x), tf.constant(dy))
            self.assertEqual(EVENTS, [])  # Tracing runs no op; only what the step runs counts.
            step(x, dy)
        else:
            graph = tf.Graph()
            with graph.as_default(), V1Session(graph) as sess:
                fetches = Step(MakeCells(k), tf.constant(x), tf.constant(dy))
                sess.run(tf.compat.v1.global_variables_initializer())
                self.assertEqual(EVENTS, [])
                sess.run(fetches)
        forward_order = CellOrders(schedule.Make('gpipe', k, m), 'F')
        backward_order = CellOrders(schedule.Make('gpipe', k, m), 'B')
        for cell in range(k):
            self.assertEqual([mb for c, kind, mb in EVENTS if (c, kind) == (cell, 'fwd')],
                             forward_order[cell], msg=f'cell {cell} forward')
            self.assertEqual([mb for c, kind, mb in EVENTS if (c, kind) == (cell, 'recompute')],
                             backward_order[cell] if recomputes[cell] else [],
                             msg=f'cell {cell} recompute')
        self.assertLen(EVENTS, k * m + sum(recomputes) * m)
        # Data dependencies: a micro-batch reaches cell c + 1 after cell c; every recompute
        # (backprop) comes after every forward; cell 2's backward precedes cell 0's recompute.
        index = {e: i for i, e in enumerate(EVENTS)}
        for mb in range(m):
            for cell in range(k - 1):
                self.assertLess(index[(cell, 'fwd', mb)], index[(cell + 1, 'fwd', mb)])
            self.assertLess(index[(2, 'recompute', mb)], index[(0, 'recompute', mb)])
        self.assertLess(max(index[(c, 'fwd', mb)] for c in range(k) for mb in range(m)),
                        min(index[(c, 'recompute', mb)] for c in (0, 2) for mb in range(m)))

    def testTracedGraphChainsEachCellsCallsInScheduleOrder(self):
        k, m, recomputes = 3, 3, [True, False, True]
        # Stateless cells: automatic control dependencies, which order a tf.function's
        # stateful calls, do not hide whether the executor orders them.
        cells = MakeCells(k, record=False)
        x, dy = RandomArrays([6, DIM], seed=8)
        graph = tf.function(
            lambda x, dy: ForwardBackward(MakeSchedule(cells, recomputes, m), cells, x, dy),
            autograph=False).get_concrete_function(tf.constant(x), tf.constant(dy)).graph
        calls = {}  # (cell, micro-batch, part) -> the function call ops under OpScope.
        for op in graph.get_operations():
            self.assertNotEqual(op.type, 'StatefulPartitionedCall', op.name)
            if op.type == 'PartitionedCall':
                match = re.match(r'cell_(\d+)_mb_(\d+)_(fwd|bwd)/', op.name)
                self.assertIsNotNone(match, op.name)
                key = (int(match[1]), int(match[2]), match[3])
                calls.setdefault(key, []).append(op)
        # One traced forward call per (cell, micro-batch), one backward call per micro-batch
        # of a re-materializing cell, each on its cell's device; nothing else calls a function
        # outside the backward of a cell that keeps its activations (tf.gradients' call).
        for cell in range(k):
            for mb in range(m):
                self.assertLen(calls[(cell, mb, 'fwd')], 1)
                self.assertEqual(calls[(cell, mb, 'fwd')][0].device, DEVICES[cell])
                if recomputes[cell]:
                    self.assertLen(calls[(cell, mb, 'bwd')], 1)
                    self.assertEqual(calls[(cell, mb, 'bwd')][0].device, DEVICES[cell])
        self.assertLen([key for key in calls if key[2] == 'fwd'], k * m)


        for cell in range(k):
            parts = ('fwd', 'bwd') if recomputes[cell] else ('fwd',)
            for part in parts:
                for mb in range(1, m):
                    self.assertIn(calls[(cell, mb - 1, part)][0],
                                  test_utils.Ancestors(calls[(cell, mb, part)][0]),
                                  msg=f'cell {cell} {part}: micro-batch {mb} does not wait '
                                      f'for {mb - 1}')


class OpScopeTest(tf.test.TestCase):

    def testNamesCellMicroBatchAndPart(self):
        self.assertEqual(executor.OpScope(2, 3, 'bwd'), 'cell_2_mb_3_bwd')
        self.assertEqual(executor.OpScope(0, 10, 'grad_sum'), 'cell_0_mb_10_grad_sum')

    def testEveryPieceOfTheStepIsUnderItsScope(self):
        k, m = 2, 3
        cells = MakeCells(k)
        x, dy = RandomArrays([6, DIM], seed=9)
        graph = tf.function(
            lambda x, dy: ForwardBackward(MakeSchedule(cells, [True, False], m), cells, x, dy),
            autograph=False).get_concrete_function(tf.constant(x), tf.constant(dy)).graph
        scopes = set()
        for op in graph.get_operations():
            match = re.match(r'cell_(\d+)_mb_(\d+)_(fwd|bwd|grad_sum)/', op.name)
            if match:
                self.assertEqual(match[0][:-1], executor.OpScope(
                    int(match[1]), int(match[2]), match[3]))
                scopes.add((int(match[1]), int(match[2]), match[3]))
        # The first micro-batch's weight gradient starts the running sum: nothing to add.
        self.assertEqual(scopes, {(c, mb, part) for c in range(k) for mb in range(m)
                                  for part in ('fwd', 'bwd', 'grad_sum')
                                  if (mb, part) != (0, 'grad_sum')})


if __name__ == '__main__':
    tf.test.main()
