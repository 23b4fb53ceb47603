r"""The time partition and the tuner against measured steps, on two virtual CPU devices that each
behave like one core (one thread per op).

For three models with uneven layers — a dense stack whose widths vary tenfold, AmoebaNetD_Small,
and a Transformer LM with its embedding and softmax (TransformerLTiny at batch 64) — at K=2:

  * partition: the measured step of the FLOPs partition, of the time partition
    (`partition_method='time'`) and of every other boundary placement (exhaustive at K=2),
    under gpipe with the model's M and no re-materialization;
  * tuner: as `--mode=tune` chooses, with ample memory: measured costs calibrated on measured
    gpipe steps (`tuner.Calibrate`), `tuner.Tune`, and the fastest measured of its
    `--chosen_from` best-ranked (`tuner.MeasureBest`); its `--top` best-ranked configurations
    are then measured afresh, and the choice is compared with the best of them and with its own
    prediction (the best-ranked too: what the simulation alone would choose);
  * memory: with a memory limit of `--memory_share` of the FLOPs-balanced gpipe
    configuration's planned peak, the tuner's pick must fit; its planned step bytes (all devices
    in one memory, as virtual CPUs are) are compared with the measured peak of a step.

A step is the pipeline's `FPropLoss` on synthesized inputs (a mean square of its float outputs,
per micro-batch), its gradients and an SGD update, in a tf.function; the median of `--repeats`
steps after two warm-ups.

    python benchmarks/tuner_quality.py [--models=dense,amoebanet,lm] [--top=5] [--chosen_from=3]
        [--parts=partition,tuner,memory] [--out=...]

Prints a table as it goes and writes every row to JSON.
"""

from __future__ import annotations

import os

os.environ.setdefault('TF_CPU_ALLOCATOR_USE_BFC', 'true')
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import argparse  # pylint: disable=g-import-not-at-top,g-bad-import-order
import json
import statistics
import time

import pipeline_overhead as bench  # Same directory: devices and thread set-up.

import tensorflow as tf  # pylint: disable=g-import-not-at-top,g-bad-import-order


def DenseParams():
    from gpipe_tf.layers import basic  # pylint: disable=g-import-not-at-top
    from gpipe_tf.pipeline import pipelining_layer  # pylint: disable=g-import-not-at-top
    widths = [64, 640, 64, 320, 64, 640, 128, 64, 64]
    layers = [basic.DenseLayer.Params().Set(name=f'dense_{i}', input_dim=a, output_dim=b,
                                            activation='tanh')
              for i, (a, b) in enumerate(zip(widths[:-1], widths[1:]))]
    return pipelining_layer.PipeliningLayer.Params().Set(
        name='dense', layer_tpl=layers, num_micro_batches=4, input_shapes=[2048, 64])


def RegisteredParams(key, batch=None):
    from gpipe_tf import model_registry  # pylint: disable=g-import-not-at-top
    p = model_registry.GetParams(key, 'Train').model.Copy()
    if batch:
        p.input_shapes = {k: [batch] + list(v[1:]) for k, v in p.input_shapes.items()}
    return p


MODELS = {
    'dense': DenseParams,
    'amoebanet': lambda: RegisteredParams('image.amoebanet.AmoebaNetD_Small'),
    'lm': lambda: RegisteredParams('lm.TransformerLTiny', batch=64),
}


def Loss(outputs, weights):
    floats = [x for x in tf.nest.flatten(outputs) if x.dtype.is_floating]
    value = tf.add_n([tf.reduce_mean(tf.square(tf.cast(x, tf.float32))) for x in floats])
    return value, tf.reduce_sum(weights)


def Measure(p, repeats):
    """(median step seconds, peak bytes a step allocates above what was in use before it)."""
    from gpipe_tf.layers import fprop_context  # pylint: disable=g-import-not-at-top
    from gpipe_tf.perf import measured_costs  # pylint: disable=g-import-not-at-top
    from gpipe_tf.pipeline import fields  # pylint: disable=g-import-not-at-top
    layer = p.Copy().Set(devices=bench.DEVICES[:p.num_cells]).Instantiate()
    inputs = measured_costs.PipelineInputs(p)[0]  # The pipeline's one input (a nest).
    weights = tf.ones([fields.BatchSize(p)])

    @tf.function
    def Step(inputs, weights):
        with tf.GradientTape() as tape, fprop_context.Scope(training=True):
            _, loss, _ = layer.FPropLoss(layer.theta, inputs, Loss, weights)
        variables = layer.trainable_variables
        for v, g in zip(variables, tape.gradient(loss, variables)):
            v.assign_sub(1e-4 * g)
        return loss

    for _ in range(2):
        Step(inputs, weights).numpy()
    tf.config.experimental.reset_memory_stats('CPU:0')
    before = tf.config.experimental.get_memory_info('CPU:0')['current']
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        Step(inputs, weights).numpy()
        times.append(time.perf_counter() - started)
    return statistics.median(times), tf.config.experimental.get_memory_info('CPU:0')['peak'] - before


