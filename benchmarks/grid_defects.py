r"""Does a small grid of (K, M, recompute) cases catch what the full grid of 36 catches?

tests/test_pipeline.py checks that a PipeliningLayer's outputs and gradients equal the
un-partitioned layers' over GRID = {1, 2, 4} cells x {1, 2, 4, 8} micro-batches x 3 recompute
modes (36 cases). PAIRWISE, 12 of them,

    PAIRWISE = [(k, m, MODES[(i + j) % 3]) for i, k in enumerate([1, 2, 4])
                                           for j, m in enumerate([1, 2, 4, 8])]

covers every (K, M), (K, mode) and (M, mode) pair; the tests' grid (SMALL) adds (4, 8,
'always'), the largest pipeline in the default mode, for a defect that needs all three. This
script seeds defects into gpipe_tf at graph-build time (each a context manager of
`unittest.mock.patch`es; no source file is edited), runs the tests' equivalence check on every
case of the full grid under each defect, and reports which cases fail (relative error at or
above the tests' tolerance, or an exception) in the full grid, among the pairwise cases and
among the tests' cases, and whether each smaller grid still catches the defect (at least one
failing case). A row without any defect checks that both grids pass as they are.

Each defect but one builds and runs, giving wrong outputs or gradients silently (no exception),
so a case fails only where the check sees the wrong value; the JSON's `exceptions` counts the
cases that raised instead. The exception is except_last_flags_short: the schedule's own
validation (`schedule.Make`, via `plan.MakeSchedule`) rejects K - 1 flags for K stages, a
ConfigError in every "except_last" case, which is the library catching the defect.

The check is the tests' `testTfFunctionMatchesUnpartitioned` (with `--v1`
also `testV1GraphMatchesUnpartitioned`), rebuilt here from `gpipe_tf.test_utils`: the same
8-layer dense tanh stack, batch 16, width 8, tolerance 1e-5, on 8 virtual CPU devices.

    python benchmarks/grid_defects.py [--v1] [--defects=a,b]
                                      [--out=benchmarks/results/grid_defects.json]

Prints one progress line per defect to stderr, then a table; writes every case to JSON. About
12 s per defect (36 cases) for the tf.function check on this machine's CPUs, 82 s for the
default seven.

Wrong re-materialization flags alone are invisible to this check (recompute changes memory, not
values): `--defects=recompute_flags_inverted` shows it; it is not in the default list.
"""

from __future__ import annotations

import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import argparse  # pylint: disable=g-import-not-at-top,g-bad-import-order
import contextlib
import dataclasses
import itertools
import json
import sys
import time
from unittest import mock

import tensorflow as tf  # pylint: disable=g-import-not-at-top,g-bad-import-order
from absl import logging  # pylint: disable=g-import-not-at-top

from gpipe_tf import test_utils  # pylint: disable=g-import-not-at-top
from gpipe_tf.layers import basic  # pylint: disable=g-import-not-at-top
from gpipe_tf.pipeline import cell as cell_lib  # pylint: disable=g-import-not-at-top
from gpipe_tf.pipeline import leaves  # pylint: disable=g-import-not-at-top
from gpipe_tf.pipeline import microbatch  # pylint: disable=g-import-not-at-top
from gpipe_tf.pipeline import pipelining_layer  # pylint: disable=g-import-not-at-top
from gpipe_tf.pipeline import plan as plan_lib  # pylint: disable=g-import-not-at-top
from gpipe_tf.pipeline import schedule  # pylint: disable=g-import-not-at-top
from gpipe_tf.pipeline import unrolled  # pylint: disable=g-import-not-at-top

DEVICES: list[str] = []  # Set by main() before any TF op runs.

# As in tests/test_pipeline.py.
TOLERANCE = 1e-5
BATCH, DIM, NUM_LAYERS = 16, 8, 8
KS, MS, MODES = [1, 2, 4], [1, 2, 4, 8], plan_lib.RECOMPUTE_MODES
GRID = list(itertools.product(KS, MS, MODES))
PAIRWISE = [(k, m, MODES[(i + j) % 3]) for i, k in enumerate(KS) for j, m in enumerate(MS)]
# tests/test_pipeline.py's GRID: the pairwise cases and the largest pipeline in the default mode
# (pairwise alone misses big_pipeline_recompute_grad_dropped, which needs all three at once).
SMALL = PAIRWISE + [(4, 8, 'always')]


