"""The trainer runs every schedule (--schedule, --virtual_stages) and gets gpipe's losses: the
schedule changes the order of the work, never the math. The runs are in this process."""

import os
import shutil
import tempfile

import tensorflow as tf
from absl.testing import parameterized

from gpipe_tf import test_utils

DEVICES = test_utils.ConfigureVirtualCpus()
MLP = 'examples.PipelinedMLP'  # Registered at K=4, M=8, R=1, with dropout.
FAST = ('train.summary_interval_steps : 1; train.save_interval_steps : 100; '
        'train.plot_pipeline : False')
STEPS = 4
RTOL = 1e-5


def Losses(*flags, overrides='') -> dict[int, float]:
    """{step: loss} of a fresh run of the MLP with `flags` (and Params `overrides`)."""
    logdir = tempfile.mkdtemp(prefix='schedules_')
    try:
        test_utils.TrainerInProcess(f'--model={MLP}',
                                    f'--model_params_override={FAST}; {overrides}',
                                    f'--logdir={logdir}', f'--max_steps={STEPS}', *flags)
        return test_utils.EventScalars(os.path.join(logdir, 'train'), 'loss')
    finally:
        shutil.rmtree(logdir, ignore_errors=True)


class TrainerSchedulesTest(tf.test.TestCase, parameterized.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.reference = {mode: Losses(f'--graph_mode={mode}') for mode in ('tf_function', 'v1')}

    @parameterized.parameters(
        ('zero_bubble', 'tf_function', True), ('interleaved_1f1b', 'v1', True),
        ('1f1b', 'tf_function', False), ('gpipe', 'v1', False),
        ('zero_bubble_v', 'tf_function', False))
    def testScheduleGivesGPipesLosses(self, kind, mode, unroll):
        flags = [f'--schedule={kind}', f'--graph_mode={mode}']
        if kind in ('interleaved_1f1b', 'zero_bubble_v'):  # 2 devices x 2 cells each.
            flags += ['--worker_split_size=2', '--virtual_stages=2']
        losses = Losses(*flags, overrides=f'model.unroll : {unroll}')
        self.assertEqual(sorted(losses), list(range(1, STEPS + 1)))
        for step, loss in self.reference[mode].items():
            self.assertAllClose(losses[step], loss, rtol=RTOL, atol=0, msg=f'step {step}')

    def testAScheduleThatCannotRunIsOneLine(self):
        result = test_utils.TrainerInProcess(
            f'--model={MLP}', '--schedule=interleaved_1f1b', '--virtual_stages=2',
            '--worker_split_size=2', '--num_micro_batches=1', '--mode=inspect_model',
            check=False)
        self.assertEqual(result.returncode, 2, result.stderr)
        self.assertIn('M (1) must be a multiple of K (2)', result.stderr)
        self.assertNotIn('Traceback', result.stderr)

    def testABadUnrollIsOneLine(self):
        result = test_utils.TrainerInProcess(
            f'--model={MLP}', '--model_params_override=model.unroll : "sometimes"',
            '--mode=inspect_model', check=False)
        self.assertEqual(result.returncode, 2, result.stderr)
        self.assertIn("model.unroll must be one of (True, False, 'auto'), got 'sometimes'",
                      result.stderr)
        self.assertNotIn('Traceback', result.stderr)


if __name__ == '__main__':
    tf.test.main()
