"""Data parallelism x pipeline: R replicas of K stages on a device mesh train like one
un-partitioned model on the global batch."""

import numpy as np
import tensorflow as tf
from absl.testing import parameterized

from gpipe_tf import errors
from gpipe_tf import test_utils
from gpipe_tf.layers import basic
from gpipe_tf.layers import normalization
from gpipe_tf.pipeline import devices
from gpipe_tf.pipeline import devices as devices_lib
from gpipe_tf.pipeline import pipelining_layer
from gpipe_tf.pipeline import plan as plan_lib

DEVICES = test_utils.ConfigureVirtualCpus()
TOLERANCE = 1e-5
BATCH, DIM = 16, 8


def _Layer(num_replicas=2, num_cells=2, m=2, recompute='always', layers=None, devices=None):
    layers = layers or [basic.DenseLayer.Params().Set(input_dim=DIM, output_dim=DIM,
                                                      activation='tanh') for _ in range(6)]
    return pipelining_layer.PipeliningLayer.Params().Set(
        name='pipe', layer_tpl=layers, num_cells=num_cells, num_micro_batches=m,
        recompute=recompute, num_replicas=num_replicas, input_shapes=[BATCH, DIM],
        devices=devices or DEVICES[:num_replicas * num_cells]).Instantiate()


def _Inputs():
    return tf.random.stateless_normal([BATCH, DIM], [3, 5])


