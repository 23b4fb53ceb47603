r"""The gpipe_tf trainer: `python -m gpipe_tf.trainer --model=<registry key> ...`
(also installed as `gpipe-train`).

    gpipe-train --model=image.amoebanet.AmoebaNetD_Small --logdir=/tmp/amoeba \
        --run_locally=cpu --num_devices=4 --mode=train_and_eval

Modes: `train`, `eval` (the latest checkpoint on `task.train.eval_dataset`), `train_and_eval`,
`inspect_params` (prints the Params text and writes `<logdir>/params.txt`), `inspect_model`
(from Params alone, building nothing: the partition table, per cell its layers, device, FLOPs,
parameters and estimated activation memory, then the memory plan per device; with `--plot_dir`
also the plan pictures as PNGs), `decode` (classify image files / translate sentences, given
with `--decode_input` or in a file with `--decode_input_file`), and `export` (the latest
checkpoint as a SavedModel in `<logdir>/export/<step>`, TensorFlow Serving's layout; see
`gpipe_tf.train.export`).
Restarting with the same `--logdir` resumes from the newest checkpoint that restores (a damaged
one is skipped with a warning); a second trainer on the same logdir is refused while the first
runs. A user's mistake is one line `error: ...` on stderr and exit status 2.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import tempfile
import time
import traceback

from absl import app
from absl import flags

from gpipe_tf import errors
from gpipe_tf.pipeline import devices as devices_lib
from gpipe_tf.pipeline import schedule as schedule_lib
from gpipe_tf.train import logdir as logdir_lib
from gpipe_tf.train import partition_change

MODES = ('train', 'eval', 'train_and_eval', 'inspect_params', 'inspect_model', 'decode',
         'export', 'tune', 'check')


def DefineFlags(flag_values: flags.FlagValues) -> None:
    """Defines the trainer's flags on `flag_values` (the process's FLAGS, or a test's own)."""
    flags.DEFINE_string('model', None, 'Registry key of the model, e.g. '
                        'image.amoebanet.AmoebaNetD_Small (see --list_models).',
                        flag_values=flag_values)
    flags.DEFINE_bool('list_models', False, 'Print the registered models and exit.',
                      flag_values=flag_values)
    flags.DEFINE_string('logdir', None, 'Checkpoints, summaries and params.txt go here '
                        '(default: <tmp>/gpipe_tf-<user>/<model>, private to the user).',
                        flag_values=flag_values)
    flags.DEFINE_bool('start_from_scratch', False, 'Start at step 0 although <logdir>/train holds '
                      'checkpoint files, none of which restores (they are moved to train/damaged/, '
                      'not deleted). Refused while a checkpoint restores.', flag_values=flag_values)
    flags.DEFINE_enum('mode', 'train', MODES, 'What to do.', flag_values=flag_values)
    flags.DEFINE_integer('max_steps', None, 'Train until this global step (default: the '
                         'model\'s train.max_steps).', flag_values=flag_values)
    flags.DEFINE_string('model_params_override', None, 'Params text applied to the task Params, '
                        'lines separated by ";", e.g. "train.learning_rate : 0.01; input.seed : 3".',
                        flag_values=flag_values)
    flags.DEFINE_string('model_params_file_override', None, 'A file of Params text applied to the '
                        'task Params (before --model_params_override).', flag_values=flag_values)
    flags.DEFINE_enum('run_locally', 'cpu', list(devices_lib.RUN_LOCALLY), 'Local devices: cpu '
                      '(--num_devices virtual CPUs), gpu (the GPUs present; the partition report '
                      'shows each cell\'s planned memory against each GPU\'s free memory) or tpu '
                      '(this Cloud TPU VM\'s TPU, as --tpu=local).', flag_values=flag_values)
    flags.DEFINE_integer('num_devices', None, 'Devices to use (default: one per stage of every '
                         'replica, R x K).', flag_values=flag_values)
    flags.DEFINE_integer('worker_split_size', None, 'Override K, the number of cells.',
                         flag_values=flag_values)
    flags.DEFINE_integer('num_micro_batches', None, 'Override M, the number of micro-batches.',
                         flag_values=flag_values)
    flags.DEFINE_enum('schedule', None, list(schedule_lib.KINDS), 'Override the pipeline '
                      'schedule: gpipe (fill-drain), 1f1b (at most K micro-batches\' activations '
                      'stored), interleaved_1f1b (with --virtual_stages), zero_bubble (ZB-H1), '
                      'zero_bubble_v (ZB-V, with --virtual_stages=2).',
                      flag_values=flag_values)
    flags.DEFINE_integer('virtual_stages', None, 'Override v, cells per device '
                         '(interleaved_1f1b; 2 for zero_bubble_v): the layers are split into '
                         'v x K cells.',
                         flag_values=flag_values)
    flags.DEFINE_integer('worker_replicas', None, 'Override R, the replicas of the pipeline (data '
                         'parallelism: each runs on 1/R of the batch; gradients are summed).',
                         flag_values=flag_values)
    flags.DEFINE_enum('fprop_dtype', None, ['bfloat16', 'float16', 'float32'],
                      'Mixed precision: the dtype the model computes in (its Params\' '
                      'fprop_dtype); variables stay float32 and the loss is computed in '
                      'float32. float16 adds dynamic loss scaling (train.loss_scale). Default: '
                      'the Params\'.', flag_values=flag_values)
    flags.DEFINE_enum('graph_mode', 'tf_function', ['tf_function', 'v1'], 'Run the training step '
                      'in a tf.function, or in a tf.compat.v1 graph with a Session.',
                      flag_values=flag_values)
    flags.DEFINE_string('cluster_spec', None, 'Run the stages on a TF cluster: Lingvo\'s form '
                        '"worker=host:port,host:port" (jobs separated by @) or TF_CONFIG JSON; also '
                        'read from the TF_CONFIG environment variable. Stage k of replica r runs on '
                        'task r*K+k of --cluster_job; the step runs in a v1 Session on task 0.',
                        flag_values=flag_values)
    flags.DEFINE_string('cluster_job', 'worker', 'The cluster job whose tasks run the stages.',
                        flag_values=flag_values)
    flags.DEFINE_float('cluster_timeout_s', 60.0, 'A step (any Session.run) the cluster does not '
                       'finish in this many seconds fails, naming the unreachable task.',
                       flag_values=flag_values)
    flags.DEFINE_string('tpu', None, 'Train on a Cloud TPU: "local" on a TPU VM, the TPU\'s name, '
                        'or grpc://<ip>:8470 of a TPU node. A tf.distribute.TPUStrategy runs R '
                        'replicas (--worker_replicas), each with its K cells on K logical devices; '
                        'the tf_function path only.', flag_values=flag_values)
    flags.DEFINE_float('tpu_timeout_s', 600.0, 'Connecting to and initializing the TPU may take this '
                       'many seconds before it counts as unreachable.', flag_values=flag_values)
    flags.DEFINE_string('data_dir', None, 'Directory of the dataset\'s files, for inputs that '
                        'read one (Fashion-MNIST\'s IDX files; default: the input Params\').',
                        flag_values=flag_values)
    flags.DEFINE_string('plot_dir', None, 'inspect_model: also write the plan pictures here: '
                        'cell_costs.png, timeline_predicted.png and memory.png.',
                        flag_values=flag_values)
    flags.DEFINE_float('device_memory_gib', None, 'inspect_model, tune: an accelerator\'s memory '
                       'in GiB (2**30 bytes); the memory plan says which cells fit, memory.png '
                       'draws it as a line, and tune fits every device in it.',
                       flag_values=flag_values)
    flags.DEFINE_enum('tune_costs', 'auto', ['auto', 'measured', 'flops'], 'tune: the layer '
                      'costs to predict steps from: measured on the first device, FLOPs, or auto '
                      '(measured where the model fits in half this machine\'s memory).',
                      flag_values=flag_values)
    flags.DEFINE_integer('tune_steps', 5, 'tune: train the chosen configuration this many steps '
                         'and print its measured step and memory beside the prediction '
                         '(measured costs only; 0: do not run it).', flag_values=flag_values)
    flags.DEFINE_float('device_memory_gb', None, 'Deprecated (until 0.2): the old name of '
                       '--device_memory_gib; it always meant GiB.', flag_values=flag_values)
    flags.register_multi_flags_validator(
        ['device_memory_gib', 'device_memory_gb'],
        lambda values: values['device_memory_gib'] is None or values['device_memory_gb'] is None,
        message='--device_memory_gb is the old name of --device_memory_gib: give one of them.',
        flag_values=flag_values)
    flags.DEFINE_integer('seed', None, 'Seed of initialisation and data order (default: Params).',
                         flag_values=flag_values)
    flags.DEFINE_list('decode_input', [], 'decode mode: image files, or sentences to translate.',
                      flag_values=flag_values)
    flags.DEFINE_string('decode_input_file', None, 'decode mode: a file with one image path or '
                        'one sentence per line.', flag_values=flag_values)
    flags.DEFINE_string('target_language', None, 'decode mode, translation: language to '
                        'translate into (e.g. de).', flag_values=flag_values)
    flags.DEFINE_bool('export_on_one_device', False, 'export mode: every cell on the first '
                      'device (a server with one accelerator); by default each cell keeps its '
                      'own device.', flag_values=flag_values)
    flags.DEFINE_bool('verbose', default=False,
                      help='Show TensorFlow\'s own log lines and, for an error, its traceback.',
                      flag_values=flag_values)


