"""Image classification inputs: Fashion-MNIST, scikit-learn's digits, and synthetic images.

Every batch is `NestedMap(images=float32 [B, H, W, C], labels=int32 [B], weights=float32 [B])`.
The real datasets are held in memory as their raw uint8 pixels (a quarter of float32's size);
`_Preprocess` scales and normalises each batch inside tf.data.
"""

from __future__ import annotations

import gzip
import os

import numpy as np
import tensorflow as tf

from gpipe_tf import errors
from gpipe_tf import hyperparams
from gpipe_tf.input import base_input
from gpipe_tf.nested_map import NestedMap

_SPLITS = ('train', 'test')

# IDX magic numbers: two zero bytes, the element type (0x08: unsigned byte), the number of dims.
IDX_IMAGES_MAGIC = 2051
IDX_LABELS_MAGIC = 2049

# The order of scikit-learn's digits is fixed, so a permutation from this seed makes a fixed
# split. Changing it would silently move examples between train and test; don't.
DIGITS_SPLIT_SEED = 20240607


def _CheckSplit(p: hyperparams.Params) -> None:
    if p.split not in _SPLITS:
        raise errors.ConfigError(f'{p.name}: split must be one of {_SPLITS}, got {p.split!r}.')


def _CheckNormalisation(p: hyperparams.Params) -> None:
    if not p.std or p.std <= 0:
        raise errors.ConfigError(f'{p.name}: std must be positive, got {p.std!r}.')


def _Normalise(pixels: tf.Tensor, max_value: float, mean: float, std: float) -> tf.Tensor:
    """Integer pixels in [0, max_value] → float32 in [0, 1], then (x - mean) / std."""
    scaled = tf.cast(pixels, tf.float32) / max_value
    return (scaled - mean) / std


def _CheckLabels(labels: np.ndarray, num_classes: int, where: str) -> None:
    bad = (labels < 0) | (labels >= num_classes)
    if bad.any():
        values = sorted(set(labels[bad].tolist()))
        raise errors.InputError(f'{where}: {bad.sum()} labels outside [0, {num_classes}): '
                                f'values {values[:10]}{" ..." if len(values) > 10 else ""}.')


# ---- IDX files ----------------------------------------------------------------------------------
def ReadIdx(path: str, expected_magic: int) -> np.ndarray:
    """Reads an IDX file of unsigned bytes (gzipped when `path` ends in `.gz`).

    IDX (LeCun's MNIST format): a big-endian uint32 magic number whose low byte is the number of
    dimensions, that many big-endian uint32 sizes, then the values in C order. numpy reads it in a
    few lines, so there's no need for TF's or tfds' readers (and their dependencies).

    Args:
      path: the file.
      expected_magic: IDX_IMAGES_MAGIC (3 dims) or IDX_LABELS_MAGIC (1 dim).

    Returns:
      A uint8 array of the shape the header gives.

    Raises:
      errors.InputError (a ValueError): on a bad magic number, a truncated or overlong file,
        or a corrupt gzip stream.
    """
    opener = gzip.open if path.endswith('.gz') else open
    try:
        with opener(path, 'rb') as f:
            data = f.read()
    except FileNotFoundError:
        raise
    except (OSError, EOFError) as e:  # gzip.BadGzipFile is an OSError; a cut-off stream, EOFError.
        raise errors.InputError(f'{path}: cannot read it as an IDX file: {e}') from e
    if len(data) < 4:
        raise errors.InputError(f'{path}: truncated: {len(data)} bytes, expected at least a '
                                f'4-byte IDX header with magic number {expected_magic}.')
    magic = int.from_bytes(data[:4], 'big')
    if magic != expected_magic:
        raise errors.InputError(f'{path}: bad magic number {magic}, expected {expected_magic} '
                                f'(an IDX file of unsigned bytes with {expected_magic & 0xff} '
                                f'dimensions).')
    rank = magic & 0xff
    header = 4 + 4 * rank
    if len(data) < header:
        raise errors.InputError(f'{path}: truncated: {len(data)} bytes, expected a {header}-byte '
                                f'header.')
    shape = tuple(int(d) for d in np.frombuffer(data, '>u4', count=rank, offset=4))
    expected = header + int(np.prod(shape))
    if len(data) != expected:
        raise errors.InputError(f'{path}: {"truncated" if len(data) < expected else "overlong"}'
                                f': {len(data)} bytes, expected {expected} for shape '
                                f'{list(shape)}.')
    return np.frombuffer(data, np.uint8, offset=header).reshape(shape)


_HOW_TO_GET_FASHION_MNIST = (
    'Install Debian\'s copy with `apt-get install dataset-fashion-mnist` (it puts the IDX files '
    'in /usr/share/datasets/fashion-mnist), or point the data_dir param (a trainer\'s '
    '--data_dir) at a directory holding train-images-idx3-ubyte[.gz], '
    'train-labels-idx1-ubyte[.gz], t10k-images-idx3-ubyte[.gz] and t10k-labels-idx1-ubyte[.gz].')


