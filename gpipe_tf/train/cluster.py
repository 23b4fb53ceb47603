"""Cells on other processes through TensorFlow's distributed runtime.

A cluster is a `tf.train.ClusterSpec`, given in Lingvo's `--cluster_spec` form
(`worker=host:port,host:port@ps=host:port`) or as TF_CONFIG JSON. Stage k of replica r runs on
task r * K + k of the worker job (`/job:worker/replica:0/task:<i>/device:CPU:0`); the trainer
is a client that builds one v1 graph and runs it in a Session on task 0's master.

Why a v1 Session: TF2's remote eager client was seen to hang with no error when a worker is
stopped or never started, while a Session with `operation_timeout_in_ms` returns
DeadlineExceeded after the timeout, and UnavailableError at once for a killed worker. Either
way the step fails within a bound; `Diagnose` then finds which task is unreachable (a TCP connect
for a dead process, a probe run with its own deadline for a stopped one), so the error names it.

A `tf.distribute.Server` listens on every interface, not only the address in its cluster spec,
and runs any op a client sends: `gpipe_tf.launch` keeps its one-machine clusters in a private
network namespace; firewall the ports of clusters of several hosts (docs/reliability.md,
"Security model of the worker servers").
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import tensorflow as tf

from gpipe_tf import errors
from gpipe_tf.pipeline import devices as devices_lib

DEFAULT_JOB = 'worker'


class ClusterError(RuntimeError):
    """A task of the cluster cannot be reached; the message names it and what was seen."""


def ParseClusterSpec(text: str) -> tf.train.ClusterSpec:
    """A ClusterSpec from Lingvo's `job=host:port,host:port@job2=host:port` form.

    Raises:
      errors.ConfigError: (a ValueError) naming the malformed part and the expected form.
    """
    jobs = {}
    for part in filter(None, (p.strip() for p in text.split('@'))):
        job, sep, addresses = part.partition('=')
        hosts = [a.strip() for a in addresses.split(',') if a.strip()]
        if not sep or not job.strip() or not hosts or any(
                not _IsAddress(h) for h in hosts):
            raise errors.ConfigError(f'--cluster_spec: cannot parse {part!r}; expected '
                                     'job=host:port,host:port (jobs separated by @), e.g. '
                                     'worker=127.0.0.1:2222,127.0.0.1:2223.')
        if job.strip() in jobs:
            raise errors.ConfigError(f'--cluster_spec: job {job.strip()!r} is given twice.')
        jobs[job.strip()] = hosts
    if not jobs:
        raise errors.ConfigError('--cluster_spec is empty; expected job=host:port,host:port.')
    return tf.train.ClusterSpec(jobs)


def _IsAddress(address: str) -> bool:
    host, sep, port = address.rpartition(':')
    return bool(sep and host and port.isdigit())


def FromTfConfig(text: str, source: str = 'TF_CONFIG') -> tf.train.ClusterSpec:
    """The cluster of a TF_CONFIG JSON (`{"cluster": {"worker": ["host:port", ...]}, ...}`);
    `source` names where the text came from, for the error.

    Raises:
      errors.ConfigError: (a ValueError) if it is not JSON with a `cluster` dict of address
        lists.
    """
    try:
        cluster = json.loads(text)['cluster']
        if not isinstance(cluster, dict) or not all(
                isinstance(v, list) and all(_IsAddress(a) for a in v) for v in cluster.values()):
            raise TypeError
    except (ValueError, KeyError, TypeError):
        raise errors.ConfigError(f'{source} must be JSON with a "cluster" dict of host:port '
                                 'lists, e.g. {"cluster": {"worker": ["127.0.0.1:2222"]}}; got '
                                 f'{text[:200]!r}.') from None
    return tf.train.ClusterSpec(cluster)


# The first `count` tasks of a job, one device each (kept under its old name).
StageDevices = devices_lib.ClusterDevices


def Target(cluster: tf.train.ClusterSpec, job: str = DEFAULT_JOB) -> str:
    """The Session target: task 0 of `job`, whose master runs the graph."""
    return f'grpc://{cluster.task_address(job, 0)}'


def SessionConfig(timeout_s: float) -> tf.compat.v1.ConfigProto:
    """Every Session.run fails with DeadlineExceeded after `timeout_s` instead of hanging."""
    if not timeout_s > 0:
        raise ValueError(f'The cluster timeout must be > 0 seconds, got {timeout_s}.')
    return tf.compat.v1.ConfigProto(operation_timeout_in_ms=int(timeout_s * 1000))


@dataclasses.dataclass(frozen=True)
class TaskStatus:
    job: str
    task: int
    address: str
    problem: str | None  # None: reachable.


def ConnectProblem(address: str, timeout_s: float) -> str | None:
    """Why nothing accepts a TCP connection at host:port `address` within `timeout_s`; None if
    something does."""
    host, _, port = address.rpartition(':')
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return None
    except OSError as error:
        return f'no process accepts connections there ({error.strerror or error})'


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What a call run by `CallWithin` did: returned `value`, or raised `error`."""
    value: object = None
    error: Exception | None = None