FLAGS = flags.FLAGS
DefineFlags(FLAGS)


@dataclasses.dataclass(frozen=True)
class Config:
    """The trainer's command line as values: `main` reads the flags once, into one of these, and
    passes it down; tests build one with `ParseConfig` and call `Main` in process."""
    model: str | None
    list_models: bool
    logdir: str | None
    start_from_scratch: bool
    mode: str
    max_steps: int | None
    model_params_override: str | None
    model_params_file_override: str | None
    run_locally: str
    num_devices: int | None
    worker_split_size: int | None
    num_micro_batches: int | None
    schedule: str | None
    virtual_stages: int | None
    worker_replicas: int | None
    fprop_dtype: str | None
    graph_mode: str
    graph_mode_given: bool  # --graph_mode was on the command line (a cluster refuses tf_function).
    cluster_spec: str | None
    cluster_job: str
    cluster_timeout_s: float
    tpu: str | None
    tpu_timeout_s: float
    data_dir: str | None
    plot_dir: str | None
    device_memory_gib: float | None
    tune_costs: str
    tune_steps: int
    seed: int | None
    decode_input: tuple[str, ...]
    decode_input_file: str | None
    target_language: str | None
    export_on_one_device: bool
    verbose: bool

    @classmethod
    def FromFlags(cls, flag_values: flags.FlagValues) -> Config:
        values = {f.name: flag_values[f.name].value for f in dataclasses.fields(cls)
                  if f.name in flag_values}
        values['decode_input'] = tuple(values['decode_input'])
        if flag_values['device_memory_gb'].value is not None:
            print('warning: --device_memory_gb is deprecated: use --device_memory_gib (the same '
                  'value; it always meant GiB).', file=sys.stderr, flush=True)
            values['device_memory_gib'] = flag_values['device_memory_gb'].value
        return cls(graph_mode_given=flag_values['graph_mode'].present, **values)


def ParseConfig(argv: list[str]) -> Config:
    """The Config of trainer flags `argv` (e.g. ['--model=examples.PipelinedMLP']), parsed on a
    FlagValues of its own: the process's FLAGS are untouched.

    Raises:
      errors.UserError: for an unknown flag or a bad flag value.
    """
    flag_values = flags.FlagValues()
    DefineFlags(flag_values)
    try:
        flag_values(['gpipe-train'] + list(argv))
    except flags.Error as error:
        raise errors.UserError(str(error)) from None
    return Config.FromFlags(flag_values)


def TaskParams(config: Config, dataset: str = 'Train'):
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


