"""Mixed precision (`fprop_dtype`): float32 variables, bfloat16 or float16 compute.

A bfloat16 pipeline computes what the same layers un-partitioned compute in bfloat16 (on the
same micro-batches), whatever the schedule, executor and graph mode; its gradients are near the
float32 pipeline's; its variables stay float32, the tensors crossing cells are bfloat16 and the
weight gradients are summed over micro-batches in float32 (which matters: a bfloat16 sum of 32
micro-batches is visibly off). float16 trains with dynamic loss scaling: an overflow skips the
update and halves the scale, finite steps apply and grow it. The memory planner counts
activations at half size; the trainer's --fprop_dtype trains and refuses a bad value in one
line.
"""

import os
import re
import shutil
import tempfile

import numpy as np
import pytest
import tensorflow as tf
from absl.testing import parameterized

from gpipe_tf import model_registry
from gpipe_tf import optimizer
from gpipe_tf import test_utils
from gpipe_tf.layers import base_layer
from gpipe_tf.layers import basic
from gpipe_tf.layers import fprop_context
from gpipe_tf.layers import normalization
from gpipe_tf.perf import memory
from gpipe_tf.pipeline import pipelining_layer
from gpipe_tf.pipeline import plan as plan_lib
from gpipe_tf.train import update

DEVICES = test_utils.ConfigureVirtualCpus()
PipeliningLayer = pipelining_layer.PipeliningLayer
BATCH, DIM, M = 16, 16, 4
# The same math in the same dtype (the pipeline against its layers un-partitioned on its
# micro-batches): only the order of float32 sums may differ.
TIGHT = 1e-5
# bfloat16 keeps 8 significant bits (relative rounding 2^-9); through 6 layers, forward and
# backward, the gradients were measured 1.1% from float32's.
BFLOAT16_TOLERANCE = 3e-2
MLP = 'examples.PipelinedMLP'


def Layers():
    """Three blocks of dense (tanh) and layer norm: 6 layers."""
    layers = []
    for _ in range(3):
        layers += [basic.DenseLayer.Params().Set(input_dim=DIM, output_dim=DIM,
                                                 activation='tanh'),
                   normalization.LayerNormLayer.Params().Set(input_dim=DIM)]
    return layers


def PipelineParams(fprop_dtype=tf.bfloat16, num_cells=3, **kwargs):
    return PipeliningLayer.Params().Set(
        name='pipe', layer_tpl=Layers(), num_cells=num_cells, num_micro_batches=M,
        fprop_dtype=fprop_dtype, input_shapes=[BATCH, DIM], devices=DEVICES[:num_cells],
        random_seed=5, **kwargs)


def Inputs():
    return tf.random.stateless_normal([BATCH, DIM], [7, 11])


def PerExampleLoss(y):
    """A fixed projection of each example's outputs (a plain sum of squares would be constant
    after layer norm), in float32."""
    projection = tf.random.stateless_normal([DIM], [3, 4])
    return tf.reduce_sum(tf.cast(y, tf.float32) * projection, axis=-1)


def LossOfMicroBatch(outputs, unused_loss_inputs):
    """FPropLoss's loss_fn: the mean over the micro-batch, weighted by its examples."""
    per_example = PerExampleLoss(outputs)
    return tf.reduce_mean(per_example), tf.cast(tf.size(per_example), tf.float32)


def OutputsAndGrads(layer, variables, x, loss_inside=False):
    """(outputs, d loss / d [x, variables...]) of the mean loss over the batch; `layer` is a
    PipeliningLayer (FPropLoss when `loss_inside`) or a function of x."""
    with tf.GradientTape() as tape:
        tape.watch(x)
        if loss_inside:
            y, loss, _ = layer.FPropLoss(layer.theta, x, LossOfMicroBatch)
        else:
            y = layer(x)
            loss = tf.reduce_mean(PerExampleLoss(y))
    return [y] + tape.gradient(loss, [x] + list(variables))


