"""Helpers for gpipe_tf's tests: virtual devices, numeric comparisons, the trainer in this
process and the scalars it writes."""

from __future__ import annotations

import contextlib
import gc
import glob
import io
import json
import logging
import os
import re
import subprocess
import sys
import zipfile

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import config as tf_config

from gpipe_tf import hyperparams
from gpipe_tf.input import image as image_input
from gpipe_tf.layers import base_layer
from gpipe_tf.layers import basic
from gpipe_tf.layers import fprop_context
from gpipe_tf.layers import normalization
from gpipe_tf.params.image import amoebanet as amoebanet_params
from gpipe_tf.pipeline import devices
from gpipe_tf.pipeline import leaves
from gpipe_tf.pipeline import unpartitioned

# Tests split the CPU into this many logical devices, enough for K = 8 cells.
NUM_VIRTUAL_CPUS = 8


def ConfigureVirtualCpus(num_devices: int = NUM_VIRTUAL_CPUS) -> list[str]:
    """`devices.VirtualCpus` with the tests' default count."""
    return devices.VirtualCpus(num_devices)


def RunV1(build):
    """`build()`'s fetches, built in a tf.compat.v1 graph and run in a Session with as many CPU
    devices as this process has logical ones, after initializing the variables."""
    graph = tf.Graph()
    with graph.as_default():
        fetches = build()
        config = tf.compat.v1.ConfigProto(
            device_count={'CPU': len(tf.config.list_logical_devices('CPU'))})
        with tf.compat.v1.Session(graph=graph, config=config) as session:
            session.run(tf.compat.v1.global_variables_initializer())
            return session.run(fetches)


def MaxRelativeError(actual, expected) -> float:
    """max |actual - expected| / max |expected| over all tensors of two like-structured nests;
    infinite where either holds a NaN or an infinity the other does not (numpy's max would
    skip a NaN difference and call the two equal)."""
    worst = 0.0
    dense = lambda x: tf.convert_to_tensor(x) if isinstance(x, tf.IndexedSlices) else x
    for a, e in zip(tf.nest.flatten(actual), tf.nest.flatten(expected)):
        a, e = np.asarray(dense(a), np.float64), np.asarray(dense(e), np.float64)
        if a.shape != e.shape:
            raise ValueError(f'Shapes differ: {a.shape} vs {e.shape}.')
        finite = np.isfinite(e)
        if not np.array_equal(np.isfinite(a), finite) or not np.array_equal(
                a[~finite], e[~finite], equal_nan=True):
            return float('inf')
        scale = max(np.abs(e[finite]).max(initial=0.0), 1e-30)
        worst = max(worst, float(np.abs(a[finite] - e[finite]).max(initial=0.0) / scale))
    return worst


FloatLeaves = leaves.FloatLeaves


def PlantModule(test, directory: str, name: str, body: str = '') -> str:
    """Writes module `name` into `directory`, importable for the rest of `test`, that creates a
    marker file when imported (then runs `body`); returns the marker's path, which exists only
    if something imported the module."""
    marker = os.path.join(directory, 'imported')
    with open(os.path.join(directory, f'{name}.py'), 'w', encoding='utf-8') as f:
        f.write(f'open({marker!r}, "w").close()\n' + (f'\n{body}' if body else ''))
    sys.path.insert(0, directory)
    test.addCleanup(sys.path.remove, directory)
    return marker


def TamperKerasFile(test, path: str, tampered: str, old: str, new: str) -> None:
    """Writes `tampered`, the `.keras` file `path` with `old` (which its config.json must hold)
    replaced by `new` in its config.json, as an attacker would edit a file."""
    with zipfile.ZipFile(path) as source, zipfile.ZipFile(tampered, 'w') as target:
        for item in source.infolist():
            data = source.read(item.filename)
            if item.filename == 'config.json':
                text = data.decode()
                test.assertIn(old, text)
                data = text.replace(old, new).encode()
                json.loads(data)
            target.writestr(item, data)


def DamageFile(path: str, how: str) -> None:
    """Damages a file as accidents do: 'truncate' (to half its size), 'flip' (one byte in its
    middle) or 'garble' (replaced by text that does not parse)."""
    with open(path, 'rb') as f:
        data = f.read()
    if how == 'truncate':
        data = data[:len(data) // 2]
    elif how == 'flip':
        middle = len(data) // 2
        data = data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1:]
    elif how == 'garble':
        data = b'model_checkpoint_path: "ckpt-12\n{{{ \x00'
    else:
        raise ValueError(f'how must be truncate, flip or garble, got {how!r}.')
    with open(path, 'wb') as f:
        f.write(data)