def _TaskParams(config: Config, dataset: str):
    from gpipe_tf import model_registry  # pylint: disable=g-import-not-at-top
    from gpipe_tf.tasks import base_task  # pylint: disable=g-import-not-at-top
    model = config.model
    try:
        p = model_registry.GetParams(model, dataset)
    except LookupError as error:  # An unknown model or dataset: the registry names the close ones.
        # In the command line's words: the registry's ListModels() is --list_models here.
        message = str(error).strip("'\"").replace('ListModels()', '--list_models')
        raise errors.ConfigError(f'--model={model}: {message}') from None
    if config.model_params_file_override:
        path = config.model_params_file_override
        if not os.path.isfile(path):
            raise FileNotFoundError(f'--model_params_file_override: no file {path!r}.')
        with open(path, encoding='utf-8') as f:
            ApplyOverride(p, f.read(), f'--model_params_file_override={path}')
    if config.model_params_override:
        ApplyOverride(p, '\n'.join(line.strip() for line in config.model_params_override.split(';')
                                   if line.strip()), '--model_params_override')
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
        from gpipe_tf.layers import precision  # pylint: disable=g-import-not-at-top
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


def _Kind(value) -> str:
    if isinstance(value, bool):
        return 'bool'
    if isinstance(value, (int, float)):
        return 'number'
    if isinstance(value, str):
        return 'str'
    return 'other'


def ApplyOverride(p, text: str, source: str):
    """Applies Params `text` to `p`; a value of another kind than the one it replaces (a string
    for a number, a number for a bool, a float for an int) is a ValueError naming the key."""
    before = p.Copy()
    try:
        p.FromText(text)
    except (ValueError, AttributeError) as e:
        raise errors.ConfigError(f'{source}: {e}') from None
    for line in text.splitlines():
        key = line.split(' : ', 1)[0].strip()
        if not key or key.startswith('#') or ' : ' not in line:
            continue
        try:
            old = before.Get(key)
        except (AttributeError, KeyError, IndexError, ValueError):
            continue  # A new list entry or field that FromText created.
        new = p.Get(key)
        if old is None or new is None or _Kind(old) == 'other' or p.CheckOf(key) is not None:
            continue  # A param with a check of its own: setting it checked the value.
        if _Kind(old) != _Kind(new) or (isinstance(old, int) and not isinstance(old, bool) and
                                         isinstance(new, float)):
            raise errors.ConfigError(
                f'{source}: {key} is {old!r} ({type(old).__name__}); the override gives '
                f'{new!r} ({type(new).__name__}).')
    return p


def PipelinePlan(p, place: bool = True):
    """The plan (`pipeline.plan.Plan`) of task Params `p`'s pipeline; None for a model that is
    not a PipeliningLayer."""
    from gpipe_tf.pipeline import plan as plan_lib  # pylint: disable=g-import-not-at-top
    if not plan_lib.IsPipeline(p.model):
        return None
    return plan_lib.MakePlan(p.model, place=place)


def NumMicroBatches(p, plan) -> int:
    """M of task Params `p`'s pipeline (`plan`) for its input's batch; 1 for a model that is not
    a pipeline."""
    return 1 if plan is None else plan.MicroBatchesOf(p.input.batch_size)


def TpuAddress(config: Config) -> str | None:
    """--tpu, or 'local' for --run_locally=tpu; None for a run without a TPU."""
    if config.tpu is not None:
        return config.tpu
    return 'local' if config.run_locally == 'tpu' else None


def Cluster(config: Config):
    """The tf.train.ClusterSpec of --cluster_spec (or TF_CONFIG), or None for a local run."""
    from gpipe_tf.train import cluster as cluster_lib  # pylint: disable=g-import-not-at-top
    text = config.cluster_spec
    if text is None and os.environ.get('TF_CONFIG'):
        return cluster_lib.FromTfConfig(os.environ['TF_CONFIG'])
    if text is None:
        return None
    if text.lstrip().startswith('{'):
        return cluster_lib.FromTfConfig(text)
    return cluster_lib.ParseClusterSpec(text)


def _SetUpDevices(config: Config, p, plan, plan_only: bool = False) -> None:
    """Asks `devices` for the run's devices (set up unless `plan_only`: `inspect_model` builds
    nothing, so K may exceed the devices present) and puts them in the pipeline's Params, unless
    the Params name their own."""
    request = devices_lib.Request(
        run_locally=config.run_locally, num_devices=config.num_devices,
        cluster=Cluster(config), cluster_job=config.cluster_job,
        tpu=TpuAddress(config) is not None)
    devices = devices_lib.StageDeviceList(request, plan.num_devices if plan else 1,
                                          plan.num_replicas if plan else 1, plan_only)
    if plan is None or (request.tpu and not plan_only):
        # A TPU run places its cells through the strategy instead (`_TpuProgram`).
        return
    if not p.model.devices:  # The Params' own placement wins; the plan checks it exists.
        p.model.devices = devices


def InspectModel(p, name: str, plan=None) -> str:
    """The partition table of task Params `p`'s pipeline from Params alone (no variables, no
    TF ops), from `plan` (placed) or one made here."""
    from gpipe_tf.pipeline import partition  # pylint: disable=g-import-not-at-top
    plan = plan or PipelinePlan(p)
    if plan is None:
        raise errors.ConfigError(f'{name}: inspect_model needs a PipeliningLayer model; got '
                                 f'{p.model.cls.__name__}.')
    metas = plan.metas
    rows = [partition.ReportRow(cell=k, device=plan.devices[k], layers=[l.name for l in cell],
                                flops=metas[k].flops if metas else None,
                                num_params=metas[k].num_params if metas else None,
                                activation_bytes=metas[k].activation_bytes if metas else None)
            for k, cell in enumerate(plan.cells)]
    cells = (f'K={plan.num_cells} cells' if plan.virtual_stages == 1 else
             f'K={plan.num_devices} devices x v={plan.virtual_stages} = {plan.num_cells} cells')
    m = NumMicroBatches(p, plan)
    head = (f'{name}: {cells}, M={m} micro-batches, schedule {p.model.schedule} '
            f'({Executor(plan, m)}), '
            f'recompute={p.model.recompute}, batch {p.input.batch_size}. '
            'FLOPs and activation '
            'bytes are per mini-batch; with re-materialization a cell keeps about 1/M of its '
            'activations at a time.')
    return head + '\n' + partition.FormatReport(rows)


