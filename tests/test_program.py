"""The training programs (`gpipe_tf.train.program`), in process, on a small PipelinedMLP (4 cells,
2 micro-batches of 8): `LatestStep` reads the latest checkpoint's step (0 when none reads); the
`tf.function` program (`EagerProgram`) lowers the loss of a fixed batch, each step reporting the
loss of the un-partitioned network computed by hand; `Save` writes the step's checkpoint and
`Restore` into a fresh program (latest or a given path) resumes with the same variables, optimizer
slots and batches; `TracedStep` is the very step `Step` would run, with every cell's
micro-batches in its trace, or the reason there is none; the learning rate follows the schedule
at the global step; the v1 graph program (`GraphProgram`) starts from the same weights and trains
to the same losses as the `tf.function` program, restores its own and the eager program's
checkpoints, and refuses for training a checkpoint of another step than its input starts at; and
a checkpoint of another model raises `CheckpointMismatchError` in both."""

import os
import shutil
import tempfile

import numpy as np
import pytest
import tensorflow as tf

from gpipe_tf import errors
from gpipe_tf import learning_rate
from gpipe_tf import model_registry
from gpipe_tf import optimizer
from gpipe_tf import test_utils
from gpipe_tf.layers import basic
from gpipe_tf.perf import trace
from gpipe_tf.train import cluster as cluster_lib
from gpipe_tf.train import program

DEVICES = test_utils.ConfigureVirtualCpus()
MLP = 'examples.PipelinedMLP'  # 16 -> 64 -> 64 -> 64 -> 10, ReLU, over 4 cells.
NUM_CELLS = 4
NUM_MICRO_BATCHES = 2
BATCH = 16
BASE_RATE = 1e-2
SCHEDULE = learning_rate.ExponentialDecay.Params().Set(decay_rate=0.5, decay_steps=2)
# The graph-versus-eager recipe: every part of the update in use.
GRAPH_RECIPE = dict(optimizer=optimizer.Momentum.Params(), clip_gradient_norm_to_value=0.5,
                    weight_decay=1e-3, lr_schedule=SCHEDULE)


def _Params(fixed_batch=False, **train):
    """PipelinedMLP with batches of BATCH in NUM_MICRO_BATCHES micro-batches; with
    `fixed_batch`, every training batch is the same BATCH examples in the same order."""
    p = model_registry.GetParams(MLP, 'Train')
    p.input.batch_size = BATCH
    p.model.num_micro_batches = NUM_MICRO_BATCHES
    if fixed_batch:
        p.input.Set(num_examples=BATCH, shuffle=False)
    p.train.Set(learning_rate=BASE_RATE, **train)
    return p


def _AnotherModelsParams(**train):
    """The MLP with one more layer: every variable of _Params is there, and one more."""
    p = _Params(**train)
    p.model.layer_tpl.append(basic.DenseLayer.Params().Set(name='dense_4', input_dim=10,
                                                           output_dim=10))
    p.model.partition_method = [0, 1, 2, 3, 5]  # The other layers stay in their cells.
    return p


def _WiderModelsParams(**train):
    """The MLP with its middle layer 32 wide: the same variables, two of other shapes."""
    p = _Params(**train)
    p.model.layer_tpl[1].output_dim = 32
    p.model.layer_tpl[2].input_dim = 32
    return p


def _TempDir(test_case_or_class):
    path = tempfile.mkdtemp(prefix='program_test_')
    if isinstance(test_case_or_class, type):
        test_case_or_class.addClassCleanup(shutil.rmtree, path, ignore_errors=True)
    else:
        test_case_or_class.addCleanup(shutil.rmtree, path, ignore_errors=True)
    return path


def _Weights(prog) -> dict:
    """{variable name: value} of the program's trainable variables."""
    variables = prog.task.trainable_variables
    if isinstance(prog, program.GraphProgram):
        values = prog.session.run(list(variables))
    else:
        values = [v.numpy() for v in variables]
    return {v.name: value for v, value in zip(variables, values)}


def _GraphVariables(prog) -> dict:
    """{name: value} of every variable of a GraphProgram's graph (optimizer slots included)."""
    with prog.graph.as_default():
        variables = tf.compat.v1.global_variables()
    return dict(zip([v.name for v in variables], prog.session.run(variables)))


