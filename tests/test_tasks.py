"""Tests of the tasks and the training programs around them: weighted-mean metrics, the
classifier's and the sequence tasks' metrics and weighting, weight decay, gradient clipping and
the update (gpipe_tf.train.update), SyncInputShapes, the eager and v1-graph training programs
(losses, checkpoints across programs and modes, evaluation) and greedy decoding."""

import functools
import re
import shutil
import tempfile

import numpy as np
import tensorflow as tf

from gpipe_tf import errors
from gpipe_tf import hyperparams
from gpipe_tf import model_registry
from gpipe_tf import optimizer
from gpipe_tf import test_utils
from gpipe_tf.input import base_input
from gpipe_tf.layers import basic
from gpipe_tf.layers import fprop_context
from gpipe_tf.models.transformer import network as transformer_model
from gpipe_tf.nested_map import NestedMap
from gpipe_tf.pipeline import pipelining_layer
from gpipe_tf.tasks import base_task
from gpipe_tf.tasks import classifier
from gpipe_tf.tasks import sequence
from gpipe_tf.train import program
from gpipe_tf.train import update

DEVICES = test_utils.ConfigureVirtualCpus()

MLP = 'examples.PipelinedMLP'
MT = 'mt.multilingual.TransformerTiny'
LM = 'lm.TransformerLTiny'
EOS_ID = 2


def _ClassTempDir(test_class):
    path = tempfile.mkdtemp()
    test_class.addClassCleanup(shutil.rmtree, path, ignore_errors=True)
    return path