def InspectMemory(p, name: str, device_bytes: float | None = None,
                  plot_dir: str | None = None, plan=None) -> str:
    """The memory plan table of task Params `p`'s pipeline from Params alone (from its `plan`
    when given); with `plot_dir`, also writes the plan pictures there as PNGs and lists their
    paths.

    Raises:
      ValueError: for a model that is not a PipeliningLayer or has no input_shapes.
    """
    from gpipe_tf.perf import pictures  # pylint: disable=g-import-not-at-top
    from gpipe_tf.perf import plot  # pylint: disable=g-import-not-at-top
    plan = pictures.Plan(p, pipeline_plan=plan)
    lines = [f'{name}: planned memory per device, in MiB (slots per parameter: '
             f'{plan.memory.slots_per_param}).', plan.memory.Format(device_bytes)]
    if plot_dir:
        for key, figure in pictures.Figures(plan, name, device_bytes).items():
            lines.append(f'wrote {plot.SavePng(figure, os.path.join(plot_dir, key + ".png"))}')
    return '\n'.join(lines)


def RunInspectModel(config: Config, p, plan) -> None:
    """Prints the partition table and the memory plan, and writes the pictures (--plot_dir)."""
    device_bytes = None
    if config.device_memory_gib is not None:
        if not config.device_memory_gib > 0:
            raise errors.ConfigError(f'--device_memory_gib must be > 0, got '
                                     f'{config.device_memory_gib}.')
        device_bytes = config.device_memory_gib * 2**30
    name = config.model
    print(InspectModel(p, name, plan))
    try:
        report = InspectMemory(p, name, device_bytes, config.plot_dir, plan)
    except ValueError as error:
        if config.plot_dir or device_bytes is not None:
            raise errors.ConfigError(str(error)) from None
        # The partition table is the mode's promise; the memory plan needs more of the Params.
        report = f'No memory plan: {error}'
    print(report, flush=True)


def GpuMemoryReport(p, plan=None) -> str:
    """Each cell's planned memory against the free memory of the GPU it runs on, read with
    nvidia-smi; a line saying why when there is no report (no plan, R > 1 replicas, devices
    that are not this machine's GPUs)."""
    from gpipe_tf.perf import pictures  # pylint: disable=g-import-not-at-top
    from gpipe_tf.pipeline import plan as plan_lib  # pylint: disable=g-import-not-at-top
    from gpipe_tf.train import gpu  # pylint: disable=g-import-not-at-top
    model = p.model
    if plan_lib.IsPipeline(model) and model.num_replicas > 1:
        # The plan is one pipeline's on the whole batch; replicas share GPUs round-robin.
        return (f'No GPU memory report: the memory plan covers one pipeline, not '
                f'{model.num_replicas} replicas.')
    try:
        plan = plan or PipelinePlan(p)
        memory = pictures.Plan(p, pipeline_plan=plan).memory  # Raises for a non-pipeline.
        report = gpu.Report(memory, plan.devices)
    except ValueError as error:  # Informational: never stops the run.
        return f'No GPU memory report: {error}'
    return (report + '\nPlanned memory leaves out what CUDA and TensorFlow themselves take on '
            'each GPU.')


def ReadParams(logdir: str) -> str | None:
    """The text of `<logdir>/params.txt` (the last start's Params), or None without one."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    path = os.path.join(logdir, 'params.txt')
    try:
        with tf.io.gfile.GFile(path) as f:  # gfile: a gs:// logdir too.
            return f.read()
    except (tf.errors.NotFoundError, UnicodeDecodeError):
        return None


def WriteParams(text: str, logdir: str) -> str:
    """Writes Params `text` to `<logdir>/params.txt` atomically (creating logdir); returns the
    path."""
    return logdir_lib.WriteAtomically(os.path.join(logdir, 'params.txt'), text)


# Where runs went before the default became private; a note points there, never a resume.
_OLD_DEFAULT_ROOT = '/tmp/gpipe_tf'


def _Logdir(config: Config) -> str:
    """--logdir, or the user's private default (created and checked)."""
    if config.logdir:
        if os.path.exists(config.logdir) and not os.path.isdir(config.logdir):
            raise errors.UserError(f'--logdir={config.logdir} is a file, not a directory.')
        return config.logdir
    logdir = logdir_lib.DefaultLogdir(config.model)
    old = os.path.join(_OLD_DEFAULT_ROOT, config.model, 'train')
    if not os.listdir(logdir) and os.path.isdir(old) and any(
            name.endswith('.index') for name in os.listdir(old)):
        Warn(f'the default logdir is now {logdir}; checkpoints of an earlier run are in the old '
             f'shared default {os.path.dirname(old)}: pass --logdir={os.path.dirname(old)} to '
             'resume them (after checking who else can write there).')
    return logdir


def Warn(text: str) -> None:
    """A one-line warning for the user, on stderr."""
    print(f'warning: {text}', file=sys.stderr, flush=True)


def LockLogdir(logdir: str):
    """The logdir's trainer lock, as a context manager that takes and releases it (a warning,
    and no lock, for a logdir that is not a local path). Entering raises
    logdir.LogdirBusyError naming the holder."""
    if not logdir_lib.IsLocalPath(logdir):
        Warn(f'{logdir} is not a local path: no lock keeps a second trainer out of it.')
        return contextlib.nullcontext()
    return logdir_lib.Lock(logdir)


def FindCheckpoint(logdir: str, writer: bool, start_from_scratch: bool = False):
    """The newest checkpoint under `logdir` that restores (`checkpoints.Found`), after a
    warning per damaged or unfinished one. A `writer` (a trainer, holding the lock) moves those
    to train/damaged/ and repairs the index.

    Raises:
      checkpoints.NoCheckpointRestoresError: if checkpoint files exist and none restores (for a
        trainer, unless --start_from_scratch).
    """
    from gpipe_tf.train import checkpoints  # pylint: disable=g-import-not-at-top
    from gpipe_tf.train import program  # pylint: disable=g-import-not-at-top
    directory = program.CheckpointDir(logdir)
    found = checkpoints.Find(directory)
    for line in checkpoints.Warnings(found):
        Warn(line)
    if found.path is None and found.any_files and not (writer and start_from_scratch):
        raise checkpoints.NoCheckpointRestoresError(checkpoints.NoneRestoresMessage(
            directory, found, '--start_from_scratch'))
    if found.path is not None and start_from_scratch:
        raise errors.UserError(f'--start_from_scratch: {found.path} restores; resume from it '
                               '(drop the flag), or pass another --logdir to start over.')
    if writer and found.any_files:
        moved = checkpoints.SetAside(directory, found)
        if moved:
            Warn(f'moved {len(moved)} damaged or unfinished checkpoint file(s) to '
                 f'{os.path.join(directory, checkpoints.DAMAGED_DIR)}.')
    return found


