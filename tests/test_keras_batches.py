"""gpipe_tf.keras.Sequential on batches of any size: a batch of one example or more, fewer than
M or not divided by M, static or known only when the step runs, trains and infers as
keras.Sequential on the same weights, in every entry point (predict, evaluate, fit with a short
last batch, train_on_batch, test_on_batch, model(x)), with every schedule, unrolled and looped;
no layer ever runs on zero examples; an embedding's gradient reaches the optimizer as the
tf.IndexedSlices keras.Sequential gives it, so stateful optimizers give keras.Sequential's
weights too.

The oracle is Keras alone: keras.Sequential of copies of the layers (from their configs, with
the same weights), or, for batch norm in training, the layer objects called in sequence on each
micro-batch. Values are compared normwise over all of them together (`assertNormClose`).
"""

import collections
import re

import keras
import numpy as np
import tensorflow as tf

from gpipe_tf import test_utils
from gpipe_tf.keras import Pipeline
from gpipe_tf.keras import Sequential

DEVICES = test_utils.ConfigureVirtualCpus()
M = 4
TOLERANCE = 1e-5
# What a difference is compared against where the oracle's values are (near) zero: a relative
# bound on nothing would demand bit-identical results.
FLOOR = 1e-7

SCHEDULES = [('gpipe', {}), ('1f1b', {}), ('interleaved_1f1b', {'virtual_stages': 2}),
             ('zero_bubble', {'recompute': 'never'}), ('zero_bubble', {}),
             ('zero_bubble_v', {'virtual_stages': 2, 'recompute': 'never'})]


# ---- layers -----------------------------------------------------------------------------------
@keras.saving.register_keras_serializable(package='test_keras_batches')
class NonEmpty(keras.layers.Layer):
    """The identity, which fails when it runs on a batch of no example."""

    def call(self, x):
        check = tf.debugging.assert_positive(tf.shape(x)[0], message='empty micro-batch')
        with tf.control_dependencies([check]):
            return tf.identity(x)

    def compute_output_shape(self, input_shape):
        return input_shape


def ConvNet():
    """For 8x8x1 inputs: Conv2D, Conv2D, MaxPooling2D, Flatten, Dense."""
    return [keras.layers.Conv2D(4, 3, padding='same', activation='relu'),
            keras.layers.Conv2D(4, 3, activation='relu'), keras.layers.MaxPooling2D(),
            keras.layers.Flatten(), keras.layers.Dense(3)]


def BatchNormConvNet():
    """ConvNet with BatchNormalization after its first convolution."""
    layers = ConvNet()
    return layers[:1] + [keras.layers.BatchNormalization(momentum=0.9)] + layers[1:]


def DenseStack():
    """4 Dense layers: enough for v K = 4 cells (virtual_stages=2)."""
    return [keras.layers.Dense(8, activation='tanh') for _ in range(3)] + [keras.layers.Dense(2)]


def EmbeddingNet():
    return [keras.layers.Embedding(40, 8), keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(8, activation='tanh'), keras.layers.Dense(3)]


# ---- models -----------------------------------------------------------------------------------
def Copies(layers):
    """Unbuilt copies of `layers`, from their configs: the oracle's own layers."""
    return [type(layer).from_config(layer.get_config()) for layer in layers]


def Pipelined(layers, input_shape, optimizer, loss='mse', schedule='1f1b', **params):
    """A gpipe_tf.keras.Sequential of `layers` (K=2, M=4), built and compiled."""
    model = Sequential(layers, num_cells=2, num_micro_batches=M, input_shape=input_shape,
                       devices=DEVICES[:2], schedule=schedule, **params)
    model.build((None,) + tuple(input_shape))
    model.compile(optimizer(), loss)
    return model


def Reference(layers, input_shape, optimizer, loss='mse', input_dtype='float32'):
    """keras.Sequential of copies of the built `layers` with their weights, compiled."""
    reference = keras.Sequential([keras.Input(input_shape, dtype=input_dtype)] +
                                 Copies(layers))
    for layer, copy in zip(layers, reference.layers):
        copy.set_weights(layer.get_weights())
    reference.compile(optimizer(), loss)
    return reference


def Models(layers, input_shape, optimizer, loss='mse', input_dtype='float32', **params):
    """(`Pipelined(layers, ...)`, `Reference(layers, ...)`), each with its own
    `optimizer()`."""
    model = Pipelined(layers, input_shape, optimizer, loss, **params)
    return model, Reference(layers, input_shape, optimizer, loss, input_dtype)


