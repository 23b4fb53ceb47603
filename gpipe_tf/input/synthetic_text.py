"""A synthetic language for the language models: arithmetic token sequences that a model can
learn to continue (token t+1 = token t + stride, mod the vocabulary, never 0)."""

from __future__ import annotations

import numpy as np

from gpipe_tf.input import base_input
from gpipe_tf.nested_map import NestedMap


def ArithmeticSequences(num: int, length: int, vocab_size: int, seed) -> NestedMap:
    """`num` sequences, stride 1..3 each, lengths uniform in [length / 2, length], padded with 0.

    Returns:
      NestedMap(ids, paddings, labels, token_weights) of numpy arrays [num, length]; labels are
      the next tokens.
    """
    if vocab_size < 3 or length < 1:
        raise ValueError(f'Need vocab_size >= 3 and length >= 1, got {vocab_size} and {length}.')
    rng = np.random.RandomState(seed)
    start = rng.randint(0, vocab_size - 1, size=[num, 1])
    stride = rng.randint(1, 4, size=[num, 1])
    tokens = 1 + (start + stride * np.arange(length + 1)) % (vocab_size - 1)
    lengths = rng.randint(max(length // 2, 1), length + 1, size=[num, 1])
    real = np.arange(length) < lengths
    return NestedMap(ids=np.where(real, tokens[:, :-1], 0).astype(np.int32),
                     paddings=(1.0 - real).astype(np.float32),
                     labels=np.where(real, tokens[:, 1:], 0).astype(np.int32),
                     token_weights=real.astype(np.float32))


class SyntheticLmInput(base_input.BaseInput):
    """Batches NestedMap(ids, paddings, labels, token_weights [B, T], weights [B]) of
    `ArithmeticSequences` (`weights` is the base class's per-example weight)."""

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('max_length', 1024, 'Tokens per sequence (padded to this length).')
        p.Define('vocab_size', 32000, 'Number of tokens; id 0 is padding.')
        p.Define('num_examples_total', 1024, 'Number of distinct sequences generated.')
        return p

    def _LoadExamples(self):
        return ArithmeticSequences(self.p.num_examples_total, self.p.max_length,
                                   self.p.vocab_size, self.p.seed)
