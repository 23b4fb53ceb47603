"""gpipe_tf.keras.Pipeline's contract: a PipeliningLayer in a Keras 3 model trains, evaluates,
saves and loads as the same layers un-partitioned would, with every weight visible to Keras."""

import os
import shutil
import sys
import tempfile
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from gpipe_tf import errors
from gpipe_tf import test_utils
from gpipe_tf.keras import Pipeline
from gpipe_tf.layers import basic
from gpipe_tf.layers import fprop_context
from gpipe_tf.pipeline import pipelining_layer

DEVICES = test_utils.ConfigureVirtualCpus()
TOLERANCE = 1e-5
BATCH, DIM, M = 8, 4, 2
LEARNING_RATE = 0.5


def Layers():
    """Two blocks of dense (no bias), batch norm (decay 0.9), tanh: 6 layers, 2 per cell."""
    return test_utils.BatchNormStack(2, DIM)


def MakePipeline(num_cells=2, num_micro_batches=M, devices=None, **kwargs):
    return Pipeline.FromLayers(Layers(), num_cells, num_micro_batches,
                               devices=devices or DEVICES[:num_cells], **kwargs)


def MakeModel(pipeline=None, seed=1, functional=False):
    """A Keras dense layer, the pipeline, a Keras dense head: the pipeline in the middle (tanh
    before it, so that every weight has a gradient: batch norm cancels a bias right before it).
    A Sequential model, or the same as a functional one."""
    init = lambda offset: keras.initializers.GlorotUniform(seed=seed + offset)
    layers = [keras.layers.Dense(DIM, activation='tanh', kernel_initializer=init(0),
                                 name='before'),
              pipeline or MakePipeline(),
              keras.layers.Dense(1, kernel_initializer=init(1), name='head')]
    if not functional:
        return keras.Sequential([keras.Input((DIM,))] + layers)
    inputs = outputs = keras.Input((DIM,))
    for layer in layers:
        outputs = layer(outputs)
    return keras.Model(inputs, outputs)


def Parts(model):
    """(the Keras layer before the pipeline, the Pipeline, the head)."""
    return [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]


def Compile(model, **kwargs):
    model.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE), loss='mse', **kwargs)
    return model


def Data(num_examples=BATCH, seed=0):
    rng = np.random.RandomState(seed)
    return (rng.randn(num_examples, DIM).astype(np.float32),
            rng.randn(num_examples, 1).astype(np.float32))


def Values(model):
    return [np.array(w.numpy()) for w in model.weights]


def ReferenceLossAndGrads(model, x, y, num_micro_batches=M):
    """The model's loss and gradients with its pipeline's layers run un-partitioned (each
    micro-batch through `Layers()` one after another: batch norm's statistics per micro-batch,
    as GPipe's), no devices, no pipeline code; nothing is updated."""
    before, pipeline, head = Parts(model)
    with tf.GradientTape() as tape:
        outputs = head(test_utils.Unpartitioned(pipeline.pipeline, before(x), num_micro_batches))
        loss = keras.losses.MeanSquaredError()(y, outputs)
    return loss, tape.gradient(loss, model.trainable_weights)


def Inference(model, x):
    """The model's outputs with the pipeline's layers run un-partitioned in inference mode."""
    before, pipeline, head = Parts(model)
    with fprop_context.Scope(training=False):
        return head(test_utils.Unpartitioned(pipeline.pipeline, before(x)))


def NamedWeights(model, name):
    return [w for w in model.weights if w.path.endswith(name)]


def FittedModel():
    """(a compiled model, x, y) after one epoch of two steps on (x, y): two steps, so that the
    moving statistics are not the initial ones."""
    model = Compile(MakeModel())
    x, y = Data(2 * BATCH)
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    return model, x, y


class TempDirTest(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        # tempfile, not create_tempdir(): that needs absl flags, which pytest does not parse.
        self.dir = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.dir)


