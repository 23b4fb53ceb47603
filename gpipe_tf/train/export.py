"""Export: a trained task as a SavedModel that TensorFlow Serving and `tf.saved_model.load` serve.

The SavedModel holds the task's variables and serving functions whose graphs do all the work,
raw input to readable output, so that loading needs TensorFlow alone (not gpipe_tf):

  image classifiers
    serving_default(images: uint8 [N, height, width, channels], any size)
        -> probabilities [N, classes] float32, classes [N] int32, labels [N] string
        (images are scaled to [0, 1], resized to the model's size and normalised as in
        training, as `--mode=decode` does for image files);
    predict(images: float32 [N, size, size, channels], model-ready) -> the same outputs.
  translation
    serving_default(sentences: string [N], target_language: string [])
        -> translations [N] string, ids [N, T] int32, scores [N] float32 (each translation's
        log-probability): beam search of the task's beam_size (1: greedy), incremental, as
        `--mode=decode`.

Every function computes in inference mode (`fprop_context.Inference()`, set where each
function's work starts): batch norm normalises with its moving statistics, dropout and drop-path
are off, and no variable is assigned, so an input's answer is the same whatever else is in the
request, and serving changes nothing.

N is any number: the functions run the model on batches of its training batch size (the
pipeline splits each into M micro-batches), the last one padded. The pipeline stays pipelined:
each cell's ops keep the device they have in the exporting process, which a loading process
must have too (the same number of devices, or soft placement, TensorFlow's default in eager
mode, puts them on what it has).

    export_dir = export.Export(task, task_params, '<logdir>/export/<step>')

The trainer's `--mode=export` writes `<logdir>/export/<step>/`: a base path with numeric
versions, TensorFlow Serving's model layout.
"""

from __future__ import annotations

import os
import time

import tensorflow as tf

from gpipe_tf.input import image as image_input
from gpipe_tf.input import vocabulary
from gpipe_tf.layers import fprop_context
from gpipe_tf.tasks import classifier
from gpipe_tf.tasks import sequence
from gpipe_tf.train import decode
from gpipe_tf.train import logdir as logdir_lib


class ExportError(ValueError):
    """The task cannot be exported (a language model, a task of another kind)."""


def Export(task, task_params, export_dir: str, report=None) -> str:
    """Writes `task` (its variables as they are now) as a SavedModel in `export_dir`.

    Args:
      task: the built task, restored from a checkpoint.
      task_params: its Params (the input Params give image sizes and the vocabulary).
      export_dir: where to write; must not exist yet (a version is never overwritten).
      report: None, or a function called with a line of progress at each phase (tracing the
        functions, writing; each takes seconds to a minute for a pipelined model).

    Returns:
      export_dir.

    Raises:
      ExportError: for a task that cannot be exported.
      FileExistsError: if export_dir exists.
      NotADirectoryError: if the directory of export_dir is a file (`CheckBase`).
    """
    CheckBase(os.path.dirname(export_dir.rstrip('/')))
    if tf.io.gfile.exists(export_dir):
        raise FileExistsError(f'export: {export_dir} exists; a version is never overwritten '
                              '(remove it, or train on and export the newer step).')
    report = report or (lambda line: None)
    start = time.time()
    servable = MakeServable(task, task_params)
    report('export: tracing the serving functions')
    signatures = servable.Signatures()
    report(f'export: traced {", ".join(signatures)} in {time.time() - start:.0f} s; writing the '
           'SavedModel')
    # Written beside, then renamed: a server watching the base path never sees half a version.
    partial = export_dir.rstrip('/') + '.partial'
    with logdir_lib.Writing(partial, 'the SavedModel'):
        if tf.io.gfile.exists(partial):
            tf.io.gfile.rmtree(partial)
        try:
            tf.saved_model.save(servable, partial, signatures=signatures)
            tf.io.gfile.rename(partial, export_dir)
        except (OSError, tf.errors.OpError):
            if tf.io.gfile.exists(partial):  # Nothing half-written is left behind.
                tf.io.gfile.rmtree(partial)
            raise
    report(f'export: done in {time.time() - start:.0f} s')
    return export_dir