def _Xent(logits, labels):
    logits = np.asarray(logits, np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    return -np.take_along_axis(log_probs, np.asarray(labels)[:, None], -1)[:, 0]


def _Numpy(nest):
    return tf.nest.map_structure(lambda x: np.asarray(x), nest)


# ---- WeightedMean -------------------------------------------------------------------------------
class WeightedMeanTest(tf.test.TestCase):

    def testMeanAndTotalWeight(self):
        mean, total = base_task.WeightedMean(tf.constant([1.0, 2.0, 3.0, 4.0]),
                                             tf.constant([1.0, 0.0, 2.0, 1.0]))
        self.assertAllClose(mean, (1.0 + 6.0 + 4.0) / 4.0)
        self.assertAllClose(total, 4.0)

    def testZeroWeightsIgnoreTheirValuesEvenNonFinite(self):
        values = tf.constant([1.0, 1e30, 3.0])
        mean, total = base_task.WeightedMean(values, tf.constant([1.0, 0.0, 1.0]))
        self.assertAllClose(mean, 2.0)
        self.assertAllClose(total, 2.0)

    def testAllZeroWeightsGiveZeroNotNan(self):
        mean, total = base_task.WeightedMean(tf.constant([5.0, 7.0]), tf.zeros([2]))
        self.assertAllEqual([mean, total], [0.0, 0.0])

    def testTwoDimensionalTokenWeights(self):
        values = tf.constant([[1.0, 2.0], [3.0, 4.0]])
        weights = tf.constant([[1.0, 1.0], [0.0, 2.0]])
        mean, total = base_task.WeightedMean(values, weights)
        self.assertAllClose(mean, (1.0 + 2.0 + 8.0) / 4.0)
        self.assertAllClose(total, 4.0)


# ---- ClassifierTask -----------------------------------------------------------------------------
def _DenseClassifierParams(input_dim=4, num_classes=3, **train):
    p = classifier.ClassifierTask.Params().Set(
        name='cls', flatten_images=True,
        model=basic.DenseLayer.Params().Set(name='dense', input_dim=input_dim,
                                            output_dim=num_classes))
    p.train.Set(**train)
    return p


class ClassifierTaskTest(tf.test.TestCase):

    LOGITS = np.array([[2.0, 0.5, -1.0], [0.1, 0.2, 0.3], [1.0, 3.0, 0.0], [0.0, 0.0, 5.0]],
                      np.float32)
    LABELS = np.array([0, 2, 0, 2], np.int32)  # Rows 0, 1 and 3 are right; row 2 is wrong.

    def setUp(self):
        super().setUp()
        self.task = _DenseClassifierParams().Instantiate()

    def _Metrics(self, logits, labels, weights):
        batch = NestedMap(labels=tf.constant(labels), weights=tf.constant(weights, tf.float32))
        return _Numpy(self.task.ComputeMetrics(batch, tf.constant(logits)))

    def testMetricsOfLogits(self):
        metrics = self._Metrics(self.LOGITS, self.LABELS, [1.0, 1.0, 1.0, 1.0])
        xent = _Xent(self.LOGITS, self.LABELS)
        self.assertAllClose(metrics.loss, (xent.mean(), 4.0))
        self.assertAllClose(metrics.log_loss, (xent.mean(), 4.0))
        self.assertAllClose(metrics.accuracy, (0.75, 4.0))

    def testExampleWeightsWeighTheMeans(self):
        weights = np.array([2.0, 1.0, 1.0, 0.5], np.float32)
        metrics = self._Metrics(self.LOGITS, self.LABELS, weights)
        xent = _Xent(self.LOGITS, self.LABELS)
        self.assertAllClose(metrics.loss, ((xent * weights).sum() / 4.5, 4.5))
        self.assertAllClose(metrics.accuracy, (3.5 / 4.5, 4.5))

    def testPaddingRowsWithWeightZeroChangeNothing(self):
        real = self._Metrics(self.LOGITS, self.LABELS, [1.0] * 4)
        # Padding rows: a confident wrong answer and a huge logit.
        logits = np.concatenate([self.LOGITS, [[0.0, 50.0, 0.0], [1e4, 0.0, 0.0]]])
        labels = np.concatenate([self.LABELS, [0, 1]]).astype(np.int32)
        padded = self._Metrics(logits.astype(np.float32), labels, [1.0] * 4 + [0.0, 0.0])
        for name in ('loss', 'accuracy', 'log_loss'):
            self.assertAllClose(padded[name], real[name], msg=name)

    def testModelNestedMapOutputsGiveTheLossWhileLogLossIsPlainCrossEntropy(self):
        # A head's NestedMap (AmoebaNet's: label smoothing, aux head) supplies the loss.
        per_example_loss = np.array([0.5, 1.5, 2.5, 3.5], np.float32)
        outputs = NestedMap(logits=tf.constant(self.LOGITS),
                            per_example_loss=tf.constant(per_example_loss),
                            correct=tf.constant([1.0, 1.0, 0.0, 1.0]))
        batch = NestedMap(labels=tf.constant(self.LABELS),
                          weights=tf.constant([1.0, 1.0, 1.0, 0.0]))
        metrics = _Numpy(self.task.ComputeMetrics(batch, outputs))
        self.assertAllClose(metrics.loss, (1.5, 3.0))
        self.assertAllClose(metrics.accuracy, (2.0 / 3.0, 3.0))
        self.assertAllClose(metrics.log_loss, (_Xent(self.LOGITS, self.LABELS)[:3].mean(), 3.0))

    def testFPropTowerRunsTheModelOnFlattenedImages(self):
        rng = np.random.RandomState(0)
        images = rng.standard_normal([4, 2, 2, 1]).astype(np.float32)
        self.task.model.vars.w.assign(rng.standard_normal([4, 3]).astype(np.float32))
        self.task.model.vars.b.assign([0.1, -0.2, 0.3])
        logits = images.reshape(4, 4) @ self.task.model.vars.w.numpy() + [0.1, -0.2, 0.3]
        weights = np.array([1.0, 1.0, 1.0, 0.0], np.float32)
        metrics = _Numpy(self.task.FPropTower(NestedMap(
            images=tf.constant(images), labels=tf.constant(self.LABELS),
            weights=tf.constant(weights))))
        xent = _Xent(logits, self.LABELS)
        self.assertAllClose(metrics.loss, (xent[:3].mean(), 3.0), rtol=1e-5)
        correct = np.argmax(logits, -1) == self.LABELS
        self.assertAllClose(metrics.accuracy, (correct[:3].mean(), 3.0))

    def testPredictGivesProbabilities(self):
        images = tf.random.stateless_normal([4, 2, 2, 1], [1, 2])
        probs = self.task.Predict(images).numpy()
        self.assertEqual(probs.shape, (4, 3))
        self.assertAllClose(probs.sum(-1), np.ones(4), rtol=1e-6)

    def testTaskWithoutModelIsAnError(self):
        with self.assertRaisesRegex(ValueError, 'p.model is None'):
            classifier.ClassifierTask.Params().Set(name='cls').Instantiate()


# ---- SequenceTask -------------------------------------------------------------------------------
def _IdentitySequenceTask(translation=True):
    return sequence.SequenceTask.Params().Set(
        name='seq', translation=translation,
        model=basic.IdentityLayer.Params().Set(name='id')).Instantiate()


class SequenceTaskMetricsTest(tf.test.TestCase):

    def testTokensWeighByTargetWeightsTimesExampleWeights(self):
        task = _IdentitySequenceTask()
        loss = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]], np.float32)
        correct = np.array([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]], np.float32)
        tgt_weights = np.array([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]], np.float32)
        example_weights = np.array([1.0, 2.0, 0.0], np.float32)
        outputs = NestedMap(per_example_loss=tf.constant(loss), correct=tf.constant(correct),
                            weight=tf.constant(tgt_weights))
        metrics = _Numpy(task.ComputeMetrics(
            NestedMap(weights=tf.constant(example_weights)), outputs))
        w = tgt_weights * example_weights[:, None]
        self.assertAllClose(metrics.loss, ((loss * w).sum() / w.sum(), w.sum()))
        self.assertAllClose(metrics.accuracy, ((correct * w).sum() / w.sum(), w.sum()))
        self.assertAllClose(metrics.num_tokens, (8.0, 1.0))
        # The example of weight 0 (a padding row) and the tokens of weight 0 count for nothing.
        self.assertAllClose(metrics.loss[0], (1 + 2 + 2 * (4 + 5 + 6)) / 8.0)

    def testLanguageModelFeedsTokenWeightsAsTheModelsWeights(self):
        task = _IdentitySequenceTask(translation=False)
        batch = NestedMap(ids=tf.ones([2, 3], tf.int32), paddings=tf.zeros([2, 3]),
                          labels=tf.ones([2, 3], tf.int32),
                          token_weights=tf.constant([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]),
                          weights=tf.constant([1.0, 0.0]))
        inputs = task.ModelInputs(batch)
        self.assertCountEqual(inputs.keys(), transformer_model.LM_INPUT_KEYS)
        self.assertAllEqual(inputs.weights, batch.token_weights)

    def testMissingInputKeysAreNamed(self):
        task = _IdentitySequenceTask()
        with self.assertRaisesRegex(ValueError, r"lacks \['tgt_labels', 'tgt_weights'\].*src_ids"):
            task.ModelInputs(NestedMap(
                src_ids=tf.ones([1, 2], tf.int32), src_paddings=tf.zeros([1, 2]),
                tgt_ids=tf.ones([1, 2], tf.int32), tgt_paddings=tf.zeros([1, 2])))

    def testLanguageModelCannotDecode(self):
        task = _IdentitySequenceTask(translation=False)
        with self.assertRaisesRegex(ValueError, 'language model'):
            task.Decode(np.ones([2, 3], np.int32), np.zeros([2, 3], np.float32))

    def testLanguageModelMetricsOnTheRegisteredTinyLm(self):
        p = model_registry.GetParams(LM, 'Train')
        p.input.Set(batch_size=4, num_examples_total=8)
        p.model.num_micro_batches = 2
        task = p.Instantiate()
        batch = next(iter(p.input.Instantiate().TrainDataset()))
        batch.weights = tf.constant([1.0, 0.0, 1.0, 1.0])
        with fprop_context.Scope(training=False):
            outputs = _Numpy(task.model(task.ModelInputs(batch)))
            metrics = _Numpy(task.FPropTower(batch))
        token_weights = batch.token_weights.numpy()
        w = token_weights * np.array([1.0, 0.0, 1.0, 1.0])[:, None]
        self.assertGreater(token_weights[1].sum(), 0)  # Row 1's tokens are dropped by its weight.
        self.assertAllClose(metrics.num_tokens[0], w.sum())
        self.assertAllClose(metrics.loss, ((outputs.per_example_loss * w).sum() / w.sum(),
                                           w.sum()), rtol=1e-5)
        self.assertAllClose(metrics.accuracy[0], (outputs.correct * w).sum() / w.sum(),
                            rtol=1e-5)


