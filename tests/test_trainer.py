"""The trainer: train, checkpoint, resume after SIGKILL with the same losses, recovery from
damaged checkpoints, one trainer per logdir, SIGTERM saves in one line, v1 graph mode, eval,
inspect modes, decode, the pipeline pictures (inspect_model's PNGs, training's TensorBoard
images) and clear errors.

Most runs are trainer.Main in this process (`InProcess`): a subprocess pays TensorFlow's import
and start-up again, several seconds a run. A run is a subprocess, as users run it, only where the
test needs a process of its own: signals and kills, --help, what the real process prints at
start-up or on a mistake, TPU connections (they change TensorFlow's global eager context), and
the process's environment (TMPDIR)."""

import contextlib
import glob
import inspect
import io
import re
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from unittest import mock

from absl import flags as absl_flags
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.training import py_checkpoint_reader  # pylint: disable=g-direct-tensorflow-import

from gpipe_tf import errors
from gpipe_tf import model_registry
from gpipe_tf import test_utils
from gpipe_tf import trainer
from gpipe_tf.perf import measured_costs
from gpipe_tf.perf import pictures
from gpipe_tf.perf import reports
from gpipe_tf.perf import trace
from gpipe_tf.pipeline import plan as plan_lib
from gpipe_tf.tasks import base_task
from gpipe_tf.tasks import classifier
from gpipe_tf.train import cluster as cluster_lib
from gpipe_tf.train import loop
from gpipe_tf.train import program
from gpipe_tf.train import setup

# Before TensorFlow initialises: the in-process trainer runs on the first R x K of these.
DEVICES = test_utils.ConfigureVirtualCpus()
MLP = 'examples.PipelinedMLP'
# Every step's loss goes to TensorBoard; checkpoints every 4 steps.
FAST = 'train.summary_interval_steps : 1; train.save_interval_steps : 4'
TIMEOUT = 300
PNG_SIGNATURE = b'\x89PNG\r\n\x1a\n'
PLAN_PICTURES = ('cell_costs', 'timeline_predicted', 'memory')


def Command(*flags):
    return [sys.executable, '-m', 'gpipe_tf.trainer'] + list(flags)


def StartTrainer(logdir, overrides, **popen_kwargs):
    """MLP training in `logdir` until it is stopped, as a subprocess."""
    return subprocess.Popen(
        Command(f'--model={MLP}', f'--logdir={logdir}', '--max_steps=100000',
                f'--model_params_override={overrides}'),
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2'), **popen_kwargs)


def WaitUntilCatching(process, signum, timeout_s=TIMEOUT):
    """Waits until `process` has a handler for `signum` (Linux: the SigCgt mask of
    /proc/<pid>/status), so that a signal sent next is the process's to handle."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        with open(f'/proc/{process.pid}/status', encoding='ascii') as f:
            caught = next(int(line.split()[1], 16) for line in f if line.startswith('SigCgt:'))
        if caught & (1 << (signum - 1)):
            return
        time.sleep(0.01)
    raise AssertionError(f'process {process.pid} did not catch signal {signum}')


def Reap(process):
    """Kills `process` if it still runs (a test that failed before it ended), and waits."""
    if process.poll() is None:
        process.kill()
        process.communicate()


def Run(*flags, check=True):
    """The trainer with `flags` as a subprocess, as users run it: for the runs that need a
    process of their own (the module's docstring says which); the others run `InProcess`."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2')
    result = subprocess.run(Command(*flags), capture_output=True, text=True, timeout=TIMEOUT,
                            env=env)
    if check and result.returncode != 0:
        raise AssertionError(f'trainer failed ({result.returncode}):\n{result.stdout}\n'
                             f'{result.stderr[-3000:]}')
    return result


# The trainer in this process (`test_utils.TrainerInProcess`).
InProcess = test_utils.TrainerInProcess


def Scalars(logdir, tag, files=None):
    """{step: value} of scalar `tag` in the training event files of `logdir`."""
    return test_utils.EventScalars(os.path.join(logdir, 'train'), tag, files)


def Images(logdir):
    """{tag: (step, PNG bytes)} of the image summaries under <logdir>/train."""
    images = {}
    for path in sorted(glob.glob(os.path.join(logdir, 'train', 'events.*'))):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                if value.metadata.plugin_data.plugin_name == 'images':
                    # tf.summary.image stores [width, height, PNG...].
                    images[value.tag] = (event.step, tf.make_ndarray(value.tensor)[2])
    return images


def EventFiles(logdir):
    return set(glob.glob(os.path.join(logdir, 'train', 'events.*')))


def CheckpointSteps(logdir):
    return sorted(int(p.split('-')[-1].split('.')[0])
                  for p in glob.glob(os.path.join(logdir, 'train', 'ckpt-*.index')))


class TrainerTestCase(tf.test.TestCase):

    def LogDir(self):
        path = tempfile.mkdtemp(prefix='trainer_test_')
        self.addCleanup(shutil.rmtree, path, ignore_errors=True)
        return path

    def AssertFails(self, pattern, *flags):
        """The trainer, in process, ends in one line `error: ...` matching `pattern` and exit
        status 2."""
        result = InProcess(*flags, check=False)
        self.assertEqual(result.returncode, 2, result.stderr)
        self.assertRegex(ErrorLine(result), pattern)
        return result


class ReferenceRunTestCase(TrainerTestCase):
    """Tests against one reference run of MLP: MAX_STEPS steps with OVERRIDES, in
    `reference_dir`; its stdout and {step: loss}."""
    MAX_STEPS = 24
    OVERRIDES = FAST

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.reference_dir = tempfile.mkdtemp(prefix='trainer_reference_')
        cls.reference_output = InProcess(f'--model={MLP}', f'--logdir={cls.reference_dir}',
                                         f'--max_steps={cls.MAX_STEPS}',
                                         f'--model_params_override={cls.OVERRIDES}').stdout
        cls.reference = Scalars(cls.reference_dir, 'loss')

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.reference_dir, ignore_errors=True)
        super().tearDownClass()