def _GraphMode(config: Config) -> str:
    """--graph_mode, except that a cluster always runs the v1 graph path."""
    return 'v1' if Cluster(config) is not None else config.graph_mode


def _Program(config: Config, p, plan, logdir):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from gpipe_tf.train import program  # pylint: disable=g-import-not-at-top
    cluster = Cluster(config)
    if TpuAddress(config) is not None:
        if cluster is not None:
            raise errors.UserError('--tpu (or --run_locally=tpu) and --cluster_spec: give one; a TPU '
                             'brings its own workers.')
        if config.graph_mode == 'v1':
            raise errors.UserError('--tpu runs the tf_function path (a TPUStrategy). The v1 TPU path '
                             'is library-level: build the step inside tf.compat.v1.tpu.rewrite '
                             'with PipeliningLayer devices=gpipe_tf.train.tpu.CoreDevices(K) '
                             '(README, "Cloud TPU").')
        tf.config.experimental.enable_op_determinism()
        return _TpuProgram(config, p, plan, logdir)
    tf.config.experimental.enable_op_determinism()
    if cluster is not None:
        from gpipe_tf.train import cluster as cluster_lib  # pylint: disable=g-import-not-at-top
        if config.graph_mode_given and config.graph_mode != 'v1':
            raise errors.UserError('--cluster_spec runs the v1 graph path (a Session with an operation '
                             'timeout: TF2 remote eager hangs on a stopped worker); drop '
                             f'--graph_mode={config.graph_mode}.')
        return program.GraphProgram(p, logdir, cluster_lib.SessionConfig(config.cluster_timeout_s),
                                    cluster=cluster, job=config.cluster_job)
    if config.graph_mode == 'v1':
        return program.GraphProgram(p, logdir)
    return program.EagerProgram(p, logdir)


def _TpuProgram(config: Config, p, plan, logdir):
    """A StrategyProgram on the TPU at `address`: R replicas of K logical devices, each cell's
    variables and ops on its device's (`Plan.DeviceOf`: cell k on k % K with v virtual
    stages). Raises tpu.TpuError when there is no usable TPU."""
    from gpipe_tf.train import program  # pylint: disable=g-import-not-at-top
    from gpipe_tf.train import tpu  # pylint: disable=g-import-not-at-top
    num_devices = plan.num_devices if plan else 1
    resolver, topology = tpu.Connect(TpuAddress(config), config.tpu_timeout_s)
    strategy = tpu.Strategy(resolver, topology, num_devices, p.model.num_replicas)
    # The replicas are the strategy's. Within one, a cell's variables are created on its
    # logical device, its ops run under that core's device scope, and the tensors crossing its
    # boundary carry that logical device's sharding.
    p.model.Set(num_replicas=1, devices=tpu.CoreDevices(num_devices),
                logical_device_fn=tpu.AssignToLogicalDevice)
    WriteParams(p.ToText(), logdir)  # What runs: the replicas are now the strategy's.
    return program.StrategyProgram(p, logdir, strategy)


def _Where(config: Config, prog) -> str:
    """Where training runs, for the first line of a training run."""
    model = prog.task.model
    strategy = getattr(prog, 'strategy', None)
    if strategy is not None:
        plan = getattr(model, 'plan', None)
        num_devices = model.num_cells if plan is None else plan.num_devices
        return (f'R={strategy.num_replicas_in_sync} replicas x K={num_devices} logical '
                f'devices on the TPU {TpuAddress(config)}')
    replicas = f'R={len(model.mesh)} replicas x ' if len(model.mesh) > 1 else ''
    return (f'{replicas}K={len(model.devices)} cells on '
            f'{model.mesh if len(model.mesh) > 1 else model.devices}')


def Executor(plan, num_micro_batches: int) -> str:
    """How a step of `plan`'s pipeline runs its schedule (the Params' `unroll`)."""
    return 'a loop over its clock' if plan.Loops(num_micro_batches) else 'unrolled'


def _ScheduleNote(plan, num_micro_batches: int) -> str:
    """' (<schedule> schedule, <executor>)' for the first line of a training run; '' for a
    model that is not a pipeline."""
    if plan is None:
        return ''
    return f' ({plan.params.schedule} schedule, {Executor(plan, num_micro_batches)})'


def RunTrain(config: Config, p, plan, logdir, with_eval: bool, resume_note: str = '') -> dict:
    from gpipe_tf.train import loop  # pylint: disable=g-import-not-at-top
    eval_params = TaskParams(config, p.train.eval_dataset).input if with_eval else None
    start = time.time()
    print(f'building {config.model}: its variables on their devices and the input pipeline',
          flush=True)
    prog = _Program(config, p, plan, logdir)
    print(f'built in {time.time() - start:.0f} s', flush=True)
    fprop_dtype = prog.task.model.p.fprop_dtype
    computing = '' if fprop_dtype is None else f', computing in {fprop_dtype.name}'
    m = NumMicroBatches(p, plan)
    print(f'training {config.model} in {logdir}: {_Where(config, prog)}, M={m}'
          # The built model's plan: the TPU path's adds a logical_device_fn (then unrolled).
          f'{_ScheduleNote(getattr(prog.task.model, "plan", None), m)}, '
          f'batch {p.input.batch_size}, {_GraphMode(config)}'
          f'{computing}', flush=True)
    metrics = loop.Train(prog, p, logdir, p.train.max_steps, eval_params, plan=plan,
                         resume_note=resume_note)
    # Greedy decoding runs eagerly, outside a TPU strategy's replicas.
    if (with_eval and _Translates(prog.task) and _GraphMode(config) != 'v1' and
            TpuAddress(config) is None):
        metrics['eval_bleu'] = ReportBleu(prog, eval_params, p.train.eval_dataset, logdir)
    if 'eval_accuracy' in metrics:
        print(f'final {p.train.eval_dataset.lower()} accuracy {metrics["eval_accuracy"]:.4f}',
              flush=True)
    print(f'logdir: {logdir}', flush=True)
    return metrics


