"""TPU cores as pipeline devices.

Lingvo's way, a v1 graph: the training step is built inside `tf.compat.v1.tpu.rewrite` (or
`shard`) and cell k runs under `tf.device(tf.compat.v1.tpu.core(k))`, the k-th logical core of
the replica. `CoreDevices(K)` is that device list for `PipeliningLayer.Params().devices`; the
replicas (data parallelism) are the rewrite's, each on its own K cores as a
`tf.tpu.experimental.DeviceAssignment` lays them out (`BuildDeviceAssignment`).

The same assignment serves TF2: `tf.distribute.TPUStrategy(resolver,
experimental_device_assignment=assignment)` runs R replicas of K logical devices each.

Nothing here needs a TPU to build: the tests check placement and the assignment arithmetic
against a fake topology. Running needs one (`--run_locally=tpu` / `--tpu=<address>`).
"""

from __future__ import annotations

import itertools

import numpy as np
import tensorflow as tf


def CoreDevices(num_cells: int) -> list[str]:
    """The logical TPU core of each of the K stages of one replica."""
    if num_cells < 1:
        raise ValueError(f'num_cells must be >= 1, got {num_cells}.')
    return [tf.compat.v1.tpu.core(k) for k in range(num_cells)]


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
