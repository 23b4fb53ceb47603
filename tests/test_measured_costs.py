"""partition_method="time" (`perf/measured_costs.py`): each layer timed on one micro-batch, the
cells the optimal min-max partition of those times, the times cached in process and in a costs
file so that a second run does not measure again; for PipeliningLayer Params, for Keras layers
(`Pipeline.FromKeras`) and in the trainer.

Where a test checks which boundaries the times give, `_Measure` is replaced by costs made up
from each layer's configuration (the clock is not a test's oracle); the real measurement is
checked for what it must hold on any machine (positive times, the output's bytes) and for its
cache."""

import json
import os
import tempfile
from unittest import mock

import keras
import numpy as np
import pytest
import tensorflow as tf

from gpipe_tf import errors
from gpipe_tf import test_utils
from gpipe_tf.keras import Pipeline
from gpipe_tf.layers import basic
from gpipe_tf.perf import measured_costs
from gpipe_tf.pipeline import partition
from gpipe_tf.pipeline import pipelining_layer
from gpipe_tf.pipeline import plan as plan_lib


DEVICES = test_utils.ConfigureVirtualCpus()
BATCH, DIM, M = 16, 4, 4


def _Params(activations, **kwargs):
    layers = [basic.DenseLayer.Params().Set(input_dim=DIM, output_dim=DIM, activation=a)
              for a in activations]
    return pipelining_layer.PipeliningLayer.Params().Set(
        name='pipe', layer_tpl=layers, input_shapes=[BATCH, DIM], num_micro_batches=M,
        devices=DEVICES[:2], **kwargs)


def _Cells(p):
    """Each cell's number of layers; a time partition measured first (`TimedBoundaries`)."""
    if p.partition_method == 'time':
        p = p.Copy().Set(partition_method=measured_costs.TimedBoundaries(p))
    return [len(cell) for cell in plan_lib.MakePlan(p, place=False).cells]


class _MadeUpCosts:
    """Stands in for `measured_costs._Measure`: a cost made up from what the layer is, and a
    count of the layers measured."""

    def __init__(self, forward_s):
        self.forward_s = forward_s  # forward_s(layer, outputs) -> seconds.
        self.calls = 0

    def __call__(self, layer, args, device, repeats, time_limit_s, outputs):
        del args, device, repeats, time_limit_s
        self.calls += 1
        forward = self.forward_s(layer, outputs)
        return measured_costs.LayerCost(forward_s=forward, backward_s=2 * forward,
                                        input_grad_s=forward, output_bytes=0, working_bytes=0)


def _Patched(made_up):
    return mock.patch.object(measured_costs, '_Measure', made_up)


