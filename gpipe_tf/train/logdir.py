"""The logdir: one trainer at a time, a private default, and small files written atomically.

- **One trainer per logdir.** A trainer holds an exclusive `flock` on `<logdir>/trainer.lock`
  for its whole run. The OS releases it when the process dies, however it dies, so a killed
  trainer never leaves a stale lock; the file keeps the holder's pid, host and start time for
  the error a second trainer gets. Eval and decode only read, and take no lock.
- **A private default.** Without `--logdir`, runs go to `<tmp>/gpipe_tf-<user>/<model>`: a
  folder created owner-only (0700) and refused when it is a symlink, another user's, or
  writable by others, so nobody else can plant a checkpoint or a symlink there. The `-` in its
  name keeps it from being imported as the `gpipe_tf` package by a script run from `<tmp>`.
- **Atomic small files.** `params.txt` and reports are written to a new temporary file beside
  the target and renamed over it: a crash leaves the old file or the new one, never half of
  one, and a symlink planted at the target is replaced, not written through.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import getpass
import json
import os
import shutil
import socket
import stat
import tempfile
from typing import Callable

from gpipe_tf import errors

LOCK_FILE = 'trainer.lock'


class LogdirBusyError(errors.UserError):
    """Another trainer holds the logdir's lock."""


class UnsafeLogdirError(errors.UserError):
    """A directory the trainer must not write into (a symlink, another user's, open to
    others)."""


def IsLocalPath(path: str) -> bool:
    """False for a filesystem TensorFlow reaches by URL (`gs://...`), where no OS lock exists."""
    return '://' not in path


def _UserName() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # No passwd entry (a container's arbitrary uid).
        return str(os.geteuid())


def _CheckPrivate(path: str) -> None:
    """Raises UnsafeLogdirError unless `path` is a real directory of this user that no one else
    may write into."""
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        raise UnsafeLogdirError(f'{path} is a symlink (to {os.readlink(path)!r}); refusing to '
                                'write through it. Remove it or pass --logdir.')
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeLogdirError(f'{path} is not a directory; remove it or pass --logdir.')
    if info.st_uid != os.geteuid():
        raise UnsafeLogdirError(f'{path} belongs to uid {info.st_uid}, not to you (uid '
                                f'{os.geteuid()}); refusing to use it. Pass --logdir.')
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeLogdirError(f'{path} is writable by other users (mode '
                                f'{stat.S_IMODE(info.st_mode):o}); refusing to use it. '
                                f'`chmod 700 {path}` or pass --logdir.')


def DefaultRoot() -> str:
    """`<tmp>/gpipe_tf-<user>`, this user's private root of default logdirs."""
    return os.path.join(tempfile.gettempdir(), f'gpipe_tf-{_UserName()}')


def DefaultLogdir(model: str) -> str:
    """`<DefaultRoot()>/<model>`, created owner-only if missing and checked to be private.

    Raises:
      UnsafeLogdirError: if the root or the model's folder is a symlink, another user's, or
        writable by others.
    """
    root = DefaultRoot()
    for path in (root, os.path.join(root, model)):
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        _CheckPrivate(path)
    return os.path.join(root, model)


class UnwritableLogdirError(errors.UserError):
    """A logdir that cannot be created or written (permissions, a read-only file system, a
    file where a directory must be)."""


def FileInTheWay(path: str) -> str | None:
    """The nearest existing path at or above local `path` when it is not a directory (a file
    where `path`, or a directory above it, would be); None when directories can be made there
    (or for a URL such as `gs://...`)."""
    if not IsLocalPath(path):
        return None
    existing = _NearestExisting(path)
    return None if os.path.isdir(existing) else existing


