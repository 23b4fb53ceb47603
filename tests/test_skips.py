"""A skip connection past stages that only carry it (`BaseLayer.PassedLeaves`): both executors
send it from the cell that made it straight to the cell that reads it, and its gradient
straight back (the loop through a ring of its own). The loss, outputs and gradients equal the
same layers run in sequence on the whole batch, under every schedule and recompute mode;
placement is read back from the step's graph; the memory plan counts the skip on the stages
that hold it.

The oracle is `test_utils.Unpartitioned` (the layers chained directly, no executor). A skip
read from another micro-batch, or a skip gradient dropped or sent to the wrong stage, misses
it: every micro-batch's inputs are distinct random values, and the skip's gradient is a large
part of the input's (the join multiplies by it and adds it).
"""

import collections

import pytest
import tensorflow as tf
from absl.testing import parameterized

from gpipe_tf import test_utils
from gpipe_tf.layers import base_layer
from gpipe_tf.layers import fprop_context
from gpipe_tf.nested_map import NestedMap
from gpipe_tf.perf import memory
from gpipe_tf.pipeline import pipelining_layer
from gpipe_tf.pipeline import plan as plan_lib

pytestmark = pytest.mark.unit

DEVICES = test_utils.ConfigureVirtualCpus()
BATCH, DIM, M = 8, 4, 4
RTOL = 1e-5


class SkipLayer(base_layer.BaseLayer):
    """`tanh(a @ w)` on its first input, and per `kind`: 'fork' takes x and gives (tanh(x @ w),
    x), where the skip starts; 'carry' takes (a, s) and gives (tanh(a @ w), s), the skip passed
    on unread (declared by PassedLeaves unless `declare` is False); 'join' takes (a, s) and
    gives tanh(a @ w) * s + s, where it is read."""

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('kind', 'carry', "'fork', 'carry' or 'join'.")
        p.Define('declare', True, 'Whether a carry declares its skip passed unread.')
        return p

    def __init__(self, params):
        super().__init__(params)
        self.CreateVariable('w', base_layer.WeightParams((DIM, DIM)))

    def FProp(self, theta, *inputs):
        if len(inputs) == 1 and isinstance(inputs[0], tuple):  # The pipeline's input, a pair.
            inputs = inputs[0]
        a = inputs[0]
        h = tf.tanh(tf.matmul(a, theta.w))
        if self.p.kind == 'fork':
            return h, a
        skip = inputs[1]
        if self.p.kind == 'carry':
            return h, skip
        return h * skip + skip

    @classmethod
    def PassedLeaves(cls, p):
        return {1: 1} if p.kind == 'carry' and p.declare else {}

    @classmethod
    def FPropMeta(cls, p, *shapes):
        shape = tf.TensorShape(shapes[0])
        out = shape if p.kind == 'join' else (shape, shape)
        return base_layer.LayerMeta(out, 2 * shape.num_elements() * DIM, DIM * DIM,
                                    base_layer.ActivationBytes(shape, p))


def Layers(num_cells, declare=True):
    """A fork, carries, and a join: two layers per cell, so the skip made in cell 0 is read
    in the last cell and only carried by the cells between."""
    kinds = ['fork'] + ['carry'] * (2 * num_cells - 2) + ['join']
    return [SkipLayer.Params().Set(name=f'layer_{i}', kind=kind, declare=declare)
            for i, kind in enumerate(kinds)]


def Pipeline(schedule, num_cells, virtual_stages=1, declare=True, **overrides):
    return pipelining_layer.PipeliningLayer.Params().Set(
        name='model', layer_tpl=Layers(num_cells * virtual_stages, declare),
        num_cells=num_cells, virtual_stages=virtual_stages, num_micro_batches=M,
        schedule=schedule, input_shapes=[BATCH, DIM], devices=DEVICES[:num_cells],
        partition_method='uniform', random_seed=3).Set(**overrides)


def Data():
    x = tf.random.stateless_normal([BATCH, DIM], [1, 2])
    return x, NestedMap(target=tf.random.stateless_normal([BATCH, DIM], [3, 4]))


def LossFn(outputs, loss_inputs):
    return tf.reduce_mean(tf.square(outputs - loss_inputs.target)), tf.constant(1.0)


def Step(layer, x, loss_inputs):
    """(loss, outputs, gradients w.r.t. x and the weights) of the pipeline's training step."""
    with tf.GradientTape() as tape, fprop_context.Scope(step=5):
        tape.watch(x)
        outputs, loss, _ = layer.FPropLoss(layer.theta, x, LossFn, loss_inputs)
    return loss, outputs, tape.gradient(loss, [x] + list(layer.trainable_variables))


def ReferenceStep(layer, x, loss_inputs):
    with tf.GradientTape() as tape:
        tape.watch(x)
        outputs = test_utils.Unpartitioned(layer, x, step=5)
        loss, _ = LossFn(outputs, loss_inputs)
    return loss, outputs, tape.gradient(loss, [x] + list(layer.trainable_variables))


