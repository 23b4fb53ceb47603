"""TPU cores as pipeline devices, without a TPU: the v1 graph built inside `tpu.rewrite` puts
every op of cell k on logical core k, and device assignments of R replicas x K cores are checked
against fake topologies."""

import tensorflow as tf
from absl.testing import parameterized

from gpipe_tf import test_utils
from gpipe_tf.layers import basic
from gpipe_tf.layers import pipeline
from gpipe_tf.train import tpu

test_utils.ConfigureVirtualCpus()
K, DIM, BATCH = 3, 8, 8


def _FunctionNodes(library, name, seen):
    if name in seen or name not in library:
        return []
    seen.add(name)
    nodes = list(library[name].node_def)
    for node in list(nodes):
        for attr in node.attr.values():
            if attr.func.name:
                nodes += _FunctionNodes(library, attr.func.name, seen)
    return nodes


class CoreDevicesTest(tf.test.TestCase, parameterized.TestCase):

    def testOneLogicalCorePerStage(self):
        self.assertEqual(tpu.CoreDevices(3), ['device:TPU_REPLICATED_CORE:0',
                                              'device:TPU_REPLICATED_CORE:1',
                                              'device:TPU_REPLICATED_CORE:2'])
        with self.assertRaisesRegex(ValueError, 'num_cells must be >= 1'):
            tpu.CoreDevices(0)

    @parameterized.parameters('always', 'except_last', 'never')
    def testEveryOpOfCellKIsOnCoreK(self, recompute):
        graph = tf.Graph()
        with graph.as_default():
            layers = [basic.DenseLayer.Params().Set(input_dim=DIM, output_dim=DIM,
                                                    activation='tanh') for _ in range(6)]
            layer = pipeline.PipeliningLayer.Params().Set(
                name='pipe', layer_tpl=layers, num_cells=K, num_micro_batches=2,
                recompute=recompute, input_shapes=[BATCH, DIM],
                devices=tpu.CoreDevices(K)).Instantiate()

            def Step(x):
                loss = test_utils.SquareLoss(layer(x))
                return [loss] + tf.compat.v1.gradients(loss, list(layer.trainable_variables),
                                                       colocate_gradients_with_ops=False)

            tf.compat.v1.tpu.rewrite(Step, [tf.zeros([BATCH, DIM])])
        library = {f.signature.name: f for f in graph.as_graph_def().library.function}
        checked = {k: 0 for k in range(K)}
        for op in graph.get_operations():
            scope = next((part for part in op.name.split('/')
                          if part.startswith('cell_') and '_mb_' in part), None)
            if scope is None:
                continue
            k = int(scope.split('_')[1])
            core = f'/device:TPU_REPLICATED_CORE:{k}'
            self.assertEqual(op.device, core, op.name)
            checked[k] += 1
            for attr in op.node_def.attr.values():
                if attr.func.name:
                    for node in _FunctionNodes(library, attr.func.name, set()):
                        # A function body's unplaced nodes (its return identities) run on the
                        # device of the call, checked above.
                        self.assertIn(node.device, (core, ''), f'{op.name}: {node.name}')
                        checked[k] += bool(node.device)
        # Forward, recompute and backward ops of every cell were seen.
        self.assertTrue(all(count > 20 for count in checked.values()), checked)


class DeviceAssignmentTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.parameters((2, 4), (4, 2), (8, 1), (1, 8), (2, 2))
    def testEveryStageOfEveryReplicaGetsItsOwnCore(self, num_cells, num_replicas):
        topology = tpu.FakeTopology([2, 2, 1, 2])  # 4 chips of 2 cores.
        assignment = tpu.BuildDeviceAssignment(topology, num_cells, num_replicas)
        self.assertEqual(assignment.num_replicas, num_replicas)
        self.assertEqual(assignment.num_cores_per_replica, num_cells)
        cores = tpu.StageCores(assignment, num_replicas, num_cells)
        coordinates = [tuple(c['coordinates']) for row in cores for c in row]
        self.assertLen(set(coordinates), num_replicas * num_cells)
        for row in cores:
            # A replica's stages fill whole chips before the next chip: stages 2j and 2j+1
            # share a chip.
            for j in range(0, num_cells - 1, 2):
                self.assertEqual(row[j]['coordinates'][:3], row[j + 1]['coordinates'][:3])

    def testHostsOfAMultiHostTopology(self):
        topology = tpu.FakeTopology([2, 2, 1, 2], num_tasks=2)  # 2 hosts of 4 cores.
        cores = tpu.StageCores(tpu.BuildDeviceAssignment(topology, 2, 4), 4, 2)
        hosts = {c['host'] for row in cores for c in row}
        self.assertEqual(hosts, {'/task:0/device:CPU:0', '/task:1/device:CPU:0'})
        for row in cores:
            self.assertLen({c['host'] for c in row}, 1)  # A chip's two cores share a host.

    def testComputationShape(self):
        self.assertEqual(tpu.ComputationShape([2, 2, 1, 2], 1), [1, 1, 1, 1])
        self.assertEqual(tpu.ComputationShape([2, 2, 1, 2], 2), [1, 1, 1, 2])
        self.assertEqual(tpu.ComputationShape([2, 2, 1, 2], 4), [1, 2, 1, 2])
        self.assertEqual(tpu.ComputationShape([4, 4, 1, 2], 8), [1, 4, 1, 2])

    def testBadShapes(self):
        topology = tpu.FakeTopology([2, 2, 1, 2])
        with self.assertRaisesRegex(ValueError, '3 cores per replica do not tile chips of 2'):
            tpu.BuildDeviceAssignment(topology, 3)
        with self.assertRaisesRegex(ValueError, '3 replicas x 4 cells need 12 TPU cores; the '
                                                'topology has 8'):
            tpu.BuildDeviceAssignment(topology, 4, 3)
        with self.assertRaisesRegex(ValueError, 'TPU mesh shape is \\[x, y, z, cores'):
            tpu.ComputationShape([2, 2], 2)


if __name__ == '__main__':
    tf.test.main()
