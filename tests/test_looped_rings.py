"""The looped executor's TensorArray rings (`rings.RingSizes`): replaying every schedule's
ticks with rings of those sizes, each read finds the micro-batch it asks for, and the rings
are as small as the schedule allows (1F1B keeps about K - b micro-batches at boundary b)."""

import numpy as np
import pytest
import tensorflow as tf
from absl.testing import absltest
from absl.testing import parameterized

from gpipe_tf.pipeline import rings
from gpipe_tf.pipeline import schedule as schedule_lib
from gpipe_tf.pipeline import ticks as ticks_lib

pytestmark = pytest.mark.unit

F, B, I, W = 'F', 'B', 'I', 'W'


def _Events(action, last, loss_in_loop, keeps):
    """(reads, writes) of an action as (array, micro-batch) pairs: an independent statement of
    what the executor's actions read and write. A stage that keeps its activations (`keeps`)
    has its forward write its residuals ('kept') and its backward read them, not its input."""
    s, m = action.stage, action.micro_batch
    if action.kind == F:
        writes = [(('act', s + 1), m)]
        if s == last - 1 and loss_in_loop:
            writes.append((('d_act', last), m))
        if keeps[s]:
            writes.append((('kept', s), m))
        return [(('act', s), m)], writes
    if action.kind == W:
        return [(('saved', s), m)], []
    writes = [(('d_act', s), m)] + ([(('saved', s), m)] if action.kind == I else [])
    return [(('kept' if keeps[s] else 'act', s), m), (('d_act', s + 1), m)], writes


def _SkipEvents(action, last, keeps):
    """(reads, writes) of an action for a skip that stage 0 makes (an output) and the last
    stage reads, the stages between passing it on: the last stage's forward reads it, and so
    does its backward (B or I) unless it keeps its activations; that backward gives the skip's
    gradient, which stage 0's backward reads."""
    s, m = action.stage, action.micro_batch
    if action.kind == F:
        return ([(('skip', 0), m)] if s == last - 1 else []), (
            [(('skip', 0), m)] if s == 0 else [])
    if action.kind == W:
        return [], []
    if s == last - 1:
        return ([] if keeps[s] else [(('skip', 0), m)]), [(('d_skip', 0), m)]
    return ([(('d_skip', 0), m)] if s == 0 else []), []


def _Replay(sched, phases, loss_in_loop, sizes, eager=False, keeps=None, skip=False):
    """Runs the loops' ticks on rings of `sizes`; returns the reads that found another
    micro-batch than theirs (as (array, wanted, found)). In a graph every read of a tick sees
    the rings as the tick began; `eager`: device by device, each seeing the writes of the
    devices before it in the tick (an eager TensorArray write changes it in place). `skip`:
    with a skip from stage 0 to the last stage (`_SkipEvents`)."""
    m_count, last = sched.num_micro_batches, sched.num_stages
    keeps = keeps or [False] * last
    rings = {}

    def Put(key, m):
        rings.setdefault(key, [None] * sizes.get(key, 1))[m % sizes.get(key, 1)] = m

    def Get(key, m):
        ring = rings.get(key, [None])
        return ring[m % len(ring)]

    wrong = []
    for m in range(m_count):
        Put(('act', 0), m)
    for p, kinds in enumerate(phases):
        if p > 0 and not loss_in_loop:
            for m in range(m_count):
                Put(('d_act', last), m)
        for tick in ticks_lib.Ticks(sched, kinds):
            # In the order the loop runs them: device by device, each in lane order.
            events = [_Events(a, last, loss_in_loop, keeps) for actions in tick for a in actions]
            if skip:
                events += [_SkipEvents(a, last, keeps) for actions in tick for a in actions]
            for reads, writes in events:
                wrong += [(key, m, Get(key, m)) for key, m in reads if Get(key, m) != m]
                if eager:
                    for key, m in writes:
                        Put(key, m)
            if not eager:  # In a graph, after every read of the tick.
                for _, writes in events:
                    for key, m in writes:
                        Put(key, m)
        if p == 0:  # The outputs, joined after the first loop.
            wrong += [(('act', last), m, Get(('act', last), m)) for m in range(m_count)
                      if Get(('act', last), m) != m]
    if len(phases[-1]) > 1 or len(phases) > 1:  # Training: the inputs' gradients, joined.
        wrong += [(('d_act', 0), m, Get(('d_act', 0), m)) for m in range(m_count)
                  if Get(('d_act', 0), m) != m]
    return wrong


def _Cases():
    for kind, v in (('gpipe', 1), ('1f1b', 1), ('zero_bubble', 1), ('interleaved_1f1b', 2),
                    ('zero_bubble_v', 2)):
        for k in (1, 2, 3, 4):
            for m in (1, 2, 4, 5, 8):
                if kind == 'interleaved_1f1b' and m % k:
                    continue
                yield kind, k, m, v


