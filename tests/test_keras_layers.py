"""gpipe_tf.keras.Pipeline.FromKeras's contract: Keras's own layers (keras.layers, keras_hub's
Transformer blocks) pipelined give the outputs and gradients of the same layer objects called
one after another on each micro-batch, with their weights built on their cells' devices."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf

from gpipe_tf import errors
from gpipe_tf import test_utils
from gpipe_tf.keras import Pipeline
from gpipe_tf.keras import Sequential
from gpipe_tf.layers import basic
from gpipe_tf.layers import normalization

DEVICES = test_utils.ConfigureVirtualCpus()
TOLERANCE = 1e-5
M = 2


def DenseStack(width=8):
    """Dense/BatchNorm/Dense/Dense: 4 layers, of unequal parameter counts."""
    return [keras.layers.Dense(width, activation='tanh'), keras.layers.BatchNormalization(),
            keras.layers.Dense(width, activation='tanh'), keras.layers.Dense(3)]


def ConvNet():
    return [keras.layers.Conv2D(4, 3, padding='same', activation='relu'),
            keras.layers.BatchNormalization(), keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(6, 3, activation='relu'), keras.layers.Flatten(),
            keras.layers.Dense(5)]


def TransformerBlocks(num_blocks=3, dropout=0.0):
    import keras_hub  # pylint: disable=import-outside-toplevel
    return [keras_hub.layers.TransformerEncoder(intermediate_dim=16, num_heads=2,
                                                dropout=dropout) for _ in range(num_blocks)]


@keras.saving.register_keras_serializable(package='test_keras_layers')
class Fork(keras.layers.Layer):
    """Two Dense heads on one input: a layer of two outputs, a tuple."""

    def __init__(self, units=(4, 4), **kwargs):
        super().__init__(**kwargs)
        self.units = tuple(units)
        self.heads = [keras.layers.Dense(n) for n in self.units]

    def build(self, input_shape):
        for head in self.heads:
            head.build(input_shape)

    def call(self, x):
        return tuple(head(x) for head in self.heads)

    def compute_output_shape(self, input_shape):
        return tuple(tuple(input_shape[:-1]) + (n,) for n in self.units)

    def get_config(self):
        return {**super().get_config(), 'units': self.units}


@keras.saving.register_keras_serializable(package='test_keras_layers')
class Gate(keras.layers.Layer):
    """h gated by aux: a call of two required positional arguments."""

    def call(self, h, aux):
        return h * keras.ops.tanh(aux)

    def compute_output_shape(self, h_shape, aux_shape):
        return h_shape


class Named(keras.layers.Layer):
    """A layer whose output is a dict."""

    def call(self, x):
        return {'h': x}

    def compute_output_shape(self, input_shape):
        return {'h': input_shape}


def Sequentially(layers, x, num_micro_batches=M, training=True):
    """The oracle: the layer objects called in order on each micro-batch (Keras's own calls,
    no pipeline code), the micro-batches' outputs concatenated. Training calls assign the
    layers' state (batch norm's moving statistics): callers snapshot it."""
    outputs = []
    for part in tf.split(x, num_micro_batches):
        for layer in layers:
            part = layer(part, training=training)
        outputs.append(part)
    return tf.concat(outputs, 0)


def Snapshot(layers):
    return [[np.array(v.numpy()) for v in layer.weights] for layer in layers]


def Restore(layers, values):
    for layer, layer_values in zip(layers, values):
        for variable, value in zip(layer.weights, layer_values):
            variable.assign(value)


def Loss(outputs):
    """A sum weighted per element, so that every output element has its own gradient."""
    weights = tf.cos(tf.range(tf.size(outputs), dtype=tf.float32))
    return tf.reduce_sum(outputs * tf.reshape(weights, tf.shape(outputs)))


def PipelineAndOracle(layers, x, **params):
    """(pipeline outputs, gradients; oracle outputs, gradients) for one training call, the
    oracle run from the same state."""
    pipe = Pipeline.FromKeras(layers, num_cells=2, num_micro_batches=M,
                              input_shape=x.shape[1:], devices=DEVICES[:2], **params)
    weights = pipe.trainable_weights
    state = Snapshot(layers)

    @tf.function
    def Step(x):
        with tf.GradientTape() as tape:
            outputs = pipe(x, training=True)
            loss = Loss(outputs)
        return outputs, tape.gradient(loss, weights)

    outputs, grads = Step(x)
    Restore(layers, state)
    with tf.GradientTape() as tape:
        expected = Sequentially(layers, x)
        loss = Loss(expected)
    expected_grads = tape.gradient(loss, weights)
    Restore(layers, state)
    return pipe, (outputs, grads), (expected, expected_grads)


class ContractTest(tf.test.TestCase):
    """Outputs and every gradient equal the layers called in sequence per micro-batch."""

    def assertMatches(self, layers, x, **params):
        _, (outputs, grads), (expected, expected_grads) = PipelineAndOracle(layers, x,
                                                                             **params)
        self.assertAllClose(expected, outputs, atol=TOLERANCE, rtol=TOLERANCE)
        self.assertLen(grads, len(expected_grads))
        for grad, expected_grad in zip(grads, expected_grads):
            self.assertIsNotNone(grad)
            self.assertAllClose(expected_grad, grad, atol=TOLERANCE, rtol=TOLERANCE)

    def testDenseBatchNormStackEveryRecomputeMode(self):
        x = tf.random.stateless_normal((8, 6), [1, 2])
        for recompute in ('always', 'never', 'except_last'):
            with self.subTest(recompute=recompute):
                keras.utils.set_random_seed(0)
                self.assertMatches(DenseStack(), x, recompute=recompute)

    def testLooped(self):
        keras.utils.set_random_seed(0)
        self.assertMatches(DenseStack(), tf.random.stateless_normal((8, 6), [3, 4]),
                           unroll=False)

    def testConvNet(self):
        keras.utils.set_random_seed(0)
        self.assertMatches(ConvNet(), tf.random.stateless_normal((4, 8, 8, 3), [5, 6]))

    def testKerasHubTransformerEncoders(self):
        keras.utils.set_random_seed(0)
        self.assertMatches(TransformerBlocks(), tf.random.stateless_normal((4, 5, 8), [7, 8]))


@pytest.mark.unit
class LayersTest(tf.test.TestCase):
    """The given layer objects are the ones used, built on their cells' devices."""

    def testWeightsAreTheLayersOwnOnTheirCellsDevices(self):
        keras.utils.set_random_seed(0)
        layers = DenseStack()
        pipe = Pipeline.FromKeras(layers, num_cells=2, num_micro_batches=M, input_shape=(6,),
                                  devices=DEVICES[:2], balance=[2, 2])
        self.assertEqual(pipe.keras_layers, layers)
        own = {id(v) for layer in layers for v in layer.weights}
        self.assertEqual(own, {id(v) for v in pipe.weights if v is not pipe.step})
        for k, cell in enumerate(pipe.pipeline.cells):
            for layer in cell.sequence:
                for variable in layer.keras_layer.weights:
                    self.assertEqual(tf.DeviceSpec.from_string(variable.value.device).device_index,
                                     tf.DeviceSpec.from_string(DEVICES[k]).device_index)

    def testAKerasSequentialsLayers(self):
        keras.utils.set_random_seed(0)
        x = tf.random.stateless_normal((4, 6), [4, 4])
        # Without keras.Input its layers are unbuilt: each is built on its cell's device.
        model = keras.Sequential(DenseStack())
        pipe = Pipeline.FromKeras(model, num_cells=2, num_micro_batches=M, input_shape=(6,),
                                  devices=DEVICES[:2])
        self.assertEqual(pipe.keras_layers, model.layers)
        self.assertEqual(tf.DeviceSpec.from_string(
            model.layers[-1].kernel.value.device).device_index, 1)
        self.assertAllClose(Sequentially(model.layers, x, 1, training=False), pipe(x),
                            atol=TOLERANCE)
        # With keras.Input it is built (on the default device) and gives the input shape.
        model = keras.Sequential([keras.Input((6,))] + DenseStack())
        pipe = Pipeline.FromKeras(model, num_cells=2, num_micro_batches=M,
                                  devices=[DEVICES[0]] * 2)
        self.assertAllClose(model(x), pipe(x), atol=TOLERANCE)

    def testBalanceByParameters(self):
        # 6*8+8, 4*8, 8*8+8, 8*3+3: the optimal split of (56, 32, 72, 27) is [0, 2, 4].
        pipe = Pipeline.FromKeras(DenseStack(), num_cells=2, num_micro_batches=M,
                                  input_shape=(6,), devices=DEVICES[:2])
        self.assertEqual([len(cell.sequence) for cell in pipe.pipeline.cells], [2, 2])
        pipe = Pipeline.FromKeras(DenseStack(), num_cells=2, num_micro_batches=M,
                                  input_shape=(6,), devices=DEVICES[:2], balance=[1, 3])
        self.assertEqual([len(cell.sequence) for cell in pipe.pipeline.cells], [1, 3])

    def testFitChangesTheLayersWeights(self):
        keras.utils.set_random_seed(0)
        layers = DenseStack()
        model = keras.Sequential([
            keras.Input((6,)),
            Pipeline.FromKeras(layers, num_cells=2, num_micro_batches=M, input_shape=(6,),
                               devices=DEVICES[:2])])
        model.compile(keras.optimizers.SGD(0.1), 'mse')
        before = Snapshot(layers)
        x, y = np.random.RandomState(0).randn(2, 8, 6).astype(np.float32)
        model.fit(x, y[:, :3], batch_size=8, verbose=0)
        for old, layer in zip(before, layers):
            for value, now in zip(old, layer.get_weights()):
                self.assertNotAllClose(value, now)

    def testOneSgdStepEqualsKerasSequential(self):
        keras.utils.set_random_seed(0)
        layers = [keras.layers.Dense(8, activation='tanh'), keras.layers.Dense(8),
                  keras.layers.Dense(2)]
        reference = keras.Sequential([keras.Input((6,))] + [
            type(layer).from_config(layer.get_config()) for layer in layers])
        model = keras.Sequential([keras.Input((6,)), Pipeline.FromKeras(
            layers, num_cells=2, num_micro_batches=4, input_shape=(6,), devices=DEVICES[:2])])
        for layer, copy in zip(layers, reference.layers):
            copy.set_weights(layer.get_weights())
        rng = np.random.RandomState(1)
        x, y = rng.randn(8, 6).astype(np.float32), rng.randn(8, 2).astype(np.float32)
        for m in (model, reference):
            m.compile(keras.optimizers.SGD(0.5), 'mse')
            m.fit(x, y, batch_size=8, verbose=0, shuffle=False)
        for layer, copy in zip(layers, reference.layers):
            for a, b in zip(layer.get_weights(), copy.get_weights()):
                self.assertAllClose(b, a, atol=TOLERANCE, rtol=TOLERANCE)


