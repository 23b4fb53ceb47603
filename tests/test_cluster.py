"""The pipeline across processes: worker tasks on 127.0.0.1 run the stages through TensorFlow's
distributed runtime; a dead, hung or missing worker is a clear error in bounded time; a restart
resumes from the last checkpoint.

Every server this starts is stopped by its process id (also when a test fails), and every wait
is bounded. As root, the servers and trainers run in a private network namespace (see
setUpModule); the launcher's own tests are in test_launch.py.
"""

import ctypes
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from absl.testing import absltest

from gpipe_tf import errors
from gpipe_tf import launch
from gpipe_tf import test_utils
from gpipe_tf.train import cluster as cluster_lib

MLP = 'examples.PipelinedMLP'
OVERRIDES = 'train.summary_interval_steps : 1; train.save_interval_steps : 2'
TIMEOUT_S = 10  # --cluster_timeout_s for the failure tests.
BOUND_S = 60  # The bound from a worker's death or hang to the error.


_CLONE_NEWNET = 0x40000000
_host_network = None  # The main thread's network namespace before setUpModule, to return to.


def setUpModule():
    """Moves the main thread, which starts every server and trainer here, into a private
    network namespace: they are born in it, unreachable from other hosts, and so are this
    test's connections to them (Linux namespaces belong to threads). Only as root: a user
    namespace needs a single-threaded process, and could not be left again."""
    global _host_network
    if os.geteuid() != 0 or not sys.platform.startswith('linux'):
        print('test_cluster: servers on the host network (a private network namespace for '
              'a multithreaded test process needs root on Linux)', file=sys.stderr)
        return
    host = os.open('/proc/thread-self/ns/net', os.O_RDONLY)
    problem = launch.EnterPrivateNetwork(allow_user_namespace=False)
    if problem:
        os.close(host)
        print(f'test_cluster: servers on the host network ({problem})', file=sys.stderr)
    else:
        _host_network = host


def tearDownModule():
    global _host_network
    if _host_network is not None:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(_host_network, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), 'setns back to the host network namespace')
        os.close(_host_network)
        _host_network = None


def Trainer(*flags):
    return [sys.executable, '-m', 'gpipe_tf.trainer', f'--model={MLP}', '--worker_split_size=2',
            f'--model_params_override={OVERRIDES}'] + list(flags)


def Env():
    return dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2')


def Run(*flags):
    result = subprocess.run(Trainer(*flags), capture_output=True, text=True, timeout=300,
                            env=Env())
    if result.returncode:
        raise AssertionError(f'trainer failed ({result.returncode}):\n{result.stdout}\n'
                             f'{result.stderr[-3000:]}')
    return result.stdout


def Losses(logdir):
    return test_utils.EventScalars(os.path.join(logdir, 'train'), 'loss')


class ClusterSpecTest(absltest.TestCase):

    def testLingvoForm(self):
        spec = cluster_lib.ParseClusterSpec('worker=127.0.0.1:1,127.0.0.1:2@ps=10.0.0.1:3')
        self.assertEqual(spec.job_tasks('worker'), ['127.0.0.1:1', '127.0.0.1:2'])
        self.assertEqual(spec.job_tasks('ps'), ['10.0.0.1:3'])
        self.assertEqual(cluster_lib.StageDevices(spec, 2)[1],
                         '/job:worker/replica:0/task:1/device:CPU:0')
        self.assertEqual(cluster_lib.Target(spec), 'grpc://127.0.0.1:1')

    def testTfConfig(self):
        spec = cluster_lib.FromTfConfig(
            '{"cluster": {"worker": ["127.0.0.1:5", "127.0.0.1:6"]}, "task": {"index": 0}}')
        self.assertEqual(spec.num_tasks('worker'), 2)

    def testBadInput(self):
        for text in ('worker', 'worker=', 'worker=localhost', '=127.0.0.1:1', ''):
            with self.assertRaisesRegex(ValueError, 'cluster_spec'):
                cluster_lib.ParseClusterSpec(text)
        with self.assertRaisesRegex(ValueError, 'given twice'):
            cluster_lib.ParseClusterSpec('worker=a:1@worker=b:2')
        with self.assertRaisesRegex(ValueError, 'TF_CONFIG must be JSON'):
            cluster_lib.FromTfConfig('{"task": {}}')
        spec = cluster_lib.ParseClusterSpec('worker=a:1')
        with self.assertRaisesRegex(ValueError, '2 pipeline stages .* need 2 tasks'):
            cluster_lib.StageDevices(spec, 2)
        with self.assertRaisesRegex(ValueError, 'no job \'chief\''):
            cluster_lib.StageDevices(spec, 1, 'chief')


    def testBadInputIsTheUsersToFix(self):
        # A ConfigError: the trainer prints it as one line `error: ...`, without a traceback.
        with self.assertRaisesRegex(errors.ConfigError, r"^--cluster_spec: cannot parse "
                                    r"'worker=nonsense'; expected job=host:port"):
            cluster_lib.ParseClusterSpec('worker=nonsense')
        with self.assertRaisesRegex(errors.ConfigError, r'^--cluster_spec must be JSON'):
            cluster_lib.FromTfConfig('{bad json', '--cluster_spec')