def _Translates(task) -> bool:
    return 'translation' in task.p and bool(task.p.translation)


def ReportBleu(prog, eval_params, name: str, logdir: str, num_samples: int = 5) -> float:
    """Greedy-decodes `eval_params`' data, prints its BLEU and a few translations, and writes
    the BLEU and every translation (`<logdir>/decode_<step>.tsv`)."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from gpipe_tf.train import decode  # pylint: disable=g-import-not-at-top
    start = time.time()
    bleu, rows = decode.EvaluateBleu(prog.task, eval_params)
    step = prog.CurrentStep()
    path = logdir_lib.WriteAtomically(
        os.path.join(logdir, f'decode_{name.lower()}_{step}.tsv'),
        'source\thypothesis\treference\n' + ''.join('\t'.join(row) + '\n' for row in rows))
    with tf.summary.create_file_writer(os.path.join(logdir, 'eval')).as_default():
        tf.summary.scalar('bleu', bleu, step=step)
    print(f'{name} BLEU {bleu:.2f} on {len(rows)} sentences, greedy decoding '
          f'({time.time() - start:.0f} s; translations in {path})', flush=True)
    for source, hypothesis, reference in rows[:num_samples]:
        print(f'  {source!r} -> {hypothesis!r} (reference {reference!r})', flush=True)
    return bleu


# How often eval and decode look for the newest checkpoint again when the one they found is
# deleted under them by a trainer's max_to_keep.
_RESTORE_ATTEMPTS = 5


def _RestoredProgram(config: Config, p, plan, logdir: str):
    """(the program, its step) with the newest checkpoint that restores, read-only: for eval
    and decode, which may run beside a trainer.

    Raises:
      errors.UserError: if `logdir` holds no checkpoint.
    """
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    found = FindCheckpoint(logdir, writer=False)
    if found.path is None:
        raise errors.UserError(f'{config.mode}: no checkpoint under '
                               f'{os.path.join(logdir, "train")}; train first (--mode=train).')
    from gpipe_tf.train import program  # pylint: disable=g-import-not-at-top
    prog = _Program(config, p, plan, logdir)
    for attempt in range(_RESTORE_ATTEMPTS):
        try:
            return prog, prog.Restore(training=False, path=found.path)
        except (tf.errors.OpError, program.CheckpointMismatchError):
            # A trainer beside us deleted it (max_to_keep) after we found it, perhaps while we
            # read it (a data file gone is an OpError; objects read from half of it do not
            # match): a newer one is there now. One still whole fails for another reason.
            gone = not (tf.io.gfile.exists(found.path + '.index') and
                        tf.io.gfile.glob(found.path + '.data-*'))
            if attempt + 1 == _RESTORE_ATTEMPTS or not gone:
                raise
            found = FindCheckpoint(logdir, writer=False)


def RunEval(config: Config, p, plan, logdir) -> dict:
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from gpipe_tf.train import loop  # pylint: disable=g-import-not-at-top
    prog, step = _RestoredProgram(config, p, plan, logdir)
    eval_params = TaskParams(config, p.train.eval_dataset).input
    writer = tf.summary.create_file_writer(os.path.join(logdir, 'eval'))
    return loop.Evaluate(prog, eval_params, writer, step, p.train.eval_dataset)


def _DecodeLines(config: Config) -> list[str]:
    lines = list(config.decode_input)
    if config.decode_input_file:
        if not os.path.isfile(config.decode_input_file):
            raise errors.UserError(f'--decode_input_file: no file {config.decode_input_file}.')
        with open(config.decode_input_file, encoding='utf-8') as f:
            lines += [line.rstrip('\n') for line in f if line.strip()]
    if not lines:
        raise errors.UserError('decode: give --decode_input (comma-separated) or '
                               '--decode_input_file.')
    return lines


def DecodeRequest(config: Config, p) -> list[str]:
    """The lines to decode, checked against task Params `p` before any device is set up or
    model built.

    Raises:
      errors.UserError: no lines, a TPU, or a request the task cannot serve (a translation
        without a known --target_language, a sentence too long, a missing image file).
    """
    from gpipe_tf.train import decode  # pylint: disable=g-import-not-at-top
    if TpuAddress(config) is not None:
        raise errors.UserError('decode runs eagerly on this machine\'s devices, not on a TPU: drop '
                               '--tpu and --run_locally=tpu.')
    lines = _DecodeLines(config)
    try:
        decode.CheckRequest(p, lines, config.target_language)
    except (ValueError, FileNotFoundError) as error:
        raise errors.UserError(str(error)) from None
    return lines


def RunDecode(config: Config, p, plan, logdir, lines: list[str]) -> list[str]:
    from gpipe_tf.train import decode  # pylint: disable=g-import-not-at-top
    prog, _ = _RestoredProgram(config, p, plan, logdir)
    results = decode.Decode(prog.task, p, lines, config.target_language)
    for source, result in results:
        print(f'{source}\t{result}', flush=True)
    return results


def CheckExport(config: Config, p) -> None:
    """Checks an export request before any device is set up or model built.

    Raises:
      errors.UserError: for a TPU or the v1 graph path (a SavedModel is saved from TF2
        functions), or a task that cannot be exported.
    """
    from gpipe_tf.tasks import classifier  # pylint: disable=g-import-not-at-top
    from gpipe_tf.tasks import sequence  # pylint: disable=g-import-not-at-top
    if TpuAddress(config) is not None:
        raise errors.UserError('export runs on this machine\'s devices, not on a TPU: drop --tpu '
                               'and --run_locally=tpu.')
    if _GraphMode(config) == 'v1':
        raise errors.UserError('export saves TF2 functions: drop --graph_mode=v1 and '
                               '--cluster_spec (export on one machine).')
    exportable = (issubclass(p.cls, classifier.ClassifierTask) or
                  (issubclass(p.cls, sequence.SequenceTask) and p.translation))
    if not exportable:
        raise errors.UserError(f'export: {config.model} cannot be exported; export serves image '
                               'classifiers and translation models.')


def RunExport(config: Config, p, plan, logdir) -> str:
    """Exports the newest checkpoint to `<logdir>/export/<step>`; prints the path."""
    from gpipe_tf.train import export  # pylint: disable=g-import-not-at-top
    if config.export_on_one_device:
        p = p.Copy()
        p.model.devices = [plan.mesh[0][0]] * (plan.num_devices * p.model.num_replicas)
    print(f'export: restoring the newest checkpoint of {logdir}', flush=True)
    prog, step = _RestoredProgram(config, p, plan, logdir)
    try:
        path = export.Export(prog.task, p,
                             export.VersionDir(os.path.join(logdir, 'export'), step),
                             report=lambda line: print(line, flush=True))
    except FileExistsError as error:
        raise errors.UserError(str(error)) from None
    print(f'exported step {step} to {path}', flush=True)
    return path


def CheckPlan(p):
    """The plan of task Params `p`'s pipeline, not yet placed (None for a model that is not
    one): making it checks, before anything is built or written, K against the layers (and the
    cells' shapes), and the batch against R replicas and M micro-batches.

    Raises:
      errors.ConfigError: naming the flag to change and the values that would work.
    """
    from gpipe_tf.pipeline import plan as plan_lib  # pylint: disable=g-import-not-at-top
    model = p.model
    if not plan_lib.IsPipeline(model):
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
        if 'num_cells' in str(error):  # In the command line's words.
            raise errors.ConfigError(f'--worker_split_size={model.num_cells}: '
                                     f'{error}') from None
        raise


def PartitionOnTime(p, logdir: str) -> None:
    """partition_method="time": measures the layers on the devices just set up (cached in
    `<logdir>/layer_costs.json`, so a restart finds the same cells without measuring again)
    and sets the boundaries they give, which params.txt then records."""
    from gpipe_tf.pipeline import plan as plan_lib  # pylint: disable=g-import-not-at-top
    model = p.model
    if not plan_lib.IsPipeline(model) or model.partition_method != 'time':
        return
    if model.costs_file is None:
        model.costs_file = os.path.join(logdir, 'layer_costs.json')
    print(f'measuring the layers of {model.name} for partition_method="time" (cached in '
          f'{model.costs_file})', flush=True)
    cells = plan_lib.MakePlan(model, place=False).cells
    bounds = [0]
    for layers in cells:
        bounds.append(bounds[-1] + len(layers))
    model.partition_method = bounds
    print(f'partition on measured time: boundaries {bounds}', flush=True)


def CheckDataDir(p) -> None:
    """A local data directory the input reads must exist (else the run would fail after
    building the model)."""
    path = p.input.data_dir if 'data_dir' in p.input else None
    if path and '://' not in path and not os.path.isdir(path):
        raise errors.ConfigError(f'--data_dir: {path} is not a directory; '
                                 f'{p.input.cls.__name__} reads its files there.')


def main(config: Config) -> None:
    """Runs `config.mode`. User mistakes raise errors.UserError before a logdir is created."""
    if config.list_models:
        from gpipe_tf import model_registry  # pylint: disable=g-import-not-at-top
        print('\n'.join(model_registry.ListModels()))
        return
    if not config.model:
        raise errors.UserError('--model is required (see --list_models).')
    p = TaskParams(config)
    if config.mode == 'tune' and config.num_devices is not None:
        p.model.num_cells = config.num_devices // p.model.num_replicas  # K, tuned for.
    if config.logdir and config.mode != 'inspect_model':
        logdir_lib.CheckCreatable(config.logdir)  # Before anything is built.
    if config.mode == 'inspect_params':
        RunInspectParams(p, _Logdir(config))
        return
    plan = CheckPlan(p)
    if config.mode in ('train', 'train_and_eval', 'eval'):
        CheckDataDir(p)
    lines = DecodeRequest(config, p) if config.mode == 'decode' else None
    if config.mode == 'export':
        CheckExport(config, p)
    _SetUpDevices(config, p, plan, plan_only=config.mode == 'inspect_model')
    if plan is not None and p.model.partition_method == 'time':
        PartitionOnTime(p, _Logdir(config))
        plan = CheckPlan(p)
    if plan is not None and (config.mode == 'inspect_model' or TpuAddress(config) is None):
        # On the devices just set up (no second partition). A TPU's strategy places the cells
        # itself, and listing devices before it connects would start TensorFlow's runtime.
        plan = plan.Placed()
    if config.run_locally == 'gpu' and Cluster(config) is None:  # (--tpu refuses gpu above.)
        print(GpuMemoryReport(p, plan), flush=True)
    if config.mode == 'inspect_model':
        RunInspectModel(config, p, plan)
        return
    if config.mode == 'tune':
        from gpipe_tf.train import tune  # pylint: disable=g-import-not-at-top
        tune.Run(p, config.model, _Logdir(config), config.device_memory_gib, config.tune_costs,
                 config.tune_steps)
        return
    if config.mode == 'check':
        from gpipe_tf.train import check  # pylint: disable=g-import-not-at-top
        check.Run(p, config.model)
        return
    logdir = _Logdir(config)
    WarnIfClusterIsExposed(config)
    with logdir_lib.RemovedAfterAMistake(logdir, _HoldsCheckpoint):
        _RunMode(config, p, plan, logdir, lines)


def _HoldsCheckpoint(logdir: str) -> bool:
    from gpipe_tf.train import checkpoints  # pylint: disable=g-import-not-at-top
    from gpipe_tf.train import program  # pylint: disable=g-import-not-at-top
    return checkpoints.AnyFiles(program.CheckpointDir(logdir))


def _RunMode(config: Config, p, plan, logdir: str, lines) -> None:
    """Trains, evaluates, exports or decodes in `logdir`."""
    if config.mode in ('train', 'train_and_eval'):
        # Held for the whole run: checkpoints, params.txt and summaries are this run's.
        with LockLogdir(logdir):
            FindCheckpoint(logdir, writer=True, start_from_scratch=config.start_from_scratch)
            previous = ReadParams(logdir)
            WriteParams(p.ToText(), logdir)
            RunTrain(config, p, plan, logdir, with_eval=config.mode == 'train_and_eval',
                     resume_note=partition_change.Describe(previous, p.ToText()))
    elif config.mode == 'eval':
        RunEval(config, p, plan, logdir)
    elif config.mode == 'export':
        RunExport(config, p, plan, logdir)
    else:
        RunDecode(config, p, plan, logdir, lines)


def RunInspectParams(p, logdir: str) -> None:
    """Prints the Params text and writes it to params.txt, unless a trainer holds the logdir
    (its params.txt describes its run)."""
    text = p.ToText()
    print(text, end='', flush=True)
    try:
        with (logdir_lib.Lock(logdir) if logdir_lib.IsLocalPath(logdir) else
              contextlib.nullcontext()):
            print(f'# written to {WriteParams(text, logdir)}', file=sys.stderr)
    except logdir_lib.LogdirBusyError as error:
        print(f'# not written: {error}', file=sys.stderr)


def WarnIfClusterIsExposed(config: Config) -> None:
    """Once per run: the exposure of a cluster whose tasks are not all on this machine's
    loopback (the launcher's own clusters are)."""
    cluster = Cluster(config)
    if cluster is None:
        return
    addresses = [a for job in cluster.jobs for a in cluster.job_tasks(job)]
    exposed = [a for a in addresses
               if a.rpartition(':')[0] not in ('127.0.0.1', 'localhost', '[::1]', '::1')]
    if exposed:
        Warn(f'the cluster\'s tf.distribute.Server tasks ({", ".join(exposed)}) run any op '
             'that any host reaching their ports sends, without authentication: firewall them '
             'to the cluster\'s hosts (README, "Reliability and security").')


def Main(config: Config) -> int:
    """Runs the trainer in this process; returns its exit status: 0, 2 for a user's mistake,
    1 for a non-finite loss or a fault of the machine (a full disk), 128 + the signal's number
    when stopped by one. A user's mistake is one line `error: ...` on stderr (with --verbose,
    also its traceback).

    Raises:
      cluster.ClusterError: when a task of the cluster (or the TPU) cannot be reached.
    """
    from gpipe_tf.train import loop  # pylint: disable=g-import-not-at-top
    try:
        main(config)
        return 0
    except errors.UserError as error:
        # The user's to resolve, not a bug: the message says what to do.
        _Error(error, config.verbose)
        return 2
    except (errors.EnvironmentFault, loop.NonFiniteLossError) as error:
        _Error(error, config.verbose)
        return 1
    except loop.Interrupted as interrupted:
        saved = (f'saved {interrupted.checkpoint} at step {interrupted.step}'
                 if interrupted.checkpoint else 'no checkpoint saved')
        print(f'stopped by {interrupted}: {saved}; run the same command again to resume.',
              file=sys.stderr, flush=True)
        return 128 + interrupted.signum
    except KeyboardInterrupt:
        # Ctrl-C outside the training steps (building, evaluating): nothing new to save.
        print('stopped by SIGINT outside training; checkpoints already written are kept.',
              file=sys.stderr, flush=True)
        return 130


def _Error(error: BaseException, verbose: bool) -> None:
    if verbose:
        traceback.print_exception(error)
    print(f'error: {error}', file=sys.stderr, flush=True)


def _Quiet() -> None:
    """Keeps TensorFlow's own log lines (start-up banners, `failed call to cuInit` on a machine
    without a GPU) and its Python warnings out of the user's terminal; --verbose keeps them.
    Works only before TensorFlow is imported, which is why `import gpipe_tf` does not."""
    os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
    # Lines logged while TensorFlow's libraries load come before its C++ logging reads the
    # variable above (TF 2.21): they go to a file, shown only if the import fails.
    with tempfile.TemporaryFile() as captured:
        stderr = os.dup(2)
        os.dup2(captured.fileno(), 2)
        try:
            import tensorflow  # pylint: disable=g-import-not-at-top,unused-import
        except BaseException:
            os.dup2(stderr, 2)
            captured.seek(0)
            sys.stderr.write(captured.read().decode(errors='replace'))
            raise
        finally:
            os.dup2(stderr, 2)
            os.close(stderr)
    from absl import logging  # pylint: disable=g-import-not-at-top
    logging.set_verbosity(logging.ERROR)


def _Main(argv):
    if len(argv) > 1:
        print(f'error: unexpected arguments {argv[1:]} (flags are --name=value; see --help).',
              file=sys.stderr, flush=True)
        sys.exit(2)
    config = Config.FromFlags(FLAGS)
    if not config.verbose:
        _Quiet()
    from gpipe_tf.train import cluster as cluster_lib  # pylint: disable=g-import-not-at-top
    try:
        status = Main(config)
    except cluster_lib.ClusterError as error:
        # The cluster's or the TPU's state, not a bug. Exit without closing the Session: with a
        # worker gone, its Close() retries without a deadline (seen hanging for minutes).
        # Checkpoints and summaries are flushed already.
        _Error(error, config.verbose)
        sys.stdout.flush()
        os._exit(1)  # pylint: disable=protected-access
    sys.exit(status)


def _Help() -> str:
    """The trainer's own flags (absl's --help would list those of the script that ran it)."""
    flag_values = flags.FlagValues()
    DefineFlags(flag_values)
    module = next(iter(flag_values.flags_by_module_dict()))
    flag_lines = flag_values.module_help(module).split('\n', 2)[-1]
    return (f'{__doc__.strip()}\n\nflags:\n{flag_lines}')


def Run(argv: list[str] | None = None):
    """Entry point of the `gpipe-train` console script."""
    argv = sys.argv if argv is None else argv
    if any(arg in ('-h', '--help', '-help', '--helpshort', '--helpfull') for arg in argv[1:]):
        print(_Help())
        sys.exit(0)
    app.run(_Main, argv=argv, flags_parser=_ParseFlags)


def _ParseFlags(argv: list[str]) -> list[str]:
    """absl's flag parsing, with a bad flag as one line `error: ...` and exit status 2."""
    try:
        return FLAGS(argv)
    except flags.Error as error:
        print(f'error: {error} (see --help).', file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == '__main__':
    Run()