# (schedule, K devices, v, recompute): each kind once, the recompute modes spread over them.
CASES = [('gpipe', 3, 1, 'always'), ('1f1b', 3, 1, 'never'), ('1f1b', 4, 1, 'except_last'),
         ('interleaved_1f1b', 2, 2, 'always'), ('zero_bubble', 3, 1, 'always'),
         ('zero_bubble', 3, 1, 'never'), ('zero_bubble_v', 2, 2, 'never')]


class ContractTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.product(case=CASES, unroll=[True, False])
    def testEveryScheduleEqualsTheLayersInSequence(self, case, unroll):
        schedule, k, v, recompute = case
        layer = Pipeline(schedule, k, v, recompute=recompute, unroll=unroll).Instantiate()
        x, loss_inputs = Data()
        got = tf.function(lambda: Step(layer, x, loss_inputs))()
        want = ReferenceStep(layer, x, loss_inputs)
        # Each weight's gradient is far from zero here, so each is compared relatively.
        for name, a, b in [('loss', got[0], want[0]), ('outputs', got[1], want[1]),
                           ('d_x', got[2][0], want[2][0]), ('weights', got[2][1:], want[2][1:])]:
            self.assertLessEqual(test_utils.MaxRelativeError(a, b), RTOL, msg=name)

    @parameterized.parameters(True, False)
    def testInferenceEqualsTheLayersInSequence(self, unroll):
        layer = Pipeline('1f1b', 3, unroll=unroll).Instantiate()
        x, _ = Data()

        @tf.function
        def Infer():
            with fprop_context.Scope(training=False):
                return layer.FProp(layer.theta, x)

        self.assertLessEqual(test_utils.MaxRelativeError(Infer(),
                                                         test_utils.Unpartitioned(layer, x)),
                             RTOL)


class PassThroughTest(tf.test.TestCase, parameterized.TestCase):
    """A skip from the pipeline's input to its outputs, which every stage only carries: carry
    layers alone take (x, x) and give (h, x) (stage 0 passes on an input, the last stage gives
    it as an output). Its gradient comes from the loss inside the pipeline (FPropLoss) or is
    given to the pipeline's backward (FProp under a tape, gpipe)."""

    def _Layer(self, schedule, unroll, num_cells):
        layers = [SkipLayer.Params().Set(name=f'layer_{i}', kind='carry') for i in range(6)]
        return pipelining_layer.PipeliningLayer.Params().Set(
            name='model', layer_tpl=layers, num_cells=num_cells, num_micro_batches=M,
            schedule=schedule, input_shapes=[(BATCH, DIM), (BATCH, DIM)],
            devices=DEVICES[:num_cells], partition_method='uniform',
            unroll=unroll).Instantiate()

    @staticmethod
    def _Loss(outputs, loss_inputs):
        h, x = outputs
        return (tf.reduce_mean(tf.square(h - loss_inputs.target)) +
                tf.reduce_mean(tf.square(x) * loss_inputs.target), tf.constant(1.0))

    # A backward given its gradients runs after every forward: gpipe's. With one cell, the
    # stage that gives the input on is the one that gives it out.
    @parameterized.product(schedule_given=[('gpipe', True), ('gpipe', False), ('1f1b', False)],
                           unroll=[True, False], num_cells=[1, 3])
    def testItsValueAndGradientEqualTheLayersInSequence(self, schedule_given, unroll,
                                                        num_cells):
        schedule, given = schedule_given
        layer = self._Layer(schedule, unroll, num_cells)
        x, loss_inputs = Data()
        a = x * 0.5  # The first layer's input: x is the skip.

        def Got():
            with tf.GradientTape() as tape, fprop_context.Scope(step=5):
                tape.watch([a, x])
                if given:
                    outputs = layer.FProp(layer.theta, (a, x))
                    loss, _ = self._Loss(outputs, loss_inputs)
                else:
                    outputs, loss, _ = layer.FPropLoss(layer.theta, (a, x), self._Loss,
                                                       loss_inputs)
            return loss, tape.gradient(loss, [a, x] + list(layer.trainable_variables))

        with tf.GradientTape() as tape:
            tape.watch([a, x])
            loss, _ = self._Loss(test_utils.Unpartitioned(layer, (a, x), step=5), loss_inputs)
        want = loss, tape.gradient(loss, [a, x] + list(layer.trainable_variables))
        got = tf.function(Got)()
        self.assertLessEqual(test_utils.MaxRelativeError(got[0], want[0]), RTOL)
        self.assertLessEqual(test_utils.MaxRelativeError(got[1], want[1]), RTOL)


def _OuterCellScope(name: str) -> str | None:
    """The outermost `cell_<k>_mb_<m>_<part>` scope of an op's name (a backward's gradient of
    a forward call holds the forward's scope inside its own)."""
    return next((part for part in name.split('/') if part.startswith('cell_')), None)


