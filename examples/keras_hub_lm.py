r"""A decoder-only Transformer language model from keras_hub blocks, pipelined with 1F1B.

keras_hub's `TokenAndPositionEmbedding`, 4 `TransformerDecoder` blocks (causal self-attention,
no encoder) and a Dense head of logits, as one `gpipe_tf.keras.Sequential` in K=4 cells on 4
virtual CPU devices, each batch of 32 sequences split into M=4 micro-batches and run with the
1F1B schedule inside Keras's `fit`. It learns the sentences of the shipped multilingual corpus
(Django's translation catalogs, their 7 target languages), character by character, each sentence
starting with its language token; validation perplexity is per character of the dev split:

    pip install -e '.[keras_hub]'
    python examples/keras_hub_lm.py [--epochs=15] [--output=history.json] [--plot=loss.png]

For scale it prints the dev perplexity of the train split's character frequencies (a unigram
model, add-one smoothed), which a model that learns nothing of context matches.
"""

from __future__ import annotations

import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import argparse  # pylint: disable=g-import-not-at-top,g-bad-import-order
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
from gpipe_tf.input import text  # pylint: disable=g-import-not-at-top
from gpipe_tf.input import vocabulary  # pylint: disable=g-import-not-at-top

LENGTH, DIM, HIDDEN, HEADS, BLOCKS = 64, 64, 256, 4, 4
BATCH, NUM_MICRO_BATCHES = 32, 4


def Sequences(split: str, vocab: vocabulary.CharVocabulary):
    """(inputs, labels, weights) of `split`: every distinct target sentence of the corpus (7
    languages) as <2xx> + its characters + </s>, padded to LENGTH + 1;
    inputs are all but the last token, labels all but the first, weights 0 on padding. Longer
    sentences are left out."""
    sentences = sorted({(lang, sentence) for _, lang, _, sentence
                        in text.ReadParallelTsv(text.CorpusPath(split))})
    ids = np.zeros([len(sentences), LENGTH + 1], np.int32)
    kept = 0
    for lang, sentence in sentences:
        tokens = [vocab.LanguageId(lang)] + vocab.Encode(sentence) + [vocabulary.EOS_ID]
        if len(tokens) <= LENGTH + 1:
            ids[kept, :len(tokens)] = tokens
            kept += 1
    ids = ids[:kept]
    weights = (ids[:, 1:] != vocabulary.PAD_ID).astype(np.float32)
    return ids[:, :-1], ids[:, 1:], weights


def UnigramNll(train_labels, train_weights, dev_labels, dev_weights, vocab_size: int) -> float:
    """Nats per character on dev of the train split's add-one-smoothed character frequencies."""
    counts = np.bincount(train_labels[train_weights > 0], minlength=vocab_size) + 1.0
    log_probs = np.log(counts / counts.sum())
    return float(-log_probs[dev_labels[dev_weights > 0]].mean())


def Model(vocab_size: int) -> gpipe_keras.Sequential:
    import keras_hub  # pylint: disable=import-outside-toplevel
    layers = ([keras_hub.layers.TokenAndPositionEmbedding(vocab_size, LENGTH, DIM)] +
              [keras_hub.layers.TransformerDecoder(HIDDEN, HEADS, dropout=0.1)
               for _ in range(BLOCKS)] +
              [keras.layers.Dense(vocab_size)])
    # Boundaries: the embedding with the first block, one block per cell, the head with the
    # last block.
    return gpipe_keras.Sequential(layers, NUM_CELLS, NUM_MICRO_BATCHES, input_shape=(LENGTH,),
                                  devices=DEVICES, schedule='1f1b',
                                  balance=[2, 1, 1, 2], name='lm')


def Arguments(description: str):
    """The examples' flags: --epochs, --output, --plot."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument('--epochs', type=int, default=15, help='passes over the train split')
    parser.add_argument('--output', default=None,
                        help='write the per-epoch losses and perplexities there (JSON)')
    parser.add_argument('--plot', default=None,
                        help='draw the train and dev loss per epoch there (PNG)')
    return parser.parse_args()


def Corpus():
    """(vocabulary, train, dev, the unigram model's dev nats/char), seeded and printed."""
    keras.utils.set_random_seed(0)
    vocab = text.DefaultVocabulary(min_count=2)
    train, dev = Sequences('train', vocab), Sequences('dev', vocab)
    print(f'{len(train[0])} train and {len(dev[0])} dev sentences, vocabulary of {vocab.size}')
    unigram = UnigramNll(train[1], train[2], dev[1], dev[2], vocab.size)
    print(f'unigram baseline: dev {unigram:.3f} nats/char (perplexity {math.exp(unigram):.2f})')
    return vocab, train, dev, unigram


def main() -> None:
    args = Arguments(__doc__.split('\n\n')[0])
    vocab, train, dev, unigram = Corpus()

    model = Model(vocab.size)
    model.build((None, LENGTH))
    print(model.pipeline.pipeline.PartitionReport())
    # The loss is Keras's mean over all positions, padding (weight 0) included; the weighted
    # metrics divide by the weights instead: nats and accuracy per real character.
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  weighted_metrics=[
                      keras.metrics.SparseCategoricalCrossentropy(from_logits=True, name='nll'),
                      keras.metrics.SparseCategoricalAccuracy(name='accuracy')])
    history = []
    for epoch in range(1, args.epochs + 1):
        start = time.time()
        fit = model.fit(train[0], train[1], sample_weight=train[2], batch_size=BATCH,
                        epochs=1, verbose=0).history
        seconds = time.time() - start
        evaluated = model.evaluate(dev[0], dev[1], sample_weight=dev[2], batch_size=BATCH,
                                   verbose=0, return_dict=True)
        history.append({'epoch': epoch, 'train_nll': fit['nll'][0],
                        'dev_nll': evaluated['nll'], 'dev_perplexity': math.exp(evaluated['nll']),
                        'dev_accuracy': evaluated['accuracy'], 'train_seconds': seconds})
        print(f'epoch {epoch}: train {fit["nll"][0]:.3f} nats/char, dev {evaluated["nll"]:.3f} '
              f'nats/char (perplexity {math.exp(evaluated["nll"]):.2f}, next-character '
              f'accuracy {evaluated["accuracy"]:.3f}), {seconds:.0f} s', flush=True)
    if args.output:
        with open(args.output, 'w', encoding='utf-8') as f:
            json.dump({'unigram_dev_nll': unigram, 'epochs': history}, f, indent=1)
    if args.plot:
        Plot(history, unigram, args.plot)


def Plot(history: list, unigram: float, path: str,
         title: str = 'keras_hub decoder LM, K=4 cells, M=4, 1F1B') -> None:
    """The train and dev nats per character by epoch, beside the unigram model's, as a PNG."""
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use('Agg')
    from matplotlib import pyplot  # pylint: disable=import-outside-toplevel
    epochs = [h['epoch'] for h in history]
    figure, axes = pyplot.subplots(figsize=(6, 3.5))
    axes.plot(epochs, [h['train_nll'] for h in history], marker='o', label='train')
    axes.plot(epochs, [h['dev_nll'] for h in history], marker='o', label='dev')
    axes.axhline(unigram, color='gray', linestyle='--', label='unigram (dev)')
    axes.set_xlabel('epoch')
    axes.set_ylabel('nats per character')
    axes.set_title(title)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)


if __name__ == '__main__':
    main()
