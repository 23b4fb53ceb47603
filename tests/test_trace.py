"""Measured timelines: op names read back as schedule boxes, and a traced step of a real pipeline
runs the GPipe schedule (each device one micro-batch at a time, in order) in both graph modes."""

import os
import shutil
import tempfile
from unittest import mock

import tensorflow as tf
from absl.testing import parameterized

from gpipe_tf import test_utils
from gpipe_tf.layers import basic
from gpipe_tf.perf import plot
from gpipe_tf.perf import simulator
from gpipe_tf.perf import trace
from gpipe_tf.pipeline import pipelining_layer

DEVICES = test_utils.ConfigureVirtualCpus()


class ClassifyOpTest(parameterized.TestCase):

    @parameterized.parameters(
        ('cell_0_mb_1_fwd/PartitionedCall/MatMul', (0, 1, 'forward')),
        ('cell_2_mb_10_bwd/PartitionedCall/recompute/MatMul_3', (2, 10, 'recompute')),
        # Gradient ops are named after the recomputed ops they differentiate.
        ('cell_2_mb_0_bwd/PartitionedCall/gradients/recompute/MatMul_grad/MatMul', (2, 0,
                                                                                     'backward')),
        ('gradients/IdentityN_grad/cell_1_mb_3_bwd/PartitionedCall/gradients/Relu_grad/ReluGrad',
         (1, 3, 'backward')),
        ('cell_3_mb_2_bwd/gradients/MatMul_grad/MatMul', (3, 2, 'backward')),
        ('cell_1_mb_0_grad_sum/add_2', (1, 0, 'backward')),
        ('cell_1_mb_0_fwd_1/PartitionedCall/MatMul', (1, 0, 'forward')),  # Built twice.
    )
    def testPipelineOps(self, name, expected):
        self.assertEqual(trace.ClassifyOp(name), expected)

    @parameterized.parameters(
        ('while/body/_1/while/device_0/switch_case/indexed_case/cell_0_fwd/PartitionedCall/'
         'MatMul', (0, None, 'forward')),
        ('while/body/_1/device_2/switch_case/indexed_case/cell_2_bwd/PartitionedCall/recompute/'
         'Relu', (2, None, 'recompute')),
        ('while/body/_1/device_2/switch_case/indexed_case/cell_2_bwd/PartitionedCall/gradients/'
         'recompute/MatMul_grad/MatMul', (2, None, 'backward')),
        ('while/body/_1/device_1/cell_1_bwd_input/PartitionedCall/gradients/MatMul_grad/MatMul',
         (1, None, 'input_grad')),
        ('while/body/_1/device_1/cell_1_bwd_weight/PartitionedCall/MatMul', (1, None,
                                                                            'weight_grad')),
    )
    def testLoopedOpsHaveNoMicroBatch(self, name, expected):
        self.assertEqual(trace.ClassifyOp(name), expected)

    def testALoopedOpsRunsAreItsMicroBatchesInOrder(self):
        name = 'while/body/_1/device_0/cell_0_fwd/PartitionedCall/MatMul'
        events = [trace.OpEvent(name, 2.0, 3.0), trace.OpEvent(name, 0.0, 1.0),
                  trace.OpEvent('cell_0_theta/Read/ReadVariableOp', 0.0, 0.1)]
        self.assertEqual([(i.micro_batch, i.start) for i in trace.MeasuredTimeline(
            events, 1).intervals], [(0, 0.0), (1, 2.0)])

    @parameterized.parameters('loss/Mean', 'cell_1_mb_0_fwd/PartitionedCall/MatMul/_17',
                              'cell_0_theta/Read/ReadVariableOp', 'cell_0_update/AssignAdd',
                              'cell_0_sums/zeros', 'cell_0_grad_scale/mul')
    def testOtherOpsAreNotBoxes(self, name):
        self.assertIsNone(trace.ClassifyOp(name))