def CheckBase(base: str) -> None:
    """Checks that versions can be written under the base path `base`: a directory, or
    nothing yet (it is created).

    Raises:
      NotADirectoryError: naming `base` when it is a file.
    """
    if base and tf.io.gfile.exists(base) and not tf.io.gfile.isdir(base):
        raise NotADirectoryError(f'export: {base} is a file, not a directory; the export base '
                                 'path must be a directory of numeric versions (TensorFlow '
                                 'Serving\'s layout): move the file away.')


def MakeServable(task, task_params) -> tf.Module:
    """The module `Export` saves, for a classifier or a translation task.

    Raises:
      ExportError: for a task that is neither.
    """
    if isinstance(task, classifier.ClassifierTask):
        return ClassifierServable(task, task_params)
    if isinstance(task, sequence.SequenceTask):
        if not task.p.translation:
            raise ExportError(f'export: {task.p.name} is a language model; export serves image '
                              'classifiers and translation models.')
        return TranslationServable(task, task_params)
    raise ExportError(f'export: {type(task).__name__} cannot be exported; export serves image '
                      'classifiers and translation models.')


def Batched(fn, inputs, batch_size: int, output_spec):
    """`fn` (which takes exactly `batch_size` rows) applied to any number of rows of `inputs`
    (a tensor or a tuple of tensors with the same first dimension): in batches, the last one
    padded with zeros, the padding's outputs dropped."""
    inputs = tuple(inputs) if isinstance(inputs, (list, tuple)) else (inputs,)
    count = tf.shape(inputs[0])[0]
    pad = (batch_size - count % batch_size) % batch_size

    def Chunks(x):
        padded = tf.concat([x, tf.zeros(tf.concat([[pad], tf.shape(x)[1:]], 0), x.dtype)], 0)
        chunks = tf.reshape(padded, tf.concat([[-1, batch_size], tf.shape(x)[1:]], 0))
        return tf.ensure_shape(chunks, [None, batch_size] + x.shape[1:].as_list())

    outputs = tf.map_fn(lambda args: fn(*args), tuple(Chunks(x) for x in inputs),
                        fn_output_signature=output_spec, parallel_iterations=1)

    def Rows(y):
        return tf.reshape(y, tf.concat([[-1], tf.shape(y)[2:]], 0))[:count]

    return tf.nest.map_structure(Rows, outputs)


class ClassifierServable(tf.Module):
    """An image classifier's serving functions (see the module docstring)."""

    def __init__(self, task, task_params):
        super().__init__(name='classifier')
        # A bound method, which the SavedModel does not track: only the variables are saved.
        self._predict = task.Predict
        # Tracked, so the SavedModel holds them; the functions read them.
        self.model_variables = list(task.variables)
        data = task_params.input
        self._spec = spec = decode.ImageSpec.Of(task_params)
        self._batch_size = data.batch_size
        names = image_input.ClassNames(data)
        self._names = list(names) if names else None
        self.predict = tf.function(
            self._Predict, autograph=False, input_signature=[
                tf.TensorSpec([None, spec.size, spec.size, spec.channels], tf.float32,
                              name='images')])
        self.classify = tf.function(
            self._Classify, autograph=False, input_signature=[
                tf.TensorSpec([None, None, None, spec.channels], tf.uint8, name='images')])

    def Signatures(self) -> dict:
        return {'serving_default': self.classify.get_concrete_function(),
                'predict': self.predict.get_concrete_function()}

    def _Outputs(self, probabilities):
        classes = tf.argmax(probabilities, axis=-1, output_type=tf.int32)
        if self._names:
            labels = tf.gather(tf.constant(self._names), classes)
        else:
            labels = tf.strings.as_string(classes)
        return {'probabilities': probabilities, 'classes': classes, 'labels': labels}

    def _Predict(self, images):
        with fprop_context.Inference():
            return self._Probabilities(images)

    def _Probabilities(self, images):
        probabilities = Batched(self._predict, images, self._batch_size,
                                tf.TensorSpec([self._batch_size, None], tf.float32))
        return self._Outputs(probabilities)

    def _Classify(self, images):
        with fprop_context.Inference():
            return self._Probabilities(self._spec.Normalize(images))