@pytest.mark.unit
class WeightsTest(tf.test.TestCase):
    """Every variable of the pipeline is a Keras weight, stored once, on its cell's device."""

    def testEveryPipelineVariableIsAKerasWeight(self):
        layer = MakePipeline()
        pipe = layer.pipeline
        self.assertEqual([w.value for w in layer.trainable_weights],
                         [v for _, v in pipe.vars.FlattenItems() if v.trainable])
        self.assertEqual([w.value for w in layer.non_trainable_weights],
                         [v for _, v in pipe.vars.FlattenItems() if not v.trainable])
        self.assertLen(layer.trainable_weights, 6)  # w, beta, gamma of each block.
        self.assertEqual([w.name for w in layer.non_trainable_weights],
                         ['layer_001.moving_mean', 'layer_001.moving_variance',
                          'layer_004.moving_mean', 'layer_004.moving_variance'])
        # The count of training calls is saved with the weights but is not a parameter.
        self.assertNotIn(id(layer.step), [id(w.value) for w in layer.weights])

    def testKerasWeightsShareTheVariablesStorage(self):
        layer = MakePipeline()
        weight = layer.trainable_weights[0]
        weight.assign(tf.fill(weight.shape, 3.0))
        self.assertAllEqual(layer.pipeline.vars.layer_000.w, tf.fill(weight.shape, 3.0))
        layer.pipeline.vars.layer_000.w.assign(tf.fill(weight.shape, -1.0))
        self.assertAllEqual(weight, tf.fill(weight.shape, -1.0))

    def testWeightsLiveOnTheirCellsDevices(self):
        layer = MakePipeline()
        cell_of = {l.p.name: k for k, cell in enumerate(layer.pipeline.cells)
                   for l in cell.sequence}
        for weight in layer.weights:
            k = cell_of[weight.name.split('.')[0]]
            self.assertEqual(tf.DeviceSpec.from_string(weight.value.device).device_index, k,
                             weight.path)
        self.assertEqual(sorted(set(cell_of.values())), [0, 1])


@pytest.mark.unit
class TrainTest(tf.test.TestCase):
    """fit trains the pipeline as the un-partitioned layers would, and only fit changes it."""

    def testTrainStepLossAndGradientsEqualUnpartitioned(self):
        model = Compile(MakeModel())
        x, y = Data()

        @tf.function
        def Step(x, y):  # Keras's train step up to the update.
            with tf.GradientTape() as tape:
                loss = model.compute_loss(x, y, model(x, training=True))
            return loss, tape.gradient(loss, model.trainable_weights)

        want = ReferenceLossAndGrads(model, x, y)
        got = Step(x, y)
        self.assertNotIn(None, got[1])
        self.assertLess(test_utils.MaxRelativeError(got, want), TOLERANCE)

    def testFitAppliesTheUnpartitionedGradients(self):
        self.CheckFitAppliesTheUnpartitionedGradients(Compile(MakeModel()))

    def testFitOfAFunctionalModelAppliesTheUnpartitionedGradients(self):
        self.CheckFitAppliesTheUnpartitionedGradients(Compile(MakeModel(functional=True)))

    def testFitOnABatchMDoesNotDivide(self):
        # M = 2 micro-batches of 3 and 2 examples.
        x, y = Data(5)
        self.CheckFitAppliesTheUnpartitionedGradients(Compile(MakeModel()), x, y, [3, 2],
                                                      batch_size=5)

    def testFitOnABatchKnownOnlyWhenTheStepRuns(self):
        # A dataset not batched with drop_remainder: Keras traces the step with batch None.
        x, y = Data(5)
        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(5)
        self.assertIsNone(data.element_spec[0].shape[0])
        self.CheckFitAppliesTheUnpartitionedGradients(Compile(MakeModel()), x, y, [3, 2],
                                                      data=data)

    def CheckFitAppliesTheUnpartitionedGradients(self, model, x=None, y=None,
                                                 micro_batches=M, data=None,
                                                 batch_size=BATCH):
        if x is None:
            x, y = Data()
        want_loss, want_grads = ReferenceLossAndGrads(model, x, y, micro_batches)
        before = [w.numpy() for w in model.trainable_weights]
        if data is None:
            history = model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False,
                                verbose=0)
        else:
            history = model.fit(data, epochs=1, verbose=0)
        # One SGD step: w <- w - lr g.
        got_grads = [(b - w.numpy()) / LEARNING_RATE
                     for b, w in zip(before, model.trainable_weights)]
        self.assertLess(test_utils.MaxRelativeError(history.history['loss'][0], want_loss),
                        TOLERANCE)
        self.assertLess(test_utils.MaxRelativeError(got_grads, want_grads), TOLERANCE)

    def testFitChangesEveryWeight(self):
        model = Compile(MakeModel())
        x, y = Data(2 * BATCH)
        before = Values(model)
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
        for weight, old, new in zip(model.weights, before, Values(model)):
            self.assertGreater(float(np.abs(new - old).max()), 0.0, weight.path)
        self.assertEqual(int(model.layers[1].step.numpy()), 2)

    def testFitUpdatesBatchNormStatisticsFromTheWholeBatch(self):
        model = Compile(MakeModel())
        x, y = Data()
        before, pipeline, _ = Parts(model)
        # The first batch norm's input, by hand: the before layer, then layer_000's matmul.
        bn_input = np.asarray(before(x)) @ pipeline.pipeline.vars.layer_000.w.numpy()
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
        # decay 0.9, from mean 0 and variance 1, towards the batch's mean and biased variance.
        self.assertAllClose(NamedWeights(model, 'layer_001.moving_mean')[0],
                            0.1 * bn_input.mean(0), rtol=1e-5, atol=1e-6)
        self.assertAllClose(NamedWeights(model, 'layer_001.moving_variance')[0],
                            0.9 + 0.1 * bn_input.var(0), rtol=1e-5, atol=1e-6)

    def testTrainingStepSeedsDropoutMasks(self):
        layers = [basic.DropoutLayer.Params().Set(keep_prob=0.5),
                  basic.DenseLayer.Params().Set(input_dim=DIM, output_dim=DIM)]
        layer = Pipeline.FromLayers(layers, 2, M, devices=DEVICES[:2])
        x = tf.ones([BATCH, DIM])
        first, second = layer(x, training=True), layer(x, training=True)
        self.assertEqual(int(layer.step.numpy()), 2)
        # The second training call drew step 1's masks, as the trainer's step 1 would.
        self.assertAllClose(second, test_utils.Unpartitioned(layer.pipeline, x, M, step=1),
                            rtol=1e-6)
        self.assertGreater(float(np.abs(first - second).max()), 0.0)