class MeasuredTimelineTest(tf.test.TestCase):

    def testBoxesSpanTheirSubstantialOpsAndBusyTimeIsAUnion(self):
        events = [
            trace.OpEvent('loss/Mean', 0.0, 0.1),
            trace.OpEvent('cell_0_mb_0_fwd/PartitionedCall/MatMul', 1.0, 2.0),
            # Two threads of device 0 overlap: busy counts [1, 2.5] once.
            trace.OpEvent('cell_0_mb_0_fwd/PartitionedCall/MatMul_1', 1.5, 2.5),
            # A constant run at the start does not stretch its box.
            trace.OpEvent('cell_1_mb_0_bwd/PartitionedCall/recompute/Const', 0.2, 0.2001),
            trace.OpEvent('cell_1_mb_0_bwd/PartitionedCall/recompute/MatMul', 3.0, 4.0),
            trace.OpEvent('cell_1_mb_0_bwd/PartitionedCall/gradients/MatMul_grad/MatMul',
                          4.0, 6.0),
            trace.OpEvent('update/AssignSub', 6.0, 7.0),
        ]
        timeline = trace.MeasuredTimeline(events, num_cells=2)
        boxes = {(i.cell, i.micro_batch, i.kind): (i.device, i.start, i.end)
                 for i in timeline.intervals}
        self.assertEqual(boxes, {(0, 0, 'forward'): (0, 1.0, 2.5),
                                 (1, 0, 'recompute'): (1, 3.0, 4.0),
                                 (1, 0, 'backward'): (1, 4.0, 6.0)})
        self.assertEqual(timeline.makespan, 7.0)
        self.assertAllClose(timeline.busy, [1.5, 3.0001])

    def testASplitBackwardsGradientSumIsPartOfItsW(self):
        events = [trace.OpEvent('cell_0_mb_0_bwd_input/MatMul', 0.0, 1.0),
                  trace.OpEvent('cell_0_mb_0_bwd_weight/MatMul', 2.0, 3.0),
                  trace.OpEvent('cell_0_mb_0_grad_sum/add', 3.0, 3.5),
                  trace.OpEvent('cell_0_mb_1_bwd/MatMul', 4.0, 5.0),
                  trace.OpEvent('cell_0_mb_1_grad_sum/add', 5.0, 5.5)]
        boxes = {(i.micro_batch, i.kind): (i.start, i.end)
                 for i in trace.MeasuredTimeline(events, 1).intervals}
        self.assertEqual(boxes, {(0, 'input_grad'): (0.0, 1.0), (0, 'weight_grad'): (2.0, 3.5),
                                 (1, 'backward'): (4.0, 5.5)})

    def testOneReplicaAtATime(self):
        events = [trace.OpEvent('replica_0/cell_0_mb_0_fwd/MatMul', 0.0, 1.0),
                  trace.OpEvent('replica_1/cell_0_mb_0_fwd/MatMul', 0.5, 3.0)]
        self.assertEqual([(i.start, i.end) for i in trace.MeasuredTimeline(
            events, 1, replica=1).intervals], [(0.5, 3.0)])
        self.assertEqual([(i.start, i.end) for i in trace.MeasuredTimeline(
            events, 1).intervals], [(0.0, 1.0)])

    def testNoPipelineOpIsAnError(self):
        with self.assertRaisesRegex(ValueError, 'None of the 1 traced ops'):
            trace.MeasuredTimeline([trace.OpEvent('loss/Mean', 0, 1)], 2)

    def testCellBeyondKIsAnError(self):
        with self.assertRaisesRegex(ValueError, 'cell 3, but the pipeline has 2 cells'):
            trace.MeasuredTimeline([trace.OpEvent('cell_3_mb_0_fwd/MatMul', 0, 1)], 2)


K, M, BATCH, DIM = 3, 4, 192, 512


def _Pipeline(recompute, unroll=True):
    layers = [basic.DenseLayer.Params().Set(input_dim=DIM, output_dim=DIM, activation='relu')
              for _ in range(6)]
    return pipelining_layer.PipeliningLayer.Params().Set(
        name='pipe', layer_tpl=layers, num_cells=K, num_micro_batches=M, recompute=recompute,
        input_shapes=[BATCH, DIM], devices=DEVICES[:K], unroll=unroll)


