r"""Does the schedule simulator predict measured step times? K=2 cells on 2 virtual CPU devices.

    python benchmarks/simulator_validation.py [--micro_batches=1,2,4,8] [--repeats=5]
        [--schedules=gpipe,1f1b,zero_bubble] [--recompute=always|never]

TensorFlow runs every op on one thread (intra-op 1) with two ops in flight (inter-op 2), so each
of the two virtual devices is one core of this 2-core machine: the pipeline's overlap is real.
The model is a stack of dense layers, partitioned into K=2 cells, re-materializing (always) or
keeping their activations (never). For each schedule and M:

  1. per-cell costs are measured in isolation: each cell's forward and its backward on one
     micro-batch, traced alone under the profiler, which times the forward, recompute and
     gradient ops apart (always: the backward recomputes the forward; never: the backward
     differentiates the forward's kept activations, fused as gpipe and 1f1b run it and split
     into input and weight gradients as zero_bubble runs it);
  2. `simulator.Simulate` predicts the step time from those costs for the schedule (transfers
     between virtual devices of one process are free: the runtime hands the tensor over);
  3. the real train step (loss, pipelined gradients, SGD update) is timed, and one step is traced
     with TensorFlow's profiler into a measured timeline;
  4. predicted vs measured step time (the target: within 20%), measured utilisation vs the
     simulated one and the schedule's ideal, and PNG Gantt charts of both timelines.

Prints a table as it goes; writes benchmarks/results/simulator_validation.json and the PNGs
(`<predicted|measured>_k2_m<M>.png` for gpipe with recompute always, else
`<schedule>_<recompute>_<predicted|measured>_k2_m<M>.png`).
"""

from __future__ import annotations

import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import argparse  # pylint: disable=g-import-not-at-top,g-bad-import-order
import json
import statistics
import time

import tensorflow as tf  # pylint: disable=g-import-not-at-top,g-bad-import-order

from gpipe_tf import test_utils  # pylint: disable=g-import-not-at-top
from gpipe_tf.layers import basic  # pylint: disable=g-import-not-at-top
from gpipe_tf.perf import plot  # pylint: disable=g-import-not-at-top
from gpipe_tf.perf import simulator  # pylint: disable=g-import-not-at-top
from gpipe_tf.perf import trace  # pylint: disable=g-import-not-at-top
from gpipe_tf.pipeline import cell as cell_lib  # pylint: disable=g-import-not-at-top
from gpipe_tf.pipeline import executor  # pylint: disable=g-import-not-at-top
from gpipe_tf.pipeline import leaves  # pylint: disable=g-import-not-at-top
from gpipe_tf.pipeline import pipelining_layer  # pylint: disable=g-import-not-at-top
from gpipe_tf.pipeline import schedule as schedule_lib  # pylint: disable=g-import-not-at-top

NUM_CELLS = 2
TOLERANCE = 0.20


def Setup() -> list[str]:
    """One thread per op, two ops in flight, two virtual devices: each device is one core."""
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(NUM_CELLS)
    return test_utils.ConfigureVirtualCpus(NUM_CELLS)


def Medians(fns, repeats: int) -> list[float]:
    """Median wall seconds of each `fn()` (which returns tensors), after a warm-up, the calls
    taken in turn, round after round, so that a slower phase of the machine falls on all."""
    def Time(fn):
        start = time.perf_counter()
        tf.nest.map_structure(lambda t: t.numpy(), fn())
        return time.perf_counter() - start
    for fn in fns:
        Time(fn)
    rounds = [[Time(fn) for fn in fns] for _ in range(repeats)]
    return [statistics.median(times) for times in zip(*rounds)]