def CallWithin(fn, timeout_s: float) -> Outcome | None:
    """`fn()` in a daemon thread abandoned after `timeout_s`: its Outcome, or None when it did
    not finish (a call into a stopped process, or into something that is no TF server, can
    wait forever)."""
    outcomes = []

    def Call():
        try:
            outcomes.append(Outcome(value=fn()))
        except Exception as error:  # pylint: disable=broad-except
            outcomes.append(Outcome(error=error))

    thread = threading.Thread(target=Call, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return outcomes[0] if outcomes else None


_SILENT = 'it accepts connections but does not answer within {:g} s (stopped or hung?)'


def _Responds(address: str, device: str, timeout_s: float) -> str | None:
    """Runs a constant on `device` through the task's own master, in a thread abandoned after
    `timeout_s` (a stopped process accepts TCP connections but never answers)."""

    def Probe():
        graph = tf.Graph()
        with graph.as_default(), tf.device(device):
            value = tf.constant(1.0) + 1.0
        config = SessionConfig(timeout_s)
        # Only this task: a master otherwise asks every task for its devices, and would wait
        # on another unreachable one.
        config.device_filters.append(device.rsplit('/device:', 1)[0])
        with tf.compat.v1.Session(f'grpc://{address}', graph=graph, config=config) as session:
            session.run(value)

    outcome = CallWithin(Probe, timeout_s + 1.0)
    if outcome is None or isinstance(outcome.error, tf.errors.DeadlineExceededError):
        return _SILENT.format(timeout_s)
    if outcome.error is not None:
        return f'it fails a probe ({type(outcome.error).__name__})'
    return None


def Diagnose(cluster: tf.train.ClusterSpec, job: str = DEFAULT_JOB,
             timeout_s: float = 5.0) -> list[TaskStatus]:
    """Which tasks of `job` are reachable, each found within about 2 * timeout_s."""
    statuses = []
    for task in range(cluster.num_tasks(job)):
        address = cluster.task_address(job, task)
        problem = ConnectProblem(address, timeout_s) or _Responds(
            address, f'/job:{job}/replica:0/task:{task}/device:CPU:0', timeout_s)
        statuses.append(TaskStatus(job, task, address, problem))
    return statuses


def UnreachableError(cluster: tf.train.ClusterSpec, error: Exception, job: str = DEFAULT_JOB,
                     probe_timeout_s: float = 5.0,
                     statuses: list[TaskStatus] | None = None) -> ClusterError:
    """A ClusterError naming the unreachable tasks behind a failed Session.run (from
    `statuses` when the caller has diagnosed the cluster already)."""
    if statuses is None:
        statuses = Diagnose(cluster, job, probe_timeout_s)
    bad = [s for s in statuses if s.problem]
    line = errors.Reason(error)
    what = f'{type(error).__name__}' + (f' ({line[:200]})' if line else '')
    if not bad:
        return ClusterError(f'A step failed on the cluster ({what}), but every task of job '
                            f'{job!r} answers now; see the workers\' logs.')
    names = '; '.join(f'/job:{s.job}/task:{s.task} at {s.address}: {s.problem}' for s in bad)
    return ClusterError(f'Unreachable: {names}. The step failed with {what}. Restart the task(s) '
                        'and run the trainer again: it resumes from the last checkpoint.')


# ---- local clusters: K server processes on 127.0.0.1 ------------------------------------------
def FreePorts(count: int) -> list[int]:
    """`count` ports that were free on 127.0.0.1 a moment ago."""
    sockets, ports = [], []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(('127.0.0.1', 0))
            sockets.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in sockets:
            s.close()
    return ports


def LocalClusterSpec(num_workers: int, ports: list[int] | None = None) -> str:
    """Lingvo's form of a one-job cluster of `num_workers` tasks on 127.0.0.1."""
    ports = ports or FreePorts(num_workers)
    return f'{DEFAULT_JOB}=' + ','.join(f'127.0.0.1:{p}' for p in ports)


def _LoadPrctl():
    """libc's prctl, resolved here: a child between fork and exec should not load libraries."""
    if not sys.platform.startswith('linux'):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
    prctl.restype = ctypes.c_int
    return prctl


_PRCTL = _LoadPrctl()
_PR_SET_PDEATHSIG = 1


def StartOwnedProcess(command: list[str], parent_death_signal: int | None = signal.SIGTERM,
                      **popen_kwargs) -> subprocess.Popen:
    """Starts `command` as a process that this one owns: one that ends when this one ends.

    The child leads a session of its own, so a terminal's Ctrl-C reaches only this process,
    which decides what the child receives. On Linux the child gets `parent_death_signal` when
    this process dies, however it dies (SIGKILL too); Linux sends it when the *thread* that
    started the child ends, so call this from the main thread. None: the child watches for
    its parent's death itself (the workers, see `StartServer`).

    Args:
      command: the argv.
      parent_death_signal: the child's parent-death signal, or None.
      **popen_kwargs: passed on to subprocess.Popen (stdout, env, ...).
    """
    parent = os.getpid()

    def DieWithParent():
        _PRCTL(_PR_SET_PDEATHSIG, parent_death_signal, 0, 0, 0)
        # The parent may have died between fork and prctl; no signal would come then.
        if os.getppid() != parent:
            os._exit(1)  # pylint: disable=protected-access

    wanted = parent_death_signal is not None and _PRCTL is not None
    return subprocess.Popen(command, start_new_session=True,
                            preexec_fn=DieWithParent if wanted else None, **popen_kwargs)


def SignalProcess(process: subprocess.Popen, signum: int) -> None:
    """Sends `signum` to the process group that `process` leads (StartOwnedProcess's children
    lead one), else to the process; nothing once the process is reaped, since its id may
    name another process then."""
    if process.poll() is not None:
        return
    try:
        if os.getpgid(process.pid) == process.pid:
            os.killpg(process.pid, signum)
        else:
            os.kill(process.pid, signum)
    except ProcessLookupError:
        pass


def ServerCommand(cluster_spec: str, task: int) -> list[str]:
    """The argv of worker task `task`, supervised through its stdin (see `StartServer`)."""
    return [sys.executable, '-m', 'gpipe_tf.launch', '--serve', f'--cluster_spec={cluster_spec}',
            f'--task={task}', '--supervised']


def StartServer(cluster_spec: str, task: int, log=None) -> subprocess.Popen:
    """Starts task `task` of the worker job as a process of its own, owned by this one.

    The worker's stdin is a pipe from this process; it exits when the pipe closes, that is
    when this process ends, however it ends, or drops the returned Popen. Not at once: first
    it gives the trainer that the launcher named on the pipe time to save its checkpoint,
    whose variables live on the workers (`gpipe_tf.launch`).
    """
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL=os.environ.get('TF_CPP_MIN_LOG_LEVEL', '2'))
    return StartOwnedProcess(ServerCommand(cluster_spec, task), parent_death_signal=None,
                             stdin=subprocess.PIPE, stdout=log or subprocess.DEVNULL,
                             stderr=log or subprocess.DEVNULL, env=env)


