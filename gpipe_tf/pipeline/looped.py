"""A pipeline schedule run as a loop in the graph: its size, and the time to build and optimize
it, do not grow with M.

`unrolled.UnrolledSchedule` adds every action to the graph, K M forwards and as many backwards,
whose optimization before the first step grows with them (docs/schedules.md, "Build cost").
`LoopedSchedule` puts the schedule's clock (`ticks.Ticks`) in a `tf.while_loop`: at each tick
every device runs the actions the tables give it, a `tf.switch_case` per lane (per stage it
holds, zero-bubble's W apart: `ticks.Lane`) over the lane's kinds of action, or idles. Each
device counts the ticks itself and reads its actions from tables on its own device, and what
an action reads of another device's TensorArrays is read there at the tick's start and sent
once (`_CrossReads`): a value, a table or a switch on another device costs a send and a
receive per tick, in every branch, taken or not.
Micro-batches live in TensorArrays, one per leaf of each stage boundary: outputs of every stage
(what the next one and re-materializing backwards read) and the gradients of every boundary;
each is a ring of as many micro-batches as the schedule has alive in it at once
(`rings.RingSizes`), so what is no longer needed is freed. The pipeline's
inputs and, when given, its outputs' gradients and the loss's inputs are read in place (along
batch_dim 0, a micro-batch is a slice that shares the mini-batch's buffer), and each loop
carries only the state its actions read or write. A batch known only when the step runs splits
as the unrolled executor splits it (`microbatch.Sizes`: the first N mod M micro-batches one
larger, the last ones empty when N < M): micro-batch m is a slice whose start and size are
computed in the graph, the TensorArrays' elements have an unknown batch dimension, and an
action on an empty micro-batch takes its switch's idle branch, so no layer runs on zero
examples and nothing is read, written or sent for it (`_written`). Dense weight gradients (a
sum per weight) and training statistics are summed in loop variables on each stage's device; a
sparse one (a gather's IndexedSlices) is kept per micro-batch in TensorArrays and concatenated
after the loop (`_SparseSum`), as the unrolled executor concatenates them. The values equal the
unrolled executor's: the same traced cell functions run on the same micro-batches, and each
device runs its actions in its list's order.

Every recompute mode runs. A re-materializing stage keeps only its input and its backward B
recomputes the forward (`recompute`); a stage that keeps its activations runs, in training,
its forward and backward as the parts of `cell.CellSplit`, the forward writing what the
backward reads of it (the residuals) to TensorArrays of their own ('kept'). Zero-bubble's split
backward uses the same parts: I reads the kept residuals (a re-materializing stage first runs
the forward again, once, after its incoming gradient exists) and writes what W reads (each
layer's pre-activation gradient, the residuals W needs) to 'saved'; W runs no forward. With
`logical_device_fn` (XLA) the unrolled executor runs.

A tensor stages give on unread (`Cell.passed_leaves`: a skip from stage 0 to stage 3 that
stages 1 and 2 only carry) is not in the boundaries' arrays: each such skip has a ring of its
own ('skip', `rings.Routes`) on the device of the stage that makes it, written by that stage's
forward and read by the reader's forward (and its re-materializing backward), and its gradient
one ('d_skip') on the reader's device, written by the reader's backward (a skip to the
pipeline's outputs: by the last stage's forward, from the loss, or given to `Backward`) and
read by the maker's (a skip of the pipeline's input: joined after the loop). The stages
between take None in its place, so it goes from device 0 to device 3 at the tick stage 3 reads
it, and nothing of it to devices 1 and 2. (With one stage, which gives an input on as an
output, the stage hands it to itself: no ring.)
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import tensorflow as tf

from gpipe_tf.pipeline import cell as cell_lib
from gpipe_tf.pipeline import executor
from gpipe_tf.pipeline import leaves
from gpipe_tf.pipeline import microbatch
from gpipe_tf.pipeline import rings
from gpipe_tf.pipeline import schedule as schedule_lib
from gpipe_tf.pipeline import ticks as ticks_lib
from gpipe_tf.pipeline import unfolded

F, B = schedule_lib.FORWARD, schedule_lib.BACKWARD
I, W = schedule_lib.INPUT_GRAD, schedule_lib.WEIGHT_GRAD


class LoopedSchedule:
    """One step of a pipeline of S stages over M micro-batches, its clock in a while loop.

    Args: as `executor.Executor` (`assign` must be None: `executor.Choose`).
    """

    def __init__(self, functions, recomputes, sched, batch_dim, step, assign=None,
                 first_example=0):
        if assign is not None:
            raise ValueError('LoopedSchedule runs no logical_device_fn; use '
                             'unrolled.UnrolledSchedule.')
        self._functions = functions
        # Per stage, the input leaves it gives on unread: each such skip has a ring of its own
        # from the stage that makes it to the one that reads it (`rings.Routes`).
        self._passed = [f.cell.passed_leaves for f in functions]
        self._recomputes = list(recomputes)
        self._devices = [f.device for f in functions]
        self._schedule = sched
        self._num_stages = len(functions)
        self._num_micro_batches = sched.num_micro_batches
        self._batch_dim = batch_dim
        self._step = step
        self._first_example = first_example

    @property
    def schedule(self) -> schedule_lib.Schedule:
        return self._schedule

    # ---- the step ---------------------------------------------------------------------------
    def Forward(self, thetas: list, inputs, training: bool = True):
        """As `unrolled.UnrolledSchedule.Forward`: (outputs, per cell its summed statistics)."""
        if training:
            executor.CheckForwardFirst(self._schedule)
        else:
            # The loop splits a static batch into equal micro-batches only
            # (`microbatch.InPlace`); in inference, padding the batch to a multiple of M changes
            # no real example's output.
            inputs, batch_size = microbatch.Padded(inputs, self._num_micro_batches,
                                                   self._batch_dim)
        # Training: `Backward` runs the backwards in a second loop.
        self._Start(thetas, inputs, training, [(F,), (B,)] if training else [(F,)])
        self._Loop((F,))
        outputs = self._Outputs()
        if not training and not (isinstance(batch_size, int) and
                                 batch_size % self._num_micro_batches == 0):
            with tf.device(self._devices[-1]):
                outputs = microbatch.Unpadded(outputs, batch_size, self._batch_dim)
        return outputs, self._Updates()

    def Backward(self, d_outputs):
        """As `unrolled.UnrolledSchedule.Backward`: (per cell its flat weight gradients,
        d_inputs)."""
        given = leaves.WithFloatLeaves(self._output_specs, leaves.FloatLeaves(d_outputs))
        with tf.device(self._devices[-1]):
            self._d_acts[-1] = [self._batch.View(given[i])
                                for i in self._d_act_leaves[self._num_stages]]
        for j, r in enumerate(self._routes):
            if r.end == self._num_stages and r.differentiable:
                # An output's gradient, sent once to the stage that made it, where its backward
                # reads it in place (an input's: the input's gradient, as it is).
                with tf.device(self._devices[r.writer]):
                    self._d_skips[j] = [given[r.target] if r.start == 0 else
                                        self._batch.View(tf.identity(given[r.target]))]
        self._Loop((B,))
        return self._Gradients()

    def ForwardBackward(self, thetas: list, inputs, loss_fn, loss_inputs=None,
                        loss_scale=None):
        """As `unrolled.UnrolledSchedule.ForwardBackward`."""
        self._Start(thetas, inputs, True, [(F, B, I, W)], loss_in_loop=True)
        self._loss_fn = loss_fn
        self._loss_scale = loss_scale
        with tf.device(self._devices[-1]):
            # Read in place, as the inputs: a micro-batch's by its index in the loop.
            self._loss_inputs = tf.nest.map_structure(
                lambda x: None if x is None else self._batch.View(tf.convert_to_tensor(x)),
                loss_inputs)
            self._loss = [tf.zeros([]), tf.zeros([])]
            # The outputs' gradients come from the loss, written as each forward ends.
            self._d_acts[-1] = self._EmptyArrays(
                self._Leaves(self._num_stages, self._d_act_leaves), ('d_act', self._num_stages))
            for j, r in enumerate(self._routes):
                if r.end == self._num_stages and r.differentiable:
                    self._d_skips[j] = self._EmptyArrays([self._RouteSpec(r)], ('d_skip', j))
        if self._schedule.splits_backward:
            self._StartSaved()
        self._Loop((F, B, I, W))
        d_thetas, d_inputs = self._Gradients()
        return (self._Outputs(), self._Updates(), tuple(self._loss), d_thetas, d_inputs)

    # ---- setting up -------------------------------------------------------------------------
    def _Start(self, thetas, inputs, training, phases, loss_in_loop=False):
        """Splits the inputs and makes the step's TensorArrays, each a ring of as many
        micro-batches as the loops `phases` (per loop, the kinds of action it runs) have alive
        in it at once (`rings.RingSizes`)."""
        m_count, batch_dim = self._num_micro_batches, self._batch_dim
        # Per stage, whether its training forward keeps its residuals for its backward.
        self._keeps = [training and not r for r in self._recomputes]
        self._loop_keys = None  # While a loop is built, the state it carries (`_Loop`).
        self._fetched = {}  # While a tick is built, what it reads across devices (`_Fetched`).
        self._clocks = []  # While a loop is built, per device its count of ticks (`_Loop`).
        self._training = training
        self._thetas = list(thetas)
        self._loss_fn = None
        self._loss_scale = None
        self._loss = None  # ForwardBackward's [sum of value * weight, sum of weight].
        with tf.device(self._devices[0]):
            # The mini-batch, read in place (along batch_dim 0, no copy).
            self._batch = microbatch.InPlace(inputs, m_count, batch_dim)
            first = [None if x is None else self._batch.View(x) for x in tf.nest.flatten(inputs)]
            self._input_structure = tf.nest.pack_sequence_as(
                inputs, [None if x is None else self._batch.Slice(x, 0) for x in first])
            # A batch known only when the step runs may leave the last micro-batches empty
            # (fewer examples than M): the loop then runs the first `_written` only (actions on
            # the others take the idle branch), the int32 count of non-empty micro-batches.
            self._written = (None if self._batch.sizes is None else
                             tf.math.count_nonzero(self._batch.sizes, dtype=tf.int32))
        # boundaries[b]: the specs of boundary b's leaves (b = 0 the input, b = S the output);
        # structures[s]: stage s's input as its call takes it (None for what it passes on).
        self._boundaries = [leaves.Specs(self._input_structure)]
        self._structures = []
        self._stat_specs = []  # Per stage, its training statistics' specs.
        step_spec = tf.TensorSpec([], tf.int64)
        for s, fn in enumerate(self._functions):
            spec = leaves.WithNone(self._boundaries[-1], self._passed[s])
            outputs, stats = fn.ForwardSpecs(self._thetas[s], spec, step_spec, training)
            self._structures.append(spec)
            self._boundaries.append(leaves.PassedOn(outputs, self._boundaries[-1],
                                                    self._passed[s]))
            self._stat_specs.append(stats)
        self._output_specs = self._boundaries[-1]
        self._routes = rings.Routes(self._passed, [[leaves.IsFloat(x) for x in
                                                    tf.nest.flatten(b)]
                                                   for b in self._boundaries])
        # Eagerly, a TensorArray write changes it in place: a device later in the same tick
        # would read it, so a slot is not reused in the tick of its last read.
        self._ring = rings.RingSizes(self._schedule, phases, loss_in_loop,
                                     reuse_in_tick=not tf.executing_eagerly(),
                                     keeps=self._keeps, routes=self._routes)
        # acts[b]: the TensorArrays of boundary b's leaves that stage b - 1 writes and stage b
        # reads (`act_leaves[b]`: every leaf of the input and the output); d_acts[b]: the
        # gradients of the float leaves stage b - 1 makes and stage b reads (`d_act_leaves[b]`;
        # at the input, those stage 0 reads; at the output, those the last makes); skips[j] and
        # d_skips[j]: the ring of route j's tensor and of its gradient.
        num = self._num_stages
        self._act_leaves, self._d_act_leaves = [], []
        for b, boundary in enumerate(self._boundaries):
            flat = tf.nest.flatten(boundary)
            made = set(range(len(flat))) - (set(self._passed[b - 1].values()) if b else set())
            read = set(range(len(flat))) - (set(self._passed[b]) if b < num else set())
            stored = range(len(flat)) if b in (0, num) else sorted(made & read)
            self._act_leaves.append(list(stored))
            self._d_act_leaves.append([i for i in sorted(made & read) if leaves.IsFloat(flat[i])])
        self._acts = [first] + [
            self._EmptyArrays(self._Leaves(b, self._act_leaves), ('act', b))
            for b in range(1, num + 1)]
        self._d_acts = [None] * (num + 1)
        for b in range(num):  # Boundary b's gradient is written by stage b.
            self._d_acts[b] = self._EmptyArrays(self._Leaves(b, self._d_act_leaves),
                                                ('d_act', b))
        self._skips = [self._EmptyArrays([self._RouteSpec(r)], ('skip', j))
                       if r.writer != r.reader else None for j, r in enumerate(self._routes)]
        # An output's gradient comes from the loss (`ForwardBackward`) or is given (`Backward`).
        self._d_skips = [self._EmptyArrays([self._RouteSpec(r)], ('d_skip', j))
                         if r.differentiable and r.end < num else None
                         for j, r in enumerate(self._routes)]
        self._grads = [None] * self._num_stages
        self._stats = [None] * self._num_stages
        # Per stage that runs them, its forward's and backward's parts (`residuals`): where it
        # keeps its residuals or splits its backward.
        self._splits = [
            fn.Split(self._thetas[s], leaves.Specs(self._structures[s]),
                     step_spec)
            if self._keeps[s] or (training and self._schedule.splits_backward) else None
            for s, fn in enumerate(self._functions)]
        # The residuals of a micro-batch, items of one TensorArray per dtype (`rings.Packing`).
        self._packings = {}
        self._kept = [None if not keep else self._PackedArrays(self._splits[s].kept_specs,
                                                              ('kept', s))
                      for s, keep in enumerate(self._keeps)]
        self._saved = [None] * self._num_stages  # Per stage, its I's saved values for its W.

    def _Leaves(self, b, positions) -> list:
        """The specs of boundary b's leaves at `positions[b]`."""
        flat = tf.nest.flatten(self._boundaries[b])
        return [flat[i] for i in positions[b]]

    def _RouteSpec(self, route):
        return tf.nest.flatten(self._boundaries[route.start])[route.source]

    def _StartSaved(self):
        """TensorArrays for what each stage's I saves for its W (a split backward)."""
        for s, split in enumerate(self._splits):
            self._saved[s] = self._PackedArrays(split.saved_specs, ('saved', s))

    def _PackedArrays(self, specs, key):
        """Empty TensorArrays for `key`'s residuals, their tensors the items of one per dtype
        (`rings.Packing`), on its device (`_Owner`)."""
        packing = self._packings[key] = rings.Packing(specs)
        with tf.device(self._Owner(key)):
            return packing.Arrays(self._RingSize(key))

    def _EmptyArrays(self, specs, key):
        """Empty TensorArrays for `key`'s leaves of `specs`, of its ring's size, on its
        device (`_Owner`)."""
        with tf.device(self._Owner(key)):
            return [tf.TensorArray(x.dtype, size=self._RingSize(key), element_shape=x.shape,
                                   clear_after_read=False) for x in specs]

    def _Owner(self, key) -> str:
        """The device of `key`'s TensorArrays, where each is made and read (`_OwnerStage`)."""
        return self._devices[self._OwnerStage(key)]

    def _OwnerStage(self, key) -> int:
        """The stage whose device holds `key`'s TensorArrays: boundary b's outputs on the stage
        that writes them, b - 1; boundary b's gradients, and a stage's kept and saved
        residuals, on stage b's (the outputs' gradients on the last stage's); a skip on the
        stage that makes it, its gradient on the one that reads it (an output's given
        gradient, not a TensorArray, is on the maker's device: `Backward`)."""
        kind, i = key
        if kind == 'skip':
            return self._routes[i].writer
        if kind == 'd_skip':
            return self._routes[i].reader
        return min(i - 1 if kind == 'act' else i, self._num_stages - 1)

    def _RingSize(self, key) -> int:
        """How many micro-batches `key`'s TensorArrays hold (1 for one the step never uses:
        the boundaries' gradients in inference)."""
        return self._ring.get(key, 1)

    def _FirstExample(self, m):
        """The index in the mini-batch of micro-batch m's first example (int64), from which
        the layers draw their randomness per example."""
        return tf.cast(self._first_example, tf.int64) + self._batch.Start(m)

    def _Slot(self, key, m):
        """Micro-batch m's index in `key`'s TensorArrays: m modulo its ring's size."""
        size = self._RingSize(key)
        return m if size == self._num_micro_batches else tf.math.floormod(m, size)

    # ---- the loop ---------------------------------------------------------------------------
    def _Loop(self, kinds):
        sched = self._schedule
        ticks = ticks_lib.Ticks(sched, kinds)
        # Per device, a switch per lane (`ticks_lib.Switches`), and the (kind, stage) pairs of
        # all its switches' branches.
        switches = ticks_lib.Switches(ticks, sched.num_devices)
        branches = [[pair for switch in device for pair in switch.branches]
                    for device in switches]
        self._InitSums(kinds)
        # Per device, a token its actions pass on: each action starts once the one before it
        # on its device is done, as the unrolled executor's control dependencies order them
        # (without it, a device's next action could start while its last one runs: the loop
        # runs several ticks at once).
        self._tokens = []
        for d in range(sched.num_devices):
            with tf.device(self._devices[d]):
                self._tokens.append(tf.zeros([], name=f'device_{d}_token'))
        # The loop carries only what its actions read or write: a value it passed on unread
        # (the outputs' micro-batches in the backwards' loop) would stay alive until it ends.
        self._loop_keys = {('token', d) for d in range(sched.num_devices)}
        # Per device, its own count of the ticks, so that its actions' indices are read from
        # tables on its own device: the loop's counter lives on one device, and reading it,
        # or a table there, cost a send and a receive per device and tick.
        self._clocks = [None] * sched.num_devices
        for d in range(sched.num_devices):
            if branches[d]:
                with tf.device(self._devices[branches[d][0][1]]):
                    self._clocks[d] = tf.zeros([], tf.int32, name=f'device_{d}_clock')
                self._loop_keys.add(('clock', d))
        for device_branches in branches:
            self._loop_keys.update(self._Reads(device_branches) + self._Writes(device_branches))
        state = self._State()
        fetches = self._CrossReads(ticks)
        # Per device, its copy of the count of micro-batches to run (`_written`): read at every
        # tick, a value of another device would cost a send per tick.
        written = [None] * sched.num_devices
        if self._written is not None:
            for d in range(sched.num_devices):
                with tf.device(self._devices[branches[d][0][1]] if branches[d] else
                               self._devices[0]):
                    written[d] = tf.identity(self._written, name=f'device_{d}_written')

        def Body(t, *flat):
            self._SetState(flat)
            # Micro-batches a device reads from another's TensorArrays, read at the tick's start
            # on the device that holds them, under its own clock.
            self._fetched = {}
            for key, (owner, reader, slots, micro_batches) in fetches.items():
                with tf.name_scope(f'fetch_{key[0]}_{key[1]}'):
                    with tf.device(self._Owner(key)):
                        slot = tf.constant(slots, tf.int32)[self._clocks[owner]]
                        if written[owner] is not None:  # Nothing to read of a skipped one.
                            m = tf.constant(micro_batches, tf.int32)[self._clocks[owner]]
                            slot = tf.where(m < written[owner], slot, -1)
                        values = _Fetched(self._Value(key), slot)
                    # On the reader's device before its switch_case takes them, so that the
                    # switch and its branches' ops stay on the reader's device.
                    with tf.device(reader):
                        self._fetched[key] = [_OnDevice(v) for v in values]
            writes = {}
            for d in range(sched.num_devices):
                if not branches[d]:
                    continue  # A device with no action of these kinds.
                with tf.device(self._devices[branches[d][0][1]]), tf.name_scope(f'device_{d}'):
                    clock = self._clocks[d]
                    writes[('clock', d)] = clock + 1
                    # A switch per lane of the device (per stage it holds, W apart), over the
                    # lane's actions: a lowered switch passes every value its branches read or
                    # write through each branch, taken or not, so one switch over the device's
                    # stages passed each stage's values through the other's branches too. The
                    # device's token runs from one switch to the next, in lane order.
                    for switch in switches[d]:
                        keys = self._Writes(switch.branches) + [('token', d)]
                        branch = tf.constant(switch.index, tf.int32)[clock]
                        m = tf.constant(switch.micro_batches, tf.int32)[clock]
                        if written[d] is not None:  # An empty micro-batch: idle instead.
                            branch = tf.where(m < written[d], branch, 0)
                        fns = [lambda keys=keys: self._Get(keys)] + [
                            (lambda kind=kind, s=s, keys=keys, m=m:
                             self._Action(kind, s, m, keys)) for kind, s in switch.branches]
                        results = dict(zip(keys, _AsList(tf.switch_case(branch, fns))))
                        self._Put(('token', d), results[('token', d)])
                        writes.update(results)
            for key, value in writes.items():
                self._Put(key, value)
            return (t + 1,) + tuple(self._State())

        with _OnInputsDevice():
            flat = tf.while_loop(
                lambda t, *_: t < len(ticks), Body, (tf.constant(0),) + tuple(state),
                # A device may start its next ticks while slower ones finish theirs (at K=8,
                # M=32: 2.2 s a step with 2, 1.8 s with 8).
                parallel_iterations=max(2, sched.num_devices))
        self._SetState(flat[1:])
        self._loop_keys = None
        self._fetched = {}

    def _CrossReads(self, ticks) -> dict:
        """Per TensorArray key that an action reads on a device other than the arrays' own, (the
        arrays' device's index, the reader's device, per tick the slot it reads: -1 where none
        reads it then). Read inside the reader's branch, such a read cost every tick, in every
        branch that reads the key, taken or not, sends to the arrays' device of the branch's
        index, its slot and a control edge, and the value back; read by the arrays' device at
        the tick's start (`_Fetched`), one send of the value."""
        tables = {}
        for t, tick in enumerate(ticks):
            for action in (a for actions in tick for a in actions):
                for key in self._Access(action.kind, action.stage)[0]:
                    if (self._Owner(key) == self._devices[action.stage] or not any(
                            isinstance(x, tf.TensorArray) for x in self._Value(key))):
                        continue
                    # The arrays' device reads them under its clock: it runs actions here.
                    owner = self._schedule.DeviceOf(self._OwnerStage(key))
                    assert self._clocks[owner] is not None, (key, owner)
                    assert key not in self._packings, key  # Residuals are read where kept.
                    _, _, slots, micro_batches = tables.setdefault(
                        key, (owner, self._devices[action.stage], [-1] * len(ticks),
                              [0] * len(ticks)))
                    assert slots[t] == -1, (key, t)  # One action a tick reads it.
                    slots[t] = action.micro_batch % self._RingSize(key)
                    micro_batches[t] = action.micro_batch
        return tables

    def _InitSums(self, kinds):
        for s, fn in enumerate(self._functions):
            with tf.device(self._devices[s]), tf.name_scope(f'cell_{s}_sums'):
                if (B in kinds or W in kinds) and self._grads[s] is None:
                    # One sum per weight, in its dtype (float32 under any fprop_dtype: cells
                    # cast their weights inside, so each micro-batch's gradient comes back in
                    # the dtype of theta). Each backward adds its gradients to them one by one:
                    # packing them into one vector cost a copy of the stage's gradients per
                    # backward. Zeros filled each step: folded, they were held (`unfolded`).
                    self._grads[s] = [
                        _SparseSum.Empty(t, self._num_micro_batches, tf.int64) if sparse else
                        unfolded.ZerosLike(t)
                        for t, sparse in zip(self._Trainable(s), self._SparseGradients(s))]
                if F in kinds and self._training:
                    self._stats[s] = tf.nest.map_structure(
                        lambda spec: unfolded.Zeros(spec.shape, spec.dtype), self._stat_specs[s])

    def _SparseGradients(self, s) -> list:
        """Per trainable leaf of stage s's theta, whether its gradient is IndexedSlices (a
        gather's): as its backward gives it, the split one's or the re-materializing one's."""
        if self._splits[s] is not None:
            flags = self._splits[s].sparse_gradients
        else:
            flags = self._functions[s].BackwardGradientKinds(
                self._thetas[s], leaves.Specs(self._structures[s]), tf.TensorSpec([], tf.int64))
        return [flag for flag, keep in zip(flags, self._functions[s].trainable) if keep]

    def _Trainable(self, s) -> list:
        return [t for t, keep in zip(tf.nest.flatten(self._thetas[s]),
                                     self._functions[s].trainable) if keep]

    def _Unpack(self, s, sums) -> list:
        """Stage s's gradient sums as its flat list (None for non-trainable leaves), a sparse
        one as IndexedSlices."""
        sums = iter(zip(sums, self._Trainable(s)))
        flat = []
        for keep in self._functions[s].trainable:
            if not keep:
                flat.append(None)
                continue
            total, weight = next(sums)
            flat.append(total.Result(weight, self._written) if isinstance(total, _SparseSum)
                        else total)
        return flat

    # The loop's state: a dict of named nests, flattened for the while loop.
    def _StateKeys(self):
        keys = [('act', b) for b in range(self._num_stages + 1)]
        keys += [('d_act', b) for b in range(self._num_stages + 1)
                 if self._d_acts[b] is not None]
        keys += [('grad', s) for s in range(self._num_stages) if self._grads[s] is not None]
        keys += [('stats', s) for s in range(self._num_stages) if self._stats[s] is not None]
        keys += [('kept', s) for s in range(self._num_stages) if self._kept[s] is not None]
        keys += [('saved', s) for s in range(self._num_stages) if self._saved[s] is not None]
        keys += [('skip', j) for j, skip in enumerate(self._skips) if skip is not None]
        keys += [('d_skip', j) for j, d in enumerate(self._d_skips) if d is not None]
        keys += [('token', d) for d in range(len(self._tokens))]
        keys += [('clock', d) for d, clock in enumerate(self._clocks) if clock is not None]
        if self._loss_fn is not None:
            keys.append(('loss', 0))
        return keys if self._loop_keys is None else [k for k in keys if k in self._loop_keys]

    def _Get(self, keys):
        return [self._Value(key) for key in keys]

    def _Table(self, kind) -> list:
        return {'act': self._acts, 'd_act': self._d_acts, 'grad': self._grads,
                'stats': self._stats, 'token': self._tokens, 'clock': self._clocks,
                'kept': self._kept, 'saved': self._saved, 'skip': self._skips,
                'd_skip': self._d_skips}[kind]

    def _Value(self, key):
        kind, i = key
        return self._loss if kind == 'loss' else self._Table(kind)[i]

    def _Put(self, key, value):
        kind, i = key
        if kind == 'loss':
            self._loss = list(value)
        else:
            self._Table(kind)[i] = value

    def _State(self):
        self._keys = self._StateKeys()
        return tf.nest.flatten([self._Value(k) for k in self._keys])

    def _SetState(self, flat):
        values = tf.nest.pack_sequence_as([self._Value(k) for k in self._keys], list(flat))
        for key, value in zip(self._keys, values):
            self._Put(key, value)

    def _Reads(self, device_branches):
        """The state a device's actions read (`rings.ArrayAccess`)."""
        return [key for kind, s in device_branches for key in
                self._Access(kind, s)[0]]

    def _Writes(self, device_branches):
        """The state a device's actions change: the TensorArrays they write (`rings.ArrayAccess`),
        the weight-gradient (B, W) and statistics (F) sums, and the loss on the last stage."""
        keys = []
        for kind, s in device_branches:
            keys += self._Access(kind, s)[1]
            if kind == F and self._stats[s] is not None:
                keys.append(('stats', s))
            if kind == F and s == self._num_stages - 1 and self._loss_fn is not None:
                keys.append(('loss', 0))
            if kind in (B, W):
                keys.append(('grad', s))
        return list(dict.fromkeys(keys))

    def _Access(self, kind, s) -> tuple:
        return rings.ArrayAccess(kind, s, self._num_stages, self._loss_fn is not None,
                                 self._keeps[s], self._routes)

    # ---- the actions ------------------------------------------------------------------------
    def _Read(self, key, structure, m):
        """Micro-batch m from `key`'s TensorArrays (as they were when the tick began), packed
        as `structure` (None: the flat list)."""
        stores = self._Value(key)
        if key in self._fetched:  # Read at the tick's start: after the device's last action.
            flat = [tf.identity(x) for x in self._fetched[key]]
        elif any(isinstance(x, tf.TensorArray) for x in stores):
            slot = self._Slot(key, m)
            # Read where the arrays live, so that only the micro-batch crosses to this device:
            # a TensorArray sent to another device is copied whole, every slot of its ring.
            with tf.device(self._Owner(key)):
                if key in self._packings:
                    flat = self._packings[key].Read(stores, slot)
                else:
                    flat = [store.read(slot) for store in stores]
        else:  # The inputs, or the outputs' gradients when given: read in place.
            flat = [self._batch.Slice(store, m) for store in stores]
        return flat if structure is None else tf.nest.pack_sequence_as(structure, flat)

    def _Input(self, s, m):
        """Stage s's input of micro-batch m as its call takes it: what the stage before wrote,
        the skips it reads from the stages that made them, None for what it passes on."""
        flat = self._ByLeaf(s, self._Read(('act', s), None, m), self._act_leaves[s])
        for j, r in enumerate(self._routes):
            if r.end == s:
                flat[r.target] = self._Read(('skip', j), None, m)[0]
        for i in self._passed[s]:
            flat[i] = None
        return tf.nest.pack_sequence_as(self._structures[s], flat)

    def _OutputGradient(self, s, m) -> list:
        """The gradients of stage s's call's float outputs of micro-batch m: from the stage
        after it, and for a skip it made, from the stage that read it."""
        flat = self._ByLeaf(s + 1, self._Read(('d_act', s + 1), None, m),
                            self._d_act_leaves[s + 1])
        for j, r in enumerate(self._routes):
            if r.start == s + 1 and r.differentiable:
                flat[r.source] = self._Read(('d_skip', j), None, m)[0]
        return [g for g in flat if g is not None]

    def _ByLeaf(self, b, values, positions) -> list:
        """Boundary b's flat leaves with `values` at `positions` and None elsewhere."""
        result = [None] * len(tf.nest.flatten(self._boundaries[b]))
        for i, value in zip(positions, values):
            result[i] = value
        return result

    def _Write(self, values, key, m, flat):
        """`values[key]`'s TensorArrays with micro-batch m's `flat` leaves written."""
        slot = self._Slot(key, m)
        if key in self._packings:
            values[key] = self._packings[key].Write(values[key], slot, flat)
        else:
            values[key] = [ta.write(slot, x) for ta, x in zip(values[key], flat)]

    def _Action(self, kind, s, m, keys):
        values = dict(zip(keys, self._Get(keys)))
        first = self._FirstExample(m)
        fn = self._functions[s]
        token = ('token', self._schedule.DeviceOf(s))
        # After the device's last action. (An identity in this branch's graph: a control
        # input from the loop body's graph would go to the switch_case op, which does not hold
        # the branch's ops back once lowered.)
        values[token] = tf.identity(values[token])
        with tf.control_dependencies([values[token]]):
            # Its input: the stage's input, the residuals its forward kept, or what its I saved;
            # and for B and I the outputs' gradient. (Read outside the cell's scope: an array of
            # another stage is read on that stage's device.)
            key = self._Access(kind, s)[0][0]
            x = self._Input(s, m) if key[0] == 'act' else self._Read(key, None, m)
            d_y = self._OutputGradient(s, m) if kind in (B, I) else None
        with tf.name_scope(f'cell_{s}_{executor.PARTS[kind]}'):
            self._Run(kind, s, m, values, fn, first, x, d_y)
        done = [t.flow if isinstance(t, tf.TensorArray) else t
                for k in keys if k != token for t in tf.nest.flatten(values[k])]
        with tf.control_dependencies(done):
            values[token] = tf.identity(values[token])
        return [values[k] for k in keys]

    def _Run(self, kind, s, m, values, fn, first, x, d_y):
        """Runs action (kind, stage s, micro-batch m) on its input `x` (the stage's input, the
        residuals its forward kept, or, for W, what I saved) and, for B and I, its outputs'
        gradient `d_y`, updating `values` (the state the action writes)."""
        theta, split, step = self._thetas[s], self._splits[s], self._step
        if kind == F:
            if self._keeps[s]:
                outputs, stats, kept = split.Forward(theta, x, step, first)
                self._Write(values, ('kept', s), m, kept)
            else:
                outputs, stats = fn.Forward(theta, x, step, first, training=self._training)
            outputs = self._WriteOutputs(values, s, m, outputs)
            if self._stats[s] is not None:
                values[('stats', s)] = tf.nest.map_structure(tf.add, values[('stats', s)], stats)
            if s == self._num_stages - 1 and self._loss_fn is not None:
                total, weight, d_y = self._Loss(outputs, m)
                d_y = leaves.WithFloatLeaves(self._output_specs, d_y)
                self._Write(values, ('d_act', s + 1), m, [d_y[i] for i in
                                                          self._d_act_leaves[s + 1]])
                for j, r in enumerate(self._routes):
                    if r.end == s + 1 and r.differentiable:
                        self._Write(values, ('d_skip', j), m, [d_y[r.target]])
                values[('loss', 0)] = [values[('loss', 0)][0] + total,
                                       values[('loss', 0)][1] + weight]
            return
        if kind == W:
            values[('grad', s)] = _Add(values[('grad', s)], split.Weight(theta, x, step, first),
                                       m)
            return
        if kind == B and self._keeps[s]:
            d_theta, d_x = split.Backward(theta, x, step, first, d_y)
        elif kind == B:
            d_theta, d_x = fn.Backward(theta, x, step, first, d_y)
        else:
            if not self._keeps[s]:  # The forward again, once, after the gradient exists.
                with tf.name_scope(cell_lib.RECOMPUTE_SCOPE), tf.control_dependencies(d_y):
                    _, _, x = split.Forward(theta, leaves.Identity(x), step, first)
            d_x, saved = split.Input(theta, x, step, first, d_y)
            self._Write(values, ('saved', s), m, saved)
        if kind == B:
            values[('grad', s)] = _Add(values[('grad', s)], d_theta, m)
        self._Write(values, ('d_act', s), m, [d_x[i] for i in self._d_act_leaves[s]])
        for j, r in enumerate(self._routes):
            if r.end == s and r.differentiable:
                self._Write(values, ('d_skip', j), m, [d_x[r.target]])

    def _WriteOutputs(self, values, s, m, outputs):
        """Writes stage s's `outputs` of micro-batch m for the stage after it, and the skips it
        makes (of its outputs; stage 0 also of its input) to their rings; returns the outputs
        as the loss reads them (the last stage's with the skips it passes on filled in)."""
        flat = tf.nest.flatten(outputs)
        last = s == self._num_stages - 1
        for j, r in enumerate(self._routes):
            made = None
            if r.writer == s:
                made = flat[r.source] if r.start == s + 1 else (
                    self._Read(('act', 0), None, m)[r.source])
                if r.reader != s:
                    self._Write(values, ('skip', j), m, [made])
            if last and r.end == s + 1:
                flat[r.target] = made if r.reader == r.writer else (
                    self._Read(('skip', j), None, m)[0])
        self._Write(values, ('act', s + 1), m, [flat[i] for i in self._act_leaves[s + 1]])
        return tf.nest.pack_sequence_as(outputs, flat)

    def _Loss(self, outputs, m):
        loss_inputs = tf.nest.map_structure(
            lambda x: None if x is None else self._batch.Slice(x, m), self._loss_inputs)
        total, weight, d_y = executor.MicroBatchLoss(self._loss_fn, outputs, loss_inputs,
                                                     self._loss_scale)
        return tf.cast(total, tf.float32), tf.cast(weight, tf.float32), d_y

    # ---- results ----------------------------------------------------------------------------
    def _Joined(self, array):
        """The micro-batches of a TensorArray joined into the mini-batch along batch_dim
        (along 0, one copy; `concat` takes micro-batches of different sizes)."""
        if self._written is not None:
            return _JoinedWritten(array, self._written, self._batch_dim, self._JoinedAll)
        return self._JoinedAll(array)

    def _JoinedAll(self, array):
        """`_Joined` of a TensorArray whose every micro-batch was written."""
        if self._batch_dim == 0:
            return array.concat()
        if self._batch.sizes is not None:  # Of different sizes: stack needs them equal.
            parts = [array.read(m) for m in range(self._num_micro_batches)]
        else:
            parts = tf.unstack(array.stack())
        return tf.concat(parts, axis=self._batch_dim)

    def _Outputs(self):
        with tf.device(self._devices[-1]):
            return tf.nest.pack_sequence_as(self._output_specs,
                                            [self._Joined(ta) for ta in self._acts[-1]])

    def _Updates(self) -> list:
        if not self._training:
            return [[] for _ in range(self._num_stages)]
        return [self._stats[s] for s in range(self._num_stages)]

    def _Gradients(self):
        with tf.device(self._devices[0]):
            flat = self._ByLeaf(0, [self._Joined(a) for a in self._d_acts[0]],
                                self._d_act_leaves[0])
            for j, r in enumerate(self._routes):
                if r.start == 0 and r.differentiable:
                    # A TensorArray written in the loop; an input given on to the output, its
                    # gradient given to `Backward`: that tensor.
                    d_skip = self._d_skips[j][0]
                    flat[r.source] = (self._Joined(d_skip) if isinstance(d_skip, tf.TensorArray)
                                      else d_skip)
            d_inputs = tf.nest.pack_sequence_as(self._input_structure, flat)
        grads = []
        for s in range(self._num_stages):
            with tf.device(self._devices[s]):
                grads.append(self._Unpack(s, self._grads[s]))
        return grads, d_inputs