def BoxSeconds(fn, args, repeats: int) -> dict:
    """Median seconds of each (kind) box of a traced call of `fn(*args)`: the ops' own time,
    without the call's dispatch, which the pipelined step (one function) does not pay per call."""
    fn(*args)  # Trace and warm up.
    seconds = {}
    for _ in range(repeats):
        for box in trace.MeasuredTimeline(trace.TraceFunction(fn, *args), NUM_CELLS).intervals:
            seconds.setdefault(box.kind, []).append(box.end - box.start)
    return {kind: statistics.median(values) for kind, values in seconds.items()}


def BuildPipeline(args, devices, num_micro_batches, kind='gpipe', recompute='always'):
    layers = [basic.DenseLayer.Params().Set(input_dim=args.width, output_dim=args.width,
                                            activation='relu') for _ in range(args.layers)]
    return pipelining_layer.PipeliningLayer.Params().Set(
        name='pipe', layer_tpl=layers, num_cells=NUM_CELLS, num_micro_batches=num_micro_batches,
        schedule=kind, recompute=recompute, input_shapes=[args.batch, args.width],
        devices=devices).Instantiate()


def CellCosts(layer, micro_batch_size: int, width: int, repeats: int) -> simulator.CellCosts:
    """Each cell's forward, recompute and backward on one micro-batch, traced alone (named as
    the pipeline names them, so the trace tells the recompute from the gradients)."""
    step, micro_batch = tf.constant(0, tf.int64), tf.constant(0, tf.int64)
    forward, recompute, backward = [], [], []
    for k, fn in enumerate(layer.cell_functions):
        theta = layer.CellTheta(k)
        with tf.device(fn.device):
            x = tf.random.stateless_normal([micro_batch_size, width], [k, 1])
            dy = [tf.random.stateless_normal([micro_batch_size, width], [k, 2])]

        @tf.function
        def Forward(x, k=k, fn=fn, theta=theta):
            with tf.name_scope(executor.OpScope(k, 0, 'fwd')):
                return fn.Forward(theta, x, step, micro_batch)[0]

        @tf.function
        def Backward(x, dy, k=k, fn=fn, theta=theta):
            with tf.name_scope(executor.OpScope(k, 0, 'bwd')):
                return [g for g in tf.nest.flatten(fn.Backward(theta, x, step, micro_batch, dy))
                        if g is not None]

        forward.append(BoxSeconds(Forward, (x,), repeats)['forward'])
        boxes = BoxSeconds(Backward, (x, dy), repeats)
        recompute.append(boxes['recompute'])
        backward.append(boxes['backward'])
    return simulator.CellCosts(forward=forward, backward=backward, recompute=recompute)


def KeptCellCosts(layer, micro_batch_size: int, width: int, repeats: int,
                  split: bool) -> simulator.CellCosts:
    """Each cell's forward and backward on one micro-batch when it keeps its activations
    (recompute never), traced alone: the backward fused (gpipe, 1f1b) or, with `split`, the
    input gradient and the weight gradient apart (zero_bubble), as the executors run them
    (the parts of `cell.CellSplit`); its `weight_fraction` is their measured ratio."""
    step, micro_batch = tf.constant(0, tf.int64), tf.constant(0, tf.int64)
    forward, backward, fractions = [], [], []
    for k, fn in enumerate(layer.cell_functions):
        theta = layer.CellTheta(k)
        with tf.device(fn.device):
            x = tf.random.stateless_normal([micro_batch_size, width], [k, 1])
            dy = [tf.random.stateless_normal([micro_batch_size, width], [k, 2])]
        parts = (fn.Split(theta, leaves.Specs(x), tf.TensorSpec([], tf.int64)) if split
                 else None)

        @tf.function
        def Fused(x, dy, k=k, fn=fn, theta=theta):
            with tf.device(fn.device):
                theta, x = leaves.Identity(theta), leaves.Identity(x)
                with tf.name_scope(executor.OpScope(k, 0, 'fwd')):
                    y, _ = fn.Forward(theta, x, step, micro_batch)
                with tf.name_scope(executor.OpScope(k, 0, 'bwd')):
                    grads = cell_lib.Differentiate(y, theta, x, dy, fn.trainable)
            return [g for g in tf.nest.flatten(grads) if g is not None]

        @tf.function
        def Split(x, dy, k=k, theta=theta, parts=parts):
            with tf.name_scope(executor.OpScope(k, 0, 'fwd')):
                _, _, kept = parts.Forward(theta, x, step, micro_batch)
            with tf.name_scope(executor.OpScope(k, 0, 'bwd_input')):
                d_x, saved = parts.Input(theta, kept, step, micro_batch, dy)
            with tf.name_scope(executor.OpScope(k, 0, 'bwd_weight')):
                d_theta = parts.Weight(theta, saved, step, micro_batch)
            return [g for g in tf.nest.flatten((d_x, d_theta)) if g is not None]

        if split:
            boxes = BoxSeconds(Split, (x, dy), repeats)
            backward.append(boxes['input_grad'] + boxes['weight_grad'])
            fractions.append(boxes['weight_grad'] / backward[-1])
        else:
            boxes = BoxSeconds(Fused, (x, dy), repeats)
            backward.append(boxes['backward'])
        forward.append(boxes['forward'])
    return simulator.CellCosts(forward=forward, backward=backward,
                               weight_fraction=statistics.mean(fractions) if split else 0.5)