def WaitUntilListening(cluster_spec: str, timeout_s: float = 60.0,
                       processes: list | None = None, cancelled=None) -> None:
    """Waits until every task accepts connections, or until `cancelled()` is true (checked
    every 0.2 s; the caller then knows why it stopped waiting).

    Raises:
      ClusterError: naming the tasks still closed after `timeout_s`, or a process that exited.
    """
    cluster = ParseClusterSpec(cluster_spec)
    deadline = time.monotonic() + timeout_s
    while not (cancelled and cancelled()):
        for i, process in enumerate(processes or []):
            if process.poll() is not None:
                raise ClusterError(f'Worker task {i} exited with status {process.returncode} '
                                   'before it was listening.')
        closed = [(t, cluster.task_address(DEFAULT_JOB, t))
                  for t in range(cluster.num_tasks(DEFAULT_JOB))
                  if ConnectProblem(cluster.task_address(DEFAULT_JOB, t), 1.0)]
        if not closed:
            return
        if time.monotonic() > deadline:
            raise ClusterError(f'Tasks not listening after {timeout_s:g} s: {closed}.')
        time.sleep(0.2)


def StopProcesses(processes: list, grace_s: float = 5.0) -> None:
    """SIGTERM (SIGCONT first, for stopped ones), then SIGKILL after `grace_s`; by process id
    (by process group for the groups they lead, see `SignalProcess`)."""
    for process in processes:
        SignalProcess(process, signal.SIGCONT)
        SignalProcess(process, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for process in processes:
        try:
            process.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            SignalProcess(process, signal.SIGKILL)
            process.wait()
        if process.stdin:
            try:
                process.stdin.close()
            except OSError:  # Its reader is gone; nothing was left to write.
                pass