# ---- Weight decay, clipping, Update -------------------------------------------------------------
def _Batch(num_examples=4, seed=0):
    rng = np.random.RandomState(seed)
    return NestedMap(images=tf.constant(rng.standard_normal([num_examples, 2, 2, 1]),
                                        tf.float32),
                     labels=tf.constant(rng.randint(0, 3, [num_examples]), tf.int32),
                     weights=tf.ones([num_examples]))


def _RunUpdate(task, opt, batch, metrics_fn=None):
    """(global_step, Update's metrics as numpy) after one eager update."""
    global_step = tf.Variable(0, dtype=tf.int64, trainable=False)
    with tf.GradientTape() as tape:
        metrics = (metrics_fn or task.FPropTower)(batch)
        _, out = update.Update(task, opt, global_step, metrics,
                               lambda loss, variables: tape.gradient(loss, variables))
    return global_step, _Numpy(out)


class WeightDecayTest(tf.test.TestCase):

    def _Task(self, weight_decay, **kwargs):
        task = _DenseClassifierParams(weight_decay=weight_decay, **kwargs).Instantiate()
        task.model.vars.b.assign([0.5, -1.0, 2.0])  # Non-zero: biases must not be decayed.
        return task

    def testRegularizationLossIsHalfTheSumOfSquaresOfWeightsOnly(self):
        task = self._Task(0.1)
        w = task.model.vars.w.numpy()
        self.assertAllClose(task.RegularizationLoss(), 0.1 * 0.5 * np.sum(w ** 2), rtol=1e-6)

    def testRegularizationLossOverEveryRankTwoVariableOfAPipeline(self):
        p = model_registry.GetParams(MLP, 'Train')
        p.input.batch_size = 16
        p.model.num_micro_batches = 2
        p.train.weight_decay = 1e-3
        task = p.Instantiate()
        weights = [v.numpy() for v in task.trainable_variables if v.shape.rank >= 2]
        self.assertLen(weights, 4)
        self.assertAllClose(task.RegularizationLoss(),
                            1e-3 * 0.5 * sum(np.sum(w ** 2) for w in weights), rtol=1e-5)

    def testNoDecayIsZero(self):
        self.assertAllEqual(self._Task(0.0).RegularizationLoss(), 0.0)

    def testUpdateAddsTheDecayToTheLossAndItsGradientToTheWeights(self):
        decay, batch = 0.25, _Batch()
        task = self._Task(decay)
        w0, b0 = task.model.vars.w.numpy(), task.model.vars.b.numpy()
        with tf.GradientTape() as tape:
            loss, _ = task.FPropTower(batch).loss
        d_w, d_b = _Numpy(tape.gradient(loss, [task.model.vars.w, task.model.vars.b]))

        opt = optimizer.SGD.Params().Instantiate().Create(1.0)
        global_step, out = _RunUpdate(task, opt, batch)
        self.assertAllClose(out.total_loss[0] - out.loss[0], decay * 0.5 * np.sum(w0 ** 2),
                            rtol=1e-5)
        self.assertAllClose(out.loss[0], loss.numpy())
        self.assertAllClose(task.model.vars.w.numpy(), w0 - (d_w + decay * w0), rtol=1e-5)
        self.assertAllClose(task.model.vars.b.numpy(), b0 - d_b, rtol=1e-5)
        self.assertEqual(int(global_step.numpy()), 1)


