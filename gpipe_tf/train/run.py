"""A trainer run as named steps: the Params and the plan checked, the devices set up, then the
mode (`gpipe_tf.trainer.MODES`). `Run` is what `gpipe_tf.trainer` calls with its `Config`; user
mistakes raise errors.UserError, checked before a logdir is created where that is cheap.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

import tensorflow as tf

from gpipe_tf import errors
from gpipe_tf.perf import reports
from gpipe_tf.pipeline import executor
from gpipe_tf.pipeline import plan as plan_lib
from gpipe_tf.tasks import classifier
from gpipe_tf.tasks import sequence
from gpipe_tf.train import check
from gpipe_tf.train import checkpoints
from gpipe_tf.train import decode
from gpipe_tf.train import export
from gpipe_tf.train import gpu
from gpipe_tf.train import logdir as logdir_lib
from gpipe_tf.train import loop
from gpipe_tf.train import model_list
from gpipe_tf.train import partition_change
from gpipe_tf.train import program
from gpipe_tf.train import setup
from gpipe_tf.train import tune


def Run(config) -> None:
    """Runs `config.mode` (`config`: the trainer's Config, checked by `trainer.CheckFlags`)."""
    if config.list_models:
        print('\n'.join(model_list.Lines()))
        return
    p = setup.TaskParams(config)
    if config.mode == 'tune' and config.num_devices is not None:
        tune.SetNumCells(p, config.model, config.num_devices)
    if config.logdir and _WritesLogdir(config.mode, p):
        logdir_lib.CheckCreatable(config.logdir)  # Before anything is built.
    if config.mode == 'inspect_params':
        RunInspectParams(p, logdir_lib.Resolve(config.logdir, config.model))
        return
    target = setup.Target.Of(config)
    plan = setup.CheckPlan(p, config)
    if config.mode in ('train', 'train_and_eval', 'eval'):
        setup.CheckDataDir(p)
    lines = DecodeRequest(config, target, p) if config.mode == 'decode' else None
    if config.mode == 'export':
        CheckExport(config, target, p)
    setup.SetUpDevices(config, target, p, plan, plan_only=config.mode == 'inspect_model')
    if plan is not None and p.model.partition_method == 'time':
        plan = setup.PartitionOnTime(p, logdir_lib.Resolve(config.logdir, config.model))
    if plan is not None and (config.mode == 'inspect_model' or target.tpu is None):
        # On the devices just set up (no second partition). A TPU's strategy places the cells
        # itself, and listing devices before it connects would start TensorFlow's runtime.
        plan = plan.Placed()
    if config.run_locally == 'gpu' and target.cluster is None:  # (--tpu refuses gpu above.)
        print(gpu.PipelineReport(p, plan), flush=True)
    if config.mode == 'inspect_model':
        RunInspectModel(config, p, plan)
        return
    if config.mode == 'tune':
        tune.Run(p, config.model, logdir_lib.Resolve(config.logdir, config.model),
                 config.device_memory_gib, config.tune_costs, config.tune_steps,
                 config.tune_top, config.verbose)
        return
    if config.mode == 'check':
        check.Run(p, config.model, plan)
        return
    logdir = logdir_lib.Resolve(config.logdir, config.model)
    setup.WarnIfClusterIsExposed(target.cluster)
    with logdir_lib.RemovedAfterAMistake(logdir, _HoldsCheckpoint):
        if config.mode in ('train', 'train_and_eval'):
            # Held for the whole run: checkpoints, params.txt and summaries are this run's.
            with logdir_lib.LockOrWarn(logdir):
                checkpoints.Choose(program.CheckpointDir(logdir), writer=True,
                                   start_from_scratch=config.start_from_scratch)
                previous = logdir_lib.ReadParams(logdir)
                logdir_lib.WriteParams(p.ToText(), logdir)
                try:
                    RunTrain(config, target, p, plan, logdir,
                             with_eval=config.mode == 'train_and_eval',
                             resume_note=partition_change.Describe(previous, p.ToText()))
                except program.CheckpointMismatchError:
                    # Refused at the restore: params.txt describes the checkpoints again.
                    if previous is not None:
                        logdir_lib.WriteParams(previous, logdir)
                    raise
        elif config.mode == 'eval':
            RunEval(config, target, p, plan, logdir)
        elif config.mode == 'export':
            RunExport(config, target, p, plan, logdir)
        else:
            RunDecode(config, target, p, plan, logdir, lines)


def _WritesLogdir(mode: str, p) -> bool:
    """Whether `mode` may write into the logdir. inspect_model writes nothing there; decode only
    reads the checkpoints, but for partition_method="time", whose measured layer costs it
    caches there (`setup.PartitionOnTime`)."""
    if mode == 'inspect_model':
        return False
    if mode == 'decode':
        return setup.PartitionsOnTime(p)
    return True


def _HoldsCheckpoint(logdir: str) -> bool:
    return checkpoints.AnyFiles(program.CheckpointDir(logdir))


def RunInspectParams(p, logdir: str) -> None:
    """Prints the Params text and writes it to params.txt, unless a trainer holds the logdir
    (its params.txt describes its run)."""
    text = p.ToText()
    print(text, end='', flush=True)
    try:
        with (logdir_lib.Lock(logdir) if logdir_lib.IsLocalPath(logdir) else
              contextlib.nullcontext()):
            print(f'# written to {logdir_lib.WriteParams(text, logdir)}', file=sys.stderr)
    except logdir_lib.LogdirBusyError as error:
        print(f'# not written: {error}', file=sys.stderr)


def RunInspectModel(config, p, plan) -> None:
    """Prints the partition table and the memory plan, and writes the pictures (--plot_dir)."""
    device_bytes = None
    if config.device_memory_gib is not None:
        if not config.device_memory_gib > 0:
            raise errors.ConfigError(f'--device_memory_gib must be > 0, got '
                                     f'{config.device_memory_gib}.')
        device_bytes = config.device_memory_gib * 2**30
    in_the_way = logdir_lib.FileInTheWay(config.plot_dir) if config.plot_dir else None
    if in_the_way:
        raise errors.ConfigError(f'--plot_dir={config.plot_dir}: {in_the_way} is a file, not a '
                                 'directory; expected a directory for the pictures (created if '
                                 'missing).')
    name = config.model
    print(reports.PartitionTable(p, name, plan))
    try:
        report = reports.MemoryTable(p, name, device_bytes, config.plot_dir, plan)
    except OSError as error:  # A directory this user may not write, say.
        raise errors.UserError(f'--plot_dir={config.plot_dir}: cannot write the pictures: '
                               f'{error.filename or config.plot_dir}: '
                               f'{(error.strerror or str(error)).lower()}.') from None
    except ValueError as error:
        if config.plot_dir or device_bytes is not None:
            raise errors.ConfigError(str(error)) from None
        # The partition table is the mode's promise; the memory plan needs more of the Params.
        report = f'No memory plan: {error}'
    print(report, flush=True)


def RunTrain(config, target: setup.Target, p, plan, logdir: str, with_eval: bool,
             resume_note: str = '') -> dict:
    eval_params = setup.TaskParams(config, p.train.eval_dataset).input if with_eval else None
    start = time.time()
    print(f'building {config.model}: its variables on their devices and the input pipeline',
          flush=True)
    prog = setup.Program(config, target, p, plan, logdir)
    print(f'built in {time.time() - start:.0f} s', flush=True)
    fprop_dtype = prog.task.model.p.fprop_dtype
    computing = '' if fprop_dtype is None else f', computing in {fprop_dtype.name}'
    m = 1 if plan is None else plan_lib.NumMicroBatches(plan.params, p.input.batch_size,
                                                         equal=False)
    print(f'training {config.model} in {logdir}: {_Where(target, prog)}, M={m}'
          # The built model's plan: the TPU path's adds a logical_device_fn (then unrolled).
          f'{_ScheduleNote(getattr(prog.task.model, "plan", None), m)}, '
          f'batch {p.input.batch_size}, {target.graph_mode}{computing}', flush=True)
    metrics = loop.Train(prog, p, logdir, p.train.max_steps, eval_params, plan=plan,
                         resume_note=resume_note)
    # Greedy decoding runs eagerly, outside a TPU strategy's replicas.
    translates = 'translation' in prog.task.p and bool(prog.task.p.translation)
    if with_eval and translates and target.graph_mode != 'v1' and target.tpu is None:
        metrics['eval_bleu'] = ReportBleu(prog, eval_params, p.train.eval_dataset, logdir)
    if 'eval_accuracy' in metrics:
        print(f'final {p.train.eval_dataset.lower()} accuracy {metrics["eval_accuracy"]:.4f}',
              flush=True)
    print(f'logdir: {logdir}', flush=True)
    return metrics


def _Where(target: setup.Target, prog) -> str:
    """Where training runs, for the first line of a training run."""
    model = prog.task.model
    strategy = getattr(prog, 'strategy', None)
    if strategy is not None:
        plan = getattr(model, 'plan', None)
        num_devices = model.num_cells if plan is None else plan.num_devices
        return (f'R={strategy.num_replicas_in_sync} replicas x K={num_devices} logical '
                f'devices on the TPU {target.tpu}')
    replicas = f'R={len(model.mesh)} replicas x ' if len(model.mesh) > 1 else ''
    return (f'{replicas}K={len(model.devices)} cells on '
            f'{model.mesh if len(model.mesh) > 1 else model.devices}')


def _ScheduleNote(plan, num_micro_batches: int) -> str:
    """' (<schedule> schedule, <executor>)' for the first line of a training run; '' for a
    model that is not a pipeline."""
    if plan is None:
        return ''
    return f' ({plan.params.schedule} schedule, {executor.Choose(plan, num_micro_batches)})'


def ReportBleu(prog, eval_params, name: str, logdir: str, num_samples: int = 5) -> float:
    """Greedy-decodes `eval_params`' data, prints its BLEU and a few translations, and writes
    the BLEU and every translation (`<logdir>/decode_<step>.tsv`)."""
    start = time.time()
    bleu, rows = decode.EvaluateBleu(prog.task, eval_params)
    step = prog.CurrentStep()
    path = logdir_lib.WriteAtomically(
        os.path.join(logdir, f'decode_{name.lower()}_{step}.tsv'),
        'source\thypothesis\treference\n' + ''.join('\t'.join(row) + '\n' for row in rows),
        'the translations')
    with loop.SummaryWriter(os.path.join(logdir, 'eval')).as_default():
        tf.summary.scalar('bleu', bleu, step=step)
    print(f'{name} BLEU {bleu:.2f} on {len(rows)} sentences, greedy decoding '
          f'({time.time() - start:.0f} s; translations in {path})', flush=True)
    for source, hypothesis, reference in rows[:num_samples]:
        print(f'  {source!r} -> {hypothesis!r} (reference {reference!r})', flush=True)
    return bleu


# How often eval and decode look for the newest checkpoint again when the one they found is
# deleted under them by a trainer's max_to_keep.
_RESTORE_ATTEMPTS = 5


def _RestoredProgram(config, target: setup.Target, p, plan, logdir: str):
    """(the program, its step) with the newest checkpoint that restores, read-only: for eval
    and decode, which may run beside a trainer.

    Raises:
      errors.UserError: if `logdir` holds no checkpoint.
    """
    directory = program.CheckpointDir(logdir)
    found = checkpoints.Choose(directory, writer=False)
    if found.path is None:
        raise errors.UserError(f'{config.mode}: no checkpoint under {directory}; train first '
                               '(--mode=train).')
    for attempt in range(_RESTORE_ATTEMPTS):
        # A program of its own per attempt: a restore that failed part-way leaves restorations
        # queued on the objects it had not made yet (the checkpoint's save counter), which the
        # next attempt's restore would run, reading the deleted checkpoint again.
        prog = setup.Program(config, target, p, plan, logdir)
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
            found = checkpoints.Choose(directory, writer=False)


def RunEval(config, target: setup.Target, p, plan, logdir: str) -> dict:
    prog, step = _RestoredProgram(config, target, p, plan, logdir)
    eval_params = setup.TaskParams(config, p.train.eval_dataset).input
    writer = loop.SummaryWriter(os.path.join(logdir, 'eval'))
    return loop.Evaluate(prog, eval_params, writer, step, p.train.eval_dataset)


def DecodeRequest(config, target: setup.Target, p) -> list[str]:
    """The lines to decode (--decode_input, then --decode_input_file's), checked against task
    Params `p` before any device is set up or model built.

    Raises:
      errors.UserError: no lines, a TPU, a --decode_input_file that is not a UTF-8 text file,
        or a request the task cannot serve (a translation without a known --target_language,
        a sentence too long, a missing image file).
    """
    if target.tpu is not None:
        raise errors.UserError('decode runs eagerly on this machine\'s devices, not on a TPU: drop '
                               '--tpu and --run_locally=tpu.')
    # Blank items and lines are dropped alike: neither is an image path or a sentence.
    lines = [line for line in config.decode_input if line.strip()]
    if config.decode_input_file:
        text = setup.ReadTextFile('--decode_input_file', config.decode_input_file,
                                  'one image path or sentence per line')
        lines += [line for line in text.split('\n') if line.strip()]
    if not lines:
        raise errors.UserError(_EmptyRequest(config.decode_input, config.decode_input_file))
    try:
        decode.CheckRequest(p, lines, config.target_language)
    except (ValueError, FileNotFoundError) as error:
        raise errors.UserError(str(error)) from None
    return lines


def _EmptyRequest(decode_input, decode_input_file: str | None) -> str:
    """The message for a decode request with nothing to decode, naming what was given."""
    if decode_input_file:
        blank_items = ', and --decode_input only blank items' if decode_input else ''
        return (f'decode: --decode_input_file={decode_input_file} holds no non-blank line'
                f'{blank_items}; expected one image path or sentence per line.')
    if decode_input:
        return ('decode: --decode_input holds only blank items; expected image paths or '
                'sentences, comma-separated.')
    return 'decode: give --decode_input (comma-separated) or --decode_input_file.'


def RunDecode(config, target: setup.Target, p, plan, logdir: str,
              lines: list[str]) -> list[str]:
    prog, _ = _RestoredProgram(config, target, p, plan, logdir)
    results = decode.Decode(prog.task, p, lines, config.target_language)
    for source, result in results:
        print(f'{source}\t{result}', flush=True)
    return results


def CheckExport(config, target: setup.Target, p) -> None:
    """Checks an export request before any device is set up or model built.

    Raises:
      errors.UserError: for a TPU or the v1 graph path (a SavedModel is saved from TF2
        functions), or a task that cannot be exported.
    """
    if target.tpu is not None:
        raise errors.UserError('export runs on this machine\'s devices, not on a TPU: drop --tpu '
                               'and --run_locally=tpu.')
    if target.graph_mode == 'v1':
        raise errors.UserError('export saves TF2 functions: drop --graph_mode=v1 and '
                               '--cluster_spec (export on one machine).')
    exportable = (issubclass(p.cls, classifier.ClassifierTask) or
                  (issubclass(p.cls, sequence.SequenceTask) and p.translation))
    if not exportable:
        raise errors.UserError(f'export: {config.model} cannot be exported; export serves image '
                               'classifiers and translation models.')


def RunExport(config, target: setup.Target, p, plan, logdir: str) -> str:
    """Exports the newest checkpoint to `<logdir>/export/<step>`; prints the path."""
    if config.export_on_one_device:
        p = p.Copy()
        p.model.devices = [plan.mesh[0][0]] * (plan.num_devices * p.model.num_replicas)
    base = os.path.join(logdir, 'export')
    try:
        export.CheckBase(base)  # Before the checkpoint is restored.
    except NotADirectoryError as error:
        raise errors.UserError(str(error)) from None
    print(f'export: restoring the newest checkpoint of {logdir}', flush=True)
    prog, step = _RestoredProgram(config, target, p, plan, logdir)
    try:
        path = export.Export(prog.task, p, export.VersionDir(base, step),
                             report=lambda line: print(line, flush=True))
    except (FileExistsError, NotADirectoryError) as error:
        raise errors.UserError(str(error)) from None
    print(f'exported step {step} to {path}', flush=True)
    return path