@pytest.mark.unit
class InferenceTest(tf.test.TestCase):
    """evaluate and predict run the pipeline in inference mode and change no weight."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.model, cls.x, cls.y = FittedModel()

    def testPredictRunsInInferenceMode(self):
        want = Inference(self.model, self.x)
        self.assertAllClose(self.model.predict(self.x, batch_size=BATCH, verbose=0), want,
                            rtol=1e-5, atol=1e-6)
        # Training mode normalises with the batch's statistics: a different answer.
        self.assertGreater(
            float(np.abs(self.model(self.x[:BATCH], training=True) - want[:BATCH]).max()), 1e-3)

    def testEvaluateRunsInInferenceMode(self):
        self.assertAllClose(self.model.evaluate(self.x, self.y, batch_size=BATCH, verbose=0),
                            keras.losses.MeanSquaredError()(self.y, Inference(self.model, self.x)),
                            rtol=1e-5)

    def testPredictEvaluateAndCallOnAnyNumberOfExamples(self):
        x, y = self.x, self.y
        for n, batch_size in ((1, 1), (3, 8), (11, 8), (16, 5)):
            # 11 in batches of 8: Keras traces the second batch size with batch None.
            self.assertAllClose(self.model.predict(x[:n], batch_size=batch_size, verbose=0),
                                Inference(self.model, x[:n]), rtol=1e-5, atol=1e-6, msg=n)
        self.assertAllClose(self.model(x[:5], training=False), Inference(self.model, x[:5]),
                            rtol=1e-5, atol=1e-6)
        self.assertAllClose(
            self.model.evaluate(x[:11], y[:11], batch_size=8, verbose=0),
            keras.losses.MeanSquaredError()(y[:11], Inference(self.model, x[:11])), rtol=1e-5)

    def testEvaluateAndPredictChangeNoWeight(self):
        before = Values(self.model)
        self.model.evaluate(self.x, self.y, batch_size=BATCH, verbose=0)
        self.model.predict(self.x, batch_size=BATCH, verbose=0)
        for weight, old, new in zip(self.model.weights, before, Values(self.model)):
            self.assertAllEqual(new, old, msg=weight.path)


class MixedPrecisionTest(tf.test.TestCase):
    """Keras's mixed_bfloat16 policy: the pipeline computes in bfloat16 (its Params'
    fprop_dtype), its variables stay float32."""

    def setUp(self):
        super().setUp()
        self.addCleanup(keras.mixed_precision.set_global_policy, keras.config.dtype_policy())

    def testGlobalPolicyComputesInBfloat16WithFloat32Variables(self):
        keras.mixed_precision.set_global_policy('mixed_bfloat16')
        # Named, so that the float32 model below gets the same initial weights.
        model = Compile(MakeModel(MakePipeline(name='pipe')))
        _, pipeline, _ = Parts(model)
        self.assertEqual(pipeline.params.fprop_dtype, tf.bfloat16)
        self.assertEqual(pipeline.dtype_policy.name, 'mixed_bfloat16')
        self.assertEqual({w.dtype for w in pipeline.trainable_weights}, {'float32'})
        self.assertEqual({v.dtype for v in pipeline.pipeline.variables}, {tf.float32})
        x, y = Data()
        self.assertEqual(pipeline(tf.constant(x)).dtype, tf.bfloat16)

        @tf.function
        def Step(x, y):  # Keras's train step up to the update.
            with tf.GradientTape() as tape:
                loss = model.compute_loss(x, y, model(x, training=True))
            return loss, tape.gradient(loss, model.trainable_weights)

        got = Step(x, y)
        # The same layers un-partitioned, in bfloat16 too: the same math. In a tf.function,
        # as the pipeline's cells run: on a CPU with bfloat16 units (AMX), graph optimization
        # fuses a matmul with its bias and activation into a kernel that rounds once, where
        # eager ops round after each.
        want = tf.function(lambda x, y: ReferenceLossAndGrads(model, x, y))(x, y)
        self.assertLess(test_utils.MaxRelativeError(got, want), TOLERANCE)
        keras.mixed_precision.set_global_policy('float32')
        float32 = Compile(MakeModel(MakePipeline(name='pipe')))
        self.assertIsNone(Parts(float32)[1].params.fprop_dtype)
        error = test_utils.MaxRelativeError(got, ReferenceLossAndGrads(float32, x, y))
        # Keras's layers compute in bfloat16 too, and batch norm divides by the spread of 4
        # examples: measured 6% (8 significant bits).
        self.assertLess(error, 1e-1)
        self.assertGreater(error, 1e-4)  # Else the pipeline did not compute in bfloat16.

    def testFitKeepsTheVariablesFloat32(self):
        keras.mixed_precision.set_global_policy('mixed_bfloat16')
        # A fixed name: the pipeline's initial values (seeded by it) do not depend on which
        # tests ran before.
        model = Compile(MakeModel(MakePipeline(name='pipe')))
        x, y = Data(2 * BATCH)
        before = Values(model)
        history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        self.assertLess(history.history['loss'][1], history.history['loss'][0])
        for weight, old, new in zip(model.weights, before, Values(model)):
            self.assertEqual(new.dtype, old.dtype, weight.path)
        self.assertEqual({v.dtype for v in Parts(model)[1].pipeline.variables}, {tf.float32})

    def testMixedFloat16TrainsWithKerasLossScalingAsFloat32Does(self):
        # Four epochs of 2 steps each: the loss of each epoch is float32's (so scaled gradients
        # were unscaled and applied, none skipped), to float16's precision. A fixed name: the
        # pipeline's initial values (seeded by it) do not depend on which tests ran before.
        x, y = Data(2 * BATCH)
        losses = {}
        for policy in ('float32', 'mixed_float16'):
            keras.mixed_precision.set_global_policy(policy)
            model = Compile(MakeModel(MakePipeline(name='pipe')))
            history = model.fit(x, y, batch_size=BATCH, epochs=4, shuffle=False, verbose=0)
            losses[policy] = history.history['loss']
        self.assertEqual(Parts(model)[1].params.fprop_dtype, tf.float16)
        self.assertIsInstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
        # Measured: 0.2% apart at most.
        self.assertAllClose(losses['mixed_float16'], losses['float32'], rtol=2e-2)
        self.assertNotAllClose(losses['mixed_float16'], losses['float32'], rtol=1e-6, atol=0)

    def testDtypeArgumentSetsTheComputeDtype(self):
        layer = MakePipeline(dtype='mixed_bfloat16')
        self.assertEqual(keras.config.dtype_policy().name, 'float32')
        self.assertEqual(layer.params.fprop_dtype, tf.bfloat16)
        self.assertEqual(layer.dtype_policy.name, 'mixed_bfloat16')
        self.assertEqual(layer(tf.ones([BATCH, DIM])).dtype, tf.bfloat16)

    def testParamsFprop16DtypeWithoutAPolicy(self):
        layer = Pipeline(MakePipeline().params.Copy().Set(name='pipe', fprop_dtype=tf.bfloat16))
        self.assertEqual(layer.dtype_policy.name, 'mixed_bfloat16')

    def testConfigRoundTripKeepsTheComputeDtype(self):
        layer = MakePipeline(dtype='mixed_bfloat16')
        loaded = Pipeline.from_config(layer.get_config())
        self.assertEqual(loaded.params.fprop_dtype, tf.bfloat16)
        self.assertEqual(loaded.dtype_policy.name, 'mixed_bfloat16')

    def testAPolicyContradictingTheParamsIsAnError(self):
        p = MakePipeline().params.Copy().Set(name='pipe', fprop_dtype=tf.float16)
        with self.assertRaisesRegex(errors.ConfigError,
                                    r'compute in float16 .*mixed_bfloat16.* computes in '
                                    r'bfloat16'):
            Pipeline(p, dtype='mixed_bfloat16')


class PlacementTest(tf.test.TestCase):
    """Keras's train step runs every op of cell k, forward and backward, on the cell's device."""

    def testTrainStepRunsEachCellOnItsDevice(self):
        model = Compile(MakeModel())
        x, y = Data()
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)  # Builds the optimizer.
        graph = tf.function(model.train_step).get_concrete_function(
            (tf.constant(x), tf.constant(y))).graph
        devices = [tf.DeviceSpec.from_string(d) for d in model.layers[1].pipeline.devices]
        self.assertEqual([d.device_index for d in devices], [0, 1])
        seen = set()
        for op in graph.get_operations():
            k, part = test_utils.CellScope(op.name)
            # A variable read without a device of its own (batch norm's update) runs where its
            # variable lives: on cell k's device, as the weights test checks.
            if k is None or (op.type == 'ReadVariableOp' and not op.device):
                continue
            seen.add((k, part))
            self.assertEqual(tf.DeviceSpec.from_string(op.device).device_index, k,
                             f'{op.name} ({op.type}) is on {op.device!r}')
        for k in range(2):
            for part in ('fwd', 'bwd'):
                self.assertIn((k, part), seen)


class SaveLoadTest(TempDirTest):
    """Saved models and weights load back to identical predictions."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.model, cls.x, cls.y = FittedModel()
        cls.predictions = cls.model.predict(cls.x, batch_size=BATCH, verbose=0)

    def Predict(self, model):
        return model.predict(self.x, batch_size=BATCH, verbose=0)

    def testKerasFileRoundTrip(self):
        path = os.path.join(self.dir, 'model.keras')
        self.model.save(path)
        loaded = keras.models.load_model(path)
        pipeline = Parts(loaded)[1]
        self.assertIsInstance(pipeline, Pipeline)
        self.assertEqual(pipeline.params, Parts(self.model)[1].params)
        for got, want in zip(Values(loaded), Values(self.model)):
            self.assertAllEqual(got, want)
        self.assertAllEqual(self.Predict(loaded), self.predictions)
        # Compiled, with the optimizer's state, and its pipeline's weights train.
        self.assertEqual(int(loaded.optimizer.iterations.numpy()), 2)
        before = [w.numpy() for w in pipeline.trainable_weights]
        loaded.fit(self.x, self.y, batch_size=BATCH, epochs=1, verbose=0)
        for weight, old in zip(pipeline.trainable_weights, before):
            self.assertGreater(float(np.abs(weight.numpy() - old).max()), 0.0, weight.path)

    def testSaveWeightsRoundTrip(self):
        path = os.path.join(self.dir, 'model.weights.h5')
        self.model.save_weights(path)
        fresh = MakeModel(seed=5)  # Other initial values, the pipeline's too (another name).
        self.assertNotAllClose(self.Predict(fresh), self.predictions)
        fresh.load_weights(path)
        self.assertAllEqual(self.Predict(fresh), self.predictions)

    def testWeightsLoadIntoAnotherPartition(self):
        path = os.path.join(self.dir, 'model.weights.h5')
        self.model.save_weights(path)
        other = MakeModel(MakePipeline(num_cells=3, num_micro_batches=4))
        other.load_weights(path)
        self.assertAllClose(self.Predict(other), self.predictions, rtol=1e-6)

    def testConfigNamingCodeOutsideThePackageIsRefused(self):
        marker = test_utils.PlantModule(self, self.dir, 'planted_mod',
                                        'class Evil:\n    pass\n')
        path = os.path.join(self.dir, 'model.keras')
        self.model.save(path)
        tampered = os.path.join(self.dir, 'tampered.keras')
        test_utils.TamperKerasFile(self, path, tampered,
                                   'type/gpipe_tf.layers.basic/DenseLayer',
                                   'type/planted_mod/Evil')
        with self.assertRaisesRegex(errors.ConfigError,
                                    'type/planted_mod/Evil is not allowed in Params text'):
            keras.models.load_model(tampered)
        self.assertFalse(os.path.exists(marker))
        self.assertNotIn('planted_mod', sys.modules)


