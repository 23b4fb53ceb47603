"""The same run and the same checkpoint at any partition: K, M, R, partition method, devices.

Layers are the pipeline's children by name and draw randomness per example, so initial weights,
dropout masks, training losses and checkpoints do not depend on how the model is partitioned or
the batch split (batch norm aside: it uses each micro-batch's statistics, as in GPipe).
"""

import itertools
import os
import shutil
import tempfile

import tensorflow as tf

from gpipe_tf import test_utils
from gpipe_tf.layers import basic
from gpipe_tf.layers import fprop_context
from gpipe_tf.layers import normalization
from gpipe_tf.params import lm
from gpipe_tf.pipeline import pipelining_layer

DEVICES = test_utils.ConfigureVirtualCpus()
BATCH, DIM, NUM_BLOCKS = 8, 8, 6
SEED = 7
RTOL = 1e-5
LEARNING_RATE = 0.1
NUM_STEPS = 3


class TinyLmWithDropout(lm.TransformerLTiny):
    DROPOUT_KEEP_PROB = 0.8


def Layers(batch_norm=False):
    """Dense + dropout blocks (and batch norm): randomness in every block."""
    layers = []
    for i in range(NUM_BLOCKS):
        layers.append(basic.DenseLayer.Params().Set(name=f'dense_{i}', input_dim=DIM,
                                                    output_dim=DIM, activation='tanh'))
        if batch_norm:
            layers.append(normalization.BatchNormLayer.Params().Set(name=f'bn_{i}', dim=DIM))
        layers.append(basic.DropoutLayer.Params().Set(name=f'dropout_{i}', keep_prob=0.7))
    return layers


def Pipeline(k, m=1, r=1, batch_norm=False, **overrides):
    return pipelining_layer.PipeliningLayer.Params().Set(
        name='model', layer_tpl=Layers(batch_norm), num_cells=k, num_micro_batches=m,
        num_replicas=r, input_shapes=[BATCH, DIM], devices=DEVICES[:k * r], random_seed=SEED
    ).Set(**overrides)


def Values(layer) -> dict:
    return {v.name: v.numpy() for v in layer.variables}


def Batch(step):
    x = tf.random.stateless_normal([BATCH, DIM], [step, 1])
    return x, tf.random.stateless_normal([BATCH, DIM], [step, 2])


def Loss(layer, x, target):
    return tf.reduce_mean(tf.square(layer(x) - target))


def TrainLosses(layer, num_steps=NUM_STEPS) -> list[float]:
    """SGD in a tf.function: each step's loss (dropout on, seeded by the step)."""
    variables = layer.trainable_variables

    @tf.function
    def Step(step, x, target):
        with tf.GradientTape() as tape, fprop_context.Scope(step=step):
            loss = Loss(layer, x, target)
        for v, g in zip(variables, tape.gradient(loss, variables)):
            v.assign_sub(LEARNING_RATE * g)
        return loss

    return [float(Step(tf.constant(s, tf.int64), *Batch(s))) for s in range(num_steps)]


def V1TrainLosses(params, num_steps=NUM_STEPS) -> list[float]:
    """TrainLosses in a tf.compat.v1 graph run by a Session."""
    batches = [[t.numpy() for t in Batch(s)] for s in range(num_steps)]
    graph = tf.Graph()
    with graph.as_default():
        layer = params.Instantiate()
        step = tf.compat.v1.placeholder(tf.int64, [])
        x = tf.compat.v1.placeholder(tf.float32, [BATCH, DIM])
        target = tf.compat.v1.placeholder(tf.float32, [BATCH, DIM])
        with fprop_context.Scope(step=step):
            loss = Loss(layer, x, target)
        variables = layer.trainable_variables
        grads = tf.compat.v1.gradients(loss, variables)
        with tf.control_dependencies([loss]):
            update = tf.group([v.assign_sub(LEARNING_RATE * g) for v, g in zip(variables, grads)])
        config = tf.compat.v1.ConfigProto(device_count={'CPU': len(DEVICES)})
        with tf.compat.v1.Session(graph=graph, config=config) as session:
            session.run(tf.compat.v1.global_variables_initializer())
            losses = []
            for s, batch in enumerate(batches):
                value, _ = session.run([loss, update], {step: s, x: batch[0], target: batch[1]})
                losses.append(float(value))
            return losses


