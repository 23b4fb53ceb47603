r"""Local multi-process runs: K `tf.distribute.Server` processes on 127.0.0.1, then the trainer.

    python -m gpipe_tf.launch --num_workers=2 -- --model=examples.PipelinedMLP \
        --worker_split_size=2 --logdir=/tmp/mlp_cluster

starts two worker tasks on free ports of 127.0.0.1, waits until both listen, runs
`python -m gpipe_tf.trainer <flags after --> --cluster_spec=worker=127.0.0.1:p0,127.0.0.1:p1`
(stage k on task k), and stops the workers when the trainer exits. Its exit status is the
trainer's. A worker process alone: `python -m gpipe_tf.launch --serve --cluster_spec=... --task=i`.

The launcher owns its processes: whatever ends it, the trainer and the workers end too.
- They run in sessions of their own, so a terminal's Ctrl-C reaches the launcher only.
- SIGINT, SIGTERM or SIGHUP to the launcher: it sends the trainer SIGINT (for SIGINT) or SIGTERM
  once; the trainer saves the step it stopped at and exits. A trainer still running after
  `--grace_s`, or after a second signal to the launcher, is killed. Only then do the workers
  stop: the trainer's variables live on them. The launcher exits with 128 + the signal's
  number (130, 143, 129) after one line on stderr saying what it did.
- SIGKILL to the launcher (or any other death): the trainer gets SIGTERM, its parent-death
  signal (Linux prctl), and saves. Each worker sees its stdin, a pipe from the launcher, close;
  it waits for the trainer to exit, SIGKILLs it after `--grace_s`, and exits.

The network. A `tf.distribute.Server` listens on every interface whatever its cluster spec says
(TensorFlow 2.21 builds the listening address as "0.0.0.0:<port>" in grpc_server_lib.cc; no
option or environment variable changes it) and runs any op that a client sends, unauthenticated:
ReadFile, WriteFile. So by default (`--network=private`) the launcher runs the whole job, the
workers and the trainer (which must reach them), in a network namespace of its own whose only
interface is loopback: no other host can reach the workers. That needs Linux and either root
or unprivileged user namespaces. Where the OS forbids it, or with `--network=host` (needed to
reach remote storage, e.g. a gs:// logdir, which the private namespace cannot), the job runs on
the host's network and the launcher prints one warning.

Why the launcher re-executes itself: `python -m gpipe_tf.launch` imports the package, hence
TensorFlow, which starts threads, and only a single-threaded process may enter a new user
namespace. So the launcher replaces itself (same pid) by a bootstrap that loads this file by
path (its top level needs only the standard library), enters the namespace, and then runs
the launcher there.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
_IFREQ = '16sH22x'  # struct ifreq: the interface's name, then ifr_flags in a 24-byte union.

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

_BOOTSTRAP = '''\
import importlib.util, sys
spec = importlib.util.spec_from_file_location('gpipe_tf_launch_bootstrap', sys.argv[1])
bootstrap = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bootstrap)
bootstrap.RunInPrivateNetwork(sys.argv[1], sys.argv[2:])
'''


# ---- the network -----------------------------------------------------------------------------
def EnterPrivateNetwork(allow_user_namespace: bool = True) -> str | None:
    """Moves this process into a new network namespace whose only interface is loopback, up.

    Processes started afterwards share it: they reach each other on 127.0.0.1, and nothing
    outside it reaches them. The network namespace alone needs CAP_SYS_ADMIN (root); otherwise
    a user namespace of its own grants it, which needs a single-threaded process (call this
    before TensorFlow is imported) and cannot be left again. In a process with threads only
    the calling thread moves: Linux namespaces belong to threads.

    Args:
      allow_user_namespace: whether to try a user namespace when the network namespace alone
        is not permitted.

    Returns:
      None when done, else why not, in one line.

    Raises:
      OSError: if the namespace was made but its loopback cannot be brought up (the process
        has no network left then).
    """
    if not sys.platform.startswith('linux'):
        return f'network namespaces need Linux; this is {sys.platform}'
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWNET) != 0:
        alone = os.strerror(ctypes.get_errno())
        if not allow_user_namespace:
            return f'unshare(CLONE_NEWNET): {alone}'
        uid, gid = os.getuid(), os.getgid()
        if libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET) != 0:
            return (f'unshare(CLONE_NEWNET): {alone}; with a user namespace: '
                    f'{os.strerror(ctypes.get_errno())}')
        # The same ids inside as outside, so that the job's files belong to the user and the
        # job keeps no capability after exec.
        for name, text in (('setgroups', 'deny'), ('uid_map', f'{uid} {uid} 1'),
                           ('gid_map', f'{gid} {gid} 1')):
            with open(f'/proc/self/{name}', 'w', encoding='ascii') as f:
                f.write(text)
    _BringUpLoopback()
    return None


def _BringUpLoopback() -> None:
    """`ip link set lo up` without the `ip` tool: a new namespace's loopback starts down."""
    import fcntl  # pylint: disable=g-import-not-at-top
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack(_IFREQ, fcntl.ioctl(s, _SIOCGIFFLAGS,
                                                  struct.pack(_IFREQ, b'lo', 0)))[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack(_IFREQ, b'lo', flags | _IFF_UP))


