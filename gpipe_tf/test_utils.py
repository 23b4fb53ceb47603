"""Helpers for gpipe_tf's tests: virtual devices and numeric comparisons."""

from __future__ import annotations

import os

import numpy as np
import tensorflow as tf

from gpipe_tf.layers import base_layer
from gpipe_tf.layers import basic
from gpipe_tf.layers import fprop_context
from gpipe_tf.layers import normalization
from gpipe_tf.pipeline import devices
from gpipe_tf.pipeline import recompute

# Tests split the CPU into this many logical devices, enough for K = 8 cells.
NUM_VIRTUAL_CPUS = 8


def ConfigureVirtualCpus(num_devices: int = NUM_VIRTUAL_CPUS) -> list[str]:
    """`devices.VirtualCpus` with the tests' default count."""
    return devices.VirtualCpus(num_devices)


def MaxRelativeError(actual, expected) -> float:
    """max |actual - expected| / max |expected| over all tensors of two like-structured nests."""
    worst = 0.0
    dense = lambda x: tf.convert_to_tensor(x) if isinstance(x, tf.IndexedSlices) else x
    for a, e in zip(tf.nest.flatten(actual), tf.nest.flatten(expected)):
        a, e = np.asarray(dense(a), np.float64), np.asarray(dense(e), np.float64)
        if a.shape != e.shape:
            raise ValueError(f'Shapes differ: {a.shape} vs {e.shape}.')
        scale = max(np.abs(e).max(initial=0.0), 1e-30)
        worst = max(worst, float(np.abs(a - e).max(initial=0.0) / scale))
    return worst


FloatLeaves = recompute.FloatLeaves


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


def PeakBytesOf(run) -> int:
    """What `run()` allocates at its peak on the CPU over what was allocated before it (BFC
    allocator statistics): earlier code of the process may leave memory behind, which an
    absolute peak would count."""
    tf.config.experimental.reset_memory_stats('CPU:0')
    before = tf.config.experimental.get_memory_info('CPU:0')['current']
    result = run()
    peak = tf.config.experimental.get_memory_info('CPU:0')['peak']
    del result
    return peak - before


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


def SquareLoss(outputs) -> tf.Tensor:
    """A scalar that depends on every float output: the sum of their squares."""
    return tf.add_n([tf.reduce_sum(tf.square(x)) for x in FloatLeaves(outputs)])


def Unpartitioned(pipeline_layer, inputs, num_micro_batches: int = 1, step: int = 0):
    """A PipeliningLayer's layers applied one after another, without the pipeline.

    No devices, no recompute, no pipeline code: each micro-batch (M=1: the whole batch) runs
    through `pipeline_layer.Layers()` under `fprop_context.Scope(step, micro_batch=m)`. Training
    updates (batch norm's moving statistics) are collected and dropped, so this changes no state.
    """
    batch_dim = pipeline_layer.p.batch_dim
    flat = [tf.split(x, num_micro_batches, batch_dim) for x in tf.nest.flatten(inputs)]
    outputs = []
    for m in range(num_micro_batches):
        args = (tf.nest.pack_sequence_as(inputs, [parts[m] for parts in flat]),)
        with fprop_context.Scope(step=step, micro_batch=m,
                                 update_collector=fprop_context.UpdateCollector()):
            for layer in pipeline_layer.Layers():
                args = base_layer.AsArgs(layer.FProp(layer.theta, *args))
        outputs.append(args[0])
    return tf.nest.map_structure(lambda *xs: tf.concat(xs, batch_dim), *outputs)


def OutputsAndGrads(fn, layer, inputs, loss_fn=SquareLoss):
    """(fn(inputs), d loss / d [float leaves of inputs + layer.trainable_variables])."""
    float_inputs = FloatLeaves(inputs)
    with tf.GradientTape() as tape:
        tape.watch(float_inputs)
        outputs = fn(inputs)
        loss = loss_fn(outputs)
    return outputs, tape.gradient(loss, float_inputs + list(layer.trainable_variables))
