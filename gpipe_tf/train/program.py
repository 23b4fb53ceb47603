"""Training and evaluation programs: the task, optimizer, global step and checkpoints, run as
a `tf.function` (`EagerProgram`, the default) or as a v1 graph in a Session (`GraphProgram`).

Both expose the same small interface to the loop in `gpipe_tf.train.loop`:
`Restore() -> step`, `Step() -> {metric: float}`, `Save()`, `Evaluate(input) -> {metric: float}`,
`LearningRate() -> float`, and `TracedStep() -> ({metric: float}, StepTrace)`: the very step
`Step()` would run, with its op events recorded (for the measured timeline). Checkpoints are
`tf.train.Checkpoint`s of (task, optimizer, global_step, and float16's loss scale) under
`<logdir>/train`, kept by a `tf.train.CheckpointManager`. The training data restarts at the
restored step (see `gpipe_tf.input.base_input`), so a resumed run sees the same batches as an
uninterrupted one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import tempfile

import numpy as np
import tensorflow as tf

from gpipe_tf import errors
from gpipe_tf.layers import fprop_context
from gpipe_tf.nested_map import NestedMap
from gpipe_tf.perf import trace
from gpipe_tf.train import checkpoints
from gpipe_tf.train import cluster as cluster_lib
from gpipe_tf.train import legacy_checkpoints
from gpipe_tf.train import update

STEP_KEY = 'global_step/.ATTRIBUTES/VARIABLE_VALUE'


def CheckpointDir(logdir: str) -> str:
    return os.path.join(logdir, 'train')


class CheckpointWriteError(errors.EnvironmentFault):
    """A checkpoint could not be written (a full disk, a file system gone read-only)."""


# A step whose task went away fails with one of these; they name the cluster, not the disk.
CLUSTER_FAILURES = (tf.errors.DeadlineExceededError, tf.errors.UnavailableError,
                    tf.errors.AbortedError, tf.errors.CancelledError)


@contextlib.contextmanager
def _WritingCheckpoint(directory: str, step: int, cluster: tf.train.ClusterSpec | None = None,
                       job: str = cluster_lib.DEFAULT_JOB):
    """A failed checkpoint write as CheckpointWriteError: the checkpoints before it restore,
    and the next start resumes from the newest of them (setting the unfinished one aside).

    The cluster's own failures pass through unchanged; on a cluster (`cluster`, `job`), a
    write that failed otherwise while a task does not answer is that task's ClusterError.
    """
    try:
        yield
    except CLUSTER_FAILURES:
        raise
    except (tf.errors.OpError, OSError) as error:
        statuses = cluster_lib.Diagnose(cluster, job) if cluster is not None else []
        if any(s.problem for s in statuses):
            raise cluster_lib.UnreachableError(cluster, error, job, statuses=statuses) from error
        why = errors.Reason(error) or type(error).__name__
        raise CheckpointWriteError(
            f'could not write the checkpoint of step {step} in {directory}: {why}. The '
            'checkpoints written before it are kept; free space (or fix the cause) and run the '
            'same command to resume from the newest.') from error


class CheckpointMismatchError(errors.UserError):
    """A checkpoint that reads back but does not fit the model being built."""


def LatestStep(logdir: str) -> int:
    """The global step of the latest checkpoint under `logdir` (0 when there is none).

    A trainer has repaired the index before (`checkpoints.SetAside`); for eval and decode,
    which leave a damaged logdir as it is, a latest checkpoint that does not read counts as
    none: they restore the one `checkpoints.Find` chose, and do not read the training data.
    """
    try:
        path = tf.train.latest_checkpoint(CheckpointDir(logdir))
        return int(tf.train.load_checkpoint(path).get_tensor(STEP_KEY)) if path else 0
    except Exception:  # pylint: disable=broad-except
        return 0


def _RestoreMatched(checkpoint, path: str):
    """`checkpoint.restore(path)`'s status, once every object of the model is known to be in
    the checkpoint.

    A checkpoint that keys the pipeline's layers by cell (written before they were keyed by
    name) is read through its converted copy (`legacy_checkpoints`). One without a loss scale
    restores into a model with one, whose scale keeps its initial value.

    Raises:
      CheckpointMismatchError: if the checkpoint holds other variables than the model's.
    """
    readable = legacy_checkpoints.Readable(path)
    if hasattr(checkpoint, 'loss_scale') and not any(
            name.startswith('loss_scale/') for name, _ in tf.train.list_variables(readable)):
        # Written without a loss scale (float32 or bfloat16 training) and resumed in float16:
        # the scale starts from its initial value.
        checkpoint = type(checkpoint)(task=checkpoint.task, optimizer=checkpoint.optimizer,
                                      global_step=checkpoint.global_step)
    try:
        return checkpoint.restore(readable).assert_existing_objects_matched()
    except (AssertionError, ValueError) as error:  # ValueError: a variable of another shape.
        raise _Mismatch(path, checkpoints.FirstLine(error)) from None


def _Mismatch(path: str, what: str) -> CheckpointMismatchError:
    return CheckpointMismatchError(
        f'checkpoint {path} does not fit the model being built ({what}): it was written by '
        'another model or configuration. Use another --logdir for this one.')


def _CheckRestoredShapes(session, path: str) -> None:
    """A v1 graph's restore assigns a checkpoint value of another shape without a word (the
    step then fails deep in the pipeline): compare every variable's value with its shape."""
    variables = [v for v in tf.compat.v1.global_variables()
                 if v.shape.is_fully_defined() and hasattr(v, 'handle')]
    # The value's shape, read from the resource (tf.shape would answer the static shape).
    shapes = session.run([tf.raw_ops.VariableShape(input=v.handle) for v in variables])
    for variable, shape in zip(variables, shapes):
        shape = [int(d) for d in shape]
        if shape != variable.shape.as_list():
            raise _Mismatch(path, f'{variable.op.name} has shape {shape} in the checkpoint, '
                                  f'{variable.shape.as_list()} in the model')


