"""Helpers for gpipe_tf's tests: virtual devices and numeric comparisons."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

# Tests split the CPU into this many logical devices, enough for K = 8 cells.
NUM_VIRTUAL_CPUS = 8


def ConfigureVirtualCpus(num_devices: int = NUM_VIRTUAL_CPUS) -> list[str]:
    """Splits the physical CPU into `num_devices` logical devices (once per process).

    Must run before TensorFlow initialises its devices; later calls check the count instead.

    Returns:
      The logical CPU device names.

    Raises:
      RuntimeError: if TF was initialised with fewer logical CPUs than asked for.
    """
    cpu = tf.config.list_physical_devices('CPU')[0]
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * num_devices)
    except RuntimeError:
        pass  # Already initialised; checked below.
    devices = [d.name for d in tf.config.list_logical_devices('CPU')]
    if len(devices) < num_devices:
        raise RuntimeError(f'Need {num_devices} logical CPUs but TensorFlow was initialised with '
                           f'{len(devices)}; configure devices before any TF op runs.')
    return devices


def MaxRelativeError(actual, expected) -> float:
    """max |actual - expected| / max |expected| over all tensors of two like-structured nests."""
    worst = 0.0
    for a, e in zip(tf.nest.flatten(actual), tf.nest.flatten(expected)):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        if a.shape != e.shape:
            raise ValueError(f'Shapes differ: {a.shape} vs {e.shape}.')
        scale = max(np.abs(e).max(initial=0.0), 1e-30)
        worst = max(worst, float(np.abs(a - e).max(initial=0.0) / scale))
    return worst