def _OracleLoss(weights: dict, batch) -> float:
    """The weighted mean cross-entropy of the MLP run un-partitioned on `batch`, by hand in
    float64."""
    by_layer = {'/'.join(name.split(':')[0].split('/')[-2:]): np.asarray(value, np.float64)
                for name, value in weights.items()}
    x = batch['images'].numpy().reshape(BATCH, -1).astype(np.float64)
    for i in range(NUM_CELLS):
        x = x @ by_layer[f'dense_{i}/w'] + by_layer[f'dense_{i}/b']
        if i < NUM_CELLS - 1:
            x = np.maximum(x, 0.0)
    shifted = x - x.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    labels, weights = batch['labels'].numpy(), batch['weights'].numpy()
    return float(-(weights * log_probs[np.arange(BATCH), labels]).sum() / weights.sum())


class ProgramTestCase(tf.test.TestCase):

    def AssertWeightsEqual(self, got: dict, expected: dict, rtol=0.0, what=''):
        self.assertCountEqual(got, expected)
        for name, value in expected.items():
            if rtol:
                self.assertAllClose(got[name], value, rtol=rtol, atol=1e-7, msg=f'{name} {what}')
            else:
                self.assertAllEqual(got[name], value, msg=f'{name} {what}')

    def AssertMetricsClose(self, got: dict, expected: dict, rtol=1e-6, what=''):
        self.assertCountEqual(got, expected)
        for name, value in expected.items():
            self.assertAllClose(got[name], value, rtol=rtol, msg=f'{name} {what}')

    def AssertTracesEveryCellsMicroBatches(self, step_trace):
        self.assertIsNone(step_trace.error)
        ran = {trace.ClassifyOp(event.name) for event in step_trace.events} - {None}
        for kind in ('forward', 'backward'):
            self.assertEqual({(cell, micro_batch) for cell, micro_batch, k in ran if k == kind},
                             {(cell, micro_batch) for cell in range(NUM_CELLS)
                              for micro_batch in range(NUM_MICRO_BATCHES)}, kind)