def UnpipelinedOnMicroBatches(pipeline_params, x, num_micro_batches=M):
    """(the un-partitioned model with the pipeline's fprop_dtype (`UnpipelinedParams`; the same
    initial weights), its outputs and gradients on `x` run one micro-batch at a time).

    In a tf.function, as the pipeline's cells run: on a CPU with bfloat16 units (AMX), graph
    optimization fuses a matmul with its bias and activation into one oneDNN kernel that rounds
    to bfloat16 once, where eager ops round after each (measured: outputs 3% apart).
    """
    model = PipeliningLayer.UnpipelinedParams(pipeline_params).Instantiate()
    fn = lambda x: tf.concat([model(part) for part in tf.split(x, num_micro_batches)], 0)
    return model, tf.function(lambda x: OutputsAndGrads(fn, model.trainable_variables, x),
                              autograph=False)(x)


class GradientsTest(tf.test.TestCase, parameterized.TestCase):
    """A bfloat16 pipeline computes its layers' bfloat16 math, near float32's."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.x = Inputs()
        p = PipelineParams()
        cls.model, cls.want = UnpipelinedOnMicroBatches(p, cls.x)

    def testPipelineMatchesTheUnpipelinedBfloat16Model(self):
        layer = PipelineParams().Instantiate()
        got = OutputsAndGrads(layer, layer.trainable_variables, self.x)
        self.assertEqual(got[0].dtype, tf.bfloat16)
        self.assertEqual(self.want[0].dtype, tf.bfloat16)
        self.assertLess(test_utils.MaxRelativeError(got, self.want), TIGHT)

    def testGradientsAreNearTheFloat32Pipelines(self):
        bfloat16 = PipelineParams().Instantiate()
        float32 = PipelineParams(fprop_dtype=None).Instantiate()
        got = OutputsAndGrads(bfloat16, bfloat16.trainable_variables, self.x)[1:]
        want = OutputsAndGrads(float32, float32.trainable_variables, self.x)[1:]
        error = test_utils.MaxRelativeError(got, want)
        self.assertLess(error, BFLOAT16_TOLERANCE)
        self.assertGreater(error, 1e-4)  # Else the pipeline did not compute in bfloat16.

    # Every schedule and both executors, across the three graph modes; the loop keeping its
    # activations (its residuals in bfloat16) too.
    @parameterized.parameters(
        ('gpipe', False, 'eager'), ('1f1b', True, 'eager'), ('1f1b', False, 'tf_function'),
        ('zero_bubble', True, 'tf_function'), ('interleaved_1f1b', True, 'v1'),
        ('gpipe', True, 'v1'), ('1f1b', False, 'tf_function', 'never'),
        ('zero_bubble', False, 'v1', 'never'))
    def testScheduleMatchesTheUnpipelinedBfloat16Model(self, kind, unroll, mode,
                                                        recompute='always'):
        num_cells = 2 if kind == 'interleaved_1f1b' else 3
        p = PipelineParams(num_cells=num_cells, schedule=kind, unroll=unroll, recompute=recompute,
                           virtual_stages=2 if kind == 'interleaved_1f1b' else 1)
        loss_inside = kind != 'gpipe'

        def Run(layer):
            return OutputsAndGrads(layer, layer.trainable_variables, tf.constant(self.x),
                                   loss_inside)

        if mode == 'v1':
            got = test_utils.RunV1(lambda: Run(p.Instantiate()))
        else:
            layer = p.Instantiate()
            got = (Run if mode == 'eager' else tf.function(Run, autograph=False))(layer)
        # FPropLoss's outputs pass no gradient, and are what the forward gave: compare them too.
        self.assertLess(test_utils.MaxRelativeError(got, self.want), TIGHT)


def CellCalls(graph, part: str) -> dict:
    """{(cell, micro-batch): the function-call op} of every `cell_<k>_mb_<m>_<part>` scope."""
    calls = {}
    for op in graph.get_operations():
        if op.type not in ('PartitionedCall', 'StatefulPartitionedCall'):
            continue
        for scope in op.name.split('/'):
            fields = scope.split('_')
            if (len(fields) == 5 and fields[0] == 'cell' and fields[2] == 'mb' and
                    fields[4] == part):
                calls[int(fields[1]), int(fields[3])] = op
    return calls


@pytest.mark.unit
class DtypesTest(tf.test.TestCase):
    """Variables in float32, cells' boundaries in bfloat16, gradient sums in float32."""

    def TrainGraph(self, **kwargs):
        layer = PipelineParams(**kwargs).Instantiate()
        step = tf.function(lambda x: OutputsAndGrads(layer, layer.trainable_variables, x),
                           autograph=False)
        return layer, step.get_concrete_function(tf.TensorSpec([BATCH, DIM])).graph

    def testVariablesStayFloat32(self):
        layer, _ = self.TrainGraph()
        self.assertLen(layer.variables, 12)
        for variable in layer.variables:
            self.assertEqual(variable.dtype, tf.float32, variable.name)

    def testTensorsCrossingCellsAreBfloat16(self):
        _, graph = self.TrainGraph()
        forwards = CellCalls(graph, 'fwd')
        self.assertLen(forwards, 3 * M)
        for (k, m), call in forwards.items():
            # The input (after the weights and seeds) and every output of a cell's forward.
            self.assertEqual(call.inputs[-3].dtype, tf.bfloat16, f'cell {k} input, mb {m}')
            self.assertEqual([t.dtype for t in call.outputs], [tf.bfloat16],
                             f'cell {k} outputs, mb {m}')
        backwards = CellCalls(graph, 'bwd')
        self.assertLen(backwards, 3 * M)
        for (k, m), call in backwards.items():
            # (d_theta per weight in float32, then d_inputs in bfloat16).
            self.assertEqual([t.dtype for t in call.outputs], [tf.float32] * 4 + [tf.bfloat16],
                             f'cell {k} backward, mb {m}')

    def testUnrolledGradientSumsAreFloat32(self):
        _, graph = self.TrainGraph()
        sums = [op for op in graph.get_operations() if '_grad_sum/' in op.name and
                op.type in ('AddV2', 'Add')]
        # Per cell, per weight (4), M - 1 additions.
        self.assertLen(sums, 3 * 4 * (M - 1))
        for op in sums:
            self.assertEqual(op.outputs[0].dtype, tf.float32, op.name)

    def testLoopedGradientSumsAreFloat32(self):
        _, graph = self.TrainGraph(unroll=False)
        loops = [op for op in graph.get_operations() if op.type in ('While', 'StatelessWhile')]
        self.assertLen(loops, 2)  # The forwards, then the backwards.
        # The backward loop's variables include per cell a sum per weight (the dense layer's
        # weight and bias, the layer norm's scale and bias), started from zeros of its dtype
        # (filled at run time: `unfolded`): a loop variable keeps its dtype.
        starts = [op for op in graph.get_operations()
                  if re.match(r'cell_\d+_sums(_\d+)?/', op.name) and op.type == 'Fill']
        self.assertLen(starts, 3 * 4)
        for op in starts:
            self.assertEqual(op.outputs[0].dtype, tf.float32, op.name)
            self.assertIn(op.outputs[0].name, [t.name for t in loops[1].inputs])