def _LossScaleEntry(loss_scale) -> dict:
    """The checkpoint's entry for the dynamic loss scale (float16), so a resumed run keeps its
    scale; none without one, so other checkpoints are as they were."""
    return {} if loss_scale is None else {'loss_scale': loss_scale}


def _Floats(metrics) -> dict:
    return {k: float(np.asarray(v)) for k, v in metrics.items()}


@dataclasses.dataclass(frozen=True)
class StepTrace:
    """The op events of one traced training step, or, if tracing failed, why (the step itself
    ran either way).

    Attributes:
      events: the step's op events (`trace.OpEvent`), or None.
      error: what stopped the tracing, or None.
    """
    events: list[trace.OpEvent] | None = None
    error: Exception | None = None


def _StopProfiler(logdir: str) -> StepTrace:
    """Stops the profiler started on `logdir` and reads its events; removes `logdir`."""
    try:
        tf.profiler.experimental.stop()
        return StepTrace(events=trace.EventsFromProfile(logdir))
    except Exception as error:  # pylint: disable=broad-except
        return StepTrace(error=error)
    finally:
        shutil.rmtree(logdir, ignore_errors=True)


class MetricSums:
    """Weighted sums of (value, weight) metrics over evaluation batches."""

    def __init__(self):
        self._sums, self._weights = {}, {}

    def Add(self, metrics: dict) -> None:
        for name, (value, weight) in metrics.items():
            value, weight = float(np.asarray(value)), float(np.asarray(weight))
            self._sums[name] = self._sums.get(name, 0.0) + value * weight
            self._weights[name] = self._weights.get(name, 0.0) + weight

    def Means(self) -> dict:
        return {k: (self._sums[k] / self._weights[k] if self._weights[k] else 0.0)
                for k in self._sums}


