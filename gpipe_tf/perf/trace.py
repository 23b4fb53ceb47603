"""Measured timelines: when each (cell, micro-batch) forward, recompute and backward really ran.

One training step is traced with TensorFlow's own tools: the profiler
(`tf.profiler.experimental`, for eager code and `tf.function`s) or a v1 Session's FULL_TRACE
`RunMetadata`. Every op the pipeline creates is under a `cell_<k>_mb_<m>_<part>` name scope
(`executor.OpScope`), and a re-materializing backward's recompute under a further `recompute`
scope, so an op's name says which box of the schedule it belongs to. In the looped executor
(`pipeline.looped`) an action's ops run once per micro-batch under one name,
`cell_<k>_<part>`: each run of a name is the next micro-batch (every schedule runs a stage's
actions of one kind in micro-batch order, and each device its actions in list order). The ops
of one box are merged into one interval on cell k's device (device k runs cell k, which the
placement tests check); a device's busy time is the union of its ops' run times, so two ops that
overlap on two threads count once.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import tempfile
from typing import Callable

import tensorflow as tf

from gpipe_tf.perf import simulator
from gpipe_tf.pipeline import cell as cell_lib

# `cell_<k>_mb_<m>_<part>` (uniquified `_<n>` when the pipeline is built twice in one graph),
# anywhere in an op's name (a v1 graph puts it under `gradients/...`).
_OP_SCOPE = re.compile(
    r'(?:^|/)cell_(\d+)_mb_(\d+)_(fwd|bwd|bwd_input|bwd_weight|grad_sum)(?:_\d+)?/(.*)$')
# The looped executor's `cell_<k>_<part>`, in its while loop's body.
_LOOPED_SCOPE = re.compile(r'(?:^|/)cell_(\d+)_(fwd|bwd|bwd_input|bwd_weight)/(.*)$')
# With R > 1 replicas, each replica's ops are under `replica_<r>/`.
_REPLICA = re.compile(r'(?:^|/)replica_(\d+)/')
# The runtime's send/receive halves (`.../_17`): transfers, not a device's computation.
_TRANSFER = re.compile(r'/_\d+$')
# Ops shorter than this fraction of their box's longest op do not stretch the box.
_SUBSTANTIAL = 0.1
# Prefix of the temporary directories TraceFunction profiles into.
TEMP_PREFIX = 'gpipe_trace_'


@dataclasses.dataclass(frozen=True)
class OpEvent:
    """One op's execution: `name` (the graph node's name), start and end in seconds."""
    name: str
    start: float
    end: float


def ClassifyOp(name: str) -> tuple[int, int | None, str] | None:
    """(cell, micro-batch, kind) of a pipeline op from its name, kind in `simulator.KINDS` or
    `simulator.SPLIT_KINDS`; None for ops outside the schedule (the update, transfers). A split
    backward's W runs no forward: it is all 'weight_grad'. The micro-batch is
    None for the looped executor's ops (the same name for every micro-batch)."""
    if _TRANSFER.search(name):
        return None
    match = _OP_SCOPE.search(name)
    if match:
        cell, micro_batch, part, rest = match.groups()
        micro_batch = int(micro_batch)
    else:
        match = _LOOPED_SCOPE.search(name)
        if not match:
            return None
        (cell, part, rest), micro_batch = match.groups(), None
    if part == 'fwd':
        kind = 'forward'
    elif part == 'bwd_weight':
        kind = 'weight_grad'
    elif (part in ('bwd', 'bwd_input') and
          re.search(rf'(^|/){cell_lib.RECOMPUTE_SCOPE}/', rest)
          and not re.search(r'(^|/)gradients/', rest)):
        # Gradient ops are named after the forward ops they differentiate, so the recompute
        # scope reappears under `gradients/`.
        kind = 'recompute'
    else:
        kind = 'backward' if part != 'bwd_input' else 'input_grad'
    return int(cell), micro_batch, kind


def EventsFromRunMetadata(run_metadata) -> list[OpEvent]:
    """The op events of a v1 `Session.run` traced with `RunOptions.FULL_TRACE`."""
    events = []
    for device in run_metadata.step_stats.dev_stats:
        for node in device.node_stats:
            start = node.all_start_micros * 1e-6
            events.append(OpEvent(node.node_name, start, start + node.all_end_rel_micros * 1e-6))
    return events


def EventsFromProfile(logdir: str) -> list[OpEvent]:
    """The op events of the newest profile (`*.xplane.pb`) under `logdir`.

    Raises:
      FileNotFoundError: if `logdir` holds no profile.
    """
    from tensorflow.tsl.profiler.protobuf import xplane_pb2  # pylint: disable=g-import-not-at-top
    paths = glob.glob(os.path.join(logdir, '**', '*.xplane.pb'), recursive=True)
    if not paths:
        raise FileNotFoundError(f'No profile (*.xplane.pb) under {logdir}.')
    space = xplane_pb2.XSpace()
    with open(max(paths, key=os.path.getmtime), 'rb') as f:
        space.ParseFromString(f.read())
    events = []
    for plane in space.planes:
        for line in plane.lines:
            for event in line.events:
                # TF op events are named '<node name>:<op type>'.
                name = plane.event_metadata[event.metadata_id].name
                if ':' not in name:
                    continue
                start = (line.timestamp_ns * 1000 + event.offset_ps) * 1e-12
                events.append(OpEvent(name.split(':')[0], start, start + event.duration_ps * 1e-12))
    return events


