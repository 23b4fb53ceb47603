"""Each layer's cost measured on one micro-batch, on the device it would run on.

FLOPs (`FPropMeta`) say nothing of memory-bound layers (normalisation, softmax, embedding
gathers): a FLOPs-balanced pipeline can still be time-unbalanced. torchgpipe's
`balance_by_time` times each layer instead; so does this module, and more finely, as the
schedules need it: per layer the training forward, the backward (input and weight gradients
together), the input gradient alone (zero-bubble's I; W is the rest), the bytes of its output
(a cell boundary's activation) and the bytes its forward and backward take above what was in
use (on devices whose allocator reports them).

Each quantity is the median of `repeats` timed calls of a `tf.function` after two warm-up
calls, within a time limit per layer: F (the forward), FB (forward and every gradient) and FI
(forward and the input gradient); backward = FB - F, input gradient = FI - F. A call that only
passes the inputs on is timed too: a call's own cost (dispatching it, waiting for its outputs),
which F includes and the differences do not; in the pipeline a cell's layers run in one call
per action, and the tuner charges it so (`cost_model.MeasuredCosts`). Inputs are
synthesized from shapes and dtypes (uniform floats, zero integers: valid ids and labels), and
each layer takes its predecessor's output, as in the pipeline.

Costs are cached by (the layer's Params less its name, its input shapes and dtypes, the device
kind and intra-op threads): in process, and in a JSON file when one is given, so a second run
does not measure again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import statistics
import time
from typing import Callable, Sequence

from absl import logging
import tensorflow as tf

from gpipe_tf import errors
from gpipe_tf.layers import base_layer
from gpipe_tf.layers import fprop_context
from gpipe_tf.pipeline import devices as devices_lib
from gpipe_tf.pipeline import fields
from gpipe_tf.pipeline import leaves
from gpipe_tf.pipeline import plan as plan_lib

# The file in a logdir that keeps its measured costs (`partition_method='time'`, `--mode=tune`).
COSTS_FILE = 'layer_costs.json'

# Bump when what is measured changes: older cache entries are then measured again.
_VERSION = 2


@dataclasses.dataclass(frozen=True)
class LayerCost:
    """One layer's measured cost on one micro-batch (seconds and bytes)."""
    forward_s: float
    backward_s: float
    input_grad_s: float
    output_bytes: int
    working_bytes: int
    # The time of a call that only passes the layer's inputs on: what a call costs of itself,
    # included in forward_s (in the pipeline a call runs a cell's layers, once per action).
    call_s: float = 0.0

    @property
    def weight_grad_s(self) -> float:
        """W: the backward less its input gradient."""
        return max(self.backward_s - self.input_grad_s, 0.0)

    def StepSeconds(self, recompute: bool) -> float:
        """Its share of a training step: forward, a re-materialized forward, and backward."""
        return self.forward_s * (2 if recompute else 1) + self.backward_s


# Process-wide cache: key -> LayerCost.
_CACHE: dict[str, LayerCost] = {}


def SynthesizedInputs(shapes, dtypes=None):
    """A tensor per leaf of `shapes` (a shape: a TensorShape or a list of ints; or a NestedMap or
    list of shapes): uniform [0, 1) floats, zero integers (valid ids and labels).

    Args:
      shapes: the inputs' shapes.
      dtypes: None (float32), one dtype for every leaf, a dict of dtypes by key for a NestedMap
        (missing keys: float32), or a list of these, one per entry of a list of shapes.
    """
    counter = iter(range(1 << 30))

    def Make(shape, dtype):
        dtype = tf.as_dtype(dtype or tf.float32)
        shape = tf.TensorShape(shape)
        if dtype.is_floating:
            return tf.random.stateless_uniform(shape, [next(counter), 0], dtype=dtype)
        return tf.zeros(shape, dtype)

    def Synthesize(shapes, dtypes):
        if isinstance(shapes, dict):
            return type(shapes)({key: Make(shape, dtypes.get(key) if isinstance(dtypes, dict)
                                           else dtypes) for key, shape in shapes.items()})
        if isinstance(shapes, (list, tuple)) and not all(
                isinstance(d, int) or d is None for d in shapes):  # A list of shapes.
            per = dtypes if isinstance(dtypes, (list, tuple)) else [dtypes] * len(shapes)
            return type(shapes)(Synthesize(s, d) for s, d in zip(shapes, per))
        return Make(shapes, dtypes)

    return Synthesize(shapes, dtypes)