def _SkipConsumers(graph) -> set:
    """The devices of the ops that read the skip of micro-batch 0: cell 0's forward call's
    second output (the fork's x, given on)."""
    forks = [op for op in graph.get_operations()
             if op.type in ('PartitionedCall', 'StatefulPartitionedCall')
             and _OuterCellScope(op.name) == 'cell_0_mb_0_fwd']
    assert len(forks) == 1, [op.name for op in forks]
    skip = forks[0].outputs[1]
    return {tf.DeviceSpec.from_string(op.device).device_index
            for op in graph.get_operations() if skip.ref() in {t.ref() for t in op.inputs}}


def _DeviceIndex(device: str) -> int:
    return tf.DeviceSpec.from_string(device).device_index


def _LoopTransfers(graph) -> collections.Counter:
    """Per (from, to) pair of device indices, how many tensors the body of the step's loop
    (one tick) sends: the inputs of its ops placed on another device than their producer's."""
    graph_def = graph.as_graph_def()
    functions = {f.signature.name: f for f in graph_def.library.function}
    loops = [node for node in graph_def.node if node.op in ('While', 'StatelessWhile')]
    assert len(loops) == 1, [node.name for node in loops]
    body = functions[loops[0].attr['body'].func.name].node_def
    devices = {node.name: node.device for node in body}
    sends = collections.Counter()
    for node in body:
        for name in (i.split(':')[0] for i in node.input if not i.startswith('^')):
            if devices.get(name) and node.device and devices[name] != node.device:
                sends[(_DeviceIndex(devices[name]), _DeviceIndex(node.device))] += 1
    return sends


class PlacementTest(tf.test.TestCase, parameterized.TestCase):

    def _Graph(self, declare, **overrides):
        layer = Pipeline('1f1b', 4, declare=declare, **overrides).Instantiate()
        x, loss_inputs = Data()
        return tf.function(lambda: Step(layer, x, loss_inputs)).get_concrete_function().graph

    def _Consumers(self, declare, **overrides):
        layer = Pipeline('1f1b', 4, declare=declare, unroll=True, **overrides).Instantiate()
        x, loss_inputs = Data()
        step = tf.function(lambda: Step(layer, x, loss_inputs))
        return _SkipConsumers(step.get_concrete_function().graph)

    @parameterized.parameters('always', 'never')
    def testASkipGoesStraightToTheStageThatReadsIt(self, recompute):
        # Cell 0's device makes it, cell 3's reads it; cells 1 and 2 never receive it.
        self.assertEqual(self._Consumers(True, recompute=recompute) - {0}, {3})

    def testUndeclaredItIsCarriedThroughEveryStage(self):
        # What the check above would see without the pass: the skip goes to cell 1.
        self.assertEqual(self._Consumers(False) - {0}, {1})

    @parameterized.parameters('always', 'never')
    def testTheLoopSendsASkipStraightToo(self, recompute):
        # Each tick, each cell sends the next its output and the one before its input's
        # gradient; the skip goes from device 0 to 3, its gradient from 3 to 0.
        sends = _LoopTransfers(self._Graph(True, unroll=False, recompute=recompute))
        self.assertEqual(sends, {(0, 1): 1, (1, 2): 1, (2, 3): 1, (1, 0): 1, (2, 1): 1,
                                 (3, 2): 1, (0, 3): 1, (3, 0): 1})

    def testUndeclaredTheLoopCarriesItThroughEveryStage(self):
        # The control of the check above: the skip and its gradient go with the output and
        # its gradient, from stage to stage.
        sends = _LoopTransfers(self._Graph(False, unroll=False))
        self.assertEqual(sends, {(0, 1): 2, (1, 2): 2, (2, 3): 2, (1, 0): 2, (2, 1): 2,
                                 (3, 2): 2})


class MemoryTest(tf.test.TestCase):

    def testTheStagesBetweenHoldNoSkipWhenItIsSentStraight(self):
        def Held(unroll, declare):
            """Per cell, the bytes it holds once gpipe's forwards are done."""
            plan = plan_lib.MakePlan(Pipeline('gpipe', 4, declare=declare, unroll=unroll),
                                     place=False)
            return [cell.before_backward for cell in memory.FromPlan(plan).cells]

        carried = Held(True, False)
        # Unrolled or looped (both send it straight), cells 1 and 2 no longer keep s
        # (BATCH / M x DIM float32: 32 bytes) per micro-batch for their re-materializing
        # backward; cell 0 makes it, cell 3 reads it: unchanged.
        skip = BATCH // M * DIM * 4
        for unroll in (True, False):
            straight = Held(unroll, True)
            self.assertEqual([c - s for c, s in zip(carried, straight)],
                             [0, M * skip, M * skip, 0], msg=f'unroll={unroll}')


if __name__ == '__main__':
    tf.test.main()
