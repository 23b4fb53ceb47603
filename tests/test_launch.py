"""The launcher on real processes: it runs the trainer on its workers; it owns every process it
starts (SIGTERM or SIGKILL to it ends them all within a bound, after the trainer saved its
step); and its workers are unreachable from the host's network where the OS allows a private
network namespace.

Each test kills, by process id, what it started and what the launcher started, also when it
fails; every wait is bounded.
"""

import contextlib
import glob
import io
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from absl.testing import absltest

from gpipe_tf import launch
from gpipe_tf.train import cluster as cluster_lib

MLP = 'examples.PipelinedMLP'
# No periodic checkpoint: one that exists after a signal was written because of the signal.
OVERRIDES = 'train.save_interval_steps : 1000000; train.progress_interval_seconds : 0'
BOUND_S = 60  # From a signal to the launcher until every process it started is gone.
GRACE_S = 40  # The launcher's --grace_s: within BOUND_S.

# Enters a private network namespace in a fresh, single-threaded process (as the launcher's
# bootstrap does), then listens on every interface, as a tf.distribute.Server does.
_PROBE = '''\
import importlib.util, socket, sys
spec = importlib.util.spec_from_file_location('launch', sys.argv[1])
launch = importlib.util.module_from_spec(spec)
spec.loader.exec_module(launch)
problem = launch.EnterPrivateNetwork()
if problem:
    print('problem:', problem, flush=True)
    sys.exit(0)
server = socket.create_server(('0.0.0.0', 0))
port = server.getsockname()[1]
socket.create_connection(('127.0.0.1', port), timeout=5).close()  # Loopback is up.
print('listening', port, flush=True)
sys.stdin.read()
'''


def Env():
    return dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2')


def HostAddresses() -> list[str]:
    """127.0.0.1 and the address this host would use to reach other machines, if it has one."""
    addresses = ['127.0.0.1']
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(('192.0.2.255', 9))  # Sends nothing: picks the route's source address.
            if s.getsockname()[0] not in addresses:
                addresses.append(s.getsockname()[0])
        except OSError:
            pass
    return addresses


def StartTime(pid: int) -> str | None:
    """The process's start time (field 22 of /proc/<pid>/stat); None once it is dead (gone or
    a zombie)."""
    try:
        with open(f'/proc/{pid}/stat', encoding='ascii') as f:
            fields = f.read().rpartition(')')[2].split()
    except FileNotFoundError:
        return None
    return None if fields[0] in 'ZX' else fields[19]


def KillIfSame(pid: int, start_time: str) -> None:
    """SIGKILLs `pid` if it is still the process that started at `start_time`."""
    if StartTime(pid) == start_time:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def RunProbe(test, prefix=()) -> int:
    """Starts _PROBE (under `prefix`, e.g. another user); the port it listens on inside its
    namespace. Skips the test where the OS forbids the namespace."""
    # Another user may not read this checkout (Bazel's runfiles sit under root's 0700 home):
    # the probe runs a world-readable copy of launch.py, in a folder it can enter.
    folder = tempfile.mkdtemp()
    test.addCleanup(shutil.rmtree, folder)
    os.chmod(folder, 0o755)
    source = shutil.copy(launch.__file__, folder)
    os.chmod(source, 0o644)
    probe = subprocess.Popen(list(prefix) + [sys.executable, '-c', _PROBE, source],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             cwd=folder)
    test.addCleanup(cluster_lib.StopProcesses, [probe])
    test.addCleanup(probe.stdout.close)
    ready, _, _ = select.select([probe.stdout], [], [], 60)
    test.assertTrue(ready, 'the probe said nothing within 60 s')
    line = probe.stdout.readline().strip()
    if line.startswith('problem:'):
        test.skipTest(f'the OS forbids a private network namespace here ({line})')
    test.assertRegex(line, r'^listening \d+$')
    return int(line.split()[1])


class PrivateNetworkTest(absltest.TestCase):
    """EnterPrivateNetwork alone, in processes that do not import TensorFlow (fast)."""

    def testPortIsUnreachableFromTheHostNetwork(self):
        port = RunProbe(self)
        for host in HostAddresses():
            self.assertIsNotNone(cluster_lib.ConnectProblem(f'{host}:{port}', 2.0),
                                 f'{host}:{port} is reachable from the host network')

    def testUnprivilegedUserGetsOneToo(self):
        # As root, the user namespace path runs only for another user.
        if os.geteuid() != 0 or not shutil.which('setpriv'):
            self.skipTest('needs root and setpriv to run as another user; as a user, '
                          'testPortIsUnreachableFromTheHostNetwork covers this path')
        port = RunProbe(self, ['setpriv', '--reuid=65534', '--regid=65534', '--clear-groups'])
        for host in HostAddresses():
            self.assertIsNotNone(cluster_lib.ConnectProblem(f'{host}:{port}', 2.0))