def _FindIdx(data_dir: str, stem: str) -> str:
    """The path of `stem` or `stem.gz` in `data_dir` (the plain file if both exist)."""
    candidates = [os.path.join(data_dir, stem), os.path.join(data_dir, stem + '.gz')]
    for path in candidates:
        if os.path.isfile(path):
            return path
    raise errors.MissingInputError(
        f'Fashion-MNIST file not found: looked for {candidates[0]} and {candidates[1]}. '
        f'{_HOW_TO_GET_FASHION_MNIST}')


# ---- Fashion-MNIST ------------------------------------------------------------------------------
class FashionMnistInput(base_input.BaseInput):
    """Fashion-MNIST (Xiao et al. 2017) from its IDX files: 60000 train / 10000 test, 28x28.

    Images come out as float32 [B, image_size, image_size, 1]: pixels / 255, normalised by `mean`
    and `std`. Files of another image size are an error (unless image_size is None), found when
    they are read rather than as a shape error inside the model.
    """

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = super().Params()
        p.name = 'fashion_mnist'
        p.Define('data_dir', '/usr/share/datasets/fashion-mnist',
                 'Directory of the IDX files, plain or gzipped (Debian\'s dataset-fashion-mnist '
                 'installs them here).')
        p.Define('split', 'train', '\'train\' (60000 examples) or \'test\' (the t10k files, '
                 '10000).')
        p.Define('num_classes', 10, 'Labels must lie in [0, num_classes).')
        p.Define('image_size', 28, 'Height and width the IDX files\' images must have (the '
                 'model\'s input size); None: whatever the files hold.',
                 check=hyperparams.OrNone(hyperparams.Integer(at_least=1)))
        p.Define('mean', 0.2860, 'Mean of the [0, 1]-scaled training pixels, subtracted.')
        p.Define('std', 0.3530, 'Standard deviation of the [0, 1]-scaled training pixels, '
                 'divided by.')
        return p

    def __init__(self, params: hyperparams.Params):
        super().__init__(params)
        _CheckSplit(self.p)
        _CheckNormalisation(self.p)

    def _LoadExamples(self) -> NestedMap:
        p = self.p
        if not os.path.isdir(p.data_dir):
            raise errors.MissingInputError(f'{p.name}: Fashion-MNIST directory {p.data_dir} '
                                           f'does not exist. {_HOW_TO_GET_FASHION_MNIST}')
        prefix = 'train' if p.split == 'train' else 't10k'
        images_path = _FindIdx(p.data_dir, f'{prefix}-images-idx3-ubyte')
        labels_path = _FindIdx(p.data_dir, f'{prefix}-labels-idx1-ubyte')
        images = ReadIdx(images_path, IDX_IMAGES_MAGIC)
        labels = ReadIdx(labels_path, IDX_LABELS_MAGIC)
        if not len(images):
            raise errors.InputError(f'{p.name}: {images_path} holds 0 images; expected at least '
                                    f'one for the {p.split} split.')
        size = list(images.shape[1:])
        if p.image_size is not None and size != [p.image_size] * 2:
            raise errors.InputError(f'{p.name}: {images_path} holds {size[0]}x{size[1]} images; '
                                    f'expected {p.image_size}x{p.image_size}, the model\'s '
                                    f'input size (param image_size).')
        if len(images) != len(labels):
            raise errors.InputError(f'{p.name}: {images_path} has {len(images)} images but '
                                    f'{labels_path} has {len(labels)} labels; expected equal '
                                    f'counts.')
        _CheckLabels(labels, p.num_classes, labels_path)
        return NestedMap(images=images, labels=labels.astype(np.int32))

    def _Preprocess(self, batch: NestedMap) -> NestedMap:
        images = _Normalise(batch.images, 255.0, self.p.mean, self.p.std)
        return NestedMap(images=images[..., tf.newaxis], labels=batch.labels)


# ---- scikit-learn's digits ----------------------------------------------------------------------
def DigitsSplitIndices(split: str, test_fraction: float, num_examples: int = 1797) -> np.ndarray:
    """Indices into `sklearn.datasets.load_digits()` of one split, ascending.

    The test split is the first round(test_fraction * num_examples) positions of
    `np.random.RandomState(DIGITS_SPLIT_SEED).permutation(num_examples)`; train is the rest. The
    split depends on nothing else, so it is the same in every run and on every machine.
    """
    num_test = int(round(test_fraction * num_examples))
    order = np.random.RandomState(DIGITS_SPLIT_SEED).permutation(num_examples)
    return np.sort(order[:num_test] if split == 'test' else order[num_test:])