def Bounds(p):
    from gpipe_tf.pipeline import plan as plan_lib  # pylint: disable=g-import-not-at-top
    return plan_lib.MakePlan(p, place=False).boundaries


def Partitions(name, p, repeats, emit):
    """FLOPs and time partitions against every cut at K=2 (gpipe, no re-materialization)."""
    base = p.Copy().Set(num_cells=2, schedule='gpipe', recompute='never', virtual_stages=1,
                        devices=bench.DEVICES[:2])
    num_layers = len(p.layer_tpl)
    flops = Bounds(base.Copy().Set(partition_method='flops'))
    from gpipe_tf.perf import measured_costs  # pylint: disable=g-import-not-at-top
    timed = measured_costs.TimedBoundaries(base.Copy().Set(partition_method='time'))
    steps = {}
    for cut in range(1, num_layers):
        steps[cut], _ = Measure(base.Copy().Set(partition_method=[0, cut, num_layers]), repeats)
        print(f'  {name}: cut {cut}: {steps[cut] * 1e3:.1f} ms', flush=True)
    best = min(steps, key=steps.get)
    row = dict(benchmark='partition', model=name, flops_boundaries=flops,
               time_boundaries=timed, best_boundaries=[0, best, num_layers],
               flops_step_s=steps[flops[1]], time_step_s=steps[timed[1]],
               best_step_s=steps[best], every_cut_s={str(c): s for c, s in steps.items()},
               time_vs_best=steps[timed[1]] / steps[best],
               time_vs_flops=steps[timed[1]] / steps[flops[1]])
    print(f'{name}: FLOPs {flops} {row["flops_step_s"] * 1e3:.1f} ms, time {timed} '
          f'{row["time_step_s"] * 1e3:.1f} ms, best {row["best_boundaries"]} '
          f'{row["best_step_s"] * 1e3:.1f} ms: time/best {row["time_vs_best"]:.3f}, '
          f'time/FLOPs {row["time_vs_flops"]:.3f}', flush=True)
    emit(row)


def Tuned(name, p, top, chosen_from, repeats, emit):
    """The tuner's choice with ample memory against its `top` best-ranked configurations: the
    costs calibrated on measured gpipe steps (`tuner.Calibrate`), the fastest measured of the
    `chosen_from` best-ranked chosen (`tuner.MeasureBest`), as `--mode=tune` does; then the
    `top` best-ranked are measured again, afresh, as the oracle."""
    from gpipe_tf.perf import cost_model  # pylint: disable=g-import-not-at-top
    from gpipe_tf.perf import tuner  # pylint: disable=g-import-not-at-top
    base = p.Copy().Set(num_cells=2, devices=bench.DEVICES[:2])
    costs = cost_model.MeasuredCosts(base)
    timed = lambda candidate: Measure(candidate.params, repeats)[0]
    calibrated = tuner.Calibrate(base, 2, costs, timed, 64 * 2**30, slots_per_param=0)
    print(f'{name}: layer costs {calibrated.description}', flush=True)
    result = tuner.Tune(base, 2, 64 * 2**30, calibrated, slots_per_param=0)
    print(result.Format(top), flush=True)
    chosen = tuner.MeasureBest(result, timed, chosen_from,
                               progress=lambda line: print(f'  {name}: tuner {line}',
                                                           flush=True))[0][0]
    measured, ranked = [], result.candidates[:top]
    for candidate in list(ranked):
        try:
            step_s, _ = Measure(candidate.params, repeats)
        except Exception as error:  # pylint: disable=broad-except
            # Recorded, not hidden: a configuration the pipeline fails to build.
            print(f'  {name}: {candidate.config}: FAILED {type(error).__name__}: '
                  f'{str(error).splitlines()[0][:200]}', flush=True)
            emit(dict(benchmark='tuner_failure', model=name, config=str(candidate.config),
                      error=f'{type(error).__name__}: {str(error).splitlines()[0]}'))
            ranked.remove(candidate)
            continue
        measured.append(step_s)
        print(f'  {name}: {candidate.config} {list(candidate.boundaries)}: predicted '
              f'{candidate.step_s * 1e3:.1f} ms, measured {step_s * 1e3:.1f} ms', flush=True)
    if not measured or chosen not in ranked:
        return
    pick = ranked.index(chosen)
    first = ranked[0]  # The best-ranked: what the simulation alone would choose.
    row = dict(benchmark='tuner', model=name, costs=calibrated.description,
               pick=str(chosen.config), pick_rank=pick + 1, chosen_from=chosen_from,
               pick_boundaries=list(chosen.boundaries), predicted_s=chosen.step_s,
               measured_s=measured[pick], best_measured_s=min(measured),
               best_measured=str(ranked[measured.index(min(measured))].config),
               ranked=[dict(config=str(c.config), boundaries=list(c.boundaries),
                            predicted_s=c.step_s, measured_s=s)
                       for c, s in zip(ranked, measured)],
               pick_vs_best=measured[pick] / min(measured),
               predicted_vs_measured=chosen.step_s / measured[pick],
               first_ranked=str(first.config), first_vs_best=measured[0] / min(measured),
               first_predicted_vs_measured=first.step_s / measured[0])
    print(f'{name}: chosen {row["pick"]} (rank {pick + 1}): measured {row["measured_s"] * 1e3:.1f} '
          f'ms, best of the top {top} {row["best_measured_s"] * 1e3:.1f} ms '
          f'({row["best_measured"]}): chosen/best {row["pick_vs_best"]:.3f}, predicted/measured '
          f'{row["predicted_vs_measured"]:.3f}; best-ranked {row["first_ranked"]}: /best '
          f'{row["first_vs_best"]:.3f}, predicted/measured '
          f'{row["first_predicted_vs_measured"]:.3f}', flush=True)
    emit(row)


