"""Tests of the image inputs: IDX parsing and its errors, normalisation, batch shapes, eval padding,
resumable training order, the fixed digits split, and synthetic determinism."""

import gzip
import importlib.util
import os
import shutil
import sys
import tempfile
from unittest import mock

import pytest
import numpy as np
import tensorflow as tf

from gpipe_tf import errors
from gpipe_tf import test_utils
from gpipe_tf.input import image

pytestmark = pytest.mark.unit

test_utils.ConfigureVirtualCpus()

FASHION_MNIST_DIR = '/usr/share/datasets/fashion-mnist'

HAVE_SKLEARN = importlib.util.find_spec('sklearn') is not None


def _WriteIdx(path, array, magic=None):
    """An IDX file of uint8 `array`, written by hand so it doesn't share code with the reader."""
    array = np.asarray(array, np.uint8)
    magic = (0x0800 | array.ndim) if magic is None else magic
    data = magic.to_bytes(4, 'big') + b''.join(d.to_bytes(4, 'big') for d in array.shape)
    data += array.tobytes()
    with (gzip.open if path.endswith('.gz') else open)(path, 'wb') as f:
        f.write(data)
    return data


def _Batches(dataset, count=None):
    dataset = dataset.take(count) if count is not None else dataset
    return [b.Transform(lambda x: x.numpy()) for b in dataset]


