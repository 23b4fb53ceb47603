"""How the looped executor (`looped.LoopedSchedule`) stores micro-batches between the actions
of its loop: which TensorArrays each action reads and writes (`ArrayAccess`), how many
micro-batches each must hold at once (`RingSizes`: a ring, not M slots, so that what is no longer
read is freed), and a micro-batch's residuals packed into one array per dtype (`Packing`).
"""

from __future__ import annotations

import tensorflow as tf

from gpipe_tf.pipeline import schedule as schedule_lib

F = schedule_lib.FORWARD
I, W = schedule_lib.INPUT_GRAD, schedule_lib.WEIGHT_GRAD


def ArrayAccess(kind: str, s: int, num_stages: int, loss_in_loop: bool,
                keep: bool = False) -> tuple:
    """(the TensorArray keys action (kind, stage s) reads, its input first, and those it writes),
    each for its micro-batch: F reads its input and writes its output (the last stage, with the
    loss in the loop, the outputs' gradient too; a stage that keeps its residuals, `keep`, also
    those); B and I read the input (`keep`: the kept residuals) and the output's gradient and
    write the input's gradient, I also what it saves for its W; W reads what its I saved."""
    if kind == F:
        writes = [('act', s + 1)]
        if s == num_stages - 1 and loss_in_loop:
            writes.append(('d_act', num_stages))
        return [('act', s)], writes + ([('kept', s)] if keep else [])
    if kind == W:
        return [('saved', s)], []
    source = ('kept', s) if keep else ('act', s)
    return [source, ('d_act', s + 1)], [('d_act', s)] + ([('saved', s)] if kind == I else [])


def RingSizes(sched: schedule_lib.Schedule, phases, loss_in_loop: bool,
               reuse_in_tick: bool = True, keeps=None) -> dict:
    """Per TensorArray key ('act', b), ('d_act', b), ('kept', s) or ('saved', s), how many
    micro-batches it holds: the smallest R such that micro-batch m + R is written (slot
    (m + R) mod R) no earlier than the tick of micro-batch m's last read. A loop's tick reads
    the arrays as they were when it began, so a write in the tick of the last read is safe.
    Values no longer in a ring are freed: with 1F1B a boundary holds about K - b micro-batches,
    a gradient one or two, where M slots would keep every micro-batch until the step ends.

    Args:
      sched: the schedule.
      phases: per loop of the step, in order, the action kinds it runs.
      loss_in_loop: whether the last stage's forwards write the outputs' gradients (the loss
        inside the loop); otherwise they are given, all at once, before the second loop.
      reuse_in_tick: whether a slot may be written in the tick of its last read (in a graph,
        where a tick reads the arrays as they were when it began); False: only after it (when
        executing eagerly, where a write changes the array in place).
      keeps: per stage, whether its forward keeps its residuals for its backward (default:
        none does).
    """
    m_count, last = sched.num_micro_batches, sched.num_stages
    keeps = keeps or [False] * last
    writes, reads = {}, {}  # key -> {micro-batch: tick}

    def Write(key, m, tick):
        writes.setdefault(key, {})[m] = tick

    def Read(key, m, tick):
        reads.setdefault(key, {})[m] = max(reads.get(key, {}).get(m, tick), tick)

    tick = 0
    for m in range(m_count):
        Write(('act', 0), m, -1)
    for p, kinds in enumerate(phases):
        if p > 0 and not loss_in_loop:
            for m in range(m_count):
                Write(('d_act', last), m, tick - 1)
        for actions in schedule_lib.Ticks(sched, kinds):
            for a in actions:
                if a is None:
                    continue
                read, written = ArrayAccess(a.kind, a.stage, last, loss_in_loop,
                                             keeps[a.stage])
                for key in read:
                    Read(key, a.micro_batch, tick)
                for key in written:
                    Write(key, a.micro_batch, tick)
            tick += 1
        if p == 0:  # The outputs, joined after the first loop.
            for m in range(m_count):
                Read(('act', last), m, tick)
    for m in range(m_count):  # The inputs' gradients, joined at the end.
        Read(('d_act', 0), m, tick)
    sizes = {}
    after = 0 if reuse_in_tick else 1
    for key in set(writes) | set(reads):
        written, read = writes.get(key, {}), reads.get(key, {})
        sizes[key] = next(r for r in range(1, m_count + 1) if all(
            written.get(m + r, float('inf')) >= read.get(m, float('-inf')) + after
            for m in range(m_count - r)))
    return sizes


class Packing:
    """Tensors of static shapes (a micro-batch's residuals) as one tensor per dtype and back:
    `specs` (None where a shape is not static: then nothing is packed), `Pack`, `Unpack`.
    Packing copies them once, at the write; the loop then carries one TensorArray per dtype
    instead of one per tensor. Each tensor takes whole rows of 64 bytes, so that unpacking
    splits the rows without a copy (TensorFlow shares the buffer of a split along the first
    dimension when the rows are aligned) and only a tensor not filling its last row is copied
    out of it. The tensors at positions `loose` are not packed but follow the packed ones as
    they are (stored as themselves, they share their buffers: a boundary's activation kept
    for the backward would otherwise be held twice while its boundary's array holds it too)."""

    _ROW_BYTES = 64

    def __init__(self, specs, loose=()):
        self._specs = list(specs)
        self._loose = sorted(set(loose))
        packed = [x for i, x in enumerate(self._specs) if i not in self._loose]
        self._dtypes = list(dict.fromkeys(x.dtype for x in packed))
        if not self._specs or not all(x.shape.is_fully_defined() for x in self._specs):
            self.specs = None
            return
        self._sizes = [x.shape.num_elements() for x in self._specs]
        self._columns = {dtype: max(1, self._ROW_BYTES // dtype.size) for dtype in self._dtypes}
        self._rows = [None if i in self._loose else -(-n // self._columns[x.dtype])
                      for i, (x, n) in enumerate(zip(self._specs, self._sizes))]
        self.specs = [tf.TensorSpec([sum(r for x, r in zip(self._specs, self._rows)
                                         if r is not None and x.dtype == dtype),
                                     self._columns[dtype]], dtype)
                      for dtype in self._dtypes] + [self._specs[i] for i in self._loose]

    def Pack(self, flat: list) -> list:
        packed = []
        for dtype in self._dtypes:
            columns = self._columns[dtype]
            rows = []
            for x, spec, n, r in zip(flat, self._specs, self._sizes, self._rows):
                if r is not None and spec.dtype == dtype:
                    x = tf.reshape(x, [-1])
                    if r * columns > n:
                        x = tf.concat([x, tf.zeros([r * columns - n], dtype)], axis=0)
                    rows.append(tf.reshape(x, [r, columns]))
            packed.append(tf.concat(rows, axis=0) if len(rows) > 1 else rows[0])
        return packed + [flat[i] for i in self._loose]

    def Unpack(self, packed: list) -> list:
        loose = dict(zip(self._loose, packed[len(self._dtypes):]))
        parts = {}
        for dtype, array in zip(self._dtypes, packed):
            rows = [r for x, r in zip(self._specs, self._rows)
                    if r is not None and x.dtype == dtype]
            parts[dtype] = iter(tf.split(array, rows) if len(rows) > 1 else [array])
        flat = []
        for i, (x, n) in enumerate(zip(self._specs, self._sizes)):
            if i in loose:
                flat.append(loose[i])
                continue
            part = next(parts[x.dtype])
            if part.shape.num_elements() > n:
                part = tf.reshape(part, [-1])[:n]
            flat.append(tf.reshape(part, x.shape))
        return flat
