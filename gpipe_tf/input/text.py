"""Sentence pairs for multilingual translation: the shipped Django corpus (or any TSV file of the
same columns), encoded with a character vocabulary into the batches `transformer_model.MtLayers`
takes.

A TSV line is `source_language<TAB>target_language<TAB>source<TAB>target`. A pair becomes, with
max_length L (tokens per side, BOS/EOS included):

  src_ids      [L] int32    <2xx> + source characters + </s>, then <pad> (0)
  src_paddings [L] float32  0.0 on those tokens, 1.0 on padding
  tgt_ids      [L] int32    <s> + target characters, then <pad>
  tgt_labels   [L] int32    target characters + </s>, then <pad> (tgt_ids shifted left by one)
  tgt_paddings [L] float32  0.0 on real tokens, 1.0 on padding
  tgt_weights  [L] float32  1 - tgt_paddings

The target-language token goes first on the source side (Johnson et al. 2017), so one model
serves every language. A pair longer than L on either side is dropped (and counted), never
truncated: a truncated target would teach the model to stop mid-sentence.
"""

from __future__ import annotations

import functools
import glob
import os
from typing import Sequence

import numpy as np
import tensorflow as tf
from absl import logging

from gpipe_tf import errors
from gpipe_tf import hyperparams
from gpipe_tf.input import base_input
from gpipe_tf.input import text_files
from gpipe_tf.input import vocabulary
from gpipe_tf.nested_map import NestedMap

SPLITS = ('train', 'dev', 'test')
_CORPUS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'data',
                           'multilingual')
_NUM_FIELDS = 4


def CorpusPath(split: str = 'train') -> str:
    """Path of a split ('train', 'dev' or 'test') of the shipped Django corpus.

    Raises:
      ValueError: on an unknown split.
    """
    if split not in SPLITS:
        raise ValueError(f'Unknown split {split!r}; expected one of {list(SPLITS)}.')
    return os.path.join(_CORPUS_DIR, f'{split}.tsv')


def _MatchingFiles(file_pattern: str) -> list[str]:
    """The files (never directories) `file_pattern` names: a path, or a glob (sorted)."""
    paths = sorted(glob.glob(file_pattern)) if glob.has_magic(file_pattern) else [file_pattern]
    return [path for path in paths if os.path.isfile(path)]


def ReadParallelTsv(file_pattern: str) -> list[tuple[str, str, str, str]]:
    """The (source_language, target_language, source, target) rows of the files matching
    `file_pattern` (a path or a glob; files in sorted order, directories it matches left out).
    Blank lines are skipped.

    Raises:
      errors.MissingInputError (a FileNotFoundError): if no file matches.
      errors.InputError (a ValueError): on a file that cannot be read or is not UTF-8, or a line
        that is not 4 non-empty tab-separated fields.
    """
    paths = _MatchingFiles(file_pattern)
    if not paths:
        raise errors.MissingInputError(f'No parallel text file matches {file_pattern}')
    rows = []
    for path in paths:
        lines = text_files.ReadLines(path, 'a readable UTF-8 TSV file of sentence pairs')
        for number, line in enumerate(lines, start=1):
            line = line.removesuffix('\r')
            if not line:
                continue
            fields = line.split('\t')
            if len(fields) != _NUM_FIELDS or not all(fields):
                raise errors.InputError(
                    f'{path}:{number}: expected {_NUM_FIELDS} non-empty tab-separated fields '
                    f'(source_language, target_language, source, target), got {len(fields)}: '
                    f'{errors.Excerpt(line)}.')
            rows.append(tuple(fields))
    return rows


@functools.lru_cache(maxsize=None)
def DefaultVocabulary(min_count: int) -> vocabulary.CharVocabulary:
    """The vocabulary of the shipped train split: its sources and targets, and a token per target
    language in it. Cached: it is a function of `min_count` alone."""
    rows = ReadParallelTsv(CorpusPath('train'))
    return vocabulary.CharVocabulary.Build(
        (text for row in rows for text in row[2:]), {row[1] for row in rows}, min_count)