def Fitted(name, p, repeats, memory_share, emit):
    """The tuner's pick under a memory limit the FLOPs-balanced gpipe configuration exceeds:
    its planned step bytes against the measured."""
    from gpipe_tf.perf import cost_model  # pylint: disable=g-import-not-at-top
    from gpipe_tf.perf import memory as memory_lib  # pylint: disable=g-import-not-at-top
    from gpipe_tf.perf import tuner  # pylint: disable=g-import-not-at-top
    base = p.Copy().Set(num_cells=2, devices=bench.DEVICES[:2])
    costs = cost_model.MeasuredCosts(base)
    gpipe = memory_lib.PlanMemory(base.Copy().Set(schedule='gpipe', recompute='never',
                                                  virtual_stages=1, partition_method='flops'),
                                  0)
    limit = memory_share * gpipe.peak_device_bytes
    fitted = tuner.Tune(base, 2, limit, costs, slots_per_param=0)
    best = fitted.best
    if best is None:
        print(f'{name}: nothing fits {limit / 2**20:.1f} MiB', flush=True)
        emit(dict(benchmark='memory', model=name, limit_bytes=limit, fits=False))
        return
    step_s, peak = Measure(best.params, repeats)
    planned = best.memory.step_bytes
    row = dict(benchmark='memory', model=name, limit_bytes=limit,
               gpipe_flops_peak_bytes=gpipe.peak_device_bytes, pick=str(best.config),
               pick_boundaries=list(best.boundaries), moved=best.moved,
               planned_peak_device_bytes=best.peak_bytes, planned_step_bytes=planned,
               planned_cells=[{name: getattr(c, name) for name in memory_lib.COMPONENTS}
                              for c in best.memory.cells],
               measured_step_bytes=peak, planned_vs_measured=planned / peak if peak else None,
               predicted_s=best.step_s, measured_s=step_s, fits=True)
    print(f'{name}: limit {limit / 2**20:.1f} MiB (gpipe on FLOPs plans '
          f'{gpipe.peak_device_bytes / 2**20:.1f}): pick {best.config} '
          f'{list(best.boundaries)}{" (moved)" if best.moved else ""}, planned step '
          f'{planned / 2**20:.1f} MiB, measured {peak / 2**20:.1f} MiB', flush=True)
    emit(row)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--models', default=','.join(MODELS))
    parser.add_argument('--top', type=int, default=5)
    parser.add_argument('--chosen_from', type=int, default=3,
                        help="The tuner's choice: the fastest measured of this many best-ranked.")
    parser.add_argument('--repeats', type=int, default=7)
    parser.add_argument('--memory_share', type=float, default=0.6)
    parser.add_argument('--parts', default='partition,tuner,memory',
                        help='Comma-separated: which of partition, tuner, memory to run.')
    parser.add_argument('--out', default='benchmarks/results/tuner_quality.json')
    args = parser.parse_args()
    bench.Setup('per_device')
    parts = args.parts.split(',')
    unknown = sorted(set(parts) - {'partition', 'tuner', 'memory'})
    if unknown:
        parser.error(f'unknown --parts {unknown}; expected partition, tuner, memory')
    rows = []
    for name in args.models.split(','):
        p = MODELS[name]()
        if 'partition' in parts:
            Partitions(name, p, args.repeats, rows.append)
        if 'tuner' in parts:
            Tuned(name, p, args.top, args.chosen_from, args.repeats, rows.append)
        if 'memory' in parts:
            Fitted(name, p, args.repeats, args.memory_share, rows.append)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, 'w') as f:
        json.dump(rows, f, indent=1)
    print(f'wrote {args.out}')


if __name__ == '__main__':
    main()
