"""`--mode=tune`: the pipeline configures itself for K devices of a given memory.

Scores every configuration of the search (`perf.tuner`) on measured layer costs where this
machine can run the model (else on FLOPs), prints the ranked table, writes the pick as a Params
override file (`<logdir>/tuned_params.txt`, for `--model_params_file_override`), and, with
measured costs, runs the pick for a few steps and prints its measured step and memory beside the
prediction.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time

import tensorflow as tf

from gpipe_tf import errors
from gpipe_tf import units
from gpipe_tf.perf import cost_model
from gpipe_tf.perf import measured_costs
from gpipe_tf.perf import memory as memory_lib
from gpipe_tf.perf import tuner
from gpipe_tf.pipeline import fields
from gpipe_tf.pipeline import pipelining_layer
from gpipe_tf.train import logdir as logdir_lib

COSTS = ('auto', 'measured', 'flops')
TUNED_PARAMS = 'tuned_params.txt'
# The pipeline's Params the tuner chooses, as task Params keys under `model.`.
TUNED_KEYS = ('num_cells', 'num_micro_batches', 'micro_batch_size', 'schedule', 'virtual_stages',
              'recompute', 'partition_method')
# Run the pick only when its steps are predicted to take at most this many seconds.
_MAX_RUN_S = 120.0
# Measure only a model whose un-partitioned step takes at most this share of host memory.
_HOST_SHARE = 0.5


def OverrideText(task_params, candidate: tuner.Candidate) -> str:
    """The candidate's pipeline settings as Params override lines (`model.<key> : <value>`)."""
    task = task_params.Copy()
    task.model = candidate.params
    wanted = {f'model.{key}' for key in TUNED_KEYS}
    return ''.join(line + '\n' for line in task.ToText().splitlines()
                   if line.split(' : ', 1)[0].strip() in wanted)


def SetNumCells(task_params, name: str, num_devices: int) -> None:
    """Sets K, the cells the pipeline of model `name` is tuned for, from --num_devices: R
    replicas (`model.num_replicas`) of K cells, one device each. A model that is not a
    pipeline is left to `Run` to refuse.

    Raises:
      errors.ConfigError: for devices that do not split into R replicas of at least one device
        each, or more cells than layers.
    """
    p = task_params.model
    if not pipelining_layer.IsPipeline(p):
        return
    replicas = p.num_replicas
    if num_devices < replicas or num_devices % replicas:
        expected = ('at least 1 device' if replicas == 1 else
                    f'a positive multiple of R={replicas} (--worker_replicas): each replica '
                    'gets the same K devices, one per cell')
        raise errors.ConfigError(f'--num_devices={num_devices}: tune needs {expected}.')
    num_cells = num_devices // replicas
    num_layers, virtual = len(p.layer_tpl or []), p.virtual_stages
    if num_layers and num_cells * virtual > num_layers:
        per_device = ('one cell per device' if virtual == 1 else
                      f'{virtual} cells per device (--virtual_stages)')
        raise errors.ConfigError(
            f'--num_devices={num_devices}: {name} has {num_layers} layers to partition into '
            f'cells of at least one layer, {per_device}: tune for at most '
            f'{num_layers // virtual * replicas} devices.')
    p.num_cells = num_cells


def _HostBytes() -> int:
    return os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE')


def ChooseCosts(p, kind: str, slots_per_param: int, micro_batches: int) -> cost_model.Costs:
    """The layer costs for `kind` ('auto': measured where the model's un-partitioned step at
    its smallest micro-batch fits in half the host's memory, else FLOPs).

    Raises:
      errors.ConfigError: for 'measured' on a model too large to measure here.
    """
    if kind == 'flops':
        return cost_model.FlopsCosts(p)
    needed = memory_lib.PlanMemory(p, slots_per_param, num_cells=1,
                                   num_micro_batches=micro_batches,
                                   recompute='always').peak_device_bytes
    fits = needed <= _HOST_SHARE * _HostBytes()
    if kind == 'measured' and not fits:
        raise errors.ConfigError(
            f'--tune_costs=measured: {p.name} needs about {units.MiB(needed)} MiB un-partitioned, '
            f'more than half of this machine\'s {units.MiB(_HostBytes())} MiB; use '
            '--tune_costs=flops (or auto).')
    if not fits:
        return cost_model.FlopsCosts(p)
    return cost_model.MeasuredCosts(p, progress=lambda line: print(line, flush=True))


