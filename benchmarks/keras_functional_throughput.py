r"""Throughput of keras_hub's GPT-2 in `fit`, pipelined with `gpipe_tf.keras.Functional` at K=2 on
2 virtual CPU devices, against the same model un-pipelined, in one process.

    python benchmarks/keras_functional_throughput.py [--micro_batches=8] [--batch=128]
        [--unroll=auto] [--recompute=always] [--repeats=3] [--epochs=2] [--breakdown]
        [--inter_op=2]

TensorFlow runs every op on one thread (intra-op 1) with two ops in flight (inter-op 2), so each
of the two virtual devices is one core of this 2-core machine, as in
`benchmarks/simulator_validation.py`. The model is `examples/keras_hub_gpt2.py`'s (a keras_hub
`GPT2CausalLM` of 4 blocks of width 64, 4 heads, feed-forward 256, sequences of 64, its tied
token embedding giving the logits over the corpus's 188 characters), on synthetic token ids of
random lengths (padding mask 1 on real tokens, sample weights 0 on padding): throughput depends
on the shapes only. The pipelined model is the keras_hub task given to `Functional` as it is,
cut at its middle block (`transformer_layer_2`) into K=2 stages, schedule 1f1b, M
micro-batches; the un-pipelined one is a second task of the same initial weights, compiled
alike (Adam, the same loss and weighted metric), on the same two threads. It is not confined to
one core: the two threads also run its independent ops together (a backward's input and weight
gradients, the optimizer's updates), which its `cores` column shows; `--inter_op=1` runs both
models one op at a time, on one core, where the pipelined model's time over the un-pipelined
one's is the extra work of its micro-batches (small ops cost their fixed overhead M times).

Each model first runs a warm-up epoch (its first `fit` traces the train step); then, `--repeats`
times, each fits `--epochs` epochs of the same data in the same batches, the two alternating
(their order swapped each round, so that a slower phase of the shared machine falls on both).
Examples per second come from the median epoch time (and, `best`, from the fastest: the least
disturbed by other work on the machine); the ratio of the pipelined model's to the un-pipelined
one's is compared with the schedule's ideal M/(M+K-1)*K (K devices, a bubble of (K-1)/(M+K-1)).
`cores` is the process's CPU seconds over the wall seconds of a model's epochs, `cpu ms/ex` its
CPU milliseconds per example (the work, all threads). The build time of the pipelined model is
`Functional(...)` and its first train step (which traces it).

Each of --batch, --micro_batches, --unroll and --recompute takes a comma-separated list: one row
per combination. `--breakdown` adds, per row, the un-pipelined model at the micro-batch size
(what M small batches cost one core instead of one) and the pipelined model at K=1 (one device,
M micro-batches: the pipeline's own overhead, recompute included).

Prints a table as it goes; writes benchmarks/results/keras_functional_throughput.json.
"""

from __future__ import annotations

import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import argparse  # pylint: disable=g-import-not-at-top,g-bad-import-order
import itertools  # pylint: disable=g-import-not-at-top,g-bad-import-order
import json  # pylint: disable=g-import-not-at-top,g-bad-import-order
import statistics  # pylint: disable=g-import-not-at-top,g-bad-import-order
import time  # pylint: disable=g-import-not-at-top,g-bad-import-order

import keras  # pylint: disable=g-import-not-at-top,g-bad-import-order
import numpy as np  # pylint: disable=g-import-not-at-top,g-bad-import-order
import tensorflow as tf  # pylint: disable=g-import-not-at-top,g-bad-import-order

from gpipe_tf import keras as gpipe_keras  # pylint: disable=g-import-not-at-top
from gpipe_tf import test_utils  # pylint: disable=g-import-not-at-top

NUM_CELLS = 2
DEVICES: list[str] = []  # Set by Setup() before any TF op runs.


def Setup(inter_op: int = NUM_CELLS) -> None:
    """One thread per op, two ops in flight, two virtual devices: each device is one core.
    Before any TF op runs (importing Keras runs none)."""
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(inter_op)
    DEVICES[:] = test_utils.ConfigureVirtualCpus(NUM_CELLS)


def Gpt2(args):
    """examples/keras_hub_gpt2.py's task (sizes from the flags), its initial weights seeded."""
    import keras_hub  # pylint: disable=import-outside-toplevel
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=args.vocab, num_layers=args.layers, num_heads=args.heads,
        hidden_dim=args.hidden, intermediate_dim=args.intermediate,
        max_sequence_length=args.length)
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def Compile(model) -> None:
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  weighted_metrics=[keras.metrics.SparseCategoricalCrossentropy(
                      from_logits=True, name='nll')])


def Data(args):
    """(inputs, labels, weights): `--examples` sequences of random ids and lengths, padded."""
    rng = np.random.default_rng(0)
    ids = rng.integers(4, args.vocab, [args.examples, args.length + 1], dtype=np.int32)
    lengths = rng.integers(8, args.length + 2, [args.examples])
    ids[np.arange(args.length + 1)[None, :] >= lengths[:, None]] = 0
    inputs = {'token_ids': ids[:, :-1], 'padding_mask': (ids[:, :-1] != 0).astype(np.int32)}
    return inputs, ids[:, 1:], (ids[:, 1:] != 0).astype(np.float32)