class InitialVariablesTest(tf.test.TestCase):
    """The same seed gives bit-identical variables, under the same names, at every partition."""

    def testEveryPartitionAndTheUnpipelinedStackStartEqual(self):
        reference = Values(Pipeline(1, batch_norm=True).Instantiate())
        self.assertIn('model/dense_3/w:0', reference)
        variants = {f'K={k} R={r}': Pipeline(k, r=r, batch_norm=True)
                    for k, r in ((2, 1), (3, 1), (4, 1), (1, 2), (2, 2), (4, 2))}
        variants['uniform'] = Pipeline(4, batch_norm=True, partition_method='uniform')
        variants['boundaries'] = Pipeline(3, batch_norm=True, partition_method=[0, 1, 5, 18])
        variants['one device'] = Pipeline(4, batch_norm=True, devices=DEVICES[:1])
        variants['un-pipelined'] = pipelining_layer.PipeliningLayer.UnpipelinedParams(
            Pipeline(4, batch_norm=True))
        for name, params in variants.items():
            with self.subTest(variant=name):
                values = Values(params.Instantiate())
                self.assertCountEqual(values, reference)
                for key, value in values.items():
                    self.assertAllEqual(value, reference[key], msg=key)

    def testAV1GraphStartsFromTheSameValues(self):
        reference = Values(Pipeline(1, batch_norm=True).Instantiate())
        with tf.Graph().as_default():
            layer = Pipeline(3, r=2, batch_norm=True).Instantiate()
            with tf.compat.v1.Session() as session:
                session.run(tf.compat.v1.global_variables_initializer())
                values = dict(zip([v.name for v in layer.variables],
                                  session.run(layer.variables)))
        self.assertCountEqual(values, reference)
        for key, value in values.items():
            self.assertAllEqual(value, reference[key], msg=key)

    def testAnotherSeedGivesOtherValues(self):
        ours = Values(Pipeline(2).Instantiate())
        other = Values(Pipeline(2).Set(random_seed=SEED + 1).Instantiate())
        self.assertNotAllClose(ours['model/dense_0/w:0'], other['model/dense_0/w:0'])


class TrainingTest(tf.test.TestCase):
    """Training with dropout gives the same losses at every K, M and R."""

    def testTfFunctionLossesAreTheSameAtEveryKMAndR(self):
        reference = TrainLosses(Pipeline(1).Instantiate())
        cases = list(itertools.product((1, 2, 4), (1, 2, 4), (1,))) + [(2, 2, 2), (1, 4, 2)]
        for k, m, r in cases[1:]:
            with self.subTest(k=repr(k), m=repr(m), r=repr(r)):
                losses = TrainLosses(Pipeline(k, m, r).Instantiate())
                self.assertAllClose(losses, reference, rtol=RTOL, atol=0)

    def testV1GraphLossesAreTheSameAtEveryKAndM(self):
        reference = TrainLosses(Pipeline(1).Instantiate())
        for k, m, r in ((1, 1, 1), (2, 4, 1), (4, 2, 1), (2, 2, 2)):
            with self.subTest(k=repr(k), m=repr(m), r=repr(r)):
                self.assertAllClose(V1TrainLosses(Pipeline(k, m, r)), reference, rtol=RTOL,
                                    atol=0)

    def testDropoutIsOnAndChangesWithTheStep(self):
        layer = Pipeline(2, 2).Instantiate()
        x, _ = Batch(0)
        with fprop_context.Scope(step=0):
            first = layer(x)
        with fprop_context.Scope(step=1):
            second = layer(x)
        with fprop_context.Scope(training=False):
            clean = layer(x)
        self.assertNotAllClose(first, clean)
        self.assertNotAllClose(first, second)

    def testTheTransformerLmsFirstLossIsTheSameAtEveryKAndM(self):
        config = TinyLmWithDropout()
        p = config.Task()
        batch = next(iter(config.Train().Instantiate().TrainDataset(start_step=0)))
        losses = {}
        for k, m in ((1, 1), (2, 4), (3, 2)):
            p.model.Set(num_cells=k, num_micro_batches=m, devices=DEVICES[:k],
                        random_seed=SEED)
            with fprop_context.Scope(step=5):
                losses[k, m] = float(p.Instantiate().FPropTower(batch).loss[0])
        with fprop_context.Scope(training=False):
            clean = float(p.Instantiate().FPropTower(batch).loss[0])
        self.assertNotAllClose(losses[1, 1], clean)  # Dropout was on.
        self.assertAllClose(list(losses.values()), [losses[1, 1]] * 3, rtol=RTOL, atol=0)