def _PlannedStepBytes(memory: memory_lib.MemoryPlan) -> int:
    """What a step after the first allocates at its peak, all devices in one memory: the plan's
    step_bytes less the optimizer's slots, which the first step created."""
    return memory.step_bytes - sum(c.slots for c in memory.cells)


def MeasurePick(task_params, candidate: tuner.Candidate, steps: int) -> tuple[float, int | None]:
    """Trains `candidate` for 1 + `steps` steps in a scratch logdir; (the median step after the
    first, in seconds; the peak bytes a step allocated above what was in use before it, on the
    first cell's device, or None where its allocator keeps no statistics or does not count its
    peak: `measured_costs.PeakBytesOf`)."""
    from gpipe_tf.train import program  # pylint: disable=g-import-not-at-top
    task = task_params.Copy()
    task.model = candidate.params.Copy()
    scratch = tempfile.mkdtemp(prefix='gpipe_tune_')
    try:
        prog = program.EagerProgram(task, scratch)
        prog.Restore()
        prog.Step()  # The trace, and the optimizer's slots.
        device = measured_costs.FirstDevice(candidate.params) or 'CPU:0'
        times = []

        def Steps():
            for _ in range(steps):
                started = time.perf_counter()
                prog.Step()
                times.append(time.perf_counter() - started)

        peak = measured_costs.PeakBytesOf(device, Steps)
        return statistics.median(times), peak
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def Run(task_params, name: str, logdir: str, device_memory_gib: float | None,
        costs: str = 'auto', steps: int = 5, top: int = 3,
        verbose: bool = False) -> tuner.Result:
    """Tunes task Params' pipeline for its K devices (`model.num_cells`, set up already) of
    `device_memory_gib` each; prints the table and writes `<logdir>/tuned_params.txt`.

    With measured costs and `steps` > 0, the pipeline is also run here: gpipe at each M searched
    first, to fit the layers' costs to the pipeline's own steps
    (`tuner.Calibrate`); then the `top` best-ranked configurations that fit, `steps` steps each,
    and the fastest measured is chosen (`tuner.MeasureBest`; `top` 1: the best-ranked is run
    and chosen). Measured steps are printed beside the predicted ones.

    Raises:
      errors.ConfigError: for a model that is not a pipeline, a missing or bad memory,
        `top` or `steps`, or no configuration that fits (naming the smallest memory that
        would).
    """
    p = task_params.model
    if not pipelining_layer.IsPipeline(p) or p.layer_tpl is None:
        raise errors.ConfigError(f'{name}: --mode=tune needs a PipeliningLayer model with '
                                 'layer_tpl (layers to partition).')
    if device_memory_gib is None or not device_memory_gib > 0:
        raise errors.ConfigError('--mode=tune needs --device_memory_gib=G > 0, the memory of '
                                 f'one device in GiB; got {device_memory_gib}.')
    if costs not in COSTS:
        raise errors.ConfigError(f'--tune_costs must be one of {COSTS}, got {costs!r}.')
    if top < 1:
        raise errors.ConfigError(f'--tune_top must be at least 1 (the configurations to run '
                                 f'and choose from), got {top}.')
    if steps < 0:
        raise errors.ConfigError(f'--tune_steps must be at least 0 (the steps to run each '
                                 f'configuration; 0: run none), got {steps}.')
    device_bytes = device_memory_gib * 2**30
    if p.costs_file is None:  # Measured costs, kept for the next run (and partition_method='time').
        p.costs_file = os.path.join(logdir, measured_costs.COSTS_FILE)
    slots = memory_lib.SlotsPerParam(task_params.train.optimizer)
    k = p.num_cells
    batch = fields.BatchSize(p) // p.num_replicas
    space = tuner.Space(len(p.layer_tpl), k, batch)
    layer_costs = ChooseCosts(p, costs, slots, max(c.num_micro_batches for c in space))
    print(f'tuning {name} for K={k} devices of {device_memory_gib:g} GiB, batch '
          f'{fields.BatchSize(p)}: {len(space)} configurations, layer costs '
          f'{layer_costs.description}', flush=True)
    started = time.perf_counter()
    runs = bool(steps and layer_costs.measured)
    peaks = {}  # Per configuration run, the peak bytes of its steps.

    def Measure(candidate):
        """The candidate's measured step, or None where its steps would take too long."""
        if candidate.step_s * steps > _MAX_RUN_S:
            print(f'not run: {steps} steps of {candidate.config} would take about '
                  f'{candidate.step_s * steps:.0f} s as predicted (more than {_MAX_RUN_S:g} s)',
                  flush=True)
            return None
        seconds, peaks[candidate.config, candidate.boundaries] = MeasurePick(
            task_params, candidate, steps)
        return seconds

    if runs:
        try:
            layer_costs = tuner.Calibrate(p, k, layer_costs, Measure, device_bytes, slots, space)
        except errors.UserError as error:  # The input's data are not here, say.
            print(f'not run: {error}', flush=True)
            runs = False
        else:
            print(f'layer costs {layer_costs.description}', flush=True)
    result = tuner.Tune(p, k, device_bytes, layer_costs, slots, space)
    print(result.Format(verbose=verbose), flush=True)
    print(f'tuned in {time.perf_counter() - started:.1f} s', flush=True)
    pick = result.best
    if pick is None:
        raise tuner.NoFitError(p, result)
    step_s, measured = None, []
    if runs:
        measured = tuner.MeasureBest(result, Measure, top,
                                     progress=lambda line: print(line, flush=True))
    if measured:
        pick, step_s = measured[0]
    path = os.path.join(logdir, TUNED_PARAMS)
    # The whole table, boundaries and per-device peaks too, as comments above the pick.
    table = ''.join(f'# {line}\n' for line in result.Format(None, verbose=True).splitlines())
    text = (f'# --mode=tune of {name}: {pick.config}, K={k}, devices of '
            f'{device_memory_gib:g} GiB\n' + table + OverrideText(task_params, pick))
    if logdir_lib.IsLocalPath(path):
        logdir_lib.WriteAtomically(path, text, 'the tuned Params')
    else:
        with logdir_lib.Writing(path, 'the tuned Params'):
            tf.io.gfile.makedirs(logdir)
            with tf.io.gfile.GFile(path, 'w') as f:
                f.write(text)
    how = (f'the fastest of the {len(measured)} best-ranked, measured'
           if measured else 'the best-ranked')
    print(f'chosen ({how}): {pick.config} with boundaries {list(pick.boundaries)}; wrote '
          f'{path} (train with --model_params_file_override={path})', flush=True)
    if step_s is not None:
        peak = peaks[pick.config, pick.boundaries]
        planned = _PlannedStepBytes(pick.memory)
        if peak is not None:
            memory = (f'; a step allocates {units.MiB(peak)} MiB at its peak (planned '
                      f'{units.MiB(planned)} MiB, all devices in one memory)')
        elif not measured_costs.CountsPeakBytes(measured_costs.FirstDevice(pick.params)):
            memory = ("; its memory is not measured: TensorFlow's default CPU allocator counts "
                      'only part of its peak (run with TF_CPU_ALLOCATOR_USE_BFC=true to measure '
                      'it)')
        else:
            memory = ''
        print(f'ran the pick for {steps} steps: step {step_s * 1e3:.1f} ms measured, '
              f'{pick.step_s * 1e3:.1f} ms predicted{memory}', flush=True)
    elif steps and not layer_costs.measured:
        print('not run: FLOPs costs predict no seconds of this machine', flush=True)
    return result
