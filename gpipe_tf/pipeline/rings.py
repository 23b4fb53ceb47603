"""How the looped executor (`looped.LoopedSchedule`) stores micro-batches between the actions
of its loop: which TensorArrays each action reads and writes (`ArrayAccess`), how many
micro-batches each must hold at once (`RingSizes`: a ring, not M slots, so that what is no longer
read is freed), the skips sent past the stages that only pass them on (`Routes`), and a
micro-batch's residuals as items of one array per dtype (`Packing`).
"""

from __future__ import annotations

from typing import NamedTuple

import tensorflow as tf

from gpipe_tf.pipeline import schedule as schedule_lib
from gpipe_tf.pipeline import ticks as ticks_lib

F = schedule_lib.FORWARD
I, W = schedule_lib.INPUT_GRAD, schedule_lib.WEIGHT_GRAD


class Route(NamedTuple):
    """A tensor that stages pass on unread (`BaseLayer.PassedLeaves`: a skip), kept in a ring
    ('skip', j) of its own from the stage that makes it to the one that reads it, and its
    gradient ('d_skip', j) the way back, so that nothing of it goes through the stages
    between. Boundary b is stage b's input (0: the pipeline's, S: its output)."""
    start: int  # The boundary where it is made: stage start - 1's output, or the input (0).
    source: int  # Its leaf index there.
    end: int  # The boundary where it is read: stage end's input, or the output (S).
    target: int  # Its leaf index there.
    writer: int  # The stage whose forward writes it: start - 1 (stage 0 for the input's).
    reader: int  # The stage whose forward reads it: end (the last one for the output's).
    differentiable: bool  # A float tensor, whose gradient goes back the same way.


def Routes(passed: list, floats: list) -> list:
    """The routes of the skips of a pipeline of S stages: `passed[s]`, stage s's {input leaf:
    output leaf} it gives on unread; `floats[b]`, per leaf of boundary b (0 to S), whether it
    is a float tensor. A skip starts where a stage passes on a leaf it did not receive passed
    on, and ends at the first stage that reads it (or the output)."""
    num_stages = len(passed)
    routes = []
    for b, stage_passed in enumerate(passed):
        for source, target in stage_passed.items():
            if b and source in passed[b - 1].values():
                continue  # Passed on to this stage too: a route that starts earlier.
            end = b + 1
            while end < num_stages and target in passed[end]:
                target = passed[end][target]
                end += 1
            routes.append(Route(b, source, end, target, max(b - 1, 0),
                                min(end, num_stages - 1), floats[b][source]))
    return routes


def ArrayAccess(kind: str, s: int, num_stages: int, loss_in_loop: bool,
                keep: bool = False, routes=()) -> tuple:
    """(the TensorArray keys action (kind, stage s) reads, its input first, and those it writes),
    each for its micro-batch: F reads its input and writes its output (the last stage, with the
    loss in the loop, the outputs' gradient too; a stage that keeps its residuals, `keep`, also
    those); B and I read the input (`keep`: the kept residuals) and the output's gradient and
    write the input's gradient, I also what it saves for its W; W reads what its I saved.
    A skip (`routes`) is written by its maker's F and read by its reader's F, and by the
    reader's B or I where they read the input; its gradient is written by the reader's B or I
    (by the last stage's F for an output's, with the loss in the loop) and read by the maker's
    B or I (the input's, joined after the loop)."""
    ends = [('skip', j) for j, r in enumerate(routes) if r.end == s]
    made = [('d_skip', j) for j, r in enumerate(routes) if r.end == s and r.differentiable]
    if kind == F:  # (A stage that is both a skip's maker and reader keeps it: no ring.)
        reads = [('act', s)] + [('skip', j) for j, r in enumerate(routes)
                                if r.reader == s != r.writer]
        writes = [('act', s + 1)] + [('skip', j) for j, r in enumerate(routes)
                                     if r.writer == s != r.reader]
        if s == num_stages - 1 and loss_in_loop:
            writes.append(('d_act', num_stages))
            writes += [('d_skip', j) for j, r in enumerate(routes)
                       if r.end == num_stages and r.differentiable]
        return reads, writes + ([('kept', s)] if keep else [])
    if kind == W:
        return [('saved', s)], []
    source = [('kept', s)] if keep else ([('act', s)] + ends)
    given = [('d_skip', j) for j, r in enumerate(routes)
             if r.start == s + 1 and r.differentiable]
    return (source + [('d_act', s + 1)] + given,
            [('d_act', s)] + made + ([('saved', s)] if kind == I else []))