def _NearestExisting(path: str) -> str:
    """The absolute local `path`, or its nearest ancestor that exists."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    return existing


def _FileInTheWayMessage(logdir: str, where: str) -> str:
    if where == os.path.abspath(logdir):
        return f'--logdir={logdir} is a file, not a directory.'
    return (f'--logdir={logdir}: {where} is a file, not a directory; expected a logdir whose '
            'parents are directories: remove the file or pass another --logdir.')


def CheckCreatable(logdir: str) -> None:
    """Fails early (before anything is built) when the nearest existing directory of a local
    `logdir` is not writable by this process (`os.access`; a superuser's denials show only
    when `MakeDirs` tries).

    Raises:
      UnwritableLogdirError: naming the directory, or the file where the logdir or a directory
        above it would be.
    """
    if not IsLocalPath(logdir):
        return
    in_the_way = FileInTheWay(logdir)
    if in_the_way:
        raise UnwritableLogdirError(_FileInTheWayMessage(logdir, in_the_way))
    existing = _NearestExisting(logdir)
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UnwritableLogdirError(_Unwritable(logdir, existing, 'permission denied'))


def MakeDirs(directory: str) -> None:
    """os.makedirs, a denial as one line naming the directory.

    Raises:
      UnwritableLogdirError: when the directory cannot be created (permissions, read-only, a
        file where it or a directory above it would be).
    """
    try:
        os.makedirs(directory, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as error:
        where = FileInTheWay(directory) or error.filename or directory
        raise UnwritableLogdirError(_Unwritable(directory, where, 'a file, not a directory')
                                    ) from None
    except OSError as error:
        raise UnwritableLogdirError(_Unwritable(directory, error.filename or directory,
                                                error.strerror or str(error))) from None


class DiskFault(errors.EnvironmentFault):
    """A file of the run could not be written for a reason of the machine's (a full disk, an
    I/O error)."""


# A path's own problem, the user's to fix: permissions, a read-only file system, a file where
# a directory must be or a directory where a file must be.
_PATH_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS, errno.EISDIR, errno.ENOTDIR,
                errno.EEXIST)


@contextlib.contextmanager
def Writing(path: str | None, what: str):
    """A failure of the file system while writing `what` (the logdir's summaries, params, an
    export) at `path` (None: where TensorFlow's message says) as one line: a path the user must
    fix as UnwritableLogdirError, any other (a full disk) as DiskFault. A cluster's failures (a
    task gone) pass through."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    try:
        yield
    except (tf.errors.DeadlineExceededError, tf.errors.UnavailableError,
            tf.errors.AbortedError, tf.errors.CancelledError):
        raise
    except (OSError, tf.errors.OpError) as error:
        raise WriteFault(path, what, error) from None