class CallbacksTest(TempDirTest):
    """ModelCheckpoint, TensorBoard and EarlyStopping in a short fit."""

    def testCheckpointTensorBoardAndEarlyStopping(self):
        model = Compile(MakeModel())
        x, y = Data(2 * BATCH)
        checkpoint = os.path.join(self.dir, 'epoch_{epoch}.keras')
        logs = os.path.join(self.dir, 'logs')
        history = model.fit(x, y, batch_size=BATCH, epochs=5, verbose=0, callbacks=[
            keras.callbacks.ModelCheckpoint(checkpoint),
            keras.callbacks.TensorBoard(logs),
            # No epoch improves the loss by 1e9: training stops after the second.
            keras.callbacks.EarlyStopping(monitor='loss', patience=0, min_delta=1e9)])
        self.assertLen(history.history['loss'], 2)
        self.assertEqual(sorted(os.listdir(self.dir)),
                         ['epoch_1.keras', 'epoch_2.keras', 'logs'])
        last = keras.models.load_model(os.path.join(self.dir, 'epoch_2.keras'))
        self.assertAllEqual(last.predict(x, batch_size=BATCH, verbose=0),
                            model.predict(x, batch_size=BATCH, verbose=0))
        events = [f for f in test_utils.FileNames(os.path.join(logs, 'train'))
                  if f.startswith('events.out.tfevents')]
        self.assertNotEmpty(events)


