"""The logdir: an exclusive trainer lock that dies with its holder, a private default root that
is refused when unsafe, and atomic writes that never follow a symlink
(`gpipe_tf.train.logdir`). The trainer's use of them: test_trainer.py (RecoveryTest)."""

import errno
import importlib.machinery
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile

import pytest
import tensorflow as tf

from gpipe_tf import errors
from gpipe_tf.train import checkpoints
from gpipe_tf.train import logdir as logdir_lib

# Holds the lock of argv[1], says so, and sleeps until killed.
HOLDER = ('import sys, time\n'
          'from gpipe_tf.train import logdir\n'
          'logdir.Lock(sys.argv[1]).Acquire()\n'
          'print("locked", flush=True)\n'
          'time.sleep(600)\n')


class LogdirTestCase(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        self.dir = tempfile.mkdtemp(prefix='logdir_test_')
        self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)


class LockTest(LogdirTestCase):

    def testASecondHolderIsRefusedNamingTheFirst(self):
        with logdir_lib.Lock(self.dir):
            with self.assertRaisesRegex(
                    logdir_lib.LogdirBusyError,
                    rf'^{self.dir} is in use by another trainer \(pid {os.getpid()} on '
                    r'\S+, started \d{4}-\d\d-\d\dT[\d:]+[+-][\d:]+\); .*--logdir\.$'):
                logdir_lib.Lock(self.dir).Acquire()
        logdir_lib.Lock(self.dir).Acquire().Release()  # Released at the end of the block.

    def testAKilledHolderLeavesNoStaleLock(self):
        holder = subprocess.Popen([sys.executable, '-c', HOLDER, self.dir],
                                  stdout=subprocess.PIPE, text=True)
        try:
            self.assertEqual(holder.stdout.readline().strip(), 'locked')
            with self.assertRaisesRegex(logdir_lib.LogdirBusyError, f'pid {holder.pid} '):
                logdir_lib.Lock(self.dir).Acquire()
            holder.send_signal(signal.SIGKILL)
            holder.wait(timeout=60)
        finally:
            if holder.poll() is None:
                holder.kill()
            holder.stdout.close()
        logdir_lib.Lock(self.dir).Acquire().Release()

    def testALockFileThatIsASymlinkIsRefused(self):
        victim = os.path.join(self.dir, 'victim')
        with open(victim, 'w') as f:
            f.write('keep')
        logdir = os.path.join(self.dir, 'run')
        os.mkdir(logdir)
        os.symlink(victim, os.path.join(logdir, logdir_lib.LOCK_FILE))
        with self.assertRaisesRegex(logdir_lib.UnsafeLogdirError, 'is a symlink'):
            logdir_lib.Lock(logdir).Acquire()
        with open(victim) as f:
            self.assertEqual(f.read(), 'keep')


@pytest.mark.unit
class DefaultLogdirTest(LogdirTestCase):

    def setUp(self):
        super().setUp()
        self.enterContext(tf.compat.v1.test.mock.patch.object(tempfile, 'tempdir', self.dir))
        self.root = logdir_lib.DefaultRoot()

    def testCreatedOwnerOnlyUnderTheTempDirectory(self):
        logdir = logdir_lib.DefaultLogdir('examples.PipelinedMLP')
        self.assertEqual(logdir, os.path.join(self.root, 'examples.PipelinedMLP'))
        self.assertEqual(os.path.dirname(self.root), self.dir)
        for path in (self.root, logdir):
            self.assertEqual(stat.S_IMODE(os.stat(path).st_mode), 0o700)
        self.assertEqual(logdir_lib.DefaultLogdir('examples.PipelinedMLP'), logdir)

    def testNotImportableFromTheTempDirectory(self):
        logdir_lib.DefaultLogdir('m')
        self.assertIsNone(importlib.machinery.PathFinder.find_spec('gpipe_tf', [self.dir]))
        self.assertFalse(os.path.basename(self.root).isidentifier())  # No `import` names it.

    def testRefusedWhenASymlinkAnotherUsersOrOpenToOthers(self):
        elsewhere = tempfile.mkdtemp(dir=self.dir)
        os.symlink(elsewhere, self.root)
        with self.assertRaisesRegex(logdir_lib.UnsafeLogdirError,
                                    rf'^{self.root} is a symlink .*--logdir\.$'):
            logdir_lib.DefaultLogdir('m')
        os.remove(self.root)
        os.mkdir(self.root, 0o700)
        os.chmod(self.root, 0o777)
        with self.assertRaisesRegex(logdir_lib.UnsafeLogdirError, 'writable by other users'):
            logdir_lib.DefaultLogdir('m')
        os.chmod(self.root, 0o700)
        if os.geteuid() == 0:  # Only root can give a folder away.
            os.chown(self.root, 12345, 12345)
            with self.assertRaisesRegex(logdir_lib.UnsafeLogdirError,
                                        r'belongs to uid 12345, not to you'):
                logdir_lib.DefaultLogdir('m')
        self.assertIsInstance(logdir_lib.UnsafeLogdirError('x'), errors.UserError)


