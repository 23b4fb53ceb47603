r"""Pipeline overhead on virtual CPU devices: step time, peak memory, graph build time.

For a 16-layer dense stack and a small Transformer stack, on 2 and 4 virtual CPU devices:
  * the un-pipelined train step (the same layers chained on one device, no micro-batches),
  * the pipelined train step per (K, M, recompute mode),
  * peak memory of a step (CPU BFC allocator statistics),
and, for K in {2, 4, 8} and M in {8, 32, 64}, the time to build the layer, trace the train step and
run the first step.

    python benchmarks/pipeline_overhead.py [--quick] [--threads=shared|per_device] [--out=...]

`--threads=shared` (default) leaves TensorFlow's thread pools as they are: every virtual device
shares the machine's cores, and one op already uses all of them, so pipelining can only cost time
here. `--threads=per_device` runs each op on one thread with as many ops in flight as there are
cores, which makes a virtual device behave like one core of its own: the setting in which GPipe's
overlap of devices can show.

Prints a table as it goes and writes every row to JSON.
"""

from __future__ import annotations

import os

# Before TensorFlow starts: allocation statistics on the CPU need the BFC allocator.
os.environ.setdefault('TF_CPU_ALLOCATOR_USE_BFC', 'true')
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import argparse  # pylint: disable=g-import-not-at-top,g-bad-import-order
import json
import statistics
import time

import tensorflow as tf  # pylint: disable=g-import-not-at-top,g-bad-import-order
from absl import logging  # pylint: disable=g-import-not-at-top

from gpipe_tf import test_utils  # pylint: disable=g-import-not-at-top
from gpipe_tf.layers import base_layer  # pylint: disable=g-import-not-at-top
from gpipe_tf.layers import basic  # pylint: disable=g-import-not-at-top
from gpipe_tf.nested_map import NestedMap  # pylint: disable=g-import-not-at-top
from gpipe_tf.pipeline import pipelining_layer  # pylint: disable=g-import-not-at-top
from gpipe_tf.pipeline import plan as plan_lib  # pylint: disable=g-import-not-at-top

DEVICES: list[str] = []  # Set by Setup() before any TF op runs.


def Setup(threads: str) -> None:
    """Thread pools and 8 virtual CPU devices; must run before TensorFlow starts."""
    if threads == 'per_device':
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(os.cpu_count())
    DEVICES[:] = test_utils.ConfigureVirtualCpus(8)


def DenseModel(batch=1024):
    """16 dense layers, 512 wide, batch 1024 (micro-batches of 128 at M=8)."""
    layers = [basic.DenseLayer.Params().Set(input_dim=512, output_dim=512, activation='relu')
              for _ in range(16)]
    return layers, [batch, 512], lambda: tf.random.stateless_normal([batch, 512], [1, 2])


def TransformerModel(batch=32):
    """8 pre-LN Transformer blocks: model dim 256, FFN 1024, 4 heads, batch 32 x 64 tokens."""
    from gpipe_tf.layers import attention  # pylint: disable=g-import-not-at-top
    length, dim = 64, 256
    layers = [attention.TransformerLayer.Params().Set(model_dim=dim, hidden_dim=4 * dim,
                                                      num_heads=4)
              for _ in range(8)]

    def Inputs():
        return NestedMap(vec=tf.random.stateless_normal([batch, length, dim], [1, 2]),
                         paddings=tf.zeros([batch, length]))

    return layers, {'vec': [batch, length, dim], 'paddings': [batch, length]}, Inputs


MODELS = {'dense16': DenseModel, 'transformer8': TransformerModel}


def Loss(outputs):
    return tf.add_n([tf.reduce_mean(tf.square(x)) for x in tf.nest.flatten(outputs)
                     if x.dtype.is_floating])


def MakeStep(fprop, variables):
    """A tf.function train step: loss, gradients, one SGD update."""
    @tf.function
    def Step(inputs):
        with tf.GradientTape() as tape:
            loss = Loss(fprop(inputs))
        grads = tape.gradient(loss, variables)
        for v, g in zip(variables, grads):
            v.assign_sub(1e-4 * g)
        return loss
    return Step


def Unpipelined(layer):
    """The pipeline's layers chained on one device, on the whole batch."""
    def FProp(inputs):
        with tf.device(DEVICES[0]):
            args = (inputs,)
            for l in layer.Layers():
                args = base_layer.AsArgs(l.FProp(l.theta, *args))
            return args[0]
    return FProp


def TimeSteps(step, inputs, repeats):
    """(median seconds per step, peak bytes) after two warm-up steps."""
    for _ in range(2):
        step(inputs).numpy()
    tf.config.experimental.reset_memory_stats('CPU:0')
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step(inputs).numpy()
        times.append(time.perf_counter() - start)
    return statistics.median(times), tf.config.experimental.get_memory_info('CPU:0')['peak']