def Bleu(hypotheses: Sequence[str], references: Sequence[str]) -> float:
    """Corpus BLEU (sacrebleu's defaults, 13a tokenization) of hypotheses against one reference
    each, in [0, 100].

    Raises:
      ImportError: if sacrebleu is not installed.
      ValueError: if the two lists differ in length.
    """
    try:
        import sacrebleu  # pylint: disable=g-import-not-at-top
    except ImportError as e:
        raise ImportError('Bleu needs sacrebleu: pip install sacrebleu') from e
    hypotheses, references = list(hypotheses), list(references)
    if len(hypotheses) != len(references):
        raise ValueError(f'Bleu needs one reference per hypothesis, got {len(hypotheses)} '
                         f'hypotheses and {len(references)} references.')
    return float(sacrebleu.corpus_bleu(hypotheses, [references]).score)


class ParallelTextInput(base_input.BaseInput):
    """Sentence pairs of a TSV file as MT batches (see the module docstring)."""

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = super().Params()
        p.Define('file_pattern', CorpusPath('train'), 'Path (or glob) of the TSV file(s) of '
                 'source_language, target_language, source, target; default: the shipped '
                 'train split.')
        p.Define('vocab_file', None, 'A CharVocabulary file; None: build the vocabulary from the '
                 'shipped train split (so every split and run gets the same one).')
        p.Define('min_count', 2, 'With vocab_file None: characters seen fewer times in the '
                 'shipped train split are left out of the vocabulary and read as <unk>.')
        p.Define('vocab_size', None, 'If set, the model\'s vocabulary size: a larger vocabulary '
                 'is an error. None: no check.')
        p.Define('max_length', 64, 'Tokens per side, BOS/EOS and the language token included; '
                 'longer pairs are dropped.')
        p.Define('languages', None, 'Target languages to keep (a list); None: all in the file.')
        return p

    def __init__(self, params: hyperparams.Params):
        super().__init__(params)
        p = self.p
        if p.max_length is None or p.max_length < 3:
            raise errors.ConfigError(f'{p.name}: max_length must be >= 3 (a language token, a '
                                     f'character and </s>), got {p.max_length!r}.')
        self._vocab = (vocabulary.CharVocabulary.Load(p.vocab_file) if p.vocab_file
                       else DefaultVocabulary(p.min_count))
        if p.vocab_size is not None and self._vocab.size > p.vocab_size:
            if p.vocab_file:
                raise errors.InputError(
                    f'{p.name}: vocab_file {p.vocab_file} has {self._vocab.size} tokens but '
                    f'vocab_size is {p.vocab_size}; expected a vocabulary of at most vocab_size '
                    f'tokens (or a model with a larger vocab_size).')
            raise errors.ConfigError(
                f'{p.name}: the vocabulary of the shipped train split (min_count={p.min_count}) '
                f'has {self._vocab.size} tokens but vocab_size is {p.vocab_size}; expected at '
                f'most vocab_size (raise vocab_size or min_count).')
        if p.languages is not None:
            for language in p.languages:
                try:
                    self._vocab.LanguageId(language)
                except ValueError as e:  # It lists the languages the vocabulary knows.
                    raise errors.ConfigError(f'{p.name}: languages: {e}') from e
        self._sentences, self._arrays, self._num_dropped = self._Encode(
            ReadParallelTsv(p.file_pattern))

    def _Encode(self, rows):
        """(kept rows, NestedMap of numpy arrays, number of rows dropped for length)."""
        p, vocab = self.p, self._vocab
        kept, sources, targets = [], [], []
        for row in rows:
            src_lang, tgt_lang, src, tgt = row
            if p.languages is not None and tgt_lang not in p.languages:
                continue
            if tgt_lang not in vocab.languages:
                raise errors.InputError(f'{p.name}: {p.file_pattern} has target language '
                                        f'{tgt_lang!r} (pair {errors.Excerpt(src)}); the '
                                        f'vocabulary knows {list(vocab.languages)}.')
            source = [vocab.LanguageId(tgt_lang)] + vocab.Encode(src) + [vocabulary.EOS_ID]
            target = vocab.Encode(tgt)
            if len(source) > p.max_length or len(target) + 1 > p.max_length:
                continue
            kept.append(row)
            sources.append(source)
            targets.append(target)
        num_wanted = sum(1 for row in rows if p.languages is None or row[1] in p.languages)
        num_dropped = num_wanted - len(kept)
        if not kept:
            raise errors.InputError(self._NoPairsMessage(len(rows), num_wanted))
        if num_dropped:
            logging.warning('%s: dropped %d of %d pairs of %s longer than max_length=%d tokens.',
                            p.name, num_dropped, num_dropped + len(kept), p.file_pattern,
                            p.max_length)
        src_ids, src_paddings = _Pack(sources, p.max_length)
        tgt_ids, tgt_paddings = _Pack([[vocabulary.BOS_ID] + t for t in targets], p.max_length)
        tgt_labels, _ = _Pack([t + [vocabulary.EOS_ID] for t in targets], p.max_length)
        arrays = NestedMap(src_ids=src_ids, src_paddings=src_paddings, tgt_ids=tgt_ids,
                           tgt_paddings=tgt_paddings, tgt_labels=tgt_labels,
                           tgt_weights=1.0 - tgt_paddings)
        return kept, arrays, num_dropped

    def _NoPairsMessage(self, num_rows: int, num_wanted: int) -> str:
        """Why none of the `num_rows` pairs read (`num_wanted` of the kept languages) is left."""
        p = self.p
        where = p.file_pattern
        if glob.has_magic(where):
            paths = _MatchingFiles(where)
            where = f'{where} ({len(paths)} files: {", ".join(paths[:3])}' + (
                ', ...)' if len(paths) > 3 else ')')
        if not num_rows:
            return (f'{p.name}: {where} has no sentence pairs; expected lines of '
                    f'source_language<TAB>target_language<TAB>source<TAB>target.')
        if not num_wanted:
            return (f'{p.name}: none of the {num_rows} pairs of {where} has a target language '
                    f'in languages={list(p.languages)}; expected at least one.')
        pairs = f'all {num_wanted} pairs of {where} are' if num_wanted > 1 else (
            f'the one pair of {where} is')
        return (f'{p.name}: {pairs} longer than max_length={p.max_length} tokens on a side '
                f'(language token and </s> included); expected at least one that fits: raise '
                f'max_length.')

    def _LoadExamples(self) -> NestedMap:
        return self._arrays

    @property
    def vocab(self) -> vocabulary.CharVocabulary:
        return self._vocab

    def NumDropped(self) -> int:
        """Pairs of the file (of the kept languages) dropped for being longer than max_length."""
        return self._num_dropped

    def Sentences(self) -> list[tuple[str, str, str, str]]:
        """(source_language, target_language, source, target) of each example, in example order
        (the rows of `Examples()` and of `EvalDataset()`)."""
        return self._sentences[:self.NumExamples()]

    def EncodeSources(self, lines: Sequence[str], target_language: str) -> NestedMap:
        """Source sentences to translate into `target_language`, encoded as in a batch.

        Returns:
          NestedMap(src_ids [len(lines), max_length] int32, src_paddings float32), numpy.

        Raises:
          errors.InputError (a ValueError): on a line longer than max_length tokens.
          ValueError: on an unknown language.
        """
        language_id = self._vocab.LanguageId(target_language)
        sources = []
        for i, line in enumerate(lines):
            source = [language_id] + self._vocab.Encode(line) + [vocabulary.EOS_ID]
            if len(source) > self.p.max_length:
                raise errors.InputError(
                    f'{self.p.name}: source {i} has {len(source)} tokens with its language token '
                    f'and </s>; expected at most max_length={self.p.max_length}: '
                    f'{errors.Excerpt(line)}.')
            sources.append(source)
        src_ids, src_paddings = _Pack(sources, self.p.max_length)
        return NestedMap(src_ids=src_ids, src_paddings=src_paddings)

    def EvalDataset(self) -> tf.data.Dataset:
        """BaseInput's eval batches, with the padding rows' paddings 1.0 (BaseInput zeroes every
        entry of a padding row, which would read as real tokens)."""

        def PadRows(batch):
            real = batch.weights[:, tf.newaxis] > 0
            for key in ('src_paddings', 'tgt_paddings'):
                batch[key] = tf.where(real, batch[key], tf.ones_like(batch[key]))
            return batch

        return super().EvalDataset().map(PadRows)


def _Pack(sequences: list[list[int]], length: int) -> tuple[np.ndarray, np.ndarray]:
    """([N, length] int32 ids padded with <pad>, [N, length] float32 paddings)."""
    ids = np.full([len(sequences), length], vocabulary.PAD_ID, np.int32)
    paddings = np.ones([len(sequences), length], np.float32)
    for i, sequence in enumerate(sequences):
        ids[i, :len(sequence)] = sequence
        paddings[i, :len(sequence)] = 0.0
    return ids, paddings
