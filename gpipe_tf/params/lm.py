"""Transformer language models of the GPipe paper, and a tiny one that trains on a CPU.

Transformer-L (GPipe Table 1): model dim 2048, feed-forward 8192, 32 heads of 64, vocabulary 32k
(32000: 2 x 32000 x 2048 embedding and softmax weights plus L layers of 50,356,224 parameters give
the table's 282.2M at L=3), sequence length 1024, batch 32, scaled by the number of layers L:

  key                 L     partitions K  paper's column  parameters (ours)   paper
  lm.TransformerL_3      3    1           Naive-1            282,176,768      282.2M
  lm.TransformerL_13    13    1           Pipeline-1         785,739,008      785.8M
  lm.TransformerL_103  103    8           Pipeline-8       5,317,799,168      5.3B
  lm.TransformerL_415  415   32           Pipeline-32     21,028,941,056     21.0B
  lm.TransformerL_1663 1663 128           Pipeline-128    83,873,508,608     83.9B
  lm.Transformer48      48    8           Table 2          2,548,206,848      (not given)

Naive-1 is the model without GPipe: one cell, one micro-batch, no re-materialization. The
Pipeline-K columns re-materialize with M = 32 micro-batches (the paper does not give M; 32
micro-batches of one sequence each, at batch 32, is Lingvo's GPipe Transformer LM setting).
Transformer-48 (Table 2's throughput model) is not described beyond its 48 layers; we take
Transformer-L's dimensions, as the paper uses that family for its Transformer experiments, and
K = 8, M = 32 (Table 2's largest setting). The paper does not state dropout or logit clipping for
these models; we use Lingvo's GPipe LM dropout (0.1 on residuals and attention) and clip logits at
20 (Lingvo's value for the multilingual models of §5).
"""

from __future__ import annotations

import tensorflow as tf

from gpipe_tf import hyperparams
from gpipe_tf import learning_rate
from gpipe_tf import model_registry
from gpipe_tf import optimizer
from gpipe_tf.input import synthetic_text
from gpipe_tf.models.transformer import network as transformer_model
from gpipe_tf.nested_map import NestedMap
from gpipe_tf.tasks import sequence


def SyntheticBatch(p: hyperparams.Params, step: int = 0) -> NestedMap:
    """A batch of the synthetic LM input `p` (SyntheticLmInput Params) as tensors:
    NestedMap(ids, paddings, labels, weights) [batch_size, max_length] (weights per token)."""
    seqs = synthetic_text.ArithmeticSequences(p.batch_size, p.max_length, p.vocab_size,
                                              [p.seed, step])
    return NestedMap(ids=tf.constant(seqs.ids), paddings=tf.constant(seqs.paddings),
                     labels=tf.constant(seqs.labels), weights=tf.constant(seqs.token_weights))


class TransformerLm:
    """A decoder-only Transformer LM pipelined with GPipe; subclasses set the sizes below."""

    VOCAB_SIZE = 32000
    MODEL_DIM = 2048
    HIDDEN_DIM = 8192
    NUM_HEADS = 32
    DIM_PER_HEAD = 64
    NUM_LAYERS = 3
    MAX_LENGTH = 1024
    BATCH_SIZE = 32
    DROPOUT_KEEP_PROB = 0.9
    LOGITS_CLIP = 20.0
    NUM_CELLS = 1
    NUM_MICRO_BATCHES = 32
    RECOMPUTE = 'always'
    # The paper's counts: the softmax has its own weights (True ties them to the embedding).
    SHARE_EMBEDDING_AND_SOFTMAX = False

    def ModelParams(self) -> hyperparams.Params:
        """The model's hyperparameters (transformer_model.LmParams())."""
        return transformer_model.LmParams().Set(
            vocab_size=self.VOCAB_SIZE, model_dim=self.MODEL_DIM, hidden_dim=self.HIDDEN_DIM,
            num_heads=self.NUM_HEADS, dim_per_head=self.DIM_PER_HEAD, num_layers=self.NUM_LAYERS,
            max_length=self.MAX_LENGTH, residual_dropout_keep_prob=self.DROPOUT_KEEP_PROB,
            atten_dropout_keep_prob=self.DROPOUT_KEEP_PROB, logits_clip=self.LOGITS_CLIP,
            share_embedding_and_softmax=self.SHARE_EMBEDDING_AND_SOFTMAX)

    def Pipeline(self) -> hyperparams.Params:
        """The PipeliningLayer Params: embedding, L Transformer layers, softmax over K cells."""
        return transformer_model.LmPipelineParams(
            self.ModelParams(), self.BATCH_SIZE, self.NUM_CELLS, self.NUM_MICRO_BATCHES,
            self.RECOMPUTE)

    def Task(self) -> hyperparams.Params:
        """An LM task; RMSProp as the paper trained its Table 1 Transformers (its learning rate
        is not stated: Lingvo's 1e-3-scale setting, with warm-up)."""
        p = sequence.SequenceTask.Params().Set(name=self.__class__.__name__,
                                               model=self.Pipeline(), translation=False)
        p.train.Set(optimizer=optimizer.RMSProp.Params().Set(momentum=0.0, epsilon=1e-6),
                    learning_rate=1e-3,
                    lr_schedule=learning_rate.Constant.Params().Set(warmup_steps=1000),
                    clip_gradient_norm_to_value=1.0)
        return p

    def _Input(self) -> hyperparams.Params:
        """Synthetic token sequences of the model's shape (see synthetic_text)."""
        return synthetic_text.SyntheticLmInput.Params().Set(
            batch_size=self.BATCH_SIZE, max_length=self.MAX_LENGTH, vocab_size=self.VOCAB_SIZE)

    def Train(self) -> hyperparams.Params:
        return self._Input().Set(seed=1)

    def Test(self) -> hyperparams.Params:
        return self._Input().Set(seed=2, shuffle=False)


