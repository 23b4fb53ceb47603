"""The trainer's strategy program (its TPU path) on CPUs: a MirroredStrategy of R replicas,
each running the whole pipeline with its cells assigned to logical devices by XLA sharding
annotations, trains like one pipeline on the whole batch, and checkpoints and evaluates."""

import shutil
import tempfile

import tensorflow as tf

from gpipe_tf import model_registry
from gpipe_tf import test_utils
from gpipe_tf.layers import basic
from gpipe_tf.layers import normalization
from gpipe_tf.tasks import base_task
from gpipe_tf.train import program
from gpipe_tf.train import tpu

DEVICES = test_utils.ConfigureVirtualCpus()
STEPS = 6
CLIP = 0.25  # Below the gradient norms of both models' first steps.
# One strategy for the process, as in the trainer: MirroredStrategy's collective all-reduces
# of two strategies over the same devices share instance keys.
STRATEGY = tf.distribute.MirroredStrategy(DEVICES[:2])


def _TaskParams(logical: bool, batch_norm: bool = False, model: str = 'examples.PipelinedMLP',
                dropout: bool = False):
    p = model_registry.GetParams(model, 'Train')
    p.model.num_cells = 2
    p.model.num_micro_batches = 4
    # Clipping is on, so the gradient the replicas combine must be the whole batch's before it.
    p.train.clip_gradient_norm_to_value = CLIP
    if batch_norm:
        p.model.layer_tpl.insert(1, normalization.BatchNormLayer.Params().Set(name='bn', dim=64))
        p.model.partition_method = [0, 2, 5]  # The same cells in every run.
    if dropout:  # Each replica draws its examples' masks: those of one pipeline.
        p.model.layer_tpl.insert(2, basic.DropoutLayer.Params().Set(name='dropout',
                                                                    keep_prob=0.5))
    if logical:
        p.model.logical_device_fn = tpu.ShardingAssign
    else:
        p.model.devices = DEVICES[:2]
    return base_task.SyncInputShapes(p)


class StrategyProgramTest(tf.test.TestCase):

    def LogDir(self):
        path = tempfile.mkdtemp(prefix='strategy_test_')
        self.addCleanup(shutil.rmtree, path, ignore_errors=True)
        return path

    def Metrics(self, prog, steps=STEPS):
        prog.Restore()
        return [prog.Step() for _ in range(steps)]

    def Losses(self, prog, steps=STEPS):
        return [metrics['loss'] for metrics in self.Metrics(prog, steps)]

    def AssertTrainsLikeOnePipeline(self, model, dropout=False):
        reference = self.Metrics(program.EagerProgram(
            _TaskParams(False, model=model, dropout=dropout), self.LogDir()))
        prog = program.StrategyProgram(_TaskParams(True, model=model, dropout=dropout),
                                       self.LogDir(), STRATEGY)
        metrics = self.Metrics(prog)
        self.assertEqual(prog.CurrentStep(), STEPS)
        for name in ('loss', 'accuracy', 'grad_norm'):
            self.assertAllClose([m[name] for m in metrics], [m[name] for m in reference],
                                rtol=1e-5, msg=name)
        # Clipping acted, and learning happened: not a run that changes nothing.
        self.assertGreater(max(m["grad_norm"] for m in reference), CLIP)
        self.assertLess(metrics[-1]['loss'], metrics[0]['loss'])

    def testReplicasOnLogicalDevicesTrainLikeOnePipeline(self):
        self.AssertTrainsLikeOnePipeline('examples.PipelinedMLP', dropout=True)

    def testTokenWeightedLossesTrainLikeOnePipeline(self):
        # A language model's loss is a mean over tokens; the replicas' shards hold different
        # numbers of them, so their gradients count by tokens, not equally.
        self.AssertTrainsLikeOnePipeline('lm.TransformerLTiny')

    def testCheckpointResumesAndEvaluationAgreesWithOnePipeline(self):
        logdir = self.LogDir()
        prog = program.StrategyProgram(_TaskParams(True), logdir, STRATEGY)
        first = self.Losses(prog, 3)
        prog.Save()
        resumed = program.StrategyProgram(_TaskParams(True), logdir, STRATEGY)
        self.assertEqual(resumed.Restore(), 3)
        later = [resumed.Step()['loss'] for _ in range(3)]
        reference = self.Losses(program.EagerProgram(_TaskParams(False), self.LogDir()))
        self.assertAllClose(first + later, reference, rtol=1e-5)
        # The same checkpoint evaluated by one pipeline and by the two replicas.
        eval_input = model_registry.GetParams('examples.PipelinedMLP', 'Test').input
        # 1000 examples: the last batch of 64 holds 40 (weights 1) and 24 of padding (weights
        # 0), so its two replicas' shards weigh 32 and 8.
        eval_input.num_examples_total = 1000
        resumed.Save()
        single = program.EagerProgram(_TaskParams(False), logdir)
        single.Restore(training=False)
        expected = single.Evaluate(eval_input)
        got = resumed.Evaluate(eval_input)
        self.assertEqual(set(got), set(expected))
        for name, value in expected.items():
            self.assertAllClose(got[name], value, rtol=1e-5, msg=name)

    def testBatchNormStatisticsAreTheGlobalBatchs(self):
        # Each replica's pipeline sums its micro-batches' sufficient statistics; the strategy
        # sums them over replicas, so the moving averages are the one-pipeline run's.
        # Batch norm normalises by micro-batch: 4 micro-batches of 16 in one pipeline are 2 of
        # 16 in each of the 2 replicas (replica r takes the r-th half of the batch).
        replicated = _TaskParams(True, batch_norm=True)
        replicated.model.num_micro_batches = 2
        progs = [program.EagerProgram(_TaskParams(False, batch_norm=True), self.LogDir()),
                 program.StrategyProgram(replicated, self.LogDir(), STRATEGY)]
        losses = [self.Losses(prog, 3) for prog in progs]
        self.assertAllClose(losses[1], losses[0], rtol=1e-5)
        for name in ('moving_mean', 'moving_variance'):
            values = [[v for v in prog.task.variables if name in v.name][0].numpy()
                      for prog in progs]
            self.assertGreater(abs(values[0] - (0.0 if name == 'moving_mean' else 1.0)).max(),
                               1e-4)  # They moved.
            self.assertAllClose(values[1], values[0], rtol=1e-5, atol=1e-7, msg=name)

    def testBatchMustSplitOverReplicas(self):
        p = _TaskParams(True)
        p.input.batch_size = 63
        with self.assertRaisesRegex(ValueError, 'Batch size 63 does not split over 2 replicas'):
            program.StrategyProgram(p, self.LogDir(), STRATEGY)


if __name__ == '__main__':
    tf.test.main()