class FashionMnistInputTest(tf.test.TestCase):

    def _TempDir(self):
        # Not create_tempdir(): it reads absl's --test_tmpdir, unparsed under pytest.
        path = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, path)
        return path

    def _WriteSplit(self, data_dir, prefix='train', num=10, gz=True, labels=None, seed=0):
        """Writes `num` random 28x28 images and labels; returns (images, labels)."""
        rng = np.random.RandomState(seed)
        images = rng.randint(0, 256, [num, 28, 28]).astype(np.uint8)
        labels = rng.randint(0, 10, [num]) if labels is None else np.asarray(labels)
        suffix = '.gz' if gz else ''
        _WriteIdx(os.path.join(data_dir, f'{prefix}-images-idx3-ubyte{suffix}'), images)
        _WriteIdx(os.path.join(data_dir, f'{prefix}-labels-idx1-ubyte{suffix}'), labels)
        return images, labels.astype(np.int32)

    def _Params(self, data_dir, **kwargs):
        return image.FashionMnistInput.Params().Set(data_dir=data_dir, batch_size=4, **kwargs)

    def testTrainBatchesHaveTheContractShapesAndDtypes(self):
        data_dir = self._TempDir()
        self._WriteSplit(data_dir)
        batch = _Batches(self._Params(data_dir).Instantiate().TrainDataset(), 1)[0]
        self.assertEqual(sorted(batch), ['images', 'labels', 'weights'])
        self.assertEqual(batch.images.shape, (4, 28, 28, 1))
        self.assertEqual(batch.images.dtype, np.float32)
        self.assertEqual(batch.labels.shape, (4,))
        self.assertEqual(batch.labels.dtype, np.int32)
        self.assertAllEqual(batch.weights, np.ones([4], np.float32))

    def testStoresRawBytesInMemory(self):
        data_dir = self._TempDir()
        images, labels = self._WriteSplit(data_dir)
        examples = self._Params(data_dir).Instantiate().Examples()
        self.assertEqual(examples.images.dtype, np.uint8)
        self.assertAllEqual(examples.images, images)
        self.assertAllEqual(examples.labels, labels)

    def testPlainAndGzippedFilesReadTheSame(self):
        gz_dir, plain_dir = self._TempDir(), self._TempDir()
        self._WriteSplit(gz_dir, gz=True)
        self._WriteSplit(plain_dir, gz=False)
        gz = self._Params(gz_dir).Instantiate().Examples()
        plain = self._Params(plain_dir).Instantiate().Examples()
        self.assertAllEqual(gz.images, plain.images)
        self.assertAllEqual(gz.labels, plain.labels)

    def testImagesAreScaledThenNormalised(self):
        data_dir = self._TempDir()
        images, labels = self._WriteSplit(data_dir, num=4)
        p = self._Params(data_dir)
        batch = _Batches(p.Instantiate().EvalDataset())[0]
        expected = (images[..., np.newaxis] / 255.0 - p.mean) / p.std
        self.assertAllClose(batch.images, expected, atol=1e-5)
        self.assertAllEqual(batch.labels, labels)
        unnormalised = _Batches(self._Params(data_dir, mean=0.0, std=1.0).Instantiate()
                                .EvalDataset())[0]
        self.assertAllClose(unnormalised.images, images[..., np.newaxis] / 255.0, atol=1e-6)

    def testTestSplitReadsTheT10kFiles(self):
        data_dir = self._TempDir()
        self._WriteSplit(data_dir, 'train', num=10, seed=0)
        test_images, _ = self._WriteSplit(data_dir, 't10k', num=3, seed=1)
        test_input = self._Params(data_dir, split='test').Instantiate()
        self.assertEqual(test_input.NumExamples(), 3)
        self.assertAllEqual(test_input.Examples().images, test_images)

    def testEvalDatasetPadsTheLastBatchWithZeroWeights(self):
        data_dir = self._TempDir()
        images, labels = self._WriteSplit(data_dir, num=10)
        batches = _Batches(self._Params(data_dir).Instantiate().EvalDataset())
        self.assertLen(batches, 3)
        self.assertAllEqual(batches[-1].weights, [1, 1, 0, 0])
        self.assertAllEqual(batches[-1].images[2:], np.zeros([2, 28, 28, 1]))
        self.assertAllEqual(batches[-1].labels[2:], [0, 0])
        real = np.concatenate([b.labels for b in batches])[:10]
        self.assertAllEqual(real, labels)

    def testTrainDatasetResumesAtStartStep(self):
        data_dir = self._TempDir()
        self._WriteSplit(data_dir, num=10)
        # 4 steps of 4 cross an epoch boundary of 10 examples.
        full = _Batches(self._Params(data_dir).Instantiate().TrainDataset(0), 6)
        resumed = _Batches(self._Params(data_dir).Instantiate().TrainDataset(start_step=2), 4)
        for expected, actual in zip(full[2:], resumed):
            self.assertAllEqual(actual.images, expected.images)
            self.assertAllEqual(actual.labels, expected.labels)

    def testTrainOrderIsDeterministicBySeed(self):
        data_dir = self._TempDir()
        self._WriteSplit(data_dir, num=10)
        first = _Batches(self._Params(data_dir, seed=3).Instantiate().TrainDataset(), 3)
        again = _Batches(self._Params(data_dir, seed=3).Instantiate().TrainDataset(), 3)
        other = _Batches(self._Params(data_dir, seed=4).Instantiate().TrainDataset(), 3)
        pixels = lambda batches: np.concatenate([b.images.ravel() for b in batches])
        self.assertAllEqual(pixels(first), pixels(again))
        self.assertNotAllEqual(pixels(first), pixels(other))

    def testMissingDirectoryNamesItAndHowToGetTheData(self):
        missing = os.path.join(self._TempDir(), 'nowhere')
        with self.assertRaisesRegex(FileNotFoundError, 'nowhere.*apt-get install '
                                    'dataset-fashion-mnist.*--data_dir'):
            self._Params(missing).Instantiate().Examples()

    def testMissingFileNamesBothPathsLookedFor(self):
        data_dir = self._TempDir()
        self._WriteSplit(data_dir)
        os.remove(os.path.join(data_dir, 'train-labels-idx1-ubyte.gz'))
        path = os.path.join(data_dir, 'train-labels-idx1-ubyte')
        with self.assertRaises(FileNotFoundError) as caught:
            self._Params(data_dir).Instantiate().Examples()
        message = str(caught.exception)
        self.assertIn(path, message)
        self.assertIn(path + '.gz', message)
        self.assertIn('apt-get install dataset-fashion-mnist', message)

    def testBadMagicNumberNamesThePath(self):
        data_dir = self._TempDir()
        self._WriteSplit(data_dir)
        path = os.path.join(data_dir, 'train-images-idx3-ubyte.gz')
        _WriteIdx(path, np.zeros([10, 28, 28]), magic=2049)
        with self.assertRaisesRegex(ValueError, f'{path}: bad magic number 2049, expected 2051'):
            self._Params(data_dir).Instantiate().Examples()

    def testTruncatedFileNamesThePath(self):
        data_dir = self._TempDir()
        self._WriteSplit(data_dir, gz=False)
        path = os.path.join(data_dir, 'train-images-idx3-ubyte')
        with open(path, 'r+b') as f:
            f.truncate(16 + 28 * 28 * 9)
        with self.assertRaisesRegex(ValueError, f'{path}: truncated.*expected {16 + 28 * 28 * 10}'):
            self._Params(data_dir).Instantiate().Examples()

    def testCutOffGzipStreamNamesThePath(self):
        data_dir = self._TempDir()
        self._WriteSplit(data_dir)
        path = os.path.join(data_dir, 'train-images-idx3-ubyte.gz')
        with open(path, 'r+b') as f:
            f.truncate(os.path.getsize(path) // 2)
        with self.assertRaisesRegex(ValueError, path):
            self._Params(data_dir).Instantiate().Examples()

    def testImageLabelCountMismatchNamesBothPaths(self):
        data_dir = self._TempDir()
        self._WriteSplit(data_dir, num=10)
        labels_path = os.path.join(data_dir, 'train-labels-idx1-ubyte.gz')
        _WriteIdx(labels_path, np.zeros([9]))
        with self.assertRaisesRegex(ValueError, '10 images but .*train-labels-idx1-ubyte.gz has 9 '
                                    'labels'):
            self._Params(data_dir).Instantiate().Examples()

    def testLabelsOutsideNumClassesNameThePath(self):
        data_dir = self._TempDir()
        self._WriteSplit(data_dir, num=4, labels=[0, 9, 10, 200])
        path = os.path.join(data_dir, 'train-labels-idx1-ubyte.gz')
        with self.assertRaisesRegex(ValueError, rf'{path}: 2 labels outside \[0, 10\): values '
                                    r'\[10, 200\]'):
            self._Params(data_dir).Instantiate().Examples()
        # A larger num_classes accepts them.
        self.assertEqual(self._Params(data_dir, num_classes=201).Instantiate().NumExamples(), 4)

    def testFilesOfNoImagesNameTheImagesFile(self):
        data_dir = self._TempDir()
        self._WriteSplit(data_dir, num=0)
        path = os.path.join(data_dir, 'train-images-idx3-ubyte.gz')
        with self.assertRaisesRegex(errors.InputError, f'{path} holds 0 images; expected at '
                                    f'least one for the train split'):
            self._Params(data_dir).Instantiate().Examples()

    def testImagesOfAnotherSizeNameTheFileAndBothSizes(self):
        data_dir = self._TempDir()
        self._WriteSplit(data_dir, num=4)
        path = os.path.join(data_dir, 'train-images-idx3-ubyte.gz')
        _WriteIdx(path, np.zeros([4, 10, 12]))
        with self.assertRaisesRegex(errors.InputError, f'{path} holds 10x12 images; expected '
                                    f'28x28'):
            self._Params(data_dir).Instantiate().Examples()
        # image_size None takes the files' own size.
        inp = self._Params(data_dir, image_size=None).Instantiate()
        self.assertEqual(next(iter(inp.TrainDataset())).images.shape, [4, 10, 12, 1])

    def testUnknownSplitIsRejected(self):
        with self.assertRaisesRegex(errors.ConfigError, "split must be one of .* got 'validation'"):
            self._Params('/tmp', split='validation').Instantiate()

    def testRealFashionMnist(self):
        if not os.path.isdir(FASHION_MNIST_DIR):
            self.skipTest(f'{FASHION_MNIST_DIR} is absent (apt-get install dataset-fashion-mnist).')
        train = image.FashionMnistInput.Params().Set(split='train').Instantiate()
        test = image.FashionMnistInput.Params().Set(split='test').Instantiate()
        self.assertEqual(train.NumExamples(), 60000)
        self.assertEqual(test.NumExamples(), 10000)
        self.assertEqual(train.Examples().images.shape, (60000, 28, 28))
        self.assertAllEqual(np.bincount(train.Examples().labels, minlength=10), [6000] * 10)
        # The default mean and std are the training set's.
        pixels = train.Examples().images / 255.0
        self.assertAllClose([pixels.mean(), pixels.std()], [train.p.mean, train.p.std], atol=1e-4)


class DigitsInputTest(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        if not HAVE_SKLEARN:
            self.skipTest('scikit-learn is not installed (pip install scikit-learn).')

    def _Params(self, **kwargs):
        return image.DigitsInput.Params().Set(batch_size=8, **kwargs)

    def testSplitsPartitionTheDataset(self):
        train = self._Params(split='train').Instantiate()
        test = self._Params(split='test').Instantiate()
        self.assertEqual(train.NumExamples() + test.NumExamples(), 1797)
        self.assertEqual(test.NumExamples(), round(0.2 * 1797))
        self.assertEmpty(np.intersect1d(train.SplitIndices(), test.SplitIndices()))
        self.assertAllEqual(np.union1d(train.SplitIndices(), test.SplitIndices()), np.arange(1797))

    def testStoredExamplesAreTheSplitsRowsOfLoadDigits(self):
        from sklearn import datasets  # pylint: disable=g-import-not-at-top
        digits = datasets.load_digits()
        test = self._Params(split='test').Instantiate()
        indices = test.SplitIndices()
        self.assertAllEqual(test.Examples().images, digits.images[indices])
        self.assertAllEqual(test.Examples().labels, digits.target[indices])

    def testSplitIsStableAcrossInstancesAndSeeds(self):
        first = self._Params(split='test', seed=0).Instantiate()
        second = self._Params(split='test', seed=5).Instantiate()
        self.assertAllEqual(first.SplitIndices(), second.SplitIndices())
        self.assertAllEqual(first.Examples().images, second.Examples().images)

    def testBatchesAreScaledAndNormalised(self):
        test = self._Params(split='test').Instantiate()
        batch = _Batches(test.EvalDataset(), 1)[0]
        self.assertEqual(batch.images.shape, (8, 8, 8, 1))
        self.assertEqual(batch.images.dtype, np.float32)
        self.assertEqual(batch.labels.dtype, np.int32)
        raw = test.Examples().images[:8, ..., np.newaxis]
        self.assertAllClose(batch.images, (raw / 16.0 - test.p.mean) / test.p.std, atol=1e-5)

    def testImageSizeResizes(self):
        batch = _Batches(self._Params(image_size=16).Instantiate().TrainDataset(), 1)[0]
        self.assertEqual(batch.images.shape, (8, 16, 16, 1))

    def testEvalDatasetCoversTheSplitOnce(self):
        test = self._Params(split='test').Instantiate()
        batches = _Batches(test.EvalDataset())
        self.assertLen(batches, -(-test.NumExamples() // 8))
        self.assertEqual(sum(b.weights.sum() for b in batches), test.NumExamples())

    def testBadTestFractionIsRejected(self):
        with self.assertRaisesRegex(errors.ConfigError,
                                    r'test_fraction must lie in \(0, 1\), got 1.5'):
            self._Params(test_fraction=1.5).Instantiate()


class DigitsWithoutSklearnTest(tf.test.TestCase):

    def testMissingSklearnSaysHowToInstallIt(self):
        with mock.patch.dict(sys.modules, {'sklearn': None, 'sklearn.datasets': None}):
            with self.assertRaisesRegex(ImportError, 'pip install scikit-learn'):
                image.DigitsInput.Params().Instantiate().Examples()


class SyntheticImageInputTest(tf.test.TestCase):

    def _Params(self, **kwargs):
        return image.SyntheticImageInput.Params().Set(
            image_size=6, num_channels=2, num_classes=5, num_examples_total=200,
            batch_size=4).Set(**kwargs)

    def testBatchShapesAndDtypes(self):
        batch = _Batches(self._Params().Instantiate().TrainDataset(), 1)[0]
        self.assertEqual(batch.images.shape, (4, 6, 6, 2))
        self.assertEqual(batch.images.dtype, np.float32)
        self.assertEqual(batch.labels.dtype, np.int32)
        self.assertAllEqual(batch.weights, np.ones([4]))

    def testLabelsComeFromALinearTeacherOverEveryClass(self):
        examples = self._Params().Instantiate().Examples()
        self.assertEqual(examples.images.shape, (200, 6, 6, 2))
        self.assertAllEqual(np.unique(examples.labels), np.arange(5))
        # A linear teacher: least squares on the one-hot labels separates them far above chance.
        x = examples.images.reshape(200, -1)
        w = np.linalg.lstsq(x, np.eye(5)[examples.labels], rcond=None)[0]
        self.assertGreater(np.mean(np.argmax(x @ w, 1) == examples.labels), 0.9)

    def testDeterministicBySeed(self):
        first = self._Params(seed=1).Instantiate().Examples()
        again = self._Params(seed=1).Instantiate().Examples()
        other = self._Params(seed=2).Instantiate().Examples()
        self.assertAllEqual(first.images, again.images)
        self.assertAllEqual(first.labels, again.labels)
        self.assertNotAllEqual(first.images, other.images)

    def testNonPositiveSizeIsRejected(self):
        with self.assertRaisesRegex(ValueError, 'num_channels must be a positive integer, got 0'):
            self._Params(num_channels=0).Instantiate()


if __name__ == '__main__':
    tf.test.main()