class CheckpointTest(tf.test.TestCase):
    """A checkpoint written at one partition restores into any other, slots included."""

    def _Step(self, layer, optimizer, step):
        variables = layer.trainable_variables
        with tf.GradientTape() as tape, fprop_context.Scope(step=step):
            loss = Loss(layer, *Batch(step))
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return float(loss)

    def testRestoresAtAnyPartitionAndUnpipelinedAndContinuesTheSame(self):
        source = Pipeline(4, 2).Instantiate()
        optimizer = tf.compat.v1.train.AdamOptimizer(0.01)
        self._Step(source, optimizer, 0)
        directory = tempfile.mkdtemp(prefix='repartition_')
        self.addCleanup(shutil.rmtree, directory, ignore_errors=True)
        path = tf.train.Checkpoint(model=source, optimizer=optimizer).save(
            os.path.join(directory, 'ckpt'))
        # What the source does next, from the checkpoint's state (Adam's slots matter).
        expected_loss = self._Step(source, optimizer, 1)
        expected = Values(source)
        targets = {'K=2 M=4': Pipeline(2, 4), 'K=3 R=2': Pipeline(3, 1, 2),
                   'un-pipelined': pipelining_layer.PipeliningLayer.UnpipelinedParams(
                       Pipeline(4))}
        for name, params in targets.items():
            with self.subTest(target=name):
                layer = params.Instantiate()
                restored = tf.compat.v1.train.AdamOptimizer(0.01)
                status = tf.train.Checkpoint(model=layer, optimizer=restored).restore(path)
                status.assert_existing_objects_matched()
                loss = self._Step(layer, restored, 1)
                status.assert_consumed()  # Every slot found its variable.
                self.assertAllClose(loss, expected_loss, rtol=RTOL, atol=0)
                values = Values(layer)
                for key, value in expected.items():
                    self.assertAllClose(values[key], value, rtol=RTOL, atol=1e-7, msg=key)

    def testTheUnpipelinedStacksCheckpointRestoresIntoAPipeline(self):
        stack = pipelining_layer.PipeliningLayer.UnpipelinedParams(
            Pipeline(1).Set(random_seed=SEED + 1)).Instantiate()
        directory = tempfile.mkdtemp(prefix='repartition_')
        self.addCleanup(shutil.rmtree, directory, ignore_errors=True)
        path = tf.train.Checkpoint(model=stack).save(os.path.join(directory, 'ckpt'))
        layer = Pipeline(3, 2, 2).Instantiate()
        tf.train.Checkpoint(model=layer).restore(path).assert_consumed()
        expected = Values(stack)
        self.assertCountEqual(Values(layer), expected)
        for key, value in Values(layer).items():
            self.assertAllEqual(value, expected[key], msg=key)

    def testDuplicateLayerNamesAreRefusedBeforeAnyVariable(self):
        layers = Layers()
        layers[2] = layers[2].Copy().Set(name='dense_0')
        p = Pipeline(2).Set(layer_tpl=layers)
        with self.assertRaisesRegex(ValueError, r'layer names must be unique.*dense_0 appear'):
            p.Instantiate()


if __name__ == '__main__':
    tf.test.main()
