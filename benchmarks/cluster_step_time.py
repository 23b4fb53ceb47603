r"""One pipeline, one process or two: step time of K=2 cells on 2 virtual CPU devices of this
process vs on 2 worker processes of a local TF cluster; and the time from a worker's death to the
trainer's error.

    python benchmarks/cluster_step_time.py [--steps=20] [--width=512] [--batch=256]

Both runs build the same v1 graph (a dense stack of K=2 re-materializing cells, M micro-batches,
loss, gradients, SGD update) and run it in a Session: locally, or with the session target on
worker 0 and stage k on `/job:worker/task:k`. Then worker 1 is killed mid-run and the time until
the step fails with the cluster's error (naming task 1) is measured.

Prints a table and writes benchmarks/results/cluster_step_time.json.
"""

from __future__ import annotations

import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import argparse  # pylint: disable=g-import-not-at-top,g-bad-import-order
import json
import signal
import statistics
import threading
import time

import tensorflow as tf  # pylint: disable=g-import-not-at-top,g-bad-import-order

from gpipe_tf import test_utils  # pylint: disable=g-import-not-at-top
from gpipe_tf.layers import basic  # pylint: disable=g-import-not-at-top
from gpipe_tf.pipeline import pipelining_layer  # pylint: disable=g-import-not-at-top
from gpipe_tf.train import cluster as cluster_lib  # pylint: disable=g-import-not-at-top

NUM_CELLS = 2


def BuildGraph(args, devices):
    graph = tf.Graph()
    with graph.as_default():
        layers = [basic.DenseLayer.Params().Set(input_dim=args.width, output_dim=args.width,
                                                activation='relu') for _ in range(args.layers)]
        layer = pipelining_layer.PipeliningLayer.Params().Set(
            name='pipe', layer_tpl=layers, num_cells=NUM_CELLS, num_micro_batches=args.m,
            input_shapes=[args.batch, args.width], devices=devices).Instantiate()
        with tf.device(devices[0]):
            x = tf.random.stateless_normal([args.batch, args.width], [1, 2])
        loss = tf.reduce_mean(tf.square(layer(x)))
        variables = list(layer.trainable_variables)
        grads = tf.compat.v1.gradients(loss, variables)
        train = tf.compat.v1.train.GradientDescentOptimizer(1e-4).apply_gradients(
            zip(grads, variables))
        init = tf.compat.v1.global_variables_initializer()
    return graph, init, train, loss


def StepTimes(session, init, train, loss, steps):
    session.run(init)
    for _ in range(3):  # Warm up: graph optimization and the first runs.
        session.run([train, loss])
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        session.run([train, loss])
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--steps', type=int, default=20, help='Timed steps per setting.')
    parser.add_argument('--layers', type=int, default=8, help='Dense layers.')
    parser.add_argument('--width', type=int, default=512, help='Width of each layer.')
    parser.add_argument('--batch', type=int, default=256, help='Mini-batch size.')
    parser.add_argument('--m', type=int, default=4, help='Micro-batches (M).')
    parser.add_argument('--timeout_s', type=float, default=10.0,
                        help='The cluster Session\'s operation timeout.')
    parser.add_argument('--out', default='benchmarks/results/cluster_step_time.json')
    args = parser.parse_args()
    rows = []
    local_devices = test_utils.ConfigureVirtualCpus(NUM_CELLS)
    graph, init, train, loss = BuildGraph(args, local_devices)
    config = tf.compat.v1.ConfigProto(device_count={'CPU': NUM_CELLS})
    with tf.compat.v1.Session(graph=graph, config=config) as session:
        rows.append(dict(setting='1 process, 2 virtual devices',
                         step_s=StepTimes(session, init, train, loss, args.steps)))
    print(f"{rows[-1]['setting']:34s} {1e3 * rows[-1]['step_s']:8.1f} ms/step", flush=True)

    spec = cluster_lib.LocalClusterSpec(NUM_CELLS)
    cluster = cluster_lib.ParseClusterSpec(spec)
    workers = [cluster_lib.StartServer(spec, task) for task in range(NUM_CELLS)]
    try:
        cluster_lib.WaitUntilListening(spec, 60, workers)
        graph, init, train, loss = BuildGraph(args, cluster_lib.StageDevices(cluster, NUM_CELLS))
        session = tf.compat.v1.Session(cluster_lib.Target(cluster), graph=graph,
                                       config=cluster_lib.SessionConfig(args.timeout_s))
        try:
            rows.append(dict(setting='2 worker processes (+ client)',
                             step_s=StepTimes(session, init, train, loss, args.steps)))
            print(f"{rows[-1]['setting']:34s} {1e3 * rows[-1]['step_s']:8.1f} ms/step",
                  flush=True)
            # Kill worker 1 while steps run; time until a step fails and the task is named.
            killer = threading.Timer(0.5, os.kill, (workers[1].pid, signal.SIGKILL))
            killer.start()
            killed_at = time.monotonic() + 0.5
            try:
                while True:
                    session.run([train, loss])
            except (tf.errors.DeadlineExceededError, tf.errors.UnavailableError,
                    tf.errors.AbortedError, tf.errors.CancelledError) as error:
                failed = time.monotonic()
                message = str(cluster_lib.UnreachableError(cluster, error))
                named = time.monotonic()
        finally:
            try:
                session.close()
            except tf.errors.OpError:  # Closing also asks the dead worker.
                pass
    finally:
        cluster_lib.StopProcesses(workers)
    rows.append(dict(setting='worker 1 killed', step_failure_s=failed - killed_at,
                     error_s=named - killed_at, error=message, timeout_s=args.timeout_s))
    print(f'worker 1 killed: the step failed after {failed - killed_at:.1f} s, the error naming '
          f'the task after {named - killed_at:.1f} s (operation timeout {args.timeout_s:g} s):\n'
          f'  {message}')
    os.makedirs(os.path.dirname(args.out) or '.', exist_ok=True)
    with open(args.out, 'w', encoding='utf-8') as f:
        json.dump({'tensorflow': tf.__version__, 'cpu_cores': os.cpu_count(),
                   'model': vars(args), 'rows': rows}, f, indent=1)
    print(f'wrote {args.out}')


if __name__ == '__main__':
    main()