class TracedStepTest(tf.test.TestCase, parameterized.TestCase):
    """One real step, traced: every (cell, micro-batch, kind) box once, on its cell's device,
    and each device's actions in the schedule's order.

    The order is read from the boxes' ends. A box spans its ops, and the executor orders an
    action after the device's previous one only through what it computes from: its ops that
    need only the weights or the incoming gradient may run early (seen: a recompute box began
    at the step's first microsecond, a backward box 0.2 ms before its recompute under load),
    while its last op always comes after the previous action's. That actions are chained is
    read from the unrolled graph (test_executor, test_schedules).
    """

    def _TraceFunction(self, recompute, unroll=True):
        layer = _Pipeline(recompute, unroll).Instantiate()
        x = tf.random.stateless_normal([BATCH, DIM], [1, 2])

        @tf.function
        def Step(x):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(layer(x)))
            return tape.gradient(loss, layer.trainable_variables)

        Step(x)
        return trace.MeasuredTimeline(trace.TraceFunction(Step, x), K)

    def _TraceSession(self, recompute):
        graph = tf.Graph()
        with graph.as_default():
            layer = _Pipeline(recompute).Instantiate()
            x = tf.random.stateless_normal([BATCH, DIM], [1, 2])
            loss = tf.reduce_mean(tf.square(layer(x)))
            grads = tf.compat.v1.gradients(loss, list(layer.trainable_variables),
                                           colocate_gradients_with_ops=False)
            config = tf.compat.v1.ConfigProto(device_count={'CPU': len(DEVICES)})
            with tf.compat.v1.Session(graph=graph, config=config) as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                sess.run(grads)
                _, events = trace.TraceSessionRun(sess, grads)
        return trace.MeasuredTimeline(events, K)

    def _CheckSchedule(self, timeline, recompute):
        remat = {'always': [True] * K, 'never': [False] * K,
                 'except_last': [True] * (K - 1) + [False]}[recompute]
        expected = {(k, m, kind) for k in range(K) for m in range(M)
                    for kind in (('forward', 'recompute', 'backward') if remat[k]
                                 else ('forward', 'backward'))}
        labels = [(i.cell, i.micro_batch, i.kind) for i in timeline.intervals]
        self.assertCountEqual(labels, expected)
        for i in timeline.intervals:
            self.assertEqual(i.device, i.cell)
        boxes = {(i.cell, i.micro_batch, i.kind): i for i in timeline.intervals}
        for k in range(K):
            # Forwards of micro-batches 0..M-1, then per micro-batch its backward: (recompute,)
            # backward, whose gradients need the recomputed activations.
            ends = [boxes[(k, m, kind)] for kind in ('forward', 'backward') for m in range(M)]
            for before, after in zip(ends, ends[1:]):
                self.assertLess(before.end, after.end, f'cell {k}: {before} ends after {after}')
            for m in range(M):
                if remat[k]:
                    recomputed, backward = boxes[(k, m, 'recompute')], boxes[(k, m, 'backward')]
                    self.assertLess(recomputed.end, backward.end,
                                    f'{recomputed} ends after {backward}')
        self.assertGreater(timeline.utilisation, 0)
        self.assertLessEqual(timeline.utilisation, 1)

    @parameterized.parameters('always', 'except_last', 'never')
    def testFunctionStepRunsTheSchedule(self, recompute):
        self._CheckSchedule(self._TraceFunction(recompute), recompute)

    def testLoopedStepRunsTheSchedule(self):
        # One name per action for every micro-batch: each run of it is the next micro-batch.
        self._CheckSchedule(self._TraceFunction('always', unroll=False), 'always')

    def testLoopedZeroBubbleStepRunsItsListInOrder(self):
        # Split backwards in the loop: every F, I (after its recompute) and W once, and each
        # device's boxes in its list's order.
        layer = _Pipeline('always', unroll=False).Set(schedule='zero_bubble').Instantiate()
        x = tf.random.stateless_normal([BATCH, DIM], [1, 2])
        step = tf.function(lambda x: layer.FPropLoss(
            layer.theta, x, lambda y, _: (tf.reduce_mean(tf.square(y)), tf.constant(1.0)))[1])
        step(x)
        timeline = trace.MeasuredTimeline(trace.TraceFunction(step, x), K)
        kinds = {'forward': 'F', 'input_grad': 'I', 'weight_grad': 'W'}
        boxes = [i for i in timeline.intervals if i.kind != 'recompute']
        sched = layer.plan.schedule
        self.assertCountEqual([(kinds[i.kind], i.cell, i.micro_batch) for i in boxes],
                              [tuple(a) for device in sched.actions for a in device])
        for d, actions in enumerate(sched.actions):
            ran = sorted((i for i in boxes if i.device == d), key=lambda i: i.end)
            self.assertEqual([(kinds[i.kind], i.cell, i.micro_batch) for i in ran],
                             [tuple(a) for a in actions])

    @parameterized.parameters('always', 'never')
    def testSessionStepRunsTheSchedule(self, recompute):
        self._CheckSchedule(self._TraceSession(recompute), recompute)

    def testGanttChartOfATracedStep(self):
        timeline = self._TraceFunction('always')
        figure = plot.TimelineFigure(timeline, title='traced',
                                     ideal_utilisation=simulator.IdealUtilisation(M, K))
        with tempfile.TemporaryDirectory() as out_dir:
            path = plot.SavePng(figure, os.path.join(out_dir, 'timeline.png'))
            with open(path, 'rb') as f:
                self.assertEqual(f.read(8), b'\x89PNG\r\n\x1a\n')
        axes = figure.axes[0]
        self.assertLen(axes.get_yticklabels(), K)
        self.assertLen(axes.patches, 3 * K * M)