@pytest.mark.unit
class StateTest(tf.test.TestCase):
    """Batch norm's moving statistics and dropout's seeds across micro-batches."""

    def testBatchNormMovesOncePerStepTowardsTheMicroBatchesStatistics(self):
        keras.utils.set_random_seed(0)
        layers = [keras.layers.Dense(4), keras.layers.BatchNormalization(momentum=0.9)]
        pipe = Pipeline.FromKeras(layers, num_cells=2, num_micro_batches=M, input_shape=(6,),
                                  devices=DEVICES[:2])
        x = tf.random.stateless_normal((8, 6), [9, 9]) * 3.0 + 1.0
        h = np.split(layers[0](x).numpy(), M)
        pipe(x, training=True)
        means = [part.mean(0) for part in h]
        variances = [part.var(0) for part in h]
        bn = layers[1]
        self.assertAllClose(0.1 * np.mean(means, 0), bn.moving_mean.numpy(), atol=1e-6)
        self.assertAllClose(0.9 + 0.1 * np.mean(variances, 0), bn.moving_variance.numpy(),
                            atol=1e-5)

    def testInferenceUsesTheMovingStatisticsAndChangesNothing(self):
        keras.utils.set_random_seed(0)
        layers = DenseStack()
        pipe = Pipeline.FromKeras(layers, num_cells=2, num_micro_batches=M, input_shape=(6,),
                                  devices=DEVICES[:2])
        x = tf.random.stateless_normal((8, 6), [1, 1])
        pipe(x, training=True)
        state = Snapshot(layers)
        outputs = pipe(x, training=False)
        self.assertAllClose(Sequentially(layers, x, 1, training=False), outputs,
                            atol=TOLERANCE)
        for old, now in zip(state, Snapshot(layers)):
            for a, b in zip(old, now):
                self.assertAllEqual(a, b)

    def DropoutRun(self, recompute, x, step=0, balance=(2, 1)):
        keras.utils.set_random_seed(0)
        layers = [keras.layers.Dense(16, kernel_initializer='ones'),
                  keras.layers.Dropout(0.5), keras.layers.Dense(16, kernel_initializer='ones')]
        pipe = Pipeline.FromKeras(layers, num_cells=2, num_micro_batches=M, input_shape=(4,),
                                  devices=DEVICES[:2], recompute=recompute,
                                  balance=list(balance))
        pipe.step.assign(step)
        with tf.GradientTape() as tape:
            outputs = pipe(x, training=True)
            loss = Loss(outputs)
        return outputs, tape.gradient(loss, pipe.trainable_weights), layers

    def testReMaterializedForwardReplaysTheDropoutMask(self):
        x = tf.ones((8, 4))
        kept, kept_grads, _ = self.DropoutRun('never', x)
        replayed, replayed_grads, _ = self.DropoutRun('always', x)
        self.assertAllClose(kept, replayed)
        for a, b in zip(kept_grads, replayed_grads):
            self.assertAllClose(a, b)

    def testADropoutLayerInALaterCellReplaysItsMask(self):
        # Keras's Dropout makes its seed state when it is made, before the pipeline places it
        # on cell 1: the state stays where it is; it is only read.
        x = tf.ones((8, 4))
        kept, kept_grads, _ = self.DropoutRun('never', x, balance=(1, 2))
        replayed, replayed_grads, layers = self.DropoutRun('always', x, balance=(1, 2))
        self.assertAllClose(kept, replayed)
        for a, b in zip(kept_grads, replayed_grads):
            self.assertAllClose(a, b)
        self.assertEqual(tf.DeviceSpec.from_string(layers[2].kernel.value.device).device_index,
                         tf.DeviceSpec.from_string(DEVICES[1]).device_index)

    def testMasksDifferBetweenMicroBatchesAndSteps(self):
        x = tf.ones((8, 4))
        first, _, layers = self.DropoutRun('always', x)
        dropped = (first.numpy() == layers[2].bias.numpy()).all(-1)  # Everything dropped?
        self.assertFalse(dropped.any())
        # Equal inputs, so equal rows mean equal masks.
        self.assertNotAllClose(first[:4], first[4:])
        second, _, _ = self.DropoutRun('always', x, step=1)
        self.assertNotAllClose(first, second)
        again, _, _ = self.DropoutRun('always', x)
        self.assertAllClose(first, again)