def LossFn(outputs, _):
    """A loss whose gradient needs every output, as real losses do; weight 1 per micro-batch
    (the mean of the micro-batches' means is the batch's mean)."""
    return tf.reduce_mean(tf.square(outputs)), tf.constant(1.0)


def TrainStep(layer, learning_rate=1e-4, kind='gpipe'):
    variables = layer.trainable_variables

    @tf.function
    def Step(x):
        with tf.GradientTape() as tape:
            if not schedule_lib.Kind(kind).loss_inside_pipeline:  # After, on the whole batch.
                loss = LossFn(layer(x), None)[0]
            else:  # The loss per micro-batch, on the last stage (1f1b, zero_bubble need it).
                _, loss, _ = layer.FPropLoss(layer.theta, x, LossFn)
        for v, g in zip(variables, tape.gradient(loss, variables)):
            v.assign_sub(learning_rate * g)
        return loss
    return Step


def Costs(layer, kind, recompute, args, micro_batch_size) -> simulator.CellCosts:
    """The cell costs the simulator walks `kind`'s schedule on (see the module docstring)."""
    split = layer.plan.schedule.splits_backward
    if recompute == 'never':
        return KeptCellCosts(layer, micro_batch_size, args.width, args.repeats, split)
    costs = CellCosts(layer, micro_batch_size, args.width, args.repeats)
    if not split:
        return costs
    # A re-materializing split backward: the recompute, then I and W as a kept cell runs them.
    kept = KeptCellCosts(layer, micro_batch_size, args.width, args.repeats, split)
    return simulator.CellCosts(forward=costs.forward, recompute=costs.recompute,
                               backward=kept.backward, weight_fraction=kept.weight_fraction)