def FileNames(directory: str) -> set:
    """The base names of every file under `directory`, subfolders included."""
    return {name for _, _, names in os.walk(directory) for name in names}


def StepBytes(layer, inputs, loss_fn=None) -> int:
    """What one tf.function step of loss and gradients of `layer` allocates at its peak on the
    CPU, over what was allocated before it (the variables, the inputs, anything earlier code
    left), after a warm-up step. Needs the BFC allocator (TF_CPU_ALLOCATOR_USE_BFC=true before
    TensorFlow starts); every virtual CPU device allocates from it."""
    variables = layer.trainable_variables
    loss_fn = loss_fn or (lambda y: tf.reduce_mean(tf.square(y)))

    @tf.function
    def Step(x):
        with tf.GradientTape() as tape:
            loss = loss_fn(layer(x))
        return tape.gradient(loss, variables)

    tf.nest.map_structure(lambda t: t.numpy(), Step(inputs))
    return PeakBytesOf(lambda: Step(inputs))


def MeasureInOwnProcess(script: str, flag: str, timeout: int = 600):
    """The JSON that `python script flag` prints last, run in a process of its own with the
    BFC allocator's statistics on (a fresh allocator: its counters are process-wide, and a
    worker's earlier tests leave slack in its chunks).

    Raises:
      RuntimeError: with the end of its stderr, if the process fails.
    """
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC='true', TF_CPP_MIN_LOG_LEVEL='2',
               PYTHONPATH=os.pathsep.join(sys.path))
    run = subprocess.run([sys.executable, script, flag], env=env, capture_output=True,
                         text=True, timeout=timeout, check=False)
    if run.returncode:
        raise RuntimeError(f'Measuring in {os.path.basename(script)} failed (exit '
                           f'{run.returncode}):\n{run.stderr[-3000:]}')
    return json.loads(run.stdout.strip().splitlines()[-1])


