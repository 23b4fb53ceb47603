"""gpipe_tf.keras.Functional's cut on measured time and its report on an example micro-batch
(keras/call_costs.py): the time cut follows where the work is, not where the parameters are;
the bytes a stage receives and sends are those of the example's tensors; a model loaded from its
config is cut where the measured one was."""

import keras
import numpy as np
import tensorflow as tf

from gpipe_tf import errors
from gpipe_tf import test_utils
from gpipe_tf.keras import Functional

DEVICES = test_utils.ConfigureVirtualCpus()


def ParamsAndWorkApart():
    """Three convolutions of 64 channels on 32 x 32 (many FLOPs, few parameters) between a
    small input projection and a head of 0.5M parameters on 8 pooled features (few FLOPs)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((32, 32, 4))
    h = keras.layers.Conv2D(64, 3, padding='same', activation='relu', name='conv_0')(inputs)
    h = keras.layers.Conv2D(64, 3, padding='same', activation='relu', name='conv_1')(h)
    h = keras.layers.Conv2D(64, 3, padding='same', activation='relu', name='conv_2')(h)
    h = keras.layers.GlobalAveragePooling2D(name='pool')(h)
    h = keras.layers.Dense(1024, name='wide')(h)
    h = keras.layers.Dense(512, name='wider')(h)
    return keras.Model(inputs, keras.layers.Dense(2, name='head')(h), name='apart')


def OpenLength():
    """Token ids and a mask of a length known only when the model runs."""
    keras.utils.set_random_seed(1)
    ids = keras.Input((None,), dtype='int32', name='ids')
    mask = keras.Input((None,), dtype='float32', name='mask')
    h = keras.layers.Embedding(30, 8, name='embedding')(ids)
    h = keras.layers.Dense(8, activation='tanh', name='d1')(h)
    h = keras.layers.Multiply(name='masked')([h, keras.layers.Reshape((-1, 1))(mask)])
    h = keras.layers.Dense(8, activation='tanh', name='d2')(h)
    return keras.Model({'ids': ids, 'mask': mask}, keras.layers.Dense(5, name='head')(h),
                       name='open_length')


def StageNames(pipelined):
    return [[l.name for l in pipelined.StageLayers(s)] for s in range(len(pipelined.stages))]


class TimeCutTest(tf.test.TestCase):

    def testTheTimeCutSplitsTheConvolutionsWhereParametersWouldSplitTheHead(self):
        by_params = Functional(ParamsAndWorkApart(), num_cells=2, num_micro_batches=2,
                               devices=DEVICES)
        by_time = Functional(ParamsAndWorkApart(), num_cells=2, num_micro_batches=2,
                             devices=DEVICES, partition_method='time', micro_batch_size=8)
        # Parameters: the convolutions (~75K) and the pooling in stage 0, the dense head
        # (~530K) split in two. Time: the convolutions (~1 GFLOP a micro-batch against
        # ~1 MFLOP for the head) are split, the head joins the last of them.
        self.assertEqual(StageNames(by_params)[1], ['wider', 'head'])
        stages = StageNames(by_time)
        self.assertIn('wide', stages[1])
        self.assertTrue(any(name.startswith('conv') for name in stages[1]), stages)
        self.assertTrue(any(name.startswith('conv') for name in stages[0]), stages)

    def testATimeCutModelPredictsAsTheModelAndLoadsWithTheSameCut(self):
        x = np.random.RandomState(2).randn(6, 32, 32, 4).astype(np.float32)
        model, reference = ParamsAndWorkApart(), ParamsAndWorkApart()
        pipelined = Functional(model, num_cells=2, num_micro_batches=2, devices=DEVICES,
                               partition_method='time', example_inputs=x[:3])
        self.assertAllClose(pipelined.predict(x, verbose=0), reference.predict(x, verbose=0),
                            rtol=1e-5, atol=1e-6)
        config = pipelined.get_config()
        self.assertEqual(sum(config['balance']), len(pipelined.graph.calls))
        again = Functional.from_config(config)
        self.assertEqual(StageNames(again), StageNames(pipelined))

    def testAnOpenLengthNeedsExampleInputsToBeTimed(self):
        with self.assertRaisesRegex(errors.ConfigError,
                                    "example_inputs=.*'ids' has shape \\(None, None\\)"):
            Functional(OpenLength(), num_cells=2, num_micro_batches=2, devices=DEVICES,
                       partition_method='time')

    def testAnUnknownPartitionMethod(self):
        with self.assertRaisesRegex(errors.ConfigError, "partition_method must be one of "
                                    "\\('params', 'time'\\); got 'flops'"):
            Functional(OpenLength(), num_cells=2, num_micro_batches=2, devices=DEVICES,
                       partition_method='flops')


class ReportTest(tf.test.TestCase):

    def testBytesAreThoseOfTheExampleMicroBatch(self):
        example = {'ids': np.zeros((3, 7), np.int32), 'mask': np.ones((3, 7), np.float32)}
        pipelined = Functional(OpenLength(), split_points=['d2'], num_micro_batches=2,
                               devices=DEVICES, example_inputs=example)
        rows = [line.split() for line in pipelined.StageReport().splitlines()[1:]]
        # Stage 0 receives ids and mask (3 x 7 of 4 bytes each) and sends the masked hidden
        # state (3 x 7 x 8 float32); stage 1 receives it and sends the logits (3 x 7 x 5).
        self.assertEqual(rows[0][3:7], ['2,', f'{2 * 3 * 7 * 4:,}', 'B', '1,'])
        self.assertEqual(rows[0][7], f'{3 * 7 * 8 * 4:,}')
        self.assertEqual(rows[1][7], f'{3 * 7 * 5 * 4:,}')
        unknown = Functional(OpenLength(), split_points=['d2'], num_micro_batches=2,
                             devices=DEVICES)
        self.assertIn('?', unknown.StageReport())

    def testExampleInputsOfAnotherStructure(self):
        with self.assertRaisesRegex(errors.ConfigError,
                                    'example_inputs has 1 input\\(s\\); open_length takes 2'):
            Functional(OpenLength(), num_cells=2, num_micro_batches=2, devices=DEVICES,
                       example_inputs=np.zeros((2, 7), np.int32))


if __name__ == '__main__':
    tf.test.main()
