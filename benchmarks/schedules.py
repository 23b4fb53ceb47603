r"""Every schedule on 8 virtual CPU devices: step time, memory, simulated and measured bubble.

A 16-layer dense stack (512 wide, ReLU, batch 256), re-materializing (or as `--recompute`
says), K in {4, 8} devices (2K
cells of interleaved_1f1b and zero_bubble_v) and M in {8, 32}, one thread per op and as many ops
in flight as devices, so that each virtual device acts as one core of its own (the machine has
fewer cores than devices: expect contention). Per schedule and (K, M):

  step_ms           median of 5 train steps (loss, gradients, SGD) in a tf.function
  peak_mib          measured peak of a step above what was allocated before it (so without the
                    variables), all devices together (virtual CPU devices share one allocator,
                    so per-device peaks cannot be measured here)
  planned_mib       the memory planner's sum over devices (`perf.memory.FromPlan`), and its
                    largest device (planned_device_mib)
  bubble_simulated  `perf.simulator` on the plan's FLOPs with backward = 2 forward
  bubble_measured   1 - busy / (K x makespan) of a traced step (`perf.trace`), the loss and
                    update included in the makespan

    python benchmarks/schedules.py [--quick] [--unroll=true|false|auto] [--schedules=gpipe,...]
        [--recompute=always|except_last|never]
        [--plot_dir=benchmarks/results/schedule_timelines]
        [--out=benchmarks/results/schedules.json]

`--unroll` is the pipeline's `unroll` (default true: the schedule unrolled into the graph; false:
run as a loop, `pipeline/looped.py`; auto: by the plan's rule, as docs/schedules.md's tables were
measured).
"""

from __future__ import annotations

import os

os.environ.setdefault('TF_CPU_ALLOCATOR_USE_BFC', 'true')
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import argparse  # pylint: disable=g-import-not-at-top,g-bad-import-order
import json
import statistics
import time

import tensorflow as tf  # pylint: disable=g-import-not-at-top,g-bad-import-order

NUM_DEVICES = 8
BATCH, WIDTH, LAYERS = 256, 512, 16
MIB = 2.0 ** 20


def Setup() -> list[str]:
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(NUM_DEVICES)
    from gpipe_tf import test_utils  # pylint: disable=g-import-not-at-top
    return test_utils.ConfigureVirtualCpus(NUM_DEVICES)


def Build(kind, k, m, devices, unroll=True, recompute='always'):
    from gpipe_tf.layers import basic  # pylint: disable=g-import-not-at-top
    from gpipe_tf.pipeline import pipelining_layer  # pylint: disable=g-import-not-at-top
    from gpipe_tf.pipeline import schedule as schedule_lib  # pylint: disable=g-import-not-at-top
    virtual = schedule_lib.Kind(kind).searched_virtual_stages
    layers = [basic.DenseLayer.Params().Set(name=f'dense_{i}', input_dim=WIDTH,
                                            output_dim=WIDTH, activation='relu')
              for i in range(LAYERS)]
    return pipelining_layer.PipeliningLayer.Params().Set(
        name='pipe', layer_tpl=layers, num_cells=k, virtual_stages=virtual,
        num_micro_batches=m, schedule=kind, input_shapes=[BATCH, WIDTH],
        devices=devices[:k], unroll=unroll, recompute=recompute).Instantiate()


def LossFn(outputs, _):
    return tf.reduce_mean(tf.square(outputs)), tf.constant(1.0)


def MakeStep(layer, kind):
    from gpipe_tf.pipeline import schedule as schedule_lib  # pylint: disable=g-import-not-at-top
    variables = layer.trainable_variables

    @tf.function
    def Step(x):
        with tf.GradientTape() as tape:
            if not schedule_lib.Kind(kind).loss_inside_pipeline:
                loss = LossFn(layer(x), None)[0]
            else:
                _, loss, _ = layer.FPropLoss(layer.theta, x, LossFn)
        for v, g in zip(variables, tape.gradient(loss, variables)):
            v.assign_sub(1e-4 * g)
        return loss
    return Step


