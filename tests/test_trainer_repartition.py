"""The trainer resumes a run under another partition, and reads checkpoints keyed by cell.

K, M, R and the graph mode may change between runs on the same logdir: the run resumes where it
stopped and goes on with the losses of a run that never changed (layers are keyed by name, their
randomness drawn per example). The runs are in this process (`trainer.Main`).
"""

import glob
import json
import os
import shutil
import tempfile
from unittest import mock

import tensorflow as tf

from gpipe_tf import test_utils
from gpipe_tf.train import legacy_checkpoints

DEVICES = test_utils.ConfigureVirtualCpus()
MLP = 'examples.PipelinedMLP'  # Registered at K=4, M=8, R=1.
FAST = ('train.summary_interval_steps : 1; train.save_interval_steps : 5; '
        'train.plot_pipeline : False')  # Pictures are another test's.
RTOL = 1e-5
# A logdir's checkpoint written by gpipe_tf before layers were keyed by name (see run.json).
LEGACY = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'data',
                      'legacy_cell_keyed_mlp')


def Main(*flags, overrides=FAST) -> str:
    """The trainer with `flags` in this process; its stdout. Raises unless it exits 0."""
    return test_utils.TrainerInProcess(
        f'--model={MLP}', f'--model_params_override={overrides}', *flags).stdout


def Losses(logdir: str) -> dict[int, float]:
    """{step: loss} of the run in `logdir` (a resumed run's steps from its own files)."""
    return test_utils.EventScalars(os.path.join(logdir, 'train'), 'loss')


class ResumeUnderAnotherPartitionTest(tf.test.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.reference_dir = tempfile.mkdtemp(prefix='repartition_reference_')
        Main(f'--logdir={cls.reference_dir}', '--max_steps=15')
        cls.reference = Losses(cls.reference_dir)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.reference_dir, ignore_errors=True)
        super().tearDownClass()

    def LogDir(self) -> str:
        path = tempfile.mkdtemp(prefix='repartition_')
        self.addCleanup(shutil.rmtree, path, ignore_errors=True)
        return path

    def AssertLossesAreTheReferences(self, losses: dict, steps):
        self.assertEqual(sorted(losses), list(steps))
        for step in steps:
            self.assertAllClose(losses[step], self.reference[step], rtol=RTOL, atol=0,
                                msg=f'step {step}')

    def testKAndMAndTheGraphModeChangeAndTheRunGoesOn(self):
        logdir = self.LogDir()
        Main(f'--logdir={logdir}', '--max_steps=5')
        output = Main(f'--logdir={logdir}', '--max_steps=10', '--worker_split_size=2',
                      '--num_micro_batches=4')
        self.assertIn('at step 5; partition changed: K 4 -> 2, M 8 -> 4\n', output)
        output = Main(f'--logdir={logdir}', '--max_steps=15', '--worker_split_size=3',
                      '--graph_mode=v1')
        self.assertIn('at step 10; partition changed: K 2 -> 3, M 4 -> 8\n', output)
        self.AssertLossesAreTheReferences(Losses(logdir), range(1, 16))

    def testReplicasChangeAndTheRunGoesOn(self):
        logdir = self.LogDir()
        output = Main(f'--logdir={logdir}', '--max_steps=10', '--worker_replicas=2',
                      '--worker_split_size=2')
        self.assertIn('R=2 replicas x K=2 cells', output)
        output = Main(f'--logdir={logdir}', '--max_steps=15')
        self.assertIn('at step 10; partition changed: K 2 -> 4, R 2 -> 1\n', output)
        self.AssertLossesAreTheReferences(Losses(logdir), range(1, 16))

    def testAnUnchangedPartitionSaysNothing(self):
        logdir = os.path.join(self.LogDir(), 'copy')
        shutil.copytree(self.reference_dir, logdir)
        output = Main(f'--logdir={logdir}', '--max_steps=16')
        self.assertRegex(output, r'resumed from \S+ckpt-15 at step 15\n')


class CellKeyedCheckpointTest(tf.test.TestCase):
    """A logdir of the cell-keyed layout (`LEGACY`, written by an earlier gpipe_tf) resumes."""

    def setUp(self):
        super().setUp()
        self.logdir = tempfile.mkdtemp(prefix='legacy_')
        self.addCleanup(shutil.rmtree, self.logdir, ignore_errors=True)
        train = os.path.join(self.logdir, 'train')
        os.makedirs(train)
        for path in glob.glob(os.path.join(LEGACY, 'ckpt-*')):
            shutil.copy(path, train)
        shutil.copy(os.path.join(LEGACY, 'params.txt'), self.logdir)
        with open(os.path.join(LEGACY, 'run.json'), encoding='utf-8') as f:
            self.run = json.load(f)
        self.checkpoint = os.path.join(train, self.run['checkpoint'])
        with open(os.path.join(train, 'checkpoint'), 'w', encoding='utf-8') as f:
            f.write(f'model_checkpoint_path: "{self.run["checkpoint"]}"\n'
                    f'all_model_checkpoint_paths: "{self.run["checkpoint"]}"\n')

    def testTrainingResumesWithTheOldRunsLossesAtAnotherK(self):
        self.assertTrue(legacy_checkpoints.IsCellKeyed(self.checkpoint))
        output = Main(f'--logdir={self.logdir}', '--max_steps=24', '--worker_split_size=2',
                      overrides='train.summary_interval_steps : 1; train.plot_pipeline : False')
        self.assertIn(f'resumed from {self.checkpoint} at step 16; partition changed: '
                      'K 4 -> 2', output)
        expected = {int(step): loss for step, loss in self.run['losses_after'].items()}
        losses = Losses(self.logdir)
        self.assertEqual(sorted(losses), sorted(expected))
        for step, loss in expected.items():
            self.assertAllClose(losses[step], loss, rtol=RTOL, atol=0, msg=f'step {step}')
        # Read through a converted copy beside it; the original is left as it was.
        converted = legacy_checkpoints.ConvertedPath(self.checkpoint)
        self.assertTrue(os.path.exists(converted + '.index'))
        self.assertFalse(legacy_checkpoints.IsCellKeyed(converted))
        self.assertTrue(legacy_checkpoints.IsCellKeyed(self.checkpoint))
        self.assertFalse(legacy_checkpoints.IsCellKeyed(os.path.join(
            self.logdir, 'train', 'ckpt-24')))

    def testEvalReadsIt(self):
        output = Main(f'--logdir={self.logdir}', '--mode=eval')
        self.assertRegex(output, r'eval Test at step 16: accuracy 0\.\d+')

    def testEvalReadsItFromALogdirItCannotWrite(self):
        converted_dir = os.path.dirname(legacy_checkpoints.ConvertedPath(self.checkpoint))
        makedirs = tf.io.gfile.makedirs

        def ReadOnly(path):
            if path == converted_dir:
                raise tf.errors.PermissionDeniedError(None, None, f'{path}: read-only')
            return makedirs(path)

        with mock.patch.object(tf.io.gfile, 'makedirs', ReadOnly):
            output = Main(f'--logdir={self.logdir}', '--mode=eval')
        self.assertRegex(output, r'eval Test at step 16: accuracy 0\.\d+')
        self.assertFalse(os.path.exists(converted_dir))


if __name__ == '__main__':
    tf.test.main()