def _ReexecInPrivateNetwork(argv: list[str]) -> None:
    """Replaces this process (same pid) by the bootstrap; continues in RunInPrivateNetwork."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, '-c', _BOOTSTRAP, os.path.abspath(__file__)]
             + argv)


def RunInPrivateNetwork(launch_file: str, argv: list[str]) -> None:
    """The bootstrap's part: enters the namespace while single-threaded, then launches."""
    for signum in STOP_SIGNALS:  # Until Launch's own handlers; nothing to stop before them.
        signal.signal(signum, lambda signum, frame: sys.exit(128 + signum))
    try:
        problem = EnterPrivateNetwork()
    except OSError as error:
        print(f'launch: error: a private network namespace was made, but its loopback cannot '
              f'be brought up ({error}); run with --network=host.', file=sys.stderr, flush=True)
        sys.exit(1)
    # The package this file belongs to, whatever the current directory holds.
    sys.path.insert(0, os.path.dirname(os.path.dirname(launch_file)))
    from gpipe_tf import launch  # pylint: disable=g-import-not-at-top
    args, trainer_flags = launch.ParseArgs(argv)
    sys.exit(launch.Launch(args, trainer_flags, exposure=problem and (
        f'no private network namespace here ({problem})')))


# ---- a worker --------------------------------------------------------------------------------
def Serve(cluster_spec: str, task: int, job: str, supervised: bool = False) -> None:
    """Runs one task of the cluster until killed; with `supervised`, also until its stdin
    closes (see `_Supervised`)."""
    if supervised:
        threading.Thread(target=_Supervised, daemon=True).start()
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from gpipe_tf.train import cluster as cluster_lib  # pylint: disable=g-import-not-at-top
    try:
        cluster = cluster_lib.ParseClusterSpec(cluster_spec)
    except ValueError as error:  # errors.ConfigError: the malformed part, the expected form.
        _UserError(str(error).rstrip('.'))
    if job not in cluster.jobs:
        _UserError(f'--job={job}: the cluster has no such job (jobs: {cluster.jobs})')
    if not 0 <= task < cluster.num_tasks(job):
        _UserError(f'--task={task}: job {job!r} has tasks 0..{cluster.num_tasks(job) - 1}')
    server = tf.distribute.Server(cluster, job_name=job, task_index=task,
                                  config=tf.compat.v1.ConfigProto(device_count={'CPU': 1}))
    print(f'/job:{job}/task:{task} serving at {cluster.task_address(job, task)} '
          f'(pid {os.getpid()})', file=sys.stderr, flush=True)
    server.join()


def TellWorkers(workers: list[subprocess.Popen], trainer_pid: int, grace_s: float) -> None:
    """Names the trainer to supervised workers: the line `_Supervised` reads."""
    for worker in workers:
        try:
            worker.stdin.write(f'{trainer_pid} {grace_s}\n'.encode())
            worker.stdin.flush()
        except OSError:  # That worker is gone; the trainer will name it.
            pass