class TraceFunctionTempDirTest(tf.test.TestCase):
    """TraceFunction's default profile directory is temporary: nothing is left in the temp
    directory, whether the traced function returns or raises."""

    def setUp(self):
        super().setUp()
        # A private temp directory: other processes' files cannot disturb the comparison.
        temp_root = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, temp_root)
        patcher = mock.patch.object(tempfile, 'tempdir', temp_root)
        patcher.start()
        self.addCleanup(patcher.stop)
        self.assertEqual(tempfile.gettempdir(), temp_root)

    def _Leftovers(self, before):
        return sorted(set(os.listdir(tempfile.gettempdir())) - before)

    def testNoDirectoryIsLeftBehind(self):
        step = tf.function(lambda x: tf.matmul(x, x, name='square'))
        x = tf.ones([64, 64])
        step(x)
        before = set(os.listdir(tempfile.gettempdir()))
        names = [e.name for e in trace.TraceFunction(step, x)]
        self.assertTrue(any(name.endswith('square') for name in names), names)
        self.assertEqual(self._Leftovers(before), [])

    def testNoDirectoryIsLeftBehindWhenTheFunctionRaises(self):
        def Fails():
            raise RuntimeError('traced function failed')

        before = set(os.listdir(tempfile.gettempdir()))
        with self.assertRaisesRegex(RuntimeError, 'traced function failed'):
            trace.TraceFunction(Fails)
        self.assertEqual(self._Leftovers(before), [])

    def testAGivenLogdirKeepsTheProfile(self):
        step = tf.function(lambda x: x + 1.0)
        x = tf.ones([4])
        step(x)
        logdir = os.path.join(tempfile.gettempdir(), 'kept')
        trace.TraceFunction(step, x, logdir=logdir)
        profiles = [f for _, _, files in os.walk(logdir) for f in files
                    if f.endswith('.xplane.pb')]
        self.assertLen(profiles, 1)


if __name__ == '__main__':
    tf.test.main()