class JitCompileTest(tf.test.TestCase):
    """XLA compiles a pipeline on one device; one on several runs without it, never a deep
    TensorFlow error."""

    def Fit(self, model, **compile_kwargs):
        Compile(model, **compile_kwargs)
        x, y = Data(2 * BATCH)
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        return Values(model)

    def testJitCompileOnOneDeviceMatchesWithout(self):
        one_device = lambda: MakePipeline(devices=[DEVICES[0]] * 2, name='pipe')
        model = MakeModel(one_device())
        self.assertTrue(model.layers[1].supports_jit)
        got = self.Fit(model, jit_compile=True)
        self.assertTrue(model.jit_compile)
        want = self.Fit(MakeModel(one_device()), jit_compile=False)
        self.assertLess(test_utils.MaxRelativeError(got, want), TOLERANCE)

    def testSeveralDevicesFallBackToNoXla(self):
        model = MakeModel(MakePipeline(name='pipe'))
        self.assertFalse(model.layers[1].supports_jit)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            got = self.Fit(model, jit_compile=True)
        self.assertFalse(model.jit_compile)
        self.assertTrue(any('jit_compile' in str(w.message) for w in caught))
        default = MakeModel(MakePipeline(name='pipe'))
        want = self.Fit(default)  # jit_compile='auto'.
        self.assertFalse(default.jit_compile)
        self.assertLess(test_utils.MaxRelativeError(got, want), TOLERANCE)

    def testXlaAroundSeveralDevicesIsAClearError(self):
        model = MakeModel()
        x, _ = Data()
        with self.assertRaisesRegex(errors.ConfigError,
                                    r'cells are on 2 devices .*jit_compile=False'):
            tf.function(lambda x: model(x, training=True), jit_compile=True,
                        autograph=False)(x)