class CleanCacheTestCase(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        measured_costs._CACHE.clear()  # pylint: disable=protected-access
        self.addCleanup(measured_costs._CACHE.clear)  # pylint: disable=protected-access


@pytest.mark.unit
class PartitionOnTimeTest(CleanCacheTestCase):

    def testCellsAreTheOptimalPartitionOfTheTimes(self):
        # Equal FLOPs, but tanh made ten times as slow as relu: FLOPs split 3 | 3, time 1 | 5.
        activations = ['tanh', 'relu', 'relu', 'relu', 'relu', 'relu']
        made_up = _MadeUpCosts(lambda layer, _: 10.0 if layer.params.activation == 'tanh'
                               else 1.0)
        self.assertEqual(_Cells(_Params(activations, num_cells=2)), [3, 3])
        with _Patched(made_up):
            for recompute in ('always', 'never'):
                p = _Params(activations, num_cells=2, partition_method='time',
                            recompute=recompute)
                self.assertEqual(_Cells(p), [1, 5])
        # StepSeconds: forward, a re-materialized forward, backward.
        cost = made_up(mock.Mock(params=mock.Mock(activation='tanh')), None, None, 0, 0, None)
        self.assertEqual((cost.StepSeconds(True), cost.StepSeconds(False)), (40.0, 30.0))
        self.assertEqual(partition.OptimalBoundaries([40, 4, 4, 4, 4, 4], 2), [0, 1, 6])

    def testOneConfigurationIsMeasuredOnce(self):
        made_up = _MadeUpCosts(lambda layer, _: 1.0)
        with _Patched(made_up):
            _Cells(_Params(['tanh'] * 3 + ['relu'] * 3, num_cells=2, partition_method='time'))
        self.assertEqual(made_up.calls, 2)  # The layers differ only in their names.

    def testTheCostsFileSparesTheSecondRunAndSurvivesCorruption(self):
        costs_file = os.path.join(self.get_temp_dir(), 'costs', 'layer_costs.json')
        p = _Params(['tanh', 'relu', 'sigmoid', 'relu'], num_cells=2, partition_method='time',
                    costs_file=costs_file)
        made_up = _MadeUpCosts(lambda layer, _: {'tanh': 1.0, 'relu': 1.0, 'sigmoid': 5.0}[
            layer.params.activation])
        with _Patched(made_up):
            self.assertEqual(_Cells(p), [2, 2])  # 1 1 | 5 1 and 1 1 5 | 1 tie on max 6.
            self.assertEqual(made_up.calls, 3)
            with open(costs_file) as f:
                self.assertLen(json.load(f), 3)
            measured_costs._CACHE.clear()  # pylint: disable=protected-access  # A new process.
            self.assertEqual(_Cells(p), [2, 2])
            self.assertEqual(made_up.calls, 3)
            # Half a file, a list, text where numbers go, a negative or a NaN cost: each is
            # one warning, and the layers are measured again and the file written whole.
            with open(costs_file) as f:
                good = json.load(f)
            key = sorted(good)[0]
            broken = ['{"half a file', '[1, 2]',
                      json.dumps({**good, key: {**good[key], 'forward_s': 'fast'}}),
                      json.dumps({**good, key: {**good[key], 'forward_s': -1.0}}),
                      json.dumps({**good, key: {**good[key], 'backward_s': float('nan')}})]
            for n, text in enumerate(broken, 1):
                with open(costs_file, 'w') as f:
                    f.write(text)
                measured_costs._CACHE.clear()  # pylint: disable=protected-access
                with mock.patch.object(errors, 'Warn') as warn:
                    self.assertEqual(_Cells(p), [2, 2])
                warn.assert_called_once()
                self.assertRegex(warn.call_args[0][0],
                                 rf'^measuring the layers again: the costs file {costs_file} '
                                 r'does not read \(.+\)\.$')
                self.assertEqual(made_up.calls, 3 + 3 * n)
                with open(costs_file) as f:
                    self.assertEqual(json.load(f), good)  # Written whole again.
        self.assertEqual(os.listdir(os.path.dirname(costs_file)), ['layer_costs.json'])

    def testAPipelineOnTimeComputesWhatTheLayersDo(self):
        made_up = _MadeUpCosts(lambda layer, _: 10.0 if layer.params.activation == 'tanh'
                               else 1.0)
        activations = ['tanh', 'relu', 'relu', 'relu']
        on_time = _Params(activations, num_cells=2, partition_method='time')
        with self.assertRaisesRegex(errors.ConfigError, 'TimedBoundaries'):
            on_time.Instantiate()  # A layer measures nothing itself.
        with _Patched(made_up):
            bounds = measured_costs.TimedBoundaries(on_time)
        self.assertEqual(bounds, [0, 1, 4])
        timed = on_time.Copy().Set(partition_method=bounds).Instantiate()
        uniform = _Params(activations, num_cells=2, partition_method='uniform').Instantiate()
        self.assertEqual([len(c.sequence) for c in timed.cells], [1, 3])
        x = tf.random.stateless_normal([BATCH, DIM], [1, 2])
        for a, b in zip(timed.trainable_variables, uniform.trainable_variables):
            b.assign(a)
        self.assertAllClose(timed.FProp(timed.theta, x), uniform.FProp(uniform.theta, x),
                            atol=1e-6)


@pytest.mark.unit
class MeasureLayersTest(CleanCacheTestCase):
    """The clock itself: what holds on any machine."""

    def testTimesArePositiveAndTheOutputBytesAreTheMicroBatchs(self):
        layers = [basic.DenseLayer.Params().Set(name=f'd{i}', input_dim=DIM, output_dim=width,
                                                activation='tanh')
                  for i, width in enumerate([8])] + [
                      basic.DenseLayer.Params().Set(name='d1', input_dim=8, output_dim=DIM)]
        x = tf.random.stateless_uniform([BATCH // M, DIM], [0, 0])
        costs = measured_costs.MeasureLayers(layers, (x,), DEVICES[0], repeats=3)
        self.assertLen(costs, 2)
        for cost, width in zip(costs, [8, DIM]):
            self.assertGreater(cost.forward_s, 0)
            self.assertGreaterEqual(cost.backward_s, 0)
            self.assertGreaterEqual(cost.weight_grad_s, 0)
            self.assertEqual(cost.output_bytes, BATCH // M * width * 4)
        spy = _MadeUpCosts(lambda *_: 1.0)
        with _Patched(spy):  # The process cache answers.
            self.assertEqual(measured_costs.MeasureLayers(layers, (x,), DEVICES[0]), costs)
            self.assertEqual(spy.calls, 0)
            # Another micro-batch size is another measurement.
            measured_costs.MeasureLayers(layers, (tf.zeros([2, DIM]),), DEVICES[0])
            self.assertEqual(spy.calls, 2)

    def testSynthesizedInputsHaveTheShapesAndDtypes(self):
        inputs = measured_costs.SynthesizedInputs(
            {'ids': tf.TensorShape([2, 5]), 'paddings': tf.TensorShape([2, 5])},
            {'ids': 'int32'})
        self.assertEqual(inputs['ids'].dtype, tf.int32)
        self.assertAllEqual(inputs['ids'], np.zeros([2, 5]))  # Valid ids and labels.
        self.assertEqual(inputs['paddings'].dtype, tf.float32)
        self.assertAllInRange(inputs['paddings'], 0.0, 1.0)
        listed = measured_costs.SynthesizedInputs([[3, 4], [3]], ['bfloat16', 'int64'])
        self.assertEqual([x.dtype for x in listed], [tf.bfloat16, tf.int64])
        self.assertEqual([x.shape.as_list() for x in listed], [[3, 4], [3]])


class KerasOnTimeTest(CleanCacheTestCase):

    def testFromKerasPartitionsOnTimesOfCopiesAndTrains(self):
        # Parameters: 28, 20, 20, 320 -> [0, 3, 4]; made-up times 6, 4, 4, 4 -> [0, 2, 4].
        keras.utils.set_random_seed(0)
        layers = [keras.layers.Dense(4), keras.layers.Dense(4), keras.layers.Dense(4),
                  keras.layers.Dense(64)]
        widths = iter([6, 4, 4])  # Measured in order; the second Dense(4) on 4 is the first's.
        made_up = _MadeUpCosts(lambda layer, outputs: float(next(widths)))
        with _Patched(made_up):
            pipe = Pipeline.FromKeras(layers, num_cells=2, num_micro_batches=2, input_shape=(6,),
                                      devices=DEVICES[:2], partition_method='time')
        self.assertEqual(made_up.calls, 3)
        self.assertEqual([len(cell.sequence) for cell in pipe.pipeline.cells], [2, 2])
        self.assertEqual(pipe.keras_layers, layers)
        by_params = Pipeline.FromKeras(
            [type(layer).from_config(layer.get_config()) for layer in layers], num_cells=2,
            num_micro_batches=2, input_shape=(6,), devices=DEVICES[:2])
        self.assertEqual([len(cell.sequence) for cell in by_params.pipeline.cells], [3, 1])
        model = keras.Sequential([keras.Input((6,)), pipe])
        model.compile(keras.optimizers.SGD(0.1), 'mse')
        x = np.random.RandomState(0).randn(8, 6).astype(np.float32)
        expected = x
        for layer in layers:
            expected = layer(expected)
        self.assertAllClose(model.predict(x, verbose=0), expected, atol=1e-5)
        before = [w.copy() for w in layers[0].get_weights()]
        model.fit(x, np.zeros([8, 64], np.float32), batch_size=8, verbose=0)
        self.assertNotAllClose(before[0], layers[0].get_weights()[0])

    def testTheRealClockLeavesTheLayersUnbuilt(self):
        layers = [keras.layers.Dense(4, activation='tanh'), keras.layers.Dense(3)]
        costs_file = os.path.join(self.get_temp_dir(), 'keras_costs.json')
        Pipeline.FromKeras(layers, num_cells=2, num_micro_batches=2, input_shape=(6,),
                           devices=DEVICES[:2], partition_method='time', costs_file=costs_file)
        with open(costs_file) as f:
            entries = json.load(f)
        self.assertLen(entries, 2)
        for entry in entries.values():
            self.assertGreater(entry['forward_s'], 0)
        for k, layer in enumerate(layers):  # Built by the pipeline, on its cell's device.
            self.assertLen(layer.weights, 2)
            for variable in layer.weights:
                self.assertEqual(tf.DeviceSpec.from_string(variable.value.device).device_index,
                                 tf.DeviceSpec.from_string(DEVICES[k]).device_index)


class TrainerTest(CleanCacheTestCase):

    def testTheTrainerRecordsTheBoundariesAndReusesTheCosts(self):
        # PipelinedMLP: 16 -> 64 -> 64 -> 64 -> 10 on K=2: FLOPs 1024, 4096, 4096, 640 split
        # [0, 2, 4]; made-up times 1/width split [0, 3, 4].
        made_up = _MadeUpCosts(lambda layer, _: 1.0 / layer.params.output_dim)
        logdir = os.path.join(tempfile.mkdtemp(dir=self.get_temp_dir()), 'run')
        flags = ['--model=examples.PipelinedMLP', f'--logdir={logdir}',
                 "--model_params_override=model.partition_method : 'time'; "
                 'model.num_cells : 2']
        with _Patched(made_up):
            result = test_utils.TrainerInProcess(*flags, '--max_steps=1')
            self.assertIn('partition on measured time: boundaries [0, 3, 4]', result.stdout)
            self.assertEqual(made_up.calls, 3)  # The last two 64-wide layers' inputs are alike.
            self.assertTrue(os.path.exists(os.path.join(logdir, 'layer_costs.json')))
            with open(os.path.join(logdir, 'params.txt')) as f:
                self.assertRegex(f.read(), r'model\.partition_method\s*:\s*\[0, 3, 4\]')
            measured_costs._CACHE.clear()  # pylint: disable=protected-access
            result = test_utils.TrainerInProcess(*flags, '--max_steps=2')
            self.assertIn('boundaries [0, 3, 4]', result.stdout)
            self.assertEqual(made_up.calls, 3)


@pytest.mark.unit
class CountsPeakBytesTest(tf.test.TestCase):

    def testOnlyTheBfcAllocatorCountsACpusPeak(self):
        # Environments as arguments: changing the process's while TensorFlow's threads read it
        # (setenv against getenv) crashed a test worker.
        bfc, default = {'TF_CPU_ALLOCATOR_USE_BFC': 'true'}, {'TF_CPU_ALLOCATOR_USE_BFC': 'false'}
        self.assertTrue(measured_costs.CountsPeakBytes('/device:CPU:1', bfc))
        self.assertFalse(measured_costs.CountsPeakBytes(
            '/job:localhost/replica:0/task:0/device:CPU:0', default))
        self.assertFalse(measured_costs.CountsPeakBytes(None, default))  # The default: CPU:0.
        self.assertTrue(measured_costs.CountsPeakBytes('/device:GPU:0', default))
        self.assertFalse(measured_costs.CountsPeakBytes('CPU:0', {}))

    def testPeakBytesOfIsWhatTheRunAllocatedAboveItsStartOrNoneWhereNotCounted(self):
        # A stand-in for the allocator's statistics: TensorFlow's default CPU allocator counts
        # only part of its peak (in a test worker that had run others, a 64 MiB run read 96).
        stats = {'current': 1000, 'peak': 5000}

        def Reset(device):
            self.assertEqual(device, 'GPU:0')
            stats['peak'] = stats['current']

        def Run():  # Allocates 300 bytes, frees 200, then 50 more at its peak.
            stats['current'] += 300
            stats['current'] -= 200
            stats['current'] += 50
            stats['peak'] = max(stats['peak'], stats['current'], 1300)

        with mock.patch.object(tf.config.experimental, 'reset_memory_stats', Reset), \
                mock.patch.object(tf.config.experimental, 'get_memory_info',
                                  lambda device: dict(stats)):
            self.assertEqual(measured_costs.PeakBytesOf('GPU:0', Run), 300)
            with mock.patch.object(measured_costs, 'CountsPeakBytes', return_value=False):
                ran = []
                self.assertIsNone(measured_costs.PeakBytesOf('CPU:0', lambda: ran.append(1)))
                self.assertEqual(ran, [1])  # Run all the same.