def CheckPairwiseCoverage() -> None:
    """PAIRWISE holds every (K, M), (K, mode) and (M, mode) pair of GRID."""
    for a, b in ((0, 1), (0, 2), (1, 2)):
        want = {(case[a], case[b]) for case in GRID}
        got = {(case[a], case[b]) for case in PAIRWISE}
        assert got == want, f'PAIRWISE misses pairs {sorted(want - got)} of positions {a, b}.'


# ---- the tests' pipeline and checks ----------------------------------------------------------

def DenseStack(num_layers=NUM_LAYERS, dim=DIM):
    return [basic.DenseLayer.Params().Set(input_dim=dim, output_dim=dim, activation='tanh')
            for _ in range(num_layers)]


def PipelineParams(num_cells, num_micro_batches, recompute_mode='always'):
    return pipelining_layer.PipeliningLayer.Params().Set(
        name='pipe', layer_tpl=DenseStack(), num_cells=num_cells,
        num_micro_batches=num_micro_batches, recompute=recompute_mode,
        input_shapes=[BATCH, DIM], devices=DEVICES[:4])


def RandomInputs(shape=(BATCH, DIM)):
    return tf.random.stateless_normal(shape, [7, 11])


def TfFunctionError(k, m, mode) -> float:
    """testTfFunctionMatchesUnpartitioned's relative error."""
    layer = PipelineParams(k, m, mode).Instantiate()
    x = RandomInputs()
    got = tf.function(lambda x: test_utils.OutputsAndGrads(layer, layer, x))(x)
    want = test_utils.OutputsAndGrads(lambda x: test_utils.Unpartitioned(layer, x), layer, x)
    return test_utils.MaxRelativeError(got, want)


def V1GraphError(k, m, mode) -> float:
    """testV1GraphMatchesUnpartitioned's relative error."""
    graph = tf.Graph()
    with graph.as_default():
        layer = PipelineParams(k, m, mode).Instantiate()
        inputs = RandomInputs()
        xs = test_utils.FloatLeaves(inputs) + list(layer.trainable_variables)
        y = layer(inputs)
        y_ref = test_utils.Unpartitioned(layer, inputs)
        fetches = ([y, tf.compat.v1.gradients(test_utils.SquareLoss(y), xs)],
                   [y_ref, tf.compat.v1.gradients(test_utils.SquareLoss(y_ref), xs)])
        config = tf.compat.v1.ConfigProto(device_count={'CPU': len(DEVICES)})
        with tf.compat.v1.Session(graph=graph, config=config) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            got, want = sess.run(fetches)
    return test_utils.MaxRelativeError(got, want)


VARIANTS = {'tf_function': TfFunctionError, 'v1': V1GraphError}


# ---- seeded defects --------------------------------------------------------------------------

def _ZeroGrads(d_theta):
    return [None if g is None else tf.zeros_like(g) for g in d_theta]


class _Running:
    """The UnrolledSchedule whose Backward is being built and the (cell, micro-batch) of the
    backward action it is building, for defects that depend on K, M or the micro-batch:
    `unrolled.UnrolledSchedule.Backward` and `._B` are wrapped to record them."""

    def __init__(self):
        self.stack = []  # (executor, cell, micro-batch); cell and micro-batch None outside _B.

    @contextlib.contextmanager
    def Recording(self):
        real_backward = unrolled.UnrolledSchedule.Backward
        real_b = unrolled.UnrolledSchedule._B  # pylint: disable=protected-access
        running = self

        def Backward(self, d_outputs):
            running.stack.append((self, None, None))
            try:
                return real_backward(self, d_outputs)
            finally:
                running.stack.pop()

        def B(self, k, m):
            running.stack.append((self, k, m))
            try:
                return real_b(self, k, m)
            finally:
                running.stack.pop()

        with mock.patch.object(unrolled.UnrolledSchedule, 'Backward', Backward), \
                mock.patch.object(unrolled.UnrolledSchedule, '_B', B):
            yield

    @property
    def action(self):
        """(executor, cell, micro-batch) of the backward being built, or (None, None, None)."""
        return self.stack[-1] if self.stack else (None, None, None)


@contextlib.contextmanager
def NoDefect():
    yield


@contextlib.contextmanager
def ConcatReversed():
    real = microbatch.Concat

    def Concat(micro_batches, batch_dim=0, sizes=None):
        if sizes is not None:  # A batch known only when the step runs: its sizes, reversed too.
            sizes = list(reversed(sizes)) if isinstance(sizes, list) else tf.reverse(sizes, [0])
        return real(list(reversed(micro_batches)), batch_dim, sizes)

    # The executor looks it up as `microbatch.Concat` for the outputs and the input gradients.
    with mock.patch.object(microbatch, 'Concat', Concat):
        yield