def BuildPipeline(layers, input_shapes, k, m, mode, devices):
    """The pipeline, unrolled (the executor this script and memory_vs_planner.py measure;
    `schedule_build.py` compares it with the loop)."""
    return pipelining_layer.PipeliningLayer.Params().Set(
        name='pipe', layer_tpl=layers, num_cells=k, num_micro_batches=m, recompute=mode,
        input_shapes=input_shapes, devices=devices, unroll=True).Instantiate()


def Overhead(model_name, quick, repeats, emit):
    layers, input_shapes, make_inputs = MODELS[model_name]()
    inputs = make_inputs()
    reference = BuildPipeline(layers, input_shapes, 1, 1, 'never', DEVICES[:1])
    base_step = MakeStep(Unpipelined(reference), reference.trainable_variables)
    # Measured twice, keeping the second: a fresh process's first seconds run measurably slower
    # (seen here: 360 ms, then 185 ms for the same step).
    TimeSteps(base_step, inputs, repeats)
    base_time, base_peak = TimeSteps(base_step, inputs, repeats)
    emit(dict(benchmark='overhead', model=model_name, devices=1, k=1, m=1, recompute='-',
              pipelined=False, step_s=base_time, peak_bytes=base_peak, vs_unpipelined=1.0))
    micro_batches = [1, 8] if quick else [1, 4, 8]
    modes = ['always', 'never'] if quick else list(plan_lib.RECOMPUTE_MODES)
    for num_devices in (2, 4):
        for m in micro_batches:
            for mode in modes:
                layer = BuildPipeline(layers, input_shapes, num_devices, m, mode,
                                      DEVICES[:num_devices])
                step_time, peak = TimeSteps(MakeStep(layer, layer.trainable_variables), inputs,
                                            repeats)
                emit(dict(benchmark='overhead', model=model_name, devices=num_devices,
                          k=num_devices, m=m, recompute=mode, pipelined=True, step_s=step_time,
                          peak_bytes=peak, vs_unpipelined=step_time / base_time))


def BuildTime(model_name, quick, emit):
    # A batch of 64 so that M=64 micro-batches are possible for every model.
    layers, input_shapes, make_inputs = MODELS[model_name](batch=64)
    inputs = make_inputs()
    for k in ([2, 8] if quick else [2, 4, 8]):
        for m in ([8, 32] if quick else [8, 32, 64]):
            start = time.perf_counter()
            layer = BuildPipeline(layers, input_shapes, k, m, 'always', DEVICES[:k])
            built = time.perf_counter()
            MakeStep(layer, layer.trainable_variables)(inputs).numpy()
            done = time.perf_counter()
            emit(dict(benchmark='build', model=model_name, devices=k, k=k, m=m,
                      recompute='always', layer_build_s=built - start,
                      trace_and_first_step_s=done - built, total_s=done - start))


def FormatRow(row):
    if row['benchmark'] == 'build':
        return (f"{row['model']:13s} build  K={row['k']} M={row['m']:<3d} layer "
                f"{row['layer_build_s']:6.2f}s  trace+first step "
                f"{row['trace_and_first_step_s']:6.2f}s  total {row['total_s']:6.2f}s")
    return (f"{row['model']:13s} dev={row['devices']} K={row['k']} M={row['m']:<2d} "
            f"{row['recompute']:12s} step {1e3 * row['step_s']:8.1f} ms  "
            f"x{row['vs_unpipelined']:4.2f}  peak {row['peak_bytes'] / 2**20:8.1f} MiB")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--quick', action='store_true', help='Fewer configurations.')
    parser.add_argument('--repeats', type=int, default=3, help='Timed steps per configuration.')
    parser.add_argument('--models', default=','.join(MODELS), help='Comma-separated models.')
    parser.add_argument('--only', choices=['overhead', 'build'], default=None,
                        help='Run one of the two benchmarks only.')
    parser.add_argument('--threads', choices=['shared', 'per_device'], default='shared',
                        help='Thread pools; see the module docstring.')
    parser.add_argument('--out', default=None,
                        help='JSON path; default benchmarks/results/pipeline_overhead_'
                             '<threads>.json')
    args = parser.parse_args()
    Setup(args.threads)
    out = args.out or f'benchmarks/results/pipeline_overhead_{args.threads}.json'
    logging.set_verbosity(logging.WARNING)
    rows = []

    def Emit(row):
        rows.append(row)
        print(FormatRow(row), flush=True)
        os.makedirs(os.path.dirname(out) or '.', exist_ok=True)
        with open(out, 'w', encoding='utf-8') as f:  # After every row: nothing lost on a crash.
            json.dump({'tensorflow': tf.__version__, 'cpu_cores': os.cpu_count(),
                       'virtual_devices': len(DEVICES), 'threads': args.threads, 'rows': rows},
                      f, indent=1)

    print(f'TensorFlow {tf.__version__}, {os.cpu_count()} CPU cores split into '
          f'{len(DEVICES)} virtual devices, threads={args.threads}')
    for model_name in args.models.split(','):
        if args.only in (None, 'overhead'):
            Overhead(model_name, args.quick, args.repeats, Emit)
        if args.only in (None, 'build'):
            BuildTime(model_name, args.quick, Emit)
    print(f'wrote {out}')


if __name__ == '__main__':
    main()