def PngName(kind, recompute, name, m) -> str:
    if (kind, recompute) == ('gpipe', 'always'):
        return f'{name}_k{NUM_CELLS}_m{m}.png'
    return f'{kind}_{recompute}_{name}_k{NUM_CELLS}_m{m}.png'


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--micro_batches', default='1,2,4,8', help='Comma-separated M values.')
    parser.add_argument('--layers', type=int, default=8, help='Dense layers (L).')
    parser.add_argument('--width', type=int, default=512, help='Width of each dense layer.')
    parser.add_argument('--batch', type=int, default=512, help='Mini-batch size (N).')
    parser.add_argument('--repeats', type=int, default=5, help='Timed runs per measurement.')
    parser.add_argument('--schedules', default='gpipe', help='Comma-separated schedule kinds '
                        '(one stage per device: gpipe, 1f1b, zero_bubble).')
    parser.add_argument('--recompute', default='always', choices=('always', 'never'))
    parser.add_argument('--out', default='benchmarks/results/simulator_validation.json')
    parser.add_argument('--plot_dir', default='benchmarks/results/timelines',
                        help='Where the Gantt charts go.')
    args = parser.parse_args()
    devices = Setup()
    print(f'TensorFlow {tf.__version__}, {os.cpu_count()} CPU cores, {NUM_CELLS} virtual devices '
          f'(intra-op 1, inter-op {NUM_CELLS} threads); {args.layers} dense layers of '
          f'{args.width}, batch {args.batch}, K={NUM_CELLS}, recompute {args.recompute}')
    print(f"{'schedule':12s} {'M':>3} {'predicted ms':>13} {'measured ms':>12} {'pred/meas':>10} "
          f"{'sim util':>9} {'meas util':>10} {'ideal':>6}  within {TOLERANCE:.0%}", flush=True)
    rows = []
    x = tf.random.stateless_normal([args.batch, args.width], [1, 2])
    for m in [int(v) for v in args.micro_batches.split(',')]:
        runs = []
        for kind in args.schedules.split(','):
            layer = BuildPipeline(args, devices, m, kind, args.recompute)
            costs = Costs(layer, kind, args.recompute, args, args.batch // m)
            runs.append((kind, layer, costs, TrainStep(layer, kind=kind)))
        times = Medians([lambda step=step: step(x) for *_, step in runs], args.repeats)
        for (kind, layer, costs, step), measured_s in zip(runs, times):
            predicted = simulator.Simulate(costs, m, layer.plan.recompute,
                                           schedule=layer.plan.schedule)
            measured = trace.MeasuredTimeline(trace.TraceFunction(step, x), NUM_CELLS)
            ideal = simulator.IdealUtilisation(m, NUM_CELLS, kind)
            ratio = predicted.makespan / measured_s
            row = dict(schedule=kind, recompute=args.recompute, k=NUM_CELLS, m=m,
                       layers=args.layers, width=args.width, batch=args.batch,
                       forward_s=list(costs.forward), recompute_s=(
                           None if costs.recompute is None else list(costs.recompute)),
                       backward_s=list(costs.backward), weight_fraction=costs.weight_fraction,
                       predicted_step_s=predicted.makespan, measured_step_s=measured_s,
                       predicted_over_measured=ratio,
                       within_tolerance=abs(ratio - 1) <= TOLERANCE,
                       simulated_utilisation=predicted.utilisation,
                       measured_utilisation=measured.utilisation,
                       traced_step_s=measured.makespan, ideal_utilisation=ideal)
            rows.append(row)
            for name, timeline in (('predicted', predicted), ('measured', measured)):
                plot.SavePng(plot.TimelineFigure(
                    timeline, title=f'{kind}, recompute {args.recompute}: {name}, '
                    f'K={NUM_CELLS} M={m}', ideal_utilisation=ideal),
                    os.path.join(args.plot_dir, PngName(kind, args.recompute, name, m)))
            print(f'{kind:12s} {m:3d} {1e3 * predicted.makespan:13.1f} {1e3 * measured_s:12.1f} '
                  f'{ratio:10.2f} {predicted.utilisation:9.1%} {measured.utilisation:10.1%} '
                  f"{ideal:6.1%}  {'yes' if row['within_tolerance'] else 'NO'}", flush=True)
            os.makedirs(os.path.dirname(args.out) or '.', exist_ok=True)
            with open(args.out, 'w', encoding='utf-8') as f:  # After every row: nothing lost.
                json.dump({'tensorflow': tf.__version__, 'cpu_cores': os.cpu_count(),
                           'tolerance': TOLERANCE, 'rows': rows}, f, indent=1)
    print(f'wrote {args.out} and timelines under {args.plot_dir}')


if __name__ == '__main__':
    main()
