"""Decoding with a trained task: classify image files, or translate sentences.

Inputs are padded to the model's batch size (the pipeline splits a fixed batch into M
micro-batches) and run in inference mode (`fprop_context.Inference()`), so that the padding and
the other inputs of a request change no input's answer.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import tensorflow as tf

from gpipe_tf import errors
from gpipe_tf.input import image as image_input
from gpipe_tf.input import vocabulary
from gpipe_tf.layers import fprop_context
from gpipe_tf.tasks import classifier
from gpipe_tf.tasks import sequence


def _Batches(rows: np.ndarray, batch_size: int):
    """(padded batch, number of real rows) chunks of `rows`."""
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        pad = np.zeros((batch_size - len(chunk),) + chunk.shape[1:], chunk.dtype)
        yield np.concatenate([chunk, pad]), len(chunk)


def _Text(vocab, ids) -> str:
    """Decoded text of `ids`; ids the model's softmax has beyond the vocabulary (it may be
    larger, as TransformerTiny's 256 over a 188-token vocabulary) read as <unk>."""
    ids = np.where(np.asarray(ids) < vocab.size, ids, vocabulary.UNK_ID)
    return vocab.Decode(ids)


# The first bytes of the formats `tf.io.decode_image` reads.
_IMAGE_SIGNATURES = ((b'\x89PNG\r\n\x1a\n', 'PNG'), (b'\xff\xd8\xff', 'JPEG'),
                     (b'GIF87a', 'GIF'), (b'GIF89a', 'GIF'), (b'BM', 'BMP'))


def _Reason(error: Exception, path: str) -> str:
    """What an OpError or OSError about `path` says (`errors.Reason`), in lower case where it
    follows our words: 'permission denied'."""
    message = errors.Reason(error, path)
    return message[:1].lower() + message[1:]


def _ImageFileBytes(path: str, size: int = -1) -> bytes:
    """The first `size` bytes (-1: all) of the image file `path`, checked to start as a PNG,
    JPEG, GIF or BMP image does: read without TensorFlow's runtime, which a request is checked
    before (the devices are not set up yet).

    Raises:
      FileNotFoundError: for a missing file; errors.InputError: for one that cannot be read or
        is not an image.
    """
    if not tf.io.gfile.exists(path) or tf.io.gfile.isdir(path):
        raise FileNotFoundError(f'decode: no image file {errors.Excerpt(path)}.')
    try:
        with tf.io.gfile.GFile(path, 'rb') as f:
            data = f.read(size)
    except (tf.errors.OpError, OSError) as error:
        raise errors.InputError(f'decode: cannot read the image file {errors.Excerpt(path)} '
                                f'({_Reason(error, path)}).') from None
    if not any(data.startswith(signature) for signature, _ in _IMAGE_SIGNATURES):
        raise errors.InputError(f'decode: {errors.Excerpt(path)} is not a PNG, JPEG, GIF or BMP '
                                f'image (it starts with {data[:8]!r}).')
    return data


def _InChannels(pixels, channels: int):
    """Decoded pixels [height, width, c] (c: 1 grey, 2 grey and alpha, 3 RGB, 4 RGBA) as
    `channels` (1 or 3) of float32: alpha dropped, RGB to grey with tf.image's luma weights,
    grey to RGB repeated. Converted here rather than by `tf.io.decode_image(channels=...)`,
    whose GIF and BMP decoders refuse channels=1."""
    pixels = tf.cast(pixels, tf.float32)
    have = pixels.shape[-1]
    if have in (2, 4):
        pixels = pixels[..., :have - 1]
    if channels == 1 and have >= 3:
        return tf.image.rgb_to_grayscale(pixels)
    if channels == 3 and have <= 2:
        return tf.image.grayscale_to_rgb(pixels)
    return pixels


def _RequireTargetLanguage(target_language: str | None) -> None:
    if not target_language:
        raise ValueError('decode: translation needs --target_language (e.g. de).')


def _CannotDecode(task_name: str) -> ValueError:
    return ValueError(f'decode: {task_name} cannot decode (image classification and '
                      'translation tasks can).')


class ImageSpec(NamedTuple):
    """What a classifier's input images are: size x size x channels, normalised by mean, std."""
    size: int
    channels: int
    mean: float
    std: float

    @classmethod
    def Of(cls, task_params) -> 'ImageSpec':
        """The spec of task Params' input (its input Params, else the model's input shapes)."""
        data = task_params.input
        shapes = task_params.model.input_shapes
        return cls(size=data.image_size if 'image_size' in data else shapes['images'][1],
                   channels=data.num_channels if 'num_channels' in data else
                   shapes['images'][3],
                   mean=float(data.mean) if 'mean' in data else 0.0,
                   std=float(data.std) if 'std' in data else 1.0)

    def Normalize(self, pixels):
        """uint8 pixels [..., height, width, channels] of any size as the model's input: scaled
        to [0, 1], resized to size x size and normalised like the training data."""
        pixels = tf.image.resize(tf.cast(pixels, tf.float32) / 255.0, [self.size, self.size])
        return (pixels - self.mean) / self.std


