"""The GPipe paper's multilingual translation Transformers (§5), and a tiny one for a CPU.

T(L, H, A): L encoder and L decoder layers, feed-forward hidden size H, A attention heads of 64
(so the attention projections are 1024 x 64A), model dim 1024, and one 64k vocabulary shared by
all 103 languages; we take 64k as 65536. One embedding table serves source and target, and the
softmax has its own weights (two 65536 x 1024 matrices: the paper's counts need exactly two).

  key                          partitions K  parameters (ours)   paper   difference
  mt.multilingual.T_6_8192_16     1 (not stated)  411,338,752    400M     +2.8%
  mt.multilingual.T_24_8192_16    4             1,242,492,928    1.3B     -4.4%
  mt.multilingual.T_12_16384_32   2             1,242,308,608    1.3B     -4.4%
  mt.multilingual.T_32_16384_32   8             3,089,010,688    3B       +3.0%
  mt.multilingual.T_64_16384_32  16             6,043,734,016    6B       +0.7%

(The paper prints the deep 1.3B model as "T(24, 8192, 32)" once; 16 heads is what its parameter
count and its model list give.) Each model uses M = 4K micro-batches (at least 4), where the paper
finds the bubble negligible. Sentence length, batch size, dropout and the logit clipping threshold
are not in the paper: we take 128 tokens, 256 sentence pairs per pipeline (the paper's 260K-4M
token batches come from data parallelism on top), dropout 0.1 and label smoothing 0.1 as for
Transformer Big, and logits clipped at 20 (Lingvo's value for its multilingual models).

Languages: the input pipeline prepends a target-language token (`<2xx>`, part of the vocabulary)
to each source sentence; nothing else in the model depends on the language pair.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from gpipe_tf import hyperparams
from gpipe_tf import learning_rate
from gpipe_tf import model_registry
from gpipe_tf import optimizer
from gpipe_tf.input import text
from gpipe_tf.models.transformer import network as transformer_model
from gpipe_tf.nested_map import NestedMap
from gpipe_tf.tasks import sequence

# Token ids of the synthetic data: padding, begin and end of sentence, then one token per
# synthetic target language, then the content tokens.
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
# Synthetic "languages": the target is the source copied, or reversed.
LANGUAGES = ('<2copy>', '<2reverse>')
FIRST_LANGUAGE_ID = 3
FIRST_CONTENT_ID = FIRST_LANGUAGE_ID + len(LANGUAGES)


def MtInputParams() -> hyperparams.Params:
    """Input params of sentence pairs: a stand-in until Params-driven tf.data inputs exist.

    It describes the data; `SyntheticBatch` draws batches of a synthetic task from it.
    """
    p = hyperparams.Params()
    p.Define('batch_size', 256, 'Sentence pairs per mini-batch.')
    p.Define('max_length', 128, 'Tokens per source and per target sentence (padded to it).')
    p.Define('vocab_size', 65536, 'Number of tokens, language tokens included; id 0 is padding.')
    p.Define('seed', 0, 'Seed the synthetic batches are drawn from.')
    return p


def SyntheticBatch(p: hyperparams.Params, step: int = 0) -> NestedMap:
    """A batch of two synthetic languages: the source is a target-language token and random
    content tokens; the target is the content copied (`<2copy>`) or reversed (`<2reverse>`).

    Returns:
      NestedMap(src_ids, src_paddings, tgt_ids, tgt_paddings, tgt_labels, tgt_weights), each
      [batch_size, max_length]: tgt_ids is BOS + target, tgt_labels is target + EOS.
    """
    rng = np.random.RandomState([p.seed, step])
    batch, length = p.batch_size, p.max_length
    if p.vocab_size <= FIRST_CONTENT_ID or length < 2:
        raise ValueError(f'Synthetic pairs need vocab_size > {FIRST_CONTENT_ID} and max_length '
                         f'>= 2, got {p.vocab_size} and {length}.')
    shape = [batch, length]
    src, tgt_ids, tgt_labels = (np.zeros(shape, np.int32) for _ in range(3))
    src_real, tgt_real = np.zeros(shape, bool), np.zeros(shape, bool)
    for b in range(batch):
        n = rng.randint(max(length // 4, 1), length)  # Content tokens; 1 + n <= length.
        content = rng.randint(FIRST_CONTENT_ID, p.vocab_size, size=n)
        language = rng.randint(len(LANGUAGES))
        target = content if language == 0 else content[::-1]
        src[b, :n + 1] = np.concatenate([[FIRST_LANGUAGE_ID + language], content])
        tgt_ids[b, :n + 1] = np.concatenate([[BOS_ID], target])
        tgt_labels[b, :n + 1] = np.concatenate([target, [EOS_ID]])
        src_real[b, :n + 1] = tgt_real[b, :n + 1] = True
    return NestedMap(
        src_ids=tf.constant(src), src_paddings=tf.constant(1.0 - src_real, tf.float32),
        tgt_ids=tf.constant(tgt_ids), tgt_paddings=tf.constant(1.0 - tgt_real, tf.float32),
        tgt_labels=tf.constant(tgt_labels), tgt_weights=tf.constant(tgt_real, tf.float32))


class MultilingualTransformer:
    """T(L, H, A) pipelined with GPipe; subclasses set the sizes below."""

    VOCAB_SIZE = 65536
    MODEL_DIM = 1024
    DIM_PER_HEAD = 64
    NUM_LAYERS = 6  # L: encoder layers, and as many decoder layers.
    HIDDEN_DIM = 8192
    NUM_HEADS = 16
    MAX_LENGTH = 128
    BATCH_SIZE = 256
    DROPOUT_KEEP_PROB = 0.9
    LABEL_SMOOTHING = 0.1
    LOGITS_CLIP = 20.0
    NUM_CELLS = 1
    NUM_MICRO_BATCHES = 4

    def ModelParams(self) -> hyperparams.Params:
        """The model's hyperparameters (transformer_model.MtParams())."""
        return transformer_model.MtParams().Set(
            vocab_size=self.VOCAB_SIZE, model_dim=self.MODEL_DIM, hidden_dim=self.HIDDEN_DIM,
            num_heads=self.NUM_HEADS, dim_per_head=self.DIM_PER_HEAD,
            num_encoder_layers=self.NUM_LAYERS, num_decoder_layers=self.NUM_LAYERS,
            max_length=self.MAX_LENGTH, residual_dropout_keep_prob=self.DROPOUT_KEEP_PROB,
            atten_dropout_keep_prob=self.DROPOUT_KEEP_PROB,
            relu_dropout_keep_prob=self.DROPOUT_KEEP_PROB,
            input_dropout_keep_prob=self.DROPOUT_KEEP_PROB,
            label_smoothing=self.LABEL_SMOOTHING, logits_clip=self.LOGITS_CLIP)

    def Pipeline(self) -> hyperparams.Params:
        """The PipeliningLayer Params: the encoder-decoder as a flat layer list over K cells."""
        return transformer_model.MtPipelineParams(
            self.ModelParams(), self.BATCH_SIZE, self.NUM_CELLS, self.NUM_MICRO_BATCHES)

    def Task(self) -> hyperparams.Params:
        """A translation task; Adam with warm-up, as Transformer Big (the paper gives no
        optimizer for §5)."""
        p = sequence.SequenceTask.Params().Set(name=self.__class__.__name__,
                                               model=self.Pipeline(), translation=True)
        p.train.Set(optimizer=optimizer.Adam.Params().Set(beta2=0.98, epsilon=1e-9),
                    learning_rate=1e-3,
                    lr_schedule=learning_rate.Constant.Params().Set(warmup_steps=4000),
                    clip_gradient_norm_to_value=1.0, eval_dataset='Dev')
        return p

    def _Input(self) -> hyperparams.Params:
        """The shipped Django corpus (7 languages), character vocabulary: a real corpus of the
        right form; the paper's 25B-pair corpus is not something this machine can hold."""
        return text.ParallelTextInput.Params().Set(
            batch_size=self.BATCH_SIZE, max_length=self.MAX_LENGTH, vocab_size=self.VOCAB_SIZE)

    def Train(self) -> hyperparams.Params:
        return self._Input().Set(file_pattern=text.CorpusPath('train'), seed=1)

    def Dev(self) -> hyperparams.Params:
        return self._Input().Set(file_pattern=text.CorpusPath('dev'), shuffle=False)

    def Test(self) -> hyperparams.Params:
        return self._Input().Set(file_pattern=text.CorpusPath('test'), shuffle=False)