@pytest.mark.unit
class AccumulationTest(tf.test.TestCase, parameterized.TestCase):
    """M=32 micro-batch gradients, each exact in bfloat16, summed: in float32 the sum is exact;
    a bfloat16 running sum of the same values would be 0.6% off."""

    @parameterized.parameters(True, False)
    def testGradientSumIsFloat32(self, unroll):
        m = 32
        one = base_layer.WeightInit.Constant(1.0)
        layers = [basic.DenseLayer.Params().Set(input_dim=1, output_dim=1, has_bias=False,
                                                params_init=one) for _ in range(2)]
        p = PipeliningLayer.Params().Set(
            name='pipe', layer_tpl=layers, num_cells=2, num_micro_batches=m, unroll=unroll,
            fprop_dtype=tf.bfloat16, input_shapes=[m, 1], devices=DEVICES[:2])
        layer = p.Instantiate()
        # 1 + i / 64: exact in bfloat16, as are the products with the weights (1).
        x = tf.constant((1.0 + np.arange(m) / 64.0)[:, None], tf.float32)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.cast(layer(x), tf.float32))
        got = np.array([g.numpy()[0, 0] for g in tape.gradient(loss, layer.trainable_variables)])

        model = PipeliningLayer.UnpipelinedParams(p).Instantiate()
        per_micro_batch = []  # Each micro-batch's gradients alone, as the cells compute them.
        for part in tf.split(x, m):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.cast(model(part), tf.float32))
            per_micro_batch.append([g.numpy()[0, 0] for g in
                                    tape.gradient(loss, model.trainable_variables)])
        per_micro_batch = np.array(per_micro_batch, np.float64)
        exact = per_micro_batch.sum(0)
        in_bfloat16 = tf.zeros([2], tf.bfloat16)
        for grads in per_micro_batch:
            in_bfloat16 += tf.cast(grads, tf.bfloat16)
        in_bfloat16 = in_bfloat16.numpy().astype(np.float64)

        self.assertAllEqual(exact, [39.75, 39.75])
        self.assertAllClose(got, exact, rtol=1e-7, atol=0)
        self.assertGreater(np.abs(in_bfloat16 - exact).max() / exact.max(), 5e-3)


