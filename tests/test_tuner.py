"""The tuner (`gpipe_tf.perf.tuner`, on the costs of `perf.cost_model`) and the trainer's
`--mode=tune`.

The tuner's search, checked against oracles of its own: on K=2 every boundary placement is
scored and none beats the tuner's for its configuration; its pick fits the memory by a memory
plan made afresh from the pick's Params (not the tuner's); where the time-optimal boundaries do
not fit a 1F1B stage 0, moved ones do; a search where nothing fits names the smallest peak. The
trainer's tune mode writes an override file that, applied, gives the chosen plan, and its errors
are one line (the check mode's tests are in test_check.py). Costs are FLOPs (deterministic)
except in the one run that measures.
"""

import dataclasses
import os
import re
import shutil
import tempfile

import pytest
import tensorflow as tf

from gpipe_tf import errors
from gpipe_tf import units
from gpipe_tf import test_utils
from gpipe_tf import trainer
from gpipe_tf.layers import basic
from gpipe_tf.perf import cost_model
from gpipe_tf.perf import memory as memory_lib
from gpipe_tf.perf import tuner
from gpipe_tf.pipeline import pipelining_layer
from gpipe_tf.pipeline import plan as plan_lib
from gpipe_tf.train import setup


DEVICES = test_utils.ConfigureVirtualCpus()
MLP = 'examples.PipelinedMLP'
InProcess = test_utils.TrainerInProcess


def Dense(widths, batch, **overrides):
    """A dense stack of `widths` on inputs of [batch, widths[0]]."""
    layers = [basic.DenseLayer.Params().Set(name=f'dense_{i}', input_dim=a, output_dim=b,
                                            activation='tanh')
              for i, (a, b) in enumerate(zip(widths[:-1], widths[1:]))]
    return pipelining_layer.PipeliningLayer.Params().Set(
        name='model', layer_tpl=layers, num_cells=2, num_micro_batches=4,
        input_shapes=[batch, widths[0]]).Set(**overrides)


def ErrorLine(result):
    assert 'Traceback' not in result.stderr, result.stderr[-3000:]
    return result.stderr.strip().splitlines()[-1]


