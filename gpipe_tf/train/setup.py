"""A run's set-up, step by step, before its mode runs: the task Params of the command line,
where the steps run (`Target`, resolved once), the plan checked before anything is built, the
devices, the time partition, and the program that trains on them.

Each function takes the trainer's `Config` (`gpipe_tf.trainer`) as `config`.
"""

from __future__ import annotations

import dataclasses
import os
import re

import tensorflow as tf

from gpipe_tf import errors
from gpipe_tf import model_registry
from gpipe_tf import overrides
from gpipe_tf.layers import precision
from gpipe_tf.perf import measured_costs
from gpipe_tf.pipeline import devices as devices_lib
from gpipe_tf.pipeline import pipelining_layer
from gpipe_tf.pipeline import plan as plan_lib
from gpipe_tf.tasks import base_task
from gpipe_tf.train import cluster as cluster_lib
from gpipe_tf.train import logdir as logdir_lib
from gpipe_tf.train import program
from gpipe_tf.train import tpu


def TaskParams(config, dataset: str = 'Train'):
    """The task Params of `config.model` with the command line's overrides applied.

    Raises:
      errors.ConfigError: for an override or flag that the Params refuse.
    """
    try:
        return _TaskParams(config, dataset)
    except errors.ConfigError:
        raise
    except (ValueError, FileNotFoundError) as error:
        # The Params name the field and the value; what is wrong is the command line's.
        raise errors.ConfigError(str(error)) from None


def _TaskParams(config, dataset: str):
    model = config.model
    try:
        p = model_registry.GetParams(model, dataset)
    except LookupError as error:  # An unknown model or dataset: the registry names the close ones.
        # In the command line's words: the registry's ListModels() is --list_models here.
        message = str(error).strip("'\"").replace('ListModels()', '--list_models')
        raise errors.ConfigError(f'--model={model}: {message}') from None
    if config.model_params_file_override:
        path = config.model_params_file_override
        text = ReadTextFile('--model_params_file_override', path, 'Params text')
        overrides.Apply(p, text, f'--model_params_file_override={path}')
    if config.model_params_override:
        lines = [line.strip() for line in config.model_params_override.split(';')]
        overrides.Apply(p, '\n'.join(line for line in lines if line), '--model_params_override')
    if 'model' not in p or 'train' not in p:
        raise ValueError(f'{model}: the trainer needs task Params (gpipe_tf.tasks) with `model` '
                         f'and `train`; got {p.cls.__name__}.')
    for flag, key in (('worker_split_size', 'model.num_cells'),
                      ('num_micro_batches', 'model.num_micro_batches'),
                      ('schedule', 'model.schedule'),
                      ('virtual_stages', 'model.virtual_stages'),
                      ('worker_replicas', 'model.num_replicas'),
                      ('max_steps', 'train.max_steps')):
        value = getattr(config, flag)
        if value is None:
            continue
        if key.startswith('model.') and key[len('model.'):] not in p.model:
            raise ValueError(f'--{flag}: the model of {model} '
                             f'({p.model.cls.__name__}) is not a PipeliningLayer.')
        try:
            p.Set(**{key: value})  # The field's own check names it: `must be >= 1, got 0`.
        except ValueError as error:
            raise ValueError(f'--{flag}: {error}') from None
    if config.fprop_dtype is not None:
        if 'fprop_dtype' not in p.model:
            raise ValueError(f'--fprop_dtype: the model of {model} ({p.model.cls.__name__}) '
                             'has no fprop_dtype (it is not a gpipe_tf layer).')
        p.model.fprop_dtype = precision.FPROP_DTYPES[config.fprop_dtype]
    if config.data_dir is not None:
        if 'data_dir' not in p.input:
            raise ValueError(f'--data_dir: the input of {model} ({p.input.cls.__name__}) reads '
                             'no data directory.')
        p.input.data_dir = config.data_dir
    if config.seed is not None:
        p.random_seed = config.seed
        p.model.random_seed = config.seed
        p.input.seed = config.seed
    return base_task.SyncInputShapes(p)


