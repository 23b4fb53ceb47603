"""TPU cores as pipeline devices, without a TPU: the v1 graph built inside `tpu.rewrite` puts
every op of cell k on logical core k; in the TF2 path (logical devices of a TPUStrategy) every
tensor crossing cell k's boundary, its parameters and their gradients are assigned to logical
device k, and the math is unchanged; device assignments of R replicas x K cores are checked
against fake topologies; `Connect` fails clearly without a TPU."""

import contextlib
import re
import tempfile
import types
from unittest import mock

import tensorflow as tf
from absl.testing import parameterized

from gpipe_tf import test_utils
from gpipe_tf import trainer
from gpipe_tf.layers import basic
from gpipe_tf.layers import fprop_context
from gpipe_tf.pipeline import pipelining_layer
from gpipe_tf.pipeline import plan as plan_lib
from gpipe_tf.train import cluster as cluster_lib
from gpipe_tf.train import program
from gpipe_tf.train import setup
from gpipe_tf.train import tpu

test_utils.ConfigureVirtualCpus()
K, DIM, BATCH = 3, 8, 8


def _Pipeline(recompute, num_micro_batches=2, **params):
    """K cells of 6 dense tanh layers over M micro-batches, with `params` set."""
    layers = [basic.DenseLayer.Params().Set(input_dim=DIM, output_dim=DIM, activation='tanh')
              for _ in range(6)]
    return pipelining_layer.PipeliningLayer.Params().Set(
        name='pipe', layer_tpl=layers, num_cells=K, num_micro_batches=num_micro_batches,
        recompute=recompute, input_shapes=[BATCH, DIM], **params).Instantiate()


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
            layer = _Pipeline(recompute, devices=tpu.CoreDevices(K))

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
                        # A function body's unplaced nodes run on the device of the call,
                        # checked above (cells of one structure share a body that names no
                        # device).
                        self.assertIn(node.device, (core, ''), f'{op.name}: {node.name}')
                        checked[k] += 1
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


def _LogicalPipeline(recompute, logical_device_fn=tpu.ShardingAssign, num_micro_batches=2):
    return _Pipeline(recompute, num_micro_batches=num_micro_batches,
                     logical_device_fn=logical_device_fn)


def _TrainStep(layer):
    """A tf.function: (outputs, gradients of the inputs and variables) at training."""

    def Step(x):
        with fprop_context.Scope(training=True, step=tf.constant(0, tf.int64)):
            return test_utils.OutputsAndGrads(layer, layer, x)

    return tf.function(Step)


def _VariableOfRead(op, handles):
    """The variable whose ReadVariableOp feeds `op` (through identities), or None."""
    while op.type in ('Identity', 'IdentityN') and op.inputs:
        op = op.inputs[0].op
    if op.type != 'ReadVariableOp':
        return None
    return handles.get(op.inputs[0].ref())


@contextlib.contextmanager
def _LogicalDevicesOfNewVariables():
    """A TPUStrategy creates variables on the logical device whose
    `extended.experimental_logical_device` scope is open. Under a stand-in strategy, yields a
    dict that records, per variable created meanwhile, that logical device (None: none open)."""
    open_scopes, created = [], {}

    @contextlib.contextmanager
    def LogicalDevice(k):
        open_scopes.append(k)
        try:
            yield
        finally:
            open_scopes.pop()

    def Creator(next_creator, **kwargs):
        variable = next_creator(**kwargs)
        created[variable.name] = open_scopes[-1] if open_scopes else None
        return variable

    strategy = types.SimpleNamespace(
        extended=types.SimpleNamespace(experimental_logical_device=LogicalDevice))
    with mock.patch.object(tf.distribute, 'get_strategy', return_value=strategy), \
            tf.variable_creator_scope(Creator):
        yield created


