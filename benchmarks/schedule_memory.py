r"""Bytes a pipelined training step holds between steps, and its peak, per schedule, recompute
mode and graph mode, against the same layers un-pipelined.

8 dense layers of 1024 with tanh, batch 4096, K=4 cells on 4 virtual CPU devices (interleaved_1f1b
and zero_bubble_v: 8 cells, two per device), M micro-batches, one SGD update per step; the loss
per micro-batch inside the pipeline (`FPropLoss`) for every schedule but gpipe, whose loss follows
the pipeline. Each configuration runs in a process of its own (a fresh allocator), built as a
tf.function or in a tf.compat.v1 graph run by a Session, the batch fed to each step:

  executor      'looped' or 'unrolled' (`--unroll`, by default 'auto': a loop from 64 cell
                calls, so K=4, M=32 loops)
  between_mib   `tf.config.experimental.get_memory_info('CPU:0')['current']` after the first
                step: the weights and whatever the step's graph keeps alive between steps
  peak_mib      the peak of the second step (the allocator's statistics reset before it),
                weights included
  between_ratio between_mib over the un-pipelined model's (K=1, M=1, same graph mode)
  step_held_mib (tf.function) the bytes in use with the step's function less those once it is
                deleted: what the compiled step holds, without the allocator's slack (a
                request is handed a whole free chunk unless it is at least twice as large, so
                between_mib varies by a few MiB from process to process)

In a v1 graph each row is the lesser of two processes: a Session holds a copy-on-write copy of a
weight or two (4 MiB each here) in some runs and not in others.

A configuration the pipeline refuses (a ConfigError) is a row with its message.

    python benchmarks/schedule_memory.py [--m=32] [--schedules=gpipe,1f1b] \
        [--recompute=never,always] [--graph_modes=function,v1] [--unroll=auto|true|false] \
        [--out=benchmarks/results/schedule_memory.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from gpipe_tf.pipeline import schedule as schedule_lib  # TensorFlow-free: the table of kinds.

BATCH, WIDTH, LAYERS, K = 4096, 1024, 8, 4
MIB = 2.0 ** 20
MODES = ('never', 'except_last', 'always')


def MeasureHere(kind: str, k: int, m: int, recompute: str, graph_mode: str,
                unroll='auto') -> dict:
    """Measures one configuration in this process (which must not have run another)."""
    os.environ.setdefault('TF_CPU_ALLOCATOR_USE_BFC', 'true')
    os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
    import numpy as np  # pylint: disable=g-import-not-at-top
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from gpipe_tf import errors  # pylint: disable=g-import-not-at-top
    from gpipe_tf import test_utils  # pylint: disable=g-import-not-at-top
    from gpipe_tf.layers import basic  # pylint: disable=g-import-not-at-top
    from gpipe_tf.pipeline import executor  # pylint: disable=g-import-not-at-top
    from gpipe_tf.pipeline import pipelining_layer  # pylint: disable=g-import-not-at-top
    devices = test_utils.ConfigureVirtualCpus(K)
    virtual = schedule_lib.Kind(kind).searched_virtual_stages if k > 1 else 1
    layers = [basic.DenseLayer.Params().Set(name=f'dense_{i}', input_dim=WIDTH,
                                            output_dim=WIDTH, activation='tanh')
              for i in range(LAYERS)]
    params = pipelining_layer.PipeliningLayer.Params().Set(
        name='pipe', layer_tpl=layers, num_cells=k, virtual_stages=virtual, num_micro_batches=m,
        schedule=kind, recompute=recompute, input_shapes=[BATCH, WIDTH], devices=devices[:k],
        unroll=unroll)
    row = dict(schedule=kind, k=k, m=m, recompute=recompute, graph_mode=graph_mode)

    def Loss(outputs, _):
        return tf.reduce_mean(tf.square(outputs)), tf.constant(1.0)

    def Step(layer, x):
        variables = layer.trainable_variables
        with tf.GradientTape() as tape:
            if not schedule_lib.Kind(kind).loss_inside_pipeline:
                loss = Loss(layer(x), None)[0]
            else:
                _, loss, _ = layer.FPropLoss(layer.theta, x, Loss)
        updates = [v.assign_sub(1e-4 * g)
                   for v, g in zip(variables, tape.gradient(loss, variables))]
        with tf.control_dependencies(updates):
            return tf.identity(loss)

    def Info():
        return tf.config.experimental.get_memory_info('CPU:0')

    try:
        # The batch is fed to each step, as a trainer's input pipeline does: a batch built in
        # the graph from constants would be folded into it and held between steps.
        x = np.random.RandomState(0).standard_normal([BATCH, WIDTH]).astype(np.float32)
        if graph_mode == 'function':
            layer = params.Instantiate()
            step = tf.function(lambda x: Step(layer, x),
                               input_signature=[tf.TensorSpec([BATCH, WIDTH], tf.float32)])
            run = lambda: step(tf.constant(x))
        else:
            graph = tf.Graph()
            with graph.as_default():
                layer = params.Instantiate()
                batch = tf.compat.v1.placeholder(tf.float32, [BATCH, WIDTH])
                update = Step(layer, batch)
                session = tf.compat.v1.Session(graph=graph, config=tf.compat.v1.ConfigProto(
                    device_count={'CPU': len(tf.config.list_logical_devices('CPU'))}))
                session.run(tf.compat.v1.global_variables_initializer())
            run = lambda: session.run(update, {batch: x})
        run()
    except errors.ConfigError as error:
        return dict(row, refused=str(error))
    loops = executor.Choose(layer.plan, m).loops
    row['executor'] = 'looped' if loops else 'unrolled'

    row['between_mib'] = Info()['current'] / MIB
    tf.config.experimental.reset_memory_stats('CPU:0')
    run()
    row['peak_mib'] = Info()['peak'] / MIB
    if graph_mode == 'function':
        # What the compiled step itself holds: freed with it (the layer and its variables kept).
        import gc  # pylint: disable=g-import-not-at-top
        gc.collect()
        with_step = Info()['current']
        del step, run
        gc.collect()
        row['step_held_mib'] = (with_step - Info()['current']) / MIB
    return row


def Measure(kind: str, k: int, m: int, recompute: str, graph_mode: str, unroll='auto') -> dict:
    """One configuration, measured in a fresh process; in a v1 graph, the lesser of two
    processes' bytes between steps (a Session's copy-on-write copies of a weight or two vary
    from run to run)."""
    if graph_mode == 'v1':
        rows = [_MeasureOnce(kind, k, m, recompute, graph_mode, unroll) for _ in range(2)]
        return min(rows, key=lambda row: row.get('between_mib', 0))
    return _MeasureOnce(kind, k, m, recompute, graph_mode, unroll)


def _MeasureOnce(kind: str, k: int, m: int, recompute: str, graph_mode: str,
                 unroll) -> dict:
    result = subprocess.run(
        [sys.executable, __file__, '--one',
         json.dumps([kind, k, m, recompute, graph_mode, unroll])],
        capture_output=True, text=True, check=False)
    if result.returncode:
        raise RuntimeError(f'{kind} K={k} M={m} {recompute} {graph_mode} failed:\n'
                           f'{result.stderr[-3000:]}')
    return json.loads(result.stdout.strip().splitlines()[-1])


def _Held(row: dict) -> str:
    return f'{row["step_held_mib"]:14.2f}' if 'step_held_mib' in row else f'{"":14s}'


def Main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--m', type=int, default=32, help='Micro-batches.')
    parser.add_argument('--schedules', default=','.join(schedule_lib.KINDS))
    parser.add_argument('--recompute', default=','.join(MODES))
    parser.add_argument('--graph_modes', default='function,v1')
    parser.add_argument('--unroll', default='auto', choices=('auto', 'true', 'false'),
                        help="The pipeline's unroll ('auto': a loop from 64 cell calls).")
    parser.add_argument('--out', default=os.path.join(os.path.dirname(__file__), 'results',
                                                      'schedule_memory.json'))
    parser.add_argument('--one', default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(MeasureHere(*json.loads(args.one))))
        return
    unroll = {'auto': 'auto', 'true': True, 'false': False}[args.unroll]
    rows = []
    print(f'{"graph":8s} {"schedule":17s} {"recompute":11s} {"executor":9s} {"between MiB":>11s} '
          f'{"x un-pipelined":>14s} {"peak MiB":>9s} {"step holds MiB":>14s}', flush=True)
    for graph_mode in args.graph_modes.split(','):
        base = Measure('gpipe', 1, 1, 'never', graph_mode)
        base['between_ratio'] = 1.0
        rows.append(base)
        print(f'{graph_mode:8s} {"(un-pipelined)":17s} {"":11s} {"":9s} '
              f'{base["between_mib"]:11.1f} '
              f'{1.0:14.2f} {base["peak_mib"]:9.1f} {_Held(base)}', flush=True)
        for kind in args.schedules.split(','):
            for recompute in args.recompute.split(','):
                row = Measure(kind, K, args.m, recompute, graph_mode, unroll)
                if 'refused' in row:
                    print(f'{graph_mode:8s} {kind:17s} {recompute:11s} refused: '
                          f'{row["refused"][:70]}', flush=True)
                else:
                    row['between_ratio'] = row['between_mib'] / base['between_mib']
                    print(f'{graph_mode:8s} {kind:17s} {recompute:11s} {row["executor"]:9s} '
                          f'{row["between_mib"]:11.1f} '
                          f'{row["between_ratio"]:14.2f} {row["peak_mib"]:9.1f} {_Held(row)}',
                          flush=True)
                rows.append(row)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, 'w', encoding='utf-8') as f:
        json.dump(dict(batch=BATCH, width=WIDTH, layers=LAYERS, rows=rows), f, indent=1)
    print(f'wrote {args.out}')


if __name__ == '__main__':
    Main()