def RingSizes(sched: schedule_lib.Schedule, phases, loss_in_loop: bool,
               reuse_in_tick: bool = True, keeps=None, routes=()) -> dict:
    """Per TensorArray key ('act', b), ('d_act', b), ('kept', s), ('saved', s), ('skip', j) or
    ('d_skip', j), how many micro-batches it holds: the smallest R such that micro-batch m + R
    is written (slot (m + R) mod R) no earlier than the tick of micro-batch m's last read. A
    loop's tick reads the arrays as they were when it began, so a write in the tick of the last
    read is safe.
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
      routes: the skips sent past the stages between (`Routes`).
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
                for j, r in enumerate(routes):
                    if r.end == last and r.differentiable:
                        Write(('d_skip', j), m, tick - 1)
        for tick_actions in ticks_lib.Ticks(sched, kinds):
            for a in (a for actions in tick_actions for a in actions):
                read, written = ArrayAccess(a.kind, a.stage, last, loss_in_loop,
                                             keeps[a.stage], routes)
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
        for j, r in enumerate(routes):
            if r.start == 0 and r.differentiable:
                Read(('d_skip', j), m, tick)
    sizes = {}
    after = 0 if reuse_in_tick else 1
    for key in set(writes) | set(reads):
        written, read = writes.get(key, {}), reads.get(key, {})
        sizes[key] = next(r for r in range(1, m_count + 1) if all(
            written.get(m + r, float('inf')) >= read.get(m, float('-inf')) + after
            for m in range(m_count - r)))
    return sizes


class Packing:
    """A micro-batch's residuals (dozens of tensors: 21 per Transformer layer) stored as the
    items of one TensorArray per dtype, each array holding its dtype's tensors of every slot of
    the ring: tensor j of a dtype with n tensors, of slot r, is item r n + j. The loop then
    carries one TensorArray per dtype instead of one per tensor (each a loop variable passed
    through every tick and every branch), and nothing is copied: an item is the tensor itself,
    of any shape, run-time shapes included (where concatenating the tensors into one buffer
    cost a copy of every residual at each write).

    `dtypes` and `counts` size the arrays (`Arrays`); `Write` and `Read` store and fetch a
    micro-batch's tensors at a slot of the ring."""

    def __init__(self, specs):
        self._specs = list(specs)
        self.dtypes = list(dict.fromkeys(x.dtype for x in self._specs))
        self.counts = [0] * len(self.dtypes)
        # Per tensor, (its dtype's array, its index among that dtype's tensors).
        self._places = []
        for x in self._specs:
            array = self.dtypes.index(x.dtype)
            self._places.append((array, self.counts[array]))
            self.counts[array] += 1

    def Arrays(self, ring_size: int) -> list:
        """Empty TensorArrays for a ring of `ring_size` micro-batches."""
        return [tf.TensorArray(dtype, size=ring_size * n, infer_shape=False,
                               clear_after_read=False)
                for dtype, n in zip(self.dtypes, self.counts)]

    def Write(self, arrays: list, slot, flat: list) -> list:
        """`arrays` with the tensors `flat` written at ring slot `slot` (an int or a scalar)."""
        arrays = list(arrays)
        for (a, j), x in zip(self._places, flat):
            arrays[a] = arrays[a].write(slot * self.counts[a] + j, x)
        return arrays

    def Read(self, arrays: list, slot) -> list:
        """The tensors written at ring slot `slot`, each of its spec's static shape."""
        flat = []
        for (a, j), spec in zip(self._places, self._specs):
            x = arrays[a].read(slot * self.counts[a] + j)
            x.set_shape(spec.shape)
            flat.append(x)
        return flat
