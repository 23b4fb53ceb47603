"""Finding the checkpoint a run resumes from, so that no accident to the files loses work.

`tf.train.CheckpointManager` trusts the `checkpoint` index file: with the index deleted or
garbled it sees no checkpoint, the run starts at step 0, overwrites `ckpt-N` under the same names
and then deletes them as old. And a damaged newest checkpoint fails the restore, although an
earlier one is intact. Here the files on disk are the truth:

- the candidates are every `ckpt-N` with an `.index` file, newest first, whatever the index
  says (the index only adds a warning when it is missing or garbled while checkpoints exist);
- a candidate is used only once every tensor of it reads back (TensorFlow checks each tensor's
  checksum on reading), so a truncated or corrupted one is found before it half-restores;
- damaged checkpoints, and the leftovers of a save that never finished (`ckpt-N_temp/`, data
  files without an index), are moved to `train/damaged/`, never deleted; then the index is
  rewritten to list what is on disk, so that the manager's `max_to_keep` only ever deletes
  checkpoints older than a complete newer one.

Only a trainer, which holds the logdir's lock (`gpipe_tf.train.logdir`), moves files; eval and
decode read the same way and leave everything in place.
"""

from __future__ import annotations

import dataclasses
import os
import re

import tensorflow as tf

from gpipe_tf import errors
from gpipe_tf.train import logdir as logdir_lib

PREFIX = 'ckpt'
DAMAGED_DIR = 'damaged'
INDEX_FILE = 'checkpoint'
# The files of one checkpoint: `ckpt-N.index`, `ckpt-N.data-00000-of-00001`.
_FILE = re.compile(rf'^{PREFIX}-(\d+)\.(index|data-\d+-of-\d+)$')
# What a save writes before it renames its files into place.
_UNFINISHED = re.compile(rf'^{PREFIX}-(\d+)_temp')


class NoCheckpointRestoresError(errors.UserError):
    """Checkpoint files exist and none of them restores."""


@dataclasses.dataclass(frozen=True)
class Damaged:
    """A checkpoint that does not read back: its prefix and the first line of the error."""
    prefix: str
    problem: str


@dataclasses.dataclass(frozen=True)
class Found:
    """What a checkpoint directory holds.

    Attributes:
      path: the newest checkpoint that reads back completely, or None.
      step: the number in its name (the global step it was saved at); 0 without one.
      damaged: newer checkpoints that do not read back, newest first.
      unfinished: files and folders left by saves that never finished.
      index_problem: why the `checkpoint` index file cannot be trusted, or None.
    """
    path: str | None
    step: int
    damaged: tuple[Damaged, ...]
    unfinished: tuple[str, ...]
    index_problem: str | None

    @property
    def any_files(self) -> bool:
        return bool(self.path or self.damaged or self.unfinished)


def _ListDir(directory: str) -> list[str]:
    """Names in `directory` ([] if it is missing); tf.io.gfile, so that gs:// logdirs work."""
    if not tf.io.gfile.isdir(directory):
        return []
    return [name.rstrip('/') for name in tf.io.gfile.listdir(directory)]


def _Step(prefix: str) -> int:
    return int(prefix.rsplit('-', 1)[1])


def Prefixes(directory: str) -> list[str]:
    """Every `ckpt-N` under `directory` that has an `.index` file, newest first."""
    steps = {int(m.group(1)) for m in map(_FILE.match, _ListDir(directory))
             if m and m.group(2) == 'index'}
    return [os.path.join(directory, f'{PREFIX}-{step}') for step in sorted(steps, reverse=True)]


def AnyFiles(directory: str) -> bool:
    """Whether `directory` holds any checkpoint file: complete, damaged or unfinished (cheap:
    names only, nothing read)."""
    return bool(Prefixes(directory) or Unfinished(directory))


def Unfinished(directory: str) -> list[str]:
    """Paths left by saves that never finished: `ckpt-N_temp*` folders, and data files of a
    `ckpt-N` without an `.index`."""
    names = _ListDir(directory)
    indexed = {m.group(1) for m in map(_FILE.match, names) if m and m.group(2) == 'index'}
    return sorted(os.path.join(directory, n) for n in names
                  if _UNFINISHED.match(n) or
                  ((m := _FILE.match(n)) and m.group(2) != 'index' and m.group(1) not in indexed))


def FirstLine(error: Exception) -> str:
    """`Type: the first line of the message that says something`, at most 200 characters of
    it."""
    line = errors.Reason(error)[:200]
    return f'{type(error).__name__}: {line}' if line else type(error).__name__