def _OnInputsDevice():
    """A device scope for building the loop in a graph: an Identity made with no device (the
    one tf.function puts on each value a loop body returns, after our device scopes end) is
    placed with its input. Left to the placer, each went to the first device: every loop
    variable of every device crossed to it and back at each tick (half the loop's sends at
    K=4). Ops made in our own device scopes keep theirs (an inner scope overrides)."""
    if tf.executing_eagerly():
        return contextlib.nullcontext()

    def Device(op):
        if not op.device and op.type == 'Identity' and op.inputs and op.inputs[0].device:
            return op.inputs[0].device
        return op.device

    return tf.compat.v1.device(Device)


def _OnDevice(x):
    """`x` by an op of the current device scope that grappler keeps (an Identity it removes,
    and the switch that takes the value then goes to the value's device)."""
    if tf.executing_eagerly():
        return x
    kept = tf.ensure_shape(x, tf.TensorShape([None] * x.shape.rank) if x.shape.rank is not None
                           else tf.TensorShape(None))
    kept.set_shape(x.shape)
    return kept


def _Fetched(stores, slot) -> list:
    """The elements at `slot` of TensorArrays `stores`, each of its array's element shape; for
    a negative slot (no read this tick) empty tensors in their place (a cond's branches return
    alike), whose size, 0, is all that crosses to the reader."""
    def Empty(store):
        shape = store.element_shape
        if shape.rank is None or shape.rank == 0:
            return tf.zeros([0] if shape.rank is None else [], store.dtype)
        dims = [0 if d is None else d for d in shape.as_list()]
        if 0 not in dims:
            dims[0] = 0
        return tf.zeros(dims, store.dtype)

    values = tf.cond(slot >= 0, lambda: [store.read(slot) for store in stores],
                     lambda: [Empty(store) for store in stores])
    if not tf.executing_eagerly():  # The branches' shapes merged: the read's, as it was.
        for value, store in zip(values, stores):
            value.set_shape(store.element_shape)
    return values