class MeshDevicesTest(parameterized.TestCase):

    def testFlatListIsReplicaMajor(self):
        self.assertEqual(devices_lib.MeshDevices(['a', 'b', 'c', 'd'], 2, 2),
                         [['a', 'b'], ['c', 'd']])

    def testFunctionOfReplicaAndStage(self):
        self.assertEqual(devices_lib.MeshDevices(lambda r, k: f'{r}{k}', 2, 3),
                         [['00', '01', '02'], ['10', '11', '12']])

    def testNestedList(self):
        self.assertEqual(devices_lib.MeshDevices([['a', 'b'], ['c', 'd']], 2, 2),
                         [['a', 'b'], ['c', 'd']])

    def testBadMeshes(self):
        with self.assertRaisesRegex(ValueError, 'must be 2 replicas x 2 stages, got \\[2, 1\\]'):
            devices_lib.MeshDevices([['a', 'b'], ['c']], 2, 2)
        with self.assertRaisesRegex(ValueError, 'function of \\(replica, stage\\)'):
            devices_lib.MeshDevices(lambda k: 'a', 2, 2)
        with self.assertRaisesRegex(ValueError, '2 replicas of 2 cells need 4 devices'):
            devices_lib.MeshDevices(['a', 'b', 'c'], 2, 2, round_robin=False)
        with self.assertRaisesRegex(ValueError, 'num_replicas must be >= 1'):
            devices_lib.MeshDevices(None, 0, 2)

    def testAListShorterThanTheStagesIsRefusedUnlessSharingIsAskedFor(self):
        with self.assertRaisesRegex(errors.ConfigError, r'1 replicas of 4 cells need 4 devices, '
                                    r"but only 2 were given \(\['a', 'b'\]\): give one per "
                                    'stage, or set round_robin=True'):
            devices_lib.MeshDevices(['a', 'b'], 1, 4, round_robin=None)
        self.assertEqual(devices_lib.MeshDevices(['a', 'b'], 1, 4, round_robin=True),
                         [['a', 'b', 'a', 'b']])
        # One device for every stage says what it means.
        self.assertEqual(devices_lib.MeshDevices(['a'], 1, 3, round_robin=None),
                         [['a', 'a', 'a']])

    def testSharedDevicesSayHowManyStagesShareWhich(self):
        self.assertIsNone(devices.SharedDevices([['a', 'b'], ['c', 'd']]))
        line = devices.SharedDevices([['a', 'b', 'a', 'b']])
        self.assertRegex(line, r'^4 pipeline stages share 2 device\(s\) \(a, b\): ')
        self.assertIn('VirtualCpus', line)
        self.assertNotIn('\n', line)

    def testALayerOnTooFewDevicesPresentWarnsOnceWhenBuilt(self):
        # More stages than the 8 virtual CPUs, none named.
        layers = [basic.DenseLayer.Params().Set(input_dim=DIM, output_dim=DIM)
                  for _ in range(10)]
        p = pipelining_layer.PipeliningLayer.Params().Set(
            name='pipe', layer_tpl=layers, num_cells=10, num_micro_batches=1,
            input_shapes=[BATCH, DIM])
        with self.assertLogs('absl', level='WARNING') as logs:
            p.Instantiate()
        shared = [line for line in logs.output if 'share' in line]
        self.assertLen(shared, 1)
        self.assertIn('10 pipeline stages share 8 device(s)', shared[0])

    def testLogicalDevicesAndDeviceSpecsGiveTheirNames(self):
        # As tf.device takes them: the list tf.config.list_logical_devices returns, flat or
        # nested, or DeviceSpecs.
        logical = tf.config.list_logical_devices('CPU')[:4]
        names = [[d.name for d in logical[:2]], [d.name for d in logical[2:]]]
        self.assertEqual(devices_lib.MeshDevices(logical, 2, 2), names)
        self.assertEqual(devices_lib.MeshDevices([logical[:2], logical[2:]], 2, 2), names)
        specs = [tf.DeviceSpec(device_type='CPU', device_index=k) for k in range(2)]
        self.assertEqual(devices_lib.MeshDevices(specs, 1, 2),
                         [['/device:CPU:0', '/device:CPU:1']])

    def testALayerOnLogicalDevicesRunsEachStageOnItsDevice(self):
        logical = tf.config.list_logical_devices('CPU')[:2]
        layer = _Layer(num_replicas=1, devices=logical)
        graph = tf.function(layer.FProp).get_concrete_function(
            layer.theta, tf.TensorSpec([BATCH, DIM])).graph
        placed = {}
        for op in graph.get_operations():
            k, _ = test_utils.CellScope(op.name)
            if k is not None:
                placed.setdefault(k, set()).add(tf.DeviceSpec.from_string(op.device))
        self.assertEqual(placed, {k: {tf.DeviceSpec.from_string(d.name)}
                                  for k, d in enumerate(logical)})

    @parameterized.named_parameters(
        ('a_string', '/device:CPU:0', r"must be None, a list of device strings, 2 list\(s\) of "
         r"2 .*got str '/device:CPU:0' \(for every stage on one device, write "
         r"\['/device:CPU:0'\]\)"),
        ('a_number', 3, r'must be None, a list of device strings.*got int 3\.$'),
        ('a_list_of_numbers', [0, 1], r'devices gives int 0 for stage 0 of replica 0; expected '
         r'a device string'),
        ('a_row_that_is_a_string', [['a', 'b'], 'cd'], r'must be 2 replicas x 2 stages'),
        ('a_function_of_numbers', lambda r, k: 42, r'the devices function returned int 42 for '
         r'stage 0 of replica 0; expected a device string'),
    )
    def testDevicesOfTheWrongKindAreAConfigError(self, devices, pattern):
        with self.assertRaisesRegex(errors.ConfigError, pattern):
            devices_lib.MeshDevices(devices, 2, 2)


class DataParallelTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.product(recompute=plan_lib.RECOMPUTE_MODES, m=[1, 2, 4])
    def testGradientsAndUpdateEqualUnpartitionedOnTheGlobalBatch(self, recompute, m):
        layer = _Layer(m=m, recompute=recompute)
        x = _Inputs()
        want = test_utils.OutputsAndGrads(lambda x: test_utils.Unpartitioned(layer, x), layer, x)
        got = tf.function(lambda x: test_utils.OutputsAndGrads(layer, layer, x))(x)
        self.assertLess(test_utils.MaxRelativeError(got, want), TOLERANCE)
        # One SGD update from the pipeline's gradients gives the un-partitioned model's weights.
        before = [v.numpy() for v in layer.trainable_variables]
        grads = got[1][1:]
        tf.compat.v1.train.GradientDescentOptimizer(0.1).apply_gradients(
            zip(grads, layer.trainable_variables))
        expected = [w - 0.1 * g.numpy() for w, g in zip(before, want[1][1:])]
        self.assertLess(test_utils.MaxRelativeError(
            [v.numpy() for v in layer.trainable_variables], expected), TOLERANCE)

    def testV1GraphMatchesUnpartitioned(self):
        graph = tf.Graph()
        with graph.as_default():
            layer = _Layer(recompute='except_last')
            x = _Inputs()
            variables = list(layer.trainable_variables)
            y, y_ref = layer(x), test_utils.Unpartitioned(layer, x)
            fetches = [[y] + tf.compat.v1.gradients(test_utils.SquareLoss(y), variables,
                                                    colocate_gradients_with_ops=False),
                       [y_ref] + tf.compat.v1.gradients(test_utils.SquareLoss(y_ref), variables)]
            config = tf.compat.v1.ConfigProto(device_count={'CPU': len(DEVICES)})
            with tf.compat.v1.Session(graph=graph, config=config) as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                got, want = sess.run(fetches)
        self.assertLess(test_utils.MaxRelativeError(got, want), TOLERANCE)

    def testInferenceConcatenatesTheReplicas(self):
        layer = _Layer(m=2)
        x = _Inputs()
        from gpipe_tf.layers import fprop_context  # pylint: disable=g-import-not-at-top
        with fprop_context.Scope(training=False):
            got = tf.function(layer)(x)
        self.assertLess(test_utils.MaxRelativeError(got, test_utils.Unpartitioned(layer, x)),
                        TOLERANCE)

    def testBatchNormMovingStatisticsCombineEveryReplica(self):
        layer = _Layer(m=2, layers=test_utils.BatchNormStack(2, DIM))
        x = _Inputs() * 3.0 + 1.0
        bn = [l for l in layer.Layers() if isinstance(l, normalization.BatchNormLayer)]
        # Training uses each (replica, micro-batch) chunk's statistics: R x M = 4 chunks in order.
        want = test_utils.OutputsAndGrads(lambda x: test_utils.Unpartitioned(layer, x, 4),
                                          layer, x)
        # The first BN layer sees the first dense layer's output of the whole global batch.
        h = x @ layer.Layers()[0].theta.w
        mean, var = tf.nn.moments(h, [0])
        expected = (0.9 * bn[0].vars.moving_mean + 0.1 * mean,
                    0.9 * bn[0].vars.moving_variance + 0.1 * var)
        got = tf.function(lambda x: test_utils.OutputsAndGrads(layer, layer, x))(x)
        self.assertLess(test_utils.MaxRelativeError(got, want), TOLERANCE)
        self.assertLess(test_utils.MaxRelativeError(
            (bn[0].vars.moving_mean, bn[0].vars.moving_variance), expected), TOLERANCE)

    def testBatchNotDivisibleByReplicasIsRefusedWhenThePlanIsMade(self):
        with self.assertRaisesRegex(ValueError, 'batch size 16 is not divisible by num_replicas'):
            _Layer(num_replicas=3, num_cells=1, m=1, devices=DEVICES[:3])


class PlacementTest(tf.test.TestCase):

    def testEachReplicaStageRunsOnItsMeshDevice(self):
        graph = tf.Graph()
        with graph.as_default():
            layer = _Layer(m=2)
            y = layer(_Inputs())
            tf.compat.v1.gradients(test_utils.SquareLoss(y), list(layer.trainable_variables),
                                   colocate_gradients_with_ops=False)
        mesh = layer.mesh
        checked = 0
        for op in graph.get_operations():
            parts = op.name.split('/')
            replica = next((int(p[len('replica_'):]) for p in parts
                            if p.startswith('replica_') and p[len('replica_'):].isdigit()), None)
            cell = next((int(p.split('_')[1]) for p in parts
                         if p.startswith('cell_') and '_mb_' in p), None)
            if replica is None or cell is None or not op.device:
                continue
            checked += 1
            self.assertEqual(tf.DeviceSpec.from_string(op.device),
                             tf.DeviceSpec.from_string(mesh[replica][cell]), op.name)
        self.assertGreater(checked, 20)
        self.assertLen({d for row in mesh for d in row}, 4)


if __name__ == '__main__':
    np.set_printoptions(precision=4)
    tf.test.main()