class UnreadableCheckpointError(errors.UserError):
    """A checkpoint whose files this user may not read."""


def Verify(prefix: str) -> str | None:
    """Why the checkpoint at `prefix` does not read back, or None when every tensor does.

    Reading checks each tensor's size and checksum; a tensor at a time, so the memory used is
    that of the largest variable.

    Raises:
      UnreadableCheckpointError: when this user may not read its files: not damage, and
        nothing is to be set aside for it.
      tf.errors.UnavailableError, tf.errors.DeadlineExceededError: a remote file system that
        did not answer (not damage either).
    """
    try:
        reader = tf.train.load_checkpoint(prefix)
        for key in reader.get_variable_to_shape_map():
            reader.get_tensor(key)
    except tf.errors.PermissionDeniedError as error:
        raise UnreadableCheckpointError(
            f'cannot read the checkpoint {prefix}: {FirstLine(error)}; make its files '
            'readable by this user (nothing was moved or changed).') from None
    except (tf.errors.UnavailableError, tf.errors.DeadlineExceededError):
        raise
    except Exception as error:  # pylint: disable=broad-except
        # Damage shows as OpError (bad magic number, checksum), IndexError (a truncated data
        # file) and others: any failure to read means the checkpoint cannot be restored.
        return FirstLine(error)
    return None


class _QuietTf:
    """Raises TensorFlow's Python logger to ERROR for a block: its warnings about a garbled
    index, or the deprecation of the v1 index writer, are ours to turn into one line."""

    def __enter__(self):
        self._level = tf.get_logger().level
        tf.get_logger().setLevel('ERROR')

    def __exit__(self, *exc):
        tf.get_logger().setLevel(self._level)


def _ReadIndex(directory: str):
    """(the index's CheckpointState or None, why it cannot be read or None)."""
    path = os.path.join(directory, INDEX_FILE)
    if not tf.io.gfile.exists(path):
        return None, 'missing'
    with _QuietTf():
        try:
            state = tf.train.get_checkpoint_state(directory)
        except Exception as error:  # pylint: disable=broad-except
            return None, f'garbled ({FirstLine(error)})'
    if state is None:  # TensorFlow could not parse it (and said so in a warning).
        return None, 'garbled'
    return state, None


def IndexProblem(directory: str, prefixes: list[str]) -> str | None:
    """Why the `checkpoint` index cannot be trusted (missing or garbled while checkpoints
    exist, or naming one whose files are gone), or None."""
    path = os.path.join(directory, INDEX_FILE)
    state, problem = _ReadIndex(directory)
    if problem:
        return f'the index {path} is {problem}' if prefixes else None
    if not state.model_checkpoint_path:
        return f'the index {path} names no checkpoint' if prefixes else None
    named = os.path.join(directory, state.model_checkpoint_path)
    if not tf.io.gfile.exists(named + '.index'):
        return f'the index {path} names {named}, which is not on disk'
    return None


def Find(directory: str) -> Found:
    """The newest checkpoint under `directory` that reads back, and what is wrong with the
    rest (see the module docstring). Reads, never changes, the files."""
    prefixes = Prefixes(directory)
    damaged = []
    path = None
    for prefix in prefixes:
        problem = Verify(prefix)
        if problem is None:
            path = prefix
            break
        damaged.append(Damaged(prefix, problem))
    return Found(path=path, step=_Step(path) if path else 0, damaged=tuple(damaged),
                 unfinished=tuple(Unfinished(directory)),
                 index_problem=IndexProblem(directory, prefixes))


def Warnings(found: Found) -> list[str]:
    """One line per thing found wrong, for the user."""
    lines = []
    if found.index_problem and found.path:
        lines.append(f'{found.index_problem}; the checkpoint files on disk are used instead.')
    for item in found.damaged:
        lines.append(f'checkpoint {item.prefix} is damaged ({item.problem}); skipped'
                     + (f' for {found.path}.' if found.path else '.'))
    if found.unfinished:
        lines.append(f'left by a save that never finished: {", ".join(found.unfinished)}.')
    return lines