class TrainAndResumeTest(ReferenceRunTestCase):

    def testTrainsWritesCheckpointsAndProgress(self):
        self.assertEqual(sorted(self.reference), list(range(1, 25)))
        self.assertLess(np.mean([self.reference[s] for s in range(21, 25)]),
                        np.mean([self.reference[s] for s in range(1, 5)]))
        self.assertEqual(CheckpointSteps(self.reference_dir)[-3:], [16, 20, 24])  # keep 3
        self.assertRegex(self.reference_output, r'step\s+24/24\s+loss \d+\.\d+')
        for tag in ('learning_rate', 'examples_per_sec', 'step_time', 'accuracy', 'grad_norm'):
            self.assertLen(Scalars(self.reference_dir, tag), 24, tag)

    def testSigkillThenRestartResumesWithTheSameLosses(self):
        logdir = self.LogDir()
        process = StartTrainer(logdir, FAST, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
        try:
            deadline = time.time() + TIMEOUT
            while not CheckpointSteps(logdir) and time.time() < deadline:
                self.assertIsNone(process.poll(), 'the trainer exited early')
                time.sleep(0.05)
            os.kill(process.pid, signal.SIGKILL)
            process.wait(timeout=60)
        finally:
            if process.poll() is None:
                process.kill()
        self.assertEqual(process.returncode, -signal.SIGKILL)
        saved = CheckpointSteps(logdir)[-1]
        self.assertLessEqual(saved, 16, 'the run was not killed mid-run')
        before = EventFiles(logdir)
        # The resume needs no process of its own.
        output = InProcess(f'--model={MLP}', f'--logdir={logdir}', f'--max_steps={saved + 8}',
                           f'--model_params_override={FAST}').stdout
        self.assertIn(f'resumed from {os.path.join(logdir, "train", f"ckpt-{saved}")} at step '
                      f'{saved}', output)
        # K=4, M=8: 32 cell calls, fewer than unroll='auto' loops from.
        self.assertIn("M=8 (gpipe schedule, unrolled: unroll='auto', 32 cell calls < 64), batch",
                      output)
        resumed = Scalars(logdir, 'loss', sorted(EventFiles(logdir) - before))
        self.assertEqual(sorted(resumed), list(range(saved + 1, saved + 9)))
        for step, loss in resumed.items():
            self.assertAllClose(loss, self.reference[step], rtol=1e-6, atol=0,
                                msg=f'step {step}')

    def testV1GraphModeGivesTheSameLossesAndResumes(self):
        logdir = self.LogDir()
        InProcess(f'--model={MLP}', f'--logdir={logdir}', '--max_steps=8', '--graph_mode=v1',
                  f'--model_params_override={FAST}')
        output = InProcess(f'--model={MLP}', f'--logdir={logdir}', '--max_steps=12',
                           '--graph_mode=v1', f'--model_params_override={FAST}').stdout
        self.assertIn('at step 8', output)
        losses = Scalars(logdir, 'loss')
        self.assertEqual(sorted(losses), list(range(1, 13)))
        for step, loss in losses.items():
            self.assertAllClose(loss, self.reference[step], rtol=1e-5, msg=f'step {step}')

    def testEvalModeEvaluatesTheLatestCheckpoint(self):
        output = InProcess(f'--model={MLP}', f'--logdir={self.reference_dir}',
                           '--mode=eval').stdout
        self.assertRegex(output, r'eval Test at step 24: accuracy 0\.\d+\s+log_loss \d')

    def testEvalLooksAgainWhenATrainerDeletesItsCheckpointUnderIt(self):
        # A trainer beside eval deletes old checkpoints (max_to_keep) as it saves new ones,
        # here while eval reads the one it found (TF then fails on the missing data file, an
        # OpError that is not a NotFoundError).
        logdir = self.LogDir()
        shutil.copytree(self.reference_dir, logdir, dirs_exist_ok=True)
        restore, paths = program._RestoreMatched, []  # pylint: disable=protected-access

        def DeletedWhileRead(checkpoint, path):
            paths.append(path)
            if len(paths) > 1:
                return restore(checkpoint, path)
            for name in glob.glob(path + '.data-*'):
                os.remove(name)
            try:
                return restore(checkpoint, path)  # The index read, its data gone.
            finally:
                os.remove(path + '.index')

        with mock.patch.object(program, '_RestoreMatched', DeletedWhileRead):
            output = InProcess(f'--model={MLP}', f'--logdir={logdir}', '--mode=eval').stdout
        self.assertEqual([os.path.basename(path) for path in paths], ['ckpt-24', 'ckpt-20'])
        self.assertRegex(output, r'eval Test at step 20: accuracy 0\.\d+')

    def testEvalLooksAgainWhenACheckpointIsDeletedAfterItsObjectsAreRead(self):
        # The trainer's deletion lands after TF read the checkpoint's object graph, as it
        # restores the values: a restore that fails then has queued restorations of objects
        # made later (the save counter), which would read the deleted checkpoint during the
        # next attempt's restore.
        logdir = self.LogDir()
        shutil.copytree(self.reference_dir, logdir, dirs_exist_ok=True)
        latest = os.path.join(logdir, 'train', 'ckpt-24')
        read = py_checkpoint_reader.NewCheckpointReader

        def DeletedWhileRestored(path):
            path_string = path.decode() if isinstance(path, bytes) else path
            if path_string == latest and any(frame.function == 'restore_saveables'
                                             for frame in inspect.stack()):
                for name in glob.glob(latest + '.*'):
                    os.remove(name)
            return read(path)

        with mock.patch.object(py_checkpoint_reader, 'NewCheckpointReader',
                               DeletedWhileRestored):
            output = InProcess(f'--model={MLP}', f'--logdir={logdir}', '--mode=eval').stdout
        self.assertFalse(glob.glob(latest + '.*'))  # The deletion happened.
        self.assertRegex(output, r'eval Test at step 20: accuracy 0\.\d+')

    def testSeedFlagChangesInitialisationAndDataOrder(self):
        logdir = self.LogDir()
        InProcess(f'--model={MLP}', f'--logdir={logdir}', '--max_steps=2', '--seed=7',
                  f'--model_params_override={FAST}')
        self.assertNotAlmostEqual(Scalars(logdir, 'loss')[1], self.reference[1], places=6)


class NonFiniteLossTest(TrainerTestCase):

    def testNanLossStopsNamingTheStepAndKeepsTheLastGoodCheckpoint(self):
        logdir = self.LogDir()
        # A learning rate of 1e38 sends the weights to ~1e38 at step 1: step 2's loss is not
        # finite.
        result = InProcess(f'--model={MLP}', f'--logdir={logdir}', '--max_steps=50',
                           '--model_params_override=train.learning_rate : 1e38; '
                           'train.save_interval_steps : 1; '
                           'train.clip_gradient_norm_to_value : 0.0', check=False)
        self.assertNotEqual(result.returncode, 0)
        self.assertRegex(result.stderr, r'The loss is (nan|inf) at step \d+: training stopped')
        found = re.search(r'at step (\d+): training stopped\. The last good checkpoint is '
                          r'\S+ckpt-(\d+)', result.stderr)
        bad_step, good_step = int(found.group(1)), int(found.group(2))
        self.assertEqual(good_step, bad_step - 1)
        self.assertEqual(CheckpointSteps(logdir)[-1], good_step)


# Checkpoints at steps 4, 8 and 12, all kept; a loss summary every step; no pictures.
RECOVERY = ('train.summary_interval_steps : 1; train.save_interval_steps : 4; '
            'train.save_max_to_keep : 5; train.plot_pipeline : False')


def Files(logdir):
    """Every file under <logdir>/train (damaged/ included), by base name."""
    return test_utils.FileNames(os.path.join(logdir, 'train'))


Damage = test_utils.DamageFile


def ErrorLine(result):
    """The stderr of a run that must end in one line `error: ...` without a traceback."""
    assert 'Traceback' not in result.stderr, result.stderr[-3000:]
    return result.stderr.strip().splitlines()[-1]


def LastLine(result):
    """The last line of stderr, traceback or not."""
    return result.stderr.strip().splitlines()[-1]


# The trainer, interrupted by SIGINT as `import tensorflow` begins; argv[1] says what the code
# the interrupt lands in does with it: 'error' raises ImportError from it, as a C extension's
# initialization does; 'swallowed' catches it and imports on.
_INTERRUPTED_IMPORT = """
import importlib.abc, os, signal, sys
landing = sys.argv.pop(1)

class Interrupting(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != 'tensorflow':
            return None
        sys.meta_path.remove(self)
        try:
            os.kill(os.getpid(), signal.SIGINT)
            signal.sigtimedwait([], 0)  # A bytecode boundary, where the handler runs.
        except KeyboardInterrupt as interrupt:
            if landing == 'error':
                raise ImportError('initialization failed') from interrupt
        return None

from gpipe_tf import trainer
sys.meta_path.insert(0, Interrupting())
trainer.Run(['gpipe_tf.trainer'] + sys.argv[1:])
"""


class RecoveryTest(ReferenceRunTestCase):
    """Accidents to a logdir never lose work: a damaged or missing index or checkpoint falls
    back to the newest intact one, a second trainer is refused, files are written safely."""
    MAX_STEPS = 12
    OVERRIDES = RECOVERY

    def Copy(self):
        logdir = os.path.join(self.LogDir(), 'run')
        shutil.copytree(self.reference_dir, logdir)
        return logdir

    def Train(self, logdir, max_steps, *flags, check=True):
        return InProcess(f'--model={MLP}', f'--logdir={logdir}', f'--max_steps={max_steps}',
                         f'--model_params_override={RECOVERY}', *flags, check=check)

    def NewLosses(self, logdir):
        """The losses of the runs on a copy of the reference logdir, not of the reference."""
        copied = {os.path.basename(p) for p in EventFiles(self.reference_dir)}
        return Scalars(logdir, 'loss', sorted(p for p in EventFiles(logdir)
                                              if os.path.basename(p) not in copied))

    def AssertResumedLikeTheReference(self, logdir, result, step, max_steps):
        self.assertIn(f'resumed from {os.path.join(logdir, "train", f"ckpt-{step}")} at step '
                      f'{step}', result.stdout)
        resumed = self.NewLosses(logdir)
        self.assertEqual(sorted(resumed), list(range(step + 1, max_steps + 1)))
        for s, loss in resumed.items():
            self.assertAllClose(loss, self.reference[s], rtol=1e-6, atol=0, msg=f'step {s}')

    def Path(self, logdir, name):
        return os.path.join(logdir, 'train', name)

    def testMissingIndexAndDamagedNewestResumeFromTheNewestIntact(self):
        logdir = self.Copy()
        before = Files(logdir)
        os.remove(self.Path(logdir, 'checkpoint'))
        Damage(self.Path(logdir, 'ckpt-12.data-00000-of-00001'), 'flip')
        Damage(self.Path(logdir, 'ckpt-8.index'), 'truncate')
        result = self.Train(logdir, 6)
        self.AssertResumedLikeTheReference(logdir, result, 4, 6)
        self.assertIn(f'warning: the index {self.Path(logdir, "checkpoint")} is missing; the '
                      'checkpoint files on disk are used instead.', result.stderr)
        self.assertRegex(result.stderr, rf'warning: checkpoint {self.Path(logdir, "ckpt-12")} '
                                        r'is damaged \(.*Checksum does not match.*\); skipped for '
                                        rf'{self.Path(logdir, "ckpt-4")}\.')
        self.assertIn(f'warning: checkpoint {self.Path(logdir, "ckpt-8")} is damaged',
                      result.stderr)
        self.assertNotIn('Traceback', result.stderr)
        # Nothing deleted: the damaged ones are in train/damaged/, the intact ones in place.
        self.assertContainsSubset(before - {'checkpoint'}, Files(logdir))
        self.assertCountEqual(os.listdir(self.Path(logdir, 'damaged')), [
            'ckpt-12.index', 'ckpt-12.data-00000-of-00001', 'ckpt-8.index',
            'ckpt-8.data-00000-of-00001'])
        self.assertEqual(CheckpointSteps(logdir), [4, 6])

    def testGarbledIndexAndTruncatedNewestResumeFromThePrevious(self):
        logdir = self.Copy()
        Damage(self.Path(logdir, 'checkpoint'), 'garble')
        Damage(self.Path(logdir, 'ckpt-12.data-00000-of-00001'), 'truncate')
        result = self.Train(logdir, 10)
        self.AssertResumedLikeTheReference(logdir, result, 8, 10)
        self.assertRegex(result.stderr, r'warning: the index \S+ is garbled')
        self.assertRegex(result.stderr, r'ckpt-12 is damaged \(IndexError: Read less bytes')

    def testNoCheckpointThatRestoresIsAnErrorUntilStartingOverDeliberately(self):
        logdir = self.Copy()
        for step in (4, 8, 12):
            Damage(self.Path(logdir, f'ckpt-{step}.data-00000-of-00001'), 'truncate')
        before = Files(logdir)
        result = self.Train(logdir, 2, check=False)
        self.assertEqual(result.returncode, 2, result.stderr[-3000:])
        line = ErrorLine(result)
        self.assertRegex(line, rf'^error: {self.Path(logdir, "")[:-1]} holds checkpoint files '
                               r'but none restores \(.*ckpt-12, .*ckpt-8, .*ckpt-4; .*'
                               r'pass --start_from_scratch .*or use another --logdir\.$')
        self.assertEqual(Files(logdir), before)
        result = self.Train(logdir, 2, '--start_from_scratch')
        self.assertNotIn('resumed', result.stdout)
        self.assertContainsSubset(before - {'checkpoint'}, Files(logdir))
        losses = self.NewLosses(logdir)
        self.assertEqual(sorted(losses), [1, 2])
        self.assertAllClose([losses[1], losses[2]], [self.reference[1], self.reference[2]],
                            rtol=1e-6, atol=0)

    def testASecondTrainerIsRefusedEvalRunsBesideAndSigtermIsOneLine(self):
        logdir = self.LogDir()
        first = StartTrainer(logdir, RECOVERY, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
        self.addCleanup(Reap, first)
        deadline = time.time() + TIMEOUT
        while not CheckpointSteps(logdir) and time.time() < deadline:
            self.assertIsNone(first.poll(), 'the first trainer exited early')
            time.sleep(0.1)
        with open(os.path.join(logdir, 'params.txt')) as f:
            params = f.read()
        # In this process, beside the trainer's (a second trainer that is not refused would
        # train its 200 steps and exit 0).
        second = InProcess(f'--model={MLP}', f'--logdir={logdir}', '--max_steps=200',
                           '--model_params_override=train.learning_rate : 0.5',
                           check=False)
        self.assertEqual(second.returncode, 2)
        self.assertRegex(ErrorLine(second),
                         rf'^error: {logdir} is in use by another trainer \(pid '
                         rf'{first.pid} on \S+, started [\dT:+-]+\); wait for it to end, '
                         r'stop it, or pass another --logdir\.$')
        with open(os.path.join(logdir, 'params.txt')) as f:
            self.assertEqual(f.read(), params)
        evaluation = InProcess(f'--model={MLP}', f'--logdir={logdir}', '--mode=eval')
        self.assertRegex(evaluation.stdout, r'eval Test at step \d+: accuracy')
        self.assertIsNone(first.poll(), 'the first trainer stopped')
        first.send_signal(signal.SIGTERM)
        _, stderr = first.communicate(timeout=120)
        self.assertEqual(first.returncode, 128 + signal.SIGTERM, stderr[-3000:])
        self.assertNotIn('Traceback', stderr)
        found = re.fullmatch(rf'stopped by SIGTERM: saved {logdir}/train/ckpt-(\d+) at step '
                             r'(\d+); run the same command again to resume\.',
                             stderr.strip().splitlines()[-1])
        self.assertIsNotNone(found, stderr[-2000:])
        self.assertEqual(found.group(1), found.group(2))
        self.assertEqual(CheckpointSteps(logdir)[-1], int(found.group(1)))

    def testCtrlCWhileStartingIsOneLine(self):
        # Half a second after Python catches SIGINT (its own handler, then the trainer's),
        # TensorFlow is still being imported (it takes seconds).
        logdir = os.path.join(self.LogDir(), 'never')
        process = StartTrainer(logdir, RECOVERY, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
        self.addCleanup(Reap, process)
        WaitUntilCatching(process, signal.SIGINT)
        time.sleep(0.5)
        process.send_signal(signal.SIGINT)
        self.AssertStoppedWhileStarting(process, logdir)

    def testCtrlCWhileStartingStopsATrainerStartedWithSigintIgnored(self):
        # As a shell script's background job starts it: SIGINT ignored, which Python keeps.
        # The trainer catches it from its first line on; before, only its training loop did.
        logdir = os.path.join(self.LogDir(), 'never')
        process = StartTrainer(
            logdir, RECOVERY, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
        self.addCleanup(Reap, process)
        WaitUntilCatching(process, signal.SIGINT)
        process.send_signal(signal.SIGINT)
        self.AssertStoppedWhileStarting(process, logdir)

    def testCtrlCThatAnImportTurnsIntoAnErrorIsOneLine(self):
        # Where the interrupt lands decides what reaches the trainer: a C extension's module
        # initialization turns it into `ImportError: initialization failed` (seen while
        # TensorFlow imports), other code swallows it. Both made here, at the same point every
        # run, by a finder that interrupts the process as `import tensorflow` begins.
        for landing in ('error', 'swallowed'):
            with self.subTest(landing=landing):
                logdir = os.path.join(self.LogDir(), landing)
                process = subprocess.Popen(
                    [sys.executable, '-c', _INTERRUPTED_IMPORT, landing, f'--model={MLP}',
                     f'--logdir={logdir}', '--max_steps=100000'],
                    env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2'), stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, text=True)
                self.addCleanup(Reap, process)
                self.AssertStoppedWhileStarting(process, logdir)

    def AssertStoppedWhileStarting(self, process, logdir):
        _, stderr = process.communicate(timeout=120)
        self.assertEqual(process.returncode, 130, stderr[-3000:])
        self.assertNotIn('Traceback', stderr)
        self.assertEqual(stderr.strip().splitlines()[-1],
                         'stopped by SIGINT while starting; nothing was written.')
        self.assertFalse(os.path.exists(logdir))

    def testInspectParamsReplacesASymlinkInsteadOfWritingThroughIt(self):
        logdir = self.LogDir()
        victim = os.path.join(logdir, 'victim.txt')
        with open(victim, 'w') as f:
            f.write('keep me')
        os.symlink(victim, os.path.join(logdir, 'params.txt'))
        InProcess(f'--model={MLP}', f'--logdir={logdir}', '--mode=inspect_params')
        with open(victim) as f:
            self.assertEqual(f.read(), 'keep me')
        self.assertFalse(os.path.islink(os.path.join(logdir, 'params.txt')))

    def testTheDefaultLogdirIsPrivateAndRefusedWhenItIsNot(self):
        # Subprocesses: the default root follows TMPDIR, which tempfile reads once a process.
        tmp = self.LogDir()
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2', TMPDIR=tmp)
        result = subprocess.run(Command(f'--model={MLP}', '--mode=inspect_params'),
                                capture_output=True, text=True, timeout=TIMEOUT, env=env)
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        [root] = os.listdir(tmp)
        self.assertRegex(root, r'^gpipe_tf-\S+$')
        root = os.path.join(tmp, root)
        self.assertEqual(os.stat(root).st_mode & 0o777, 0o700)
        self.assertTrue(os.path.isfile(os.path.join(root, MLP, 'params.txt')))
        os.chmod(root, 0o777)  # As another user's planted folder would be.
        result = subprocess.run(Command(f'--model={MLP}', '--max_steps=1'),
                                capture_output=True, text=True, timeout=TIMEOUT, env=env)
        self.assertEqual(result.returncode, 2)
        self.assertEqual(ErrorLine(result),
                         f'error: {root} is writable by other users (mode 777); refusing to use '
                         f'it. `chmod 700 {root}` or pass --logdir.')

    def testADeviceThatDoesNotExistIsAnError(self):
        result = InProcess(f'--model={MLP}', f'--logdir={self.LogDir()}', '--max_steps=1',
                           '--worker_split_size=2', '--model_params_override=model.devices : '
                           "['/device:CPU:0', '/device:CPU:9']", check=False)
        self.assertEqual(result.returncode, 2, result.stderr[-3000:])
        line = ErrorLine(result)
        self.assertIn('/device:CPU:9', line)
        self.assertIn('/device:CPU:1', line)  # Among the devices present.


class ModesTest(TrainerTestCase):

    def testListModels(self):
        output = InProcess('--list_models').stdout
        self.assertIn('image.amoebanet.AmoebaNetD_Small', output.split())
        self.assertIn('mt.multilingual.TransformerTiny', output.split())
        lines = {line.split()[0]: ' '.join(line.split()[1:]) for line in output.splitlines()}
        # The MLP's 16-64-64-64-10: 16*64+64 + 2*(64*64+64) + 64*10+10 = 10,058 parameters.
        self.assertEqual(lines[MLP], '10.06K params, K=4 M=8 trains on a CPU in minutes')
        self.assertEqual(lines['lm.TransformerL_3'], '282.18M params, K=1 M=1')  # Table 1.
        self.assertEqual(sorted(k for k, v in lines.items() if v.endswith('in minutes')),
                         ['examples.PipelinedMLP', 'image.amoebanet.AmoebaNetD_Small',
                          'lm.TransformerLTiny', 'mt.multilingual.TransformerTiny'])

    def testInspectParamsPrintsAndWritesLoadableParams(self):
        logdir = self.LogDir()
        output = InProcess(f'--model={MLP}', f'--logdir={logdir}', '--mode=inspect_params',
                           '--model_params_override=train.learning_rate : 0.125').stdout
        with open(os.path.join(logdir, 'params.txt'), encoding='utf-8') as f:
            text = f.read()
        self.assertEqual(output, text)
        p = classifier.ClassifierTask.Params().FromText(text)
        self.assertEqual(p.train.learning_rate, 0.125)
        self.assertEqual(p.model.num_cells, 4)

    def testOverridesFromAFileThenTheFlag(self):
        logdir = self.LogDir()
        override = os.path.join(logdir, 'override.txt')
        with open(override, 'w', encoding='utf-8') as f:
            f.write('train.learning_rate : 0.5\ninput.batch_size : 32\n')
        output = InProcess(f'--model={MLP}', f'--logdir={logdir}', '--mode=inspect_params',
                           f'--model_params_file_override={override}',
                           '--model_params_override=train.learning_rate : 0.25',
                           '--worker_split_size=2', '--num_micro_batches=4').stdout
        p = classifier.ClassifierTask.Params().FromText(output)
        self.assertEqual(p.train.learning_rate, 0.25)
        self.assertEqual((p.model.num_cells, p.model.num_micro_batches), (2, 4))
        self.assertEqual(p.model.input_shapes, [32, 16])  # Follows the input's batch size.

    def testInspectModelWorksForEveryRegisteredModelWithoutBuildingIt(self):
        graph = tf.Graph()
        with graph.as_default():
            for key in model_registry.ListModels():
                with self.subTest(model=key):
                    p = base_task.SyncInputShapes(model_registry.GetParams(key, 'Train'))
                    table = reports.PartitionTable(p, key)
                    rows = [line for line in table.splitlines() if line[:1].isdigit()]
                    self.assertLen(rows, p.model.num_cells)
        self.assertEmpty(graph.get_operations())

    def testInspectModelPrintsOneRowPerCell(self):
        output = InProcess('--model=image.amoebanet.AmoebaNetD_Small', '--mode=inspect_model',
                           '--worker_split_size=3').stdout
        rows = [line for line in output.splitlines() if line[:1].isdigit()]
        self.assertLen(rows, 3)
        self.assertIn('/device:CPU:2', rows[2])
        self.assertIn('stem', rows[0])
        self.assertIn('head', rows[2])
        # K=3, M=8: 24 cell calls, unrolled; M=32 (batch 64): 96, a loop (unroll='auto').
        self.assertIn("M=8 micro-batches, schedule gpipe (unrolled: unroll='auto', 24 cell calls "
                      '< 64)', output)
        output = InProcess('--model=image.amoebanet.AmoebaNetD_Small', '--mode=inspect_model',
                           '--worker_split_size=3', '--num_micro_batches=32').stdout
        self.assertIn("M=32 micro-batches, schedule gpipe (a loop over its clock: unroll='auto', "
                      '96 cell calls >= 64)', output)


class DecodeTest(TrainerTestCase):

    def testClassifiesImageFiles(self):
        logdir = self.LogDir()
        InProcess(f'--model={MLP}', f'--logdir={logdir}', '--max_steps=1')
        paths = []
        for i in range(3):
            path = os.path.join(logdir, f'image_{i}.png')
            pixels = tf.cast(tf.random.stateless_uniform([4, 4, 1], [i, 0], 0, 255), tf.uint8)
            tf.io.write_file(path, tf.io.encode_png(pixels))
            paths.append(path)
        output = InProcess(f'--model={MLP}', f'--logdir={logdir}', '--mode=decode',
                           f'--decode_input={",".join(paths)}').stdout
        lines = output.strip().splitlines()
        self.assertLen(lines, 3)
        for path, line in zip(paths, lines):
            self.assertRegex(line, rf'^{path}\t\d \(0\.\d+\)$')


class TranslateTest(TrainerTestCase):

    def testTrainsOnTheShippedCorpusThenTranslates(self):
        logdir = self.LogDir()
        output = InProcess('--model=mt.multilingual.TransformerTiny', f'--logdir={logdir}',
                           '--max_steps=2',
                           '--model_params_override=train.summary_interval_steps : 1').stdout
        self.assertRegex(output, r'step\s+2/2\s+loss \d+\.\d+')
        self.assertEqual(CheckpointSteps(logdir), [2])
        output = InProcess('--model=mt.multilingual.TransformerTiny', f'--logdir={logdir}',
                           '--mode=decode', '--target_language=de',
                           '--decode_input=Enter a valid date.,Add user').stdout
        lines = output.rstrip('\n').split('\n')
        self.assertLen(lines, 2)
        self.assertTrue(lines[0].startswith('Enter a valid date.\t'), lines[0])
        self.assertTrue(lines[1].startswith('Add user\t'), lines[1])


class DecodeRequestTest(TrainerTestCase):
    """A request the model cannot serve is one line and exit 2, before anything is built (no
    checkpoint is needed to find out)."""

    def AssertFails(self, pattern, *flags):
        return super().AssertFails(pattern, f'--logdir={self.LogDir()}', '--mode=decode', *flags)

    def testATranslationNeedsAKnownTargetLanguage(self):
        mt = '--model=mt.multilingual.TransformerTiny'
        self.AssertFails(r'^error: decode: translation needs --target_language \(e\.g\. de\)',
                         mt, '--decode_input=Add user')
        self.AssertFails(r"^error: decode: --target_language='xx': .*'xx'.*'de'", mt,
                         '--target_language=xx', '--decode_input=Add user')
        # A sentence too long is the sentence's problem, not the language's.
        self.AssertFails(r'^error: decode: (?!--target_language).*expected at most '
                         r'max_length=64', mt, '--target_language=de',
                         f'--decode_input={"x" * 100}')

    def testMissingImageFile(self):
        self.AssertFails(r"^error: decode: no image file '/nonexistent\.png'\.$",
                         f'--model={MLP}', '--decode_input=/nonexistent.png')

    def testAFileThatIsNotAnImage(self):
        path = os.path.join(self.LogDir(), 'notes.png')
        with open(path, 'w', encoding='utf-8') as f:
            f.write('not a picture\n')
        result = self.AssertFails(
            rf"^error: decode: '{re.escape(path)}' is not a PNG, JPEG, GIF or BMP image "
            r"\(it starts with b'not a pi'\)\.$", f'--model={MLP}', f'--decode_input={path}')
        self.assertNotIn('Traceback', result.stderr)

    def testAnInputFileWithNoNonBlankLineNamesIt(self):
        directory = self.LogDir()
        for name, text in (('empty.txt', ''), ('blank.txt', '\n  \n\t\n')):
            path = os.path.join(directory, name)
            with open(path, 'w', encoding='utf-8') as f:
                f.write(text)
            self.AssertFails(rf'^error: decode: --decode_input_file={re.escape(path)} holds no '
                             r'non-blank line; expected one image path or sentence per line\.$',
                             f'--model={MLP}', f'--decode_input_file={path}')
        self.AssertFails(r'^error: decode: --decode_input_file=/dev/null holds no non-blank line',
                         f'--model={MLP}', '--decode_input_file=/dev/null')

    def testBlankDecodeInputItemsAreDroppedAsBlankLinesAre(self):
        mt = '--model=mt.multilingual.TransformerTiny'
        for flag in ('--decode_input=,', '--decode_input= ', '--decode_input= , '):
            self.AssertFails(r'^error: decode: --decode_input holds only blank items; expected '
                             r'image paths or sentences, comma-separated\.$', mt,
                             '--target_language=de', flag)
        # The blank items around a missing image are dropped before it is looked for.
        self.AssertFails(r"^error: decode: no image file '/nonexistent\.png'\.$",
                         f'--model={MLP}', '--decode_input=,/nonexistent.png, ')

    def testAReadOnlyLogdirIsNoMistakeForDecodeWhichWritesNothingThere(self):
        image = os.path.join(self.LogDir(), 'x.png')
        tf.io.write_file(image, tf.io.encode_png(tf.zeros([4, 4, 1], tf.uint8)))
        logdir = self.LogDir()
        os.chmod(logdir, 0o555)
        self.addCleanup(os.chmod, logdir, 0o755)
        access = os.access
        # As root, os.access grants what the mode denies: deny writes under the logdir here.
        with mock.patch.object(os, 'access', lambda path, mode, **kwargs: (
                access(path, mode, **kwargs) and
                not (mode & os.W_OK and os.fspath(path).startswith(logdir)))):
            # Past the logdir check, to the checkpoint it reads.
            TrainerTestCase.AssertFails(
                self, rf'^error: decode: no checkpoint under {re.escape(logdir)}/train',
                f'--model={MLP}', f'--logdir={logdir}', '--mode=decode', f'--decode_input={image}')
            # Training writes there.
            TrainerTestCase.AssertFails(
                self, rf'^error: cannot write the logdir {re.escape(logdir)}', f'--model={MLP}',
                f'--logdir={logdir}', '--max_steps=1')

    def testATaskThatCannotDecode(self):
        self.AssertFails(r'^error: decode: SequenceTask cannot decode',
                         '--model=lm.TransformerLTiny', '--decode_input=hello')

    def testAnInputFileThatIsADirectoryOrNotUtf8NamesTheFlagAndThePath(self):
        directory = self.LogDir()
        self.AssertFails(rf'^error: --decode_input_file={re.escape(directory)} is a directory; '
                         r'expected a file of one image path or sentence per line\.$',
                         f'--model={MLP}', f'--decode_input_file={directory}')
        path = os.path.join(directory, 'latin1.txt')
        with open(path, 'wb') as f:
            f.write('caf\xe9\n'.encode('utf-8') + 'na\xefve\n'.encode('latin-1'))
        self.AssertFails(rf'^error: --decode_input_file={re.escape(path)} is not UTF-8 text '
                         r'\(byte 0xef on line 2, offset 8\); expected a UTF-8 file of one '
                         r'image path or sentence per line\.$', f'--model={MLP}',
                         f'--decode_input_file={path}')


class SmallConfigsTrainTest(TrainerTestCase):

    def _TrainsTwoSteps(self, model, *flags):
        logdir = self.LogDir()
        output = InProcess(f'--model={model}', f'--logdir={logdir}', '--max_steps=2',
                           '--model_params_override=train.summary_interval_steps : 1',
                           *flags).stdout
        self.assertRegex(output, r'step\s+2/2\s+loss \d+\.\d+')
        self.assertEqual(CheckpointSteps(logdir), [2])

    def testAmoebaNetSmallOnFashionMnist(self):
        if not os.path.isdir('/usr/share/datasets/fashion-mnist'):
            self.skipTest('Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist)')
        # M=2 instead of the registered 8: the model and its data are this test's subject. The
        # M=8 graph has 4x the ops (most of the time here) and differs only in M, which
        # test_pipeline's grids cover; the main job (README) runs it.
        self._TrainsTwoSteps('image.amoebanet.AmoebaNetD_Small', '--num_micro_batches=2')

    def testLanguageModelTiny(self):
        self._TrainsTwoSteps('lm.TransformerLTiny')


class OnePartitionTest(TrainerTestCase):
    """A run measures a time partition once, before anything is built, and writes it into the
    Params: the pipeline it builds plans from them (its own plan, no second measurement)."""

    def testAMeasuredPartitionIsMeasuredOnceAndBuilt(self):
        with mock.patch.object(measured_costs, 'StepSeconds',
                               wraps=measured_costs.StepSeconds) as measured, \
                mock.patch.object(plan_lib, 'MakePlan', wraps=plan_lib.MakePlan) as made:
            InProcess(f'--model={MLP}', f'--logdir={self.LogDir()}', '--max_steps=1',
                      f'--model_params_override={FAST}; train.plot_pipeline : False; '
                      'model.partition_method : "time"')
        measured.assert_called_once()
        # The layer's own plans (placed, its devices checked) are of the measured boundaries.
        built = [c.args[0] for c in made.call_args_list if c.kwargs.get('check_devices')]
        self.assertNotEmpty(built)
        for params in built:
            self.assertIsInstance(params.partition_method, list)


class ClusterExposureTest(tf.test.TestCase):
    """The trainer names, once, the tasks of a cluster that other hosts may reach."""

    def Warnings(self, cluster_spec):
        config = trainer.ParseConfig([f'--cluster_spec={cluster_spec}'] if cluster_spec else [])
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr):
            setup.WarnIfClusterIsExposed(setup.Target.Of(config).cluster)
        return stderr.getvalue().splitlines()

    def testTasksOnOtherHostsAreNamedInOneWarning(self):
        [line] = self.Warnings('worker=10.0.0.5:2222,127.0.0.1:2223,host-b:2224')
        self.assertStartsWith(line, 'warning: the cluster\'s tf.distribute.Server tasks '
                                    '(10.0.0.5:2222, host-b:2224) run any op')
        self.assertIn('firewall them', line)

    def testALoopbackClusterOrNoneIsNotWarnedAbout(self):
        self.assertEmpty(self.Warnings('worker=127.0.0.1:2222,localhost:2223'))
        self.assertEmpty(self.Warnings(None))


class ErrorsTest(TrainerTestCase):

    def testMissingModel(self):
        self.AssertFails(r'--model is required')

    def testMistakesThatNeedNoModelAreAnsweredBeforeTensorFlowIsImported(self):
        script = ('import sys\nfrom gpipe_tf import trainer\ntry:\n'
                  '    trainer.Run(["gpipe-train"] + sys.argv[1:])\n'
                  'except SystemExit as stop:\n'
                  '    print(stop.code, "tensorflow" in sys.modules)\n')
        for flags, pattern in (
                ([], r'^error: --model is required \(see --list_models\)\.$'),
                (['--model=lm.TransformerLtiny'], r"^error: --model=lm\.TransformerLtiny: Unknown "
                 r"model 'lm\.TransformerLtiny'; closest registered models: "
                 r"'lm\.TransformerLTiny'.*see --list_models\)\.$"),
                ([f'--model={MLP}', '--num_micro_batches=0'], r'^error: --num_micro_batches: '
                 r'must be a positive integer \(M, the micro-batches\), got 0\.$'),
                ([f'--model={MLP}', '--worker_split_size=-1'], r'^error: --worker_split_size: '
                 r'must be a positive integer \(K, the cells\), got -1\.$')):
            with self.subTest(flags=flags):
                result = subprocess.run([sys.executable, '-c', script] + flags,
                                        capture_output=True, text=True, timeout=TIMEOUT)
                self.assertEqual(result.stdout.split(), ['2', 'False'], result.stderr)
                self.assertRegex(result.stderr.strip(), pattern)

    def testUnknownModelSuggestsCloseNames(self):
        self.AssertFails(r"^error: --model=examples\.PipelinedMLQ: Unknown "
                         r"model 'examples\.PipelinedMLQ'; closest registered "
                         r'models: .*examples\.PipelinedMLP.*see --list_models\)\.$',
                         '--model=examples.PipelinedMLQ', '--mode=inspect_params')

    def testMalformedOverrideNamesTheLine(self):
        self.AssertFails(r"Line 1 \('train.no_such_field : 1'\)", f'--model={MLP}',
                         '--mode=inspect_params', '--model_params_override=train.no_such_field : 1')

    def testOverrideOfTheWrongKindIsAnErrorBeforeTraining(self):
        logdir = os.path.join(self.LogDir(), 'run')
        result = self.AssertFails(r'^error: --model_params_override: input\.seed is 1 \(int\); '
                                  r'the override gives 1\.5 \(float\)\.$', f'--model={MLP}',
                                  f'--logdir={logdir}', '--model_params_override=input.seed : 1.5')
        self.assertNotIn('step', result.stdout)
        self.assertFalse(os.path.exists(logdir))

    def AssertFailsBeforeTheLogdir(self, pattern, *flags):
        """Training with `flags` is one line `error: ...` matching `pattern`, exit status 2,
        and no logdir."""
        logdir = os.path.join(self.LogDir(), 'run')
        self.AssertFails(pattern, f'--model={MLP}', f'--logdir={logdir}', *flags)
        self.assertFalse(os.path.exists(logdir))

    def testMicroBatchesThatDoNotDivideTheBatch(self):
        self.AssertFailsBeforeTheLogdir(
            r'^error: --num_micro_batches: Batch size 64 is not divisible by num_micro_batches '
            r'\(7\)\. M must divide the 64 examples of a replica: one of \[1, 2, 4, 8, 16, 32, '
            r'64\]\.$', '--num_micro_batches=7')

    def testMoreMicroBatchesThanExamples(self):
        self.AssertFailsBeforeTheLogdir(r'num_micro_batches \(128\) is larger than the batch '
                                        r'size \(64\)', '--num_micro_batches=128')

    def testReplicasThatDoNotDivideTheBatch(self):
        self.AssertFailsBeforeTheLogdir(r'--worker_replicas=3: the batch of 64 examples does not '
                                        r'split into 3 equal replicas', '--worker_replicas=3')

    def testMoreCellsThanLayers(self):
        self.AssertFailsBeforeTheLogdir(r'^error: --worker_split_size=9: num_cells \(9\) is '
                                        r'larger than the number of layers \(4\)\.$',
                                        '--worker_split_size=9')

    def testNegativeMaxSteps(self):
        self.AssertFailsBeforeTheLogdir(r'^error: --max_steps: train\.max_steps must be an '
                                        r'integer >= 0, got -1\.$', '--max_steps=-1')

    def testUnknownFlag(self):
        self.AssertFailsBeforeTheLogdir(r"^error: Unknown command line flag 'no_such_flag'",
                                        '--no_such_flag=1')

    def testALogdirThatIsAFile(self):
        path = os.path.join(self.LogDir(), 'file')
        with open(path, 'w', encoding='utf-8') as f:
            f.write('not a logdir')
        self.AssertFails(rf'^error: --logdir={path} is a file, not a directory\.$',
                         f'--model={MLP}', f'--logdir={path}', '--max_steps=1')

    def testALogdirUnderAFile(self):
        path = os.path.join(self.LogDir(), 'file')
        with open(path, 'w', encoding='utf-8') as f:
            f.write('not a logdir')
        self.AssertFails(rf'^error: --logdir={path}/run: {path} is a file, not a directory; '
                         r'expected a logdir whose parents are directories',
                         f'--model={MLP}', f'--logdir={path}/run', '--max_steps=1')

    def testWhatTheLogdirHoldsInTheWayIsOneLine(self):
        # A file where the summaries' directory goes; a directory where params.txt goes.
        logdir = self.LogDir()
        with open(os.path.join(logdir, 'train'), 'w', encoding='utf-8') as f:
            f.write('not a directory')
        self.AssertFails(rf'^error: cannot write the summaries at {logdir}/train: Not a '
                         r'directory; fix that path', f'--model={MLP}', f'--logdir={logdir}',
                         '--max_steps=1')
        logdir = self.LogDir()
        os.mkdir(os.path.join(logdir, 'params.txt'))
        self.AssertFails(rf'^error: cannot read {logdir}/params.txt: Is a directory',
                         f'--model={MLP}', f'--logdir={logdir}', '--max_steps=1')

    def testAParamsFileThatIsADirectoryOrNotUtf8NamesTheFlagAndThePath(self):
        directory = self.LogDir()
        self.AssertFails(rf'^error: --model_params_file_override={re.escape(directory)} is a '
                         r'directory; expected a file of Params text\.$', f'--model={MLP}',
                         '--mode=inspect_params', f'--model_params_file_override={directory}')
        path = os.path.join(directory, 'params.txt')
        with open(path, 'wb') as f:
            f.write(b'\xffinput.seed : 3\n')
        self.AssertFails(rf'^error: --model_params_file_override={re.escape(path)} is not UTF-8 '
                         r'text \(byte 0xff on line 1, offset 0\); expected a UTF-8 file of '
                         r'Params text\.$', f'--model={MLP}', '--mode=inspect_params',
                         f'--model_params_file_override={path}')

    def testATextFileOnAFilesystemReachedByUrlIsRead(self):
        # --mode=tune writes tuned_params.txt beside the logdir, gs://... included, and says to
        # pass it back with --model_params_file_override.
        tf.io.gfile.makedirs('ram://test_trainer/run')
        path = 'ram://test_trainer/run/tuned_params.txt'
        with tf.io.gfile.GFile(path, 'w') as f:
            f.write('model.num_cells : 2\r\n')
        self.assertEqual(setup.ReadTextFile('--model_params_file_override', path, 'Params text'),
                         'model.num_cells : 2\n')
        with self.assertRaisesRegex(errors.InputError, r'ram://test_trainer/run is a directory'):
            setup.ReadTextFile('--model_params_file_override', 'ram://test_trainer/run', 'text')
        with self.assertRaisesRegex(errors.MissingInputError, r'no such file'):
            setup.ReadTextFile('--model_params_file_override', 'ram://test_trainer/none', 'text')

    def testAClusterSpecThatDoesNotParse(self):
        self.AssertFailsBeforeTheLogdir(r"^error: --cluster_spec: cannot parse 'worker=nonsense'; "
                                        r'expected job=host:port', '--cluster_spec=worker=nonsense')
        self.AssertFailsBeforeTheLogdir(r'^error: --cluster_spec \(TF_CONFIG JSON\) must be JSON '
                                        r'with a "cluster" dict', '--cluster_spec={bad json')

    def testAClusterTimeoutThatIsNotPositive(self):
        for seconds in ('0', '-1', 'inf'):
            self.AssertFailsBeforeTheLogdir(
                r'^error: flag --cluster_timeout_s=\S+: expected a finite number of seconds > 0',
                '--cluster_spec=worker=127.0.0.1:2999', '--worker_split_size=1',
                f'--cluster_timeout_s={seconds}')

    def testAPlanErrorNamesOnlyTheFlagsThatSetItsCells(self):
        self.AssertFailsBeforeTheLogdir(r'^error: --virtual_stages=3: num_cells x virtual_stages '
                                        r'\(4 x 3\) is larger than the number of layers \(4\)\.$',
                                        '--virtual_stages=3', '--schedule=interleaved_1f1b')
        self.AssertFailsBeforeTheLogdir(r'^error: num_cells \(9\) is larger than the number of '
                                        r'layers \(4\)\.$',
                                        '--model_params_override=model.num_cells : 9')
        self.AssertFailsBeforeTheLogdir(r"^error: mlp: recompute='except_last_9' keeps",
                                        "--model_params_override=model.recompute : "
                                        "'except_last_9'", '--worker_split_size=4')

    def testHelpListsTheTrainersFlagsAndExitsZero(self):
        # A subprocess, as users run it; it imports no TensorFlow, so it is quick.
        result = Run('--help')
        for flag in ('model', 'num_micro_batches', 'worker_split_size', 'verbose'):
            self.assertRegex(result.stdout, rf'\n  --(\[no\])?{flag}:')

    def testAMistakeIsOneLineQuicklyAndTheTracebackOnlyWithVerbose(self):
        # As users run it: TensorFlow's start-up lines stay out of stderr.
        result = Run(f'--model={MLP}', '--num_micro_batches=7', check=False)
        self.assertEqual(result.returncode, 2)
        self.assertEqual(len(result.stderr.strip().splitlines()), 1, result.stderr)
        self.assertStartsWith(result.stderr, 'error: --num_micro_batches: ')
        verbose = Run(f'--model={MLP}', '--num_micro_batches=7', '--verbose', check=False)
        self.assertEqual(verbose.returncode, 2)
        self.assertIn('Traceback', verbose.stderr)
        self.assertEqual(LastLine(verbose), result.stderr.strip())

    def testEvalWithoutCheckpoint(self):
        logdir = self.LogDir()
        self.AssertFails(r'no checkpoint under .*train first', f'--model={MLP}',
                         f'--logdir={logdir}', '--mode=eval')

    def testGpuWithoutGpu(self):
        if tf.config.list_physical_devices('GPU'):
            self.skipTest('this machine has a GPU')
        self.AssertFails(r'--run_locally=gpu: TensorFlow sees no GPU', f'--model={MLP}',
                         '--run_locally=gpu', '--mode=inspect_model')

    def FailsWithoutTraceback(self, *flags) -> str:
        """Trains with `flags`, which must end in exit status 1 before any step and without a
        traceback; returns stderr. A subprocess: connecting to a TPU changes TensorFlow's
        global eager context, and the exit status 1 is _Main's (os._exit), not Main's."""
        result = Run(f'--model={MLP}', f'--logdir={self.LogDir()}', '--max_steps=1', *flags,
                     check=False)
        self.assertEqual(result.returncode, 1, result.stderr[-2000:])
        self.assertNotIn('Traceback', result.stderr)
        self.assertNotIn('step', result.stdout)
        return result.stderr

    def AssertFailsWithoutTraceback(self, message, *flags):
        self.assertIn(f'error: {message}', self.FailsWithoutTraceback(*flags))

    def testTpuAddressWhereNothingListens(self):
        port = cluster_lib.FreePorts(1)[0]
        self.AssertFailsWithoutTraceback(
            f'--tpu=grpc://127.0.0.1:{port}: no process accepts connections there',
            f'--tpu=grpc://127.0.0.1:{port}', '--tpu_timeout_s=60')

    def testTpuAddressThatAcceptsButNeverAnswers(self):
        # A socket that accepts connections and says nothing: the initialization is abandoned
        # after --tpu_timeout_s (or fails earlier if gRPC gives up on it first).
        listener = socket.create_server(('127.0.0.1', 0))
        self.addCleanup(listener.close)
        port = listener.getsockname()[1]
        stderr = self.FailsWithoutTraceback(f'--tpu=grpc://127.0.0.1:{port}', '--tpu_timeout_s=5')
        self.assertRegex(stderr, rf'error: --tpu=grpc://127.0.0.1:{port}: (the TPU did not '
                                 r'initialize within 5 s|no usable TPU at )')

    def testTpuTakesItsCoresFromReplicasAndCells(self):
        self.AssertFails(r'--tpu uses R x K TPU cores .*drop --num_devices', f'--model={MLP}',
                         '--tpu=local', '--num_devices=4', '--mode=inspect_model')

    def testTpuAddressOfAServerWithoutATpu(self):
        spec = cluster_lib.LocalClusterSpec(1)
        server = cluster_lib.StartServer(spec, 0)
        try:
            cluster_lib.WaitUntilListening(spec, 60, [server])
            address = 'grpc://' + spec.split('=', 1)[1]
            self.AssertFailsWithoutTraceback(
                f'--tpu={address}: no usable TPU at {address} (NotFoundError: TPUs not found',
                f'--tpu={address}', '--tpu_timeout_s=60')
        finally:
            cluster_lib.StopProcesses([server])

    def testRunLocallyTpuWithoutATpu(self):
        self.AssertFailsWithoutTraceback('--tpu=local: no usable TPU on this machine',
                                         '--run_locally=tpu', '--tpu_timeout_s=60')

    def testTpuRunsTheTfFunctionPath(self):
        self.AssertFails(r'--tpu runs the tf_function path', f'--model={MLP}',
                         f'--logdir={self.LogDir()}', '--tpu=local', '--graph_mode=v1')

    def testInspectModelPlansTpuCoresWithoutATpu(self):
        output = InProcess(f'--model={MLP}', '--run_locally=tpu', '--mode=inspect_model').stdout
        for k in range(4):
            self.assertRegex(output, rf'\n\s*{k}\s+device:TPU_REPLICATED_CORE:{k}\s')

    def testMissingFashionMnistNamesThePath(self):
        self.AssertFails(r'/no/such/dir', '--model=image.amoebanet.AmoebaNetD_Small',
                         '--max_steps=1', f'--logdir={self.LogDir()}', '--data_dir=/no/such/dir')

    def AssertFailsAndLeavesNothing(self, pattern, *flags, status=2):
        """One line `error: ...` matching `pattern`, exit `status`, and the logdir this run
        would have created is not there."""
        logdir = os.path.join(self.LogDir(), 'run')
        result = InProcess(f'--logdir={logdir}', *flags, check=False)
        self.assertEqual(result.returncode, status, result.stderr)
        self.assertRegex(ErrorLine(result), pattern)
        self.assertNotIn('Traceback', result.stderr)
        self.assertFalse(os.path.exists(logdir))

    def testATruncatedFashionMnistFileNamesItAndItsExpectedSize(self):
        data_dir = self.LogDir()
        images = os.path.join(data_dir, 'train-images-idx3-ubyte')
        with open(images, 'wb') as f:  # A header of 60000 28x28 images, and 10 of their bytes.
            f.write(b''.join(n.to_bytes(4, 'big') for n in (0x803, 60000, 28, 28)) + bytes(10))
        with open(os.path.join(data_dir, 'train-labels-idx1-ubyte'), 'wb') as f:
            f.write(b''.join(n.to_bytes(4, 'big') for n in (0x801, 60000)) + bytes(60000))
        self.AssertFailsAndLeavesNothing(
            rf'^error: .*{re.escape(images)}: truncated: 26 bytes, expected 47040016',
            '--model=image.amoebanet.AmoebaNetD_Small', '--num_micro_batches=2',
            '--max_steps=1', f'--data_dir={data_dir}')

    def _Translation(self, file_pattern):
        return ('--model=mt.multilingual.TransformerTiny', '--max_steps=1',
                f"--model_params_override=input.file_pattern : '{file_pattern}'")

    def testAMalformedParallelTextLineNamesFileAndLine(self):
        corpus = os.path.join(self.LogDir(), 'pairs.tsv')
        with open(corpus, 'w') as f:
            f.write('en\tde\tAdd user\tBenutzer hinzufuegen\nen\tde\tonly three fields\n')
        self.AssertFailsAndLeavesNothing(
            rf'^error: .*{re.escape(corpus)}:2: expected 4 non-empty tab-separated fields',
            *self._Translation(corpus))

    def testAFilePatternThatMatchesNothing(self):
        pattern = os.path.join(self.LogDir(), 'none-*.tsv')
        self.AssertFailsAndLeavesNothing(
            rf'^error: .*No parallel text file matches {re.escape(pattern)}',
            *self._Translation(pattern))

    def testALogdirThatCannotBeCreated(self):
        # /sys refuses new directories, to the superuser too.
        result = InProcess(f'--model={MLP}', '--logdir=/sys/gpipe_tf_test/run', '--max_steps=1',
                           check=False)
        self.assertEqual(result.returncode, 2, result.stderr)
        self.assertRegex(ErrorLine(result), r'^error: cannot write the logdir '
                         r'/sys/gpipe_tf_test/run: /sys.*; pass a --logdir in a directory')

    def testAFullDiskIsOneLineExitOneAndKeepsTheCheckpointsBefore(self):
        logdir = self.LogDir()
        InProcess(f'--model={MLP}', f'--logdir={logdir}', '--max_steps=4',
                  f'--model_params_override={FAST}')
        full = tf.errors.ResourceExhaustedError(
            None, None, '{{function_node SaveV2}} ckpt-8_temp/part-00000: No space left on '
            'device [Op:SaveV2]')
        with mock.patch.object(tf.train.CheckpointManager, 'save', side_effect=full):
            result = InProcess(f'--model={MLP}', f'--logdir={logdir}', '--max_steps=8',
                               f'--model_params_override={FAST}', check=False)
        self.assertEqual(result.returncode, 1, result.stderr)
        self.assertRegex(ErrorLine(result), r'^error: could not write the checkpoint of step 8 '
                         r'in .*/train: ckpt-8_temp/part-00000: No space left on device\. '
                         r'The checkpoints written before it are kept')
        self.assertNotIn('Traceback', result.stderr)
        self.assertEqual(CheckpointSteps(logdir), [4])

    def testDataDirForAnInputWithoutOne(self):
        self.AssertFails(r'--data_dir: the input of examples.PipelinedMLP \(SyntheticImageInput\)',
                         f'--model={MLP}', '--mode=inspect_params', '--data_dir=/tmp')


class PipelinePicturesTest(TrainerTestCase):

    def AssertPngs(self, plot_dir, output):
        for key in PLAN_PICTURES:
            path = os.path.join(plot_dir, f'{key}.png')
            self.assertIn(f'wrote {path}', output)
            with open(path, 'rb') as f:
                data = f.read()
            self.assertGreater(len(data), len(PNG_SIGNATURE), path)
            self.assertEqual(data[:8], PNG_SIGNATURE, path)

    def testInspectModelWritesThePlanPicturesAndPrintsTheMemoryPlan(self):
        plot_dir = os.path.join(self.LogDir(), 'plots')
        output = InProcess(f'--model={MLP}', '--mode=inspect_model', f'--plot_dir={plot_dir}',
                           '--device_memory_gib=16').stdout
        self.AssertPngs(plot_dir, output)
        table = output[output.index('planned memory per device'):]
        rows = [line.split() for line in table.splitlines() if line.strip()[:1].isdigit()]
        self.assertLen(rows, 4)
        self.assertEqual({row[-1] for row in rows}, {'yes'})  # The fits column.
        self.assertIn('peak per device', table)

    def testInspectModelPrintsTheMemoryPlanWithoutPlotDir(self):
        output = InProcess(f'--model={MLP}', '--mode=inspect_model').stdout
        self.assertIn('planned memory per device', output)
        self.assertNotIn('wrote', output)

    def testInspectModelPlotsAPaperSizeModelWithoutBuildingIt(self):
        # K=128 cells of 83.9B parameters, on more cells than devices: planned and drawn from
        # Params alone.
        plot_dir = os.path.join(self.LogDir(), 'plots')
        output = InProcess('--model=lm.TransformerL_1663', '--mode=inspect_model',
                           f'--plot_dir={plot_dir}', '--device_memory_gib=16').stdout
        self.AssertPngs(plot_dir, output)
        self.assertIn('K=128 M=32 batch=32', output)
        partition_table = output[:output.index('planned memory per device')]
        rows = [line for line in partition_table.splitlines() if line[:1].isdigit()]
        self.assertLen(rows, 128)
        self.assertIn('device:CPU:127', rows[-1])

    def testInspectModelWithPlotDirNeedsInputShapes(self):
        result = InProcess(f'--model={MLP}', '--mode=inspect_model', f'--plot_dir={self.LogDir()}',
                           "--model_params_override=model.partition_method : 'uniform'; "
                           'model.input_shapes : None', check=False)
        self.assertNotEqual(result.returncode, 0)
        self.assertIn('the plan pictures need model.input_shapes', result.stderr)

    def testAPlotDirThatIsAFileOrUnderOne(self):
        path = os.path.join(self.LogDir(), 'file')
        with open(path, 'w', encoding='utf-8') as f:
            f.write('not a directory')
        for plot_dir in (path, os.path.join(path, 'plots')):
            result = InProcess(f'--model={MLP}', '--mode=inspect_model', f'--plot_dir={plot_dir}',
                               check=False)
            self.assertEqual(result.returncode, 2, result.stderr)
            self.assertEqual(ErrorLine(result), f'error: --plot_dir={plot_dir}: {path} is a file, '
                             'not a directory; expected a directory for the pictures (created '
                             'if missing).')

    def testDeviceMemoryMustBePositive(self):
        result = InProcess(f'--model={MLP}', '--mode=inspect_model', '--device_memory_gib=0',
                           check=False)
        self.assertEqual(result.returncode, 2)
        self.assertIn('--device_memory_gib must be > 0, got 0.0', result.stderr)

    def testDeviceMemoryGbIsADeprecatedNameOfGib(self):
        tiny = '--device_memory_gib=0.00005'  # 54 kB: cells 1 and 2 of the MLP do not fit.
        new = InProcess(f'--model={MLP}', '--mode=inspect_model', tiny)
        old = InProcess(f'--model={MLP}', '--mode=inspect_model',
                        tiny.replace('_gib', '_gb'))
        self.assertEqual(old.stdout, new.stdout)
        self.assertEqual(new.stdout.split().count('NO'), 2)
        self.assertIn('--device_memory_gb is deprecated: use --device_memory_gib', old.stderr)
        self.assertNotIn('deprecated', new.stderr)
        both = InProcess(f'--model={MLP}', '--mode=inspect_model', tiny,
                         tiny.replace('_gib', '_gb'), check=False)
        self.assertEqual(both.returncode, 2)
        self.assertIn('--device_memory_gb is the old name of --device_memory_gib', both.stderr)

    def AssertImages(self, logdir, tags, step):
        images = Images(logdir)
        self.assertCountEqual(images, tags)
        for tag in tags:
            image_step, png = images[tag]
            self.assertEqual(image_step, step, tag)
            self.assertEqual(tf.io.decode_png(png).shape[-1], 4, tag)

    def testTrainingWritesThePicturesToTensorBoardOnce(self):
        logdir = self.LogDir()
        output = InProcess(f'--model={MLP}', f'--logdir={logdir}', '--max_steps=3',
                           f'--model_params_override={FAST}').stdout
        tags = [f'pipeline/{key}' for key in PLAN_PICTURES + ('timeline_measured',)]
        # The run's second step is traced: its first also traces the step function.
        self.AssertImages(logdir, tags, step=2)
        self.assertIn('pipeline pictures at step 2 in TensorBoard', output)

    def testV1GraphModeTracesItsStepToo(self):
        logdir = self.LogDir()
        InProcess(f'--model={MLP}', f'--logdir={logdir}', '--max_steps=2', '--graph_mode=v1',
                  f'--model_params_override={FAST}')
        self.AssertImages(logdir, [f'pipeline/{key}' for key in PLAN_PICTURES +
                                   ('timeline_measured',)], step=2)

    def testTracingChangesNoLoss(self):
        losses = {}
        for plot in (True, False):
            logdir = self.LogDir()
            InProcess(f'--model={MLP}', f'--logdir={logdir}', '--max_steps=4',
                      f'--model_params_override={FAST}; train.plot_pipeline : {plot}')
            self.assertEqual(bool(Images(logdir)), plot)
            losses[plot] = Scalars(logdir, 'loss')
        self.assertEqual(sorted(losses[True]), [1, 2, 3, 4])
        self.assertEqual(losses[True], losses[False])

    def testAPictureThatCannotBeDrawnIsAWarningNotAnError(self):
        logdir = self.LogDir()
        # Without input_shapes there is no plan to draw; the traced step still is.
        output = InProcess(f'--model={MLP}', f'--logdir={logdir}', '--max_steps=2',
                           "--model_params_override=model.partition_method : 'uniform'; "
                           'model.input_shapes : None').stdout
        self.assertRegex(output, r'step\s+2/2\s+loss \d+\.\d+')
        self.AssertImages(logdir, ['pipeline/timeline_measured'], step=2)


class PipelineFiguresTest(tf.test.TestCase):
    """The pictures' Params side, in this process: nothing is built."""

    def MlpParams(self, **overrides):
        p = base_task.SyncInputShapes(model_registry.GetParams(MLP, 'Train'))
        p.model.Set(**overrides)
        return p

    def testPlanFiguresOfTaskAndPipelineParams(self):
        p = self.MlpParams()
        for params in (p, p.model):
            figures = pictures.PlanFigures(params, MLP, device_bytes=2**20)
            self.assertCountEqual(figures, PLAN_PICTURES)
            self.assertIn('nominal 1 TFLOP/s per device',
                          figures['timeline_predicted'].axes[0].get_title())

    def testPredictedTimelineFollowsTheRecomputeMode(self):
        for mode, recomputing_cells in (('always', 4), ('except_last', 3), ('never', 0)):
            with self.subTest(mode=mode):
                plan = pictures.Plan(self.MlpParams(recompute=mode))
                kinds = [i.kind for i in pictures.PredictedTimeline(plan).intervals]
                self.assertEqual(kinds.count('recompute'), recomputing_cells * 8)
                self.assertEqual(kinds.count('forward'), 4 * 8)

    def testPlanFiguresNeedInputShapes(self):
        p = self.MlpParams(partition_method='uniform', input_shapes=None)
        with self.assertRaisesRegex(ValueError, r'need model\.input_shapes'):
            pictures.PlanFigures(p, MLP)

    def testPlanFiguresNeedAPipeline(self):
        p = self.MlpParams()
        p.model = p.model.layer_tpl[0]
        with self.assertRaisesRegex(ValueError, 'need a PipeliningLayer model; got DenseLayer'):
            pictures.PlanFigures(p, MLP)

    def testTheLoopsPicturesUseTheTrainersPlan(self):
        p = self.MlpParams()
        plan = plan_lib.MakePlan(p.model)
        events = [trace.OpEvent(f'model/cell_{k}_mb_{m}_fwd/MatMul', k + m, k + m + 1.0)
                  for k in range(plan.num_cells) for m in range(plan.num_micro_batches)]
        with mock.patch.object(plan_lib, 'MakePlan', side_effect=AssertionError('re-planned')):
            figures = loop.PipelineFigures(p, plan, 2, program.StepTrace(events=events))
        self.assertCountEqual(figures, PLAN_PICTURES + ('timeline_measured',))

    def testAModelThatIsNotAPipelineHasNoPictures(self):
        p = self.MlpParams()
        with self.assertLogs('absl', 'WARNING') as logs:
            figures = loop.PipelineFigures(p, None, 2, program.StepTrace(events=[]))
        self.assertEqual(figures, {})
        self.assertIn('is not a PipeliningLayer', '\n'.join(logs.output))

    def testFailedTracingLeavesTheMeasuredTimelineOut(self):
        p = self.MlpParams()
        with self.assertLogs('absl', 'WARNING') as logs:
            figures = loop.PipelineFigures(p, plan_lib.MakePlan(p.model), 2,
                                           program.StepTrace(error=RuntimeError('busy')))
        self.assertCountEqual(figures, PLAN_PICTURES)
        self.assertIn('tracing step 2 failed: busy', '\n'.join(logs.output))

    def testATraceWithoutPipelineOpsLeavesTheMeasuredTimelineOut(self):
        step_trace = program.StepTrace(events=[trace.OpEvent('loss/Mean', 0.0, 1.0)])
        with self.assertLogs('absl', 'WARNING') as logs:
            p = self.MlpParams()
            figures = loop.PipelineFigures(p, plan_lib.MakePlan(p.model), 2, step_trace)
        self.assertCountEqual(figures, PLAN_PICTURES)
        self.assertIn('None of the 1 traced ops is a pipeline op', '\n'.join(logs.output))


if __name__ == '__main__':
    tf.test.main()


@pytest.mark.unit
class FlagTableTest(tf.test.TestCase):
    """The flag table of docs/trainer.md names every flag the trainer defines
    (`trainer.DefineFlags`), and only those; a flag's row is its first column."""

    def testEveryFlagHasARowAndEveryRowAFlag(self):
        defined = absl_flags.FlagValues()
        trainer.DefineFlags(defined)
        page = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'docs',
                            'trainer.md')
        with open(page, encoding='utf-8') as f:
            rows = [line.split('|')[1] for line in f if line.startswith('| `--')]
        self.assertNotEmpty(rows, f'no flag table in {page}')
        in_table = set(re.findall(r'`--([a-z0-9_]+)', ''.join(rows)))
        deprecated = {'device_memory_gb'}  # Named in --device_memory_gib's row.
        self.assertEmpty(set(defined) - deprecated - in_table, 'flags without a row')
        self.assertEmpty(in_table - set(defined), 'rows without a flag')