def ReadTextFile(flag: str, path: str, expected: str) -> str:
    """The text of the UTF-8 file `path` that the command line's `flag` names, local or on a
    filesystem TensorFlow reaches by URL (`gs://...`, where `--mode=tune` writes
    tuned_params.txt beside a remote logdir); `expected` says what the file holds, for the
    errors.

    Raises:
      errors.MissingInputError: when there is no file at `path`.
      errors.InputError: for a directory, a file that cannot be read, or one that is not UTF-8
        text; each names the flag and the path.
    """
    if tf.io.gfile.isdir(path):
        raise errors.InputError(f'{flag}={path} is a directory; expected a file of {expected}.')
    if not tf.io.gfile.exists(path):
        raise errors.MissingInputError(f'{flag}={path}: no such file; expected a file of '
                                       f'{expected}.')
    try:
        with tf.io.gfile.GFile(path, 'rb') as f:
            data = f.read()
    except tf.errors.OpError as error:
        raise errors.InputError(f'{flag}={path}: cannot read it ({error.message}).') from None
    try:
        text = data.decode('utf-8')
    except UnicodeDecodeError as error:
        line = data.count(b'\n', 0, error.start) + 1
        raise errors.InputError(
            f'{flag}={path} is not UTF-8 text (byte {data[error.start]:#04x} on line {line}, '
            f'offset {error.start}); expected a UTF-8 file of {expected}.') from None
    return text.replace('\r\n', '\n').replace('\r', '\n')  # As open() in text mode reads it.


@dataclasses.dataclass(frozen=True)
class Target:
    """Where a run's steps run, resolved once from the command line and handed on."""
    cluster: tf.train.ClusterSpec | None  # --cluster_spec (or TF_CONFIG); None: this machine.
    tpu: str | None  # --tpu's address, 'local' for --run_locally=tpu; None without a TPU.
    graph_mode: str  # --graph_mode, except that a cluster always runs the v1 graph path.

    @classmethod
    def Of(cls, config) -> Target:
        """Raises errors.ConfigError (a UserError) for a cluster spec that does not
        parse."""
        cluster = _Cluster(config.cluster_spec)
        tpu_address = config.tpu
        if tpu_address is None and config.run_locally == 'tpu':
            tpu_address = 'local'
        return cls(cluster=cluster, tpu=tpu_address,
                   graph_mode='v1' if cluster is not None else config.graph_mode)


def _Cluster(text: str | None):
    """The cluster of --cluster_spec `text` (Lingvo's form or TF_CONFIG JSON), else of the
    TF_CONFIG environment variable; None for neither. Raises errors.ConfigError naming the
    one that does not parse."""
    if text is None and os.environ.get('TF_CONFIG'):
        return cluster_lib.FromTfConfig(os.environ['TF_CONFIG'],
                                        'The TF_CONFIG environment variable')
    if text is None:
        return None
    if text.lstrip().startswith('{'):
        return cluster_lib.FromTfConfig(text, '--cluster_spec (TF_CONFIG JSON)')
    return cluster_lib.ParseClusterSpec(text)


