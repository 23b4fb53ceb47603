"""The training loop's handling of stop signals (`gpipe_tf.train.loop`): SIGINT, SIGTERM and
SIGHUP stop training after the running step and save it; a second signal stops a step at once;
a signal that arrives while a checkpoint is being written waits until it is complete. A stand-in program records what the loop asked of
it, so each signal lands at a known point.

Also the console progress (step, loss, examples/sec, ETA on a fake clock) and, on a stand-in
program, what a run writes: scalars every `summary_interval_steps` and at the end, checkpoints
every `save_interval_steps` and at the end, evaluations every `eval_interval_steps` and at the
end, the resume and nothing-to-train lines, and a non-finite loss stopping training with the
last good checkpoint kept."""

import os
import shutil
import signal
import tempfile
import time
import types
from unittest import mock

import pytest
import tensorflow as tf

from gpipe_tf import model_registry
from gpipe_tf import test_utils
from gpipe_tf.train import loop

pytestmark = pytest.mark.unit


class RecordingProgram:
    """Steps count up; `Save` records (step, complete) and can send a signal mid-save."""

    def __init__(self, signal_at_step=None, signal_in_save_at=None, signum=signal.SIGTERM,
                 signals_per_step=1):
        self.step = 0
        self.finished_steps = 0
        self.saves = []  # (step, complete)
        self.manager = types.SimpleNamespace(latest_checkpoint=None)
        self._signal_at_step, self._signal_in_save_at = signal_at_step, signal_in_save_at
        self._signum, self._signals_per_step = signum, signals_per_step

    def Restore(self):
        return self.step

    def Step(self):
        self.step += 1
        if self.step == self._signal_at_step:
            for _ in range(self._signals_per_step):
                os.kill(os.getpid(), self._signum)
        self.finished_steps += 1  # Not reached when a signal stops the step half-way.
        return {'loss': 1.0}

    def Save(self):
        self.saves.append((self.step, False))
        if self.step == self._signal_in_save_at:
            # The handler runs at the next bytecode: still inside this save.
            os.kill(os.getpid(), self._signum)
        self.saves[-1] = (self.step, True)
        self.manager.latest_checkpoint = f'ckpt-{self.step}'
        return self.manager.latest_checkpoint

    def CurrentStep(self):
        return self.step

    def LearningRate(self):
        return 0.1


