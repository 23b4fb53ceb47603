"""The training loop: steps, checkpoints, TensorBoard scalars and pictures, console progress,
evaluation.

Works on either training program of `gpipe_tf.train.program`. A checkpoint is written every
`save_interval_steps`, at the end, and when the run is interrupted (Ctrl-C or SIGTERM), so no
finished step is lost; a restart with the same logdir resumes from the latest one.

Once per run (`train.plot_pipeline`), the pipeline's pictures go to TensorBoard as images: the
plan from Params (`pipeline/cell_costs`, `pipeline/timeline_predicted`, `pipeline/memory`) and
`pipeline/timeline_measured`, the timeline of one real training step traced as it runs. The
traced step is the run's second (its first also traces and optimizes the step function and
creates the optimizer's slots), or its only one.
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import signal
import time

import tensorflow as tf
from absl import logging

from gpipe_tf import start_signals
from gpipe_tf.perf import pictures
from gpipe_tf.perf import plot
from gpipe_tf.pipeline import plan as plan_lib
from gpipe_tf.train import logdir as logdir_lib


def FormatDuration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    return f'{hours}:{minutes:02d}:{seconds:02d}' if hours else f'{minutes}:{seconds:02d}'


class Progress:
    """One console line every `interval` seconds: step, loss, examples/sec, ETA.

    The rate, and the ETA from it, are those of the recent lines only (the last
    RECENT_LINES): the first steps after tracing, or a busy moment of the machine, would
    otherwise skew them for the rest of the run. Time spent in `Excluding()` (an evaluation
    during training) is not training time: neither the rate nor the ETA counts it.
    """
    RECENT_LINES = 5

    def __init__(self, first_step: int, max_steps: int, batch_size: int, interval: float,
                 printer=print):
        self._first, self._max, self._batch = first_step, max_steps, batch_size
        self._interval, self._print = interval, printer
        self._last = None
        self._recent = collections.deque(maxlen=self.RECENT_LINES)  # (time, step) printed.

    def Update(self, step: int, metrics: dict, force: bool = False) -> None:
        now = time.time()
        if self._last is None:  # The first step includes tracing: time from after it.
            self._last = now
            self._recent.append((now, step))
            self._Print(step, metrics, None)
            return
        if not force and now - self._last < self._interval:
            return
        self._last = now
        since, since_step = self._recent[0]
        rate = (step - since_step) / (now - since) if now > since else None
        self._recent.append((now, step))
        self._Print(step, metrics, rate)

    @contextlib.contextmanager
    def Excluding(self):
        """A block whose time the rate and the ETA leave out: the recent lines' times move
        forward by it, as if it had not been."""
        start = time.time()
        try:
            yield
        finally:
            paused = time.time() - start
            self._recent = collections.deque(((t + paused, s) for t, s in self._recent),
                                             maxlen=self.RECENT_LINES)
            if self._last is not None:
                self._last += paused

    def _Print(self, step: int, metrics: dict, steps_per_sec) -> None:
        parts = [f'step {step:6d}/{self._max}', f'loss {metrics["loss"]:.4f}']
        for name in ('accuracy',):
            if name in metrics:
                parts.append(f'{name} {metrics[name]:.3f}')
        if steps_per_sec:
            parts.append(f'{steps_per_sec * self._batch:,.0f} examples/sec')
            parts.append(f'ETA {FormatDuration((self._max - step) / steps_per_sec)}')
        self._print('  '.join(parts), flush=True)


class Interrupted(BaseException):
    """SIGINT, SIGTERM or SIGHUP stopped training; the step it stopped at is saved. Not an
    Exception, so that code which must not stop training (the pictures) cannot swallow it.

    Attributes:
      signum: the signal.
      step: the last finished step.
      checkpoint: the checkpoint holding it (None if saving failed).
    """

    def __init__(self, signum: int, step: int = 0, checkpoint: str | None = None):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.step, self.checkpoint = signum, step, checkpoint


class NonFiniteLossError(FloatingPointError):
    """The loss became NaN or infinite: training stops and keeps the last good checkpoint."""


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class _StopSignals:
    """While active, SIGINT, SIGTERM and SIGHUP stop training at the next safe point, between
    two steps: the handler only records the signal, and the loop raises `Interrupted`.

    Raising in the handler itself is unsafe: it runs at whatever Python bytecode comes next,
    which may be TensorFlow translating one of its C++ errors into Python (seen: pybind11's
    `error_already_set ... MISMATCH`, the DeadlineExceededError replaced by the signal's) or the
    middle of a checkpoint write (an orphan data file). A second signal during a step does stop
    it at once, so that a step that hangs can still be interrupted; never during a save.
    """

    def __init__(self):
        self._previous, self._saving, self.pending = {}, False, None

    def __enter__(self):
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._Handle)
        # A SIGINT the start-up received but did not stop on (`start_signals`): the first
        # safe point stops.
        self.pending = start_signals.Pending()
        return self

    def __exit__(self, *exc):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _Handle(self, signum, frame):
        del frame
        if self.pending is None:
            self.pending = signum
        elif not self._saving:
            raise Interrupted(self.pending)

    def RaiseIfPending(self) -> None:
        if self.pending is not None:
            raise Interrupted(self.pending)

    @contextlib.contextmanager
    def Saving(self):
        """A block no signal interrupts (a checkpoint being written)."""
        self._saving = True
        try:
            yield
        finally:
            self._saving = False


def SummaryWriter(directory: str):
    """tf.summary.create_file_writer(`directory`), a failure as one line (`logdir.Writing`)."""
    with logdir_lib.Writing(directory, 'the summaries'):
        return tf.summary.create_file_writer(directory)


def WriteScalars(writer, step: int, metrics: dict, prefix: str = '') -> None:
    with logdir_lib.Writing(None, 'the summaries'), writer.as_default():
        for name, value in metrics.items():
            tf.summary.scalar(prefix + name, value, step=step)
        writer.flush()


def PipelineFigures(task_params, plan, step: int, step_trace) -> dict:
    """The pictures of task Params' pipeline: the plan's and, from `step_trace`
    (`program.StepTrace` of `step`), the measured timeline. A picture that cannot be drawn is
    left out with a warning: pictures never stop training.

    Args:
      plan: the pipeline's plan (`pipeline.plan.MakePlan` of `task_params.model`), made once by
        the caller; None for a model that is not a pipeline (no picture, a warning).
    """
    name = task_params.name
    if plan is None:
        logging.warning('No pipeline pictures of %s: its model is not a PipeliningLayer.', name)
        return {}
    figures = {}
    try:
        figures.update(pictures.Figures(pictures.Plan(task_params, pipeline_plan=plan), name))
    except Exception as error:  # pylint: disable=broad-except
        logging.warning('No plan pictures of %s: %s', name, error)
    if step_trace.events is None:
        logging.warning('No measured timeline of %s: tracing step %d failed: %s', name, step,
                        step_trace.error)
        return figures
    try:
        num_micro_batches = plan_lib.NumMicroBatches(
            plan.params, task_params.input.batch_size, equal=False)
        figures['timeline_measured'] = pictures.MeasuredTimelineFigure(
            step_trace.events, plan.num_cells, num_micro_batches,
            f'{name}\nmeasured step {step}', sched=plan.Schedule(num_micro_batches))
    except Exception as error:  # pylint: disable=broad-except
        logging.warning('No measured timeline of %s: %s', name, error)
    return figures


def WritePipelinePictures(writer, step: int, task_params, plan, step_trace) -> list[str]:
    """Writes `PipelineFigures` as TensorBoard images 'pipeline/<name>' at `step`; returns
    their tags. Failures are warnings, never errors."""
    tags = []
    with writer.as_default():
        for key, figure in PipelineFigures(task_params, plan, step, step_trace).items():
            try:
                tf.summary.image(f'pipeline/{key}', plot.ImageArray(figure), step=step)
                tags.append(f'pipeline/{key}')
            except Exception as error:  # pylint: disable=broad-except
                logging.warning('Could not write the picture pipeline/%s: %s', key, error)
    writer.flush()
    return tags


def Evaluate(program, input_params, writer, step: int, name: str, printer=print) -> dict:
    start = time.time()
    metrics = program.Evaluate(input_params)
    WriteScalars(writer, step, metrics)
    text = '  '.join(f'{k} {v:.4f}' for k, v in sorted(metrics.items()))
    printer(f'eval {name} at step {step}: {text}  ({time.time() - start:.1f} s)', flush=True)
    return metrics


def Train(program, task_params, logdir: str, max_steps: int, eval_params=None,
          printer=print, plan=None, resume_note: str = '') -> dict:
    """Trains `program` until `max_steps`; returns the last step's metrics (and `eval_*`).

    SIGINT, SIGTERM and SIGHUP stop training after the step that runs (a second one at once,
    except while a checkpoint is written), save that step, then raise `Interrupted`.

    Args:
      eval_params: input Params evaluated every `eval_interval_steps` and at the end (the
        train_and_eval mode), or None.
      plan: the pipeline's plan, for the pictures (`train.plot_pipeline`); None for a model
        that is not a pipeline.
      resume_note: added to the line that reports a resume (`partition_change.Describe`).
    """
    train = task_params.train
    step = program.Restore()
    if step:
        note = f'; {resume_note}' if resume_note else ''
        printer(f'resumed from {program.manager.latest_checkpoint} at step {step}{note}',
                flush=True)
    if step >= max_steps:
        printer(f'already at step {step} >= max_steps {max_steps}; nothing to train.' if step
                else f'max_steps {max_steps} trains no step; no checkpoint is written.',
                flush=True)
    writer = SummaryWriter(os.path.join(logdir, 'train'))
    eval_writer = (SummaryWriter(os.path.join(logdir, 'eval'))
                   if eval_params is not None else None)
    batch_size = task_params.input.batch_size
    progress = Progress(step, max_steps, batch_size, train.progress_interval_seconds, printer)
    traced_step = min(step + 2, max_steps) if train.plot_pipeline else None
    metrics, last_saved = {}, step
    if step < max_steps:
        printer('running the first step: TensorFlow builds and optimizes the step\'s graph '
                'once, so it takes longer than the steps after it', flush=True)
    signals = _StopSignals().__enter__()
    try:
        while step < max_steps:
            signals.RaiseIfPending()
            start = time.time()
            if step + 1 == traced_step:
                metrics, step_trace = program.TracedStep()
            else:
                metrics = program.Step()
            elapsed = time.time() - start
            step += 1
            if not math.isfinite(metrics['loss']):
                # This step's update is applied already: it is not saved.
                raise NonFiniteLossError(
                    f'The loss is {metrics["loss"]} at step {step}: training stopped. The last '
                    f'good checkpoint is {program.manager.latest_checkpoint}; lower the learning '
                    'rate or clip gradients (train.clip_gradient_norm_to_value) and restart.')
            progress.Update(step, metrics, force=step == max_steps)
            if step == traced_step:
                tags = WritePipelinePictures(writer, step, task_params, plan, step_trace)
                if tags:
                    printer(f'pipeline pictures at step {step} in TensorBoard: '
                            f'{", ".join(tags)}', flush=True)
            if step % train.summary_interval_steps == 0 or step == max_steps:
                WriteScalars(writer, step, dict(
                    metrics, learning_rate=program.LearningRate(), step_time=elapsed,
                    examples_per_sec=batch_size / elapsed if elapsed > 0 else 0.0))
            if step % train.save_interval_steps == 0:
                with signals.Saving():
                    program.Save()
                    last_saved = step
            if (eval_writer is not None and train.eval_interval_steps and
                    step % train.eval_interval_steps == 0 and step < max_steps):
                with progress.Excluding():  # Not training: the ETA leaves it out.
                    Evaluate(program, eval_params, eval_writer, step, 'during training',
                             printer)
        signals.RaiseIfPending()
        if step != last_saved:
            with signals.Saving():
                program.Save()
                last_saved = step
        signals.RaiseIfPending()  # A signal held while the last checkpoint was written.
    except Interrupted as interrupted:
        with signals.Saving():
            # The program's step: a second signal may have stopped a step half-way.
            interrupted.step = program.CurrentStep()
            logging.warning('Interrupted at step %d (%s); saving a checkpoint.',
                            interrupted.step, interrupted)
            interrupted.checkpoint = (program.Save() if interrupted.step != last_saved else
                                      program.manager.latest_checkpoint)
        printer(f'interrupted: saved {interrupted.checkpoint} at step {interrupted.step}',
                flush=True)
        raise
    finally:
        signals.__exit__()
    checkpoint = program.manager.latest_checkpoint
    if checkpoint:  # None only where no step ran: the line above said so.
        printer(f'checkpoint {checkpoint} at step {step}', flush=True)
    if eval_writer is not None:
        evaluation = Evaluate(program, eval_params, eval_writer, step, 'final', printer)
        metrics = dict(metrics, **{f'eval_{k}': v for k, v in evaluation.items()})
    return metrics