SCHEDULES = [('gpipe', {}), ('1f1b', {}), ('interleaved_1f1b', {'virtual_stages': 2}),
             ('zero_bubble', {'recompute': 'never'}), ('zero_bubble', {}),
             ('zero_bubble_v', {'virtual_stages': 2, 'recompute': 'never'})]


def DenseLayers():
    return [keras.layers.Dense(8, activation='tanh') for _ in range(4)] + [keras.layers.Dense(2)]


def SequentialAndReference(schedule='gpipe', loss='mse', metrics=('mae',), **params):
    """(a gpipe_tf.keras.Sequential over DenseLayers(), a keras.Sequential of copies with the
    same initial weights), both compiled alike."""
    keras.utils.set_random_seed(0)
    layers = DenseLayers()
    reference = keras.Sequential([keras.Input((6,))] + [
        type(layer).from_config(layer.get_config()) for layer in layers])
    model = Sequential(layers, num_cells=2, num_micro_batches=4, input_shape=(6,),
                       devices=DEVICES[:2], schedule=schedule, **params)
    model.build((None, 6))
    for layer, copy in zip(layers, reference.layers):
        copy.set_weights(layer.get_weights())
    for m in (model, reference):
        m.compile(keras.optimizers.SGD(0.5), loss, metrics=list(metrics))
    return model, reference


def Data(num_examples=16, seed=1):
    rng = np.random.RandomState(seed)
    return (rng.randn(num_examples, 6).astype(np.float32),
            rng.randn(num_examples, 2).astype(np.float32),
            rng.rand(num_examples).astype(np.float32))


def AssertFitsAsKerasSequential(test, x, y, batch_size, schedule, **params):
    """`fit` of the pipelined model gives keras.Sequential's losses and weights."""
    model, reference = SequentialAndReference(schedule, **params)
    histories = [m.fit(x, y, batch_size=batch_size, verbose=0, shuffle=False).history
                 for m in (model, reference)]
    test.assertAllClose(histories[1]['loss'], histories[0]['loss'], atol=TOLERANCE)
    AssertSameWeights(test, model.pipeline.keras_layers, reference.layers)


class SequentialTest(tf.test.TestCase):
    """gpipe_tf.keras.Sequential trains with every schedule as keras.Sequential does."""

    def testZeroBubbleOnAStaticBatchMDoesNotDivide(self):
        x, y, _ = Data(6)  # One batch of 6: micro-batches of 2, 2, 1 and 1.
        AssertFitsAsKerasSequential(self, x, y, 6, 'zero_bubble')

    def testLoopedOnAPartialLastBatch(self):
        # Batches of 8 and 3; Keras traces the second with batch None, and the loop splits it
        # when the step runs into micro-batches of 1, 1, 1 and 0.
        x, y, _ = Data(11)
        AssertFitsAsKerasSequential(self, x, y, 8, '1f1b', unroll=False)

    def testEveryScheduleFitsAsKerasSequential(self):
        x, y, sample_weight = Data()
        for schedule, params in SCHEDULES:
            with self.subTest(schedule=schedule, **params):
                model, reference = SequentialAndReference(schedule, **params)
                histories = [m.fit(x, y, sample_weight=sample_weight, batch_size=8, epochs=1,
                                   verbose=0, shuffle=False).history
                             for m in (model, reference)]
                for key in ('loss', 'mae'):
                    self.assertAllClose(histories[1][key], histories[0][key], atol=TOLERANCE)
                for layer, copy in zip(model.pipeline.keras_layers, reference.layers):
                    for a, b in zip(layer.get_weights(), copy.get_weights()):
                        self.assertAllClose(b, a, atol=TOLERANCE, rtol=TOLERANCE)

    def testClassWeightAsKerasSequential(self):
        x, _, _ = Data()
        labels = (x[:, 0] > 0).astype(np.int32)
        model, reference = SequentialAndReference(
            '1f1b', keras.losses.SparseCategoricalCrossentropy(from_logits=True), ())
        histories = [m.fit(x, labels, class_weight={0: 0.25, 1: 2.0}, batch_size=8,
                           verbose=0, shuffle=False).history for m in (model, reference)]
        self.assertAllClose(histories[1]['loss'], histories[0]['loss'], atol=TOLERANCE)
        for layer, copy in zip(model.pipeline.keras_layers, reference.layers):
            for a, b in zip(layer.get_weights(), copy.get_weights()):
                self.assertAllClose(b, a, atol=TOLERANCE, rtol=TOLERANCE)

    def testEvaluateAndPredictAsKerasSequential(self):
        x, y, _ = Data()
        model, reference = SequentialAndReference('1f1b')
        self.assertAllClose(reference.predict(x, batch_size=8, verbose=0),
                            model.predict(x, batch_size=8, verbose=0), atol=TOLERANCE)
        self.assertAllClose(reference.evaluate(x, y, batch_size=8, verbose=0),
                            model.evaluate(x, y, batch_size=8, verbose=0), atol=TOLERANCE)

    def testAnyBatchSizeFitsAndPredictsAsKerasSequential(self):
        # 11 examples in batches of 6: the last batch of 5 splits into M=4 micro-batches of
        # [2, 1, 1, 1]; batches of 3 leave one of the four empty. Keras weighs every example
        # alike, the pipeline must too.
        x, y, sample_weight = Data(11)
        for schedule, params in (('gpipe', {}), ('1f1b', {}), ('zero_bubble', {})):
            for batch_size in (6, 3):
                with self.subTest(schedule=schedule, batch_size=batch_size):
                    model, reference = SequentialAndReference(schedule, **params)
                    histories = [m.fit(x, y, sample_weight=sample_weight,
                                       batch_size=batch_size, epochs=1, verbose=0,
                                       shuffle=False).history for m in (model, reference)]
                    for key in ('loss', 'mae'):
                        self.assertAllClose(histories[1][key], histories[0][key],
                                            atol=TOLERANCE)
                    for layer, copy in zip(model.pipeline.keras_layers, reference.layers):
                        for a, b in zip(layer.get_weights(), copy.get_weights()):
                            self.assertAllClose(b, a, atol=TOLERANCE, rtol=TOLERANCE)
                    for n in (1, 3):
                        self.assertAllClose(reference.predict(x[:n], verbose=0),
                                            model.predict(x[:n], verbose=0), atol=TOLERANCE)

    def testWeightRegularizersFitAsKerasSequential(self):
        # 11 examples in batches of 8: the regularizers' penalty counts once per step, also
        # on the partial batch.
        x, y, _ = Data(11)
        keras.utils.set_random_seed(0)
        layers = [keras.layers.Dense(8, activation='tanh',
                                     kernel_regularizer=keras.regularizers.L2(0.1)),
                  keras.layers.Dense(8, activation='tanh'),
                  keras.layers.Dense(2, bias_regularizer=keras.regularizers.L1(0.05))]
        reference = keras.Sequential([keras.Input((6,))] + Copies(layers))
        model = Sequential(layers, num_cells=2, num_micro_batches=4, input_shape=(6,),
                           devices=DEVICES[:2], schedule='1f1b')
        model.build((None, 6))
        CopyWeights(layers, reference.layers)
        histories = []
        for m in (model, reference):
            m.compile(keras.optimizers.SGD(0.5), 'mse')
            histories.append(m.fit(x, y, batch_size=8, epochs=2, verbose=0,
                                   shuffle=False).history['loss'])
        self.assertAllClose(histories[1], histories[0], atol=TOLERANCE)
        AssertSameWeights(self, layers, reference.layers)

    def testALossAddedInACallIsAConfigErrorInTraining(self):
        x, y, _ = Data()
        layers = [keras.layers.Dense(8, activity_regularizer=keras.regularizers.L2(0.1)),
                  keras.layers.Dense(2)]
        model = Sequential(layers, num_cells=2, num_micro_batches=4, input_shape=(6,),
                           devices=DEVICES[:2], schedule='1f1b')
        model.compile(keras.optimizers.SGD(0.5), 'mse')
        with self.assertRaisesRegex(errors.ConfigError,
                                    r'adds a loss in its call \(add_loss, activity_regularizer'):
            model.fit(x, y, batch_size=8, verbose=0)
        # Inference has no loss to miss it in.
        self.assertAllClose(Sequentially(layers, x, 1, training=False),
                            model.predict(x, verbose=0), atol=TOLERANCE)

    def testATrainingCallOutsideTheTrainStepNamesTheGpipeSchedule(self):
        x, _, _ = Data()
        model, _ = SequentialAndReference('1f1b')
        with self.assertRaisesRegex(
                errors.ConfigError,
                r"schedule '1f1b' trains only through the model's train step .*custom "
                r'training loop.* schedule="gpipe"'):
            model(x, training=True)

    def testRecompiledAsKerasSequential(self):
        # Keras keeps the compiled metrics when a recompile names none, and replaces them when
        # it names others.
        x, y, _ = Data()
        model, reference = SequentialAndReference('1f1b')
        for compile_kwargs in ({}, {'loss': 'huber'}, {'loss': 'mae', 'metrics': ['mse']}):
            with self.subTest(**compile_kwargs):
                results = []
                for m in (model, reference):
                    if compile_kwargs:
                        m.compile(keras.optimizers.SGD(0.5), **compile_kwargs)
                    history = m.fit(x, y, batch_size=8, verbose=0, shuffle=False).history
                    results.append((history, m.evaluate(x, y, verbose=0, return_dict=True)))
                for got, want in zip(results[0], results[1]):
                    self.assertEqual(sorted(want), sorted(got))
                    for key in want:
                        self.assertAllClose(want[key], got[key], atol=TOLERANCE, msg=key)

    def testPipelineInAModelRefusesAScheduleThatNeedsTheLossInside(self):
        with self.assertRaisesRegex(errors.ConfigError, 'gpipe_tf.keras.Sequential'):
            Pipeline.FromKeras(DenseLayers(), num_cells=2, num_micro_batches=4,
                               input_shape=(6,), devices=DEVICES[:2], schedule='1f1b')