def _Supervised() -> None:
    """A launcher's worker: stdin is a pipe from the launcher, which closes when the launcher
    ends, however it ends (SIGKILL too; this works where prctl does not exist). The trainer
    then has SIGTERM from its parent-death signal and saves its checkpoint, whose variables
    live on the workers: so the worker waits until the trainer the launcher named is gone,
    SIGKILLs it after its grace period, and only then exits."""
    trainer = None
    for line in sys.stdin:
        try:
            pid, grace_s = line.split()
            trainer = int(pid), float(grace_s)
        except ValueError:  # Not the launcher's line; the pipe's end is what matters.
            pass
    if trainer:
        _EndWithin(*trainer)
    os.kill(os.getpid(), signal.SIGTERM)


def _EndWithin(pid: int, grace_s: float) -> None:
    """Waits until process `pid` (not a child) exits, SIGKILLing it after `grace_s`."""
    try:
        # A pidfd names this very process, even after its pid is reused.
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):  # No pidfd (not Linux >= 5.3): poll the pid.
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.5)
        os.kill(pid, signal.SIGKILL)
        return
    try:
        exited, _, _ = select.select([pidfd], [], [], grace_s)
        if not exited:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    finally:
        os.close(pidfd)


# ---- the launcher ----------------------------------------------------------------------------
class _Signals:
    """Records SIGINT, SIGTERM and SIGHUP to the launcher for its supervising loop, which acts
    on them between waits (a handler that acted itself could interrupt a process start)."""

    def __init__(self):
        self.first, self.count, self.at = None, 0, 0.0
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._Handle)

    def _Handle(self, signum, frame):
        del frame
        self.count += 1
        if self.first is None:
            self.first, self.at = signum, time.monotonic()

    @property
    def name(self) -> str:
        return signal.Signals(self.first).name


def _Supervise(trainer: subprocess.Popen, signals: _Signals, grace_s: float) -> tuple[int, str]:
    """Waits for the trainer, forwarding the launcher's first stop signal to it once; (its exit
    status, what happened after a signal)."""
    from gpipe_tf.train import cluster as cluster_lib  # pylint: disable=g-import-not-at-top
    forwarded = None
    while True:
        if signals.first is not None and forwarded is None:
            # SIGINT stays SIGINT (the trainer treats Ctrl-C as Ctrl-C); SIGHUP becomes
            # SIGTERM: the trainer has no terminal to hang up.
            forwarded = signal.SIGINT if signals.first == signal.SIGINT else signal.SIGTERM
            cluster_lib.SignalProcess(trainer, forwarded)
        try:
            status = trainer.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            pass
        else:
            if forwarded is None:
                return status, ''
            return status, (f'sent {forwarded.name} to the trainer (pid {trainer.pid}), which '
                            f'exited with status {status} after '
                            f'{time.monotonic() - signals.at:.1f} s')
        if forwarded is not None and (signals.count > 1 or
                                      time.monotonic() - signals.at > grace_s):
            why = ('a second signal came' if signals.count > 1 else
                   f'it did not exit within --grace_s={grace_s:g} s')
            cluster_lib.SignalProcess(trainer, signal.SIGKILL)
            return trainer.wait(), (f'sent {forwarded.name} to the trainer (pid {trainer.pid}); '
                                    f'killed it: {why}')


def Launch(args: argparse.Namespace, trainer_flags: list[str], exposure: str | None) -> int:
    """Runs the workers and the trainer; the exit status (the trainer's, or 128 + a signal).

    Args:
      args: the launcher's flags (ParseArgs).
      trainer_flags: the trainer's flags.
      exposure: None when the job runs in a private network namespace, else why it does not.
    """
    from gpipe_tf.train import cluster as cluster_lib  # pylint: disable=g-import-not-at-top
    signals = _Signals()
    spec = cluster_lib.LocalClusterSpec(args.num_workers)
    if exposure is None:
        print(f'launch: {args.num_workers} workers: {spec}, in a private network namespace '
              '(loopback only: no other host reaches them).', file=sys.stderr, flush=True)
    else:
        print(f'launch: {args.num_workers} workers: {spec}.\nlaunch: warning: {exposure}: the '
              'workers listen on every interface of this host and run any op sent to their '
              'ports, without authentication; firewall these ports (docs/reliability.md, '
              '"Security model of the worker servers").', file=sys.stderr, flush=True)
    workers, trainer, status, what = [], None, None, ''
    try:
        for task in range(args.num_workers):
            workers.append(cluster_lib.StartServer(spec, task))
        cluster_lib.WaitUntilListening(spec, args.start_timeout_s, workers,
                                       cancelled=lambda: signals.first is not None)
        if signals.first is None:
            trainer = cluster_lib.StartOwnedProcess(
                [sys.executable, '-m', 'gpipe_tf.trainer'] + trainer_flags +
                [f'--cluster_spec={spec}'])
            TellWorkers(workers, trainer.pid, args.grace_s)
            print(f'launch: trainer pid {trainer.pid}, worker pids {[w.pid for w in workers]}',
                  file=sys.stderr, flush=True)
            status, what = _Supervise(trainer, signals, args.grace_s)
    except cluster_lib.ClusterError as error:
        print(f'launch: error: {error}', file=sys.stderr, flush=True)
        status = 1
    finally:
        # The trainer first (it is still running only if the launcher failed): the workers
        # hold its variables.
        cluster_lib.StopProcesses([trainer] if trainer else [])
        cluster_lib.StopProcesses(workers)
    stopped = f'stopped workers {[w.pid for w in workers]}'
    if signals.first is not None and (what or status is None):
        status = 128 + signals.first
        print(f'launch: {signals.name}: {what or "came before the trainer started"}; '
              f'{stopped}; exit status {status}.', file=sys.stderr, flush=True)
    else:
        print(f'launch: {stopped}', file=sys.stderr, flush=True)
    return status