def FirstDevice(p) -> str:
    """The device of PipeliningLayer Params `p`'s first cell, where its layers are measured."""
    return devices_lib.MeshDevices(p.devices, p.num_replicas, p.num_cells)[0][0]


def PipelineInputs(p, batch_size: int | None = None) -> list:
    """`SynthesizedInputs` for PipeliningLayer Params `p`: one tensor (or nest) per input of
    `p.input_shapes` and `p.input_dtypes`, with `batch_size` examples (None: the Params')."""
    shapes = fields.InputShapes(p)
    if batch_size is not None:
        shapes = [_WithBatch(s, p.batch_dim, batch_size) for s in shapes]
    dtypes = p.input_dtypes
    return SynthesizedInputs(shapes, dtypes if isinstance(dtypes, (list, tuple)) else
                             [dtypes] * len(shapes))


def PipelineLayerCosts(p, micro_batch_size: int | None = None, progress: Callable | None = None
                       ) -> tuple[list[LayerCost], list[LayerCost]]:
    """The measured costs of PipeliningLayer Params `p`'s before_tpl layers and body layers
    (named as the plan names them), on one micro-batch of `p.input_shapes` and
    `p.input_dtypes` (of `micro_batch_size` examples; None: the Params' own micro-batch), on
    the first cell's device, cached in `p.costs_file`."""
    before, layers = fields.BeforeLayers(p), fields.BodyLayers(p)
    if micro_batch_size is None:
        batch_size = fields.BatchSize(p)
        micro_batch_size = -(-batch_size // p.num_replicas //
                             plan_lib.NumMicroBatches(p, batch_size))
    inputs = PipelineInputs(p, micro_batch_size)
    costs = MeasureLayers(list(before) + list(layers), inputs, FirstDevice(p),
                          cache_file=p.costs_file, progress=progress)
    return costs[:len(before)], costs[len(before):]


def StepSeconds(p, progress: Callable | None = logging.info) -> list[float]:
    """Each body layer's measured share of a training step (`LayerCost.StepSeconds`), for
    PipeliningLayer Params `p` (`PipelineLayerCosts` on its micro-batch): the costs
    `plan.MakePlan(layer_costs=...)` partitions on for partition_method='time'."""
    _, costs = PipelineLayerCosts(p, progress=progress)
    recompute = plan_lib.AnyRematerialized(p)
    return [c.StepSeconds(recompute) for c in costs]


def TimedBoundaries(p, progress: Callable | None = logging.info) -> list[int]:
    """The boundaries [0, b_1, ..., L] that partition_method='time' gives PipeliningLayer
    Params `p`: its layers measured on its first device (`StepSeconds`), the optimal min-max
    partition of those costs. Set them as `p.partition_method` before building the layer.

    Raises:
      errors.ConfigError: as `plan.MakePlan`.
    """
    return plan_lib.MakePlan(p, place=False, layer_costs=StepSeconds(p, progress)).boundaries


def _WithBatch(shapes, batch_dim: int, batch_size: int):
    if isinstance(shapes, dict):
        return type(shapes)({k: _WithBatch(v, batch_dim, batch_size) for k, v in shapes.items()})
    shape = tf.TensorShape(shapes).as_list()
    shape[batch_dim] = batch_size
    return tf.TensorShape(shape)


def _DeviceParts(device: str | None) -> tuple[str, str, int]:
    """(the device's type, its name, the intra-op threads: 0 for all)."""
    spec = tf.DeviceSpec.from_string(device or '')
    kind = spec.device_type or 'CPU'
    physical = tf.config.list_physical_devices(kind)
    name = ''
    if physical:
        name = tf.config.experimental.get_device_details(physical[0]).get('device_name', '')
    return kind, name, tf.config.threading.get_intra_op_parallelism_threads()


def DeviceKind(device: str | None) -> str:
    """What a measurement depends on of the device: its type and name, and the intra-op threads
    (two virtual CPUs of one thread each differ from one CPU of all cores)."""
    kind, name, threads = _DeviceParts(device)
    return f'{kind}:{name}:threads={threads}'


def DescribeDevice(device: str | None) -> str:
    """`DeviceKind` in words, e.g. 'CPU (intra-op threads: 1)'."""
    kind, name, threads = _DeviceParts(device)
    return (f'{kind}{" " + name if name else ""} (intra-op threads: '
            f'{"all" if threads == 0 else threads})')