class EagerProgram:
    """Training in a `tf.function` (eager outer loop)."""

    def __init__(self, task_params, logdir: str):
        self.task_params = task_params
        self.logdir = logdir
        self.task = task_params.Instantiate()
        train = task_params.train
        self.global_step = tf.Variable(0, dtype=tf.int64, trainable=False, name='global_step')
        self._learning_rate = update.LearningRateFn(train, self.global_step)
        self.optimizer = train.optimizer.Instantiate().Create(self._learning_rate)
        self.loss_scale = update.LossScaleFor(self.task)
        self.checkpoint = tf.train.Checkpoint(task=self.task, optimizer=self.optimizer,
                                              global_step=self.global_step,
                                              **_LossScaleEntry(self.loss_scale))
        self.manager = tf.train.CheckpointManager(
            self.checkpoint, CheckpointDir(logdir), max_to_keep=train.save_max_to_keep)
        self._iterator = None
        self._train_step = tf.function(self._TrainStep, autograph=False)
        self._eval_step = tf.function(self._EvalStep, autograph=False)

    def Restore(self, training: bool = True, path: str | None = None) -> int:
        """Restores checkpoint `path` (default: the latest, if any); returns the step training
        resumes at. With `training` False (eval, decode) the optimizer's slots are not needed.

        Raises:
          CheckpointMismatchError: if the checkpoint holds other variables than the model's.
        """
        path = path or self.manager.latest_checkpoint
        if path:
            status = _RestoreMatched(self.checkpoint, path)
            if not training:
                status.expect_partial()
        step = int(self.global_step.numpy())
        dataset = self.task_params.input.Instantiate().TrainDataset(start_step=step)
        self._iterator = iter(self._Distribute(dataset))
        return step

    def _Distribute(self, dataset):
        """The dataset as the step takes it (a strategy's program splits it over replicas)."""
        return dataset

    def _FirstExample(self):
        """The index in the global batch of this replica's first example (the layers draw
        their randomness per example): 0 for one program on the whole batch."""
        return 0

    def _TrainMetrics(self, batch):
        """One update; returns its metrics as (value, weight) pairs."""
        step_scale = self.loss_scale.ForStep() if self.loss_scale else None
        with tf.GradientTape() as tape:
            with fprop_context.Scope(training=True, step=self.global_step,
                                     first_example=self._FirstExample(),
                                     loss_scale=step_scale and step_scale.value):
                metrics = self.task.FPropTower(batch)
            _, metrics = update.Update(
                self.task, self.optimizer, self.global_step, metrics,
                lambda loss, variables: tape.gradient(loss, variables), step_scale)
        return metrics

    def _TrainStep(self, batch):
        return {k: v[0] for k, v in self._TrainMetrics(batch).items()}

    def Step(self) -> dict:
        """Runs one training step; returns its metrics as floats."""
        return _Floats(self._train_step(next(self._iterator)))

    def TracedStep(self) -> tuple[dict, StepTrace]:
        """Runs `Step()` under TensorFlow's profiler: the same step on the same batch, so the
        training is unchanged. Profiler failures go into the StepTrace, never raised."""
        logdir = tempfile.mkdtemp(prefix='gpipe_step_trace_')
        try:
            tf.profiler.experimental.start(logdir)
        except Exception as error:  # pylint: disable=broad-except
            # E.g. another profiler session is running: the step runs untraced.
            shutil.rmtree(logdir, ignore_errors=True)
            return self.Step(), StepTrace(error=error)
        try:
            metrics = self.Step()
        finally:
            step_trace = _StopProfiler(logdir)
        return metrics, step_trace

    def _EvalStep(self, batch):
        with fprop_context.Scope(training=False, step=self.global_step):
            return dict(self.task.FPropTower(batch))

    def Evaluate(self, input_params) -> dict:
        """Weighted means of the task's metrics over one pass of `input_params`' data."""
        sums = MetricSums()
        for batch in self._Distribute(input_params.Instantiate().EvalDataset()):
            sums.Add(self._eval_step(batch))
        return sums.Means()

    def LearningRate(self) -> float:
        return float(self._learning_rate())

    def CurrentStep(self) -> int:
        return int(self.global_step.numpy())

    def Save(self) -> str:
        with _WritingCheckpoint(self.manager.directory, self.CurrentStep()):
            return self.manager.save(checkpoint_number=self.global_step)