def Sgd():
    return keras.optimizers.SGD(0.1)


def ConvModels():
    """`Models` of a ConvNet, from seed 0, with SGD."""
    keras.utils.set_random_seed(0)
    return Models(ConvNet(), (8, 8, 1), Sgd)


def Weights(layers):
    """The values of the layers' weights, in order."""
    return [w for layer in layers for w in layer.get_weights()]


def Images(num_examples, seed=1):
    rng = np.random.RandomState(seed)
    return (rng.randn(num_examples, 8, 8, 1).astype(np.float32),
            rng.randn(num_examples, 3).astype(np.float32))


def Vectors(num_examples, seed=2):
    rng = np.random.RandomState(seed)
    return (rng.randn(num_examples, 6).astype(np.float32),
            rng.randn(num_examples, 2).astype(np.float32))


def Tokens(num_examples, seed=3):
    rng = np.random.RandomState(seed)
    # Few distinct ids: micro-batches read the same rows, which a sparse update must sum.
    return (rng.randint(0, 12, size=(num_examples, 5)).astype(np.int32),
            rng.randn(num_examples, 3).astype(np.float32))


def Batches(x, y, sizes):
    """A tf.data.Dataset of the consecutive batches of (x, y) of the given sizes, whose batch
    dimension is unknown (None): Keras traces one step for all of them, of a batch known only
    when the step runs."""
    starts = np.cumsum([0] + list(sizes))
    signature = tuple(tf.TensorSpec((None,) + a.shape[1:], a.dtype) for a in (x, y))
    dataset = tf.data.Dataset.from_generator(
        lambda: ((x[a:b], y[a:b]) for a, b in zip(starts[:-1], starts[1:])),
        output_signature=signature)
    # Of a known length, so that Keras runs no step past the end: one whose input runs out
    # stops midway, after the optimizer's weight decay (which reads no input) has run on
    # some weights but maybe not others.
    return dataset.apply(tf.data.experimental.assert_cardinality(len(sizes)))


class BatchLosses(keras.callbacks.Callback):
    """The loss Keras reports after each training batch (its mean over the epoch so far)."""

    def __init__(self):
        super().__init__()
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs['loss']))


def FitLosses(model, *args, **kwargs):
    """`model.fit(*args, **kwargs)`'s loss after each batch."""
    losses = BatchLosses()
    model.fit(*args, verbose=0, shuffle=False, callbacks=[losses], **kwargs)
    return losses.losses


def Flat(values) -> np.ndarray:
    """Every array of a nest, dense, as one float64 vector."""
    parts = []
    for value in tf.nest.flatten(values):
        if isinstance(value, tf.IndexedSlices):
            value = tf.convert_to_tensor(value)
        parts.append(np.ravel(np.asarray(value, np.float64)))
    return np.concatenate(parts)


class NormTestCase(tf.test.TestCase):
    """assertNormClose: the comparison of every test here."""

    def assertNormClose(self, expected, actual, msg=None):
        """||actual - expected|| / ||expected|| <= TOLERANCE over every array of the two nests
        concatenated (IndexedSlices made dense), or the difference within FLOOR for an
        expected value of norm below FLOOR / TOLERANCE."""
        want, got = Flat(expected), Flat(actual)
        self.assertEqual(want.shape, got.shape, msg)
        self.assertTrue(np.isfinite(got).all(), msg)
        error, scale = np.linalg.norm(got - want), np.linalg.norm(want)
        self.assertLessEqual(error, max(TOLERANCE * scale, FLOOR),
                             f'{msg or ""}: |a - b| = {error:.3g}, |b| = {scale:.3g}')


# ---- a conv net, without and with batch norm --------------------------------------------------
def WithMovingStatistics(layers, seed=4):
    """Sets the built `layers`' batch norms' statistics and scales to values far from their
    initial ones (mean 0, variance 1), so that inference depends on them."""
    rng = np.random.RandomState(seed)
    for layer in layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            gamma, beta, mean, variance = layer.get_weights()
            layer.set_weights([1.0 + 0.3 * rng.randn(*gamma.shape), 0.3 * rng.randn(*beta.shape),
                               rng.randn(*mean.shape), 0.5 + rng.rand(*variance.shape)])