class TranslationServable(tf.Module):
    """A translation model's serving function (see the module docstring)."""

    def __init__(self, task, task_params):
        super().__init__(name='translation')
        self._beam_ids = task.BeamIds  # (See ClassifierServable.)
        self._beam_size = task.p.beam_size
        self.model_variables = list(task.variables)
        data = task_params.input.Instantiate()
        vocab = data.vocab
        self._vocab_size = vocab.size
        self._tokens = list(vocab.tokens)
        self._max_length = task_params.input.max_length
        self._batch_size = task_params.input.batch_size
        chars = [t for t in self._tokens if len(t) == 1]
        self._char_table = tf.lookup.StaticHashTable(
            tf.lookup.KeyValueTensorInitializer(
                tf.constant(chars), tf.constant([self._tokens.index(c) for c in chars],
                                                tf.int32)),
            default_value=vocabulary.UNK_ID)
        languages = list(vocab.languages)
        self._language_table = tf.lookup.StaticHashTable(
            tf.lookup.KeyValueTensorInitializer(
                tf.constant(languages or ['']),
                tf.constant([vocab.LanguageId(lang) for lang in languages] or [-1], tf.int32)),
            default_value=-1)
        self._languages = ', '.join(languages)
        self.translate = tf.function(
            self._Translate, autograph=False, input_signature=[
                tf.TensorSpec([None], tf.string, name='sentences'),
                tf.TensorSpec([], tf.string, name='target_language')])

    def Signatures(self) -> dict:
        return {'serving_default': self.translate.get_concrete_function()}

    def _Encode(self, sentences, target_language):
        """(src_ids, src_paddings) [N, max_length], as `TextInput.EncodeSources`."""
        language = self._language_table.lookup(target_language)
        check_language = tf.debugging.assert_non_negative(
            language, message=f'unknown target language; the vocabulary knows '
            f'{self._languages}')
        chars = tf.strings.unicode_split(sentences, 'UTF-8')
        ids = tf.ragged.map_flat_values(self._char_table.lookup, chars)
        count = tf.shape(sentences)[0]
        ids = tf.concat([tf.fill([count, 1], language), ids,
                         tf.fill([count, 1], vocabulary.EOS_ID)], axis=1)
        check_length = tf.debugging.assert_less_equal(
            tf.cast(ids.row_lengths(), tf.int32), self._max_length,
            message=f'a sentence has more than max_length={self._max_length} tokens with its '
            'language token and </s>')
        with tf.control_dependencies([check_language, check_length]):
            src_ids = ids.to_tensor(default_value=vocabulary.PAD_ID,
                                    shape=[None, self._max_length])
        real = tf.sequence_mask(ids.row_lengths(), self._max_length)
        return src_ids, 1.0 - tf.cast(real, tf.float32)

    def _Text(self, ids):
        """Strings of target ids [N, T], as `CharVocabulary.Decode`: up to the first </s>,
        <pad> and <s> left out, ids beyond the vocabulary read as <unk>."""
        ids = tf.where(ids < self._vocab_size, ids, vocabulary.UNK_ID)
        before_eos = tf.equal(tf.cumsum(tf.cast(tf.equal(ids, vocabulary.EOS_ID), tf.int32),
                                        axis=1), 0)
        shown = before_eos & tf.not_equal(ids, vocabulary.PAD_ID) & tf.not_equal(
            ids, vocabulary.BOS_ID)
        tokens = tf.where(shown, tf.gather(tf.constant(self._tokens), ids), '')
        return tf.strings.reduce_join(tokens, axis=1)

    def _Translate(self, sentences, target_language):
        with fprop_context.Inference():
            return self._Translations(sentences, target_language)

    def _Translations(self, sentences, target_language):
        src_ids, src_paddings = self._Encode(sentences, target_language)
        ids, scores = Batched(
            lambda ids, paddings: self._beam_ids(ids, paddings, self._beam_size),
            (src_ids, src_paddings), self._batch_size,
            (tf.TensorSpec([self._batch_size, self._max_length], tf.int32),
             tf.TensorSpec([self._batch_size], tf.float32)))
        return {'translations': self._Text(ids), 'ids': ids, 'scores': scores}


def VersionDir(base: str, step: int) -> str:
    """TensorFlow Serving's layout: versions are numeric directories under a base path."""
    return os.path.join(base, str(step))