def PaddingMask(lengths, length):
    return tf.cast(tf.range(length)[None] < tf.constant(lengths, tf.int32)[:, None], tf.int32)


class KeywordInputsTest(tf.test.TestCase):
    """A dict last in the input holds keyword inputs (masks): every Keras layer whose call
    takes one gets it, as when the layers are called in sequence with it."""

    def testEveryEncoderGetsThePaddingMaskUnrolledAndLooped(self):
        x = tf.random.stateless_normal((4, 5, 8), [7, 8])
        mask = PaddingMask([3, 5, 1, 4], 5)
        for unroll in (True, False):
            with self.subTest(unroll=unroll):
                keras.utils.set_random_seed(0)
                layers = TransformerBlocks()
                pipe = Pipeline.FromKeras(layers, num_cells=2, num_micro_batches=M,
                                          input_shape=(5, 8), devices=DEVICES[:2],
                                          unroll=unroll)
                state = Snapshot(layers)

                @tf.function
                def Step(x, mask):
                    with tf.GradientTape() as tape:
                        outputs = pipe((x, {'padding_mask': mask}), training=True)
                        loss = Loss(outputs)
                    return outputs, tape.gradient(loss, pipe.trainable_weights)

                outputs, grads = Step(x, mask)
                Restore(layers, state)
                with tf.GradientTape() as tape:
                    parts = []
                    for part, part_mask in zip(tf.split(x, M), tf.split(mask, M)):
                        for layer in layers:
                            part = layer(part, padding_mask=part_mask, training=True)
                        parts.append(part)
                    expected = tf.concat(parts, 0)
                    loss = Loss(expected)
                expected_grads = tape.gradient(loss, pipe.trainable_weights)
                self.assertAllClose(expected, outputs, atol=TOLERANCE, rtol=TOLERANCE)
                for grad, expected_grad in zip(grads, expected_grads):
                    self.assertAllClose(expected_grad, grad, atol=TOLERANCE, rtol=TOLERANCE)
                Restore(layers, state)
                # The mask is used: without it the outputs differ.
                self.assertNotAllClose(pipe(x), pipe((x, {'padding_mask': mask})))

    def testSequentialFitsAsAFunctionalModelThatPassesTheMask(self):
        import keras_hub  # pylint: disable=import-outside-toplevel
        rng = np.random.RandomState(0)
        x = rng.randn(11, 5, 8).astype(np.float32)
        y = rng.randn(11, 5, 2).astype(np.float32)
        mask = PaddingMask(rng.randint(1, 6, size=11), 5).numpy()
        # zero_bubble's weight gradient of a run-time batch reads one output of an op
        # whose other output the input gradient reads (BroadcastGradientArgs).
        for schedule in ('1f1b', 'zero_bubble'):
            with self.subTest(schedule=schedule):
                keras.utils.set_random_seed(0)
                layers = [keras_hub.layers.TransformerEncoder(intermediate_dim=16, num_heads=2)
                          for _ in range(3)] + [keras.layers.Dense(2)]
                model = Sequential(layers, num_cells=2, num_micro_batches=4,
                                   input_shape=(5, 8), devices=DEVICES[:2], schedule=schedule)
                model((x[:2], {'padding_mask': mask[:2]}))
                # The oracle: Keras's functional model that hands each encoder the mask.
                copies = [type(layer).from_config(layer.get_config()) for layer in layers]
                inputs = keras.Input((5, 8))
                mask_input = keras.Input((5,), dtype='int32')
                hidden = inputs
                for copy in copies[:-1]:
                    hidden = copy(hidden, padding_mask=mask_input)
                reference = keras.Model((inputs, {'padding_mask': mask_input}),
                                        copies[-1](hidden))
                for layer, copy in zip(layers, copies):
                    copy.set_weights(layer.get_weights())
                data = (x, {'padding_mask': mask})
                histories = []
                for m in (model, reference):
                    m.compile(keras.optimizers.SGD(0.1), 'mse')
                    # Batches of 8 and 3: the last splits into micro-batches of [1, 1, 1, 0].
                    histories.append(m.fit(data, y, batch_size=8, epochs=2, verbose=0,
                                           shuffle=False).history['loss'])
                self.assertAllClose(histories[1], histories[0], atol=TOLERANCE, rtol=TOLERANCE)
                self.assertAllClose(reference.predict(data, verbose=0),
                                    model.predict(data, verbose=0), atol=TOLERANCE,
                                    rtol=TOLERANCE)

    def testAKeywordNoLayerTakesNamesWhatTheyTake(self):
        pipe = Pipeline.FromKeras(TransformerBlocks(1), num_cells=1, num_micro_batches=M,
                                  input_shape=(5, 8), devices=DEVICES[:1])
        with self.assertRaisesRegex(errors.ConfigError,
                                    "'padding_msk'.*take 'attention_mask', 'padding_mask'"):
            pipe((tf.zeros([2, 5, 8]), {'padding_msk': tf.ones([2, 5], tf.int32)}))


def Copies(layers):
    """Unbuilt copies of `layers`, from their configs: the oracle's own layers."""
    return [type(layer).from_config(layer.get_config()) for layer in layers]


def CopyWeights(layers, copies):
    for layer, copy in zip(layers, copies):
        copy.set_weights(layer.get_weights())


def AssertSameWeights(test, layers, copies):
    for layer, copy in zip(layers, copies):
        for a, b in zip(layer.get_weights(), copy.get_weights()):
            test.assertAllClose(b, a, atol=TOLERANCE, rtol=TOLERANCE)