class LocalClusterTest(absltest.TestCase):
    """Two worker processes; the trainer is a third (the client)."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.reference_dir = tempfile.mkdtemp(prefix='cluster_reference_')
        Run('--graph_mode=v1', '--max_steps=8', f'--logdir={cls.reference_dir}')
        cls.reference = Losses(cls.reference_dir)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.reference_dir, ignore_errors=True)
        super().tearDownClass()

    def setUp(self):
        super().setUp()
        self.ports = cluster_lib.FreePorts(2)
        self.spec = cluster_lib.LocalClusterSpec(2, self.ports)
        self.workers = [cluster_lib.StartServer(self.spec, task) for task in range(2)]
        self.addCleanup(cluster_lib.StopProcesses, self.workers)
        if _host_network is not None:  # setUpModule's namespace holds them.
            host = os.readlink(f'/proc/self/fd/{_host_network}')
            for worker in self.workers:
                self.assertNotEqual(os.readlink(f'/proc/{worker.pid}/ns/net'), host)
        cluster_lib.WaitUntilListening(self.spec, 60, self.workers)
        self.logdir = tempfile.mkdtemp(prefix='cluster_test_')
        self.addCleanup(shutil.rmtree, self.logdir, ignore_errors=True)

    def _Start(self, max_steps=100000):
        process = subprocess.Popen(
            Trainer(f'--cluster_spec={self.spec}', f'--cluster_timeout_s={TIMEOUT_S}',
                    f'--max_steps={max_steps}', f'--logdir={self.logdir}'),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=Env())
        self.addCleanup(cluster_lib.StopProcesses, [process])
        return process

    def _WaitForCheckpoint(self, process, timeout_s=120):
        deadline = time.monotonic() + timeout_s
        while not glob.glob(os.path.join(self.logdir, 'train', 'ckpt-*.index')):
            self.assertIsNone(process.poll(), 'the trainer exited before its first checkpoint')
            self.assertLess(time.monotonic(), deadline, 'no checkpoint in time')
            time.sleep(0.2)

    def _SignalWorkerDuringARun(self, sig):
        """Sends `sig` to worker 1 once a run has checkpointed; (trainer output, seconds from
        the signal to the trainer's failure)."""
        trainer = self._Start()
        self._WaitForCheckpoint(trainer)
        signalled = time.monotonic()
        os.kill(self.workers[1].pid, sig)
        return self._ErrorWithin(trainer, signalled)

    def _ErrorWithin(self, process, since):
        try:
            output, _ = process.communicate(timeout=BOUND_S + 60)
        except subprocess.TimeoutExpired:
            self.fail(f'the trainer did not stop within {BOUND_S + 60} s')
        elapsed = time.monotonic() - since
        self.assertNotEqual(process.returncode, 0, output[-2000:])
        self.assertLessEqual(elapsed, BOUND_S, output[-2000:])
        return output, elapsed

    def testMultiProcessLossesEqualSingleProcess(self):
        output = Run(f'--cluster_spec={self.spec}', '--max_steps=8', f'--logdir={self.logdir}')
        self.assertIn('/job:worker/replica:0/task:1/device:CPU:0', output)
        losses = Losses(self.logdir)
        self.assertEqual(sorted(losses), list(range(1, 9)))
        for step, loss in losses.items():
            self.assertAlmostEqual(loss, self.reference[step], delta=1e-5 * abs(loss),
                                   msg=f'step {step}')

    def testKilledWorkerIsAClearErrorThenARestartResumes(self):
        output, elapsed = self._SignalWorkerDuringARun(signal.SIGKILL)
        self.assertRegex(output, r'Unreachable: /job:worker/task:1 at 127\.0\.0\.1:\d+: no '
                                 r'process accepts connections')
        print(f'killed worker -> error in {elapsed:.1f} s')
        # Restart the task on its port; the trainer resumes from its last checkpoint.
        saved = max(int(re.search(r'ckpt-(\d+)', p).group(1))
                    for p in glob.glob(os.path.join(self.logdir, 'train', 'ckpt-*.index')))
        self.workers[1] = cluster_lib.StartServer(self.spec, 1)
        cluster_lib.WaitUntilListening(self.spec, 60, self.workers)
        output = Run(f'--cluster_spec={self.spec}', f'--max_steps={saved + 3}',
                     f'--logdir={self.logdir}')
        self.assertIn(f'at step {saved}', output)
        losses = Losses(self.logdir)
        for step in range(saved + 1, min(saved + 4, 9)):
            self.assertAlmostEqual(losses[step], self.reference[step],
                                   delta=1e-5 * abs(losses[step]), msg=f'step {step}')

    def testHungWorkerIsAClearErrorInBoundedTime(self):
        output, elapsed = self._SignalWorkerDuringARun(signal.SIGSTOP)
        self.assertRegex(output, r'Unreachable: /job:worker/task:1 at 127\.0\.0\.1:\d+: it '
                                 r'accepts connections but does not answer')
        print(f'stopped worker -> error in {elapsed:.1f} s')

    def testWorkerThatIsNotRunningIsAClearError(self):
        # Task 1 is gone before the trainer starts (as if it never started).
        cluster_lib.StopProcesses(self.workers[1:])
        started = time.monotonic()
        result = subprocess.run(
            Trainer(f'--cluster_spec={self.spec}', f'--cluster_timeout_s={TIMEOUT_S}',
                    '--max_steps=4', f'--logdir={self.logdir}'),
            capture_output=True, text=True, timeout=BOUND_S + 60, env=Env())
        self.assertNotEqual(result.returncode, 0)
        self.assertLessEqual(time.monotonic() - started, BOUND_S)
        self.assertRegex(result.stderr, rf'error: Unreachable: /job:worker/task:1 at '
                                        rf'127\.0\.0\.1:{self.ports[1]}: no process accepts '
                                        r'connections')
        self.assertNotIn('Traceback', result.stderr)


if __name__ == '__main__':
    absltest.main()