def MeasureLayers(layer_params: Sequence, inputs, device: str | None = None,
                  repeats: int = 5, time_limit_s: float = 5.0, cache_file: str | None = None,
                  key_of: Callable | None = None, progress: Callable | None = None
                  ) -> list[LayerCost]:
    """Each layer's cost on `inputs` (the first layer's arguments: a tuple of nests of
    tensors, one micro-batch), the layers chained as in the pipeline.

    Args:
      layer_params: the layers' Params, in order. Each is instantiated afresh for measuring
        (its own variables, initialised from its Params), under `device`.
      inputs: the first layer's arguments (`SynthesizedInputs` of the micro-batch's shapes).
      device: where to run them (the device the layers will run on; None: the default).
      repeats: timed calls per quantity (the median is taken).
      time_limit_s: stop repeating a layer's measurement after this many seconds.
      cache_file: None, or a JSON file of costs measured before; new ones are added to it.
      key_of: `key_of(layer_params)` -> a string that identifies the layer's computation
        (default: its Params text less its name).
      progress: None, or called with one line per layer measured.

    Returns:
      One LayerCost per layer.
    """
    key_of = key_of or ParamsKey
    stored = _Load(cache_file)
    kind = DeviceKind(device)
    costs, args, changed = [], tuple(inputs), False
    for index, lp in enumerate(layer_params):
        key = _Key(key_of(lp), args, kind)
        with tf.device(device):
            layer = lp.Copy().Set(name=f'measured_{index}').Instantiate()
            outputs = _Forward(layer, args)
        cost = _CACHE.get(key) or stored.get(key)
        if cost is None:
            started = time.perf_counter()
            cost = _Measure(layer, args, device, repeats, time_limit_s, outputs)
            changed = True
            if progress:
                progress(f'measured layer {index} ({lp.name or lp.cls.__name__}): forward '
                         f'{cost.forward_s * 1e3:.2f} ms, backward {cost.backward_s * 1e3:.2f} '
                         f'ms ({time.perf_counter() - started:.1f} s)')
        _CACHE[key] = stored[key] = cost
        costs.append(cost)
        args = base_layer.AsArgs(outputs)
    if cache_file and changed:
        _Store(cache_file, stored)
    return costs


def ParamsKey(lp) -> str:
    """The layer's Params text without its name: two layers of one configuration cost alike."""
    return lp.Copy().Set(name='').ToText()


def _Key(layer_key: str, args, kind: str) -> str:
    specs = [f'{tuple(x.shape)}:{x.dtype.name}' for x in tf.nest.flatten(args)]
    text = json.dumps([_VERSION, layer_key, specs, kind])
    return hashlib.sha256(text.encode()).hexdigest()


def _Forward(layer, args, theta=None):
    with fprop_context.Scope(training=True, update_collector=fprop_context.UpdateCollector()):
        return layer.FProp(layer.theta if theta is None else theta, *args)