@model_registry.RegisterSingleTaskModel
class T_6_8192_16(MultilingualTransformer):  # pylint: disable=invalid-name
    """T(6, 8192, 16), GPipe §5's "Transformer Big" baseline: 400M parameters; partitions not
    stated (one cell here)."""
    NUM_LAYERS, HIDDEN_DIM, NUM_HEADS = 6, 8192, 16
    NUM_CELLS, NUM_MICRO_BATCHES = 1, 4


@model_registry.RegisterSingleTaskModel
class T_24_8192_16(MultilingualTransformer):  # pylint: disable=invalid-name
    """T(24, 8192, 16), GPipe §5's deep 1.3B model, 4 partitions."""
    NUM_LAYERS, HIDDEN_DIM, NUM_HEADS = 24, 8192, 16
    NUM_CELLS, NUM_MICRO_BATCHES = 4, 16


@model_registry.RegisterSingleTaskModel
class T_12_16384_32(MultilingualTransformer):  # pylint: disable=invalid-name
    """T(12, 16384, 32), GPipe §5's wide 1.3B model, 2 partitions."""
    NUM_LAYERS, HIDDEN_DIM, NUM_HEADS = 12, 16384, 32
    NUM_CELLS, NUM_MICRO_BATCHES = 2, 8


@model_registry.RegisterSingleTaskModel
class T_32_16384_32(MultilingualTransformer):  # pylint: disable=invalid-name
    """T(32, 16384, 32), GPipe §5's 3B model, 8 partitions."""
    NUM_LAYERS, HIDDEN_DIM, NUM_HEADS = 32, 16384, 32
    NUM_CELLS, NUM_MICRO_BATCHES = 8, 32