def MlpTask(fprop_dtype=None, schedule='gpipe', **loss_scale):
    """The registered MLP's task at batch 16, M=4, fprop_dtype, SGD (a step is
    -learning_rate x the gradient)."""
    p = model_registry.GetParams(MLP, 'Train')
    p.input.batch_size = BATCH
    p.model.Set(num_micro_batches=M, fprop_dtype=fprop_dtype, schedule=schedule)
    p.train.optimizer = optimizer.SGD.Params()
    p.train.loss_scale.Set(**loss_scale)
    return p


class _TaskStep:
    """A task, its SGD optimizer and global step, and one update (`update.Update`) run
    eagerly on the MLP's first batch, optionally with gradients made infinite."""

    def __init__(self, task_params):
        self.task = task_params.Instantiate()
        self.global_step = tf.Variable(0, dtype=tf.int64, trainable=False)
        self.optimizer = task_params.train.optimizer.Instantiate().Create(0.1)
        self.loss_scale = update.LossScaleFor(self.task)
        self.batch = next(iter(task_params.input.Instantiate().TrainDataset()))

    def Step(self, overflow=False, scale=True):
        step_scale = self.loss_scale.ForStep() if self.loss_scale and scale else None

        def Grads(loss, variables):
            grads = list(tape.gradient(loss, variables))
            if overflow:  # One infinite gradient entry, as a float16 overflow leaves.
                grads[0] = tf.tensor_scatter_nd_update(
                    grads[0], [[0] * grads[0].shape.rank], [np.inf])
            return grads

        with tf.GradientTape() as tape:
            with fprop_context.Scope(training=True, step=self.global_step,
                                     loss_scale=step_scale and step_scale.value):
                metrics = self.task.FPropTower(self.batch)
            _, metrics = update.Update(self.task, self.optimizer, self.global_step, metrics,
                                       Grads, step_scale)
        return metrics

    def Weights(self):
        return [v.numpy() for v in self.task.trainable_variables]