class LogicalDeviceTest(tf.test.TestCase, parameterized.TestCase):
    """The TF2 TPU path: cells on the logical devices of a TPUStrategy replica, annotated with
    XLA sharding ops (which run as identities on a CPU)."""

    @parameterized.parameters('always', 'except_last', 'never')
    def testEveryCellBoundaryAndParameterIsOnLogicalDeviceK(self, recompute):
        layer = _LogicalPipeline(recompute)
        self.assertEqual(layer.devices, [''] * K)  # No device scopes: XLA places the cells.
        x = tf.random.stateless_normal([BATCH, DIM], seed=[1, 2])
        graph = _TrainStep(layer).get_concrete_function(x).graph
        handles = {placeholder.ref(): variable
                   for variable in layer.trainable_variables
                   for captured, placeholder in graph.captures if captured is variable.handle}
        cell_of = {variable.ref(): k for k, cell in enumerate(layer.cells)
                   for variable in cell.trainable_variables}
        annotated = {}
        parameters = {k: set() for k in range(K)}
        for op in graph.get_operations():
            device = tpu.LogicalDeviceOf(op)
            if op.type != 'XlaSharding':
                continue
            self.assertIn(device, range(K), op.name)
            scope = re.search(r'cell_(\d+)_mb_(\d+)_(fwd|bwd)', op.name)
            if scope:
                k, m, part = int(scope[1]), int(scope[2]), scope[3]
                self.assertEqual(device, k, op.name)
                annotated[(k, m, part)] = annotated.get((k, m, part), 0) + 1
            variable = _VariableOfRead(op.inputs[0].op, handles)
            if variable is not None:
                self.assertEqual(device, cell_of[variable.ref()], op.name)
                parameters[device].add(variable.ref())
        # Forward: input and output; backward: incoming gradient, outgoing input gradient and
        # the cell's two weight gradients; of every cell and micro-batch.
        for k in range(K):
            for m in range(2):
                self.assertGreaterEqual(annotated.get((k, m, 'fwd'), 0), 2, (k, m))
                self.assertGreaterEqual(annotated.get((k, m, 'bwd'), 0), 4, (k, m))
            # Every parameter of cell k is read onto logical device k.
            self.assertEqual(parameters[k], {v.ref() for v in layer.cells[k].trainable_variables})

    @parameterized.parameters(('always', False), ('never', False), ('always', True))
    def testAnnotationsLeaveTheMathUnchanged(self, recompute, jit_compile):
        layer = _LogicalPipeline(recompute, num_micro_batches=4)
        x = tf.random.stateless_normal([BATCH, DIM], seed=[3, 4])
        step = _TrainStep(layer)
        if jit_compile:
            step = tf.function(step.python_function, jit_compile=True)
        outputs, grads = step(x)

        def Reference(inputs):
            return test_utils.Unpartitioned(layer, inputs)

        ref_outputs, ref_grads = test_utils.OutputsAndGrads(Reference, layer, x)
        self.assertLess(test_utils.MaxRelativeError(outputs, ref_outputs), 1e-5)
        self.assertLess(test_utils.MaxRelativeError(grads, ref_grads), 1e-5)

    def testUnderATpuStrategyCellKsVariablesAreCreatedOnLogicalDeviceK(self):
        with _LogicalDevicesOfNewVariables() as created:
            layer = _LogicalPipeline('always')
        for k, cell in enumerate(layer.cells):
            self.assertNotEmpty(cell.variables)
            for variable in cell.variables:
                self.assertEqual(created[variable.name], k, variable.name)

    def testTheAnnotationsReachXla(self):
        # The HLO that XLA compiles (here for the CPU; on a TPU, its partitioner places by
        # them) carries each annotation as a maximal sharding on its cell's logical device.
        layer = _LogicalPipeline('always')
        step = tf.function(_TrainStep(layer).python_function, jit_compile=True)
        hlo = step.experimental_get_compiler_ir(tf.zeros([BATCH, DIM]))(stage='hlo')
        per_device = {}
        for line in hlo.splitlines():
            sharding = re.search(r'sharding=\{maximal device=(\d+)\}', line)
            if not sharding:
                continue
            device = int(sharding[1])
            op_name = re.search(r'op_name="([^"]+)"', line)[1]
            self.assertRegex(op_name, rf'(^|/)cell_{device}_', line)
            per_device[device] = per_device.get(device, 0) + 1
        # Per cell at least: 2 parameters; per micro-batch (2) forward input and output,
        # backward incoming gradient, input gradient and 2 weight gradients.
        self.assertEqual(sorted(per_device), list(range(K)))
        self.assertTrue(all(n >= 2 + 2 * 6 for n in per_device.values()), per_device)

    @parameterized.parameters(('interleaved_1f1b', [0, 1, 2, 0, 1, 2]),
                              ('zero_bubble_v', [0, 1, 2, 2, 1, 0]))
    def testWithVirtualStagesEachCellIsOnItsDeviceInTheSchedule(self, kind, device_of_cell):
        # v = 2 cells per device: 2 K cells on K logical devices, placed as the schedule
        # places them (zero_bubble_v in a V), not cell k on logical device k.
        layers = [basic.DenseLayer.Params().Set(input_dim=DIM, output_dim=DIM,
                                                activation='tanh') for _ in range(2 * K)]
        with _LogicalDevicesOfNewVariables() as created:
            layer = pipelining_layer.PipeliningLayer.Params().Set(
                name='pipe', layer_tpl=layers, num_cells=K, virtual_stages=2,
                schedule=kind, num_micro_batches=K, recompute='always',
                input_shapes=[2 * K, DIM], logical_device_fn=tpu.ShardingAssign).Instantiate()
        for k, cell in enumerate(layer.cells):
            self.assertNotEmpty(cell.variables)
            for variable in cell.variables:
                self.assertEqual(created[variable.name], device_of_cell[k], variable.name)
        self.assertEqual([layer.plan.DeviceOf(k) for k in range(2 * K)], device_of_cell)
        x = tf.random.stateless_normal([2 * K, DIM], seed=[5, 6])

        def MeanSquare(y):
            return tf.reduce_mean(tf.square(y))

        @tf.function
        def Step(x):  # These schedules take the loss per micro-batch: FPropLoss.
            with tf.GradientTape() as tape, fprop_context.Scope(
                    training=True, step=tf.constant(0, tf.int64)):
                tape.watch(x)
                outputs, loss, _ = layer.FPropLoss(
                    layer.theta, x, lambda y, _: (MeanSquare(y), tf.constant(1.0)))
            return outputs, tape.gradient(loss, [x] + list(layer.trainable_variables))

        step = Step
        graph = step.get_concrete_function(x).graph
        annotated = set()
        for op in graph.get_operations():
            scope = re.search(r'cell_(\d+)_mb_\d+_', op.name)
            if op.type == 'XlaSharding' and scope:
                self.assertEqual(tpu.LogicalDeviceOf(op), device_of_cell[int(scope[1])],
                                 op.name)
                annotated.add(int(scope[1]))
        self.assertEqual(annotated, set(range(2 * K)))
        outputs, grads = step(x)
        ref_outputs, ref_grads = test_utils.OutputsAndGrads(
            lambda inputs: test_utils.Unpartitioned(layer, inputs), layer, x, MeanSquare)
        self.assertLess(test_utils.MaxRelativeError(outputs, ref_outputs), 1e-5)
        self.assertLess(test_utils.MaxRelativeError(grads, ref_grads), 1e-5)

    def testTheTrainersAssignNeedsATpuStrategyAndKeepsParamsText(self):
        layer = _LogicalPipeline('always', logical_device_fn=tpu.AssignToLogicalDevice)
        self.assertIn('logical_device_fn : callable/gpipe_tf.train.tpu/AssignToLogicalDevice',
                      layer.p.ToText())
        with self.assertRaisesRegex(ValueError, 'AssignToLogicalDevice runs inside a '
                                                'TPUStrategy .* in scope is '
                                                '_DefaultDistributionStrategy'):
            _TrainStep(layer).get_concrete_function(tf.zeros([BATCH, DIM]))

    def testErrors(self):
        layer = _LogicalPipeline('always')
        with self.assertRaisesRegex(ValueError, 'logical_device_fn annotates graph tensors; '
                                                'call the layer inside a tf.function'):
            with fprop_context.Scope(training=True, step=tf.constant(0, tf.int64)):
                layer(tf.zeros([BATCH, DIM]))
        with self.assertRaisesRegex(ValueError, 'num_replicas must be 1, got 2'):
            pipelining_layer.PipeliningLayer.Params().Set(
                name='pipe', layer_tpl=[basic.DenseLayer.Params().Set(input_dim=2, output_dim=2)],
                num_replicas=2, logical_device_fn=tpu.ShardingAssign).Instantiate()