class ClipGradientsTest(tf.test.TestCase):

    GRADS = [tf.constant([3.0, 0.0]), tf.constant([[0.0], [4.0]])]  # Global norm 5.

    def testClipsToTheBoundAndReportsTheNormBefore(self):
        grads, norm = update.ClipGradients(self.GRADS, 2.0)
        self.assertAllClose(norm, 5.0)
        self.assertAllClose(tf.linalg.global_norm(grads), 2.0)
        for got, original in zip(grads, self.GRADS):
            self.assertAllClose(got, original * 0.4)

    def testBelowTheBoundOrZeroLeavesTheGradients(self):
        for clip in (0.0, 10.0):
            grads, norm = update.ClipGradients(self.GRADS, clip)
            self.assertAllClose(norm, 5.0)
            for got, original in zip(grads, self.GRADS):
                self.assertAllClose(got, original, msg=f'clip {clip}')

    def testUpdateClipsAndReportsTheUnclippedNorm(self):
        batch = _Batch()
        task = _DenseClassifierParams(clip_gradient_norm_to_value=1e-3).Instantiate()
        with tf.GradientTape() as tape:
            loss, _ = task.FPropTower(batch).loss
        grads = tape.gradient(loss, task.trainable_variables)
        expected_norm = tf.linalg.global_norm(grads).numpy()
        self.assertGreater(expected_norm, 1e-2)
        before = [v.numpy() for v in task.trainable_variables]

        opt = optimizer.SGD.Params().Instantiate().Create(1.0)
        _, out = _RunUpdate(task, opt, batch)
        self.assertAllClose(out.grad_norm[0], expected_norm, rtol=1e-5)
        step = [b - v.numpy() for b, v in zip(before, task.trainable_variables)]
        self.assertAllClose(tf.linalg.global_norm(step), 1e-3, rtol=1e-4)