@pytest.mark.unit
class ErrorsTest(tf.test.TestCase):
    """A mistake is one readable ConfigError saying what was wrong and what is expected."""

    def testNotParams(self):
        with self.assertRaisesRegex(errors.ConfigError,
                                    r'takes PipeliningLayer Params .*got int 42\. For a list'):
            Pipeline(42)

    def testALayersParams(self):
        with self.assertRaisesRegex(errors.ConfigError, r'got Params of DenseLayer'):
            Pipeline(basic.DenseLayer.Params().Set(input_dim=DIM, output_dim=DIM))

    def testAListOfLayersPointsToFromLayers(self):
        with self.assertRaisesRegex(errors.ConfigError,
                                    r'got a list of 6 items\. .*Pipeline\.FromLayers\('):
            Pipeline(Layers())

    def testFromLayersWithSomethingElseThanLayerParams(self):
        with self.assertRaisesRegex(errors.ConfigError, r'layers\[1\] is str \'dense\''):
            Pipeline.FromLayers([Layers()[0], 'dense'], 1, M)

    def testFromLayersWithZeroCells(self):
        with self.assertRaisesRegex(errors.ConfigError,
                                    r'num_cells must be a positive integer, got 0'):
            Pipeline.FromLayers(Layers(), 0, M)

    def testScheduleThatNeedsTheLossInside(self):
        p = MakePipeline().params.Copy().Set(name='pipe', schedule='1f1b')
        with self.assertRaisesRegex(errors.ConfigError, r"schedule '1f1b' .*schedule=\"gpipe\""):
            Pipeline(p)

    def testAScheduleThatIsNoneIsNamedAsSuch(self):
        # Not taken for a schedule that would need the loss inside the pipeline.
        p = MakePipeline().params.Copy().Set(name='pipe', schedule='zb')
        with self.assertRaisesRegex(errors.ConfigError,
                                    r"^gpipe_tf\.keras\.Pipeline: schedule must be one of "
                                    r"\('gpipe', .*got 'zb'\.$"):
            Pipeline(p)

    def testDtypeOtherThanTheParams(self):
        with self.assertRaisesRegex(errors.ConfigError, r'set params\.dtype instead'):
            MakePipeline(dtype='float64')

    def testInputOfTheWrongWidth(self):
        with self.assertRaisesRegex(errors.ConfigError,
                                    r'an input of shape \(None, 5\) does not fit the pipeline'):
            keras.Sequential([keras.Input((5,)), MakePipeline()])

    def testUnderADistributionStrategy(self):
        with tf.distribute.OneDeviceStrategy(DEVICES[0]).scope():
            with self.assertRaisesRegex(errors.ConfigError,
                                        r'does not run under a tf\.distribute strategy'):
                MakePipeline()

    def testConfigWithoutParamsText(self):
        with self.assertRaisesRegex(errors.ConfigError, r'"params" must be Params text'):
            Pipeline.from_config({'name': 'pipeline'})

    def testConfigOfAnotherLayer(self):
        text = pipelining_layer.PipeliningLayer.Params().ToText().replace(
            'type/gpipe_tf.pipeline.pipelining_layer/PipeliningLayer',
            'type/gpipe_tf.layers.basic/DenseLayer')
        with self.assertRaisesRegex(errors.ConfigError, r'got Params of DenseLayer'):
            Pipeline.from_config({'name': 'pipeline', 'params': text})


if __name__ == '__main__':
    tf.test.main()