@contextlib.contextmanager
def _OrderWithout(drop):
    """Patches `schedule.Make` so the build order leaves out the actions `drop(sched, action)`
    names (bypassing the validator, as a bug in the executor's walk would), and reads the
    gradients a left-out backward never gave as zeros (`UnrolledSchedule._Gradients`): its
    micro-batch's input gradient, and a cell's weight gradient when none of its backwards ran.
    Without that, the executor fails to join the None input gradient (a TypeError from
    ConcatV2 at graph build, in every case), and the patch, not the grid, would catch it; with
    it the step silently gives wrong gradients, which is what the grid is to see."""
    real_make = schedule.Make
    real_gradients = unrolled.UnrolledSchedule._Gradients  # pylint: disable=protected-access

    def Make(*args, **kwargs):
        sched = real_make(*args, **kwargs)
        return dataclasses.replace(sched, order=tuple(a for a in sched.order
                                                      if not drop(sched, a)))

    def Gradients(self):
        # pylint: disable=protected-access
        with tf.device(self._devices[0]):
            for m, d_x in enumerate(self._d_inputs):
                if d_x is None:  # The micro-batch whose cell-0 backward never ran.
                    self._d_inputs[m] = tf.nest.map_structure(
                        lambda x: tf.zeros_like(x) if leaves.IsFloat(x) else None,
                        self._acts[0][m])
        for k, d_theta in enumerate(self._d_thetas):
            if d_theta is None:  # A cell none of whose backwards ran (K = M = 1).
                with tf.device(self._devices[k]):
                    self._d_thetas[k] = [
                        tf.zeros_like(w) if trainable else None for w, trainable in
                        zip(tf.nest.flatten(self._thetas[k]), self._functions[k].trainable)]
        return real_gradients(self)

    with mock.patch.object(schedule, 'Make', Make), mock.patch.object(
            unrolled.UnrolledSchedule, '_Gradients', Gradients):
        yield


@contextlib.contextmanager
def BackwardLastTickDropped():
    # The last backward tick of fill-drain is cell 0's backward of micro-batch M-1: an
    # off-by-one in the walk over the backward.
    with _OrderWithout(lambda sched, a: a == schedule.Action(
            'B', 0, sched.num_micro_batches - 1)):
        yield


@contextlib.contextmanager
def ExceptLastFlagsShort():
    real = plan_lib.RecomputeFlags

    def RecomputeFlags(mode, num_cells):
        if mode == 'except_last':  # "All but the last" written as range(num_cells - 1).
            return [True for _ in range(num_cells - 1)]
        return real(mode, num_cells)

    # MakePlan and MakeSchedule look it up in plan's globals.
    with mock.patch.object(plan_lib, 'RecomputeFlags', RecomputeFlags):
        yield


@contextlib.contextmanager
def LastMicroBatchGradsDropped(min_cells_times_micro_batches=1, recompute_only=False):
    """Every cell's weight gradient of micro-batch M - 1 is left out of its running sum (only
    when K * M >= the threshold; with recompute_only, only in re-materializing cells)."""
    running = _Running()

    def IsLast(sched, m) -> bool:
        return (sched is not None and m == sched.schedule.num_micro_batches - 1 and
                sched.schedule.num_stages * sched.schedule.num_micro_batches >=
                min_cells_times_micro_batches)

    real_cell_backward = cell_lib.CellFunctions.Backward

    def CellBackward(self, theta, inputs, step, first_example, d_outputs):
        # `first_example` is a tensor (the micro-batch's first example in the mini-batch): the
        # micro-batch is the one of the executor's backward action being built.
        d_theta, d_x = real_cell_backward(self, theta, inputs, step, first_example, d_outputs)
        sched, _, m = running.action
        if IsLast(sched, m):
            d_theta = _ZeroGrads(d_theta)
        return d_theta, d_x

    real_differentiate = cell_lib.Differentiate

    def Differentiate(outputs, theta, inputs, d_outputs, trainable, tape=None):
        d_theta, d_x = real_differentiate(outputs, theta, inputs, d_outputs, trainable, tape)
        sched, k, m = running.action
        # The executor's call for a cell that keeps its activations passes its recorded
        # inputs; the re-materializing backward's own call (inside CellFunctions) does not.
        if (IsLast(sched, m) and
                inputs is sched._inputs[k][m]):  # pylint: disable=protected-access
            d_theta = _ZeroGrads(d_theta)
        return d_theta, d_x

    patches = [mock.patch.object(cell_lib.CellFunctions, 'Backward', CellBackward)]
    if not recompute_only:
        # The executor calls `cell_lib.Differentiate` for cells that keep their activations.
        patches.append(mock.patch.object(cell_lib, 'Differentiate', Differentiate))
    with running.Recording(), contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        yield