@pytest.mark.unit
class TuneTest(tf.test.TestCase):

    def testMicroBatchCountsAreDivisorsFromK(self):
        self.assertEqual(tuner.MicroBatchCounts(64, 2), [2, 4, 8, 16])
        self.assertEqual(tuner.MicroBatchCounts(12, 2), [2, 4, 12])
        self.assertEqual(tuner.MicroBatchCounts(3, 4), [3])  # None as large as K: the batch.

    def testNoBoundaryPlacementOfKTwoBeatsTheTunersForItsConfiguration(self):
        # Widths that vary tenfold: the layers' costs differ by up to 100 times.
        p = Dense([32, 320, 32, 64, 640, 64, 32], 256)
        space = [tuner.Config(kind, 8, 1, mode) for kind in ('gpipe', '1f1b', 'zero_bubble')
                 for mode in ('never', 'always')]
        result = tuner.Tune(p, 2, 1e12, space=space)
        self.assertLen(result.candidates, len(space))
        costs = cost_model.FlopsCosts(p)
        before, layers = costs.Of(256 // 8)
        for candidate in result.candidates:
            for cut in range(1, 6):
                other = tuner.Score(p, 2, candidate.config, [0, cut, 6], before, layers, 1e12)
                self.assertGreaterEqual(other.step_s, candidate.step_s * (1 - 1e-9),
                                        f'{candidate.config}: cut at {cut} beats '
                                        f'{candidate.boundaries}')

    def testEachActionCostsItsCallOnceWhateverItsLayers(self):
        # Each layer's forward timed as a call of its own includes the call's cost once; in the
        # pipeline the cell's four layers run in one call per action. K=1: the step is every
        # action in turn, M forwards and M backwards (zero_bubble: I and W, two calls), each
        # one call's cost more than the layers' work alone.
        p = Dense([32, 64, 32, 64, 32], 64)
        before, work = cost_model.FlopsCosts(p).Of(64 // 4)
        call = 1e-3
        timed = [cost_model.LayerSeconds(c.forward + call, c.backward, c.input_grad) for c in work]
        for kind, calls_per_micro_batch in (('gpipe', 2), ('1f1b', 2), ('zero_bubble', 3)):
            config = tuner.Config(kind, 4, 1, 'never')
            bare = tuner.Score(p, 1, config, [0, 4], before, work, 1e12)
            called = tuner.Score(p, 1, config, [0, 4], before, timed, 1e12,
                                 overheads=cost_model.Overheads(action_s=call, call_s=call))
            self.assertAlmostEqual(called.step_s - bare.step_s, 4 * calls_per_micro_batch * call,
                                   msg=kind)

    def testThePickFitsWhereTheFlopsBalancedGpipeConfigurationDoesNot(self):
        p = Dense([64] * 13, 4096, num_micro_batches=8, recompute='never')
        gpipe = memory_lib.PlanMemory(p.Copy().Set(partition_method='flops'))
        limit = 0.5 * gpipe.peak_device_bytes
        self.assertFalse(gpipe.Fits(limit))
        result = tuner.Tune(p, 2, limit)
        pick = result.best
        self.assertIsNotNone(pick)
        # A plan made afresh from the pick's own Params, as the pipeline would make it.
        planned = memory_lib.PlanMemory(pick.params)
        self.assertLessEqual(planned.peak_device_bytes, limit)
        self.assertEqual(pick.params.num_cells, 2)
        # Ranked: every candidate that fits, fastest first, ahead of those that do not.
        fits = [c.fits for c in result.candidates]
        self.assertEqual(fits, sorted(fits, reverse=True))
        steps = [c.step_s for c in result.candidates if c.fits]
        self.assertEqual(steps, sorted(steps))

    def testMovedBoundariesFitAOneFOneBStageZeroWhereTheTimeOptimalOnesDoNot(self):
        # Uniform layers: the time-optimal cut is in the middle, but 1F1B's stage 0 holds two
        # micro-batches and stage 1 one.
        p = Dense([64] * 13, 4096)
        space = [tuner.Config('1f1b', 8, 1, 'never')]
        optimal = tuner.Tune(p, 2, 1e12, space=space).candidates[0]
        self.assertEqual(optimal.boundaries, (0, 6, 12))
        self.assertGreater(optimal.device_bytes[0], optimal.device_bytes[1])
        limit = 0.95 * optimal.peak_bytes
        moved = tuner.Tune(p, 2, limit, space=space).best
        self.assertIsNotNone(moved)
        self.assertTrue(moved.moved)
        self.assertLess(moved.boundaries[1], 6)  # Layers moved off stage 0.
        self.assertLessEqual(memory_lib.PlanMemory(moved.params).peak_device_bytes, limit)

    def testBetweenAlwaysAndNeverThePickKeepsTheMostLastCellsThatFit(self):
        # 1F1B at K=4: stage s holds 4 - s micro-batches, so keeping the last cells'
        # activations costs least.
        p = Dense([64] * 13, 4096, num_cells=4, num_micro_batches=8, schedule='1f1b')
        peak = lambda mode: memory_lib.PlanMemory(p.Copy().Set(recompute=mode)).peak_device_bytes
        for limit in (1.1 * peak('always'), (peak('always') + peak('never')) / 2):
            space = [tuner.Config('1f1b', 8, 1, mode) for mode in ('always', 'never')]
            result = tuner.Tune(p, 4, limit, space=space)
            pick = result.best
            self.assertIsNotNone(pick)
            kept = plan_lib.KeptCells(pick.params.recompute, 4)
            self.assertTrue(0 < kept < 4, pick.config)
            self.assertLessEqual(memory_lib.PlanMemory(pick.params).peak_device_bytes, limit)
            # The oracle: each j scored alone, boundaries fitted the same way.
            fits = [tuner.Tune(p, 4, limit, space=[tuner.Config('1f1b', 8, 1, mode)],
                               search_kept_cells=False).candidates[0].fits
                    for mode in [plan_lib.KeepLast(j) for j in range(5)]]
            self.assertEqual(kept, max(j for j in range(5) if fits[j]), fits)
            self.assertGreaterEqual(kept, 2)  # Beyond the modes 'except_last' (j = 1) offers.
            always = next(c for c in result.candidates if c.config.recompute == 'always')
            self.assertLess(pick.step_s, always.step_s)  # It re-runs more forwards.
            # Scored: the two modes and the pick, not every j.
            self.assertLen(result.candidates, 3)
            row = result.Format().splitlines()[1]
            self.assertIn(f'except_last_{kept} ({kept}/4 kept)', row)
            self.assertIn(f'recompute=except_last_{kept}', str(pick.config))

    def testKeptCellsAreNotSearchedWhereEveryCellOrNoneFits(self):
        p = Dense([64] * 13, 4096, num_cells=4, num_micro_batches=8, schedule='1f1b')
        space = [tuner.Config('1f1b', 8, 1, mode) for mode in ('always', 'never')]
        for limit in (1e12, 1024):  # 'never' fits; 'always' does not.
            modes = [c.config.recompute for c in tuner.Tune(p, 4, limit, space=space).candidates]
            self.assertCountEqual(modes, ['always', 'never'])

    def testNothingFitsNamesTheSmallestPeak(self):
        p = Dense([64] * 5, 256)
        result = tuner.Tune(p, 2, 1024)
        self.assertIsNone(result.best)
        least = min(c.peak_bytes for c in result.candidates)
        error = tuner.NoFitError(p, result)
        self.assertIsInstance(error, errors.ConfigError)
        self.assertIn(f'the smallest peak, {least / 2**30:.3g} GiB per device', str(error))
        self.assertNotIn('\n', str(error))

    def testTheTableSaysWhereTheCostsCameFrom(self):
        result = tuner.Tune(Dense([64] * 5, 256), 2, 2**30)
        table = result.Format(3)
        self.assertIn('step (nominal ms)', table)
        self.assertIn('layer costs estimated from FLOPs', table)
        self.assertLen(table.splitlines(), 1 + 3 + 1)

    def testTheTableFitsAScreenAtAnyKAndVerboseAddsBoundariesAndPeaks(self):
        p = Dense([64] * 65, 256, num_cells=32, num_micro_batches=32)
        result = tuner.Tune(p, 32, 2**30, space=[tuner.Config('1f1b', 32, 1, 'always'),
                                                  tuner.Config('gpipe', 64, 1, 'never')])
        lines = result.Format().splitlines()
        self.assertLessEqual(max(len(line) for line in lines), 150, '\n'.join(lines))
        self.assertEqual(lines[0].split()[-5:], ['peak', '(MiB)', 'spread', '(MiB)', 'fits'])
        verbose = result.Format(verbose=True).splitlines()
        for candidate, line in zip(result.candidates, verbose[1:]):
            self.assertIn(','.join(map(str, candidate.boundaries)), line)
            self.assertTrue(line.endswith(' '.join(units.MiB(b) for b in
                                                   candidate.device_bytes)), line)
        # The spread: the largest peak less the smallest.
        first = result.candidates[0]
        self.assertIn(units.MiB(first.peak_bytes - min(first.device_bytes)), lines[1])

    def testCalibrationScalesThePredictionsToTheMeasuredSteps(self):
        # The oracle: two equal cells on two devices; gpipe and 1f1b take M + 1 slots of a
        # cell's forward and M + 1 of its backward (the last micro-batch's fill and the first's
        # drain), each slot a micro-batch's share of a cell's work and one action's cost.
        p = Dense([32, 64, 32, 64, 32], 64)

        class Costs(cost_model.FlopsCosts):
            def Overheads(self, micro_batch_size):
                return cost_model.Overheads(action_s=1e-3)

        costs = Costs(p)
        before, layers = costs.Of(64)
        work = sum(c.forward + c.backward for c in list(before) + list(layers))

        def Step(m):
            return (m + 1) * (work / (2 * m) + 2e-3)

        counts = tuner.MicroBatchCounts(64, 2)
        noise = dict(zip(counts, (1.1, 0.95, 1.0, 1.05)))  # Measured steps vary.
        runs = []

        def Measure(candidate):
            self.assertEqual(list(candidate.boundaries), [0, 2, 4])
            runs.append(candidate.config)
            return 0.6 * noise[candidate.config.num_micro_batches] * Step(
                candidate.config.num_micro_batches)

        fitted = tuner.Calibrate(p, 2, costs, Measure, 1e12, slots_per_param=0)
        self.assertEqual([(c.schedule, c.num_micro_batches) for c in runs],
                         [('gpipe', m) for m in counts])
        # Least squares in relative error, min over k of sum((k / r - 1)^2) for the measured
        # over predicted ratios r = 0.6 x noise: k = sum(1 / r) / sum(1 / r^2).
        expected = (sum(1 / (0.6 * noise[m]) for m in counts) /
                    sum(1 / (0.6 * noise[m]) ** 2 for m in counts))
        self.assertAllClose(fitted.scale, expected, rtol=1e-6)
        self.assertIn(f'x{expected:.2f} calibrated on measured gpipe steps', fitted.description)
        space = [tuner.Config('1f1b', m, 1, 'never') for m in (2, 4, 32)]
        for candidate in tuner.Tune(p, 2, 1e12, fitted, 0, space).candidates:
            self.assertAllClose(candidate.step_s,
                                expected * Step(candidate.config.num_micro_batches),
                                rtol=1e-6, msg=str(candidate.config))

    def testCalibrationWithNothingThatFitsLeavesTheCosts(self):
        p = Dense([32, 64, 32], 64)
        costs = cost_model.FlopsCosts(p)
        self.assertIs(tuner.Calibrate(p, 2, costs, lambda c: 1.0, 1024), costs)

    def testMeasureBestRunsTheBestRankedThatFitAndPutsTheFastestFirst(self):
        p = Dense([64] * 7, 256)
        space = [tuner.Config(kind, 8, 1, mode) for kind in ('gpipe', '1f1b', 'zero_bubble')
                 for mode in ('never', 'always')]
        result = tuner.Tune(p, 2, 1e12, space=space)
        # The best-ranked does not fit: it is not run.
        candidates = [dataclasses.replace(result.candidates[0], fits=False)] + \
            result.candidates[1:]
        result = dataclasses.replace(result, candidates=candidates)
        seconds = {c.config: 1.0 - 0.1 * i for i, c in enumerate(candidates)}  # Later: faster.
        runs, lines = [], []

        def Measure(candidate):
            runs.append(candidate.config)
            return seconds[candidate.config]

        measured = tuner.MeasureBest(result, Measure, 3, progress=lines.append)
        self.assertEqual(runs, [c.config for c in candidates[1:4]])
        self.assertEqual([c.config for c, _ in measured],
                         [c.config for c in reversed(candidates[1:4])])
        self.assertEqual([s for _, s in measured], sorted(seconds[c] for c in runs))
        self.assertLen(lines, 3)
        self.assertRegex(lines[0], r'^rank 1: .* predicted [\d.]+ ms, measured 900.00 ms$')

    def testPipelineParamsWithoutLayersToPartitionAreRefused(self):
        p = Dense([64] * 5, 256).Set(input_shapes=None)
        with self.assertRaisesRegex(errors.ConfigError, 'input_shapes'):
            tuner.Tune(p, 2, 2**30)


class TuneModeTest(tf.test.TestCase):

    def LogDir(self):
        path = tempfile.mkdtemp(prefix='tune_test_')
        self.addCleanup(shutil.rmtree, path, ignore_errors=True)
        return path

    def testTheOverrideFileGivesTheChosenPlan(self):
        logdir = self.LogDir()
        output = InProcess(f'--model={MLP}', '--mode=tune', '--num_devices=2',
                           '--device_memory_gib=1', '--tune_costs=flops',
                           f'--logdir={logdir}').stdout
        self.assertIn('layer costs estimated from FLOPs', output)
        chosen = re.search(r'chosen \(the best-ranked\): (\S+)(?: v=(\d))? M=(\d+) '
                           r'recompute=(\S+) with boundaries \[([\d, ]+)\]', output)
        self.assertIsNotNone(chosen, output)
        path = os.path.join(logdir, 'tuned_params.txt')
        self.assertIn(f'wrote {path}', output)
        task = setup.TaskParams(trainer.ParseConfig(
            [f'--model={MLP}', f'--model_params_file_override={path}']))
        plan = plan_lib.MakePlan(task.model, place=False)
        kind, v, m, recompute, bounds = chosen.groups()
        self.assertEqual(task.model.schedule, kind)
        self.assertEqual(plan.num_devices, 2)
        self.assertEqual(plan.virtual_stages, int(v or 1))
        self.assertEqual(plan.num_micro_batches, int(m))
        self.assertEqual(task.model.recompute, recompute)
        sizes = [len(cell) for cell in plan.cells]
        self.assertEqual([0] + [sum(sizes[:i + 1]) for i in range(len(sizes))],
                         [int(b) for b in bounds.split(',')])

    def testMeasuredCostsAreCalibratedAndTheFastestOfTheBestRankedIsChosen(self):
        logdir = self.LogDir()
        output = InProcess(f'--model={MLP}', '--mode=tune', '--num_devices=2',
                           '--device_memory_gib=1', '--tune_costs=measured', '--tune_steps=2',
                           '--tune_top=2', f'--logdir={logdir}').stdout
        self.assertIn('layer costs measured on CPU', output)
        self.assertRegex(output, r'x[\d.]+ calibrated on measured gpipe steps \(M=2: [\d.]+ ms, '
                         r'4: [\d.]+ ms, 8: [\d.]+ ms, 16: [\d.]+ ms\)')
        runs = re.findall(r'^rank (\d): (.*) \[[\d, ]+\]: predicted [\d.]+ ms, measured '
                          r'([\d.]+) ms$', output, re.M)
        self.assertEqual([rank for rank, _, _ in runs], ['1', '2'])
        # Steps are printed to 0.01 ms: two that print alike may both be the fastest.
        least = min(float(run[2]) for run in runs)
        fastest = [name for _, name, ms in runs if float(ms) == least]
        chosen = re.search(r'chosen \(the fastest of the 2 best-ranked, measured\): (.*?) with '
                           r'boundaries', output)
        self.assertIsNotNone(chosen, output)
        self.assertIn(chosen.group(1), fastest)
        with open(os.path.join(logdir, 'tuned_params.txt')) as f:
            self.assertIn(f': {chosen.group(1)}, K=2', f.readline())
        self.assertRegex(output, r'ran the pick for 2 steps: step [\d.]+ ms measured, '
                         r'[\d.]+ ms predicted')
        # The layers' costs are kept in the logdir: a second run measures none again.
        self.assertIn('measured layer', output)
        self.assertTrue(os.path.exists(os.path.join(logdir, 'layer_costs.json')))
        again = InProcess(f'--model={MLP}', '--mode=tune', '--num_devices=2',
                          '--device_memory_gib=1', '--tune_costs=measured', '--tune_steps=0',
                          f'--logdir={logdir}').stdout
        self.assertNotIn('measured layer', again)
        self.assertIn('chosen (the best-ranked)', again)

    def testTuneTopBelowOneIsOneLine(self):
        result = InProcess(f'--model={MLP}', '--mode=tune', '--num_devices=2',
                           '--device_memory_gib=1', '--tune_top=0', f'--logdir={self.LogDir()}',
                           check=False)
        self.assertEqual(result.returncode, 2, result.stderr)
        self.assertEqual(ErrorLine(result), 'error: --tune_top must be at least 1 (the '
                         'configurations to run and choose from), got 0.')

    def testWithoutAMemoryIsOneLine(self):
        result = InProcess(f'--model={MLP}', '--mode=tune', f'--logdir={self.LogDir()}',
                           check=False)
        self.assertEqual(result.returncode, 2, result.stderr)
        self.assertRegex(ErrorLine(result), r'^error: --mode=tune needs --device_memory_gib')

    def testMoreDevicesThanLayersIsOneLineNamingNumDevices(self):
        for flags, expected in (
                (['--num_devices=8'], 'one cell per device: tune for at most 4 devices.'),
                (['--num_devices=4', '--virtual_stages=2', '--schedule=interleaved_1f1b'],
                 '2 cells per device (--virtual_stages): tune for at most 2 devices.')):
            result = InProcess(f'--model={MLP}', '--mode=tune', *flags, '--device_memory_gib=1',
                               '--tune_costs=flops', f'--logdir={self.LogDir()}', check=False)
            self.assertEqual(result.returncode, 2, result.stderr)
            self.assertEqual(ErrorLine(result), f'error: {flags[0]}: examples.PipelinedMLP has 4 '
                             'layers to partition into cells of at least one layer, '
                             f'{expected}')

    def testDevicesThatDoNotSplitIntoTheReplicasAreOneLineNamingNumDevices(self):
        for devices, replicas, expected in (
                (1, 2, 'a positive multiple of R=2 (--worker_replicas)'),
                (3, 2, 'a positive multiple of R=2 (--worker_replicas)')):
            result = InProcess(f'--model={MLP}', '--mode=tune', f'--num_devices={devices}',
                               f'--worker_replicas={replicas}', '--device_memory_gib=1',
                               '--tune_costs=flops', f'--logdir={self.LogDir()}', check=False)
            self.assertEqual(result.returncode, 2, result.stderr)
            self.assertStartsWith(ErrorLine(result),
                                  f'error: --num_devices={devices}: tune needs {expected}')
        # No device at all needs no model: answered before TensorFlow loads (`trainer`).
        result = InProcess(f'--model={MLP}', '--mode=tune', '--num_devices=0',
                           '--device_memory_gib=1', f'--logdir={self.LogDir()}', check=False)
        self.assertEqual(ErrorLine(result),
                         'error: --num_devices: must be a positive integer (devices), got 0.')

    def testNegativeTuneStepsIsOneLine(self):
        logdir = os.path.join(self.LogDir(), 'run')
        result = InProcess(f'--model={MLP}', '--mode=tune', '--num_devices=2',
                           '--device_memory_gib=1', '--tune_costs=measured', '--tune_steps=-1',
                           f'--logdir={logdir}', check=False)
        self.assertEqual(result.returncode, 2, result.stderr)
        self.assertEqual(ErrorLine(result), 'error: --tune_steps must be at least 0 (the steps '
                         'to run each configuration; 0: run none), got -1.')
        self.assertNotIn('measured layer', result.stdout)  # Before anything is measured.

    def testNothingFitsIsOneLineNamingTheMemoryThatWould(self):
        logdir = os.path.join(self.LogDir(), 'run')
        result = InProcess(f'--model={MLP}', '--mode=tune', '--device_memory_gib=1e-6',
                           '--tune_costs=flops', f'--logdir={logdir}', check=False)
        self.assertEqual(result.returncode, 2, result.stderr)
        self.assertRegex(ErrorLine(result), r'^error: .*no configuration fits devices of '
                         r'1e-06 GiB; the smallest peak, [\d.e-]+ GiB per device, is ')
        self.assertFalse(os.path.exists(logdir))
