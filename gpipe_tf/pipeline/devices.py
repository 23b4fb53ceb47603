"""Devices a local run places its cells on: `--run_locally=cpu|gpu|tpu`, and virtual CPUs.

TensorFlow is imported inside the functions: the trainer reads RUN_LOCALLY for its flags before
it decides how quiet TensorFlow starts."""

from __future__ import annotations

RUN_LOCALLY = ('cpu', 'gpu', 'tpu')


def LocalDevices(run_locally: str, num_devices: int) -> list[str]:
    """Sets up and returns the local devices; call before TensorFlow runs any op.

    Args:
      run_locally: 'cpu' splits the CPU into `num_devices` virtual devices; 'gpu' uses the GPUs
        present (memory growth on; `num_devices` of them, 0 meaning all); 'tpu' is an error
        (TPU cores are a TPUStrategy's logical devices, see `gpipe_tf.train.tpu`).

    Raises:
      ValueError: for an unknown kind, a bad count, or 'tpu'; RuntimeError: when the GPUs are
        absent.
    """
    if run_locally not in RUN_LOCALLY:
        raise ValueError(f'--run_locally must be one of {RUN_LOCALLY}, got {run_locally!r}.')
    if num_devices < 0:
        raise ValueError(f'--num_devices must be >= 0, got {num_devices}.')
    if run_locally == 'cpu':
        return VirtualCpus(max(num_devices, 1))
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    if run_locally == 'tpu':
        # A TPU is reached through a TPUClusterResolver and a TPUStrategy, not as local
        # devices: the trainer's --run_locally=tpu is --tpu=local (gpipe_tf.train.tpu).
        raise ValueError('TPU cores are not local devices: connect with '
                         'gpipe_tf.train.tpu.Connect("local") and run under tpu.Strategy.')
    gpus = tf.config.list_physical_devices('GPU')
    if not gpus:
        raise RuntimeError('--run_locally=gpu: TensorFlow sees no GPU on this machine (devices: '
                           f'{[d.name for d in tf.config.list_physical_devices()]}).')
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if num_devices > len(gpus):
        raise ValueError(f'--num_devices={num_devices} but only {len(gpus)} GPUs are present.')
    names = [d.name for d in tf.config.list_logical_devices('GPU')]
    return names[:num_devices] if num_devices else names


def VirtualCpus(num_devices: int) -> list[str]:
    """Splits the physical CPU into `num_devices` logical devices (once per process).

    Must run before TensorFlow initialises its devices; later calls check the count instead.

    Returns:
      The logical CPU device names.

    Raises:
      RuntimeError: if TF was initialised with fewer logical CPUs than asked for.
    """
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
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