@pytest.mark.unit
class FileInTheWayTest(LogdirTestCase):
    """A file where a logdir, or a directory above it, would be is a user's error naming the
    file, from each of the functions that meet it; never an OSError's traceback."""

    def setUp(self):
        super().setUp()
        self.file = os.path.join(self.dir, 'file')
        with open(self.file, 'w') as f:
            f.write('not a directory')

    def testTheFileIsFoundAtOrAboveThePath(self):
        self.assertEqual(logdir_lib.FileInTheWay(self.file), self.file)
        self.assertEqual(logdir_lib.FileInTheWay(os.path.join(self.file, 'a', 'b')), self.file)
        self.assertIsNone(logdir_lib.FileInTheWay(os.path.join(self.dir, 'a', 'b')))
        self.assertIsNone(logdir_lib.FileInTheWay('gs://bucket/run'))

    def testALogdirUnderAFileIsAUserErrorNamingTheFile(self):
        logdir = os.path.join(self.file, 'run')
        expected = (rf'^--logdir={logdir}: {self.file} is a file, not a directory; expected a '
                    r'logdir whose parents are directories')
        for check in (logdir_lib.CheckCreatable, lambda d: logdir_lib.Resolve(d, 'm')):
            with self.assertRaisesRegex(logdir_lib.UnwritableLogdirError, expected):
                check(logdir)
        self.assertIsInstance(logdir_lib.UnwritableLogdirError('x'), errors.UserError)

    def testMakeDirsAndTheLockNameTheFileInTheirWay(self):
        for directory in (self.file, os.path.join(self.file, 'run')):
            with self.assertRaisesRegex(logdir_lib.UnwritableLogdirError,
                                        rf'^cannot write the logdir {directory}: {self.file}: a '
                                        'file, not a directory;'):
                logdir_lib.MakeDirs(directory)
        with self.assertRaisesRegex(logdir_lib.UnwritableLogdirError, 'a file, not a directory'):
            logdir_lib.Lock(os.path.join(self.file, 'run')).Acquire()


@pytest.mark.unit
class WriteAtomicallyTest(LogdirTestCase):

    def testReplacesASymlinkInsteadOfWritingThroughIt(self):
        victim = os.path.join(self.dir, 'victim')
        with open(victim, 'w') as f:
            f.write('keep')
        path = os.path.join(self.dir, 'params.txt')
        os.symlink(victim, path)
        logdir_lib.WriteAtomically(path, 'new text\n')
        self.assertFalse(os.path.islink(path))
        with open(path) as f:
            self.assertEqual(f.read(), 'new text\n')
        with open(victim) as f:
            self.assertEqual(f.read(), 'keep')

    def testLeavesNoTemporaryFileBehind(self):
        path = os.path.join(self.dir, 'params.txt')
        logdir_lib.WriteAtomically(path, 'a\n')
        logdir_lib.WriteAtomically(path, 'b\n')
        self.assertEqual(os.listdir(self.dir), ['params.txt'])

    def testADirectoryInTheWayIsOneLineAndLeavesNothing(self):
        path = os.path.join(self.dir, 'params.txt')
        os.mkdir(path)
        with self.assertRaisesRegex(
                logdir_lib.UnwritableLogdirError,
                rf'^cannot write the Params at {path}: Is a directory; fix that path'):
            logdir_lib.WriteParams('a\n', self.dir)
        self.assertEqual(os.listdir(self.dir), ['params.txt'])


