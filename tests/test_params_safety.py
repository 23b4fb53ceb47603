"""Params text is data, run through the real trainer process: a value naming a module outside
the gpipe_tf package (a module planted in the working directory, `this`, `os`) is refused before
anything is imported, and values that are surely mistakes (`save_interval_steps : 0`, a NaN
learning rate) are refused before training, naming the field."""

import os
import shutil
import subprocess
import sys
import tempfile

import tensorflow as tf

MLP = 'examples.PipelinedMLP'
TIMEOUT = 300
PLANTED = '''
open({marker!r}, 'w').close()


class Evil:
    pass
'''


class TrainerRefusesUnsafeParamsTest(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        # tempfile, not create_tempdir(): that needs absl flags, which pytest does not parse.
        self.dir = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.dir)
        self.logdir = os.path.join(self.dir, 'logdir')

    def Run(self, *flags, cwd=None):
        """Runs the trainer on the example model; returns the finished process."""
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2')
        return subprocess.run(
            [sys.executable, '-m', 'gpipe_tf.trainer', f'--model={MLP}',
             f'--logdir={self.logdir}', *flags],
            capture_output=True, text=True, timeout=TIMEOUT, env=env, cwd=cwd or self.dir)

    def assertRefused(self, result, field, *phrases):
        """A non-zero exit whose last line of stderr names `field` (and each phrase)."""
        self.assertNotEqual(result.returncode, 0, result.stdout + result.stderr)
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        self.assertNotEmpty(lines)
        for text in (field,) + phrases:
            self.assertIn(text, lines[-1], result.stderr[-3000:])

    def testAModulePlantedInTheWorkingDirectoryIsNeverImported(self):
        marker = os.path.join(self.dir, 'imported')
        with open(os.path.join(self.dir, 'planted_mod.py'), 'w') as f:
            f.write(PLANTED.format(marker=marker))
        # The plant works: importing it from this directory creates the marker.
        subprocess.run([sys.executable, '-c', 'import planted_mod'], cwd=self.dir, check=True,
                       timeout=60)
        self.assertTrue(os.path.exists(marker))
        os.remove(marker)
        params_file = os.path.join(self.dir, 'override.txt')
        with open(params_file, 'w') as f:
            f.write('train.learning_rate : 0.01\ninput.cls : type/planted_mod/Evil\n')
        result = self.Run('--mode=inspect_params', f'--model_params_file_override={params_file}')
        self.assertRefused(result, 'input.cls', 'type/planted_mod/Evil is not allowed')
        self.assertFalse(os.path.exists(marker))
        self.assertFalse(os.path.exists(os.path.join(self.logdir, 'params.txt')))

    def testModulesOutsideThePackageAreRefused(self):
        result = self.Run('--mode=inspect_params',
                          '--model_params_override=model.cls : type/this/X')
        self.assertRefused(result, 'model.cls', 'type/this/X is not allowed')
        self.assertNotIn('The Zen of Python', result.stdout + result.stderr)
        result = self.Run('--mode=inspect_params',
                          '--model_params_override=model.devices : callable/os/system')
        self.assertRefused(result, 'model.devices', 'callable/os/system is not allowed')

    def testZeroSaveIntervalIsRefusedBeforeTraining(self):
        result = self.Run('--mode=train', '--max_steps=2',
                          '--model_params_override=train.save_interval_steps : 0')
        self.assertRefused(result, 'train.save_interval_steps',
                           'must be a positive integer, got 0')
        self.assertNotIn('step 1', result.stdout)
        self.assertEqual(self.Checkpoints(), [])

    def testNanLearningRateIsRefusedBeforeTraining(self):
        result = self.Run('--mode=train', '--max_steps=2',
                          '--model_params_override=train.learning_rate : nan')
        self.assertRefused(result, 'train.learning_rate', 'must be a finite number > 0, got nan')
        self.assertEqual(self.Checkpoints(), [])

    def Checkpoints(self):
        found = []
        for root, _, files in os.walk(self.logdir):
            found += [os.path.join(root, f) for f in files if f.startswith('ckpt-')]
        return found


if __name__ == '__main__':
    tf.test.main()