def PeakBytesOf(run, repeats: int = 3, attempts: int = 8) -> int:
    """What `run()` allocates at its peak on the CPU over what was allocated before it (BFC
    allocator statistics): earlier code of the process may leave memory behind, which an
    absolute peak would count.

    Other threads of the process share the allocator: an input pipeline or server an earlier
    test left running could allocate or free during `run()` and move the reading either way. A
    reading counts only when the allocator holds as much after `run()` (its result dropped) as
    before, so nothing else allocated or freed meanwhile; the median of `repeats` such readings
    also rejects a transient allocation that was freed before the end. Raises RuntimeError when
    fewer than `repeats` of `attempts` readings are clean.

    The allocator hands a request a whole free chunk unless the chunk is at least twice as
    large, so after much earlier work a peak may include such slack: measure in a fresh process
    where the figure must be exact (test_memory does).
    """
    readings = []
    for _ in range(attempts):
        peak, clean = _OnePeak(run)
        if clean:
            readings.append(peak)
            if len(readings) == repeats:
                return sorted(readings)[repeats // 2]
    raise RuntimeError(f'Only {len(readings)} of {attempts} memory readings were free of other '
                       f'allocations in the process; expected {repeats}.')


def _OnePeak(run) -> tuple:
    """(peak of `run()` over what was allocated before it, whether the allocator was back at
    its starting point once the result was dropped)."""
    # What earlier code left unreferenced is freed now, not during the step.
    gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    try:
        tf.config.experimental.reset_memory_stats('CPU:0')
        before = tf.config.experimental.get_memory_info('CPU:0')['current']
        result = run()
        peak = tf.config.experimental.get_memory_info('CPU:0')['peak']
        del result
        after = tf.config.experimental.get_memory_info('CPU:0')['current']
    finally:
        if collecting:
            gc.enable()
    return peak - before, after == before


def BatchNormStack(num_blocks: int, dim: int) -> list:
    """Layer Params of `num_blocks` blocks of dense (no bias), batch norm (decay 0.9), tanh.

    No bias before batch norm, and a nonlinearity after it: otherwise some gradients are exactly
    zero in theory and only rounding noise in practice.
    """
    layers = []
    for _ in range(num_blocks):
        layers += [basic.DenseLayer.Params().Set(input_dim=dim, output_dim=dim, has_bias=False),
                   normalization.BatchNormLayer.Params().Set(dim=dim, decay=0.9),
                   basic.ActivationLayer.Params().Set(activation='tanh')]
    return layers


class SmallAmoebaNet(amoebanet_params.AmoebaNetD_Small):
    """AmoebaNetD_Small's network with 8 filters, K = 2, M = 4, batch 16, on synthetic images."""
    NUM_FILTERS = 8
    BATCH_SIZE = 16
    NUM_CELLS = 2
    NUM_MICRO_BATCHES = 4

    def _Input(self):
        return image_input.SyntheticImageInput.Params().Set(
            batch_size=self.BATCH_SIZE, image_size=self.IMAGE_SIZE,
            num_channels=self.NUM_CHANNELS, num_classes=self.NUM_CLASSES,
            num_examples_total=64, seed=2, shuffle=False)


def SmallAmoebaNetParams() -> hyperparams.Params:
    """Task Params of AmoebaNet-D (3, 8) over K = 2 cells and M = 4 micro-batches of 4, with
    every layer whose inference differs from training: batch norm, drop-path and dropout (keep
    0.9). Its input is 64 synthetic 28 x 28 x 1 images in batches of 16, not shuffled."""
    small = SmallAmoebaNet()
    p = small.Task()
    p.input = small._Input()  # pylint: disable=protected-access
    return p


def ScrambleMovingStatistics(task, seed: int = 0) -> None:
    """Assigns every batch norm moving mean N(0, 0.5) and moving variance U(0.5, 2) values, so
    that normalising with them differs clearly from normalising with a batch's statistics."""
    rng = np.random.RandomState(seed)
    for v in task.variables:
        if 'moving_mean' in v.name:
            v.assign(rng.normal(0.0, 0.5, v.shape).astype(np.float32))
        elif 'moving_variance' in v.name:
            v.assign(rng.uniform(0.5, 2.0, v.shape).astype(np.float32))


def Ancestors(op) -> set:
    """Every op `op` waits for in its graph: through data and control inputs."""
    seen, stack = set(), [op]
    while stack:
        current = stack.pop()
        for parent in [t.op for t in current.inputs] + list(current.control_inputs):
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return seen


_CELL_SCOPE = re.compile(r'^cell_(\d+)_(?:mb_\d+_)?(fwd|bwd|grad_sum|stats|update|theta)(_\d+)?$')


def CellScope(name: str) -> tuple:
    """(cell index, part) of an op from its `cell_<k>_<part>` name scope, or (None, None)."""
    for part in name.split('/'):
        match = _CELL_SCOPE.match(part)
        if match:
            return int(match.group(1)), match.group(2)
    return None, None


def SquareLoss(outputs) -> tf.Tensor:
    """A scalar that depends on every float output: the sum of their squares."""
    return tf.add_n([tf.reduce_sum(tf.square(x)) for x in FloatLeaves(outputs)])


# The reference the pipeline's outputs and gradients equal; a product module, since
# `--mode=check` runs it too.
Unpartitioned = unpartitioned.Unpartitioned


def OutputsAndGrads(fn, layer, inputs, loss_fn=SquareLoss):
    """(fn(inputs), d loss / d [float leaves of inputs + layer.trainable_variables])."""
    float_inputs = FloatLeaves(inputs)
    with tf.GradientTape() as tape:
        tape.watch(float_inputs)
        outputs = fn(inputs)
        loss = loss_fn(outputs)
    return outputs, tape.gradient(loss, float_inputs + list(layer.trainable_variables))


def AssertGradientsMatchFiniteDifferences(test: tf.test.TestCase,
                                          layer: base_layer.BaseLayer, *inputs,
                                          delta: float = 1e-6,
                                          tolerance: float = 1e-6) -> list[np.ndarray]:
    """Asserts that `layer`'s gradients equal central finite differences, in float64.

    The function checked is a fixed random projection of every float output of
    `layer.FProp(theta, *inputs)` to a scalar (a plain sum would not do: the sum of a normalised
    output is constant), differentiated with respect to every trainable variable (as theta) and
    every float tensor of `inputs`: its gradient is J^T w for the layer's Jacobian J and random
    w, and every entry of it is compared with (f(x + delta) - f(x - delta)) / (2 delta), computed
    in one tf.function that loops over the coordinates (one eager FProp per evaluation would take
    seconds for a few hundred coordinates). Training updates (batch norm's moving statistics)
    are collected and dropped; dropout draws the masks of the current `fprop_context` step in
    every evaluation.

    A mismatch fails with the worst coordinates, and for each its one-sided derivatives from
    both sides (second order, steps delta and 2 delta): when those differ, the layer is not
    differentiable within 2 delta of the inputs (a relu input near 0, a max-pool tie) and other
    inputs are needed; when they agree, the analytic gradient is wrong.

    Args:
        test: the test case that asserts.
        layer: a layer built with dtype float64 (its variables and activations).
        *inputs: its FProp arguments; float tensors must be float64, others (ids, labels) are
            passed unchanged.
        delta: step of the central differences.
        tolerance: largest allowed max |analytic - numeric| / max |numeric|, the maximum taken
            over all sources together (a source whose exact gradient is zero, such as a bias
            before batch norm, has only rounding noise to scale by).

    Returns:
        The numeric gradients, arrays shaped like [trainable variables..., float inputs...].
    """
    variables = list(layer.trainable_variables)
    flat_inputs = tf.nest.flatten(inputs)
    float_positions = [i for i, x in enumerate(flat_inputs) if leaves.IsFloat(x)]
    sources = [v.read_value() for v in variables] + [flat_inputs[i] for i in float_positions]
    names = [v.name for v in variables] + [f'input leaf {i}' for i in float_positions]
    for name, x in zip(names, sources):
        test.assertEqual(x.dtype, tf.float64, f'{name} must be float64 for a finite-difference '
                         f'check, got {x.dtype.name}.')
    source_of = {v.ref(): k for k, v in enumerate(variables)}

    def FloatOutputs(values):
        theta = layer.vars.Transform(
            lambda v: values[source_of[v.ref()]] if v.ref() in source_of else
            v.read_value() if isinstance(v, tf.Variable) else v)
        flat = list(flat_inputs)
        for i, x in zip(float_positions, values[len(variables):]):
            flat[i] = x
        with fprop_context.Scope(update_collector=fprop_context.UpdateCollector()):
            return FloatLeaves(layer.FProp(theta, *tf.nest.pack_sequence_as(inputs, flat)))

    weights = [tf.random.stateless_normal(tf.shape(y), [k, 7], dtype=y.dtype)
               for k, y in enumerate(FloatOutputs(sources))]

    def Scalar(values):
        return tf.add_n([tf.reduce_sum(y * w) for y, w in zip(FloatOutputs(values), weights)])

    with tf.GradientTape() as tape:
        tape.watch(sources)
        scalar = Scalar(sources)
    analytic = np.concatenate([
        np.zeros(int(np.prod(x.shape))) if g is None else
        tf.reshape(tf.convert_to_tensor(g), [-1]).numpy()
        for x, g in zip(sources, tape.gradient(scalar, sources))])

    sizes = [int(np.prod(x.shape)) for x in sources]
    x0 = tf.concat([tf.reshape(x, [-1]) for x in sources], 0)

    def ScalarAt(flat):
        parts = tf.split(flat, sizes)
        return Scalar([tf.reshape(part, x.shape) for part, x in zip(parts, sources)])

    def Step(j, offset):
        return x0 + offset * tf.one_hot(j, x0.shape[0], dtype=x0.dtype)

    @tf.function(autograph=False)
    def CentralDifferences():
        return tf.map_fn(lambda j: (ScalarAt(Step(j, delta)) - ScalarAt(Step(j, -delta))) /
                         (2 * delta), tf.range(x0.shape[0]), fn_output_signature=x0.dtype)

    numeric = CentralDifferences().numpy()
    scale = float(np.abs(numeric).max(initial=0.0))
    test.assertGreater(scale, 0.0, 'Every numeric gradient is zero: the outputs do not depend '
                       'on the variables and inputs.')
    error = np.abs(analytic - numeric)
    if error.max() > tolerance * scale:
        owner = np.repeat(np.arange(len(sources)), sizes)
        starts = np.cumsum([0] + sizes)
        lines = []
        for j in np.argsort(-error)[:5]:
            if error[j] <= tolerance * scale:
                break
            f = {o: float(ScalarAt(Step(j, o * delta))) for o in (-2, -1, 1, 2)}
            right = (-3 * float(scalar) + 4 * f[1] - f[2]) / (2 * delta)
            left = (3 * float(scalar) - 4 * f[-1] + f[-2]) / (2 * delta)
            kink = abs(right - left) > tolerance * scale
            verdict = ('not differentiable here, choose other inputs' if kink else
                       'the analytic gradient is wrong')
            lines.append(f'{names[owner[j]]}[{j - starts[owner[j]]}] (flat): analytic '
                         f'{analytic[j]:.9g}, central {numeric[j]:.9g}, right {right:.9g}, '
                         f'left {left:.9g}: {verdict}')
        test.fail(f'Gradients differ from central differences by up to '
                  f'{error.max() / scale:.3g} of their scale {scale:.3g} (tolerance '
                  f'{tolerance:g}):\n' + '\n'.join(lines))
    return [part.reshape(x.shape) for part, x in zip(np.split(numeric, np.cumsum(sizes)[:-1]),
                                                     sources)]


def TrainerInProcess(*flags, check=True) -> subprocess.CompletedProcess:
    """Runs the trainer with `flags` in this process (`trainer.Main`), on the virtual CPUs the
    test configured: a CompletedProcess with its exit status and what it printed. Training,
    eval, decode, inspect modes and errors alike; seconds faster than a subprocess (no
    TensorFlow import).

    Its stderr is what the subprocess's would be, but for TensorFlow's C++ log lines: what it
    prints, and log records of level ERROR (WARNING with --verbose), as the trainer leaves
    them. Op determinism, which a built program turns on for the whole process, is put back as
    it was: the tests that run in this process after it (unseeded random ops, say) must not
    inherit it.

    Raises:
      AssertionError: with `check`, if the exit status is not 0.
    """
    from gpipe_tf import errors  # pylint: disable=g-import-not-at-top
    from gpipe_tf import trainer  # pylint: disable=g-import-not-at-top
    stdout, stderr = io.StringIO(), io.StringIO()
    handler = logging.StreamHandler(stderr)
    handler.setLevel(logging.WARNING if '--verbose' in flags else logging.ERROR)
    deterministic = tf_config.is_op_determinism_enabled()
    logging.getLogger().addHandler(handler)
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                status = trainer.Main(trainer.ParseConfig(list(flags)))
            except errors.UserError as error:  # A bad flag, as _ParseFlags reports it.
                print(f'error: {error}', file=sys.stderr)
                status = 2
    finally:
        logging.getLogger().removeHandler(handler)
        if not deterministic:
            tf_config.disable_op_determinism()
    result = subprocess.CompletedProcess(list(flags), status, stdout.getvalue(),
                                         stderr.getvalue())
    if check and status != 0:
        raise AssertionError(f'trainer failed ({status}):\n{result.stdout}\n{result.stderr}')
    return result


def EventScalars(directory: str, tag: str, files=None) -> dict[int, float]:
    """{step: value} of scalar `tag` in the event files under `directory` (or `files`); a
    later file's value of a step wins (a resumed run's)."""
    values = {}
    for path in files or sorted(glob.glob(os.path.join(directory, 'events.*'))):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                if value.tag == tag:
                    values[event.step] = float(tf.make_ndarray(value.tensor))
    return values


def KerasSgdStepInSequence(layers, x, y, learning_rate: float, num_micro_batches: int):
    """The oracle of one training step of Keras layers on the batch (x, y), from Keras's calls
    alone: the layers called in sequence on each micro-batch as a pipeline splits the batch
    (min(M, N) of them, as equal as can be, the first N mod M one larger: np.array_split),
    each from the same state (batch norm normalises with the micro-batch's statistics); Keras's
    mean squared error of each weighted by its examples; plain SGD.

    Returns:
      (the loss, the trainable weights after the step, the non-trainable ones: the
      examples-weighted mean over micro-batches of what each call assigns, as gpipe_tf.keras
      documents). The layers are left as they were.
    """
    import keras  # pylint: disable=g-import-not-at-top  # Only the Keras tests need it.
    weights = [w for layer in layers for w in layer.weights]
    state = [w.numpy() for w in weights]

    def Restore():
        for w, value in zip(weights, state):
            w.assign(value)

    trainable = [w for layer in layers for w in layer.trainable_weights]
    parts = min(num_micro_batches, len(x))
    loss, assigned = 0.0, []
    with tf.GradientTape() as tape:
        for part_x, part_y in zip(np.array_split(x, parts), np.array_split(y, parts)):
            Restore()
            outputs = tf.constant(part_x)
            for layer in layers:
                outputs = layer(outputs, training=True)
            weight = len(part_x) / len(x)
            loss += weight * keras.losses.MeanSquaredError()(part_y, outputs)
            assigned.append([weight * w.numpy() for layer in layers
                             for w in layer.non_trainable_weights])
    grads = tape.gradient(loss, trainable)
    after = [w.numpy() - learning_rate * g.numpy() for w, g in zip(trainable, grads)]
    Restore()
    return float(loss), after, [sum(values) for values in zip(*assigned)]