class NestsTest(tf.test.TestCase):
    """A layer's several outputs, a tuple, are the next layer's inputs across a cell boundary,
    as keras.Sequential passes them (one argument) or, to a call that requires several, one
    each; a last layer's tuple is the model's outputs."""

    def testATupleCrossesACellBoundaryToTheNextLayer(self):
        x = tf.random.stateless_normal((8, 6), [2, 3])
        cases = {
            # keras.Sequential's way: the tuple is Add's and Concatenate's one argument.
            'add': ([Fork(), keras.layers.Add(), keras.layers.Dense(2)],
                    lambda l, h: l[2](l[1](l[0](h)))),
            'concatenate': ([Fork(), keras.layers.Concatenate(), keras.layers.Dense(2)],
                            lambda l, h: l[2](l[1](l[0](h)))),
            # Calls that require two arguments get one each.
            'gate': ([Fork(), Gate(), keras.layers.Dense(2)],
                     lambda l, h: l[2](l[1](*l[0](h)))),
            'attention': ([keras.layers.Reshape((3, 2)), Fork(), keras.layers.MultiHeadAttention(
                2, 2), keras.layers.Flatten(), keras.layers.Dense(2)],
                          lambda l, h: l[4](l[3](l[2](*l[1](l[0](h)))))),
        }
        for name, (layers, oracle) in cases.items():
            with self.subTest(name):
                keras.utils.set_random_seed(0)
                fork = next(i for i, layer in enumerate(layers) if isinstance(layer, Fork))
                pipe = Pipeline.FromKeras(layers, num_cells=2, num_micro_batches=M,
                                          input_shape=(6,), devices=DEVICES[:2],
                                          balance=[fork + 1, len(layers) - fork - 1])
                with tf.GradientTape() as tape:
                    outputs = pipe(x, training=True)
                    loss = Loss(outputs)
                grads = tape.gradient(loss, pipe.trainable_weights)
                with tf.GradientTape() as tape:
                    expected = tf.concat([oracle(layers, part) for part in tf.split(x, M)], 0)
                    loss = Loss(expected)
                expected_grads = tape.gradient(loss, pipe.trainable_weights)
                self.assertAllClose(expected, outputs, atol=TOLERANCE, rtol=TOLERANCE)
                for grad, expected_grad in zip(grads, expected_grads):
                    self.assertAllClose(expected_grad, grad, atol=TOLERANCE, rtol=TOLERANCE)

    def testSeveralOutputsFitAsKerasSequential(self):
        rng = np.random.RandomState(3)
        x, _, sample_weight = Data(11)
        y = (rng.randn(11, 2).astype(np.float32), rng.randn(11, 3).astype(np.float32))
        keras.utils.set_random_seed(0)
        layers = [keras.layers.Dense(8, activation='tanh'),
                  keras.layers.Dense(8, activation='tanh'), Fork((2, 3))]
        reference = keras.Sequential([keras.Input((6,))] + Copies(layers))
        # zero_bubble: the loss inside the pipeline, the backward split in two.
        model = Sequential(layers, num_cells=2, num_micro_batches=M, input_shape=(6,),
                           devices=DEVICES[:2], schedule='zero_bubble')
        model.build((None, 6))
        CopyWeights(layers, reference.layers)
        histories = []
        for m in (model, reference):
            m.compile(keras.optimizers.SGD(0.5), ['mse', 'mae'], metrics=[['mae'], ['mse']])
            # Batches of 4, 4 and 3: the last splits into micro-batches of 2 and 1.
            histories.append(m.fit(x, y, sample_weight=sample_weight, batch_size=4, verbose=0,
                                   shuffle=False).history)
        self.assertEqual(sorted(histories[1]), sorted(histories[0]))
        for key in histories[1]:  # The loss, each output's loss ('mse_loss'), the metrics.
            self.assertAllClose(histories[1][key], histories[0][key], atol=TOLERANCE, msg=key)
        AssertSameWeights(self, layers, reference.layers)
        predictions = model.predict(x[:3], verbose=0)
        self.assertLen(predictions, 2)
        for got, want in zip(predictions, reference.predict(x[:3], verbose=0)):
            self.assertAllClose(want, got, atol=TOLERANCE)

    def testSeveralInputsAreTheFirstLayersAsInAFunctionalModel(self):
        rng = np.random.RandomState(4)
        a, b = rng.randn(11, 6).astype(np.float32), rng.randn(11, 3).astype(np.float32)
        y = rng.randn(11, 2).astype(np.float32)
        keras.utils.set_random_seed(0)
        layers = [keras.layers.Concatenate(), keras.layers.Dense(8, activation='tanh'),
                  keras.layers.Dense(2)]
        model = Sequential(layers, num_cells=2, num_micro_batches=M, input_shape=[(6,), (3,)],
                           devices=DEVICES[:2], schedule='1f1b')
        model.build([(None, 6), (None, 3)])
        copies = Copies(layers)
        inputs = (keras.Input((6,)), keras.Input((3,)))
        hidden = copies[0](list(inputs))
        reference = keras.Model(inputs, copies[2](copies[1](hidden)))
        CopyWeights(layers, copies)
        histories = []
        for m in (model, reference):
            m.compile(keras.optimizers.SGD(0.5), 'mse')
            histories.append(m.fit((a, b), y, batch_size=8, epochs=2, verbose=0,
                                   shuffle=False).history['loss'])
        self.assertAllClose(histories[1], histories[0], atol=TOLERANCE)
        AssertSameWeights(self, layers, copies)
        self.assertAllClose(reference.predict((a, b), verbose=0),
                            model.predict((a, b), verbose=0), atol=TOLERANCE)

    def testALayerThatReturnsADictIsAConfigError(self):
        with self.assertRaisesRegex(
                errors.ConfigError, r"layers\[0\] \(named.*\): its outputs are \{'h': "
                r"'KerasTensor'\}; .*a dict is the keyword inputs"):
            Pipeline.FromKeras([Named(), keras.layers.Dense(2)], num_cells=2,
                               num_micro_batches=M, input_shape=(6,), devices=DEVICES[:2])


class MixedPrecisionTest(tf.test.TestCase):
    """Keras's mixed policies: every Keras layer computes in the policy's dtype inside the
    pipeline as it does in keras.Sequential, the weights stay float32, and mixed_float16 trains
    through Keras's LossScaleOptimizer."""

    def tearDown(self):
        keras.mixed_precision.set_global_policy('float32')
        super().tearDown()

    def testFitAndPredictAsKerasSequentialUnderEachPolicy(self):
        x, y, sample_weight = Data()
        # Measured: losses 0.18% (bfloat16) and 0.004% (float16) apart over 3 epochs, from the
        # order of the sums over micro-batches; predictions 5e-3 and 5e-4 apart.
        for policy, dtype, rtol in (('mixed_bfloat16', 'bfloat16', 1e-2),
                                    ('mixed_float16', 'float16', 1e-3)):
            with self.subTest(policy=policy):
                keras.mixed_precision.set_global_policy(policy)
                model, reference = SequentialAndReference('zero_bubble')
                histories = [m.fit(x, y, sample_weight=sample_weight, batch_size=8, epochs=3,
                                   verbose=0, shuffle=False).history['loss']
                             for m in (model, reference)]
                self.assertAllClose(histories[1], histories[0], rtol=rtol)
                self.assertEqual(type(model.optimizer), type(reference.optimizer))
                self.assertEqual(
                    isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer),
                    policy == 'mixed_float16')
                predictions = model.predict(x[:3], verbose=0)
                self.assertEqual(predictions.dtype, dtype)
                self.assertAllClose(reference.predict(x[:3], verbose=0), predictions,
                                    rtol=2 * rtol, atol=2 * rtol)
                self.assertEqual({w.dtype for w in model.trainable_weights}, {'float32'})