def TraceFunction(fn, *args, logdir: str | None = None) -> list[OpEvent]:
    """Runs `fn(*args)` once under TensorFlow's profiler and returns its op events.

    Run `fn` once beforehand: a first call would also trace and optimize the function.

    Args:
      fn: the function to trace, called as `fn(*args)`.
      logdir: where the profile is written and kept; default: a temporary directory, removed
        before returning (also when `fn` raises).
    """
    if not logdir:
        with tempfile.TemporaryDirectory(prefix=TEMP_PREFIX) as temp_dir:
            return TraceFunction(fn, *args, logdir=temp_dir)
    tf.profiler.experimental.start(logdir)
    try:
        tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, 'numpy') else t, fn(*args))
    finally:
        tf.profiler.experimental.stop()
    return EventsFromProfile(logdir)


def TraceSessionRun(session, fetches, feed_dict=None) -> tuple[object, list[OpEvent]]:
    """(results, op events) of one `session.run(fetches)` with a full trace."""
    metadata = tf.compat.v1.RunMetadata()
    results = session.run(
        fetches, feed_dict=feed_dict, run_metadata=metadata,
        options=tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE))
    return results, EventsFromRunMetadata(metadata)


def _UnionLength(spans: list[tuple[float, float]]) -> float:
    total, reach = 0.0, float('-inf')
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def ReplicaOf(name: str) -> int:
    """The replica an op belongs to (0 without a `replica_<r>` scope)."""
    match = _REPLICA.search(name)
    return int(match.group(1)) if match else 0


def MeasuredTimeline(events: list[OpEvent], num_cells: int, replica: int = 0,
                     num_devices: int | None = None,
                     device_of: Callable[[int], int] | None = None) -> simulator.Timeline:
    """The schedule's boxes of one replica's pipeline from a step's op events, times relative
    to the step's first op; cell c on device `device_of(c)` (default: c % num_devices; one cell
    per device without num_devices; a schedule's `DeviceOf`).

    The makespan runs from the first to the last op of the step (the loss and the update
    included); a device's busy time is the union of its pipeline ops.

    Raises:
      ValueError: if no op of the pipeline is among the events, or one names a cell >= K.
    """
    num_devices = num_devices or num_cells
    device_of = device_of or (lambda cell: cell % num_devices)
    ops, spans = {}, [[] for _ in range(num_devices)]
    runs = {}  # A looped op's name -> how many of its runs came before.
    for event in sorted(events, key=lambda e: e.start):
        label = ClassifyOp(event.name)
        if label is None or ReplicaOf(event.name) != replica:
            continue
        if label[1] is None:  # Its n-th run is micro-batch n's.
            label = (label[0], runs.get(event.name, 0), label[2])
            runs[event.name] = label[1] + 1
        cell = label[0]
        if cell >= num_cells:
            raise ValueError(f'Op {event.name} belongs to cell {cell}, but the pipeline has '
                             f'{num_cells} cells.')
        ops.setdefault(label, []).append(event)
        spans[device_of(cell)].append((event.start, event.end))
    if not ops:
        raise ValueError(f'None of the {len(events)} traced ops is a pipeline op (named under '
                         'cell_<k>_mb_<m>_<part> or cell_<k>_<part>): was the right step '
                         'traced?')
    # A micro-batch's gradient sum (`grad_sum`, read as 'backward') follows the action that
    # computed the gradient: under a split backward that is its W, whose box it joins.
    for cell, m, kind in list(ops):
        if kind == 'backward' and (cell, m, 'weight_grad') in ops:
            ops[cell, m, 'weight_grad'] += ops.pop((cell, m, kind))
    origin = min(e.start for e in events)
    intervals = []
    for (cell, m, kind), box_ops in ops.items():
        # A box spans its substantial ops: its constants and shape ops have no inputs to wait
        # for and run whenever a thread is free, often at the step's very start.
        longest = max(e.end - e.start for e in box_ops)
        box_ops = [e for e in box_ops if e.end - e.start >= _SUBSTANTIAL * longest]
        intervals.append(simulator.Interval(device_of(cell), cell, m, kind,
                                            min(e.start for e in box_ops) - origin,
                                            max(e.end for e in box_ops) - origin))
    intervals.sort(key=lambda i: (i.start, i.device))
    return simulator.Timeline(intervals=intervals,
                              makespan=max(e.end for e in events) - origin,
                              busy=[_UnionLength(s) for s in spans])