class UpdateTest(tf.test.TestCase):

    def testVariableWithoutGradientIsAClearError(self):
        task = _DenseClassifierParams().Instantiate()
        opt = optimizer.SGD.Params().Instantiate().Create(1.0)

        def metrics_fn(batch):  # The loss depends on the weights but not on the bias.
            del batch
            return NestedMap(loss=(tf.reduce_sum(task.model.vars.w), tf.constant(1.0)))

        with self.assertRaisesRegex(ValueError, r'does not depend on .*model/b') as error:
            _RunUpdate(task, opt, _Batch(), metrics_fn)
        self.assertNotIn('model/w', str(error.exception))

    def testMetricsGainTotalLossAndGradNorm(self):
        task = _DenseClassifierParams().Instantiate()
        opt = optimizer.Adam.Params().Instantiate().Create(1e-3)
        _, out = _RunUpdate(task, opt, _Batch())
        self.assertContainsSubset(['loss', 'accuracy', 'log_loss', 'total_loss', 'grad_norm'],
                                  list(out.keys()))
        self.assertAllClose(out.total_loss, out.loss)  # No weight decay.
        self.assertAllClose(out.grad_norm[1], 1.0)


# ---- SyncInputShapes ----------------------------------------------------------------------------
def _ShapesParams(input_shapes, batch_size=8, batch_dim=0):
    p = hyperparams.Params()
    p.Define('model', pipelining_layer.PipeliningLayer.Params().Set(input_shapes=input_shapes,
                                                            batch_dim=batch_dim), '')
    p.Define('input', base_input.BaseInput.Params().Set(batch_size=batch_size), '')
    return p