class ConvNetInferenceTest(NormTestCase):
    """Inference on batches of fewer examples than M, or not divided by M, equals
    keras.Sequential's (one model for all: inference changes no weight)."""

    LAYERS = staticmethod(ConvNet)

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        keras.utils.set_random_seed(0)
        layers = cls.LAYERS()
        cls.model = Pipelined(layers, (8, 8, 1), Sgd)
        WithMovingStatistics(layers)
        cls.reference = Reference(layers, (8, 8, 1), Sgd)
        cls.x, cls.y = Images(5)

    def testPredictOnOneTwoThreeAndFiveExamples(self):
        for n in (1, 2, 3, 5):
            with self.subTest(examples=n):
                self.assertNormClose(self.reference.predict(self.x[:n], verbose=0),
                                     self.model.predict(self.x[:n], verbose=0))

    def testEvaluateOnOneAndThreeExamples(self):
        for n in (1, 3):
            with self.subTest(examples=n):
                self.assertNormClose(self.reference.evaluate(self.x[:n], self.y[:n], verbose=0),
                                     self.model.evaluate(self.x[:n], self.y[:n], verbose=0))

    def testTestOnBatchOfThreeExamples(self):
        self.assertNormClose(self.reference.test_on_batch(self.x[:3], self.y[:3]),
                             self.model.test_on_batch(self.x[:3], self.y[:3]))

    def testCallOnThreeExamples(self):
        self.assertNormClose(self.reference(self.x[:3]), self.model(self.x[:3]))


class BatchNormConvNetInferenceTest(ConvNetInferenceTest):
    """The same with batch norm: in inference it normalises with its moving statistics, so
    keras.Sequential is the oracle on any batch."""

    LAYERS = staticmethod(BatchNormConvNet)


class ConvNetTrainingTest(NormTestCase):

    def testFitWithAShortLastBatchGivesKerasSequentialsLossesAndWeights(self):
        # Batches of 32 and 3: Keras traces the second with an unknown batch, which leaves one
        # of the M=4 micro-batches empty.
        x, y = Images(35)
        model, reference = ConvModels()
        losses = [FitLosses(m, x, y, batch_size=32) for m in (model, reference)]
        self.assertLen(losses[0], 2)
        self.assertNormClose(losses[1], losses[0], 'losses')
        self.assertNormClose(Weights(reference.layers), Weights(model.pipeline.keras_layers),
                             'weights')

    def testTrainOnBatchOfOneThenThreeExamplesGivesKerasSequentialsWeights(self):
        x, y = Images(4)
        model, reference = ConvModels()
        for batch in (slice(0, 1), slice(1, 4)):
            with self.subTest(examples=batch.stop - batch.start):
                losses = [m.train_on_batch(x[batch], y[batch]) for m in (model, reference)]
                self.assertNormClose(losses[1], losses[0], 'loss')
                self.assertNormClose(Weights(reference.layers),
                                     Weights(model.pipeline.keras_layers), 'weights')


class PipelineInAKerasModelTest(NormTestCase):
    """`Pipeline.FromKeras` as one layer of a keras.Sequential (gpipe schedule, Keras's loss
    after it) on batches smaller than M: as the same layers without the pipeline."""

    def setUp(self):
        super().setUp()
        keras.utils.set_random_seed(0)
        layers = ConvNet()
        pipe = Pipeline.FromKeras(layers[:-1], num_cells=2, num_micro_batches=M,
                                  input_shape=(8, 8, 1), devices=DEVICES[:2])
        head = layers[-1]
        self.model = keras.Sequential([keras.Input((8, 8, 1)), pipe, head])
        self.reference = keras.Sequential([keras.Input((8, 8, 1))] + Copies(layers))
        for layer, copy in zip(pipe.keras_layers + [head], self.reference.layers):
            copy.set_weights(layer.get_weights())
        for m in (self.model, self.reference):
            m.compile(Sgd(), 'mse')
        self.layers = pipe.keras_layers + [head]

    def testPredictOnOneAndThreeExamples(self):
        x, _ = Images(3)
        for n in (1, 3):
            self.assertNormClose(self.reference.predict(x[:n], verbose=0),
                                 self.model.predict(x[:n], verbose=0), f'{n} examples')

    def testFitWithAShortLastBatchAndTrainOnBatchOfOne(self):
        x, y = Images(35)
        losses = [FitLosses(m, x, y, batch_size=32) for m in (self.model, self.reference)]
        self.assertNormClose(losses[1], losses[0], 'losses')
        losses = [m.train_on_batch(x[:1], y[:1]) for m in (self.model, self.reference)]
        self.assertNormClose(losses[1], losses[0], 'train_on_batch loss')
        self.assertNormClose(Weights(self.reference.layers), Weights(self.layers), 'weights')


