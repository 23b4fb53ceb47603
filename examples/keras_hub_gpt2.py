r"""keras_hub's GPT-2, as it is, pipelined with `gpipe_tf.keras.Functional` and 1F1B.

A small `keras_hub.models.GPT2CausalLM` (its `GPT2Backbone`: token and position embeddings, 4
pre-norm transformer blocks of width 64 with 4 heads and a feed-forward of 256, a final layer
norm; the logits from the tied token embedding) is given to `gpipe_tf.keras.Functional` as keras_hub
makes it, cut at its transformer blocks into K=4 stages on 4 virtual CPU devices, each batch of
32 sequences split into M=4 micro-batches and run with the 1F1B schedule inside Keras's `fit`.
The token embedding is called by the first stage (ids to vectors) and by the last (vectors to
logits): one set of weights, on the first stage's device. It learns the sentences of the shipped
multilingual corpus character by character, as `examples/keras_hub_lm.py` does (its data and
baseline are the same: each sentence starts with its language token), with GPT-2's inputs:
`token_ids` and a `padding_mask` of 1 on real tokens:

    pip install -e '.[keras_hub]'
    python examples/keras_hub_gpt2.py [--epochs=15] [--output=history.json] [--plot=loss.png]

It prints the stages (layers, parameters, what crosses each cut per micro-batch), the time to
make the pipelined model and to run its first train step (which traces it), the dev perplexity
per character each epoch against a unigram model's, and checks that `predict` gives the
un-pipelined task's logits.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import json  # pylint: disable=g-import-not-at-top,g-bad-import-order
import math  # pylint: disable=g-import-not-at-top,g-bad-import-order
import time  # pylint: disable=g-import-not-at-top,g-bad-import-order

from gpipe_tf.pipeline import devices  # pylint: disable=g-import-not-at-top

NUM_CELLS = 4
# The virtual devices must exist before TensorFlow starts; Keras starts it on import.
DEVICES = devices.VirtualCpus(NUM_CELLS)

import keras  # pylint: disable=g-import-not-at-top,g-bad-import-order
import numpy as np  # pylint: disable=g-import-not-at-top,g-bad-import-order

from gpipe_tf import keras as gpipe_keras  # pylint: disable=g-import-not-at-top
from gpipe_tf.input import vocabulary  # pylint: disable=g-import-not-at-top

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# The corpus's sentences and the unigram baseline, as the keras_hub decoder example reads them.
# pylint: disable-next=g-import-not-at-top,wrong-import-position
from keras_hub_lm import LENGTH, Arguments, Corpus, Plot

HIDDEN, INTERMEDIATE, HEADS, LAYERS = 64, 256, 4, 4
BATCH, NUM_MICRO_BATCHES = 32, 4
# A stage begins at each: the embeddings with block 0, one block per stage, the final norm and
# the tied embedding's logits with block 3.
SPLIT_POINTS = ['transformer_layer_1', 'transformer_layer_2', 'transformer_layer_3']


def Gpt2(vocab_size: int):
    """The un-pipelined keras_hub task (no preprocessor: it takes token ids)."""
    import keras_hub  # pylint: disable=import-outside-toplevel
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=vocab_size, num_layers=LAYERS, num_heads=HEADS, hidden_dim=HIDDEN,
        intermediate_dim=INTERMEDIATE, max_sequence_length=LENGTH)
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def Gpt2Inputs(ids) -> dict:
    """GPT-2's inputs for token ids padded with PAD_ID: the mask is 1 on real tokens."""
    return {'token_ids': ids, 'padding_mask': (ids != vocabulary.PAD_ID).astype(np.int32)}


class FirstStep(keras.callbacks.Callback):
    """The wall seconds of the first train step of a `fit` (the one that traces it)."""

    def on_train_batch_begin(self, batch, logs=None):
        if batch == 0:
            self.start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        if batch == 0:
            self.seconds = time.perf_counter() - self.start