class TrainerTpuProgramTest(tf.test.TestCase):
    """The trainer's TPU path asks the TPU for K logical devices per replica, also with v
    virtual stages (v K cells), and places the cells on them as the schedule does."""

    def testInterleavedCellsShareTheirDevicesCores(self):
        config = trainer.ParseConfig(['--model=examples.PipelinedMLP', '--tpu=grpc://tpu:8470',
                                      '--worker_split_size=2', '--schedule=interleaved_1f1b',
                                      '--virtual_stages=2'])
        p = setup.TaskParams(config)
        plan = plan_lib.MakePlan(p.model)
        self.assertEqual(plan.num_cells, 2 * plan.num_devices)
        with mock.patch.object(tpu, 'Connect', return_value=('resolver', 'topology')), \
                mock.patch.object(tpu, 'Strategy', return_value='strategy') as strategy, \
                mock.patch.object(program, 'StrategyProgram',
                                  side_effect=lambda p, logdir, strategy: p), \
                tempfile.TemporaryDirectory() as logdir:
            ran = setup.TpuProgram(config, setup.Target.Of(config), p, plan, logdir)
        strategy.assert_called_once_with('resolver', 'topology', plan.num_devices, 1)
        placed = plan_lib.MakePlan(ran.model)
        cores = tpu.CoreDevices(plan.num_devices)
        self.assertEqual(placed.devices, [cores[k % plan.num_devices]
                                          for k in range(plan.num_cells)])


class ConnectTest(tf.test.TestCase):
    """Addresses that fail before connecting. (Connecting changes the process's eager context
    for good, so the cases that get that far run in trainer subprocesses: test_trainer.py.)"""

    def testNothingListening(self):
        port = cluster_lib.FreePorts(1)[0]
        with self.assertRaisesRegex(tpu.TpuError, f'--tpu=grpc://127.0.0.1:{port}: no process '
                                                  'accepts connections there'):
            tpu.Connect(f'grpc://127.0.0.1:{port}')

    def testBadAddresses(self):
        with self.assertRaisesRegex(tpu.TpuError, 'expected grpc://host:port'):
            tpu.Connect('grpc://nohost')
        with self.assertRaisesRegex(tpu.TpuError, 'empty address'):
            tpu.Connect('')


if __name__ == '__main__':
    tf.test.main()
