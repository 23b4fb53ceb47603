"""TPU cores as pipeline devices.

Lingvo's way, a v1 graph: the training step is built inside `tf.compat.v1.tpu.rewrite` (or
`shard`) and cell k runs under `tf.device(tf.compat.v1.tpu.core(k))`, the k-th logical core of
the replica. `CoreDevices(K)` is that device list for `PipeliningLayer.Params().devices`; the
replicas (data parallelism) are the rewrite's, each on its own K cores as a
`tf.tpu.experimental.DeviceAssignment` lays them out (`BuildDeviceAssignment`).

The same assignment serves TF2, the trainer's path (`--tpu=<address>`, `--run_locally=tpu`):
`Connect` finds the TPU, `Strategy` makes a `tf.distribute.TPUStrategy` of R replicas of K logical
devices each, and `AssignToLogicalDevice` is the pipeline's `logical_device_fn`: cell k's
parameters, inputs, outputs and gradients are assigned to logical device k
(`strategy.experimental_assign_to_logical_device`, an XLA sharding annotation).

Nothing here needs a TPU to build: the tests check placement and annotations, and the assignment
arithmetic against a fake topology. Running needs one.
"""

from __future__ import annotations

import itertools
import urllib.parse

import numpy as np
import tensorflow as tf
from tensorflow.compiler.xla import xla_data_pb2  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.compiler.xla.experimental import xla_sharding  # pylint: disable=g-direct-tensorflow-import

from gpipe_tf import errors
from gpipe_tf.pipeline import devices as devices_lib
from gpipe_tf.train import cluster as cluster_lib


class TpuError(cluster_lib.ClusterError):
    """No usable TPU at the address given: the trainer prints it without a traceback."""


# The logical TPU core of each of the K stages of one replica (kept under its old name).
CoreDevices = devices_lib.TpuCoreDevices


def ComputationShape(mesh_shape, num_cores: int) -> list[int]:
    """The [x, y, z, core] box of `num_cores` cores that one replica takes: the cores of one
    chip first, then chips along x, y and z.

    Raises:
      ValueError: when no box of `num_cores` fits the mesh.
    """
    mesh = [int(d) for d in mesh_shape]
    if len(mesh) != 4:
        raise ValueError(f'A TPU mesh shape is [x, y, z, cores per chip], got {mesh_shape}.')
    cores = mesh[3]
    per_chip = num_cores if num_cores <= cores else cores
    if num_cores % per_chip or cores % per_chip:
        raise ValueError(f'{num_cores} cores per replica do not tile chips of {cores} cores '
                         f'(mesh {mesh}).')
    chips = num_cores // per_chip
    for x, y, z in itertools.product(range(1, mesh[0] + 1), range(1, mesh[1] + 1),
                                     range(1, mesh[2] + 1)):
        if x * y * z == chips and not (mesh[0] % x or mesh[1] % y or mesh[2] % z):
            return [x, y, z, per_chip]
    raise ValueError(f'No box of {chips} chips x {per_chip} cores fits the TPU mesh {mesh} '
                     f'for {num_cores} cores per replica.')


def BuildDeviceAssignment(topology, num_cells: int, num_replicas: int = 1):
    """R replicas of K logical cores each on `topology` (a tf.tpu.experimental.Topology).

    Raises:
      ValueError: if K cores per replica do not tile the mesh, or R x K exceeds its cores.
    """
    mesh = topology.mesh_shape
    total = int(np.prod(mesh))
    if num_replicas * num_cells > total:
        raise ValueError(f'{num_replicas} replicas x {num_cells} cells need '
                         f'{num_replicas * num_cells} TPU cores; the topology has {total} '
                         f'(mesh {list(mesh)}).')
    shape = ComputationShape(mesh, num_cells)
    return tf.tpu.experimental.DeviceAssignment.build(
        topology, computation_shape=shape, num_replicas=num_replicas)


def StageCores(assignment, num_replicas: int, num_cells: int) -> list[list[dict]]:
    """Per (replica, stage): the host device, TPU ordinal and mesh coordinates it runs on."""
    return [[dict(host=assignment.host_device(replica=r, logical_core=k),
                  tpu_ordinal=int(assignment.tpu_ordinal(replica=r, logical_core=k)),
                  coordinates=[int(c) for c in assignment.coordinates(r, k)])
             for k in range(num_cells)] for r in range(num_replicas)]


def FakeTopology(mesh_shape, num_tasks: int = 1):
    """A Topology of `mesh_shape` whose chips are spread evenly over `num_tasks` hosts, for
    tests and for planning without a TPU."""
    mesh = [int(d) for d in mesh_shape]
    coordinates = [[x, y, z, c] for z in range(mesh[2]) for y in range(mesh[1])
                   for x in range(mesh[0]) for c in range(mesh[3])]
    if len(coordinates) % num_tasks:
        raise ValueError(f'{len(coordinates)} cores do not split over {num_tasks} hosts.')
    per_task = len(coordinates) // num_tasks
    device_coordinates = np.array(coordinates, dtype=np.int32).reshape(
        num_tasks, per_task, 4)
    return tf.tpu.experimental.Topology(mesh_shape=mesh, device_coordinates=device_coordinates)