class BatchNormConvNetTrainingTest(NormTestCase):

    def testOneStepOnThreeExamplesIsTheLayersInSequencePerMicroBatch(self):
        # Three micro-batches of one example for a static batch; four, one of them empty and
        # skipped, for a batch known only when the step runs. Either adds the same.
        x, y = Images(3)
        for batch in ('static', 'unknown'):
            with self.subTest(batch=batch):
                keras.utils.set_random_seed(0)
                layers = BatchNormConvNet()
                model = Pipelined(layers, (8, 8, 1), Sgd)
                WithMovingStatistics(layers)
                loss, trainable, non_trainable = test_utils.KerasSgdStepInSequence(
                    layers, x, y, 0.1, M)
                if batch == 'static':
                    got = model.train_on_batch(x, y)
                else:
                    got, = FitLosses(model, Batches(x, y, [3]))
                self.assertNormClose(loss, got, 'loss')
                self.assertNormClose(trainable, [w.numpy() for layer in layers
                                                 for w in layer.trainable_weights], 'weights')
                self.assertNormClose(non_trainable, [w.numpy() for layer in layers
                                                     for w in layer.non_trainable_weights],
                                     'moving statistics')


# ---- every schedule, unrolled and looped ------------------------------------------------------
class ScheduleMatrixTest(NormTestCase):

    def testFitOnBatchesOfAnySizeGivesKerasSequentialsLossesAndWeights(self):
        # Batches of 1, 2, M-1, M+1, 2M and a partial last one of 7, of a batch unknown when
        # the step is traced: micro-batches empty, uneven and even.
        x, y = Vectors(26)
        data = Batches(x, y, [1, 2, 3, 5, 8, 7])
        keras.utils.set_random_seed(0)
        reference = keras.Sequential([keras.Input((6,))] + DenseStack())
        reference.compile(Sgd(), 'mse')
        initial = [layer.get_weights() for layer in reference.layers]
        expected_losses = FitLosses(reference, data)
        self.assertLen(expected_losses, 6)
        for schedule, params in SCHEDULES:
            for unroll in (True, False):
                with self.subTest(schedule=schedule, unroll=unroll, **params):
                    model = Pipelined(DenseStack(), (6,), Sgd, schedule=schedule,
                                      unroll=unroll, **params)
                    for layer, values in zip(model.pipeline.keras_layers, initial):
                        layer.set_weights(values)
                    self.assertNormClose(expected_losses, FitLosses(model, data), 'losses')
                    self.assertNormClose(Weights(reference.layers),
                                         Weights(model.pipeline.keras_layers), 'weights')


# ---- an embedding's sparse gradient -----------------------------------------------------------
class RecordingSgd(keras.optimizers.SGD):
    """SGD that records the gradient it is given for one weight: its type when the step is
    traced, its dense value when the step runs (into `value`, a variable the test makes)."""

    def __init__(self, watched, value, **kwargs):
        super().__init__(**kwargs)
        self._watched = watched
        self._value = value
        self.types = []

    def apply_gradients(self, grads_and_vars):
        grads_and_vars = list(grads_and_vars)
        for grad, variable in grads_and_vars:
            if variable is self._watched:
                self.types.append(type(grad))
                self._value.assign(tf.convert_to_tensor(grad))
        return super().apply_gradients(grads_and_vars)