@contextlib.contextmanager
def BigPipelineTickDropped():
    # Cell 0's backward of the last micro-batch, only when K * M >= 32.
    with _OrderWithout(lambda sched, a: (
            sched.num_stages * sched.num_micro_batches >= 32 and
            a == schedule.Action('B', 0, sched.num_micro_batches - 1))):
        yield


@contextlib.contextmanager
def RecomputeFlagsInverted():
    real = plan_lib.RecomputeFlags

    def RecomputeFlags(mode, num_cells):
        return [not flag for flag in real(mode, num_cells)]

    with mock.patch.object(plan_lib, 'RecomputeFlags', RecomputeFlags):
        yield


# name -> (context manager factory, one-line description of the patch).
DEFECTS = {
    'none': (NoDefect, 'no patch (sanity: both grids must pass)'),
    'concat_reversed': (
        ConcatReversed,
        'microbatch.Concat joins the micro-batches in reverse order (outputs and input '
        'gradients)'),
    'backward_last_tick_dropped': (
        BackwardLastTickDropped,
        'the backward walk stops one action short: cell 0\'s backward of micro-batch M-1 '
        'never runs; the gradients it would have given read as zeros (its micro-batch\'s input '
        'gradient; cell 0\'s weight gradient at M = 1)'),
    'except_last_flags_short': (
        ExceptLastFlagsShort,
        'plan.RecomputeFlags gives K - 1 flags for "except_last" (the last cell\'s is missing): '
        'schedule.Make\'s validation raises a ConfigError in every except_last case'),
    'last_mb_grads_dropped': (
        LastMicroBatchGradsDropped,
        'every cell\'s weight gradient of micro-batch M-1 is not added to the running sum '
        '(CellFunctions.Backward and cell_lib.Differentiate return zeros for it)'),
    'big_pipeline_tick_dropped': (
        BigPipelineTickDropped,
        'the backward walk drops cell 0\'s backward of micro-batch M-1 when K * M >= 32 (its '
        'gradients read as zeros, as in backward_last_tick_dropped)'),
    'big_pipeline_recompute_grad_dropped': (
        lambda: LastMicroBatchGradsDropped(min_cells_times_micro_batches=32,
                                           recompute_only=True),
        'when K * M >= 32, a re-materializing cell\'s (CellFunctions.Backward) weight gradient '
        'of micro-batch M-1 is dropped: a K x M x mode interaction'),
    # Not run by default: re-materialization changes memory, not values, so no equivalence
    # case can see wrong flags (run it with --defects to check).
    'recompute_flags_inverted': (
        RecomputeFlagsInverted,
        'plan.RecomputeFlags inverted: "always" keeps activations, "never" re-materializes'),
}
DEFAULT_DEFECTS = [name for name in DEFECTS if name != 'recompute_flags_inverted']


# ---- running ---------------------------------------------------------------------------------

def RunCase(variant: str, defect: str, case) -> dict:
    k, m, mode = case
    start = time.perf_counter()
    try:
        with DEFECTS[defect][0]():
            error = VARIANTS[variant](k, m, mode)
        exception = None
    except Exception as e:  # pylint: disable=broad-except
        # A tf.function error's message starts with its traceback; its last line is the cause.
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        error, exception = None, f'{type(e).__name__}: {lines[-1][:200] if lines else ""}'
    failed = exception is not None or not error < TOLERANCE  # NaN fails too.
    return {'variant': variant, 'defect': defect, 'k': k, 'm': m, 'mode': mode,
            'pairwise': case in PAIRWISE, 'small': case in SMALL, 'max_relative_error': error,
            'exception': exception, 'failed': failed,
            'seconds': round(time.perf_counter() - start, 3)}


def Summarize(variant: str, defect: str, cases: list[dict]) -> dict:
    full = [(c['k'], c['m'], c['mode']) for c in cases if c['failed']]
    pairwise = [case for case in full if case in PAIRWISE]
    small = [case for case in full if case in SMALL]
    return {'variant': variant, 'defect': defect, 'description': DEFECTS[defect][1],
            'full_failures': len(full), 'full_cases': len(GRID),
            'pairwise_failures': len(pairwise), 'pairwise_cases': len(PAIRWISE),
            'small_failures': len(small), 'small_cases': len(SMALL),
            'full_caught': bool(full), 'pairwise_caught': bool(pairwise),
            'small_caught': bool(small),
            'failing_cases': [list(c) for c in full],
            'failing_pairwise_cases': [list(c) for c in pairwise],
            'exceptions': sum(c['exception'] is not None for c in cases)}