def _UserError(message: str) -> None:
    """A user's mistake: one line, exit status 2 (not argparse's usage block)."""
    print(f'launch: error: {message} (see --help)', file=sys.stderr, flush=True)
    sys.exit(2)


class _Parser(argparse.ArgumentParser):

    def error(self, message):
        _UserError(message)


def ParseArgs(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The launcher's flags, and the trainer's (after `--`); exits 2 with one line on misuse."""
    if '--' in argv:
        split = argv.index('--')
        own, trainer_flags = argv[:split], argv[split + 1:]
    else:
        own, trainer_flags = argv, []
    parser = _Parser(prog='python -m gpipe_tf.launch',
                                     description=__doc__.split('\n')[0])
    parser.add_argument('--num_workers', type=int, default=2, help='Worker tasks to start (K).')
    parser.add_argument('--start_timeout_s', type=float, default=60.0,
                        help='How long the workers may take to listen.')
    parser.add_argument('--grace_s', type=float, default=60.0,
                        help='After a stop signal, how long the trainer may take to save its '
                        'checkpoint and exit before it is killed.')
    parser.add_argument('--network', choices=('private', 'host'), default='private',
                        help='private: the job runs in a loopback-only network namespace where '
                        'the OS allows one; host: on the host\'s network (reaches remote '
                        'storage; the workers are exposed).')
    parser.add_argument('--serve', action='store_true', help='Run one worker task (internal).')
    parser.add_argument('--cluster_spec', default=None, help='With --serve: the cluster.')
    parser.add_argument('--task', type=int, default=0, help='With --serve: this task\'s index.')
    parser.add_argument('--job', default='worker', help='With --serve: this task\'s job.')
    parser.add_argument('--supervised', action='store_true',
                        help='With --serve: a launcher\'s worker, which exits when its stdin '
                        'closes (internal).')
    args = parser.parse_args(own)
    if args.serve:
        if not args.cluster_spec:
            parser.error('--serve needs --cluster_spec')
        return args, trainer_flags
    if not trainer_flags:
        parser.error('give the trainer\'s flags after --, e.g. -- --model=examples.PipelinedMLP')
    if args.num_workers < 1:
        parser.error(f'--num_workers must be >= 1, got {args.num_workers}')
    if not args.grace_s >= 0:
        parser.error(f'--grace_s must be >= 0, got {args.grace_s}')
    remote = [f for f in trainer_flags if '://' in f]
    if args.network == 'private' and remote:
        parser.error(f'{remote[0]} names a remote location, which the private network '
                     'namespace cannot reach; add --network=host (and firewall the workers\' '
                     'ports)')
    return args, trainer_flags


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args, trainer_flags = ParseArgs(argv)
    if args.serve:
        Serve(args.cluster_spec, args.task, args.job, args.supervised)
        return
    if args.network == 'private':
        _ReexecInPrivateNetwork(argv)
    sys.exit(Launch(args, trainer_flags, exposure='--network=host was given'))


if __name__ == '__main__':
    main()