class LossScaleTest(tf.test.TestCase, parameterized.TestCase):
    """float16's dynamic loss scaling: skip and halve on overflow, apply and grow otherwise."""

    def testFloat16GetsALossScaleAndBfloat16None(self):
        self.assertIsNotNone(update.LossScaleFor(MlpTask(tf.float16).Instantiate()))
        self.assertIsNone(update.LossScaleFor(MlpTask(tf.bfloat16).Instantiate()))
        self.assertIsNone(update.LossScaleFor(MlpTask(None).Instantiate()))

    def testOverflowSkipsTheUpdateAndHalvesTheScale(self):
        run = _TaskStep(MlpTask(tf.float16, initial_scale=1024.0, growth_interval=2))
        run.Step()  # A finite step: one good step counted.
        self.assertEqual(int(run.loss_scale.good_steps.numpy()), 1)
        before = run.Weights()
        metrics = run.Step(overflow=True)
        for old, new in zip(before, run.Weights()):
            self.assertAllEqual(new, old)
        self.assertEqual(int(run.global_step.numpy()), 2)  # The skipped step counts.
        self.assertEqual(float(run.loss_scale.scale.numpy()), 512.0)
        self.assertEqual(int(run.loss_scale.good_steps.numpy()), 0)
        self.assertEqual(float(metrics.loss_scale[0]), 1024.0)  # The step's own scale.

    def testFiniteStepsApplyAndGrowTheScale(self):
        run = _TaskStep(MlpTask(tf.float16, initial_scale=1024.0, growth_interval=2))
        scales = []
        for _ in range(3):
            before = run.Weights()
            run.Step()
            changed = [not np.array_equal(old, new) for old, new in zip(before, run.Weights())]
            self.assertTrue(all(changed))
            scales.append(float(run.loss_scale.scale.numpy()))
        self.assertEqual(scales, [1024.0, 2048.0, 2048.0])
        self.assertEqual(int(run.global_step.numpy()), 3)

    @parameterized.parameters('gpipe', '1f1b')
    def testScaledStepEqualsTheUnscaledOne(self, schedule):
        # In float32 a power-of-two scale is exact: the update must be the same, whether the
        # loss is after the pipeline (gpipe) or inside it (1f1b, FPropLoss).
        scaled = _TaskStep(MlpTask(None, schedule))
        scaled.loss_scale = MlpTask().train.loss_scale.Set(initial_scale=2.0**12).Instantiate()
        plain = _TaskStep(MlpTask(None, schedule))
        scaled.Step()
        plain.Step()
        self.assertLess(test_utils.MaxRelativeError(scaled.Weights(), plain.Weights()), 1e-6)

    @parameterized.parameters('gpipe', '1f1b')
    def testScalingKeepsFloat16GradientsFromUnderflowing(self, schedule):
        tiny = 2.0 ** -30  # The loss's gradients are far below float16's smallest (2^-24).
        x = Inputs()

        def TinyLoss(outputs, loss_inputs):
            value, weight = LossOfMicroBatch(outputs, loss_inputs)
            return tiny * value, weight

        def Grads(fprop_dtype, loss_scale):
            # As a trainer's step: the loss times the scale, the gradients divided by it.
            layer = PipelineParams(fprop_dtype, schedule=schedule).Instantiate()
            with tf.GradientTape() as tape:
                with fprop_context.Scope(loss_scale=loss_scale):
                    if schedule == 'gpipe':
                        loss = tiny * tf.reduce_mean(PerExampleLoss(layer(x)))
                    else:
                        _, loss, _ = layer.FPropLoss(layer.theta, x, TinyLoss)
                loss *= loss_scale or 1.0
            return [g / (loss_scale or 1.0) / tiny
                    for g in tape.gradient(loss, layer.trainable_variables)]

        want = Grads(None, None)
        unscaled = Grads(tf.float16, None)
        scaled = Grads(tf.float16, 2.0 ** 24)
        self.assertLess(test_utils.MaxRelativeError(scaled, want), 1e-2)
        self.assertGreater(test_utils.MaxRelativeError(unscaled, want), 0.5)


