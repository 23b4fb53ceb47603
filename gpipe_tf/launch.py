r"""Local multi-process runs: K `tf.distribute.Server` processes on 127.0.0.1, then the trainer.

    python -m gpipe_tf.launch --num_workers=2 -- --model=examples.PipelinedMLP \
        --worker_split_size=2 --logdir=/tmp/mlp_cluster

starts two worker tasks on free ports of 127.0.0.1, waits until both listen, runs
`python -m gpipe_tf.trainer <flags after --> --cluster_spec=worker=127.0.0.1:p0,127.0.0.1:p1`
(stage k on task k), and stops the workers, by process id, when the trainer exits, fails or is
interrupted. Its exit status is the trainer's.

A worker process alone: `python -m gpipe_tf.launch --serve --cluster_spec=... --task=i`.

`tf.distribute.Server` listens on every interface, not only 127.0.0.1: on a shared network,
firewall the ports (printed at start).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys


def Serve(cluster_spec: str, task: int, job: str) -> None:
    """Runs one task of the cluster until killed."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from gpipe_tf.train import cluster as cluster_lib  # pylint: disable=g-import-not-at-top
    cluster = cluster_lib.ParseClusterSpec(cluster_spec)
    if not 0 <= task < cluster.num_tasks(job):
        raise SystemExit(f'--task={task}: job {job!r} has tasks 0..{cluster.num_tasks(job) - 1}.')
    server = tf.distribute.Server(cluster, job_name=job, task_index=task,
                                  config=tf.compat.v1.ConfigProto(device_count={'CPU': 1}))
    print(f'/job:{job}/task:{task} serving at {cluster.task_address(job, task)} '
          f'(pid {os.getpid()})', file=sys.stderr, flush=True)
    server.join()


def Launch(num_workers: int, trainer_flags: list[str], start_timeout_s: float) -> int:
    from gpipe_tf.train import cluster as cluster_lib  # pylint: disable=g-import-not-at-top
    if num_workers < 1:
        raise SystemExit(f'--num_workers must be >= 1, got {num_workers}.')
    spec = cluster_lib.LocalClusterSpec(num_workers)
    print(f'launch: {num_workers} workers: {spec}. tf.distribute.Server listens on every '
          'interface: firewall these ports on a shared network.', file=sys.stderr, flush=True)
    workers = [cluster_lib.StartServer(spec, task) for task in range(num_workers)]
    try:
        cluster_lib.WaitUntilListening(spec, start_timeout_s, workers)
        command = [sys.executable, '-m', 'gpipe_tf.trainer'] + trainer_flags + [
            f'--cluster_spec={spec}']
        return subprocess.call(command)
    except KeyboardInterrupt:
        return 130
    finally:
        cluster_lib.StopProcesses(workers)
        print(f'launch: stopped workers {[w.pid for w in workers]}', file=sys.stderr, flush=True)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if '--' in argv:
        split = argv.index('--')
        own, trainer_flags = argv[:split], argv[split + 1:]
    else:
        own, trainer_flags = argv, []
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--num_workers', type=int, default=2, help='Worker tasks to start (K).')
    parser.add_argument('--start_timeout_s', type=float, default=60.0,
                        help='How long the workers may take to listen.')
    parser.add_argument('--serve', action='store_true', help='Run one worker task (internal).')
    parser.add_argument('--cluster_spec', default=None, help='With --serve: the cluster.')
    parser.add_argument('--task', type=int, default=0, help='With --serve: this task\'s index.')
    parser.add_argument('--job', default='worker', help='With --serve: this task\'s job.')
    args = parser.parse_args(own)
    if args.serve:
        if not args.cluster_spec:
            parser.error('--serve needs --cluster_spec.')
        Serve(args.cluster_spec, args.task, args.job)
        return
    if not trainer_flags:
        parser.error('give the trainer\'s flags after --, e.g. -- --model=examples.PipelinedMLP')
    sys.exit(Launch(args.num_workers, trainer_flags, args.start_timeout_s))


if __name__ == '__main__':
    main()