def main() -> None:
    args = Arguments(__doc__.split('\n\n')[0])
    began = time.perf_counter()
    vocab, train, dev, unigram = Corpus()

    lm = Gpt2(vocab.size)
    start = time.perf_counter()
    micro_batch = BATCH // NUM_MICRO_BATCHES
    # One micro-batch of the inputs, as torch's mb_args: what StageReport counts bytes of (the
    # length GPT-2's inputs leave open is then known).
    example = Gpt2Inputs(train[0][:micro_batch])
    pipelined = gpipe_keras.Functional(lm, num_micro_batches=NUM_MICRO_BATCHES,
                                       split_points=SPLIT_POINTS, devices=DEVICES,
                                       schedule='1f1b', name='gpt2_pipelined',
                                       example_inputs=example)
    made = time.perf_counter() - start
    print(f'per micro-batch of {micro_batch} sequences of {LENGTH} tokens:')
    print(pipelined.StageReport())
    print(f'{pipelined.count_params():,} parameters (the task alone: {lm.count_params():,})')
    # The loss is Keras's mean over all positions, padding (weight 0) included; the weighted
    # metrics divide by the weights instead: nats and accuracy per real character.
    pipelined.compile(optimizer=keras.optimizers.Adam(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      weighted_metrics=[
                          keras.metrics.SparseCategoricalCrossentropy(from_logits=True,
                                                                      name='nll'),
                          keras.metrics.SparseCategoricalAccuracy(name='accuracy')])
    history, first_step = [], FirstStep()
    for epoch in range(1, args.epochs + 1):
        start = time.perf_counter()
        fit = pipelined.fit(Gpt2Inputs(train[0]), train[1], sample_weight=train[2],
                            batch_size=BATCH, epochs=1, verbose=0,
                            callbacks=[first_step] if epoch == 1 else []).history
        seconds = time.perf_counter() - start
        if epoch == 1:
            print(f'build: Functional(...) {made:.2f} s, first train step (tracing it) '
                  f'{first_step.seconds:.1f} s')
        evaluated = pipelined.evaluate(Gpt2Inputs(dev[0]), dev[1], sample_weight=dev[2],
                                       batch_size=BATCH, verbose=0, return_dict=True)
        history.append({'epoch': epoch, 'train_loss': fit['loss'][0],
                        'train_nll': fit['nll'][0], 'dev_nll': evaluated['nll'],
                        'dev_perplexity': math.exp(evaluated['nll']),
                        'dev_accuracy': evaluated['accuracy'], 'train_seconds': seconds})
        print(f'epoch {epoch}: train loss {fit["loss"][0]:.3f}, {fit["nll"][0]:.3f} nats/char, '
              f'dev {evaluated["nll"]:.3f} nats/char (perplexity '
              f'{math.exp(evaluated["nll"]):.2f}, next-character accuracy '
              f'{evaluated["accuracy"]:.3f}), {seconds:.0f} s', flush=True)

    # Inference through the pipeline: logits per position, the task's own (the same weights).
    logits = pipelined.predict(Gpt2Inputs(dev[0][:10]), batch_size=BATCH, verbose=0)
    expected = (10, LENGTH, vocab.size)
    assert logits.shape == expected, f'predict gave logits of {logits.shape}, not {expected}'
    own = lm.predict(Gpt2Inputs(dev[0][:10]), batch_size=BATCH, verbose=0)
    difference = float(np.abs(logits - own).max() / np.abs(own).max())
    assert difference < 1e-4, f'the pipelined logits differ from the task\'s by {difference}'
    wall = time.perf_counter() - began
    print(f'predict: logits of {logits.shape}, the task\'s own within {difference:.1e} '
          f'(relative); wall time {wall:.0f} s')
    if args.output:
        with open(args.output, 'w', encoding='utf-8') as f:
            json.dump({'unigram_dev_nll': unigram, 'build_seconds': made,
                       'first_step_seconds': first_step.seconds, 'wall_seconds': wall,
                       'epochs': history}, f, indent=1)
    if args.plot:
        Plot(history, unigram, args.plot,
             f'keras_hub GPT-2 (Functional), K={NUM_CELLS}, M={NUM_MICRO_BATCHES}, 1F1B')


if __name__ == '__main__':
    main()