def NoneRestoresMessage(directory: str, found: Found, writer: bool) -> str:
    """Why nothing restores, and the way out: for a trainer (`writer`) --start_from_scratch;
    for a reader (eval, export, decode) training first."""
    names = [d.prefix for d in found.damaged] + list(found.unfinished)
    aside = f'they are moved to {os.path.join(directory, DAMAGED_DIR)}, not deleted'
    if writer:
        way_out = (f'To start at step 0 anyway, pass --start_from_scratch ({aside}), or use '
                   'another --logdir.')
    else:
        way_out = ('Nothing to read: train in this logdir again with --start_from_scratch '
                   f'({aside}), or pass a --logdir with a checkpoint that restores.')
    return (f'{directory} holds checkpoint files but none restores ({", ".join(names)}; '
            f'first problem: {found.damaged[0].problem if found.damaged else "unfinished save"}). '
            + way_out)


def _MoveAside(path: str, target_dir: str) -> str:
    tf.io.gfile.makedirs(target_dir)
    target = os.path.join(target_dir, os.path.basename(path))
    n = 1
    while tf.io.gfile.exists(target):
        target = os.path.join(target_dir, f'{os.path.basename(path)}.{n}')
        n += 1
    tf.io.gfile.rename(path, target)
    return target


def SetAside(directory: str, found: Found) -> list[str]:
    """Moves the damaged checkpoints and unfinished saves of `found` to `<directory>/damaged/`
    and rewrites the index to list the checkpoints left, oldest first, the newest sound one
    last. Returns the new paths of what was moved. Call only while holding the logdir's lock."""
    target_dir = os.path.join(directory, DAMAGED_DIR)
    moved = []
    for item in found.damaged:
        name = os.path.basename(item.prefix)
        for entry in sorted(_ListDir(directory)):
            if entry.startswith(name + '.'):
                moved.append(_MoveAside(os.path.join(directory, entry), target_dir))
    for path in found.unfinished:
        if tf.io.gfile.exists(path):
            moved.append(_MoveAside(path, target_dir))
    index = os.path.join(directory, INDEX_FILE)
    if found.path is None:
        if tf.io.gfile.exists(index):  # It names only what was just moved.
            moved.append(_MoveAside(index, target_dir))
    elif found.index_problem or _IndexLatest(directory) != found.path:
        # The manager deletes, after each save, the oldest checkpoints its index lists beyond
        # max_to_keep: list every one on disk, so none is kept or lost by accident.
        # (The manager only manages entries newer than `last_preserved_timestamp`.)
        kept = list(reversed(Prefixes(directory)))
        times = [tf.io.gfile.stat(prefix + '.index').mtime_nsec / 1e9 for prefix in kept]
        with _QuietTf():
            tf.compat.v1.train.update_checkpoint_state(
                directory, found.path, all_model_checkpoint_paths=kept,
                all_model_checkpoint_timestamps=times, last_preserved_timestamp=min(times) - 1.0)
    return moved


def _IndexLatest(directory: str) -> str | None:
    """The newest checkpoint the index names, as a path; None if it names none or is garbled."""
    state, _ = _ReadIndex(directory)
    if state is None or not state.model_checkpoint_path:
        return None
    return os.path.join(directory, state.model_checkpoint_path)


def Choose(directory: str, writer: bool, start_from_scratch: bool = False) -> Found:
    """The newest checkpoint in `directory` that restores (`Found`), after a warning per damaged
    or unfinished one. A `writer` (a trainer, holding the lock) moves those to damaged/ and
    repairs the index.

    Raises:
      NoCheckpointRestoresError: if checkpoint files exist and none restores (for a trainer,
        unless --start_from_scratch or all are unfinished saves).
      UnreadableCheckpointError: for a checkpoint this user may not read.
    """
    found = Find(directory)
    for line in Warnings(found):
        errors.Warn(line)
    # Saves that never finished hold nothing a checkpoint could give back: a trainer sets them
    # aside and starts at step 0 (a failed first save says to run the command again).
    only_unfinished = found.unfinished and not found.damaged
    if (found.path is None and found.any_files and
            not (writer and (start_from_scratch or only_unfinished))):
        raise NoCheckpointRestoresError(NoneRestoresMessage(directory, found, writer))
    if found.path is not None and start_from_scratch:
        raise errors.UserError(f'--start_from_scratch: {found.path} restores; resume from it '
                               '(drop the flag), or pass another --logdir to start over.')
    if writer and found.any_files:
        with logdir_lib.Writing(directory, 'the checkpoints set aside and their index'):
            moved = SetAside(directory, found)
        if moved:
            errors.Warn(f'moved {len(moved)} damaged or unfinished checkpoint file(s) to '
                        f'{os.path.join(directory, DAMAGED_DIR)}.')
    return found