@model_registry.RegisterSingleTaskModel
class T_64_16384_32(MultilingualTransformer):  # pylint: disable=invalid-name
    """T(64, 16384, 32), GPipe §5's 6B model of 128 Transformer layers, 16 partitions."""
    NUM_LAYERS, HIDDEN_DIM, NUM_HEADS = 64, 16384, 32
    NUM_CELLS, NUM_MICRO_BATCHES = 16, 64


@model_registry.RegisterSingleTaskModel
class TransformerTiny(MultilingualTransformer):
    """T(2, 512, 4) in miniature that trains on a 2-core CPU in minutes on the shipped Django
    corpus (English into 7 languages, character vocabulary): model dim 128, 4 heads of 32, 2
    encoder and 2 decoder layers, vocabulary 256, 64 tokens per side, batch 32, pipelined over
    K=4 cells and M=4 micro-batches; no dropout (3,805 pairs: the job is to fit them within
    minutes). The translation job of docs/trainer.md."""
    TRAINS_ON_A_CPU = True  # In minutes, on 2 cores (--list_models says so).
    VOCAB_SIZE = 256
    MODEL_DIM = 128
    DIM_PER_HEAD = 32
    NUM_LAYERS, HIDDEN_DIM, NUM_HEADS = 2, 512, 4
    MAX_LENGTH = 64
    BATCH_SIZE = 32
    DROPOUT_KEEP_PROB = 1.0
    NUM_CELLS, NUM_MICRO_BATCHES = 4, 4
    MAX_STEPS = 2000

    def Task(self) -> hyperparams.Params:
        p = super().Task()
        p.train.Set(learning_rate=3e-3,
                    lr_schedule=learning_rate.CosineDecay.Params().Set(
                        total_steps=self.MAX_STEPS, min_value=0.05, warmup_steps=100),
                    max_steps=self.MAX_STEPS, save_interval_steps=500,
                    summary_interval_steps=25, eval_interval_steps=500)
        return p