def FormatCases(cases: list) -> str:
    if not cases:
        return '-'
    if len(cases) > 4:
        return f'{len(cases)} cases'
    return ' '.join(f'{k}/{m}/{mode}' for k, m, mode in cases)


def FormatTable(summaries: list[dict]) -> str:
    header = (f'{"variant":11s} {"defect":36s} {"full fail":>9s} {"pairwise fail":>13s} '
              f'{"pairwise catches":>16s} {"tests fail":>10s} {"tests catch":>11s}  '
              f'failing cases (K/M/mode): full | pairwise')
    lines = [header, '-' * len(header)]
    for s in summaries:
        if s['defect'] == 'none':
            verdict = small_verdict = ('ok' if not s['full_caught'] and not s['small_caught']
                                       else 'BROKEN')
        elif not s['full_caught']:
            verdict = small_verdict = 'n/a'
        else:
            verdict = 'yes' if s['pairwise_caught'] else 'NO'
            small_verdict = 'yes' if s['small_caught'] else 'NO'
        lines.append(f'{s["variant"]:11s} {s["defect"]:36s} '
                     f'{s["full_failures"]:>4d}/{s["full_cases"]:<4d} '
                     f'{s["pairwise_failures"]:>8d}/{s["pairwise_cases"]:<4d} {verdict:>16s} '
                     f'{s["small_failures"]:>5d}/{s["small_cases"]:<4d} {small_verdict:>11s}  '
                     f'{FormatCases([tuple(c) for c in s["failing_cases"]])} | '
                     f'{FormatCases([tuple(c) for c in s["failing_pairwise_cases"]])}')
    return '\n'.join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--variants', default='tf_function',
                        help=f'Comma-separated checks, of {list(VARIANTS)}.')
    parser.add_argument('--v1', action='store_true',
                        help='Also the v1 graph check (adds v1 to --variants).')
    parser.add_argument('--defects', default=','.join(DEFAULT_DEFECTS),
                        help=f'Comma-separated defects, of {list(DEFECTS)}.')
    parser.add_argument('--out', default='benchmarks/results/grid_defects.json',
                        help='JSON path.')
    args = parser.parse_args()
    variants, defects = args.variants.split(','), args.defects.split(',')
    if args.v1 and 'v1' not in variants:
        variants.append('v1')
    for name, known in ((variants, VARIANTS), (defects, DEFECTS)):
        unknown = [n for n in name if n not in known]
        if unknown:
            parser.error(f'unknown {unknown}; choose from {list(known)}')
    CheckPairwiseCoverage()
    DEVICES[:] = test_utils.ConfigureVirtualCpus()
    logging.set_verbosity(logging.WARNING)
    tf.get_logger().setLevel('ERROR')
    start = time.perf_counter()
    summaries, cases = [], []

    def Write():
        os.makedirs(os.path.dirname(args.out) or '.', exist_ok=True)
        with open(args.out, 'w', encoding='utf-8') as f:  # After every defect.
            json.dump({'tensorflow': tf.__version__, 'tolerance': TOLERANCE,
                       'grid': [list(c) for c in GRID], 'pairwise': [list(c) for c in PAIRWISE],
                       'small': [list(c) for c in SMALL],
                       'seconds': round(time.perf_counter() - start, 1),
                       'summaries': summaries, 'cases': cases}, f, indent=1)

    print(f'TensorFlow {tf.__version__}, {len(DEVICES)} virtual CPU devices; full grid '
          f'{len(GRID)} cases, pairwise {len(PAIRWISE)}', file=sys.stderr)
    for variant in variants:
        for defect in defects:
            defect_start = time.perf_counter()
            results = [RunCase(variant, defect, case) for case in GRID]
            cases.extend(results)
            summaries.append(Summarize(variant, defect, results))
            s = summaries[-1]
            print(f'[{time.perf_counter() - start:7.1f}s] {variant} {defect}: full '
                  f'{s["full_failures"]}/{len(GRID)} failing ({s["exceptions"]} exceptions), '
                  f'pairwise {s["pairwise_failures"]}/{len(PAIRWISE)}, tests\' grid '
                  f'{s["small_failures"]}/{len(SMALL)} '
                  f'({time.perf_counter() - defect_start:.1f}s)', file=sys.stderr, flush=True)
            Write()
    print(FormatTable(summaries))
    print(f'total {time.perf_counter() - start:.1f}s; wrote {args.out}')


if __name__ == '__main__':
    main()