def _Measure(layer, args, device, repeats, time_limit_s, outputs) -> LayerCost:
    trainable = [v for v in layer.trainable_variables]
    float_args = leaves.FloatLeaves(args)

    def Gradients(with_weights: bool):
        def Run(args):
            with tf.GradientTape() as tape:
                tape.watch(leaves.FloatLeaves(args))
                ys = leaves.FloatLeaves(_Forward(layer, args))
            sources = leaves.FloatLeaves(args) + (trainable if with_weights else [])
            if not sources:
                return ys
            return tape.gradient(ys, sources, output_gradients=[tf.ones_like(y) for y in ys],
                                 unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return tf.function(Run, autograph=False)

    forward = tf.function(lambda args: _Forward(layer, args), autograph=False)
    # A call's own cost (dispatching it from Python, waiting for its outputs), timed on a call
    # that only passes its inputs on. B and I are differences of two calls, where it cancels.
    passing = tf.function(lambda args: [tf.identity(x) for x in tf.nest.flatten(args)],
                          autograph=False)
    deadline = time.perf_counter() + time_limit_s
    with tf.device(device):
        call_s = _Median(passing, args, repeats, deadline)
        forward_s = _Median(forward, args, repeats, deadline)
        working = _WorkingBytes(device, Gradients(True), args)
        both_s = _Median(Gradients(True), args, repeats, deadline)
        input_s = (_Median(Gradients(False), args, repeats, deadline) if float_args
                   else forward_s)
    return LayerCost(
        forward_s=forward_s, backward_s=max(both_s - forward_s, 0.0),
        input_grad_s=max(input_s - forward_s, 0.0),
        output_bytes=sum(x.shape.num_elements() * x.dtype.size
                         for x in tf.nest.flatten(outputs)),
        working_bytes=working, call_s=call_s)


def _Median(fn, args, repeats: int, deadline: float) -> float:
    for _ in range(2):  # Warm up: the trace, and the first run's allocations.
        _Sync(fn(args))
    times = []
    while len(times) < max(repeats, 1):
        started = time.perf_counter()
        _Sync(fn(args))
        times.append(time.perf_counter() - started)
        if time.perf_counter() > deadline:
            break
    return statistics.median(times)


def _Sync(result) -> None:
    """Waits for the values (a GPU runs asynchronously)."""
    for x in tf.nest.flatten(result):
        if isinstance(x, tf.Tensor):
            x.numpy()


def CountsPeakBytes(device: str | None, environ=None) -> bool:
    """Whether TensorFlow's statistics of `device`'s allocator (`get_memory_info`) count its
    peak: an accelerator's do, a CPU's only with the BFC allocator (TF_CPU_ALLOCATOR_USE_BFC=true
    before TensorFlow starts; read from `environ`, default the process's). The default CPU
    allocator's peak counts only part: a zero_bubble step of AmoebaNetD_Small read 40.3 MiB
    with it, 64.8 MiB with BFC (75.1 planned)."""
    kind = tf.DeviceSpec.from_string(device or 'CPU:0').device_type or 'CPU'
    if kind.upper() != 'CPU':
        return True
    environ = os.environ if environ is None else environ
    return environ.get('TF_CPU_ALLOCATOR_USE_BFC', '').strip().lower() in ('true', '1')


def PeakBytesOf(device: str, run: Callable[[], None]) -> int | None:
    """Calls `run()`; the peak bytes allocated on `device` while it ran, above those in use
    when it started, or None where the device's allocator keeps no statistics or does not
    count its peak (`CountsPeakBytes`)."""
    before = None
    if CountsPeakBytes(device):
        try:
            tf.config.experimental.reset_memory_stats(device)
            before = tf.config.experimental.get_memory_info(device)['current']
        except (ValueError, tf.errors.OpError):
            pass
    run()
    if before is None:
        return None
    return max(tf.config.experimental.get_memory_info(device)['peak'] - before, 0)


def _WorkingBytes(device, fn, args) -> int:
    """Peak bytes above what was in use during one forward and backward (after one to warm
    up); 0 where `PeakBytesOf` has none."""
    name = device or 'CPU:0'
    if not CountsPeakBytes(name):
        return 0
    try:
        _Sync(fn(args))
        return PeakBytesOf(name, lambda: _Sync(fn(args))) or 0
    except (ValueError, tf.errors.OpError):
        return 0


def _Load(cache_file: str | None) -> dict[str, LayerCost]:
    if not cache_file or not tf.io.gfile.exists(cache_file):
        return {}
    try:
        with tf.io.gfile.GFile(cache_file) as f:
            entries = json.load(f)
        if not isinstance(entries, dict):
            raise ValueError(f'expected an object of layers, got {type(entries).__name__}')
        costs = {key: LayerCost(**value) for key, value in entries.items()}
        for key, cost in costs.items():
            for name, value in dataclasses.asdict(cost).items():
                if (isinstance(value, bool) or not isinstance(value, (int, float)) or
                        not math.isfinite(value) or value < 0):
                    raise ValueError(f'{key}: {name} is {value!r}, not a number >= 0')
        return costs
    except (ValueError, TypeError, AttributeError, tf.errors.OpError) as error:
        # The file is a cache: what it says wrong is measured again, and the file rewritten.
        errors.Warn(f'measuring the layers again: the costs file {cache_file} does not read '
                    f'({error}).')
        return {}


def _Store(cache_file: str, costs: dict[str, LayerCost]) -> None:
    """Writes the file whole, through a temporary file: a reader never sees half of it. A file
    that cannot be written is a warning: it only spares the next run the measuring."""
    directory = os.path.dirname(cache_file)
    temporary = f'{cache_file}.tmp'
    try:
        if directory:
            tf.io.gfile.makedirs(directory)
        with tf.io.gfile.GFile(temporary, 'w') as f:
            json.dump({key: dataclasses.asdict(c) for key, c in sorted(costs.items())}, f,
                      indent=1)
        tf.io.gfile.rename(temporary, cache_file, overwrite=True)
    except (OSError, tf.errors.OpError) as error:
        errors.Warn(f'could not write the costs file {cache_file} '
                    f'({errors.Reason(error)}); the next run measures again.')