class EmbeddingTest(NormTestCase):
    """An embedding's gradient reaches the optimizer as tf.IndexedSlices, as keras.Sequential
    gives it, so optimizers whose sparse update differs from their dense one give
    keras.Sequential's weights."""

    # Each optimizer with another pipeline: unrolled and looped, recompute always and never,
    # a backward split in two (zero_bubble).
    CASES = [
        ('sgd', lambda: keras.optimizers.SGD(0.1),
         dict(schedule='gpipe', recompute='always', unroll=True)),
        ('sgd_momentum', lambda: keras.optimizers.SGD(0.1, momentum=0.9),
         dict(schedule='1f1b', unroll=False)),
        ('adam', lambda: keras.optimizers.Adam(0.01),
         dict(schedule='zero_bubble', recompute='never', unroll=True)),
        ('adamw', lambda: keras.optimizers.AdamW(0.01),
         dict(schedule='1f1b', recompute='never', unroll=True)),
        ('adagrad', lambda: keras.optimizers.Adagrad(0.1),
         dict(schedule='zero_bubble', unroll=False)),
    ]

    def testEveryOptimizerGivesKerasSequentialsWeights(self):
        # Batches of 4, 4 and a partial 3, of a batch unknown when traced.
        data = Batches(*Tokens(11), [4, 4, 3])
        for name, optimizer, params in self.CASES:
            with self.subTest(optimizer=name, **params):
                keras.utils.set_random_seed(0)
                model, reference = Models(EmbeddingNet(), (5,), optimizer,
                                          input_dtype='int32', **params)
                losses = [FitLosses(m, data) for m in (model, reference)]
                self.assertLen(losses[0], 3)
                self.assertNormClose(losses[1], losses[0], 'losses')
                self.assertNormClose(Weights(reference.layers),
                                     Weights(model.pipeline.keras_layers), 'weights')

    def testTheOptimizerGetsIndexedSlicesOfKerasSequentialsGradient(self):
        x, y = Tokens(3)
        for batch in ('static', 'unknown'):
            with self.subTest(batch=batch):
                keras.utils.set_random_seed(0)
                layers = EmbeddingNet()
                table = tf.Variable(tf.zeros([40, 8]), trainable=False)
                model = Pipelined(layers, (5,), lambda: RecordingSgd(
                    layers[0].embeddings, table, learning_rate=0.1))
                reference = Reference(layers, (5,), Sgd, input_dtype='int32')
                with tf.GradientTape() as tape:
                    loss = reference.compute_loss(x, y, reference(x, training=True),
                                                  training=True)
                expected = tape.gradient(loss, reference.layers[0].embeddings)
                self.assertIsInstance(expected, tf.IndexedSlices)
                if batch == 'static':
                    model.train_on_batch(x, y)
                else:
                    FitLosses(model, Batches(x, y, [3]))
                self.assertEqual(list(model.optimizer.types), [tf.IndexedSlices])
                self.assertNormClose(expected, table.numpy())


# ---- no empty micro-batch reaches a layer -----------------------------------------------------
def CellForwardCalls(graph) -> collections.Counter:
    """(cell, micro-batch) -> the number of calls of the cell's forward function in `graph`."""
    calls = collections.Counter()
    for op in graph.get_operations():
        match = re.match(r'cell_(\d+)_mb_(\d+)_fwd/', op.name)
        if match and op.type in ('PartitionedCall', 'StatefulPartitionedCall'):
            calls[int(match[1]), int(match[2])] += 1
    return calls


class NoEmptyMicroBatchTest(NormTestCase):

    def testTheCheckFailsOnNoExample(self):
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError, 'empty micro-batch'):
            NonEmpty()(tf.zeros([0, 8]))

    def testNoLayerRunsOnNoExampleOfThreeInEveryEntryPoint(self):
        # A check in each cell; three examples at M=4, static (train_on_batch, predict's first
        # call) and known only when the step runs (tf.data), unrolled and looped.
        x, y = Vectors(3)
        data = Batches(x, y, [3])
        for unroll in (True, False):
            with self.subTest(unroll=unroll):
                keras.utils.set_random_seed(0)
                model = Pipelined([keras.layers.Dense(8, activation='tanh'), NonEmpty(),
                                   keras.layers.Dense(2), NonEmpty()], (6,), Sgd,
                                  balance=[2, 2], unroll=unroll)
                model.train_on_batch(x, y)
                model.fit(data, verbose=0, shuffle=False)
                model.predict(x, verbose=0)
                model.predict(data.map(lambda x, y: x), verbose=0)

    def testAStaticBatchOfThreeRunsEachCellOnThreeMicroBatches(self):
        keras.utils.set_random_seed(0)
        model = Pipelined(DenseStack(), (6,), Sgd, unroll=True)
        model.optimizer.build(model.trainable_variables)
        step = tf.function(lambda x, y: model.train_step((x, y)))
        graph = step.get_concrete_function(tf.TensorSpec([3, 6]), tf.TensorSpec([3, 2])).graph
        self.assertEqual(CellForwardCalls(graph),
                         {(k, m): 1 for k in range(2) for m in range(3)})


if __name__ == '__main__':
    tf.test.main()
