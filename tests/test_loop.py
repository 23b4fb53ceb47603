"""The training loop's handling of stop signals (`gpipe_tf.train.loop`): SIGINT, SIGTERM and
SIGHUP stop training after the running step and save it; a second signal stops a step at once;
a signal that arrives while a checkpoint is being written waits until it is complete. A stand-in program records what the loop asked of
it, so each signal lands at a known point."""

import os
import shutil
import signal
import tempfile
import types

import pytest
import tensorflow as tf

from gpipe_tf import model_registry
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


if __name__ == '__main__':
    tf.test.main()