# ---- LatestStep ---------------------------------------------------------------------------------
@pytest.mark.unit
class LatestStepTest(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        self.logdir = _TempDir(self)

    def _Save(self, *steps):
        global_step = tf.Variable(0, dtype=tf.int64)
        manager = tf.train.CheckpointManager(tf.train.Checkpoint(global_step=global_step),
                                             program.CheckpointDir(self.logdir), max_to_keep=5)
        for step in steps:
            global_step.assign(step)
            manager.save(checkpoint_number=step)

    def testNoCheckpointIsStepZero(self):
        self.assertEqual(program.LatestStep(self.logdir), 0)
        self.assertEqual(program.LatestStep(os.path.join(self.logdir, 'missing')), 0)

    def testTheLatestCheckpointsGlobalStep(self):
        self.assertEqual(program.CheckpointDir(self.logdir), os.path.join(self.logdir, 'train'))
        self._Save(3, 7)
        self.assertEqual(program.LatestStep(self.logdir), 7)

    def testALatestCheckpointThatDoesNotReadCountsAsNone(self):
        self._Save(3, 7)
        test_utils.DamageFile(os.path.join(program.CheckpointDir(self.logdir), 'ckpt-7.index'),
                              'truncate')
        self.assertEqual(program.LatestStep(self.logdir), 0)

    def testADamagedIndexCountsAsNone(self):
        self._Save(3, 7)
        test_utils.DamageFile(os.path.join(program.CheckpointDir(self.logdir), 'checkpoint'),
                              'garble')
        self.assertEqual(program.LatestStep(self.logdir), 0)


@pytest.mark.unit
class WritingCheckpointTest(tf.test.TestCase):
    """A failed checkpoint write is the disk's fault (CheckpointWriteError) unless a task of the
    cluster is gone: then it is that task's ClusterError, as for a failed step."""

    FAILED = tf.errors.InternalError(None, None, 'Graph execution error:\n\nsomething failed')

    def _Write(self, error, cluster=None):
        with program._WritingCheckpoint('/logdir/train', 4, cluster):
            raise error

    def testAFullDiskNamesTheStepAndTheReason(self):
        full = tf.errors.ResourceExhaustedError(None, None, 'No space left on device')
        with self.assertRaisesRegex(program.CheckpointWriteError,
                                    r'^could not write the checkpoint of step 4 in /logdir/train: '
                                    r'No space left on device\. The checkpoints written before'):
            self._Write(full)
        with self.assertRaisesRegex(program.CheckpointWriteError, r'/logdir/train: something '
                                    r'failed\.'):
            self._Write(self.FAILED)

    def testTheClustersOwnFailuresPassThrough(self):
        with self.assertRaises(tf.errors.UnavailableError):
            self._Write(tf.errors.UnavailableError(None, None, 'Socket closed'))

    def testAWriteThatFailedWhileATaskIsGoneNamesTheTask(self):
        port, = cluster_lib.FreePorts(1)  # Nothing listens there.
        cluster = tf.train.ClusterSpec({'worker': [f'127.0.0.1:{port}']})
        with self.assertRaisesRegex(cluster_lib.ClusterError, rf'^Unreachable: /job:worker/task:0 '
                                    rf'at 127\.0\.0\.1:{port}: no process accepts connections'):
            self._Write(self.FAILED, cluster)


# ---- EagerProgram -------------------------------------------------------------------------------
class EagerProgramTest(ProgramTestCase):
    """Against one reference run: 6 steps, saved at steps 2 and 4."""

    SAVE_STEPS = (2, 4)
    NUM_STEPS = 6

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.logdir = _TempDir(cls)
        prog = program.EagerProgram(_Params(lr_schedule=SCHEDULE), cls.logdir)
        cls.start_step = prog.Restore()
        cls.start_rate = prog.LearningRate()
        cls.weights, cls.metrics, cls.saved = {0: _Weights(prog)}, {}, {}
        for step in range(1, cls.NUM_STEPS + 1):
            cls.metrics[step] = prog.Step()
            cls.weights[step] = _Weights(prog)
            if step in cls.SAVE_STEPS:
                cls.saved[step] = prog.Save()
        cls.end_step, cls.end_rate = prog.CurrentStep(), prog.LearningRate()

    def _Fresh(self, params=None):
        return program.EagerProgram(params or _Params(lr_schedule=SCHEDULE), self.logdir)

    def testAFreshLogdirStartsAtStepZero(self):
        self.assertEqual(self.start_step, 0)

    def testSaveWritesTheCheckpointOfTheCurrentStep(self):
        for step, path in self.saved.items():
            self.assertEqual(path, os.path.join(program.CheckpointDir(self.logdir), f'ckpt-{step}'))
            self.assertEqual(tf.train.load_checkpoint(path).get_tensor(program.STEP_KEY), step)
        self.assertEqual(program.LatestStep(self.logdir), 4)

    def testAFreshProgramRestoresTheLatestAndContinuesAsTheFirstDid(self):
        prog = self._Fresh()
        self.assertEqual(prog.Restore(), 4)
        self.assertEqual(prog.CurrentStep(), 4)
        self.AssertWeightsEqual(_Weights(prog), self.weights[4])
        # Same weights, optimizer slots and batch: the same step 5.
        self.AssertMetricsClose(prog.Step(), self.metrics[5], what='at step 5')
        self.AssertWeightsEqual(_Weights(prog), self.weights[5], rtol=1e-6, what='after step 5')

    def testRestoreOfAnOlderCheckpointResumesWithItsBatches(self):
        prog = self._Fresh()
        self.assertEqual(prog.Restore(path=self.saved[2]), 2)
        self.AssertWeightsEqual(_Weights(prog), self.weights[2])
        for step in (3, 4):
            self.AssertMetricsClose(prog.Step(), self.metrics[step], what=f'at step {step}')
        self.AssertWeightsEqual(_Weights(prog), self.weights[4], rtol=1e-6, what='after step 4')

    def testTracedStepIsTheStepThatStepWouldRun(self):
        prog = self._Fresh()
        prog.Restore()
        metrics, step_trace = prog.TracedStep()
        self.AssertMetricsClose(metrics, self.metrics[5], what='at step 5')
        self.AssertWeightsEqual(_Weights(prog), self.weights[5], rtol=1e-6, what='after step 5')
        self.AssertTracesEveryCellsMicroBatches(step_trace)

    def testWithAnotherProfilerRunningTheTracedStepRunsUntracedAndSaysWhy(self):
        prog = self._Fresh()
        prog.Restore()
        profile_dir = _TempDir(self)
        tf.profiler.experimental.start(profile_dir)
        try:
            metrics, step_trace = prog.TracedStep()
        finally:
            tf.profiler.experimental.stop()
        self.assertIsNone(step_trace.events)
        self.assertIsInstance(step_trace.error, Exception)
        self.AssertMetricsClose(metrics, self.metrics[5], what='at step 5')
        self.assertEqual(prog.CurrentStep(), 5)

    def testLearningRateFollowsTheScheduleAtTheGlobalStep(self):
        self.assertAllClose(self.start_rate, BASE_RATE)
        self.assertEqual(self.end_step, 6)
        self.assertAllClose(self.end_rate, BASE_RATE * 0.5 ** 3)  # Decays every 2 steps.

    def testACheckpointOfAnotherModelRaisesCheckpointMismatchError(self):
        prog = self._Fresh(_AnotherModelsParams(lr_schedule=SCHEDULE))
        with self.assertRaisesRegex(program.CheckpointMismatchError,
                                    f'checkpoint {self.saved[4]} does not fit the model being '
                                    'built .*another model') as raised:
            prog.Restore()
        self.assertIsInstance(raised.exception, errors.UserError)

    def testACheckpointWithVariablesOfOtherShapesRaisesCheckpointMismatchError(self):
        prog = self._Fresh(_WiderModelsParams(lr_schedule=SCHEDULE))
        with self.assertRaisesRegex(program.CheckpointMismatchError,
                                    f'checkpoint {self.saved[4]} does not fit the model being '
                                    'built .*another model'):
            prog.Restore()


class EagerProgramOnAFixedBatchTest(ProgramTestCase):

    def testEachStepReportsTheBatchsLossAndLowersIt(self):
        params = _Params(fixed_batch=True)
        batch = next(iter(params.input.Instantiate().TrainDataset()))
        prog = program.EagerProgram(params, _TempDir(self))
        prog.Restore()
        losses = []
        for step in range(1, 5):
            losses.append(_OracleLoss(_Weights(prog), batch))
            self.assertAllClose(prog.Step()['loss'], losses[-1], rtol=1e-5, msg=f'step {step}')
        losses.append(_OracleLoss(_Weights(prog), batch))
        for step, (before, after) in enumerate(zip(losses[:-1], losses[1:]), 1):
            self.assertLess(after, before, f'step {step}')


# ---- GraphProgram -------------------------------------------------------------------------------
class GraphProgramTest(ProgramTestCase):
    """A GraphProgram's 3 steps, saved at 3, against an EagerProgram's 5 steps, saved at 3,
    with GRAPH_RECIPE."""

    GRAPH_STEPS = 3
    EAGER_STEPS = 5

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.eager_dir, cls.graph_dir = _TempDir(cls), _TempDir(cls)
        eager = program.EagerProgram(_Params(**GRAPH_RECIPE), cls.eager_dir)
        eager.Restore()
        cls.eager_weights, cls.eager_metrics = {0: _Weights(eager)}, {}
        cls.eager_rates = {0: eager.LearningRate()}
        for step in range(1, cls.EAGER_STEPS + 1):
            cls.eager_metrics[step] = eager.Step()
            cls.eager_weights[step] = _Weights(eager)
            cls.eager_rates[step] = eager.LearningRate()
            if step == cls.GRAPH_STEPS:
                eager.Save()

        graph = program.GraphProgram(_Params(**GRAPH_RECIPE), cls.graph_dir)
        cls.graph_start_step = graph.Restore()
        cls.graph_weights, cls.graph_metrics = {0: _Weights(graph)}, {}
        for step in range(1, cls.GRAPH_STEPS + 1):
            cls.graph_metrics[step] = graph.Step()
            cls.graph_weights[step] = _Weights(graph)
        cls.graph_saved = graph.Save()
        cls.graph_variables = _GraphVariables(graph)
        cls.graph_end_step, cls.graph_end_rate = graph.CurrentStep(), graph.LearningRate()

    def _Fresh(self, logdir, params=None):
        return program.GraphProgram(params or _Params(**GRAPH_RECIPE), logdir)

    def testStartsFromTheSameWeightsAndTrainsToTheSameLossesAsTheEagerProgram(self):
        self.assertEqual(self.graph_start_step, 0)
        self.AssertWeightsEqual(self.graph_weights[0], self.eager_weights[0])
        for step in range(1, self.GRAPH_STEPS + 1):
            self.AssertMetricsClose(self.graph_metrics[step], self.eager_metrics[step],
                                    rtol=1e-5, what=f'at step {step}')
            self.AssertWeightsEqual(self.graph_weights[step], self.eager_weights[step],
                                    rtol=1e-5, what=f'after step {step}')

    def testLearningRateAndCurrentStepFollowTheGlobalStep(self):
        self.assertEqual(self.graph_end_step, 3)
        self.assertAllClose(self.graph_end_rate, BASE_RATE * 0.5)
        self.assertAllClose(self.graph_end_rate, self.eager_rates[3])

    def testSaveThenRestoreIntoAFreshGraphProgram(self):
        self.assertEqual(self.graph_saved,
                         os.path.join(program.CheckpointDir(self.graph_dir), 'ckpt-3'))
        prog = self._Fresh(self.graph_dir)
        self.assertEqual(prog.Restore(), 3)
        restored = _GraphVariables(prog)
        self.assertTrue(any('Momentum' in name for name in restored))  # Slots are compared.
        self.AssertWeightsEqual(restored, self.graph_variables)
        # Step 4 from the saved weights and slots, on batch 4, is the eager program's step 4.
        self.AssertMetricsClose(prog.Step(), self.eager_metrics[4], rtol=1e-5, what='at step 4')
        self.AssertWeightsEqual(_Weights(prog), self.eager_weights[4], rtol=1e-5,
                                what='after step 4')

    def testAnEagerCheckpointRestoresInAGraphProgram(self):
        prog = self._Fresh(self.eager_dir)
        self.assertEqual(prog.Restore(), 3)
        self.AssertWeightsEqual(_Weights(prog), self.eager_weights[3])
        # The eager program's Momentum slots came along: step 4 is the eager program's.
        self.AssertMetricsClose(prog.Step(), self.eager_metrics[4], rtol=1e-5, what='at step 4')
        self.AssertWeightsEqual(_Weights(prog), self.eager_weights[4], rtol=1e-5,
                                what='after step 4')

    def testTracedStepIsTheStepThatStepWouldRun(self):
        prog = self._Fresh(self.graph_dir)
        prog.Restore()
        metrics, step_trace = prog.TracedStep()
        self.AssertMetricsClose(metrics, self.eager_metrics[4], rtol=1e-5, what='at step 4')
        self.AssertWeightsEqual(_Weights(prog), self.eager_weights[4], rtol=1e-5,
                                what='after step 4')
        self.AssertTracesEveryCellsMicroBatches(step_trace)

    def testACheckpointOfAnotherStepThanTheInputStartsAtIsRefusedForTraining(self):
        prog = self._Fresh(_TempDir(self))  # No checkpoint: its input starts at step 0.
        with self.assertRaisesRegex(RuntimeError, r'Checkpoint step 3 differs from the step the '
                                    r'input was built for \(0\)'):
            prog.Restore(path=self.graph_saved)
        # Evaluation and decoding read no training data.
        self.assertEqual(prog.Restore(training=False, path=self.graph_saved), 3)
        self.AssertWeightsEqual(_Weights(prog), self.graph_weights[3])

    def testACheckpointOfAnotherModelRaisesCheckpointMismatchError(self):
        prog = self._Fresh(self.graph_dir, _AnotherModelsParams(**GRAPH_RECIPE))
        with self.assertRaisesRegex(program.CheckpointMismatchError,
                                    f'checkpoint {self.graph_saved} does not fit the model being '
                                    'built .*another model') as raised:
            prog.Restore()
        self.assertIsInstance(raised.exception, errors.UserError)

    def testACheckpointWithVariablesOfOtherShapesRaisesCheckpointMismatchError(self):
        # A v1 restore would assign the other shapes silently; the step then failed deep in
        # the pipeline's backward.
        prog = self._Fresh(self.graph_dir, _WiderModelsParams(**GRAPH_RECIPE))
        with self.assertRaisesRegex(program.CheckpointMismatchError,
                                    r'dense_1/w has shape \[64, 64\] in the checkpoint, '
                                    r'\[64, 32\] in the model'):
            prog.Restore()


if __name__ == '__main__':
    tf.test.main()