def _Phases(kind):
    # As the executor runs them: gpipe's forwards then (through Backward) its backwards;
    # the others in one loop with the loss inside.
    return ([(F,), (B,)], False) if kind == 'gpipe' else ([(F, B, I, W)], True)


class RingTest(parameterized.TestCase):

    @parameterized.parameters(*_Cases())
    def testEveryReadFindsItsMicroBatch(self, kind, k, m, v):
        sched = schedule_lib.Make(kind, k, m, v)
        phases, loss_in_loop = _Phases(kind)
        sizes = rings.RingSizes(sched, phases, loss_in_loop)
        self.assertEqual(_Replay(sched, phases, loss_in_loop, sizes), [])
        inference = schedule_lib.Make(kind, k, m, v, training=False)
        sizes = rings.RingSizes(inference, [(F,)], False)
        self.assertEqual(_Replay(inference, [(F,)], False, sizes), [])

    @parameterized.parameters(*_Cases())
    def testEagerRingsAreNotReusedInTheTickOfTheirLastRead(self, kind, k, m, v):
        sched = schedule_lib.Make(kind, k, m, v)
        phases, loss_in_loop = _Phases(kind)
        sizes = rings.RingSizes(
            sched, phases, loss_in_loop, reuse_in_tick=False)
        self.assertEqual(_Replay(sched, phases, loss_in_loop, sizes, eager=True), [])
        graph_sizes = rings.RingSizes(sched, phases, loss_in_loop)
        self.assertTrue(all(sizes[key] >= size for key, size in graph_sizes.items()))

    def testEagerReplayCatchesARingReusedInItsLastReadsTick(self):
        # zero_bubble_v, K=2, M=4: the graph's rings reuse a slot in the tick of its last read,
        # which an eager loop (devices in turn) reads after the write.
        sched = schedule_lib.Make('zero_bubble_v', 2, 4, 2)
        sizes = rings.RingSizes(sched, [(F, B, I, W)], True)
        self.assertNotEqual(_Replay(sched, [(F, B, I, W)], True, sizes, eager=True), [])

    @parameterized.parameters(*_Cases())
    def testNoRingCanBeSmaller(self, kind, k, m, v):
        sched = schedule_lib.Make(kind, k, m, v)
        phases, loss_in_loop = _Phases(kind)
        sizes = rings.RingSizes(sched, phases, loss_in_loop)
        for key, size in sizes.items():
            if size > 1:
                smaller = {**sizes, key: size - 1}
                self.assertNotEqual(_Replay(sched, phases, loss_in_loop, smaller), [], key)

    @parameterized.parameters(*_Cases())
    def testKeptResidualsRingsAreRightAndNoneCanBeSmaller(self, kind, k, m, v):
        sched = schedule_lib.Make(kind, k, m, v)
        phases, loss_in_loop = _Phases(kind)
        # Every other stage keeps its activations (recompute 'never' on those).
        keeps = [s % 2 == 0 for s in range(sched.num_stages)]
        sizes = rings.RingSizes(
            sched, phases, loss_in_loop, keeps=keeps)
        self.assertEqual(_Replay(sched, phases, loss_in_loop, sizes, keeps=keeps), [])
        self.assertEqual({key for key in sizes if key[0] == 'kept'},
                         {('kept', s) for s in range(sched.num_stages) if keeps[s]})
        for key, size in sizes.items():
            if size > 1:
                smaller = {**sizes, key: size - 1}
                self.assertNotEqual(
                    _Replay(sched, phases, loss_in_loop, smaller, keeps=keeps), [], key)

    @parameterized.parameters(*[c for c in _Cases() if c[1] * c[3] >= 3])
    def testSkipRingsAreRightAndNoneCanBeSmaller(self, kind, k, m, v):
        sched = schedule_lib.Make(kind, k, m, v)
        phases, loss_in_loop = _Phases(kind)
        last = sched.num_stages
        # x -> (h, s) -> ... -> (h, s) -> y: the stages between pass s on unread.
        passed = [{}] + [{1: 1}] * (last - 2) + [{}]
        floats = [[True]] + [[True, True]] * (last - 1) + [[True]]
        routes = rings.Routes(passed, floats)
        self.assertEqual(routes, [rings.Route(start=1, source=1, end=last - 1, target=1,
                                              writer=0, reader=last - 1, differentiable=True)])
        for keeps in ([False] * last, [True] * last):
            sizes = rings.RingSizes(sched, phases, loss_in_loop, keeps=keeps, routes=routes)
            self.assertEqual(_Replay(sched, phases, loss_in_loop, sizes, keeps=keeps,
                                     skip=True), [])
            for key in (('skip', 0), ('d_skip', 0)):
                if sizes[key] > 1:
                    smaller = {**sizes, key: sizes[key] - 1}
                    self.assertNotEqual(_Replay(sched, phases, loss_in_loop, smaller,
                                                keeps=keeps, skip=True), [], key)

    def testRoutesFollowAChainOfPassesToItsReader(self):
        # Four stages. Stage 0 passes input leaf 1 on as its output leaf 2, which stages 1
        # to 3 pass on to the output's leaf 0; stage 1 passes its input leaf 0 (stage 0's
        # output, an integer mask) to stage 2, which reads it.
        passed = [{1: 2}, {2: 1, 0: 2}, {1: 0}, {0: 0}]
        floats = [[True, True], [False, True, True], [True, True, False], [True, True],
                  [True]]
        self.assertEqual(rings.Routes(passed, floats), [
            rings.Route(0, 1, 4, 0, 0, 3, True), rings.Route(1, 0, 2, 2, 0, 2, False)])

    def testOneFOneBKeepsAboutKMinusBMicroBatchesAtBoundaryB(self):
        k, m = 4, 16
        sizes = rings.RingSizes(
            schedule_lib.Make('1f1b', k, m), [(F, B, I, W)], True)
        for b in range(1, k):
            self.assertLessEqual(sizes['act', b], k - b + 1)
        for b in range(1, k + 1):
            self.assertLessEqual(sizes['d_act', b], 2)
        # Keeping its activations, stage s holds about K - s micro-batches' residuals.
        kept = rings.RingSizes(
            schedule_lib.Make('1f1b', k, m), [(F, B, I, W)], True, keeps=[True] * k)
        for s in range(k):
            self.assertLessEqual(kept['kept', s], k - s + 1)
        # GPipe keeps every micro-batch's boundaries for its backwards, and the inputs,
        # outputs and input gradients are whole under every schedule.
        gpipe = rings.RingSizes(
            schedule_lib.Make('gpipe', k, m), [(F,), (B,)], False)
        for b in range(k + 1):
            self.assertEqual(gpipe['act', b], m)
        self.assertEqual((sizes['act', 0], sizes['act', k], sizes['d_act', 0]), (m, m, m))