def WriteFault(path: str | None, what: str, error: Exception) -> Exception:
    """The one-line error for `error` (an OSError or a TensorFlow OpError), raised writing
    `what` at `path` (`Writing`)."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    why = errors.Reason(error, path) or type(error).__name__
    if isinstance(error, OSError):
        user = error.errno in _PATH_ERRNOS
    else:
        user = isinstance(error, (tf.errors.PermissionDeniedError,
                                  tf.errors.FailedPreconditionError,
                                  tf.errors.AlreadyExistsError))
    where = f'{what} at {path}' if path else what
    if user:
        return UnwritableLogdirError(f'cannot write {where}: {why}; fix that path (its '
                                     'permissions, or a file or directory in the way), or pass '
                                     'another --logdir.')
    return DiskFault(f'could not write {where}: {why}. The checkpoints written before it are '
                     'kept; free space (or fix the cause) and run the same command again.')


def _Unwritable(logdir: str, where: str, why: str) -> str:
    return (f'cannot write the logdir {logdir}: {where}: {why.lower()}; pass a --logdir in a '
            'directory this user may write.')


@contextlib.contextmanager
def RemovedAfterAMistake(logdir: str, holds_checkpoint: Callable[[str], bool]):
    """A local logdir that this run creates is removed again when the run ends in a user's
    mistake (errors.UserError) before a checkpoint is written into it
    (`holds_checkpoint(logdir)`): a mistake leaves nothing behind. A logdir that existed
    before, or holds a checkpoint, is kept as it is."""
    created = IsLocalPath(logdir) and not os.path.lexists(logdir)
    try:
        yield
    except errors.UserError:
        if created and os.path.isdir(logdir) and not holds_checkpoint(logdir):
            shutil.rmtree(logdir, ignore_errors=True)
        raise


def WriteAtomically(path: str, text: str, what: str = 'a file') -> str:
    """Writes `text` to `path` through a temporary file in the same directory renamed over it;
    returns `path`. A symlink at `path` is replaced, never followed.

    Raises:
      UnwritableLogdirError, DiskFault: when it cannot be written (`Writing`); nothing is
        left of the attempt.
    """
    directory = os.path.dirname(os.path.abspath(path))
    MakeDirs(directory)
    with Writing(path, what):
        fd, temp = tempfile.mkstemp(prefix=f'.{os.path.basename(path)}.', dir=directory)
        try:
            with os.fdopen(fd, 'w', encoding='utf-8') as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(temp, 0o644 & ~_Umask())
            os.replace(temp, path)
        except BaseException:
            if os.path.lexists(temp):
                os.unlink(temp)
            raise
    return path


def _Umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


class Lock:
    """The exclusive lock of a logdir, held until `Release()` or the process ends."""

    def __init__(self, logdir: str):
        self.logdir = logdir
        self.path = os.path.join(logdir, LOCK_FILE)
        self._fd = None

    def Acquire(self) -> 'Lock':
        """Takes the lock, or fails at once.

        Raises:
          LogdirBusyError: naming the holder (pid, host, start time) when another process has
            it.
          UnsafeLogdirError: when the lock file is a symlink.
        """
        MakeDirs(self.logdir)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as error:
            if os.path.islink(self.path):
                raise UnsafeLogdirError(f'{self.path} is a symlink; refusing to follow it. '
                                        'Remove it.') from None
            raise WriteFault(self.path, 'the trainer lock', error) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _ReadHolder(fd)
            os.close(fd)
            raise LogdirBusyError(f'{self.logdir} is in use by another trainer ({holder}); '
                                  'wait for it to end, stop it, or pass another --logdir.'
                                  ) from None
        holder = {'pid': os.getpid(), 'host': socket.gethostname(),
                  'started': datetime.datetime.now().astimezone().isoformat(timespec='seconds')}
        try:
            with Writing(self.path, 'the trainer lock'):
                os.ftruncate(fd, 0)
                os.pwrite(fd, (json.dumps(holder) + '\n').encode(), 0)
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return self

    def Release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # Closing the descriptor releases the flock.
            self._fd = None

    def __enter__(self):
        return self.Acquire()

    def __exit__(self, *exc):
        self.Release()


def _ReadHolder(fd: int) -> str:
    try:
        holder = json.loads(os.pread(fd, 4096, 0).decode() or '{}')
        return f'pid {holder["pid"]} on {holder["host"]}, started {holder["started"]}'
    except (ValueError, KeyError, OSError):
        return 'holder unknown: it is starting'


def ReadParams(logdir: str) -> str | None:
    """The text of `<logdir>/params.txt` (the last start's Params), or None without one."""
    # TensorFlow's gfile reads a gs:// logdir too; imported here, so that taking the lock
    # (all a lock holder needs of this module) does not load TensorFlow.
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    path = os.path.join(logdir, 'params.txt')
    try:
        with tf.io.gfile.GFile(path) as f:
            return f.read()
    except (tf.errors.NotFoundError, UnicodeDecodeError):
        return None
    except tf.errors.OpError as error:  # A directory there, or one this user may not read.
        raise UnwritableLogdirError(f'cannot read {path}: {errors.Reason(error, path)}; make it a '
                                    'file this user may read and write, or pass another '
                                    '--logdir.') from None


def WriteParams(text: str, logdir: str) -> str:
    """Writes Params `text` to `<logdir>/params.txt` atomically (creating logdir); returns the
    path."""
    return WriteAtomically(os.path.join(logdir, 'params.txt'), text, 'the Params')


# Where runs went before the default became private; a note points there, never a resume.
_OLD_DEFAULT_ROOT = '/tmp/gpipe_tf'


def Resolve(logdir: str | None, model: str) -> str:
    """--logdir `logdir`, or the user's private default for `model` (created and checked).

    Raises:
      UnwritableLogdirError: when `logdir`, or a directory above it, is a file.
      UnsafeLogdirError: for an unsafe default (`DefaultLogdir`).
    """
    if logdir:
        in_the_way = FileInTheWay(logdir)
        if in_the_way:
            raise UnwritableLogdirError(_FileInTheWayMessage(logdir, in_the_way))
        return logdir
    logdir = DefaultLogdir(model)
    old = os.path.join(_OLD_DEFAULT_ROOT, model, 'train')
    if not os.listdir(logdir) and os.path.isdir(old) and any(
            name.endswith('.index') for name in os.listdir(old)):
        errors.Warn(f'the default logdir is now {logdir}; checkpoints of an earlier run are in '
                    f'the old shared default {os.path.dirname(old)}: pass '
                    f'--logdir={os.path.dirname(old)} to resume them (after checking who else '
                    'can write there).')
    return logdir


def LockOrWarn(logdir: str):
    """The logdir's trainer lock, as a context manager that takes and releases it (a warning,
    and no lock, for a logdir that is not a local path). Entering raises
    LogdirBusyError naming the holder."""
    if not IsLocalPath(logdir):
        errors.Warn(f'{logdir} is not a local path: no lock keeps a second trainer out of it.')
        return contextlib.nullcontext()
    return Lock(logdir)
