"""The step over R replicas: the mini-batch sharded across the replicas' pipelines, and in
training the whole step as one custom-gradient op.

Each replica runs its own `executor.Executor` on its shard of the batch (`ShardSizes`: a static
batch of fewer examples than R runs on fewer replicas); the outputs are joined along the batch on
the last stage's device (`Replicated`). In training (`Train` after the pipeline's loss,
`TrainWithLoss` with the loss per micro-batch inside it) the step is one `tf.custom_gradient` op,
so that its backward is the schedule's: each cell's weight gradients (and training statistics) are
the sum over replicas, taken on the device of the cell's variables (replica 0's), an in-graph
all-reduce whose broadcast is the next step's read (`SumOverReplicas`).

`devices` here is replica 0's device of each cell, where the variables live; `batch_dim` the
pipeline's batch dimension.
"""

from __future__ import annotations

import tensorflow as tf

from gpipe_tf import loss_scale as loss_scale_lib
from gpipe_tf.layers import fprop_context
from gpipe_tf.pipeline import executor
from gpipe_tf.pipeline import gradient_sums
from gpipe_tf.pipeline import leaves
from gpipe_tf.pipeline import microbatch
from gpipe_tf.pipeline import unfolded


def ShardSizes(batch_size: int | None, num_replicas: int) -> list:
    """Per replica that runs, its shard's examples (`microbatch.Sizes`): all R with None
    (a batch known only when the step runs); of a static batch, only those with examples
    (one, of no example, for an empty batch)."""
    if batch_size is None:
        return [None] * num_replicas
    return [size for size in microbatch.Sizes(batch_size, num_replicas) if size] or [0]


def Replicated(fn, inputs, num_replicas: int, devices: list, batch_dim: int):
    """Concatenation over `num_replicas` replicas (fewer than R for a static batch of
    fewer examples) of `fn(r, replica r's shard of inputs)`; with one, `fn(0, inputs)`."""
    if num_replicas == 1:
        return fn(0, inputs)
    with tf.device(devices[0]):
        shards = microbatch.Split(inputs, num_replicas, batch_dim)
    outputs = []
    for r, shard in enumerate(shards):
        with _ReplicaScope(r):
            outputs.append(fn(r, shard))
    with tf.device(devices[-1]):
        return _Joined(outputs, inputs, batch_dim)


def Train(runs: list[executor.Executor], thetas: list, inputs, devices: list, batch_dim: int):
    """The unrolled step of every replica (`runs`, one executor each) as one custom-gradient op,
    so that its backward is ours: built per cell under the cell's device, in the schedule's
    order. With R replicas, each cell's weight gradient is the sum of the replicas', taken on
    the device of the variables (replica 0's): an in-graph all-reduce whose broadcast is the
    next step's read.

    Returns:
      (outputs, per cell its layers' training statistics summed over micro-batches and
      replicas).
    """
    num_replicas = len(runs)
    results = []

    @tf.custom_gradient
    def Pipeline(*flat):
        thetas_in, offset = _Unflatten(thetas, flat)
        replica_updates = []

        def Forward(r, shard):
            outputs, updates = runs[r].Forward(thetas_in, shard)
            replica_updates.append(updates)
            return outputs

        outputs = Replicated(Forward, tf.nest.pack_sequence_as(inputs, flat[offset:]),
                             num_replicas, devices, batch_dim)
        results.append((outputs, SumOverReplicas(replica_updates, devices)))

        def Grad(*d_flat):
            d_outputs = tf.nest.pack_sequence_as(outputs, _FloatGrads(outputs, d_flat))
            replica_d_thetas = []

            def Backward(r, d_shard):
                d_thetas, d_inputs = runs[r].Backward(d_shard)
                replica_d_thetas.append(d_thetas)
                return d_inputs

            if num_replicas == 1:
                d_inputs = Backward(0, d_outputs)
            else:
                with tf.device(devices[-1]):
                    d_shards = microbatch.Split(d_outputs, num_replicas, batch_dim)
                d_inputs = []
                for r, d_shard in enumerate(d_shards):
                    with _ReplicaScope(r):
                        d_inputs.append(Backward(r, d_shard))
                with tf.device(devices[0]):
                    d_inputs = _Joined(d_inputs, d_outputs, batch_dim)
            d_thetas = SumOverReplicas(replica_d_thetas, devices)
            return [g for cell in d_thetas for g in cell] + tf.nest.flatten(d_inputs)

        return tf.nest.flatten(outputs), Grad

    flat_outputs = Pipeline(*[t for theta in thetas for t in tf.nest.flatten(theta)],
                            *tf.nest.flatten(inputs))
    outputs, updates = results[0]
    return tf.nest.pack_sequence_as(outputs, list(flat_outputs)), updates


