"""The GPU partition report: each cell's planned memory against each GPU's free memory.

The plan (`perf.memory.PlanMemory`) says what each cell needs at its peak; `nvidia-smi` says what
each GPU has free now. `MemoryReport` puts them side by side, one row per cell, then one row per
GPU with the sum of the cells placed on it (several cells share a GPU when the stages are laid
out round-robin over fewer GPUs than cells, `pipeline.StageDevices`).

TensorFlow does not say how much memory a GPU has free before it allocates, and once it has
started it owns what it allocated; nvidia-smi reports the driver's view, with the other
processes on the GPU counted. So the free memory is read with nvidia-smi, before the run.

TensorFlow's '/device:GPU:i' is the i-th GPU CUDA makes visible: CUDA_VISIBLE_DEVICES picks and
orders them (`VisibleGpus`). Without CUDA_DEVICE_ORDER=PCI_BUS_ID, CUDA puts the fastest GPUs
first; nvidia-smi numbers them in PCI bus order. The two agree when the GPUs are all of one
model, the usual case; on a mixed machine the report says it assumed nvidia-smi's order.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
import subprocess
from typing import Mapping, Sequence

import tensorflow as tf

from gpipe_tf import units
from gpipe_tf.perf import memory as memory_lib
from gpipe_tf.perf import pictures
from gpipe_tf.pipeline import pipelining_layer
from gpipe_tf.pipeline import plan as plan_lib

QUERY_COLUMNS = ('index', 'uuid', 'name', 'memory.free', 'memory.total')
_MIB = 2**20


@dataclasses.dataclass(frozen=True)
class GpuMemory:
    """One GPU as nvidia-smi reports it.

    Attributes:
      index: nvidia-smi's index (PCI bus order), which CUDA_VISIBLE_DEVICES indices refer to.
      uuid: the GPU's UUID, 'GPU-' and 32 hex digits in dashed groups.
      name: the product name, e.g. 'NVIDIA H100 80GB HBM3'.
      free_bytes: memory free when queried (other processes' allocations are not free).
      total_bytes: the GPU's memory.
    """
    index: int
    uuid: str
    name: str
    free_bytes: int
    total_bytes: int


class GpuQueryError(RuntimeError):
    """nvidia-smi could not be run or read, or CUDA_VISIBLE_DEVICES names no GPU it listed."""


def QueryGpus(command: str = 'nvidia-smi', timeout_s: float = 30.0) -> list[GpuMemory]:
    """The GPUs of this machine and their free memory, in nvidia-smi's index order.

    Args:
      command: the nvidia-smi executable: a name looked up on PATH, or a path.
      timeout_s: how long nvidia-smi may run (it can hang on a wedged driver).

    Returns:
      One GpuMemory per line nvidia-smi prints.

    Raises:
      GpuQueryError: when the command is not found or cannot be run, exits non-zero, runs past
        `timeout_s`, or prints a line that is not the five expected columns.
    """
    args = [command, '--query-gpu=' + ','.join(QUERY_COLUMNS), '--format=csv,noheader,nounits']
    try:
        result = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s,
                                check=False)
    except FileNotFoundError as error:
        raise GpuQueryError(f'{command!r} was not found (is the NVIDIA driver installed and '
                            f'nvidia-smi on PATH?): {error}') from error
    except subprocess.TimeoutExpired as error:
        raise GpuQueryError(f'{command!r} did not finish within {timeout_s} s.') from error
    except OSError as error:
        raise GpuQueryError(f'{command!r} could not be run: {error}') from error
    if result.returncode != 0:
        # nvidia-smi prints some failures (no driver, no device) on stdout.
        said = _FirstLine(result.stderr) or _FirstLine(result.stdout) or 'no output'
        raise GpuQueryError(f'{command!r} exited with status {result.returncode}: {said}')
    return [_ParseLine(line, command) for line in result.stdout.splitlines() if line.strip()]


def _FirstLine(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), '')


def _ParseLine(line: str, command: str) -> GpuMemory:
    fields = [field.strip() for field in line.split(',')]
    expected = (f'expected {len(QUERY_COLUMNS)} comma-separated columns '
                f'{", ".join(QUERY_COLUMNS)}, with integer index and memory in MiB')
    if len(fields) < len(QUERY_COLUMNS):
        raise GpuQueryError(f'{command!r} printed {line!r}: {expected}.')
    # Only the name could hold a comma: the columns around it are fixed.
    index, uuid, free, total = fields[0], fields[1], fields[-2], fields[-1]
    name = ', '.join(fields[2:-2])
    try:
        return GpuMemory(index=int(index), uuid=uuid, name=name, free_bytes=int(free) * _MIB,
                         total_bytes=int(total) * _MIB)
    except ValueError as error:
        raise GpuQueryError(f'{command!r} printed {line!r}: {expected}.') from error


def VisibleGpus(gpus: Sequence[GpuMemory],
                cuda_visible_devices: str | None) -> list[GpuMemory]:
    """The GPUs TensorFlow sees, in its order: TF's GPU:i is entry i of the result.

    Args:
      gpus: all GPUs, as `QueryGpus` returns them.
      cuda_visible_devices: the CUDA_VISIBLE_DEVICES value; None (unset) shows every GPU in
        index order, '' none. Otherwise a comma-separated list of nvidia-smi indices, UUIDs or
        unique UUID prefixes that start with 'GPU-', as CUDA accepts them. As in CUDA, a
        negative index ends the list (CUDA_VISIBLE_DEVICES=-1 hides every GPU).

    Raises:
      GpuQueryError: for an entry that matches no GPU, matches several, or repeats one.
    """
    if cuda_visible_devices is None:
        return sorted(gpus, key=lambda gpu: gpu.index)
    visible = []
    for entry in (e.strip() for e in cuda_visible_devices.split(',')):
        if not entry:
            continue
        if re.fullmatch(r'-?\d+', entry):
            if int(entry) < 0:
                break
            matches = [gpu for gpu in gpus if gpu.index == int(entry)]
        elif entry.upper().startswith('GPU-'):
            matches = [gpu for gpu in gpus if gpu.uuid.lower() == entry.lower()] or [
                gpu for gpu in gpus if gpu.uuid.lower().startswith(entry.lower())]
        else:
            matches = []
        listed = ', '.join(f'{gpu.index} ({gpu.uuid})' for gpu in gpus) or 'none'
        if not matches:
            raise GpuQueryError(
                f'CUDA_VISIBLE_DEVICES={cuda_visible_devices!r}: entry {entry!r} matches no GPU; '
                f'expected an nvidia-smi index or a UUID (or a prefix of one starting with '
                f'"GPU-") of the GPUs listed: {listed}.')
        if len(matches) > 1:
            raise GpuQueryError(
                f'CUDA_VISIBLE_DEVICES={cuda_visible_devices!r}: entry {entry!r} is a prefix of '
                f'{len(matches)} GPUs\' UUIDs ({", ".join(gpu.uuid for gpu in matches)}); '
                'expected one.')
        if matches[0] in visible:
            raise GpuQueryError(
                f'CUDA_VISIBLE_DEVICES={cuda_visible_devices!r}: entry {entry!r} names GPU '
                f'{matches[0].index} again; expected each GPU at most once.')
        visible.append(matches[0])
    return visible


def GpuPosition(device: str) -> int:
    """The i of a TensorFlow GPU device string ('/device:GPU:i', possibly job-qualified).

    Raises:
      ValueError: for a string that is not a device, not a GPU, has no index, or is on a job
        other than this process's ('localhost'), whose GPUs nvidia-smi here does not see.
    """
    try:
        spec = tf.DeviceSpec.from_string(device)
    except ValueError as error:
        raise ValueError(f'{device!r} is not a TensorFlow device string: {error}') from error
    if spec.device_type != 'GPU' or spec.device_index is None:
        raise ValueError(f'{device!r} is not a GPU device; expected one like "/device:GPU:0".')
    if spec.job not in (None, 'localhost'):
        raise ValueError(f'{device!r} is on job {spec.job!r}; the free memory is this '
                         "machine's, so only local devices (no job, or 'localhost') can be "
                         'reported.')
    return spec.device_index


def _Positions(plan: memory_lib.MemoryPlan, stage_devices: Sequence[str],
               num_visible: int | None) -> list[int]:
    """Each cell's GPU position; `num_visible` None skips the range check."""
    if len(stage_devices) != plan.num_cells:
        raise ValueError(f'The plan has {plan.num_cells} cells but {len(stage_devices)} stage '
                         f'devices were given ({list(stage_devices)}); expected one per cell.')
    positions = [GpuPosition(device) for device in stage_devices]
    for device, position in zip(stage_devices, positions):
        if num_visible is not None and position >= num_visible:
            raise ValueError(f'{device!r} is GPU {position}, but only {num_visible} GPUs are '
                             f'visible (GPU 0 to {num_visible - 1}).')
    return positions


def _PlannedByGpu(plan, stage_devices, gpus) -> dict[int, list[int]]:
    """GPU position -> the cells on it, in position order."""
    cells = collections.defaultdict(list)
    for cell, position in enumerate(_Positions(plan, stage_devices, len(gpus))):
        cells[position].append(cell)
    return dict(sorted(cells.items()))


def Shortfalls(plan: memory_lib.MemoryPlan, stage_devices: Sequence[str],
               gpus: Sequence[GpuMemory]) -> dict[int, int]:
    """For each GPU whose cells' planned memory exceeds its free memory, the bytes it is short.

    Args:
      plan: a memory plan with one entry per cell.
      stage_devices: cell k's TensorFlow device string.
      gpus: the visible GPUs in TensorFlow's order (`VisibleGpus`).

    Returns:
      GPU position (TF's GPU:i) -> planned bytes less free bytes, for the GPUs that do not fit.

    Raises:
      ValueError: for a device that is not a local GPU or is beyond the visible GPUs, or a
        device count that is not the plan's cell count.
    """
    short = {}
    for position, cells in _PlannedByGpu(plan, stage_devices, gpus).items():
        missing = sum(plan.cells[c].total for c in cells) - gpus[position].free_bytes
        if missing > 0:
            short[position] = missing
    return short


def MemoryReport(plan: memory_lib.MemoryPlan, stage_devices: Sequence[str],
                 gpus: Sequence[GpuMemory]) -> str:
    """A table of each cell's planned peak memory on its GPU, then each GPU's sum against its
    free memory, in MiB.

    Args:
      plan: a memory plan with one entry per cell; a cell's planned memory is its peak
        (`CellMemory.total`).
      stage_devices: cell k's TensorFlow device string, e.g. '/device:GPU:1'.
      gpus: the visible GPUs in TensorFlow's order (`VisibleGpus`).

    Raises:
      ValueError: for a device that is not a local GPU or is beyond the visible GPUs, or a
        device count that is not the plan's cell count.
    """
    by_gpu = _PlannedByGpu(plan, stage_devices, gpus)
    position_of = {cell: position for position, cells in by_gpu.items() for cell in cells}
    cell_rows = [('cell', 'device', 'planned MiB', 'GPU', 'name', 'free MiB')]
    for cell, device in enumerate(stage_devices):
        gpu = gpus[position_of[cell]]
        cell_rows.append((str(cell), device, units.MiB(plan.cells[cell].total),
                          _GpuLabel(position_of[cell], gpu), gpu.name, units.MiB(gpu.free_bytes)))
    short = Shortfalls(plan, stage_devices, gpus)
    gpu_rows = [('GPU', 'name', 'cells', 'planned MiB', 'free MiB', 'verdict')]
    for position, cells in by_gpu.items():
        gpu = gpus[position]
        verdict = (f'DOES NOT FIT (short by {units.MiB(short[position])} MiB)' if position in short
                   else 'fits')
        gpu_rows.append((_GpuLabel(position, gpu), gpu.name, ','.join(map(str, cells)),
                         units.MiB(sum(plan.cells[c].total for c in cells)),
                         units.MiB(gpu.free_bytes), verdict))
    lines = ['Planned peak memory per cell against its GPU\'s free memory (nvidia-smi):']
    lines += _Table(cell_rows)
    lines += ['', 'Per GPU, the cells on it:']
    lines += _Table(gpu_rows)
    return '\n'.join(lines)


def Report(plan: memory_lib.MemoryPlan, stage_devices: Sequence[str],
           command: str = 'nvidia-smi', environ: Mapping[str, str] = os.environ) -> str:
    """`MemoryReport` of the GPUs `environ`'s CUDA_VISIBLE_DEVICES shows; if nvidia-smi cannot
    be read, a line saying why and the planned memory per cell. Informational: a failed query
    does not raise.

    Args:
      plan: a memory plan with one entry per cell.
      stage_devices: cell k's TensorFlow device string.
      command: the nvidia-smi executable (`QueryGpus`).
      environ: the environment TensorFlow runs in (for CUDA_VISIBLE_DEVICES).

    Raises:
      ValueError: for a device that is not a local GPU or is beyond the visible GPUs, or a
        device count that is not the plan's cell count.
    """
    _Positions(plan, stage_devices, None)  # Bad devices are an error with or without GPUs.
    try:
        every_gpu = QueryGpus(command)
        gpus = VisibleGpus(every_gpu, environ.get('CUDA_VISIBLE_DEVICES'))
    except GpuQueryError as error:
        rows = [('cell', 'device', 'planned MiB')] + [
            (str(cell), device, units.MiB(plan.cells[cell].total))
            for cell, device in enumerate(stage_devices)]
        return '\n'.join([f'free GPU memory unknown: {error}'] + _Table(rows))
    report = MemoryReport(plan, stage_devices, gpus)
    if (len({gpu.name for gpu in every_gpu}) > 1
            and environ.get('CUDA_DEVICE_ORDER') != 'PCI_BUS_ID'):
        report += ('\nGPUs of different models and CUDA_DEVICE_ORDER is not PCI_BUS_ID: CUDA may '
                   'number them fastest first, not in nvidia-smi\'s order, which this report '
                   'assumes.')
    return report


def PipelineReport(p, plan=None) -> str:
    """`Report` for task Params `p`'s pipeline (its `plan`, or one made here): each cell's
    planned memory against the free memory of the GPU it runs on; a line saying why when there
    is no report (no plan, R > 1 replicas, devices that are not this machine's GPUs)."""
    model = p.model
    if pipelining_layer.IsPipeline(model) and model.num_replicas > 1:
        # The plan is one pipeline's on the whole batch; replicas share GPUs round-robin.
        return (f'No GPU memory report: the memory plan covers one pipeline, not '
                f'{model.num_replicas} replicas.')
    try:
        if plan is None and pipelining_layer.IsPipeline(model):
            plan = plan_lib.MakePlan(model)
        memory = pictures.Plan(p, pipeline_plan=plan).memory  # Raises for a non-pipeline.
        report = Report(memory, plan.devices)
    except ValueError as error:  # Informational: never stops the run.
        return f'No GPU memory report: {error}'
    return (report + '\nPlanned memory leaves out what CUDA and TensorFlow themselves take on '
            'each GPU.')


def _GpuLabel(position: int, gpu: GpuMemory) -> str:
    """TF's GPU:i, with nvidia-smi's index when CUDA_VISIBLE_DEVICES makes them differ."""
    return f'GPU:{position}' + ('' if gpu.index == position else f' (nvidia-smi {gpu.index})')


def _Table(rows: list[tuple[str, ...]]) -> list[str]:
    """Columns two spaces apart, text left-aligned and numbers right-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    numeric = [all(_IsNumber(row[i]) for row in rows[1:]) for i in range(len(rows[0]))]
    return ['  '.join(value.rjust(width) if right else value.ljust(width)
                      for value, width, right in zip(row, widths, numeric)).rstrip()
            for row in rows]


def _IsNumber(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