def _Add(sums: list, grads: list, m) -> list:
    """Each sum plus its gradient of micro-batch m (`grads` flat over theta, None for
    non-trainable leaves). A dense sum keeps its static shape: a gradient whose shape TF cannot
    infer (a 1x1 convolution's filter gradient, say) would otherwise loosen the loop
    variable's shape. A sparse one (`_SparseSum`) is written to its TensorArrays at m."""
    grads = [g for g in grads if g is not None]
    added = []
    for total, grad in zip(sums, grads):
        if isinstance(total, _SparseSum):
            added.append(total.Write(m, grad))
            continue
        new = total + tf.convert_to_tensor(grad)
        new.set_shape(total.shape)
        added.append(new)
    return added


class _SparseSum(NamedTuple):
    """A sparse weight gradient (IndexedSlices, a gather's) summed over a loop's
    micro-batches: each micro-batch's rows and values in TensorArrays, concatenated once the
    loop ends (`Result`), as `gradient_sums.Add` joins them unrolled. A dense sum of a
    32k-row table would be the table's size; these are the batch's rows."""
    values: tf.TensorArray
    indices: tf.TensorArray

    @classmethod
    def Empty(cls, weight, num_micro_batches: int, indices_dtype) -> '_SparseSum':
        return cls(tf.TensorArray(weight.dtype, size=num_micro_batches,
                                  element_shape=[None] + weight.shape[1:].as_list()),
                   tf.TensorArray(indices_dtype, size=num_micro_batches, element_shape=[None]))

    def Write(self, m, grad: tf.IndexedSlices) -> '_SparseSum':
        return _SparseSum(self.values.write(m, grad.values),
                          self.indices.write(m, tf.cast(grad.indices, self.indices.dtype)))

    def Result(self, weight, written) -> tf.IndexedSlices:
        """The IndexedSlices of every micro-batch's rows; `written`: the micro-batches the
        loop ran (an int32 scalar; None: all), the others left empty."""
        def Joined(array):
            concat = lambda a: a.concat()
            return concat(array) if written is None else _JoinedWritten(array, written, 0, concat)

        values, indices = Joined(self.values), Joined(self.indices)
        return tf.IndexedSlices(values, indices, tf.constant(weight.shape.as_list(), tf.int64))


