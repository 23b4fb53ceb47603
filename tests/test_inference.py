"""Inference mode (`fprop_context.Inference`, `base_task.Inference`): a task's Predict and
Decode, `--mode=decode` and the export's serving functions compute as eval's forward does
(training=False), give each example the same answer whatever else is in its request, and change
no variable.

The oracle never goes through the code it checks: the pipeline's layers run one after another
without the pipeline (`test_utils.Unpartitioned`) under `fprop_context.Scope(training=False)`,
and eval's own metrics (`program.EagerProgram.Evaluate`). Each model has a layer whose training
forward differs (batch norm with scrambled moving statistics, drop-path, dropout), and a test
checks that it does, so the comparisons can fail.
"""

import os
import shutil
import tempfile

import numpy as np
import tensorflow as tf

from gpipe_tf import model_registry
from gpipe_tf import test_utils
from gpipe_tf.layers import fprop_context
from gpipe_tf.nested_map import NestedMap
from gpipe_tf.params.mt import multilingual
from gpipe_tf.train import decode
from gpipe_tf.train import export
from gpipe_tf.train import program

DEVICES = test_utils.ConfigureVirtualCpus()

# Ops that write a variable: a serving function must hold none.
_WRITES = ('AssignVariableOp', 'AssignAddVariableOp', 'AssignSubVariableOp', 'Assign',
           'AssignAdd', 'AssignSub', 'ResourceScatterUpdate', 'ResourceScatterAdd')


def WritingOps(concrete_function) -> list:
    """Names of the ops of a concrete function (and of every function it calls) that write a
    variable."""
    graph = concrete_function.graph.as_graph_def()
    nodes = list(graph.node) + [n for f in graph.library.function for n in f.node_def]
    return sorted(n.name for n in nodes if n.op in _WRITES or n.op.startswith('ResourceApply'))


def Values(variables) -> list:
    return [v.numpy().copy() for v in variables]