@pytest.mark.unit
class MemoryPlanTest(tf.test.TestCase):
    """The planner counts activations and cell boundaries in fprop_dtype, weights in dtype."""

    def testBfloat16HalvesActivationsNotWeights(self):
        float32 = memory.PlanMemory(PipelineParams(fprop_dtype=None), slots_per_param=2)
        bfloat16 = memory.PlanMemory(PipelineParams(), slots_per_param=2)
        for c32, c16 in zip(float32.cells, bfloat16.cells):
            self.assertEqual((c16.params, c16.gradients, c16.slots),
                             (c32.params, c32.gradients, c32.slots))
            self.assertGreater(c32.stored_activations, 0)
            self.assertEqual(2 * c16.stored_activations, c32.stored_activations)
        self.assertEqual(2 * bfloat16.input_bytes, float32.input_bytes)

    def testOneCellOneMicroBatchByHand(self):
        # 4 dense layers of 512x512 (+ bias) on 1024 rows: a layer's output is 1 MiB in
        # bfloat16; the weights, 4 x (512 x 512 + 512) float32s, a little over 4 MiB.
        mib = 2**20
        layers = [basic.DenseLayer.Params().Set(input_dim=512, output_dim=512)
                  for _ in range(4)]
        p = PipeliningLayer.Params().Set(name='pipe', layer_tpl=layers, num_micro_batches=1,
                                         fprop_dtype=tf.bfloat16, input_shapes=[1024, 512])
        plan = memory.PlanMemory(p, slots_per_param=2)
        cell = plan.cells[0]
        params = 4 * (512 * 512 + 512) * 4
        self.assertEqual((cell.params, cell.slots, cell.gradients), (params, 2 * params, 0))
        # The input (cast) and the output, 1 MiB each.
        self.assertEqual(cell.stored_activations, 2 * mib)
        # The first backward holds the larger of the 4 recomputed outputs (4 MiB) and the
        # weights' gradients (float32, a little more), two activation gradients (2 MiB) and
        # the weights cast to bfloat16 (half of theirs).
        self.assertEqual(cell.working_activations, max(4 * mib, params) + 2 * mib + params // 2)
        # The cast input is a copy: nothing of the step's peak existed before it but the weights.
        self.assertEqual(plan.step_bytes, plan.shared_peak_bytes - params)

    def testLayerMetasCountActivationsAtTheComputeDtype(self):
        plan = plan_lib.Cells(PipelineParams())[1]
        plan32 = plan_lib.Cells(PipelineParams(fprop_dtype=None))[1]
        for meta, meta32 in zip(plan, plan32):
            self.assertEqual(2 * meta.activation_bytes, meta32.activation_bytes)
            self.assertEqual(meta.num_params, meta32.num_params)


class TrainerTest(tf.test.TestCase):
    """--fprop_dtype trains in the trainer; a bad value is one line."""

    def setUp(self):
        super().setUp()
        self.logdir = tempfile.mkdtemp(prefix='mixed_precision_')
        self.addCleanup(shutil.rmtree, self.logdir, ignore_errors=True)

    def Train(self, *flags, logdir=None, overrides=''):
        return test_utils.TrainerInProcess(
            f'--model={MLP}', f'--logdir={logdir or self.logdir}', '--max_steps=30',
            '--model_params_override=train.summary_interval_steps : 1; '
            f'train.plot_pipeline : False; {overrides}', *flags)

    def Losses(self, logdir=None):
        return test_utils.EventScalars(os.path.join(logdir or self.logdir, 'train'), 'loss')

    def testBfloat16Trains(self):
        result = self.Train('--fprop_dtype=bfloat16')
        self.assertIn('computing in bfloat16', result.stdout)
        with open(os.path.join(self.logdir, 'params.txt')) as f:
            self.assertIn('model.fprop_dtype : bfloat16', f.read())
        losses = self.Losses()
        float32_logdir = os.path.join(self.logdir, 'float32')
        self.Train(logdir=float32_logdir)
        float32 = self.Losses(float32_logdir)
        self.assertEqual(sorted(losses), list(range(1, 31)))
        mean = lambda run, steps: np.mean([run[s] for s in steps])
        first, last = range(1, 6), range(26, 31)
        self.assertLess(mean(losses, last), 0.8 * mean(losses, first))
        # The float32 run's: the first step to bfloat16's rounding, then the runs drift apart
        # (measured: 6% at most by step 30, 1% on the last five's mean).
        self.assertAllClose(losses[1], float32[1], rtol=1e-2)
        self.assertAllClose(mean(losses, last), mean(float32, last), rtol=5e-2)
        reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(
            os.path.join(self.logdir, 'train')))
        self.assertEqual(reader.get_variable_to_dtype_map()[
            'task/_layer_children/model/_layer_children/dense_0/_layer_vars/w/'
            '.ATTRIBUTES/VARIABLE_VALUE'], tf.float32)
        self.assertNotIn('loss_scale/scale/.ATTRIBUTES/VARIABLE_VALUE',
                         reader.get_variable_to_dtype_map())

    def testFloat16KeepsItsLossScaleInTheCheckpoint(self):
        def Saved():
            reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(
                os.path.join(self.logdir, 'train')))
            return [reader.get_tensor(f'loss_scale/{name}/.ATTRIBUTES/VARIABLE_VALUE')
                    for name in ('scale', 'good_steps')]

        growth = 'train.loss_scale.growth_interval : 10'
        result = self.Train('--fprop_dtype=float16', '--graph_mode=v1', overrides=growth)
        self.assertIn('computing in float16', result.stdout)
        # 30 finite steps: the scale doubled three times from 2^15.
        self.assertEqual(Saved(), [2.0 ** 18, 0])
        # Resumed (in the tf.function program), it goes on from the saved scale.
        test_utils.TrainerInProcess(
            f'--model={MLP}', f'--logdir={self.logdir}', '--max_steps=35',
            '--fprop_dtype=float16', '--model_params_override=train.summary_interval_steps : '
            f'1; train.plot_pipeline : False; {growth}')
        self.assertEqual(Saved(), [2.0 ** 18, 5])
        self.assertEqual(sorted(self.Losses()), list(range(1, 36)))

    def testAFloat32CheckpointResumesInFloat16(self):
        # The float32 run's checkpoint has no loss scale; float16 starts one at 2^15, in either
        # program (the v1 graph one initialises what the checkpoint lacks).
        self.Train()
        for mode in ('v1', 'tf_function'):
            logdir = os.path.join(self.logdir, mode)
            shutil.copytree(os.path.join(self.logdir, 'train'), os.path.join(logdir, 'train'))
            test_utils.TrainerInProcess(
                f'--model={MLP}', f'--logdir={logdir}', '--max_steps=32',
                '--fprop_dtype=float16', f'--graph_mode={mode}',
                '--model_params_override=train.plot_pipeline : False')
            reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(
                os.path.join(logdir, 'train')))
            self.assertEqual(reader.get_tensor('global_step/.ATTRIBUTES/VARIABLE_VALUE'), 32)
            self.assertEqual(
                reader.get_tensor('loss_scale/scale/.ATTRIBUTES/VARIABLE_VALUE'), 2.0 ** 15)
            self.assertEqual(
                reader.get_tensor('loss_scale/good_steps/.ATTRIBUTES/VARIABLE_VALUE'), 2)

    def testABadValueIsOneLine(self):
        result = test_utils.TrainerInProcess(f'--model={MLP}', '--fprop_dtype=int8',
                                             f'--logdir={self.logdir}', check=False)
        self.assertEqual(result.returncode, 2)
        self.assertEqual(len(result.stderr.strip().splitlines()), 1, result.stderr)
        self.assertRegex(result.stderr, r'^error: .*fprop_dtype.*bfloat16')
        self.assertNotIn('Traceback', result.stderr)


if __name__ == '__main__':
    tf.test.main()
