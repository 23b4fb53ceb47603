r"""The total work of zero-bubble's split backward against 1F1B's fused one.

zero_bubble splits each backward into I (the input gradient) and W (the weight gradients) so
that W fills the bubble; it pays only if the split adds little work. Here every cell is on one
device (so nothing overlaps and a step's time is its total work): 8 dense layers of 1024 with
tanh, batch 2048, K=4 cells on CPU:0, M=8 micro-batches, the loss per micro-batch inside the
pipeline (`FPropLoss`), one SGD update per step, a tf.function; one op at a time
(inter-op threads 1), each op on the machine's cores. Per (executor, recompute, schedule):

  step_s   the median of `--steps` steps (after two warm-up steps), the configurations' steps
           taken in turn, round after round, so that a slower phase of the machine falls on all
  ratio    zero_bubble's step over 1f1b's, same executor and recompute mode

    python benchmarks/split_backward_work.py [--steps=9] [--recompute=never,always]
        [--executors=unrolled,looped] [--out=benchmarks/results/split_backward_work.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import tensorflow as tf  # pylint: disable=g-import-not-at-top,g-bad-import-order

BATCH, WIDTH, LAYERS, K, M = 2048, 1024, 8, 4, 8
KINDS = ('1f1b', 'zero_bubble')


def MakeStep(kind: str, recompute: str, executor: str):
    """A compiled train step of the configuration and its input."""
    from gpipe_tf.layers import basic  # pylint: disable=g-import-not-at-top
    from gpipe_tf.pipeline import pipelining_layer  # pylint: disable=g-import-not-at-top
    layers = [basic.DenseLayer.Params().Set(name=f'dense_{i}', input_dim=WIDTH,
                                            output_dim=WIDTH, activation='tanh')
              for i in range(LAYERS)]
    layer = pipelining_layer.PipeliningLayer.Params().Set(
        name='pipe', layer_tpl=layers, num_cells=K, num_micro_batches=M, schedule=kind,
        recompute=recompute, unroll=executor == 'unrolled', input_shapes=[BATCH, WIDTH],
        devices=['/device:CPU:0'] * K, partition_method='uniform').Instantiate()
    variables = layer.trainable_variables

    def Loss(outputs, _):
        return tf.reduce_mean(tf.square(outputs)), tf.constant(1.0)

    @tf.function
    def Step(x):
        with tf.GradientTape() as tape:
            _, loss, _ = layer.FPropLoss(layer.theta, x, Loss)
        for v, g in zip(variables, tape.gradient(loss, variables)):
            v.assign_sub(1e-4 * g)
        return loss

    x = tf.random.stateless_normal([BATCH, WIDTH], [1, 2])
    return lambda: Step(x).numpy()


def Main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--steps', type=int, default=9)
    parser.add_argument('--recompute', default='never,always')
    parser.add_argument('--executors', default='unrolled,looped')
    parser.add_argument('--out', default=os.path.join(os.path.dirname(__file__), 'results',
                                                      'split_backward_work.json'))
    args = parser.parse_args()
    tf.config.threading.set_inter_op_parallelism_threads(1)
    configs = [(executor, recompute, kind) for executor in args.executors.split(',')
               for recompute in args.recompute.split(',') for kind in KINDS]
    steps = {}
    for config in configs:
        steps[config] = MakeStep(config[2], config[1], config[0])
        for _ in range(2):  # Warm-up: the first step builds and optimizes the graph.
            steps[config]()
    times = {config: [] for config in configs}
    for _ in range(args.steps):
        for config in configs:
            begin = time.perf_counter()
            steps[config]()
            times[config].append(time.perf_counter() - begin)
    rows = []
    print(f'{"executor":9s} {"recompute":10s} {"schedule":12s} {"step s":>7s} {"ratio":>6s}')
    for executor, recompute, kind in configs:
        step = statistics.median(times[executor, recompute, kind])
        ratio = step / statistics.median(times[executor, recompute, '1f1b'])
        rows.append(dict(executor=executor, recompute=recompute, schedule=kind, step_s=step,
                         ratio=ratio, steps_s=times[executor, recompute, kind]))
        print(f'{executor:9s} {recompute:10s} {kind:12s} {step:7.3f} {ratio:6.3f}', flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, 'w', encoding='utf-8') as f:
        json.dump({'tensorflow': tf.__version__, 'cpu_cores': os.cpu_count(), 'k': K, 'm': M,
                   'batch': BATCH, 'width': WIDTH, 'layers': LAYERS, 'rows': rows}, f, indent=1)
    print(f'wrote {args.out}')


if __name__ == '__main__':
    Main()