def CheckPlan(p, config=None):
    """The plan of task Params `p`'s pipeline, not yet placed (None for a model that is not
    one): making it checks, before anything is built or written, K against the layers (and the
    cells' shapes), and the batch against R replicas and M micro-batches. It is the run's plan
    (reports and --mode=check read it; the pipeline that `Program` builds makes its own from
    the same Params), unless the partition is measured (`PartitionOnTime` then makes the run's
    plan; this one checks on a uniform partition).

    Raises:
      errors.ConfigError: naming the values that would work and, where `config` (the
        trainer's) set the value at fault, its flag.
    """
    model = p.model
    if not pipelining_layer.IsPipeline(model):
        return None
    batch, replicas = p.input.batch_size, model.num_replicas
    if batch % replicas:
        raise errors.ConfigError(f'--worker_replicas={replicas}: the batch of {batch} examples '
                                 f'does not split into {replicas} equal replicas.')
    per_replica = batch // replicas
    try:
        plan_lib.NumMicroBatches(model, batch)
    except errors.ConfigError as error:
        divisors = [m for m in range(1, per_replica + 1) if per_replica % m == 0]
        raise errors.ConfigError(f'--num_micro_batches: {error} M must divide the '
                                 f'{per_replica} examples of a replica: one of {divisors}.'
                                 ) from None
    if model.partition_method == 'time':
        # Measuring would start TensorFlow's devices before they are set up; the counts and
        # shapes check alike on any partition (`PartitionOnTime` then measures).
        model = model.Copy().Set(partition_method='uniform')
    try:
        return plan_lib.MakePlan(model, place=False)  # K > layers, cells that do not chain.
    except errors.ConfigError as error:
        flags = _CellFlags(str(error), model, config)
        if flags:  # In the command line's words.
            raise errors.ConfigError(f'{flags}: {error}') from None
        raise


def _CellFlags(message: str, model, config) -> str:
    """The flags of `config` that set what plan error `message` is about, when it is about
    the number of cells (`num_cells (9) is larger ...`, `num_cells x virtual_stages (4 x 3)
    ...`): --worker_split_size for K, --virtual_stages for v, where given; '' for none (a
    Params override or the model's own value set them, or the error is about another field)."""
    subject = re.match(r'(num_cells(?: x virtual_stages)?)\b', message)
    if config is None or subject is None:
        return ''
    named = [f'--{flag}={getattr(model, key)}' for flag, key in
             (('worker_split_size', 'num_cells'), ('virtual_stages', 'virtual_stages'))
             if key in subject.group(1) and getattr(config, flag) is not None]
    return ' '.join(named)


def CheckDataDir(p) -> None:
    """A local data directory the input reads must exist (else the run would fail after
    building the model)."""
    path = p.input.data_dir if 'data_dir' in p.input else None
    if path and logdir_lib.IsLocalPath(path) and not os.path.isdir(path):
        raise errors.ConfigError(f'--data_dir: {path} is not a directory; '
                                 f'{p.input.cls.__name__} reads its files there.')


def SetUpDevices(config, target: Target, p, plan, plan_only: bool = False) -> None:
    """Asks `devices` for the run's devices (set up unless `plan_only`: `inspect_model` builds
    nothing, so K may exceed the devices present) and puts them in the pipeline's Params, unless
    the Params name their own."""
    request = devices_lib.Request(
        run_locally=config.run_locally, num_devices=config.num_devices,
        cluster=target.cluster, cluster_job=config.cluster_job, tpu=target.tpu is not None)
    devices = devices_lib.StageDeviceList(request, plan.num_devices if plan else 1,
                                          plan.num_replicas if plan else 1, plan_only)
    if plan is None or (request.tpu and not plan_only):
        # A TPU run places its cells through the strategy instead (`TpuProgram`).
        return
    if not p.model.devices:  # The Params' own placement wins; the plan checks it exists.
        p.model.devices = devices
        if p.model.round_robin is None:
            # Fewer devices than stages (--num_devices): the run asked to share them.
            p.model.round_robin = True


def PartitionsOnTime(p) -> bool:
    """Whether task Params `p`'s model is a pipeline partitioned on measured time, whose layer
    costs `PartitionOnTime` measures (and caches in the logdir unless costs_file says where)."""
    return pipelining_layer.IsPipeline(p.model) and p.model.partition_method == 'time'


def PartitionOnTime(p, logdir: str):
    """partition_method="time": measures the layers on the devices just set up (cached in
    `<logdir>/layer_costs.json`, so a restart finds the same cells without measuring again)
    and sets the boundaries they give, which params.txt then records. Returns the run's plan,
    not yet placed: its cells are those boundaries' (None for a model that is not a pipeline
    partitioned on time)."""
    model = p.model
    if not PartitionsOnTime(p):
        return None
    if model.costs_file is None:
        model.costs_file = os.path.join(logdir, measured_costs.COSTS_FILE)
    print(f'measuring the layers of {model.name} for partition_method="time" (cached in '
          f'{model.costs_file})', flush=True)
    bounds = measured_costs.TimedBoundaries(model)
    model.partition_method = bounds
    print(f'partition on measured time: boundaries {bounds}', flush=True)
    return plan_lib.MakePlan(model, place=False)