class SyncInputShapesTest(tf.test.TestCase):

    def testOneShape(self):
        p = _ShapesParams([64, 16])
        self.assertIs(base_task.SyncInputShapes(p), p)
        self.assertEqual(list(p.model.input_shapes), [8, 16])

    def testDictOfShapes(self):
        p = _ShapesParams(transformer_model.MtInputShapes(256, 128, 64))
        base_task.SyncInputShapes(p)
        self.assertEqual(p.model.input_shapes,
                         {k: [8, v[1]] for k, v in
                          transformer_model.MtInputShapes(256, 128, 64).items()})

    def testListOfShapes(self):
        p = _ShapesParams([[64, 16], [64], [64, 4, 4]])
        base_task.SyncInputShapes(p)
        self.assertEqual([list(s) for s in p.model.input_shapes], [[8, 16], [8], [8, 4, 4]])

    def testBatchDim(self):
        p = _ShapesParams([[10, 64, 3], [10, 64]], batch_dim=1)
        base_task.SyncInputShapes(p)
        self.assertEqual([list(s) for s in p.model.input_shapes], [[10, 8, 3], [10, 8]])

    def testShapesOfSeveralInputsAsTensorShapesKeepTheirOtherDimensions(self):
        # A list of TensorShapes is several inputs, as the plan reads it: each gets the batch.
        p = _ShapesParams([tf.TensorShape([64, 16]), tf.TensorShape([64])])
        base_task.SyncInputShapes(p)
        self.assertEqual([list(s) for s in p.model.input_shapes], [[8, 16], [8]])

    def testInputShapesThatAreNoShapesAreAConfigErrorNamingThemAsWritten(self):
        for shapes in (128, 'ab', '128,64'):
            with self.subTest(shapes=shapes):
                expected = rf'input_shapes must be .*; got {re.escape(repr(shapes))}\.$'
                with self.assertRaisesRegex(errors.ConfigError, expected):
                    base_task.SyncInputShapes(_ShapesParams(shapes))

    def testWithoutInputOrShapesNothingChanges(self):
        p = _ShapesParams(None)
        base_task.SyncInputShapes(p)
        self.assertIsNone(p.model.input_shapes)
        p = _ShapesParams([64, 16])
        p.input = None
        base_task.SyncInputShapes(p)
        self.assertEqual(list(p.model.input_shapes), [64, 16])

    def testTaskSyncsTheRegisteredModelsPipeline(self):
        p = model_registry.GetParams(MT, 'Train')
        p.input.batch_size = 4
        p.model.num_micro_batches = 2
        task = p.Instantiate()
        for key, shape in task.model.p.input_shapes.items():
            self.assertEqual(shape[0], 4, key)
        self.assertEqual(p.model.input_shapes['src_ids'][0], 32)  # The caller's Params stay.


# ---- MetricSums ---------------------------------------------------------------------------------
class MetricSumsTest(tf.test.TestCase):

    def testWeightedMeansOverBatches(self):
        sums = program.MetricSums()
        sums.Add({'loss': (2.0, 3.0), 'acc': (np.float32(0.5), np.float32(2.0))})
        sums.Add({'loss': (tf.constant(4.0), tf.constant(1.0)), 'acc': (1.0, 0.0)})
        means = sums.Means()
        self.assertAllClose(means['loss'], (6.0 + 4.0) / 4.0)
        self.assertAllClose(means['acc'], 0.5)

    def testZeroWeightGivesZero(self):
        sums = program.MetricSums()
        sums.Add({'loss': (3.0, 0.0)})
        self.assertEqual(sums.Means(), {'loss': 0.0})


# ---- Training programs on PipelinedMLP ----------------------------------------------------------
NUM_STEPS = 8  # Steps before the checkpoint the programs restore.


def _MlpParams(dataset='Train'):
    p = model_registry.GetParams(MLP, dataset)
    p.input.batch_size = 16
    p.model.num_micro_batches = 2
    return p


def _EvalInput():
    """40 examples in batches of 16: the last batch has 8 padding rows."""
    p = _MlpParams('Test').input
    p.num_examples = 40
    return p


def _Weights(variables, session=None):
    return session.run(list(variables)) if session else [v.numpy() for v in variables]