class Timer(keras.callbacks.Callback):
    """Wall seconds of each epoch of a `fit` and of its first train step."""

    def __init__(self):
        super().__init__()
        self.epochs, self.first_step = [], None

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append(time.perf_counter() - self._epoch)

    def on_train_batch_begin(self, batch, logs=None):
        if self.first_step is None:
            self._step = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        if self.first_step is None:
            self.first_step = time.perf_counter() - self._step


def Fit(model, data, batch: int, epochs: int) -> tuple[list[float], float]:
    """Per-epoch wall seconds and the process's CPU seconds of a fit."""
    timer = Timer()
    cpu = time.process_time()
    model.fit(*data[:2], sample_weight=data[2], batch_size=batch, epochs=epochs, shuffle=False,
              verbose=0, callbacks=[timer])
    return timer.epochs, time.process_time() - cpu


class Contender:
    """A compiled model, its warm-up done, and its epoch times and cores used so far."""

    def __init__(self, name, model, data, batch):
        self.name, self.model, self.data, self.batch = name, model, data, batch
        Compile(model)
        timer = Timer()
        start = time.perf_counter()
        model.fit(*data[:2], sample_weight=data[2], batch_size=batch, epochs=1, shuffle=False,
                  verbose=0, callbacks=[timer])
        self.warmup_s, self.first_step_s = time.perf_counter() - start, timer.first_step
        self.Reset()

    def Reset(self) -> None:
        self.epochs, self.cpu_s = [], 0.0

    def Run(self, epochs: int) -> None:
        seconds, cpu_s = Fit(self.model, self.data, self.batch, epochs)
        self.epochs += seconds
        self.cpu_s += cpu_s

    @property
    def examples_per_s(self) -> float:
        """From the median epoch."""
        return len(self.data[1]) / statistics.median(self.epochs)

    @property
    def best_examples_per_s(self) -> float:
        """From the fastest epoch (the least disturbed by other work on the machine)."""
        return len(self.data[1]) / min(self.epochs)

    @property
    def cores(self) -> float:
        """CPU seconds over wall seconds of the timed epochs."""
        return self.cpu_s / sum(self.epochs)

    @property
    def cpu_ms_per_example(self) -> float:
        """The work: CPU milliseconds per example, all threads (less disturbed than wall time
        by other work on the machine)."""
        return 1e3 * self.cpu_s / (len(self.data[1]) * len(self.epochs))

    def Summary(self) -> dict:
        return {'examples_per_s': self.examples_per_s,
                'best_examples_per_s': self.best_examples_per_s, 'epoch_s': self.epochs,
                'median_epoch_s': statistics.median(self.epochs), 'cores_used': self.cores,
                'cpu_ms_per_example': self.cpu_ms_per_example, 'warmup_epoch_s': self.warmup_s,
                'first_step_s': self.first_step_s}


def Pipelined(args, m: int, unroll, recompute: str, num_cells: int = NUM_CELLS):
    """The task in `num_cells` stages, cut at its blocks; (model, seconds of Functional(...))."""
    lm = Gpt2(args)
    split = [f'transformer_layer_{args.layers * k // num_cells}' for k in range(1, num_cells)]
    start = time.perf_counter()
    model = gpipe_keras.Functional(lm, num_micro_batches=m, split_points=split,
                                   devices=DEVICES[:num_cells], schedule='1f1b',
                                   unroll=unroll, recompute=recompute)
    return model, time.perf_counter() - start


def Alternate(contenders, repeats: int, epochs: int) -> None:
    """`repeats` rounds of each contender's `epochs`, their order reversed every round."""
    for r in range(repeats):
        for contender in (contenders if r % 2 == 0 else contenders[::-1]):
            contender.Run(epochs)