def LoadImage(path: str, spec: ImageSpec):
    """An image file (PNG, JPEG, GIF, BMP) as the model's input: [size, size, channels] float32
    (`ImageSpec.Normalize`).

    The file's own channels are decoded (a GIF's RGB, a BMP's grey, a CMYK JPEG's RGB), then
    converted to the model's (`_InChannels`).

    Raises:
      FileNotFoundError: for a missing file; errors.InputError: for a file that cannot be read
        or is not an image.
    """
    data = _ImageFileBytes(path)
    try:
        pixels = tf.io.decode_image(data, channels=0, expand_animations=False)
    except tf.errors.InvalidArgumentError as error:
        raise errors.InputError(f'decode: {errors.Excerpt(path)} is not a PNG, JPEG, GIF or BMP '
                                f'image ({_Reason(error, path)}).') from None
    return spec.Normalize(_InChannels(pixels, spec.channels)).numpy()


def ClassifyImages(task, task_params, paths: list[str]) -> list[tuple[str, str]]:
    """(path, 'label (probability)') for each image file."""
    data = task_params.input
    spec = ImageSpec.Of(task_params)
    names = image_input.ClassNames(data)
    images = np.stack([LoadImage(p, spec) for p in paths])
    predict = tf.function(task.Predict, autograph=False)
    results = []
    for batch, count in _Batches(images, data.batch_size):
        probs = predict(tf.constant(batch)).numpy()[:count]
        for probabilities in probs:
            label = int(np.argmax(probabilities))
            name = names[label] if names else str(label)
            results.append(f'{name} ({probabilities[label]:.3f})')
    return list(zip(paths, results))


def _Translations(task, vocab, src_ids, src_paddings, batch_size: int) -> list[str]:
    """Greedy translations of encoded sources, in model-sized batches (padding rows are all
    padding)."""
    texts = []
    for (ids, count), (paddings, _) in zip(_Batches(src_ids, batch_size),
                                           _Batches(src_paddings, batch_size)):
        paddings[count:] = 1.0
        texts += [_Text(vocab, row) for row in task.Decode(ids, paddings)[:count]]
    return texts


def Translate(task, task_params, sentences: list[str], target_language: str
              ) -> list[tuple[str, str]]:
    """(sentence, translation into `target_language`) for each sentence."""
    _RequireTargetLanguage(target_language)
    data = task_params.input.Instantiate()
    encoded = data.EncodeSources(sentences, target_language)
    return list(zip(sentences, _Translations(task, data.vocab, encoded.src_ids,
                                             encoded.src_paddings, task_params.input.batch_size)))


def CheckRequest(task_params, lines: list[str], target_language: str | None) -> None:
    """Checks a decode request against task Params before any model is built or restored: the
    task decodes, image files exist, a translation names a language the vocabulary knows and
    every sentence fits max_length.

    Raises:
      ValueError (FileNotFoundError for a missing image): naming what is wrong.
    """
    if issubclass(task_params.cls, classifier.ClassifierTask):
        channels = ImageSpec.Of(task_params).channels
        if channels not in (1, 3):
            raise ValueError(f'decode: {task_params.cls.__name__} takes {channels}-channel '
                             'images; decode reads them as grey (1 channel) or RGB (3).')
        for path in lines:
            _ImageFileBytes(path, size=8)
        return
    if issubclass(task_params.cls, sequence.SequenceTask) and task_params.translation:
        _RequireTargetLanguage(target_language)
        try:
            task_params.input.Instantiate().EncodeSources(lines, target_language)
        except errors.InputError as error:  # A sentence the model cannot take.
            raise errors.InputError(f'decode: {error}') from None
        except ValueError as error:  # The vocabulary has no such language.
            raise ValueError(f'decode: --target_language={errors.Excerpt(target_language)}: '
                             f'{error}') from None
        return
    raise _CannotDecode(task_params.cls.__name__)


def Decode(task, task_params, lines: list[str], target_language: str | None):
    """Classifies (image tasks) or translates (translation tasks) `lines`, in inference mode
    (`fprop_context.Inference()`): each line's answer is the same whatever other lines come with
    it, and no variable changes."""
    with fprop_context.Inference():
        if isinstance(task, classifier.ClassifierTask):
            return ClassifyImages(task, task_params, lines)
        if isinstance(task, sequence.SequenceTask) and task.p.translation:
            return Translate(task, task_params, lines, target_language)
    raise _CannotDecode(type(task).__name__)


def EvaluateBleu(task, input_params, max_sentences: int | None = None) -> tuple[float, list]:
    """Corpus BLEU (sacrebleu) of greedy translations of a split: (bleu, [(src, hyp, ref)])."""
    from gpipe_tf.input import text  # pylint: disable=g-import-not-at-top
    data = input_params.Instantiate()
    rows = data.Sentences()[:max_sentences]
    examples = data.Examples()
    hypotheses = _Translations(task, data.vocab, examples.src_ids[:len(rows)],
                               examples.src_paddings[:len(rows)], input_params.batch_size)
    references = [row[3] for row in rows]
    bleu = text.Bleu(hypotheses, references)
    return bleu, [(row[2], h, row[3]) for row, h in zip(rows, hypotheses)]