class SavingTest(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        self.dir = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.dir)

    def testSequentialRoundTrip(self):
        x, y, _ = Data()
        model, _ = SequentialAndReference('zero_bubble', recompute='never')
        model.fit(x, y, batch_size=8, verbose=0)
        path = os.path.join(self.dir, 'sequential.keras')
        model.save(path)
        loaded = keras.models.load_model(path)
        self.assertIsInstance(loaded, Sequential)
        self.assertEqual(loaded.pipeline.params.schedule, 'zero_bubble')
        self.assertAllClose(model.predict(x, batch_size=8, verbose=0),
                            loaded.predict(x, batch_size=8, verbose=0), atol=1e-6)

    def testKerasFileRoundTripBuildsOnTheCellsDevices(self):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((5, 8)), Pipeline.FromKeras(
            TransformerBlocks(2), num_cells=2, num_micro_batches=M, input_shape=(5, 8),
            devices=DEVICES[:2]), keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.1), 'mse')
        rng = np.random.RandomState(0)
        x, y = rng.randn(8, 5, 8).astype(np.float32), rng.randn(8, 1).astype(np.float32)
        model.fit(x, y, batch_size=4, verbose=0)
        path = os.path.join(self.dir, 'model.keras')
        model.save(path)
        loaded = keras.models.load_model(path)
        self.assertAllClose(model.predict(x, batch_size=4, verbose=0),
                            loaded.predict(x, batch_size=4, verbose=0), atol=1e-6)
        pipe = loaded.layers[0]
        for k, cell in enumerate(pipe.pipeline.cells):
            for layer in cell.sequence:
                for variable in layer.keras_layer.weights:
                    self.assertEqual(tf.DeviceSpec.from_string(variable.value.device).device_index,
                                     tf.DeviceSpec.from_string(DEVICES[k]).device_index)


    def testALambdaLayerRunsAndLoadsOnlyOutsideSafeMode(self):
        # A Lambda of a Python lambda cannot be made from its config in safe mode, so the
        # pipeline counts its parameters on a deep copy; loading it is Keras's decision.
        keras.utils.set_random_seed(0)
        layers = [keras.layers.Dense(8, activation='tanh'),
                  keras.layers.Lambda(lambda t: 2.0 * t), keras.layers.Dense(2)]
        model = Sequential(layers, num_cells=2, num_micro_batches=M, input_shape=(6,),
                           devices=DEVICES[:2])
        x, _, _ = Data()
        predictions = model.predict(x, verbose=0)
        self.assertAllClose(Sequentially(layers, x, 1, training=False), predictions,
                            atol=TOLERANCE)
        path = os.path.join(self.dir, 'lambda.keras')
        model.save(path)
        with self.assertRaisesRegex(ValueError, 'safe_mode=False'):
            keras.models.load_model(path)
        loaded = keras.models.load_model(path, safe_mode=False)
        self.assertAllClose(predictions, loaded.predict(x, verbose=0), atol=1e-6)

    def testAKerasLayerNamingAModuleOutsideKerasRunsNoCode(self):
        # Keras's safe deserialization imports no module a layer's config names beyond its
        # own and its registered classes'.
        marker = test_utils.PlantModule(self, self.dir, 'planted_keras_mod')
        model = Sequential([keras.layers.Dense(8), keras.layers.Dense(2)], num_cells=2,
                           num_micro_batches=M, input_shape=(6,), devices=DEVICES[:2])
        model(tf.zeros([2, 6]))
        path, tampered = (os.path.join(self.dir, name) for name in ('m.keras', 't.keras'))
        model.save(path)
        test_utils.TamperKerasFile(self, path, tampered,
                                   '"module": "keras.layers", "class_name": "Dense"',
                                   '"module": "planted_keras_mod", "class_name": "Dense"')
        with self.assertRaises(TypeError):
            keras.models.load_model(tampered)
        self.assertFalse(os.path.exists(marker))
        self.assertNotIn('planted_keras_mod', sys.modules)

    def testSeveralOutputsRoundTrip(self):
        keras.utils.set_random_seed(0)
        model = Sequential([keras.layers.Dense(8, activation='tanh'), Fork((2, 3))],
                           num_cells=2, num_micro_batches=M, input_shape=(6,),
                           devices=DEVICES[:2], schedule='1f1b')
        model.compile(keras.optimizers.SGD(0.1), ['mse', 'mse'])
        x, _, _ = Data()
        model.fit(x, (x[:, :2], x[:, 3:]), batch_size=8, verbose=0)
        path = os.path.join(self.dir, 'outputs.keras')
        model.save(path)
        loaded = keras.models.load_model(path)
        for got, want in zip(loaded.predict(x, verbose=0), model.predict(x, verbose=0)):
            self.assertAllClose(want, got, atol=1e-6)


def SmallConvNet():
    """ConvNet for 6x6 inputs (6 layers, batch norm among them)."""
    return [keras.layers.Conv2D(4, 3, padding='same', activation='relu'),
            keras.layers.BatchNormalization(), keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(4, 3, activation='relu'), keras.layers.Flatten(),
            keras.layers.Dense(3)]


class ScheduleMatrixTest(tf.test.TestCase):
    """One SGD step inside `fit` equals the layers run in sequence per micro-batch (outputs,
    loss, every weight, batch norm's moving statistics) for every schedule and every recompute
    mode."""

    SCHEDULES = [('gpipe', {}), ('1f1b', {}), ('interleaved_1f1b', {'virtual_stages': 2}),
                 ('zero_bubble', {}), ('zero_bubble_v', {'virtual_stages': 2})]

    def assertStepsAsInSequence(self, make_layers, x, y, schedule, **params):
        keras.utils.set_random_seed(0)
        layers = make_layers()
        model = Sequential(layers, num_cells=2, num_micro_batches=M, input_shape=x.shape[1:],
                           devices=DEVICES[:2], schedule=schedule, **params)
        model.build((None,) + x.shape[1:])
        model.compile(keras.optimizers.SGD(0.1), 'mse')
        loss, trainable, non_trainable = test_utils.KerasSgdStepInSequence(layers, x, y, 0.1, M)
        history = model.fit(x, y, batch_size=len(x), verbose=0, shuffle=False).history
        self.assertAllClose(loss, history['loss'][0], atol=TOLERANCE, rtol=TOLERANCE)
        for want, weight in zip(trainable,
                                [w for layer in layers for w in layer.trainable_weights]):
            self.assertAllClose(want, weight, atol=TOLERANCE, rtol=TOLERANCE, msg=weight.path)
        for want, weight in zip(non_trainable,
                                [w for layer in layers for w in layer.non_trainable_weights]):
            self.assertAllClose(want, weight, atol=TOLERANCE, rtol=TOLERANCE, msg=weight.path)

    def testConvNetWithBatchNormEveryScheduleAndRecomputeMode(self):
        rng = np.random.RandomState(5)
        x, y = rng.randn(4, 6, 6, 2).astype(np.float32), rng.randn(4, 3).astype(np.float32)
        for schedule, params in self.SCHEDULES:
            for recompute in ('always', 'never', 'except_last'):
                with self.subTest(schedule=schedule, recompute=recompute):
                    self.assertStepsAsInSequence(SmallConvNet, x, y, schedule,
                                                 recompute=recompute, **params)

    def testKerasHubEncodersZeroBubbleV(self):
        rng = np.random.RandomState(6)
        x, y = rng.randn(4, 4, 8).astype(np.float32), rng.randn(4, 3).astype(np.float32)
        make_layers = lambda: TransformerBlocks(3) + [keras.layers.Flatten(),
                                                      keras.layers.Dense(3)]
        self.assertStepsAsInSequence(make_layers, x, y, 'zero_bubble_v', virtual_stages=2)