def WarnIfClusterIsExposed(cluster) -> None:
    """Once per run: the exposure of `cluster` (a tf.train.ClusterSpec or None) when its
    tasks are not all on this machine's loopback (the launcher's own clusters are)."""
    if cluster is None:
        return
    addresses = [a for job in cluster.jobs for a in cluster.job_tasks(job)]
    exposed = [a for a in addresses
               if a.rpartition(':')[0] not in ('127.0.0.1', 'localhost', '[::1]', '::1')]
    if exposed:
        errors.Warn(f'the cluster\'s tf.distribute.Server tasks ({", ".join(exposed)}) run any '
                    'op that any host reaching their ports sends, without authentication: '
                    'firewall them to the cluster\'s hosts (docs/reliability.md, "Security '
                    'model of the worker servers").')


def Program(config, target: Target, p, plan, logdir: str):
    """The training program for `target`: a StrategyProgram on a TPU, a GraphProgram (v1
    Session) on a cluster or for --graph_mode=v1, else an EagerProgram (tf.function). Its
    pipeline makes its own plan from `p.model` (equal to `plan`, the run's: `CheckPlan`)."""
    cluster = target.cluster
    if target.tpu is not None:
        if cluster is not None:
            raise errors.UserError('--tpu (or --run_locally=tpu) and --cluster_spec: give one; '
                                   'a TPU brings its own workers.')
        if config.graph_mode == 'v1':
            raise errors.UserError(
                '--tpu runs the tf_function path (a TPUStrategy). The v1 TPU path is '
                'library-level: build the step inside tf.compat.v1.tpu.rewrite with '
                'PipeliningLayer devices=gpipe_tf.train.tpu.CoreDevices(K) '
                '(docs/accelerators.md, "The v1 graph path").')
        tf.config.experimental.enable_op_determinism()
        return TpuProgram(config, target, p, plan, logdir)
    tf.config.experimental.enable_op_determinism()
    if cluster is not None:
        if config.graph_mode_given and config.graph_mode != 'v1':
            raise errors.UserError('--cluster_spec runs the v1 graph path (a Session with an '
                                   'operation timeout: TF2 remote eager hangs on a stopped '
                                   f'worker); drop --graph_mode={config.graph_mode}.')
        return program.GraphProgram(p, logdir, cluster_lib.SessionConfig(config.cluster_timeout_s),
                                    cluster=cluster, job=config.cluster_job)
    if config.graph_mode == 'v1':
        return program.GraphProgram(p, logdir)
    return program.EagerProgram(p, logdir)


def TpuProgram(config, target: Target, p, plan, logdir: str):
    """A StrategyProgram on the TPU at `target.tpu`: R replicas of K logical devices, each cell's
    variables and ops on its device's (`Plan.DeviceOf`: cell k on k % K with v virtual
    stages). Raises tpu.TpuError when there is no usable TPU."""
    num_devices = plan.num_devices if plan else 1
    resolver, topology = tpu.Connect(target.tpu, config.tpu_timeout_s)
    strategy = tpu.Strategy(resolver, topology, num_devices, p.model.num_replicas)
    # The replicas are the strategy's. Within one, a cell's variables are created on its
    # logical device, its ops run under that core's device scope, and the tensors crossing its
    # boundary carry that logical device's sharding.
    p.model.Set(num_replicas=1, devices=tpu.CoreDevices(num_devices),
                logical_device_fn=tpu.AssignToLogicalDevice)
    logdir_lib.WriteParams(p.ToText(), logdir)  # What runs: the replicas are now the strategy's.
    return program.StrategyProgram(p, logdir, strategy)