def Measure(kind, k, m, devices, unroll=True, plot_dir=None, recompute='always') -> dict:
    from gpipe_tf.perf import memory  # pylint: disable=g-import-not-at-top
    from gpipe_tf.pipeline import executor  # pylint: disable=g-import-not-at-top
    from gpipe_tf.perf import simulator  # pylint: disable=g-import-not-at-top
    from gpipe_tf.perf import trace  # pylint: disable=g-import-not-at-top
    layer = Build(kind, k, m, devices, unroll, recompute)
    step = MakeStep(layer, kind)
    x = tf.random.stateless_normal([BATCH, WIDTH], [1, 2])
    start = time.perf_counter()
    step(x).numpy()
    first = time.perf_counter() - start
    step(x).numpy()
    times = []
    for _ in range(5):
        begin = time.perf_counter()
        step(x).numpy()
        times.append(time.perf_counter() - begin)
    tf.config.experimental.reset_memory_stats('CPU:0')
    # What earlier configurations of this process still hold is not this step's.
    held = tf.config.experimental.get_memory_info('CPU:0')['current']
    step(x).numpy()
    peak = tf.config.experimental.get_memory_info('CPU:0')['peak'] - held
    plan = layer.plan
    planned = memory.FromPlan(plan)
    flops = [meta.flops / m for meta in plan.metas]
    costs = simulator.CostsFromFlops(flops, 1e9)
    simulated = simulator.Simulate(costs, m, plan.recompute, schedule=plan.schedule)
    events = trace.TraceFunction(step, x)
    measured = trace.MeasuredTimeline(events, plan.num_cells, num_devices=plan.num_devices,
                                      device_of=plan.schedule.DeviceOf)
    if plot_dir:
        from gpipe_tf.perf import plot  # pylint: disable=g-import-not-at-top
        for name, timeline in (('predicted', simulated), ('measured', measured)):
            plot.SavePng(plot.TimelineFigure(
                timeline, title=f'{kind}, K={k}, M={m}: {name}, bubble {timeline.bubble:.2f}'),
                os.path.join(plot_dir, f'{kind}{"" if recompute == "always" else "_" + recompute}'
                                       f'_k{k}_m{m}_{name}.png'))
    loops = executor.Choose(plan, m).loops
    return dict(schedule=kind, k=k, v=plan.virtual_stages, m=m, looped=loops,
                recompute=recompute,
                first_step_s=first,
                step_ms=1e3 * statistics.median(times), peak_mib=peak / MIB,
                planned_mib=sum(planned.device_totals) / MIB,
                planned_device_mib=max(planned.device_totals) / MIB,
                bubble_simulated=simulated.bubble, bubble_measured=measured.bubble)


def Main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--quick', action='store_true', help='K=4, M=8 only.')
    parser.add_argument('--out', default=os.path.join(os.path.dirname(__file__), 'results',
                                                      'schedules.json'))
    parser.add_argument('--plot_dir', default=None,
                        help='Also write each row\'s predicted and measured timelines here '
                             '(<schedule>_k<K>_m<M>_<predicted|measured>.png).')
    parser.add_argument('--schedules', default=None,
                        help='Comma-separated kinds to measure (default: every kind).')
    parser.add_argument('--unroll', default='true', choices=('true', 'false', 'auto'),
                        help="The pipeline's unroll: unrolled, a loop, or by the plan's rule.")
    parser.add_argument('--recompute', default='always', choices=('always', 'except_last',
                                                                  'never'),
                        help="The pipeline's recompute mode.")
    args = parser.parse_args()
    unroll = {'true': True, 'false': False, 'auto': 'auto'}[args.unroll]
    devices = Setup()
    from gpipe_tf.pipeline import schedule  # pylint: disable=g-import-not-at-top
    rows = []
    print(f'{"schedule":17s} {"K":>2s} {"M":>3s} {"step ms":>8s} {"peak MiB":>9s} '
          f'{"planned":>8s} {"bubble sim":>10s} {"measured":>8s}', flush=True)
    for k in ([4] if args.quick else [4, 8]):
        for m in ([8] if args.quick else [8, 32]):
            for kind in (args.schedules.split(',') if args.schedules else schedule.KINDS):
                row = Measure(kind, k, m, devices, unroll, args.plot_dir, args.recompute)
                rows.append(row)
                print(f'{kind:17s} {k:2d} {m:3d} {row["step_ms"]:8.1f} {row["peak_mib"]:9.1f} '
                      f'{row["planned_mib"]:8.1f} {row["bubble_simulated"]:10.3f} '
                      f'{row["bubble_measured"]:8.3f}', flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, 'w', encoding='utf-8') as f:
        json.dump(rows, f, indent=1)
    print(f'wrote {args.out}')


if __name__ == '__main__':
    Main()