def Unroll(value: str):
    return {'true': True, 'false': False, 'auto': 'auto'}[value.lower()]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--micro_batches', default='8', help='Comma-separated M values.')
    parser.add_argument('--batch', default='128', help='Comma-separated examples per step (N).')
    parser.add_argument('--unroll', default='auto', help='Comma-separated: auto, true, false.')
    parser.add_argument('--recompute', default='always', help='Comma-separated: always, never.')
    parser.add_argument('--repeats', type=int, default=3, help='Rounds of the two models.')
    parser.add_argument('--epochs', type=int, default=2, help='Timed epochs per round.')
    parser.add_argument('--examples', type=int, default=1024, help='Examples per epoch.')
    parser.add_argument('--breakdown', action='store_true',
                        help='Also time the un-pipelined model at the micro-batch size and the '
                        'pipelined one at K=1.')
    parser.add_argument('--vocab', type=int, default=188, help='examples/keras_hub_gpt2.py: 188.')
    parser.add_argument('--length', type=int, default=64)
    parser.add_argument('--hidden', type=int, default=64)
    parser.add_argument('--intermediate', type=int, default=256)
    parser.add_argument('--heads', type=int, default=4)
    parser.add_argument('--layers', type=int, default=4)
    parser.add_argument('--inter_op', type=int, default=NUM_CELLS,
                        help='Ops in flight: 1 runs both models on one core (the pipeline '
                        'without its overlap: its extra work).')
    parser.add_argument('--out', default='benchmarks/results/keras_functional_throughput.json')
    parser.add_argument('--append', action='store_true',
                        help='Keep the rows already in --out (another setting\'s run).')
    args = parser.parse_args()
    Setup(args.inter_op)
    load = os.getloadavg()
    print(f'TensorFlow {tf.__version__}, Keras {keras.__version__}, {os.cpu_count()} CPU cores '
          f'(load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}), {NUM_CELLS} virtual devices '
          f'(intra-op 1, inter-op {args.inter_op} threads); GPT-2 of {args.layers} blocks, hidden '
          f'{args.hidden}, {args.heads} heads, intermediate {args.intermediate}, length '
          f'{args.length}, vocabulary {args.vocab}; {args.examples} examples '
          f'an epoch, {args.repeats} x {args.epochs} timed epochs each', flush=True)
    data = Data(args)
    print(f"{'N':>4} {'M':>3} {'unroll':>6} {'recompute':>9} {'plain ex/s':>11} "
          f"{'piped ex/s':>11} {'ratio':>6} {'best':>5} {'ideal':>6} {'cores':>9} "
          f"{'cpu ms/ex':>9} {'build s':>8} {'1st step s':>10}"
          + ('  breakdown ex/s: plain at N/M, K=1' if args.breakdown else ''), flush=True)
    rows, plains = [], {}
    if args.append and os.path.exists(args.out):
        with open(args.out, encoding='utf-8') as f:
            rows = json.load(f)['rows']
    for batch, m, unroll, recompute in itertools.product(
            [int(v) for v in args.batch.split(',')],
            [int(v) for v in args.micro_batches.split(',')],
            [Unroll(v) for v in args.unroll.split(',')], args.recompute.split(',')):
        if batch not in plains:
            plains[batch] = Contender('plain', Gpt2(args), data, batch)
        plain = plains[batch]
        model, build_s = Pipelined(args, m, unroll, recompute)
        piped = Contender('pipelined', model, data, batch)
        contenders = [plain, piped]
        if args.breakdown:
            micro = Contender('plain_micro', Gpt2(args), data, max(batch // m, 1))
            one, _ = Pipelined(args, m, unroll, recompute, num_cells=1)
            contenders += [micro, Contender('pipelined_k1', one, data, batch)]
        plain.Reset()  # Timed alongside this row's contenders only.
        Alternate(contenders, args.repeats, args.epochs)
        ideal = m / (m + NUM_CELLS - 1) * NUM_CELLS
        ratio = piped.examples_per_s / plain.examples_per_s
        best = piped.best_examples_per_s / plain.best_examples_per_s
        row = dict(k=NUM_CELLS, m=m, batch=batch, unroll=unroll, recompute=recompute,
                   plain=plain.Summary(), pipelined=piped.Summary(), ratio=ratio,
                   best_ratio=best, ideal_ratio=ideal, build_s=build_s,
                   first_step_s=piped.first_step_s, inter_op=args.inter_op,
                   examples_per_epoch=args.examples, repeats=args.repeats,
                   epochs_per_repeat=args.epochs, load_before=list(load),
                   load_after=list(os.getloadavg()))
        extra = ''
        if args.breakdown:
            row['plain_micro_batch'] = contenders[2].Summary()
            row['pipelined_k1'] = contenders[3].Summary()
            extra = (f'  {contenders[2].examples_per_s:.0f}, '
                     f'{contenders[3].examples_per_s:.0f}')
            del contenders[2:], micro, one
        rows.append(row)
        load = os.getloadavg()
        print(f'{batch:4d} {m:3d} {str(unroll):>6} {recompute:>9} {plain.examples_per_s:11.1f} '
              f'{piped.examples_per_s:11.1f} {ratio:6.2f} {best:5.2f} {ideal:6.2f} '
              f'{plain.cores:4.2f}/{piped.cores:4.2f} '
              f'{plain.cpu_ms_per_example:4.2f}/{piped.cpu_ms_per_example:4.2f} '
              f'{build_s:8.2f} {piped.first_step_s:10.1f}' + extra, flush=True)
        os.makedirs(os.path.dirname(args.out) or '.', exist_ok=True)
        with open(args.out, 'w', encoding='utf-8') as f:  # After every row: nothing lost.
            json.dump({'tensorflow': tf.__version__, 'keras': keras.__version__,
                       'cpu_cores': os.cpu_count(), 'model': {
                           k: getattr(args, k) for k in ('vocab', 'length', 'hidden',
                                                         'intermediate', 'heads', 'layers')},
                       'rows': rows}, f, indent=1)
    print(f'wrote {args.out}')


if __name__ == '__main__':
    main()
