r"""The gpipe_tf trainer: `python -m gpipe_tf.trainer --model=<registry key> ...`
(also installed as `gpipe-train`).

    gpipe-train --model=image.amoebanet.AmoebaNetD_Small --logdir=/tmp/amoeba \
        --run_locally=cpu --num_devices=4 --mode=train_and_eval

Modes: `train`, `eval` (the latest checkpoint on `task.train.eval_dataset`), `train_and_eval`,
`inspect_params` (prints the Params text and writes `<logdir>/params.txt`), `inspect_model`
(from Params alone, building nothing: the partition table, per cell its layers, device, FLOPs,
parameters and estimated activation memory, then the memory plan per device; with `--plot_dir`
also the plan pictures as PNGs), `decode` (classify image files / translate sentences, given
with `--decode_input` or in a file with `--decode_input_file`), `export` (the latest
checkpoint as a SavedModel in `<logdir>/export/<step>`, TensorFlow Serving's layout; see
`gpipe_tf.train.export`), `tune` (with `--device_memory_gib`: searches schedule, M, recompute
and partition for the fastest step that fits, on measured layer costs where the model runs
here; prints the ranked table and writes `<logdir>/tuned_params.txt`) and `check` (one batch
through the pipeline and through the same layers un-partitioned: losses and gradients compared,
a failure above the tolerance).
Restarting with the same `--logdir` resumes from the newest checkpoint that restores (a damaged
one is skipped with a warning); a second trainer on the same logdir is refused while the first
runs. A user's mistake is one line `error: ...` on stderr and exit status 2.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
import traceback

from absl import app
from absl import flags

from gpipe_tf import errors
from gpipe_tf import model_keys
from gpipe_tf import start_signals
from gpipe_tf.pipeline import devices as devices_lib
from gpipe_tf.pipeline import schedule as schedule_lib

# The modes `gpipe_tf.train.run` runs.
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
                        'lines separated by ";", e.g. "train.learning_rate : 0.01; '
                        'input.seed : 3".',
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
                      f'schedule: {schedule_lib.KindsHelp()}.', flag_values=flag_values)
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
                        '"worker=host:port,host:port" (jobs separated by @) or TF_CONFIG JSON; '
                        'also read from the TF_CONFIG environment variable. Stage k of replica r '
                        'runs on task r*K+k of --cluster_job; the step runs in a v1 Session on '
                        'task 0.',
                        flag_values=flag_values)
    flags.DEFINE_string('cluster_job', 'worker', 'The cluster job whose tasks run the stages.',
                        flag_values=flag_values)
    flags.DEFINE_float('cluster_timeout_s', 60.0, 'A step (any Session.run) the cluster does not '
                       'finish in this many seconds fails, naming the unreachable task.',
                       flag_values=flag_values)
    flags.register_validator(
        'cluster_timeout_s', lambda seconds: 0 < seconds < 2**63 / 1000,  # Milliseconds, int64.
        message='expected a finite number of seconds > 0, within which the cluster must finish '
        'each step', flag_values=flag_values)
    flags.DEFINE_string('tpu', None, 'Train on a Cloud TPU: "local" on a TPU VM, the TPU\'s name, '
                        'or grpc://<ip>:8470 of a TPU node. A tf.distribute.TPUStrategy runs R '
                        'replicas (--worker_replicas), each with its K cells on K logical devices; '
                        'the tf_function path only.', flag_values=flag_values)
    flags.DEFINE_float('tpu_timeout_s', 600.0, 'Connecting to and initializing the TPU may take '
                       'this many seconds before it counts as unreachable.',
                       flag_values=flag_values)
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
    flags.DEFINE_integer('tune_steps', 5, 'tune: with measured costs, run the pipeline this many '
                         'steps per configuration: gpipe at each M searched to calibrate the '
                         'costs, then the --tune_top best-ranked, and print measured steps and '
                         'memory beside the predicted (0: run nothing, choose the best-ranked).',
                         flag_values=flag_values)
    flags.DEFINE_integer('tune_top', 3, 'tune: run this many best-ranked configurations '
                         'that fit (--tune_steps steps each) and choose the fastest measured '
                         '(1: the best-ranked).', flag_values=flag_values)
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
                      help='Show TensorFlow\'s own log lines and, for an error, its traceback; '
                      'tune: also each configuration\'s boundaries and per-device peaks.',
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
    tune_top: int
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


# The integer flags that must be positive when given, and what each counts.
_POSITIVE = (('num_micro_batches', 'M, the micro-batches'), ('worker_split_size', 'K, the cells'),
             ('virtual_stages', 'v, the cells per device'),
             ('worker_replicas', 'R, the pipeline\'s replicas'), ('num_devices', 'devices'))


def CheckFlags(config: Config) -> None:
    """The mistakes that need no model, checked before TensorFlow is imported (which takes
    seconds): a missing or unknown --model, a count flag below 1.

    Raises:
      errors.UserError: naming the flag.
    """
    if config.list_models:
        return
    if not config.model:
        raise errors.UserError('--model is required (see --list_models).')
    keys = model_keys.DeclaredKeys()
    registry = sys.modules.get('gpipe_tf.model_registry')  # Models registered in process.
    if registry is not None:
        keys |= set(registry._MODEL_PARAMS)  # pylint: disable=protected-access
    if config.model not in keys:
        message = model_keys.UnknownModel(config.model, keys)
        raise errors.ConfigError(
            f'--model={config.model}: {message.replace("ListModels()", "--list_models")}')
    for name, what in _POSITIVE:
        value = getattr(config, name)
        if value is not None and value < 1:
            raise errors.ConfigError(f'--{name}: must be a positive integer ({what}), got '
                                     f'{value}.')


def Main(config: Config) -> int:
    """Runs the trainer in this process; returns its exit status: 0, 2 for a user's mistake,
    1 for a non-finite loss or a fault of the machine (a full disk), 128 + the signal's number
    when stopped by one. A user's mistake is one line `error: ...` on stderr (with --verbose,
    also its traceback).

    Raises:
      cluster.ClusterError: when a task of the cluster (or the TPU) cannot be reached.
    """
    try:
        CheckFlags(config)
    except errors.UserError as error:
        _Error(error, config.verbose)
        return 2
    # After `_Quiet`: importing the run imports TensorFlow.
    try:
        from gpipe_tf.train import loop  # pylint: disable=g-import-not-at-top
        from gpipe_tf.train import run  # pylint: disable=g-import-not-at-top
    except (Exception, KeyboardInterrupt) as error:  # pylint: disable=broad-except
        if not _Interrupted(error):
            raise
        print(_STOPPED_STARTING, file=sys.stderr, flush=True)
        return 130
    if start_signals.Pending() is not None:  # An interrupt that code it landed in swallowed.
        print(_STOPPED_STARTING, file=sys.stderr, flush=True)
        return 130
    try:
        run.Run(config)
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
    except (Exception, KeyboardInterrupt) as error:  # pylint: disable=broad-except
        if not _Interrupted(error):
            raise
        print(_STOPPED_OUTSIDE_TRAINING, file=sys.stderr, flush=True)
        return 130


# Ctrl-C while TensorFlow and the trainer's modules load: nothing has been written yet.
_STOPPED_STARTING = 'stopped by SIGINT while starting; nothing was written.'
# Ctrl-C outside the training steps (building, evaluating): nothing new to save.
_STOPPED_OUTSIDE_TRAINING = ('stopped by SIGINT outside training; checkpoints already written '
                             'are kept.')


def _Interrupted(error: BaseException) -> bool:
    """Whether `error` is, or comes from, the user's Ctrl-C. The interrupt is raised wherever
    the interpreter is, and code it lands in may turn it into an error of its own: a C
    extension's module initialization raises `ImportError: initialization failed` from it
    (seen while TensorFlow imports). `start_signals` keeps the record either way."""
    return isinstance(error, KeyboardInterrupt) or start_signals.Pending() is not None


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
        except BaseException as error:
            if _Interrupted(error):  # Ctrl-C: the user's, not a failed import to explain.
                raise
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
    try:
        CheckFlags(config)  # Before TensorFlow's import: an answer in well under a second.
    except errors.UserError as error:
        _Error(error, config.verbose)
        sys.exit(2)
    try:
        if not config.verbose:
            _Quiet()
        from gpipe_tf.train import cluster as cluster_lib  # pylint: disable=g-import-not-at-top
    except (Exception, KeyboardInterrupt) as error:  # pylint: disable=broad-except
        if not _Interrupted(error):
            raise
        print(_STOPPED_STARTING, file=sys.stderr, flush=True)
        sys.exit(130)
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
    start_signals.Listen()  # First: Ctrl-C stops the start-up too (`start_signals`).
    argv = sys.argv if argv is None else argv
    if any(arg in ('-h', '--help', '-help', '--helpshort', '--helpfull') for arg in argv[1:]):
        print(_Help())
        sys.exit(0)
    try:
        app.run(_Main, argv=argv, flags_parser=_ParseFlags)
    except KeyboardInterrupt:  # While the flags are parsed: before `_Main` listens for it.
        print(_STOPPED_STARTING, file=sys.stderr, flush=True)
        sys.exit(130)


def _ParseFlags(argv: list[str]) -> list[str]:
    """absl's flag parsing, with a bad flag as one line `error: ...` and exit status 2."""
    try:
        return FLAGS(argv)
    except flags.Error as error:
        print(f'error: {error} (see --help).', file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == '__main__':
    Run()