class LaunchTest(absltest.TestCase):

    def testLaunchRunsTheTrainerOnTwoWorkersAndStopsThem(self):
        logdir = tempfile.mkdtemp(prefix='launch_test_')
        self.addCleanup(shutil.rmtree, logdir, ignore_errors=True)
        result = subprocess.run(
            [sys.executable, '-m', 'gpipe_tf.launch', '--num_workers=2', '--', f'--model={MLP}',
             '--worker_split_size=2', '--max_steps=2', f'--logdir={logdir}'],
            capture_output=True, text=True, timeout=300, env=Env())
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        self.assertIn('/job:worker/replica:0/task:1/device:CPU:0', result.stdout)
        self.assertIn('checkpoint', result.stdout)
        pids = [int(p) for p in re.search(r'stopped workers \[([\d, ]+)\]',
                                          result.stderr).group(1).split(',')]
        self.assertLen(pids, 2)
        for pid in pids:
            self.assertIsNone(StartTime(pid), f'worker {pid} still runs')

    def testLaunchNeedsTrainerFlags(self):
        result = subprocess.run([sys.executable, '-m', 'gpipe_tf.launch', '--num_workers=2'],
                                capture_output=True, text=True, timeout=120, env=Env())
        self.assertEqual(result.returncode, 2)
        self.assertIn('give the trainer\'s flags after --', result.stderr)

    def testRemoteLogdirNeedsTheHostNetwork(self):
        result = subprocess.run(
            [sys.executable, '-m', 'gpipe_tf.launch', '--', f'--model={MLP}',
             '--logdir=gs://bucket/run'], capture_output=True, text=True, timeout=120, env=Env())
        self.assertEqual(result.returncode, 2)
        self.assertRegex(result.stderr, r'--logdir=gs://bucket/run names a remote location.*'
                                        r'--network=host')
        self.assertNotIn('Traceback', result.stderr)


class ServeTest(absltest.TestCase):

    def AssertOneLine(self, message, *args):
        """`launch.Serve(*args)` exits 2 with one line `launch: error: <message> ...`."""
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr), self.assertRaises(SystemExit) as exit_:
            launch.Serve(*args)
        self.assertEqual(exit_.exception.code, 2)
        self.assertLen(stderr.getvalue().splitlines(), 1)
        self.assertStartsWith(stderr.getvalue(), f'launch: error: {message}')

    def testAClusterSpecThatDoesNotParseIsOneLine(self):
        self.AssertOneLine("--cluster_spec: cannot parse 'garbage'; expected job=host:port",
                           'garbage', 0, 'worker')

    def testATaskOrJobTheClusterLacksIsOneLine(self):
        self.AssertOneLine("--task=3: job 'worker' has tasks 0..0", 'worker=127.0.0.1:1', 3,
                           'worker')
        self.AssertOneLine('--job=ps: the cluster has no such job', 'worker=127.0.0.1:1', 0, 'ps')