class TrainSignalsTest(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        self.params = model_registry.GetParams('examples.PipelinedMLP', 'Train')
        self.params.train.Set(save_interval_steps=4, summary_interval_steps=1000,
                              plot_pipeline=False)
        self.logdir = tempfile.mkdtemp(prefix='loop_test_')
        self.addCleanup(shutil.rmtree, self.logdir, ignore_errors=True)

    def Train(self, program):
        return loop.Train(program, self.params, self.logdir, 20, printer=lambda *a, **k: None)

    def testEachStopSignalSavesTheStepItStoppedAt(self):
        for signum in loop.STOP_SIGNALS:
            with self.subTest(signal.Signals(signum).name):
                program = RecordingProgram(signal_at_step=6, signum=signum)
                with self.assertRaises(loop.Interrupted) as raised:
                    self.Train(program)
                self.assertEqual((raised.exception.signum, raised.exception.step,
                                  raised.exception.checkpoint), (signum, 6, 'ckpt-6'))
                self.assertEqual(program.saves, [(4, True), (6, True)])

    def testASignalDuringASaveWaitsUntilTheSaveIsComplete(self):
        program = RecordingProgram(signal_in_save_at=8)
        with self.assertRaises(loop.Interrupted) as raised:
            self.Train(program)
        # The save at step 8 finished; the loop stopped right after it, and no step ran since.
        self.assertEqual(program.saves, [(4, True), (8, True)])
        self.assertEqual((raised.exception.step, raised.exception.checkpoint), (8, 'ckpt-8'))
        self.assertEqual(program.step, 8)

    def testASignalDuringTheLastSaveStopsTheRun(self):
        # Max steps 18 is no multiple of 4: the run ends in a save of its own, and a signal
        # there is not lost (the run says it was stopped, and a final eval would not start).
        program = RecordingProgram(signal_in_save_at=18)
        with self.assertRaises(loop.Interrupted) as raised:
            loop.Train(program, self.params, self.logdir, 18, printer=lambda *a, **k: None)
        self.assertEqual(program.saves[-1], (18, True))
        self.assertEqual((raised.exception.step, raised.exception.checkpoint), (18, 'ckpt-18'))

    def testASecondSignalStopsTheStepHalfWayAndSavesTheProgramsStep(self):
        program = RecordingProgram(signal_at_step=6, signals_per_step=2)
        with self.assertRaises(loop.Interrupted) as raised:
            self.Train(program)
        self.assertEqual(program.finished_steps, 5)
        self.assertEqual(raised.exception.step, 6)
        self.assertEqual(program.saves, [(4, True), (6, True)])

    def testTheHandlersAreRestoredAfterwards(self):
        before = {s: signal.getsignal(s) for s in loop.STOP_SIGNALS}
        self.Train(RecordingProgram())
        with self.assertRaises(loop.Interrupted):
            self.Train(RecordingProgram(signal_at_step=2))
        self.assertEqual({s: signal.getsignal(s) for s in loop.STOP_SIGNALS}, before)


class FakeClock:
    """time.time() of the loop, set by the test."""

    def __init__(self, now=1000.0):
        self.now = now

    def time(self):
        return self.now


class ProgressTest(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        self.clock = FakeClock()
        patcher = mock.patch.object(loop, 'time', self.clock)
        patcher.start()
        self.addCleanup(patcher.stop)
        self.lines = []

    def Progress(self, first_step=0, max_steps=100, batch_size=32, interval=10.0):
        return loop.Progress(first_step, max_steps, batch_size, interval,
                             printer=lambda line, flush: self.lines.append(line))

    def testTheFirstStepsLineHasNoRateThenExamplesPerSecondAndETA(self):
        progress = self.Progress()
        progress.Update(1, {'loss': 2.0, 'accuracy': 0.125})
        self.clock.now += 5.0
        progress.Update(2, {'loss': 1.75})  # Within the interval: no line.
        self.clock.now += 5.0
        progress.Update(3, {'loss': 1.5, 'accuracy': 0.25})
        # 2 steps in the 10 s since step 1: 0.2 steps/s of 32 examples; 97 steps left: 485 s.
        self.assertEqual(self.lines, [
            'step      1/100  loss 2.0000  accuracy 0.125',
            'step      3/100  loss 1.5000  accuracy 0.250  6 examples/sec  ETA 8:05'])

    def testForceAddsALineWithinTheInterval(self):
        progress = self.Progress(max_steps=4, batch_size=10, interval=60.0)
        progress.Update(1, {'loss': 1.0})
        self.clock.now += 3.0
        progress.Update(4, {'loss': 0.5}, force=True)
        self.assertEqual(self.lines[1], 'step      4/4  loss 0.5000  10 examples/sec  ETA 0:00')

    def testAResumedRunTimesItsOwnSteps(self):
        progress = self.Progress(first_step=5000, max_steps=10000, batch_size=1, interval=0.0)
        progress.Update(5001, {'loss': 1.0})
        self.clock.now += 100.0
        progress.Update(5101, {'loss': 1.0})
        # 1 step/s; 4899 steps left: 1 h 21 min 39 s.
        self.assertEqual(self.lines[1], 'step   5101/10000  loss 1.0000  1 examples/sec  '
                                        'ETA 1:21:39')

    def testTheRateIsThatOfTheRecentLinesOnly(self):
        progress = self.Progress(max_steps=1000, batch_size=1, interval=0.0)
        progress.Update(1, {'loss': 1.0})
        self.clock.now += 100.0  # A slow start: 1 step in 100 s.
        progress.Update(2, {'loss': 1.0})
        for step in range(3, 3 + loop.Progress.RECENT_LINES):
            self.clock.now += 1.0  # Then 1 step/s.
            progress.Update(step, {'loss': 1.0})
        # The slow start has left the window: 1 step/s, 994 steps left.
        self.assertEqual(self.lines[-1], 'step      7/1000  loss 1.0000  1 examples/sec  '
                                         'ETA 16:33')

    def testAnEvaluationIsNotTrainingTime(self):
        progress = self.Progress(max_steps=1000, batch_size=1, interval=0.0)
        progress.Update(1, {'loss': 1.0})
        self.clock.now += 10.0
        progress.Update(11, {'loss': 1.0})  # 1 step/s.
        with progress.Excluding():
            self.clock.now += 500.0  # An evaluation during training.
        self.clock.now += 10.0
        progress.Update(21, {'loss': 1.0})
        # Still 1 step/s (20 steps in 20 s of training): 979 steps left, not 979 x 26.
        self.assertEqual(self.lines[-1], 'step     21/1000  loss 1.0000  1 examples/sec  '
                                         'ETA 16:19')

    def testALineAtTheSameClockTimeHasNoRate(self):
        progress = self.Progress(max_steps=2, interval=0.0)
        progress.Update(1, {'loss': 1.0})
        progress.Update(2, {'loss': 0.5}, force=True)  # No time has passed (a coarse clock).
        self.assertEqual(self.lines[-1], 'step      2/2  loss 0.5000')

    def testFormatDuration(self):
        for seconds, text in ((0, '0:00'), (59.6, '1:00'), (61, '1:01'), (3600, '1:00:00'),
                              (3725.4, '1:02:05'), (90061, '25:01:01')):
            self.assertEqual(loop.FormatDuration(seconds), text, seconds)


class ScriptedProgram:
    """A stand-in program whose step s reports loss `losses[s - 1]`; records its saves and
    evaluations."""

    def __init__(self, losses, start_step=0):
        self.step = start_step
        self.losses = losses
        self.saves, self.evaluations = [], []
        self.manager = types.SimpleNamespace(
            latest_checkpoint=f'ckpt-{start_step}' if start_step else None)

    def Restore(self):
        return self.step

    def Step(self):
        # A step that takes no time on the clock would divide by zero in the loop's rates.
        time.sleep(1e-3)
        self.step += 1
        return {'loss': self.losses[self.step - 1], 'accuracy': 0.5}

    def Save(self):
        self.saves.append(self.step)
        self.manager.latest_checkpoint = f'ckpt-{self.step}'
        return self.manager.latest_checkpoint

    def Evaluate(self, input_params):
        del input_params
        self.evaluations.append(self.step)
        return {'loss': 10.0 + self.step}

    def CurrentStep(self):
        return self.step

    def LearningRate(self):
        return 0.1 * self.step


def Scalars(directory, tag):
    """{step: value} of scalar `tag` in the event files under `directory`."""
    return test_utils.EventScalars(directory, tag)


class TrainWritesTest(tf.test.TestCase):
    """8 steps; summaries every 3, checkpoints every 4, evaluations every 2."""

    MAX_STEPS = 8
    LOSSES = [2.0 - 0.125 * i for i in range(10)]

    def setUp(self):
        super().setUp()
        self.params = model_registry.GetParams('examples.PipelinedMLP', 'Train')
        self.params.train.Set(summary_interval_steps=3, save_interval_steps=4,
                              eval_interval_steps=2, progress_interval_seconds=1000.0,
                              plot_pipeline=False)
        self.logdir = tempfile.mkdtemp(prefix='loop_test_')
        self.addCleanup(shutil.rmtree, self.logdir, ignore_errors=True)
        self.lines = []

    def Train(self, program, eval_params=None):
        return loop.Train(program, self.params, self.logdir, self.MAX_STEPS, eval_params,
                          printer=lambda line, flush: self.lines.append(line))

    def testScalarsEverySummaryIntervalAndAtTheEnd(self):
        metrics = self.Train(ScriptedProgram(self.LOSSES))
        self.assertEqual(metrics, {'loss': self.LOSSES[7], 'accuracy': 0.5})
        train_dir = os.path.join(self.logdir, 'train')
        self.assertEqual(Scalars(train_dir, 'loss'),
                         {3: self.LOSSES[2], 6: self.LOSSES[5], 8: self.LOSSES[7]})
        self.assertEqual(Scalars(train_dir, 'accuracy'), {3: 0.5, 6: 0.5, 8: 0.5})
        self.assertAllClose(Scalars(train_dir, 'learning_rate'), {3: 0.3, 6: 0.6, 8: 0.8})
        for tag in ('step_time', 'examples_per_sec'):
            self.assertEqual(sorted(Scalars(train_dir, tag)), [3, 6, 8], tag)
        times, rates = Scalars(train_dir, 'step_time'), Scalars(train_dir, 'examples_per_sec')
        for step, step_time in times.items():
            self.assertAllClose(rates[step], self.params.input.batch_size / step_time,
                                rtol=1e-5)

    def testCheckpointsEverySaveIntervalAndAtTheEnd(self):
        program = ScriptedProgram(self.LOSSES)
        self.Train(program)
        self.assertEqual(program.saves, [4, 8])  # Step 8 is saved once.
        self.assertEqual(self.lines[-1], 'checkpoint ckpt-8 at step 8')

    def testProgressLinesAtTheFirstAndTheLastStep(self):
        self.Train(ScriptedProgram(self.LOSSES))
        steps = [line for line in self.lines if line.startswith('step ')]
        self.assertLen(steps, 2)
        self.assertEqual(steps[0], f'step      1/8  loss {self.LOSSES[0]:.4f}  accuracy 0.500')
        self.assertRegex(steps[1], rf'^step      8/8  loss {self.LOSSES[7]:.4f}  accuracy 0.500'
                                   r'  [\d,]+ examples/sec  ETA 0:00$')

    def testEvaluationsEveryEvalIntervalAndAtTheEnd(self):
        program = ScriptedProgram(self.LOSSES)
        metrics = self.Train(program, eval_params=object())
        self.assertEqual(program.evaluations, [2, 4, 6, 8])  # Step 8 is evaluated once.
        self.assertEqual(Scalars(os.path.join(self.logdir, 'eval'), 'loss'),
                         {2: 12.0, 4: 14.0, 6: 16.0, 8: 18.0})
        self.assertEqual(metrics['eval_loss'], 18.0)
        self.assertEqual(metrics['loss'], self.LOSSES[7])
        self.assertLen([line for line in self.lines if line.startswith('eval during training')],
                       3)
        self.assertRegex(self.lines[-1], r'^eval final at step 8: loss 18\.0000  \(\d+\.\d s\)$')

    def testAResumedRunSaysWhereItResumedAndRunsTheRemainingSteps(self):
        program = ScriptedProgram(self.LOSSES, start_step=5)
        self.Train(program)
        self.assertEqual(self.lines[0], 'resumed from ckpt-5 at step 5')
        self.assertEqual(program.step, 8)
        self.assertEqual(program.saves, [8])
        self.assertEqual(sorted(Scalars(os.path.join(self.logdir, 'train'), 'loss')), [6, 8])

    def testAtMaxStepsNothingIsTrainedOrSaved(self):
        program = ScriptedProgram(self.LOSSES, start_step=8)
        self.assertEqual(self.Train(program), {})
        self.assertIn('already at step 8 >= max_steps 8; nothing to train.', self.lines)
        self.assertEqual((program.step, program.saves), (8, []))

    def testMaxStepsZeroTrainsNothingAndSaysThereIsNoCheckpoint(self):
        program = ScriptedProgram(self.LOSSES)
        self.MAX_STEPS = 0
        self.assertEqual(self.Train(program), {})
        self.assertEqual(self.lines, ['max_steps 0 trains no step; no checkpoint is written.'])
        self.assertEqual((program.step, program.saves), (0, []))

    def testANonFiniteLossStopsTrainingAndKeepsTheLastGoodCheckpoint(self):
        for bad in (float('nan'), float('inf')):
            with self.subTest(bad):
                losses = list(self.LOSSES)
                losses[5] = bad  # Step 6.
                program = ScriptedProgram(losses)
                with self.assertRaisesRegex(loop.NonFiniteLossError,
                                            rf'The loss is {bad} at step 6: training stopped\. '
                                            r'The last good checkpoint is ckpt-4'):
                    self.Train(program)
                self.assertEqual(program.saves, [4])  # Step 6 is not saved.
                self.assertEqual(program.step, 6)


if __name__ == '__main__':
    tf.test.main()