# ---- TF2: TPUStrategy with K logical devices per replica ---------------------------------------
def ShardingAssign(tensor: tf.Tensor, logical_device: int) -> tf.Tensor:
    """`tensor` assigned to `logical_device` by an XLA sharding op: what
    `TPUStrategy.experimental_assign_to_logical_device` does, without a strategy (for tests, and
    graphs compiled by `tpu.rewrite`). On a CPU the op is an identity."""
    return xla_sharding.assign_device(tensor, logical_device, use_sharding_op=True)


def LogicalDeviceOf(op) -> int | None:
    """The logical device an op's `_XlaSharding` attribute assigns it to (None: no maximal
    sharding)."""
    try:
        proto = op.get_attr('_XlaSharding')
    except ValueError:
        return None
    sharding = xla_data_pb2.OpSharding.FromString(proto)
    if sharding.type != xla_data_pb2.OpSharding.MAXIMAL:
        return None
    return int(sharding.tile_assignment_devices[0])


def AssignToLogicalDevice(tensor: tf.Tensor, logical_device: int) -> tf.Tensor:
    """The pipeline's `logical_device_fn` on a TPU: `tensor` assigned to logical device
    `logical_device` of the replica running it, by the TPUStrategy in scope
    (`experimental_assign_to_logical_device`). A module-level function, so Params keep their
    text form.

    Raises:
      ValueError: outside a TPUStrategy's replica (off a TPU, `ShardingAssign` annotates alike).
    """
    strategy = tf.distribute.get_strategy()
    assign = getattr(strategy, 'experimental_assign_to_logical_device', None)
    if assign is None:
        raise ValueError('AssignToLogicalDevice runs inside a TPUStrategy (strategy.run); the '
                         f'strategy in scope is {type(strategy).__name__}. Without a TPU, '
                         'tpu.ShardingAssign makes the same annotation.')
    return assign(tensor, logical_device)


def _HostPort(address: str) -> str | None:
    """host:port of a grpc:// address; None for a TPU name or 'local'."""
    if not address.startswith('grpc://'):
        return None
    parsed = urllib.parse.urlparse(address)
    if not parsed.hostname or not parsed.port:
        raise TpuError(f'--tpu={address}: expected grpc://host:port (the TPU worker\'s address, '
                       'port 8470 on a TPU node), "local" on a TPU VM, or a TPU name.')
    return f'{parsed.hostname}:{parsed.port}'


def Connect(address: str, timeout_s: float = 600.0):
    """Connects to the TPU at `address` and initializes it.

    Args:
      address: 'local' (a Cloud TPU VM), a TPU name (resolved by the Cloud TPU API), or
        grpc://host:port (a TPU node's worker).
      timeout_s: how long initialization may take before it counts as no answer.

    Returns:
      (the TPUClusterResolver, the TPU's tf.tpu.experimental.Topology).

    Raises:
      TpuError: nothing accepts connections at a grpc:// address, no TPU is there, or it does
        not answer within `timeout_s`.
    """
    if not address:
        raise TpuError('--tpu: empty address; expected "local", a TPU name or grpc://host:port.')
    host_port = _HostPort(address)
    if host_port is not None:
        problem = cluster_lib.ConnectProblem(host_port, 5.0)
        if problem:
            raise TpuError(f'--tpu={address}: {problem}. Is the TPU worker running at that '
                           'address (port 8470 on a TPU node)?')

    def Initialize():
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=address)
        tf.config.experimental_connect_to_cluster(resolver)
        return resolver, tf.tpu.experimental.initialize_tpu_system(resolver)

    # Initialization can wait forever on an address that accepts connections but is no TPU
    # worker; the thread is abandoned after the timeout.
    outcome = cluster_lib.CallWithin(Initialize, timeout_s)
    if outcome is None:
        raise TpuError(f'--tpu={address}: the TPU did not initialize within {timeout_s:g} s.')
    if outcome.error is not None:
        error = outcome.error
        where = 'on this machine' if address == 'local' else f'at {address}'
        raise TpuError(f'--tpu={address}: no usable TPU {where} ({type(error).__name__}: '
                       f'{errors.Reason(error)[:300]}). On a Cloud TPU VM use '
                       '--tpu=local; for a TPU node give its name or grpc://<ip>:8470.')
    return outcome.value


def Strategy(resolver, topology, num_cells: int,
             num_replicas: int = 1) -> tf.distribute.TPUStrategy:
    """A TPUStrategy of R replicas, each on K logical devices (one per pipeline stage).

    Args:
      resolver: the TPUClusterResolver `Connect` returned.
      topology: the TPU's tf.tpu.experimental.Topology (`Connect`).
      num_cells: K, the logical devices (one TPU core each) of a replica.
      num_replicas: R.

    Raises:
      ValueError: if R x K cores do not fit the topology (see `BuildDeviceAssignment`).
    """
    assignment = BuildDeviceAssignment(topology, num_cells, num_replicas)
    return tf.distribute.TPUStrategy(resolver, experimental_device_assignment=assignment)