def _JoinedWritten(array: tf.TensorArray, written, axis: int, join):
    """`join(array)`, the micro-batches of `array` joined along `axis`, when the loop wrote
    every element; when it wrote only the first `written` (an int32 scalar; the others were
    skipped as empty: a batch of fewer examples than M), those joined (none: zeros of no
    example, 0 in every dimension unknown statically). A TensorArray's concat
    would read an element never written as one of the written ones' shape. With fewer
    examples than M every micro-batch run holds one example, so those elements are alike:
    gathered, then merged into one dimension at `axis`."""
    shape = array.element_shape
    if shape.rank is not None:
        axis %= shape.rank

    def Written():
        stacked = array.gather(tf.range(written))  # [written, *element]
        moved = tf.experimental.numpy.moveaxis(stacked, 0, axis)
        dims = tf.shape(moved)
        merged = tf.concat([dims[:axis], [dims[axis] * dims[axis + 1]], dims[axis + 2:]],
                           axis=0)
        return tf.reshape(moved, merged)

    def NoneWritten():  # A replica's shard of no example (fewer than R).
        return tf.zeros([0 if d is None or i == axis else d
                         for i, d in enumerate(shape.as_list())], array.dtype)

    joined = tf.cond(written < array.size(),
                     lambda: tf.cond(written > 0, Written, NoneWritten), lambda: join(array))
    if shape.rank is not None:
        joined.set_shape(shape[:axis].concatenate([None]).concatenate(shape[axis + 1:]))
    return joined


def _AsList(results):
    return list(results) if isinstance(results, (list, tuple)) else [results]