class StrategyProgram(EagerProgram):
    """Training in a `tf.function` run by a `tf.distribute.Strategy`: R replicas, each running
    the whole pipeline on 1/R of every batch, their gradients combined into the whole batch's
    (`update.GlobalBatchGradients`) before the one update; metrics are the whole batch's.

    The trainer's TPU path: a `TPUStrategy` whose replicas have K logical devices each, the
    pipeline's cells placed on them by `PipeliningLayer.Params().logical_device_fn`
    (`gpipe_tf.train.tpu`). Any other strategy runs the same program (a MirroredStrategy over
    CPUs in the tests).
    """

    def __init__(self, task_params, logdir: str, strategy):
        """Builds the task, optimizer and checkpoint under `strategy`'s scope.

        Raises:
          ValueError: if the batch does not split evenly over the strategy's replicas.
        """
        replicas = strategy.num_replicas_in_sync
        batch = task_params.input.batch_size
        if batch % replicas:
            raise ValueError(f'Batch size {batch} does not split over {replicas} replicas.')
        self.strategy = strategy
        with strategy.scope():
            super().__init__(task_params, logdir)

    def _Distribute(self, dataset):
        return self.strategy.experimental_distribute_dataset(dataset)

    def _FirstExample(self):
        # The distributed dataset gives replica r the r-th slice of every global batch, so
        # its examples' indices start at r B / R: dropout masks are those of one program.
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        shard = self.task_params.input.batch_size // self.strategy.num_replicas_in_sync
        return tf.cast(replica, tf.int64) * shard

    def Restore(self, training: bool = True, path: str | None = None) -> int:
        # Restored optimizer slots are created when first used, and must be the strategy's.
        with self.strategy.scope():
            return super().Restore(training, path)

    def Step(self) -> dict:
        with self.strategy.scope():
            return super().Step()

    def _WeightedMeans(self, fn, batch) -> dict:
        """Per metric of `fn`'s (value, weight) metrics on every replica's shard: (the mean over
        the replicas weighted by their weights, the total weight), in one `strategy.run`."""

        def Replica(shard):
            return {name: (tf.cast(value, tf.float32) * tf.cast(weight, tf.float32),
                           tf.cast(weight, tf.float32))
                    for name, (value, weight) in fn(shard).items()}

        sums = self.strategy.run(Replica, args=(batch,))
        means = {}
        for name, (weighted, weight) in sums.items():
            total = self.strategy.reduce(tf.distribute.ReduceOp.SUM, weight, axis=None)
            weighted = self.strategy.reduce(tf.distribute.ReduceOp.SUM, weighted, axis=None)
            means[name] = (tf.math.divide_no_nan(weighted, total), total)
        return means

    def _TrainStep(self, batch):
        return {k: v for k, (v, _) in self._WeightedMeans(self._TrainMetrics, batch).items()}

    def _EvalStep(self, batch):
        return self._WeightedMeans(super()._EvalStep, batch)


