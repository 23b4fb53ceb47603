"""Where each stage of each replica runs: the one owner of device choices.

A mesh is R lists of K device strings, from a user's list or function or the devices present
(`MeshDevices`), checked against the devices that exist (`CheckDevices`); local runs set up
their devices here (`LocalDevices`: virtual CPUs or GPUs).

TensorFlow is imported inside the functions: the trainer reads RUN_LOCALLY for its flags before
it decides how quiet TensorFlow starts.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

from gpipe_tf import errors

RUN_LOCALLY = ('cpu', 'gpu', 'tpu')


@dataclasses.dataclass(frozen=True)
class Request:
    """Where a run asks its stages to go (the trainer's --run_locally, --num_devices,
    --cluster_spec, --cluster_job and --tpu).

    Attributes:
      run_locally: 'cpu' (virtual CPUs), 'gpu' (the GPUs present) or 'tpu'.
      num_devices: how many devices; None: one per stage of every replica (R x K).
      cluster: a tf.train.ClusterSpec whose tasks run the stages, or None for a local run.
      cluster_job: the cluster's job whose tasks run the stages.
      tpu: whether a TPU runs the stages (its cores are each replica's logical devices).
    """
    run_locally: str = 'cpu'
    num_devices: int | None = None
    cluster: Any = None
    cluster_job: str = 'worker'
    tpu: bool = False


def StageDeviceList(request: Request, num_cells: int, num_replicas: int,
                    plan_only: bool = False) -> list[str]:
    """The devices a run's stages go on (for `PipeliningLayer.Params().devices`), set up unless
    `plan_only` (a plan names devices without needing them: K may exceed those present).

    A TPU gives its K logical cores (the strategy's replicas are R); a cluster the first R x K
    tasks of its job; a local run R x K virtual CPUs or the GPUs present.

    Raises:
      errors.UserError: for devices asked for that this machine or cluster does not have, or
        flags that do not go with a TPU.
    """
    if request.tpu:
        if request.num_devices is not None or request.run_locally == 'gpu':
            raise errors.UserError('--tpu uses R x K TPU cores (--worker_replicas x '
                                   '--worker_split_size); drop --num_devices and '
                                   '--run_locally=gpu.')
        return TpuCoreDevices(num_cells)
    count = (request.num_devices if request.num_devices is not None else
             num_cells * num_replicas)
    try:
        if request.cluster is not None:
            devices = ClusterDevices(request.cluster, count, request.cluster_job)
        elif plan_only and request.run_locally == 'cpu':
            devices = [f'/job:localhost/replica:0/task:0/device:CPU:{i}' for i in range(count)]
        else:
            devices = LocalDevices(request.run_locally, count)
    except (ValueError, RuntimeError) as error:  # Asked for devices that are not there.
        raise errors.UserError(str(error)) from None
    return devices[:count] if count else devices


def ClusterDevices(cluster, count: int, job: str = 'worker') -> list[str]:
    """The first `count` tasks of `job` of tf.train.ClusterSpec `cluster`, one device each.

    Raises:
      ValueError: if the job is missing or has fewer than `count` tasks.
    """
    if job not in cluster.jobs:
        raise ValueError(f'The cluster has no job {job!r} (jobs: {cluster.jobs}).')
    tasks = cluster.num_tasks(job)
    if tasks < count:
        raise ValueError(f'{count} pipeline stages (replicas x cells) need {count} tasks of job '
                         f'{job!r}, but the cluster has {tasks}: {cluster.job_tasks(job)}.')
    return [f'/job:{job}/replica:0/task:{i}/device:CPU:0' for i in range(count)]


def TpuCoreDevices(num_cells: int) -> list[str]:
    """The logical TPU core of each of the K stages of one replica."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    if num_cells < 1:
        raise ValueError(f'num_cells must be >= 1, got {num_cells}.')
    return [tf.compat.v1.tpu.core(k) for k in range(num_cells)]


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


def DefaultDevices() -> list[str]:
    """The logical accelerators present (GPUs, else TPUs, else CPUs)."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    for kind in ('GPU', 'TPU', 'CPU'):
        devices = tf.config.list_logical_devices(kind)
        if devices:
            return [d.name for d in devices]
    return ['/device:CPU:0']


def MeshDevices(devices, num_replicas: int, num_cells: int,
                round_robin: bool | None = True) -> list[list[str]]:
    """Device string of each (replica, stage): R lists of K.

    Args:
      devices: None (the logical devices present), a flat list of devices (replica r's
        stage k takes entry r * K + k), a list of R lists of K, or a function of
        (replica, stage) returning a device (of the stage alone when R is 1). A device is a
        string, a tf.config.LogicalDevice or a tf.DeviceSpec (`_DeviceName`).
      num_replicas: R, the pipelines run side by side for data parallelism.
      num_cells: K.
      round_robin: whether stages may share devices round-robin when there are fewer than
        R * K: True; False never; None for the devices present (`SharedDevices` says when
        they are shared) and a list of one device (every stage on it), but not for a longer
        list given, whose length must then be R * K (a list of 2 for 4 stages is more likely
        a mistake than a wish to share).

    Raises:
      errors.ConfigError (a ValueError): for devices of another type (a string rather than a
        list of them), a device that is not a string, too few devices without round_robin, or
        a nested list that is not R x K.
    """
    if num_replicas < 1:
        raise errors.ConfigError(f'num_replicas must be >= 1, got {num_replicas}.')
    if not (devices is None or callable(devices) or isinstance(devices, (list, tuple))):
        one = (f" (for every stage on one device, write ['{devices}'])"
               if isinstance(devices, str) else '')
        raise errors.ConfigError(
            'PipeliningLayer devices must be None, a list of device strings, '
            f'{num_replicas} list(s) of {num_cells} (replicas x stages), or a function of '
            f'(replica, stage); got {type(devices).__name__} {devices!r}{one}.')
    if isinstance(devices, (list, tuple)):  # A LogicalDevice is a tuple, not a replica's row.
        devices = [_DeviceName(device) for device in devices]
    if callable(devices):
        if len(inspect.signature(devices).parameters) >= 2:
            mesh = [[devices(r, k) for k in range(num_cells)] for r in range(num_replicas)]
        elif num_replicas > 1:
            raise errors.ConfigError(f'With {num_replicas} replicas, devices must be a function of '
                             '(replica, stage); this one takes the stage only.')
        else:
            mesh = [[devices(k) for k in range(num_cells)]]
        return _DeviceStrings(mesh, 'the devices function returned')
    if devices and isinstance(devices[0], (list, tuple)):
        if (len(devices) != num_replicas or
                any(not isinstance(row, (list, tuple)) or len(row) != num_cells
                    for row in devices)):
            raise errors.ConfigError(
                f'A nested devices list must be {num_replicas} replicas x {num_cells} stages, '
                f'got {[len(row) if isinstance(row, (list, tuple)) else row for row in devices]}.')
        return _DeviceStrings([list(row) for row in devices], 'devices gives')
    available = list(devices) if devices else DefaultDevices()
    needed = num_replicas * num_cells
    shares = round_robin or (round_robin is None and (not devices or len(devices) == 1))
    if len(available) < needed and not shares:
        why = ('round_robin is off' if round_robin is False else
               'set round_robin=True to share them round-robin')
        raise errors.ConfigError(f'{num_replicas} replicas of {num_cells} cells need {needed} '
                                 f'devices, but only {len(available)} were given ({available}): '
                                 f'give one per stage, or {why}.')
    return _DeviceStrings([[available[(r * num_cells + k) % len(available)]
                            for k in range(num_cells)] for r in range(num_replicas)],
                          'devices gives')


def SharedDevices(mesh: list[list[str]]) -> str | None:
    """A line saying how stages share devices where the mesh (R lists of K) puts several on
    one device (fewer devices present than R x K); None where each has its own. The stages
    then run one after another on each device: the math is the same, without the pipeline's
    overlap or its memory split."""
    stages = [device for row in mesh for device in row]
    distinct = sorted(set(stages))
    if len(distinct) == len(stages):
        return None
    replicas = f' x {len(mesh)} replicas' if len(mesh) > 1 else ''
    return (f'{len(mesh[0])} pipeline stages{replicas} share {len(distinct)} device(s) '
            f'({", ".join(distinct)}): the stages of a device run in turn. For one device per '
            'stage, make logical devices before TensorFlow starts (gpipe_tf.pipeline.devices.'
            'VirtualCpus(n) splits the CPU), or pass devices.')


def _DeviceStrings(mesh: list[list], given: str) -> list[list[str]]:
    """`mesh`, checked to hold device strings (after `_DeviceName`): TensorFlow would fail on
    anything else deep in placement, naming neither the stage nor the value."""
    mesh = [[_DeviceName(device) for device in row] for row in mesh]
    for r, row in enumerate(mesh):
        for k, device in enumerate(row):
            if not isinstance(device, str):
                raise errors.ConfigError(
                    f'PipeliningLayer devices: {given} {type(device).__name__} {device!r} for '
                    f"stage {k} of replica {r}; expected a device string, such as "
                    f"'/device:GPU:{k}'.")
    return mesh


def _DeviceName(device):
    """The name of what `tf.device` takes besides a string: a `tf.config.LogicalDevice` (as
    `tf.config.list_logical_devices` lists them) or a `tf.DeviceSpec`; anything else as it is."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    if isinstance(device, tf.config.LogicalDevice):
        return device.name
    if isinstance(device, tf.DeviceSpec):
        return device.to_string()
    return device


# Device types a string is checked for even when none is present (a GPU asked for on a machine
# without one); other types (TPU_REPLICATED_CORE, which tpu.rewrite maps to cores) only when
# TensorFlow lists devices of the type.
_CHECKED_DEVICE_TYPES = ('CPU', 'GPU', 'TPU')


def CheckDevices(mesh: list[list[str]], available: list[str] | None = None) -> None:
    """Raises unless every device of `mesh` that names one device is present.

    TensorFlow's soft placement would silently run a missing device's ops elsewhere (on CPU:0):
    the numbers would be right, the placement not the one asked for.

    A device string is checked when it names a device type (CPU, GPU, TPU, or a type among the
    available devices) and an index; empty strings and wildcards are left to TensorFlow. A
    string TensorFlow cannot parse (`tf.device` would refuse it too, deep in the build) is an
    error here.

    Args:
      mesh: the device of each (replica, stage), R lists of K (`MeshDevices`).
      available: names of the devices present; default: this process's logical devices
        (`tf.config.list_logical_devices()`), against which only local strings (no job, or job
        `localhost`) are checked: another job's devices belong to a cluster. Given (a cluster's
        devices, say), every string is checked, and a job, replica or task it names must match.

    Raises:
      errors.ConfigError (a ValueError): naming the first missing or unparsable device, its
        stage and replica, and (missing) the devices present.
    """
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    local = available is None
    present, kinds = None, set()
    for r, row in enumerate(mesh):
        for k, device in enumerate(row):
            try:
                spec = tf.DeviceSpec.from_string(device or '')
            except ValueError as error:
                raise errors.ConfigError(
                    f'Device {device!r} of stage {k}, replica {r} is not a device string: '
                    f"{error} Expected one such as '/device:GPU:{k}' or "
                    f"'/job:worker/task:{k}/device:CPU:0'.") from None
            if spec.device_type is None or spec.device_index is None:
                continue
            if local and spec.job not in (None, 'localhost'):
                continue
            if present is None:  # Listing initialises TF's devices: only when there is a need.
                names = ([d.name for d in tf.config.list_logical_devices()] if local
                         else list(available))
                present = [(name, tf.DeviceSpec.from_string(name)) for name in names]
                kinds = set(_CHECKED_DEVICE_TYPES) | {
                    p.device_type.upper() for _, p in present if p.device_type}
            if spec.device_type.upper() not in kinds:
                continue
            if not any(_SameDevice(spec, p) for _, p in present):
                where = ('is not a device of this process; devices present' if local else
                         'is not among the devices available')
                raise errors.ConfigError(
                    f'PipeliningLayer devices: {device} (stage {k} of replica {r}) {where}: '
                    f'{", ".join(name for name, _ in present) or "none"}.')


def _SameDevice(wanted, present) -> bool:
    """Whether `present` is the device `wanted` names; a field either leaves unset matches."""
    if (wanted.device_type.upper() != (present.device_type or '').upper() or
            wanted.device_index != present.device_index):
        return False
    return all(a is None or b is None or a == b for a, b in (
        (wanted.job, present.job), (wanted.replica, present.replica),
        (wanted.task, present.task)))


def StageDevices(devices, num_cells: int, round_robin: bool = True) -> list[str]:
    """Device string of each of the K stages of the first replica (see `MeshDevices`)."""
    return MeshDevices(devices, 1, num_cells, round_robin)[0]