@pytest.mark.unit
class ErrorsTest(tf.test.TestCase):

    def assertConfigError(self, pattern, **kwargs):
        arguments = dict(layers=DenseStack(), num_cells=2, num_micro_batches=M,
                         input_shape=(6,), devices=DEVICES[:2])
        arguments.update(kwargs)
        with self.assertRaisesRegex(errors.ConfigError, pattern):
            Pipeline.FromKeras(**arguments)

    def testNotKerasLayers(self):
        self.assertConfigError(r'layers\[1\] is str .*expected a Keras layer',
                               layers=[keras.layers.Dense(2), 'dense'])

    def testNoInputShape(self):
        self.assertConfigError('give input_shape', input_shape=None)

    def testBadInputShape(self):
        self.assertConfigError('input_shape must be the shape of one example',
                               input_shape='six')

    def testInputThatDoesNotFit(self):
        self.assertConfigError(r'layers\[0\] \(conv2d.*\) does not take inputs of shapes '
                               r'\[\[6\]\]', layers=ConvNet())

    def testBalanceThatDoesNotAddUp(self):
        self.assertConfigError(r'balance \[1, 2\] must give 2 cells .* and 4 layers',
                               balance=[1, 2])

    def testAScheduleThatIsNone(self):
        self.assertConfigError(r"^gpipe_tf\.keras\.Pipeline\.FromKeras: schedule must be one of "
                               r"\('gpipe', .*got 'zb'\.$", schedule='zb')

    def testASequentialWithAScheduleThatIsNoneIsRefusedWhenMade(self):
        with self.assertRaisesRegex(errors.ConfigError, r"^gpipe_tf\.keras\.Pipeline\.FromKeras: "
                                    r"schedule must be one of .*got 'zb'\.$"):
            Sequential(DenseStack(), 2, M, input_shape=(6,), devices=DEVICES[:2],
                       schedule='zb')

    def testOneLayerObjectTwice(self):
        dense = keras.layers.Dense(6)
        self.assertConfigError(r'layers\[0\] and layers\[2\] are the same Keras layer object '
                               r'\(dense.*\); each layer must be a distinct object',
                               layers=[dense, keras.layers.Dense(6), dense, keras.layers.Dense(3)])

    def testMoreCellsThanLayersEndsInOnePeriod(self):
        self.assertConfigError(r'Cannot partition 4 layers into 8 non-empty cells \(4 < 8\)\.$',
                               num_cells=8)

    def testUnknownParam(self):
        self.assertConfigError("Unknown param 'recomput'; closest", recomput='never')

    def testLayerBuiltOnAnotherDevice(self):
        layers = DenseStack()
        with tf.device(DEVICES[0]):
            built = keras.Sequential([keras.Input((6,))] + layers)
        del built
        self.assertConfigError(r'built before the pipeline, with its weights on .*CPU:0, not on '
                               r"its cell's device .*CPU:1", layers=layers)


def SummaryLines(model, **kwargs) -> list[str]:
    """`model.summary(**kwargs)`'s lines."""
    lines = []
    model.summary(print_fn=lambda text, **_: lines.extend(text.splitlines()), **kwargs)
    return lines


def SummaryRows(model, **kwargs) -> list[tuple[str, str, int]]:
    """(name and class, output shape, parameters) of each row of `model.summary(**kwargs)`'s
    table, a row's lines joined (the table wraps a long name)."""
    rows, row = [], []
    for line in SummaryLines(model, **kwargs) + ['']:
        if line.startswith('│'):
            row.append([c.strip() for c in line.split('│')[1:-1]])
            continue
        if row:
            name, shape, params = (' '.join(filter(None, column)) for column in zip(*row))
            rows.append((name, shape, int(params.replace(',', ''))))
        row = []
    return rows


def TotalParams(model) -> int:
    line, = [l for l in SummaryLines(model) if 'Total params:' in l]
    return int(line.split(':')[1].split('(')[0].replace(',', ''))


def DropoutStack():
    """DenseStack with a Dropout: what the step seeds."""
    return [keras.layers.Dense(8, activation='tanh'), keras.layers.BatchNormalization(),
            keras.layers.Dropout(0.5), keras.layers.Dense(2)]


class RegisteredNameTest(tf.test.TestCase):
    """The classes are registered as gpipe_tf.keras>Sequential and gpipe_tf.keras>Pipeline,
    and files saved under the old names (gpipe_tf>...) load."""

    def setUp(self):
        super().setUp()
        self.dir = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.dir)

    def SavedModel(self):
        keras.utils.set_random_seed(0)
        model = Sequential([keras.layers.Dense(3), keras.layers.Dense(2)], num_cells=2,
                           num_micro_batches=M, input_shape=(4,), devices=DEVICES[:2])
        path = os.path.join(self.dir, 'm.keras')
        model.save(path)
        return model, path

    def testLoadingWithoutTheImportNamesThePackage(self):
        _, path = self.SavedModel()
        # A fresh process that imports Keras only: Keras's error must say what to import.
        script = ('import sys, keras\n'
                  'try:\n'
                  f'    keras.models.load_model({path!r})\n'
                  'except TypeError as error:\n'
                  '    print(error)\n'
                  'print("imported gpipe_tf:", "gpipe_tf" in sys.modules)\n')
        result = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True,
                                timeout=120, check=True)
        self.assertIn("Could not locate class 'Sequential'", result.stdout)
        self.assertIn("'registered_name': 'gpipe_tf.keras>Sequential'", result.stdout)
        self.assertIn("'registered_name': 'gpipe_tf.keras>Pipeline'", result.stdout)
        self.assertIn('imported gpipe_tf: False', result.stdout)

    def testAFileOfTheOldRegisteredNamesLoads(self):
        model, path = self.SavedModel()
        old, older = (os.path.join(self.dir, name) for name in ('old.keras', 'older.keras'))
        # What the file would say had it been saved before the names changed.
        test_utils.TamperKerasFile(self, path, old, '"gpipe_tf.keras>Sequential"',
                                   '"gpipe_tf>Sequential"')
        test_utils.TamperKerasFile(self, old, older, '"gpipe_tf.keras>Pipeline"',
                                   '"gpipe_tf>Pipeline"')
        loaded = keras.models.load_model(older)
        self.assertIsInstance(loaded, Sequential)
        x = np.random.RandomState(0).randn(4, 4).astype(np.float32)
        self.assertAllClose(model.predict(x, verbose=0), loaded.predict(x, verbose=0),
                            atol=1e-6)
        # Saved again, it takes the new names.
        loaded.save(path)
        with zipfile.ZipFile(path) as saved:
            config = json.loads(saved.read('config.json'))
        self.assertEqual(config['registered_name'], 'gpipe_tf.keras>Sequential')
        self.assertEqual(config['config']['pipeline']['registered_name'],
                         'gpipe_tf.keras>Pipeline')