class GraphProgram:
    """Training in a tf.compat.v1 graph run by a Session (`--graph_mode=v1`)."""

    def __init__(self, task_params, logdir: str, session_config=None, cluster=None,
                 job: str = 'worker'):
        """Args:
          session_config: the Session's ConfigProto (with a cluster: an operation timeout).
          cluster: a tf.train.ClusterSpec whose task 0 of `job` runs the graph (cells are placed
            on its tasks by the pipeline's devices), or None for a local Session. A step the
            cluster cannot finish raises `cluster.ClusterError` naming the unreachable task.
        """
        self.task_params = task_params
        self.logdir = logdir
        self.graph = tf.Graph()
        self._session_config = session_config
        self._cluster, self._job = cluster, job
        self._eval_graphs = {}
        with self.graph.as_default():
            # Op determinism requires a graph seed; gpipe_tf's randomness is stateless, seeded
            # from Params, so the value does not matter.
            tf.compat.v1.set_random_seed(0)
            self.task = task_params.Instantiate()
            train = task_params.train
            self.global_step = tf.Variable(0, dtype=tf.int64, trainable=False,
                                           name='global_step')
            self._learning_rate = update.LearningRateFn(train, self.global_step)()
            self.optimizer = train.optimizer.Instantiate().Create(self._learning_rate)
            self.loss_scale = update.LossScaleFor(self.task)
            self.checkpoint = tf.compat.v1.train.Checkpoint(
                task=self.task, optimizer=self.optimizer, global_step=self.global_step,
                **_LossScaleEntry(self.loss_scale))
            self._start_step = LatestStep(logdir)
            dataset = task_params.input.Instantiate().TrainDataset(start_step=self._start_step)
            batch = tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()
            step_scale = self.loss_scale.ForStep() if self.loss_scale else None
            with fprop_context.Scope(training=True, step=self.global_step,
                                     loss_scale=step_scale and step_scale.value):
                metrics = self.task.FPropTower(NestedMap(batch))
            train_op, metrics = update.Update(
                self.task, self.optimizer, self.global_step, metrics,
                # No colocate_gradients_with_ops: the pipeline's custom gradient places each
                # cell's backward on its device, and colocating with the one gradient op of
                # the whole pipeline would contradict that.
                lambda loss, variables: tf.compat.v1.gradients(loss, variables), step_scale)
            updates = tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)
            self._train_op = tf.group([train_op] + updates)
            self._metrics = {k: v[0] for k, v in metrics.items()}
            self._eval_metrics = None
            target = cluster_lib.Target(cluster, job) if cluster else ''
            self.session = tf.compat.v1.Session(target, graph=self.graph, config=session_config)
            self.manager = tf.train.CheckpointManager(
                self.checkpoint, CheckpointDir(logdir), max_to_keep=train.save_max_to_keep)

    @contextlib.contextmanager
    def _Guard(self):
        """Turns a cluster's failed or timed-out run into a ClusterError naming the task."""
        try:
            yield
        except CLUSTER_FAILURES as error:
            if self._cluster is None:
                raise
            raise cluster_lib.UnreachableError(self._cluster, error, self._job) from error

    def Restore(self, training: bool = True, path: str | None = None) -> int:
        """As `EagerProgram.Restore`; the graph holds every variable, so the checkpoint
        restores them all, optimizer slots included."""
        with self._Guard(), self.graph.as_default(), self.session.as_default():
            path = path or self.manager.latest_checkpoint
            if path:
                _RestoreMatched(self.checkpoint, path).run_restore_ops(self.session)
                # Slot and other variables the checkpoint does not hold start from their
                # initialisers.
                self.session.run(tf.compat.v1.variables_initializer(
                    [v for v in tf.compat.v1.global_variables()
                     if not self.session.run(tf.compat.v1.is_variable_initialized(v))]))
                _CheckRestoredShapes(self.session, path)
            else:
                self.session.run(tf.compat.v1.global_variables_initializer())
            step = int(self.session.run(self.global_step))
        if training and step != self._start_step:
            raise RuntimeError(f'Checkpoint step {step} differs from the step the input was '
                               f'built for ({self._start_step}).')
        return step

    def Step(self) -> dict:
        with self._Guard():
            metrics, _ = self.session.run([self._metrics, self._train_op])
        return _Floats(metrics)

    def TracedStep(self) -> tuple[dict, StepTrace]:
        """Runs `Step()` with a full trace (`RunOptions.FULL_TRACE`), which times the ops
        without changing what they compute."""
        with self._Guard():
            (metrics, _), events = trace.TraceSessionRun(
                self.session, [self._metrics, self._train_op])
        return _Floats(metrics), StepTrace(events=events)

    def Evaluate(self, input_params) -> dict:
        with self._Guard():
            return self._Evaluate(input_params)

    def _Evaluate(self, input_params) -> dict:
        key = input_params.ToText()
        with self.graph.as_default():
            if key not in self._eval_graphs:
                dataset = input_params.Instantiate().EvalDataset()
                iterator = tf.compat.v1.data.make_initializable_iterator(dataset)
                with fprop_context.Scope(training=False, step=self.global_step):
                    metrics = self.task.FPropTower(NestedMap(iterator.get_next()))
                self._eval_graphs[key] = (iterator.initializer, dict(metrics))
        initializer, metrics = self._eval_graphs[key]
        self.session.run(initializer)
        sums = MetricSums()
        while True:
            try:
                sums.Add(self.session.run(metrics))
            except tf.errors.OutOfRangeError:
                return sums.Means()

    def LearningRate(self) -> float:
        with self._Guard():
            return float(self.session.run(self._learning_rate))

    def CurrentStep(self) -> int:
        with self._Guard():
            return int(self.session.run(self.global_step))

    def Save(self) -> str:
        with self._Guard(), self.graph.as_default(), self.session.as_default():
            step = self.CurrentStep()
            with _WritingCheckpoint(self.manager.directory, step, self._cluster, self._job):
                return self.manager.save(checkpoint_number=step)