@functools.lru_cache(maxsize=None)
def _EagerReference():
    """An uninterrupted EagerProgram run: NUM_STEPS steps, a checkpoint, one more step."""
    logdir = tempfile.mkdtemp()
    prog = program.EagerProgram(_MlpParams(), logdir)
    ref = NestedMap(logdir=logdir, program=prog, start_step=prog.Restore())
    ref.initial_weights = _Weights(prog.task.trainable_variables)
    ref.losses = [prog.Step()['loss'] for _ in range(NUM_STEPS)]
    prog.Save()
    ref.saved_weights = _Weights(prog.task.trainable_variables)
    ref.next_metrics = prog.Step()
    ref.eval_after = prog.Evaluate(_EvalInput())
    return ref


def tearDownModule():
    if _EagerReference.cache_info().currsize:
        shutil.rmtree(_EagerReference().logdir, ignore_errors=True)


class EagerProgramTest(tf.test.TestCase):

    def testStartsAtStepZeroAndTheLossGoesDown(self):
        ref = _EagerReference()
        self.assertEqual(ref.start_step, 0)
        self.assertLess(np.mean(ref.losses[-3:]), np.mean(ref.losses[:3]))

    def testRestoreResumesWithTheSavedWeightsAndTheSameNextStep(self):
        ref = _EagerReference()
        self.assertEqual(program.LatestStep(ref.logdir), NUM_STEPS)
        restored = program.EagerProgram(_MlpParams(), ref.logdir)
        self.assertEqual(restored.Restore(), NUM_STEPS)
        self.assertEqual(restored.CurrentStep(), NUM_STEPS)
        for got, expected in zip(_Weights(restored.task.trainable_variables), ref.saved_weights):
            self.assertAllEqual(got, expected)
        # The restored program's next step is the uninterrupted program's next step: same
        # weights, same optimizer slots, same batch.
        metrics = restored.Step()
        for name, value in ref.next_metrics.items():
            self.assertAllClose(metrics[name], value, rtol=1e-6, msg=name)

    def testEvaluateReturnsWeightedMeansOverTheRealExamples(self):
        ref = _EagerReference()
        task = ref.program.task
        logits, labels = [], []
        for batch in _EvalInput().Instantiate().EvalDataset():
            real = batch['weights'].numpy() > 0
            with fprop_context.Scope(training=False):
                out = task.model(tf.reshape(batch['images'], [16, -1])).numpy()
            logits.append(out[real])
            labels.append(batch['labels'].numpy()[real])
        logits, labels = np.concatenate(logits), np.concatenate(labels)
        self.assertLen(labels, 40)
        xent = _Xent(logits, labels)
        self.assertAllClose(ref.eval_after['loss'], xent.mean(), rtol=1e-5)
        self.assertAllClose(ref.eval_after['log_loss'], xent.mean(), rtol=1e-5)
        self.assertAllClose(ref.eval_after['accuracy'], np.mean(logits.argmax(-1) == labels))

    def testLearningRateIsTheScheduledRate(self):
        ref = _EagerReference()
        self.assertAllClose(ref.program.LearningRate(), 1e-2)