class SummaryTest(tf.test.TestCase):
    """summary() and count_params() count what keras.Sequential counts on the same layers (the
    step is no parameter), and summary(expand_nested=True) lists each cell's layers."""

    def setUp(self):
        super().setUp()
        self.dir = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.dir)

    def ModelAndReference(self):
        keras.utils.set_random_seed(0)
        layers = DropoutStack()
        reference = keras.Sequential([keras.Input((6,))] + Copies(layers))
        model = Sequential(layers, num_cells=2, num_micro_batches=M, input_shape=(6,),
                           devices=DEVICES[:2], balance=[2, 2])
        model(tf.zeros([2, 6]))
        return model, reference

    def testCountsAsKerasSequential(self):
        model, reference = self.ModelAndReference()
        # Dense 6x8 + 8, batch norm 4 x 8 (2 x 8 of them moving statistics), Dense 8x2 + 2.
        self.assertEqual(56 + 32 + 18, reference.count_params())
        self.assertEqual(reference.count_params(), model.count_params())
        self.assertEqual(reference.count_params(), model.pipeline.count_params())
        self.assertEqual(TotalParams(reference), TotalParams(model))
        self.assertEqual(len(reference.non_trainable_weights),
                         len(model.non_trainable_weights))

    def testExpandedSummaryListsEachCellsLayers(self):
        model, _ = self.ModelAndReference()
        dense, norm, dropout, head = model.pipeline.keras_layers
        rows = SummaryRows(model, expand_nested=True)
        self.assertEqual(
            [(name, params) for name, _, params in rows],
            [('pipeline (Pipeline)', 106),
             ('└ cell_0 (Cell)', 88), (f'└ {dense.name} (Dense)', 56),
             (f'└ {norm.name} (BatchNormalization)', 32),
             ('└ cell_1 (Cell)', 18), (f'└ {dropout.name} (Dropout)', 0),
             (f'└ {head.name} (Dense)', 18)])
        self.assertEqual([shape for _, shape, _ in rows[:3]],
                         ['(None, 2)', '(None, 8)', '(None, 8)'])
        # The layers are nested deeper than the cells.
        lines = SummaryLines(model, expand_nested=True)
        depths = {name: line.index('└') for name in ('cell_0', dense.name)
                  for line in lines if f'└ {name} (' in line}
        self.assertGreater(depths[dense.name], depths['cell_0'])
        # Without expand_nested, the one Pipeline row.
        self.assertEqual([name for name, _, _ in SummaryRows(model)], ['pipeline (Pipeline)'])

    def testAPipelineOfGpipeLayersInAKerasModel(self):
        layers = [basic.DenseLayer.Params().Set(input_dim=6, output_dim=4),
                  basic.DenseLayer.Params().Set(input_dim=4, output_dim=3)]
        pipe = Pipeline.FromLayers(layers, num_cells=2, num_micro_batches=M,
                                   devices=DEVICES[:2], name='pipeline')
        model = keras.Sequential([keras.Input((6,)), pipe, keras.layers.Dense(1)])
        rows = SummaryRows(model, expand_nested=True)
        # DenseLayer: a weight input_dim x output_dim and a bias output_dim.
        self.assertEqual(rows, [('pipeline (Pipeline)', '(None, 3)', 28 + 15),
                                ('└ cell_0 (Cell)', '(None, 4)', 28),
                                ('└ layer_000 (DenseLayer)', '(None, 4)', 28),
                                ('└ cell_1 (Cell)', '(None, 3)', 15),
                                ('└ layer_001 (DenseLayer)', '(None, 3)', 15),
                                (f'{model.layers[1].name} (Dense)', '(None, 1)', 4)])
        self.assertEqual(TotalParams(model), 28 + 15 + 4)

    def FitModel(self, epochs):
        """A Sequential of DropoutStack fit on 16 examples in batches of 8 (2 steps an
        epoch)."""
        model, _ = self.ModelAndReference()
        model.compile(keras.optimizers.SGD(0.1), 'mse')
        x, y, _ = Data()
        model.fit(x, y, batch_size=8, epochs=epochs, verbose=0, shuffle=False)
        return model, x

    def testStepIsSavedAndRestoredWithTheWeights(self):
        model, x = self.FitModel(epochs=2)
        self.assertEqual(int(model.pipeline.step.numpy()), 4)
        weights_path = os.path.join(self.dir, 'm.weights.h5')
        model.save_weights(weights_path)
        fresh, _ = self.ModelAndReference()
        fresh.load_weights(weights_path)
        self.assertEqual(int(fresh.pipeline.step.numpy()), 4)
        path = os.path.join(self.dir, 'm.keras')
        model.save(path)
        loaded = keras.models.load_model(path)
        self.assertEqual(int(loaded.pipeline.step.numpy()), 4)
        self.assertAllClose(model.predict(x, verbose=0), loaded.predict(x, verbose=0),
                            atol=1e-6)

    def testStepIsStoredWhereItWasAWeight(self):
        # Files saved when the step was the layer's last weight (key "<weights>") load, and
        # the layer's weights keep their keys: "0"... in trainable, then non-trainable order.
        layers = [basic.DenseLayer.Params().Set(input_dim=6, output_dim=4),
                  normalization.BatchNormLayer.Params().Set(dim=4)]
        pipe = Pipeline.FromLayers(layers, num_cells=2, num_micro_batches=M,
                                   devices=DEVICES[:2])
        model = keras.Sequential([keras.Input((6,)), pipe])
        pipe.step.assign(7)
        path = os.path.join(self.dir, 'm.weights.h5')
        model.save_weights(path)
        own = pipe.trainable_weights + pipe.non_trainable_weights
        with h5py.File(path) as f:
            stored = f['layers/pipeline/vars']
            self.assertEqual(sorted(stored, key=int), [str(i) for i in range(len(own) + 1)])
            for i, weight in enumerate(own):
                self.assertAllEqual(weight.numpy(), stored[str(i)][()])
            self.assertEqual(stored[str(len(own))][()], 7)
            self.assertEqual(stored[str(len(own))].dtype, np.int64)


class BuiltAtConstructionTest(tf.test.TestCase):
    """A Sequential given input_shape is built when made, as a keras.Sequential that starts
    with a keras.Input."""

    def testBuiltBeforeTheFirstCall(self):
        keras.utils.set_random_seed(0)
        layers = DenseLayers()
        reference = keras.Sequential([keras.Input((6,))] + Copies(layers))
        model = Sequential(layers, num_cells=2, num_micro_batches=4, input_shape=(6,),
                           devices=DEVICES[:2])
        self.assertTrue(model.built)
        self.assertEqual(reference.count_params(), model.count_params())
        self.assertEqual(SummaryRows(model), [('pipeline (Pipeline)', '(None, 2)',
                                               reference.count_params())])

    def testBackupAndRestoreResumesAsAnUninterruptedFit(self):
        # Dropout's masks are seeded by the step: the resumed fit draws the uninterrupted
        # one's only if the backup restored the step with the weights.
        x, y, _ = Data()
        backup = tempfile.mkdtemp()
        # A fit that ends removes its backup.
        self.addCleanup(shutil.rmtree, backup, ignore_errors=True)

        def Model():
            keras.utils.set_random_seed(0)
            model = Sequential(DropoutStack(), num_cells=2, num_micro_batches=M,
                               input_shape=(6,), devices=DEVICES[:2], schedule='1f1b')
            model.compile(keras.optimizers.SGD(0.1), 'mse')
            return model

        class Interrupt(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                if epoch == 2:
                    raise RuntimeError('interrupted')

        def Fit(model, callbacks):
            return model.fit(x, y, batch_size=8, epochs=3, verbose=0, shuffle=False,
                             callbacks=callbacks).history['loss']

        uninterrupted = Model()
        want = Fit(uninterrupted, [])
        with self.assertRaisesRegex(RuntimeError, 'interrupted'):
            Fit(Model(), [keras.callbacks.BackupAndRestore(backup), Interrupt()])
        resumed = Model()
        got = Fit(resumed, [keras.callbacks.BackupAndRestore(backup)])
        self.assertLen(got, 1)  # Only the third epoch ran.
        self.assertAllClose(want[-1], got[0], atol=1e-6)
        self.assertEqual(int(resumed.pipeline.step.numpy()), 6)
        AssertSameWeights(self, resumed.pipeline.keras_layers,
                          uninterrupted.pipeline.keras_layers)