class DigitsInput(base_input.BaseInput):
    """scikit-learn's 8x8 handwritten digits (1797 images, pixels 0..16, 10 classes).

    Bundled with scikit-learn, so no download. The dataset has no official split; see
    `DigitsSplitIndices` for the fixed one used here. Images come out as float32
    [B, image_size, image_size, 1]: pixels / 16, resized bilinearly when image_size != 8,
    normalised by `mean` and `std`.
    """

    NATIVE_SIZE = 8

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = super().Params()
        p.name = 'digits'
        p.Define('split', 'train', '\'train\' or \'test\' (a fixed, seeded split; see '
                 'DigitsSplitIndices).')
        p.Define('test_fraction', 0.2, 'Fraction of the 1797 examples in the test split.')
        p.Define('image_size', 8, 'Height and width of the output images; other than 8 resizes '
                 'bilinearly.')
        p.Define('mean', 0.3053, 'Mean of the [0, 1]-scaled pixels, subtracted.')
        p.Define('std', 0.3760, 'Standard deviation of the [0, 1]-scaled pixels, divided by.')
        return p

    def __init__(self, params: hyperparams.Params):
        super().__init__(params)
        p = self.p
        _CheckSplit(p)
        _CheckNormalisation(p)
        if not 0 < p.test_fraction < 1:
            raise errors.ConfigError(f'{p.name}: test_fraction must lie in (0, 1), got '
                                     f'{p.test_fraction!r}.')
        if not isinstance(p.image_size, int) or p.image_size < 1:
            raise errors.ConfigError(f'{p.name}: image_size must be a positive integer, got '
                                     f'{p.image_size!r}.')

    def SplitIndices(self) -> np.ndarray:
        """Indices of this split's examples in `load_digits()`, in the order they are stored."""
        return DigitsSplitIndices(self.p.split, self.p.test_fraction)

    def _LoadExamples(self) -> NestedMap:
        try:
            from sklearn import datasets  # pylint: disable=g-import-not-at-top
        except ImportError as e:
            raise ImportError(f'{self.p.name}: DigitsInput needs scikit-learn for its bundled '
                              f'digits dataset: `pip install scikit-learn`.') from e
        digits = datasets.load_digits()
        indices = DigitsSplitIndices(self.p.split, self.p.test_fraction, len(digits.target))
        # Pixels are integers 0..16, stored exactly as uint8.
        return NestedMap(images=digits.images[indices].astype(np.uint8),
                         labels=digits.target[indices].astype(np.int32))

    def _Preprocess(self, batch: NestedMap) -> NestedMap:
        images = tf.cast(batch.images[..., tf.newaxis], tf.float32) / 16.0
        if self.p.image_size != self.NATIVE_SIZE:
            images = tf.image.resize(images, [self.p.image_size] * 2, method='bilinear')
        images = (images - self.p.mean) / self.p.std
        return NestedMap(images=images, labels=batch.labels)


# ---- synthetic ----------------------------------------------------------------------------------
class SyntheticImageInput(base_input.BaseInput):
    """Gaussian images labelled by a fixed random linear teacher: learnable, for benchmarks.

    Images are i.i.d. N(0, 1) float32 [image_size, image_size, num_channels]; the label of image x
    is argmax(flatten(x) @ W) with W [H * W * C, num_classes] Gaussian, so a model can fit the
    labels exactly. Images come from `np.random.RandomState(seed)`, the teacher from
    `np.random.RandomState(teacher_seed)`: splits with different seeds share the teacher (the
    same labelling rule) but not the images. The whole set is held in memory
    as float32: num_examples_total * image_size^2 * num_channels * 4 bytes.
    """

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = super().Params()
        p.name = 'synthetic_image'
        p.Define('image_size', 32, 'Height and width of the images.')
        p.Define('num_channels', 3, 'Channels of the images.')
        p.Define('num_classes', 10, 'Number of classes of the teacher.')
        p.Define('num_examples_total', 1024, 'Number of distinct examples generated.')
        p.Define('teacher_seed', 0, 'Seed of the labelling teacher; keep it equal across splits.')
        return p

    def __init__(self, params: hyperparams.Params):
        super().__init__(params)
        for name in ('image_size', 'num_channels', 'num_classes', 'num_examples_total'):
            value = self.p.Get(name)
            if not isinstance(value, int) or value < 1:
                raise errors.ConfigError(f'{self.p.name}: {name} must be a positive integer, '
                                         f'got {value!r}.')

    def _LoadExamples(self) -> NestedMap:
        p = self.p
        rng = np.random.RandomState(p.seed)
        shape = [p.num_examples_total, p.image_size, p.image_size, p.num_channels]
        images = rng.standard_normal(shape).astype(np.float32)
        teacher = np.random.RandomState(p.teacher_seed).standard_normal(
            [int(np.prod(shape[1:])), p.num_classes]).astype(np.float32)
        labels = np.argmax(images.reshape(shape[0], -1) @ teacher, axis=1).astype(np.int32)
        return NestedMap(images=images, labels=labels)


# Fashion-MNIST's label names, by label (Zalando's README).
FASHION_MNIST_CLASSES = ('T-shirt/top', 'Trouser', 'Pullover', 'Dress', 'Coat', 'Sandal',
                         'Shirt', 'Sneaker', 'Bag', 'Ankle boot')


def ClassNames(input_params) -> tuple[str, ...] | None:
    """Names of the labels of an image input's dataset, or None when they are just numbers."""
    if issubclass(input_params.cls, FashionMnistInput):
        return FASHION_MNIST_CLASSES
    if issubclass(input_params.cls, DigitsInput):
        return tuple(str(d) for d in range(10))
    return None