@model_registry.RegisterSingleTaskModel
class TransformerL_3(TransformerLm):  # pylint: disable=invalid-name
    """Transformer-L, L=3 (GPipe Table 1, Naive-1: 282.2M parameters, no GPipe)."""
    NUM_LAYERS = 3
    NUM_CELLS = 1
    NUM_MICRO_BATCHES = 1
    RECOMPUTE = 'never'


@model_registry.RegisterSingleTaskModel
class TransformerL_13(TransformerLm):  # pylint: disable=invalid-name
    """Transformer-L, L=13 (GPipe Table 1, Pipeline-1: 785.8M parameters on one accelerator)."""
    NUM_LAYERS = 13
    NUM_CELLS = 1


@model_registry.RegisterSingleTaskModel
class TransformerL_103(TransformerLm):  # pylint: disable=invalid-name
    """Transformer-L, L=103 (GPipe Table 1, Pipeline-8: 5.3B parameters)."""
    NUM_LAYERS = 103
    NUM_CELLS = 8


@model_registry.RegisterSingleTaskModel
class TransformerL_415(TransformerLm):  # pylint: disable=invalid-name
    """Transformer-L, L=415 (GPipe Table 1, Pipeline-32: 21.0B parameters)."""
    NUM_LAYERS = 415
    NUM_CELLS = 32


@model_registry.RegisterSingleTaskModel
class TransformerL_1663(TransformerLm):  # pylint: disable=invalid-name
    """Transformer-L, L=1663 (GPipe Table 1, Pipeline-128: 83.9B parameters)."""
    NUM_LAYERS = 1663
    NUM_CELLS = 128


@model_registry.RegisterSingleTaskModel
class Transformer48(TransformerLm):
    """Transformer-48 (GPipe Table 2's throughput model): Transformer-L's dimensions, 48 layers
    (2.55B parameters; the paper gives no count), K=8, M=32."""
    NUM_LAYERS = 48
    NUM_CELLS = 8


@model_registry.RegisterSingleTaskModel
class TransformerLTiny(TransformerLm):
    """A byte-level Transformer-L in miniature that trains on a 2-core CPU in minutes: model dim
    64, feed-forward 256, 4 heads of 16, 4 layers, vocabulary 256, length 32, batch 16, pipelined
    over K=2 cells and M=4 micro-batches. No dropout, so runs are reproducible."""
    TRAINS_ON_A_CPU = True  # In minutes, on 2 cores (--list_models says so).
    VOCAB_SIZE = 256
    MODEL_DIM = 64
    HIDDEN_DIM = 256
    NUM_HEADS = 4
    DIM_PER_HEAD = 16
    NUM_LAYERS = 4
    MAX_LENGTH = 32
    BATCH_SIZE = 16
    DROPOUT_KEEP_PROB = 1.0
    NUM_CELLS = 2
    NUM_MICRO_BATCHES = 4

    def Task(self) -> hyperparams.Params:
        p = super().Task()
        p.train.Set(optimizer=optimizer.Adam.Params(), learning_rate=3e-3,
                    lr_schedule=learning_rate.Constant.Params().Set(warmup_steps=20),
                    max_steps=300, save_interval_steps=100, summary_interval_steps=10,
                    eval_interval_steps=100)
        return p