class FileFaultsTest(LogdirTestCase):
    """What the run writes into the logdir fails as one line: a path to fix is the user's
    (UnwritableLogdirError, exit 2), a full disk the machine's (DiskFault, exit 1)."""

    def Raised(self, error):
        with self.assertRaises(Exception) as raised:
            with logdir_lib.Writing('/logdir/train', 'the summaries'):
                raise error
        return raised.exception

    def testAPathToFixIsTheUsers(self):
        for error in (PermissionError(errno.EACCES, 'Permission denied'),
                      OSError(errno.EROFS, 'Read-only file system'),
                      tf.errors.PermissionDeniedError(None, None, 'Permission denied'),
                      tf.errors.FailedPreconditionError(
                          None, None, '{{function_node __wrapped__CreateSummaryFileWriter}} '
                          'Not a directory [Op:CreateSummaryFileWriter] name:')):
            with self.subTest(error):
                fault = self.Raised(error)
                self.assertIsInstance(fault, logdir_lib.UnwritableLogdirError)
                self.assertRegex(str(fault), r'^cannot write the summaries at /logdir/train: '
                                 r'(Permission denied|Read-only file system|Not a directory); '
                                 r'fix that path')

    def testAFullDiskIsTheMachines(self):
        for error in (OSError(errno.ENOSPC, 'No space left on device'),
                      tf.errors.ResourceExhaustedError(None, None,
                                                       '/logdir/train; No space left on device')):
            with self.subTest(error):
                fault = self.Raised(error)
                self.assertIsInstance(fault, errors.EnvironmentFault)
                self.assertEqual(str(fault), 'could not write the summaries at /logdir/train: '
                                 'No space left on device. The checkpoints written before it '
                                 'are kept; free space (or fix the cause) and run the same '
                                 'command again.')

    def testAClusterThatDoesNotAnswerPassesThrough(self):
        unavailable = tf.errors.UnavailableError(None, None, 'worker gone')
        self.assertIs(self.Raised(unavailable), unavailable)

    def testALockOrParamsThatAreDirectoriesAreOneLine(self):
        os.mkdir(os.path.join(self.dir, logdir_lib.LOCK_FILE))
        with self.assertRaisesRegex(logdir_lib.UnwritableLogdirError,
                                    r'cannot write the trainer lock at .*: Is a directory'):
            logdir_lib.Lock(self.dir).Acquire()
        params = os.path.join(self.dir, 'params.txt')
        os.mkdir(params)
        with self.assertRaisesRegex(logdir_lib.UnwritableLogdirError,
                                    rf'^cannot read {params}: Is a directory; make it a file'):
            logdir_lib.ReadParams(self.dir)


if __name__ == '__main__':
    tf.test.main()


@pytest.mark.unit
class RemovedAfterAMistakeTest(tf.test.TestCase):
    """A logdir the failed run created, holding no checkpoint, goes; anything else stays."""

    def Fail(self, logdir, error, write=('params.txt',)):
        with self.assertRaises(type(error)):
            with logdir_lib.RemovedAfterAMistake(
                    logdir, lambda d: checkpoints.AnyFiles(os.path.join(d, 'train'))):
                for name in write:
                    path = os.path.join(logdir, name)
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                    with open(path, 'w') as f:
                        f.write('x')
                raise error

    def testACreatedLogdirGoesAfterAMistake(self):
        logdir = os.path.join(self.get_temp_dir(), 'created')
        self.Fail(logdir, errors.InputError('bad file'))
        self.assertFalse(os.path.exists(logdir))

    def testWhatHoldsACheckpointOrExistedOrFailedByABugStays(self):
        with_checkpoint = os.path.join(self.get_temp_dir(), 'with_checkpoint')
        self.Fail(with_checkpoint, errors.InputError('late'), write=('train/ckpt-4.index',))
        self.assertTrue(os.path.exists(os.path.join(with_checkpoint, 'train/ckpt-4.index')))
        existing = os.path.join(self.get_temp_dir(), 'existing')
        os.makedirs(existing)
        self.Fail(existing, errors.InputError('bad file'))
        self.assertTrue(os.path.exists(os.path.join(existing, 'params.txt')))
        bug = os.path.join(self.get_temp_dir(), 'bug')
        self.Fail(bug, KeyError('ours'))  # A traceback: what it left is evidence.
        self.assertTrue(os.path.exists(os.path.join(bug, 'params.txt')))