class GraphProgramTest(tf.test.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.logdir = _ClassTempDir(cls)
        cls.prog = program.GraphProgram(_MlpParams(), cls.logdir)
        cls.start_step = cls.prog.Restore()
        cls.initial_weights = _Weights(cls.prog.task.trainable_variables, cls.prog.session)
        cls.losses = [cls.prog.Step()['loss'] for _ in range(3)]
        cls.prog.Save()
        cls.saved_weights = _Weights(cls.prog.task.trainable_variables, cls.prog.session)

    def _RestoredEagerProgram(self, training=True):
        eager = program.EagerProgram(_MlpParams(), self.logdir)
        self.assertEqual(eager.Restore(training=training), 3)
        return eager

    def testStartsFromTheEagerProgramsInitialisation(self):
        self.assertEqual(self.start_step, 0)
        for got, expected in zip(self.initial_weights, _EagerReference().initial_weights):
            self.assertAllEqual(got, expected)

    def testFirstLossesEqualTheEagerProgramsLosses(self):
        self.assertAllClose(self.losses, _EagerReference().losses[:3], rtol=1e-5)

    def testCheckpointRestoresInAnEagerProgram(self):
        eager = self._RestoredEagerProgram()
        for got, expected in zip(_Weights(eager.task.trainable_variables), self.saved_weights):
            self.assertAllEqual(got, expected)
        # Step 4 from the graph's weights and Adam slots is the uninterrupted run's step 4.
        self.assertAllClose(eager.Step()['loss'], _EagerReference().losses[3], rtol=1e-5)

    def testEvaluateEqualsTheEagerProgramsEvaluateOfTheSameCheckpoint(self):
        expected = self._RestoredEagerProgram(training=False).Evaluate(_EvalInput())
        got = self.prog.Evaluate(_EvalInput())
        self.assertCountEqual(got.keys(), expected.keys())
        for name, value in expected.items():
            self.assertAllClose(got[name], value, rtol=1e-5, msg=name)


# ---- Greedy decoding ----------------------------------------------------------------------------
class DecodeTest(tf.test.TestCase):

    BATCH_SIZE = 4
    MAX_STEPS = 4

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        p = model_registry.GetParams(MT, 'Test')
        p.input.batch_size = cls.BATCH_SIZE
        p.model.num_micro_batches = 2
        cls.vocab_size = p.input.vocab_size
        cls.task = p.Instantiate()
        batch = next(iter(p.input.Instantiate().EvalDataset()))
        cls.src_ids, cls.src_paddings = batch['src_ids'], batch['src_paddings']
        cls.decoded = cls._Decode()

    @classmethod
    def _Decode(cls):
        return cls.task.Decode(cls.src_ids, cls.src_paddings, max_steps=cls.MAX_STEPS)

    def _CheckEndsAtEos(self, decoded):
        for row in decoded:
            eos = np.flatnonzero(row == EOS_ID)
            if eos.size:
                self.assertAllEqual(row[eos[0] + 1:], np.zeros_like(row[eos[0] + 1:]))

    def testShapeDtypeAndRange(self):
        self.assertEqual(self.decoded.shape, tuple(self.src_ids.shape))
        self.assertEqual(self.decoded.dtype, np.int32)
        self.assertAllInRange(self.decoded, 0, self.vocab_size - 1)
        # Nothing is decoded past max_steps.
        self.assertAllEqual(self.decoded[:, self.MAX_STEPS:],
                            np.zeros_like(self.decoded[:, self.MAX_STEPS:]))
        self._CheckEndsAtEos(self.decoded)

    def testIsDeterministic(self):
        self.assertAllEqual(self._Decode(), self.decoded)

    def testRowsAreZeroAfterTheirFirstEos(self):
        # Make the model answer EOS wherever it would have answered token X: give EOS X's
        # softmax column and a slightly larger bias. The prefixes before X are unchanged (the
        # decoder is causal), so each row must end at its first X.
        x = int(self.decoded[0, 1])
        self.assertNotIn(x, (0, EOS_ID))
        softmax = [v for v in self.task.trainable_variables
                   if 'softmax' in v.name and v.shape[-1] == self.vocab_size]
        w = next(v for v in softmax if v.shape.rank == 2)
        b = next(v for v in softmax if v.shape.rank == 1)
        w0, b0 = w.numpy(), b.numpy()
        self.addCleanup(w.assign, w0)
        self.addCleanup(b.assign, b0)
        w.assign(_SetColumn(w0, EOS_ID, w0[:, x]))
        b.assign(_SetColumn(b0[None], EOS_ID, b0[x] + 1e-3)[0])

        decoded = self._Decode()
        expected = self.decoded.copy()
        for row in expected:
            hits = np.flatnonzero(row == x)
            if hits.size:
                row[hits[0]] = EOS_ID
                row[hits[0] + 1:] = 0
        self.assertEqual(decoded[0, 1], EOS_ID)
        self.assertAllEqual(decoded, expected)
        self._CheckEndsAtEos(decoded)


def _SetColumn(matrix, column, values):
    out = np.array(matrix, copy=True)
    out[:, column] = values
    return out


if __name__ == '__main__':
    tf.test.main()
