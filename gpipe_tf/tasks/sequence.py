"""Sequence tasks over the Transformer stacks of `gpipe_tf.models.transformer.network`:
translation (encoder-decoder, one model for many language pairs) and language modelling.

Metrics are per target token: `loss` (label-smoothed cross-entropy, what is minimised),
`accuracy` (arg-max token equals the label); `num_tokens` counts the real tokens.
`Decode` translates greedily and incrementally (`models/transformer/decoding.py`: the source
encoded once, each decoder layer caching its keys and values, O(T) work per sentence);
`DecodeByFullForward` is the reference it equals, the whole model run once per target position on
the growing prefix (the decoder is causal, so positions after t do not change position t's
prediction; O(T^2) work).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from gpipe_tf.layers import precision
from gpipe_tf.models.transformer import decoding
from gpipe_tf.models.transformer import network as transformer_model
from gpipe_tf.nested_map import NestedMap
from gpipe_tf.tasks import base_task


class SequenceTask(base_task.BaseTask):
    """A translation (`translation=True`) or language-model task."""

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('translation', True, 'Encoder-decoder translation; False: decoder-only LM.')
        p.Define('bos_id', 1, 'Token that starts every target (decoding feeds it first).')
        p.Define('eos_id', 2, 'Token that ends a target (decoding stops there).')
        p.Define('beam_size', 1, 'Decoding: hypotheses kept per sentence; 1 decodes greedily.')
        p.Define('length_alpha', 0.6, 'Beam search: log-probabilities are divided by '
                 '((5 + length) / 6) ** length_alpha to rank hypotheses (GNMT, Lingvo).')
        return p

    def __init__(self, params):
        super().__init__(params)
        self._decode_step = None
        self._decoder = None  # The IncrementalDecoder, made on first use.
        self._greedy = {}  # Traced Decode functions by max_steps.

    def _Keys(self):
        if self.p.translation:
            return transformer_model.MT_INPUT_KEYS
        return transformer_model.LM_INPUT_KEYS

    def ModelInputs(self, batch):
        if not self.p.translation:
            # The LM's token weights travel as `token_weights`: `weights` is per example.
            batch = NestedMap(batch, weights=batch.get('token_weights'))
        missing = [k for k in self._Keys() if batch.get(k) is None]
        if missing:
            raise ValueError(f'{self.path}: the input batch lacks {missing}; it has '
                             f'{sorted(k for k, v in batch.items() if v is not None)}.')
        return NestedMap({k: batch[k] for k in self._Keys()})

    def ComputeMetrics(self, batch, outputs):
        # A model computing in bfloat16 or float16 (fprop_dtype): the metrics in float32.
        outputs = precision.AtLeastFloat32(outputs)
        weights = outputs.weight * tf.cast(batch.weights, outputs.weight.dtype)[:, None]
        loss, num_tokens = base_task.WeightedMean(outputs.per_example_loss, weights)
        accuracy, _ = base_task.WeightedMean(outputs.correct, weights)
        return NestedMap(loss=(loss, num_tokens), accuracy=(accuracy, num_tokens),
                         num_tokens=(num_tokens, tf.constant(1.0)))

    @base_task.Inference
    def Predictions(self, src_ids, src_paddings, tgt_ids):
        """Arg-max target tokens [B, T] int32 for every target position in inference mode (the
        decoder is causal: position t sees tgt_ids up to t)."""
        zeros = tf.zeros(tf.shape(tgt_ids), tf.float32)
        outputs = self.model(NestedMap(
            src_ids=src_ids, src_paddings=src_paddings, tgt_ids=tgt_ids,
            tgt_paddings=zeros, tgt_labels=tf.zeros_like(tgt_ids), tgt_weights=zeros))
        return tf.cast(outputs.predictions, tf.int32)

    @base_task.Inference
    def GreedyIds(self, src_ids, src_paddings, max_steps: int | None = None) -> tf.Tensor:
        """Greedy target ids [B, T] int32 by incremental decoding (graph code: for a
        tf.function or an exported model); see `Decode`."""
        if self._decoder is None:
            self._decoder = decoding.IncrementalDecoder(self.model)
        return self._decoder.Greedy(self.model.theta, src_ids, src_paddings, self.p.bos_id,
                                    self.p.eos_id, max_steps)

    @base_task.Inference
    def BeamIds(self, src_ids, src_paddings, beam_size: int, max_steps: int | None = None):
        """(ids [B, T] int32, log-probabilities [B]) of the best of `beam_size` hypotheses
        (`IncrementalDecoder.Beam`, with the Params' length_alpha); graph code."""
        if self._decoder is None:
            self._decoder = decoding.IncrementalDecoder(self.model)
        return self._decoder.Beam(self.model.theta, src_ids, src_paddings, self.p.bos_id,
                                  self.p.eos_id, beam_size, self.p.length_alpha, max_steps)

    @base_task.Inference
    def Decode(self, src_ids, src_paddings, max_steps: int | None = None,
               beam_size: int | None = None) -> np.ndarray:
        """Translations [B, T] (numpy int32) of source batches `src_ids`/`src_paddings` ([B, T],
        B the model's batch size): each row holds the target tokens up to and including the
        first `eos_id`, then 0. Greedy (`GreedyIds`) with beam_size 1, else beam search
        (`BeamIds`); beam_size None: the Params'. One traced function: the source encoded once,
        then one position's work per target token.
        """
        if not self.p.translation:
            raise ValueError(f'{self.path}: Decode translates; this task is a language model.')
        beam_size = self.p.beam_size if beam_size is None else beam_size
        # (A tf.Module's dict attribute needs string keys to be saved.)
        key = f'{max_steps}/{beam_size}'
        if key not in self._greedy:
            if beam_size == 1:
                fn = lambda ids, paddings: self.GreedyIds(ids, paddings, max_steps)
            else:
                fn = lambda ids, paddings: self.BeamIds(ids, paddings, beam_size, max_steps)[0]
            self._greedy[key] = tf.function(fn, autograph=False)
        return self._greedy[key](tf.convert_to_tensor(src_ids, tf.int32),
                                 tf.convert_to_tensor(src_paddings, tf.float32)).numpy()

    @base_task.Inference
    def DecodeByFullForward(self, src_ids, src_paddings,
                            max_steps: int | None = None) -> np.ndarray:
        """`Decode`'s result the slow way, the reference it is tested against: the whole model
        run once per target position on the growing prefix. Runs eagerly: one traced forward
        per position.
        """
        if not self.p.translation:
            raise ValueError(f'{self.path}: Decode translates; this task is a language model.')
        if self._decode_step is None:
            self._decode_step = tf.function(self.Predictions, autograph=False)
        src_ids = tf.convert_to_tensor(src_ids, tf.int32)
        src_paddings = tf.convert_to_tensor(src_paddings, tf.float32)
        batch_size, length = src_ids.shape
        tgt_ids = np.zeros([batch_size, length], np.int32)
        tgt_ids[:, 0] = self.p.bos_id
        decoded = np.zeros([batch_size, length], np.int32)
        done = np.zeros([batch_size], bool)
        for t in range(min(max_steps or length, length)):
            token = self._decode_step(src_ids, src_paddings, tf.constant(tgt_ids)).numpy()[:, t]
            token = np.where(done, 0, token)
            decoded[:, t] = token
            if t + 1 < length:
                tgt_ids[:, t + 1] = token
            done |= token == self.p.eos_id
            if done.all():
                break
        return decoded
