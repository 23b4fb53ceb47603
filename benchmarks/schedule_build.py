r"""Graph build, first step and step time of a pipeline against M, unrolled or looped.

The configuration of issue 17's comparison with Lingvo: 8 Transformer layers (model dim 256, FFN
1024, 4 heads), batch 32 x 64 tokens (batch M when M > 32, one example per micro-batch), K=8
virtual CPU devices, one thread per op, a tf.function train step (loss, gradients, SGD). Each
measurement runs in a process of its own:

  layer    Params -> PipeliningLayer (variables created)
  trace    tracing the train step (get_concrete_function)
  first    the first step: graph optimization, placement, executor set-up and the step
  step     the median of 5 further steps
  peak     what one step allocates at its peak over what was allocated before it, all 8 devices
           together (the BFC allocator's statistics: TF_CPU_ALLOCATOR_USE_BFC=true)

    python benchmarks/schedule_build.py [--runs=looped:gpipe:8,unrolled:gpipe:32,...]
        (a run: executor:schedule:M[:recompute], recompute 'always' unless given)
        [--out=benchmarks/results/schedule_build.json]

Prints a table and writes every row to JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

DEFAULT_RUNS = ('looped:gpipe:8,looped:gpipe:32,looped:gpipe:128,looped:1f1b:32,'
                'looped:interleaved_1f1b:32,looped:zero_bubble:32,looped:zero_bubble_v:32,'
                'looped:1f1b:32:never,looped:zero_bubble:32:never,'
                'unrolled:gpipe:8,unrolled:gpipe:32,unrolled:1f1b:32')
K = 8


def Measure(executor: str, kind: str, m: int, recompute: str = 'always') -> dict:
    """One measurement, in this process (a fresh one: see Main)."""
    os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    tf.config.threading.set_intra_op_parallelism_threads(1)
    from gpipe_tf import test_utils  # pylint: disable=g-import-not-at-top
    devices = test_utils.ConfigureVirtualCpus(K)
    from gpipe_tf.layers import attention  # pylint: disable=g-import-not-at-top
    from gpipe_tf.nested_map import NestedMap  # pylint: disable=g-import-not-at-top
    from gpipe_tf.pipeline import pipelining_layer  # pylint: disable=g-import-not-at-top
    from gpipe_tf.pipeline import schedule as schedule_lib  # pylint: disable=g-import-not-at-top

    batch, length, dim = max(32, m), 64, 256
    virtual = schedule_lib.Kind(kind).searched_virtual_stages
    layers = [attention.TransformerLayer.Params().Set(
        name=f'layer_{i}', model_dim=dim, hidden_dim=4 * dim, num_heads=4) for i in range(8)]
    start = time.perf_counter()
    layer = pipelining_layer.PipeliningLayer.Params().Set(
        name='pipe', layer_tpl=layers, num_cells=K // virtual, virtual_stages=virtual,
        num_micro_batches=m, schedule=kind, unroll=executor == 'unrolled', recompute=recompute,
        partition_method='uniform',
        input_shapes={'vec': [batch, length, dim], 'paddings': [batch, length]},
        devices=devices[:K // virtual]).Instantiate()
    built = time.perf_counter()
    inputs = NestedMap(vec=tf.random.stateless_normal([batch, length, dim], [1, 2]),
                       paddings=tf.zeros([batch, length]))
    variables = layer.trainable_variables

    def LossFn(outputs, _):
        return tf.reduce_mean(tf.square(outputs.vec)), tf.constant(1.0)

    @tf.function
    def Step(inputs):
        with tf.GradientTape() as tape:
            if not schedule_lib.Kind(kind).loss_inside_pipeline:
                loss = LossFn(layer(inputs), None)[0]
            else:
                _, loss, _ = layer.FPropLoss(layer.theta, inputs, LossFn)
        for v, g in zip(variables, tape.gradient(loss, variables)):
            v.assign_sub(1e-4 * g)
        return loss

    Step.get_concrete_function(inputs)
    traced = time.perf_counter()
    Step(inputs).numpy()
    first = time.perf_counter()
    times = []
    for _ in range(5):
        begin = time.perf_counter()
        Step(inputs).numpy()
        times.append(time.perf_counter() - begin)
    try:
        peak = test_utils.PeakBytesOf(lambda: Step(inputs).numpy())
    except RuntimeError as e:  # The timings stand without it.
        print(f'no peak: {e}', file=sys.stderr)
        peak = None
    return dict(executor=executor, schedule=kind, recompute=recompute, k=K, v=virtual, m=m,
                batch=batch,
                layer_s=built - start, trace_s=traced - built, first_step_s=first - traced,
                build_and_first_s=first - start, step_s=sorted(times)[2], peak_bytes=peak)


def Main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--runs', default=DEFAULT_RUNS,
                        help='Comma-separated executor:schedule:M[:recompute] (executor '
                        'looped|unrolled).')
    parser.add_argument('--out', default=os.path.join(os.path.dirname(__file__), 'results',
                                                      'schedule_build.json'))
    parser.add_argument('--one', default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:  # A child process: one measurement, printed as JSON.
        executor, kind, m, *recompute = args.one.split(':')
        print('RESULT ' + json.dumps(Measure(executor, kind, int(m), *recompute)), flush=True)
        return
    rows = []
    print(f'{"executor":9s} {"schedule":17s} {"recompute":11s} {"M":>4s} {"layer":>6s} '
          f'{"trace":>6s} {"first":>7s} {"total":>7s} {"step":>6s}  (seconds) {"peak MB":>8s}',
          flush=True)
    for run in args.runs.split(','):
        result = subprocess.run([sys.executable, __file__, f'--one={run}'], capture_output=True,
                                text=True, check=False,
                                env=dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC='true'))
        lines = [l for l in result.stdout.splitlines() if l.startswith('RESULT ')]
        if result.returncode or not lines:
            print(f'{run}: failed (exit {result.returncode}):\n{result.stderr[-2000:]}',
                  file=sys.stderr)
            continue
        row = json.loads(lines[-1][len('RESULT '):])
        rows.append(row)
        print(f'{row["executor"]:9s} {row["schedule"]:17s} {row["recompute"]:11s} {row["m"]:4d} '
              f'{row["layer_s"]:6.1f} {row["trace_s"]:6.1f} {row["first_step_s"]:7.1f} '
              f'{row["build_and_first_s"]:7.1f} {row["step_s"]:6.2f}            '
              f'{"n/a" if row["peak_bytes"] is None else round(row["peak_bytes"] / 2**20):>8}',
              flush=True)
    if not rows:
        sys.exit('error: every run failed (see above); nothing written')
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, 'w', encoding='utf-8') as f:
        json.dump(rows, f, indent=1)
    print(f'wrote {args.out}')


if __name__ == '__main__':
    Main()
