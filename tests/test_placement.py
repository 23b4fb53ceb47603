"""Every op of a stage runs on the stage's device, read back from the graphs a tf.function step
actually ran (its partition graphs, after placement, inlining and grappler), under every
schedule and recompute mode, as a loop and unrolled.

A traced cell function serves every stage of its structure; ops it took a device from while it
was traced ran on that device for every stage (the looped backwards all on the first device).
test_pipeline's PlacementTest reads a v1 graph before placement; this test reads what ran.
"""

import re

import tensorflow as tf
from absl.testing import parameterized
from tensorflow.python.eager import context

from gpipe_tf import test_utils
from gpipe_tf.layers import basic
from gpipe_tf.pipeline import pipelining_layer
from gpipe_tf.pipeline import plan as plan_lib

DEVICES = test_utils.ConfigureVirtualCpus()
BATCH, DIM = 8, 4
# An op of stage s's action: `cell_<s>_<part>/` (looped) or `cell_<s>_mb_<m>_<part>/` (unrolled).
_STAGE_SCOPE = re.compile(r'(?:^|/)cell_(\d+)_(?:mb_\d+_)?(?:fwd|bwd|bwd_input|bwd_weight)'
                          r'(?:_\d+)?/')
# (schedule, devices, virtual stages): zero_bubble_v's four stages on devices 0, 1, 1, 0.
KINDS = [('gpipe', 2, 1), ('1f1b', 2, 1), ('interleaved_1f1b', 2, 2), ('zero_bubble', 2, 1),
         ('zero_bubble_v', 2, 2)]


def SquareLoss(outputs, _):
    """FPropLoss's loss_fn: (value, weight) of a micro-batch."""
    return tf.reduce_sum(tf.square(outputs)), tf.constant(1.0)


def PartitionGraphs(layer) -> list:
    """The partition graphs (GraphDefs, one per device and function) of one step of a fresh
    tf.function (partition graphs are reported when a function first runs)."""
    variables = layer.trainable_variables

    @tf.function
    def Step(x):
        with tf.GradientTape() as tape:
            _, loss, _ = layer.FPropLoss(layer.theta, x, SquareLoss)
        return tape.gradient(loss, variables)

    x = tf.random.stateless_normal([BATCH, DIM], [1, 2])
    context.enable_run_metadata()
    try:
        context.export_run_metadata()  # Drops what earlier steps left.
        Step(x)
        metadata = context.export_run_metadata()
    finally:
        context.disable_run_metadata()
    return list(metadata.partition_graphs) + [
        g for function in metadata.function_graphs for g in function.partition_graphs]


def Pipeline(kind, k, v, mode, unroll):
    layers = [basic.DenseLayer.Params().Set(name=f'dense_{i}', input_dim=DIM, output_dim=DIM,
                                            activation='tanh') for i in range(2 * k * v)]
    return pipelining_layer.PipeliningLayer.Params().Set(
        name='pipe', layer_tpl=layers, num_cells=k, virtual_stages=v, num_micro_batches=4,
        schedule=kind, recompute=mode, unroll=unroll, input_shapes=[BATCH, DIM],
        devices=DEVICES[:k]).Instantiate()


class RunTimePlacementTest(parameterized.TestCase):

    @parameterized.named_parameters(*[
        (f'{kind}_{mode}_{"unrolled" if unroll else "looped"}', kind, k, v, mode, unroll)
        for kind, k, v in KINDS for mode in plan_lib.RECOMPUTE_MODES
        for unroll in (False, True)])
    def testEveryStageOpRanOnItsStagesDevice(self, kind, k, v, mode, unroll):
        layer = Pipeline(kind, k, v, mode, unroll)
        stage_devices = [tf.DeviceSpec.from_string(d) for d in layer.devices]
        self.assertLen(stage_devices, k * v)
        checked, wrong = 0, []
        for name, op, device in [(node.name, node.op, node.device)
                                 for g in PartitionGraphs(layer) for node in g.node]:
            match = _STAGE_SCOPE.search(name)
            # Nodes named `.../_<n>` are the runtime's: send/receive pairs (a node on each
            # side of a device boundary) and the identities an inlined call's inputs and
            # outputs pass through.
            if match is None or re.search(r'/_\d+$', name):
                continue
            checked += 1
            stage = int(match.group(1))
            ran = tf.DeviceSpec.from_string(device)
            if ran.device_index != stage_devices[stage].device_index:
                wrong.append(f'{name} ({op}) of stage {stage} on {device}')
        self.assertGreater(checked, 0)
        self.assertEqual(wrong[:5], [], f'{len(wrong)} of {checked} stage ops on another '
                                        'device')


class LoopStateTest(parameterized.TestCase):
    """The loop's state stays on its devices: a TensorArray is read where it lives (sent to
    another device, a TensorArray is copied whole, every micro-batch of its ring), and no loop
    variable passes through another device on its way from one tick to the next."""

    @parameterized.named_parameters(*[(f'{kind}_{mode}', kind, k, v, mode)
                                      for kind, k, v in KINDS for mode in ('always', 'never')])
    def testNoTensorArrayOrLoopVariableCrossesADevice(self, kind, k, v, mode):
        graphs = PartitionGraphs(Pipeline(kind, k, v, mode, unroll=False))
        sends, loop_variables = 0, 0
        for g in graphs:
            ops = {node.name: node.op for node in g.node}
            for node in g.node:
                if node.op == '_Send':
                    sends += 1
                    self.assertNotEqual(node.attr['T'].type, tf.variant.as_datatype_enum,
                                        f'{node.name} sends a TensorArray to '
                                        f'{node.attr["recv_device"].s.decode()}')
                if node.op == 'NextIteration':
                    loop_variables += 1
                    source = node.input[0].split(':')[0]
                    self.assertNotEqual(ops.get(source), '_Recv',
                                        f'{node.name} takes its next value from another device')
        self.assertGreater(sends, 0)  # The stages' devices do exchange micro-batches.
        self.assertGreater(loop_variables, 0)

    @parameterized.named_parameters(*[(f'{kind}_{mode}', kind, k, v, mode)
                                      for kind, k, v in KINDS for mode in ('always', 'never')])
    def testNothingCrossesADeviceInsideASwitch(self, kind, k, v, mode):
        """A device's switch over its actions (lowered: its branches' ops run every tick,
        taken or not) sends nothing to, and receives nothing from, another device: what an
        action reads of another device's arrays is read there before the switch, and the
        action's index and micro-batch come from the device's own tables. (A transfer inside
        the switch costs a send and a receive each tick in every branch that has it.)"""
        graphs = PartitionGraphs(Pipeline(kind, k, v, mode, unroll=False))
        transfers = ('_Send', '_Recv', '_HostSend', '_HostRecv')
        crossings = 0
        for g in graphs:
            ops = {node.name: node.op for node in g.node}
            for node in g.node:
                # (A switch's completion, `branch_executed`, goes to the loop body's control
                # output on the first device: one signal a tick, not an action's data.)
                if 'branch_executed' in node.name:
                    continue
                if node.op in ('_Send', '_HostSend'):
                    crossings += 1
                    self.assertNotIn('switch_case', node.input[0],
                                     f'{node.name} sends a value of a switch to another device')
                if 'switch_case' in node.name and node.op not in transfers:
                    for source in (x.lstrip('^').split(':')[0] for x in node.input):
                        self.assertNotIn(ops.get(source), transfers,
                                         f'{node.name} takes {source} from another device')
        self.assertGreater(crossings, 0)


if __name__ == '__main__':
    tf.test.main()