class ClassifierInferenceTest(tf.test.TestCase):
    """AmoebaNet-D (3, 8), K=2, M=4, batch 16: batch norm, drop-path and dropout."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.logdir = tempfile.mkdtemp()
        cls.p = test_utils.SmallAmoebaNetParams()
        cls.program = program.EagerProgram(cls.p, cls.logdir)
        cls.task = cls.program.task
        test_utils.ScrambleMovingStatistics(cls.task)
        data = cls.p.input.Instantiate()
        batches = list(data.EvalDataset())
        cls.images = np.concatenate([b['images'].numpy() for b in batches])
        cls.labels = np.concatenate([b['labels'].numpy() for b in batches])
        cls.servable = export.MakeServable(cls.task, cls.p)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.logdir, ignore_errors=True)
        super().tearDownClass()

    def _Oracle(self, images, training=False):
        """Probabilities of the layers run without the pipeline, batch by batch."""
        batch = self.p.input.batch_size
        rows = []
        for start in range(0, len(images), batch):
            chunk = tf.constant(images[start:start + batch])
            inputs = NestedMap(images=chunk, labels=tf.zeros([len(chunk)], tf.int32))
            with fprop_context.Scope(training=training):
                outputs = test_utils.Unpartitioned(self.task.model, inputs)
            rows.append(tf.nn.softmax(outputs.logits).numpy())
        return np.concatenate(rows)

    def testTrainingModeWouldGiveOtherAnswers(self):
        # What makes the other tests able to fail: the model's training forward differs.
        self.assertNotAllClose(self._Oracle(self.images[:16], training=True),
                               self._Oracle(self.images[:16]), rtol=1e-3, atol=1e-3)

    def testPredictEqualsTheLayersInInferenceModeFromATrainingContext(self):
        with fprop_context.Scope(training=True):
            got = self.task.Predict(tf.constant(self.images[:16])).numpy()
        self.assertAllClose(got, self._Oracle(self.images[:16]), rtol=1e-5, atol=1e-6)

    def testAnImagesAnswerDoesNotDependOnItsRequest(self):
        want = self._Oracle(self.images)
        for size in (1, 7, 16, 23, 64):
            with self.subTest(request=size):
                got = np.concatenate([
                    self.servable.predict(tf.constant(self.images[i:i + size]))[
                        'probabilities'].numpy() for i in range(0, 23, size)])
                self.assertAllClose(got, want[:len(got)], rtol=1e-5, atol=1e-6)
        alone = self.servable.predict(tf.constant(np.repeat(self.images[:1], 8, 0)))
        self.assertLen(set(alone['classes'].numpy()), 1)

    def testServedAccuracyEqualsEvalsForRequestsOf1And7And64(self):
        accuracy = self.program.Evaluate(self.p.input)['accuracy']
        for size in (1, 7, 64):
            with self.subTest(request=size):
                classes = np.concatenate([
                    self.servable.predict(tf.constant(self.images[i:i + size]))[
                        'classes'].numpy() for i in range(0, len(self.images), size)])
                self.assertAllClose(np.mean(classes == self.labels), accuracy, atol=1e-6)

    def testServingAndDecodingChangeNoVariable(self):
        self.assertEqual(WritingOps(self.servable.predict.get_concrete_function()), [])
        self.assertEqual(WritingOps(self.servable.classify.get_concrete_function()), [])
        before = Values(self.task.variables)
        pixels = np.random.RandomState(3).randint(0, 256, [5, 28, 28, 1]).astype(np.uint8)
        for _ in range(2):
            self.servable.classify(tf.constant(pixels))
            self.servable.predict(tf.constant(self.images[:3]))
            self.task.Predict(tf.constant(self.images[:16]))
        for got, want in zip(Values(self.task.variables), before):
            self.assertAllEqual(got, want)

    def testDecodeEqualsTheLayersOnImageFiles(self):
        directory = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, directory, ignore_errors=True)
        pixels = np.random.RandomState(4).randint(0, 256, [3, 28, 28, 1]).astype(np.uint8)
        paths = []
        for i, image in enumerate(pixels):
            paths.append(os.path.join(directory, f'{i}.png'))
            tf.io.write_file(paths[-1], tf.io.encode_png(image))
        ready = decode.ImageSpec.Of(self.p).Normalize(pixels).numpy()
        want = self._Oracle(ready)
        results = decode.Decode(self.task, self.p, paths, None)
        alone = [decode.Decode(self.task, self.p, [path], None)[0] for path in paths]
        self.assertEqual(results, alone)
        for (_, text), probabilities in zip(results, want):
            label = int(np.argmax(probabilities))
            self.assertEqual(text, f'{label} ({probabilities[label]:.3f})')


class _DropoutTransformer(multilingual.TransformerTiny):
    DROPOUT_KEEP_PROB = 0.5


class TranslationInferenceTest(tf.test.TestCase):
    """TransformerTiny with dropout (keep 0.5), K=4, M=2, batch 2."""

    SENTENCES = ['Hello.', 'A cat, Ω.', 'Guten Tag', 'xy']

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        p = _DropoutTransformer().Task()
        p.input = model_registry.GetParams('mt.multilingual.TransformerTiny', 'Test').input
        p.input.batch_size = 2
        p.input.max_length = 12
        p.model.num_micro_batches = 2
        cls.p = p
        cls.task = p.Instantiate()
        data = p.input.Instantiate()
        cls.language = data.vocab.languages[0]
        cls.encoded = data.EncodeSources(cls.SENTENCES, cls.language)
        cls.servable = export.MakeServable(cls.task, p)

    def _GreedyByTheLayers(self, src_ids, src_paddings, training=False):
        """Greedy target ids [B, T] of the layers run without the pipeline, the whole model once
        per position on the growing prefix, each row cut after its first </s>."""
        batch, length = src_ids.shape
        tgt_ids = np.zeros([batch, length], np.int32)
        tgt_ids[:, 0] = self.task.p.bos_id
        decoded = np.zeros([batch, length], np.int32)
        done = np.zeros([batch], bool)
        zeros = tf.zeros([batch, length])
        for t in range(length):
            inputs = NestedMap(src_ids=tf.constant(src_ids), src_paddings=tf.constant(src_paddings),
                               tgt_ids=tf.constant(tgt_ids), tgt_paddings=zeros,
                               tgt_labels=tf.zeros([batch, length], tf.int32), tgt_weights=zeros)
            with fprop_context.Scope(training=training):
                outputs = test_utils.Unpartitioned(self.task.model, inputs)
            token = np.where(done, 0, outputs.predictions.numpy()[:, t].astype(np.int32))
            decoded[:, t] = token
            if t + 1 < length:
                tgt_ids[:, t + 1] = token
            done |= token == self.task.p.eos_id
        return decoded

    def testTrainingModeWouldGiveOtherTokens(self):
        ids, paddings = self.encoded.src_ids[:2], self.encoded.src_paddings[:2]
        self.assertNotAllEqual(self._GreedyByTheLayers(ids, paddings, training=True),
                               self._GreedyByTheLayers(ids, paddings))

    def testDecodeEqualsTheLayersGreedyDecodingFromATrainingContext(self):
        for start in (0, 2):
            ids = self.encoded.src_ids[start:start + 2]
            paddings = self.encoded.src_paddings[start:start + 2]
            with fprop_context.Scope(training=True):
                got = self.task.Decode(ids, paddings)
            self.assertAllEqual(got, self._GreedyByTheLayers(ids, paddings))

    def testASentenceAloneIsTranslatedAsInAFullRequestAndNoVariableChanges(self):
        self.assertEqual(WritingOps(self.servable.translate.get_concrete_function()), [])
        before = Values(self.task.variables)
        together = self.servable.translate(tf.constant(self.SENTENCES), tf.constant(self.language))
        for i, sentence in enumerate(self.SENTENCES):
            alone = self.servable.translate(tf.constant([sentence]), tf.constant(self.language))
            self.assertEqual(alone['translations'].numpy()[0], together['translations'].numpy()[i])
            self.assertAllEqual(alone['ids'].numpy()[0], together['ids'].numpy()[i])
        want = np.concatenate([self._GreedyByTheLayers(self.encoded.src_ids[s:s + 2],
                                                       self.encoded.src_paddings[s:s + 2])
                               for s in (0, 2)])
        self.assertAllEqual(together['ids'].numpy(), want)
        for got, want in zip(Values(self.task.variables), before):
            self.assertAllEqual(got, want)


class NoUpdatesTest(tf.test.TestCase):

    def testAnUpdateReportedInAnInferencePassIsAnError(self):
        layer = test_utils.BatchNormStack(1, 4)[1].Set(name='bn').Instantiate()
        with fprop_context.Inference(), fprop_context.Scope(training=True):
            with self.assertRaisesRegex(ValueError, 'bn reported a training update in an '
                                        'inference pass'):
                layer.FProp(layer.theta, tf.ones([2, 4]))


if __name__ == '__main__':
    tf.test.main()