class OwnershipTest(absltest.TestCase):
    """A training launched for long; then a signal to the launcher."""

    def setUp(self):
        super().setUp()
        self.dir = tempfile.mkdtemp(prefix='launch_own_')
        self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)
        self.logdir = os.path.join(self.dir, 'logdir')
        self.out, self.err = (os.path.join(self.dir, n) for n in ('out', 'err'))
        with open(self.out, 'w') as out, open(self.err, 'w') as err:
            self.launcher = subprocess.Popen(
                [sys.executable, '-m', 'gpipe_tf.launch', '--num_workers=2',
                 f'--grace_s={GRACE_S}', '--', f'--model={MLP}', '--worker_split_size=2',
                 '--max_steps=1000000', f'--logdir={self.logdir}', '--cluster_timeout_s=10',
                 f'--model_params_override={OVERRIDES}'],
                stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=Env())
        self.addCleanup(self._KillAll)
        self.started = {}  # pid: start time, of every process the launcher started.
        deadline = time.monotonic() + 300
        while not re.search(r'^step +\d+/', self._Read(self.out), re.M):
            self.assertIsNone(self.launcher.poll(), f'the launcher exited:\n{self._Tail()}')
            self.assertLess(time.monotonic(), deadline, f'no training step:\n{self._Tail()}')
            if not self.started:  # Known early, for _KillAll.
                self._FindPids()
            time.sleep(0.5)
        self._FindPids()
        self.assertLen(self.started, 3, self._Tail())

    def _Read(self, path):
        with open(path, encoding='utf-8', errors='replace') as f:
            return f.read()

    def _Tail(self):
        return f'stdout: {self._Read(self.out)[-1500:]}\nstderr: {self._Read(self.err)[-3000:]}'

    def _FindPids(self):
        found = re.search(r'launch: trainer pid (\d+), worker pids \[([\d, ]+)\]',
                          self._Read(self.err))
        if found:
            self.trainer = int(found.group(1))
            self.workers = [int(p) for p in found.group(2).split(',')]
            self.started = {p: StartTime(p) for p in [self.trainer] + self.workers}

    def _KillAll(self):
        if self.launcher.poll() is None:
            self.launcher.kill()
        self.launcher.wait()
        for pid, start_time in self.started.items():
            KillIfSame(pid, start_time)

    def _Checkpoints(self):
        return {int(re.search(r'ckpt-(\d+)\.index$', p).group(1))
                for p in glob.glob(os.path.join(self.logdir, 'train', 'ckpt-*.index'))}

    def _LastStepPrinted(self):
        return max(int(s) for s in re.findall(r'^step +(\d+)/', self._Read(self.out), re.M))

    def _AssertAllGoneWithin(self, since, bound_s):
        while True:
            alive = [p for p, t in self.started.items() if t is not None and StartTime(p) == t]
            if not alive:
                return time.monotonic() - since
            self.assertLess(time.monotonic() - since, bound_s,
                            f'still running after {bound_s} s: {alive}\n{self._Tail()}')
            time.sleep(0.2)

    def _AssertSavedTheStepItStoppedAt(self, seen_step):
        # No periodic checkpoints: any was written after the signal.
        self.assertTrue(self._Checkpoints(), f'no checkpoint:\n{self._Tail()}')
        self.assertGreaterEqual(max(self._Checkpoints()), seen_step, self._Tail())

    def _AssertNetworkAsTheOsAllows(self):
        """Workers and trainer share a private network namespace where the OS has them."""
        problem = subprocess.run([sys.executable, '-c', _PROBE, launch.__file__],
                                 input='', capture_output=True, text=True, timeout=60).stdout
        if problem.startswith('problem:'):
            self.assertIn('launch: warning: no private network namespace here',
                          self._Read(self.err))
            return
        networks = {os.readlink(f'/proc/{pid}/ns/net')
                    for pid in [self.launcher.pid] + list(self.started)}
        self.assertLen(networks, 1)
        self.assertNotEqual(networks.pop(), os.readlink('/proc/thread-self/ns/net'))
        ports = re.search(r'workers: worker=([\d.:,]+)', self._Read(self.err)).group(1)
        for port in re.findall(r':(\d+)', ports):
            for host in HostAddresses():
                self.assertIsNotNone(cluster_lib.ConnectProblem(f'{host}:{port}', 2.0),
                                     f'worker port {host}:{port} is reachable from the host')

    def testSigtermSavesTheStepAndEndsEveryProcess(self):
        seen_step = self._LastStepPrinted()
        signalled = time.monotonic()
        self.launcher.send_signal(signal.SIGTERM)
        try:
            status = self.launcher.wait(BOUND_S)
        except subprocess.TimeoutExpired:
            self.fail(f'the launcher still runs {BOUND_S} s after SIGTERM:\n{self._Tail()}')
        elapsed = self._AssertAllGoneWithin(signalled, BOUND_S)
        self.assertEqual(status, 128 + signal.SIGTERM, self._Tail())
        self.assertRegex(self._Read(self.err),
                         rf'launch: SIGTERM: sent SIGTERM to the trainer \(pid {self.trainer}\), '
                         r'which exited with status \d+ after [\d.]+ s; stopped workers '
                         r'\[[\d, ]+\]; exit status 143\.')
        self._AssertSavedTheStepItStoppedAt(seen_step)
        print(f'SIGTERM -> every process gone in {elapsed:.1f} s')

    def testSigkillEndsEveryProcessAfterTheTrainerSaved(self):
        self._AssertNetworkAsTheOsAllows()
        seen_step = self._LastStepPrinted()
        signalled = time.monotonic()
        self.launcher.kill()
        self.launcher.wait()
        elapsed = self._AssertAllGoneWithin(signalled, BOUND_S)
        # The trainer's parent-death signal is SIGTERM, and the workers wait for it to save.
        self._AssertSavedTheStepItStoppedAt(seen_step)
        print(f'SIGKILL -> every process gone in {elapsed:.1f} s')


if __name__ == '__main__':
    absltest.main()