def TrainWithLoss(runs: list[executor.Executor], thetas: list, inputs, loss_fn, loss_inputs,
                  devices: list, batch_dim: int):
    """Every replica's whole step (forwards, per micro-batch losses, backwards, in its
    schedule's order) run as the forward of one custom-gradient op whose output is the
    loss: the gradients, computed with the loss (times the `fprop_context` loss_scale), are
    scaled by the incoming gradient and divided by the weight.

    Returns:
      (outputs, per cell its training statistics, loss, weight).
    """
    num_replicas = len(runs)
    loss_scale = fprop_context.Current().loss_scale
    if loss_scale is not None:
        loss_scale = tf.cast(loss_scale, tf.float32)
    results = []

    @tf.custom_gradient
    def Pipeline(*flat):
        thetas_in, offset = _Unflatten(thetas, flat)
        steps = []

        def Step(r, shard):
            pipeline_shard, loss_shard = shard
            steps.append(runs[r].ForwardBackward(thetas_in, pipeline_shard, loss_fn,
                                                 loss_shard, loss_scale))
            return steps[-1][0]

        outputs = Replicated(
            Step, (tf.nest.pack_sequence_as(inputs, flat[offset:]), loss_inputs),
            num_replicas, devices, batch_dim)
        with tf.device(devices[-1]):
            total = tf.add_n([s[2][0] for s in steps])
            weight = tf.add_n([s[2][1] for s in steps])
            loss = tf.math.divide_no_nan(total, weight)
        with tf.device(devices[0]):
            d_inputs = (steps[0][4] if num_replicas == 1 else
                        _Joined([s[4] for s in steps], inputs, batch_dim))
        d_thetas = SumOverReplicas([s[3] for s in steps], devices)
        results.append((outputs, SumOverReplicas([s[1] for s in steps], devices), weight))

        def Grad(d_loss):
            # Each cell's gradients on its device, then the inputs' on the first. They
            # were computed for the loss times loss_scale.
            pieces = list(enumerate(d_thetas)) + [(0, tf.nest.flatten(d_inputs))]
            grads = []
            for k, piece in pieces:
                with tf.device(devices[k]), tf.name_scope(f'cell_{k}_grad_scale'):
                    scale = tf.math.divide_no_nan(
                        d_loss, weight if loss_scale is None else weight * loss_scale)
                    grads += [loss_scale_lib.ScaleGradient(g, scale) for g in piece]
            return grads

        return loss, Grad

    loss = Pipeline(*[t for theta in thetas for t in tf.nest.flatten(theta)],
                    *tf.nest.flatten(inputs))
    outputs, updates, weight = results[0]
    return outputs, updates, loss, weight


def SumOverReplicas(per_replica: list, devices: list) -> list:
    """Per cell, the sum over replicas (on the cell's variables' device, `devices[k]`) of a
    per-replica list of per-cell nests; None leaves stay None."""
    if len(per_replica) == 1:
        return per_replica[0]
    summed = []
    for k, cells in enumerate(zip(*per_replica)):
        with tf.device(devices[k]), tf.name_scope(f'cell_{k}_replica_sum'):
            summed.append(tf.nest.map_structure(
                lambda *xs: None if xs[0] is None else gradient_sums.AddAll(list(xs)),
                *cells))
    return summed


def _ReplicaScope(r: int):
    """Replica r's name scope, taken only with several replicas (one keeps its op names
    `cell_<k>_mb_<m>_*`)."""
    return tf.name_scope(f'replica_{r}')


def _Joined(shards: list, inputs, batch_dim: int):
    """The replicas' shards of a nest joined along the batch (`microbatch.Concat`: a shard
    of a batch known only when the step runs may be empty, fewer examples than R)."""
    sizes = None
    if microbatch.StaticBatchSize(inputs, batch_dim) is None:
        sizes = microbatch.Sizes(microbatch.RunBatchSize(inputs, batch_dim), len(shards))
    return microbatch.Concat(shards, batch_dim, sizes)


def _Unflatten(thetas: list, flat) -> tuple[list, int]:
    """(per cell its theta with the leaves taken in order from `flat`, the index in `flat`
    after the last theta leaf): how the custom-gradient ops receive the cells' thetas."""
    thetas_in, offset = [], 0
    for theta in thetas:
        size = len(tf.nest.flatten(theta))
        thetas_in.append(tf.nest.pack_sequence_as(theta, flat[offset:offset + size]))
        offset += size
    return thetas_in, offset


def _FloatGrads(outputs, d_flat) -> list:
    """Incoming gradients with zeros where none arrived (unused outputs), filled each step."""
    return [d if d is not None or not leaves.IsFloat(y) else unfolded.ZerosLike(y)
            for y, d in zip(tf.nest.flatten(outputs), d_flat)]