if __name__ == '__main__':
    absltest.main()


class PackingTest(absltest.TestCase):
    """A micro-batch's residuals stored as items of one array per dtype (`rings.Packing`) come
    back as they were, from the slot they were written to, as the tensors themselves (no copy),
    whatever their shapes."""

    def _Values(self):
        return [np.arange(3 * 16, dtype=np.float32).reshape(3, 16),
                np.float32(7.5),
                np.arange(5, dtype=np.int32),
                np.ones([2, 3, 5], np.float32),
                np.array([True, False]),
                np.zeros([0, 4], np.float32)]

    def testRoundTripOfMixedDtypesAndSizesAtEverySlot(self):
        values = self._Values()
        specs = [tf.TensorSpec(np.shape(v), tf.as_dtype(np.asarray(v).dtype)) for v in values]
        packing = rings.Packing(specs)
        self.assertEqual(packing.dtypes, [tf.float32, tf.int32, tf.bool])
        self.assertEqual(packing.counts, [4, 1, 1])
        arrays = packing.Arrays(3)
        self.assertEqual([a.size() for a in arrays], [12, 3, 3])
        # Slot r holds the values plus r: no slot's items overwrite another's.
        for r in range(3):
            arrays = packing.Write(arrays, r, [tf.constant(v) + tf.cast(r, v.dtype) if
                                               v.dtype != np.bool_ else tf.constant(v)
                                               for v in values])
        for r in (2, 0, 1):
            for got, want in zip(packing.Read(arrays, tf.constant(r)), values):
                self.assertEqual(got.dtype, tf.as_dtype(np.asarray(want).dtype))
                expected = want if want.dtype == np.bool_ else want + want.dtype.type(r)
                np.testing.assert_array_equal(got.numpy(), expected)

    def testItemsAreTheTensorsWritten(self):
        values = [tf.constant(v) for v in self._Values()]
        packing = rings.Packing([tf.TensorSpec(v.shape, v.dtype) for v in values])
        arrays = packing.Write(packing.Arrays(2), 1, values)
        for got, want in zip(packing.Read(arrays, 1), values):
            self.assertIs(got, want)

    def testRunTimeShapesInAGraph(self):
        """Specs with dimensions known only when the step runs: the items keep their own
        shapes, and what is read has the specs' static shapes."""
        specs = [tf.TensorSpec([None, 4], tf.float32), tf.TensorSpec([None], tf.float32)]
        packing = rings.Packing(specs)

        @tf.function(input_signature=specs)
        def RoundTrip(a, b):
            arrays = packing.Write(packing.Arrays(2), 1, [a, b])
            read = packing.Read(arrays, tf.constant(1))
            self.assertEqual([x.shape.as_list() for x in read], [[None, 4], [None]])
            return read

        a, b = np.ones([3, 4], np.float32), np.arange(7, dtype=np.float32)
        got = RoundTrip(a, b)
        np.testing.assert_array_equal(got[0].numpy(), a)
        np.testing.assert_array_equal(got[1].numpy(), b)
