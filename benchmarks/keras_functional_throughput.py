r"""Throughput of keras_hub's GPT-2 in `fit`, pipelined with `gpipe_tf.keras.Functional` at K=2 on
2 virtual CPU devices of one thread each, against the same model un-pipelined on one thread.

    python benchmarks/keras_functional_throughput.py [--micro_batches=8] [--batch=128]
        [--unroll=auto] [--recompute=always] [--repeats=3] [--epochs=2] [--breakdown]
        [--inter_op=2] [--baseline_inter_op=1]

The pipelined model runs in this process, where TensorFlow runs every op on one thread (intra-op
1) with two ops in flight (inter-op 2), so each of the two virtual devices is one core of this
2-core machine, as in `benchmarks/simulator_validation.py`. The un-pipelined baseline runs in a
child process (this script, `--_role=plain`), since TensorFlow fixes its thread pools when it
starts: intra-op 1 and `--baseline_inter_op` threads, by default 1, one op at a time on one
core. A comma-separated list (`--baseline_inter_op=1,2`) starts one child per value, all timed
in every row: at inter-op 2 the baseline also runs its independent ops together (a backward's
input and weight gradients, the optimizer's updates), as it did in this process before, which
its `cores` column shows. `--inter_op=1` runs the pipelined model one op at a time too, on one
core, where its time over the baseline's is the extra work of its micro-batches (small ops
cost their fixed overhead M times).

The model is `examples/keras_hub_gpt2.py`'s (a keras_hub `GPT2CausalLM` of 4 blocks of width
64, 4 heads, feed-forward 256, sequences of 64, its tied token embedding giving the logits over
the corpus's 188 characters), on synthetic token ids of random lengths (padding mask 1 on real
tokens, sample weights 0 on padding): throughput depends on the shapes only. The pipelined
model is the keras_hub task given to `Functional` as it is, cut at its middle block
(`transformer_layer_2`) into K=2 stages, schedule 1f1b, M micro-batches; the baseline is the
same task built in the child from the same seed (the child reports a digest of its initial
weights and of its data, checked against this process's), compiled alike (Adam, the same loss
and weighted metric), fitted on the same data in the same batches.

Each fit takes its batches, in order, from one iterator over the data repeated (`FitTimed`:
Keras given arrays makes an iterator per epoch, and deleting the last one waited up to a second
for its thread). Each model first runs a warm-up epoch (its first `fit` traces the train step);
then, `--repeats` rounds, each model fits `--epochs` epochs, the models in turn (this process
asks the child for its epochs with a line on its stdin, the child answers with a JSON line of
its epoch times and CPU seconds; the order swapped each round, so that a slower phase of the
shared machine falls on both). Examples per second come from the median epoch time (and, `best`, from the fastest: the
least disturbed by other work on the machine); the ratio of the pipelined model's to the
baseline's is compared with the schedule's ideal M/(M+K-1)*K (K devices, a bubble of
(K-1)/(M+K-1)). `cores` is a process's CPU seconds over the wall seconds of a model's epochs,
`cpu ms/ex` its CPU milliseconds per example (the work, all threads). The build time of the
pipelined model is `Functional(...)` and its first train step (which traces it). A failure in
the child ends the run with one line (its log is kept); the child dies with this process.

Each of --batch, --micro_batches, --unroll and --recompute takes a comma-separated list: one row
per combination. `--breakdown` adds, per row, the baseline at the micro-batch size (in the first
child: what M small batches cost one core instead of one) and the pipelined model at K=1 (one
device, M micro-batches: the pipeline's own overhead, recompute included).

Prints a table as it goes; writes benchmarks/results/keras_functional_throughput.json.
"""

from __future__ import annotations

import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import argparse  # pylint: disable=g-import-not-at-top,g-bad-import-order
import ctypes  # pylint: disable=g-import-not-at-top,g-bad-import-order
import hashlib  # pylint: disable=g-import-not-at-top,g-bad-import-order
import itertools  # pylint: disable=g-import-not-at-top,g-bad-import-order
import json  # pylint: disable=g-import-not-at-top,g-bad-import-order
import signal  # pylint: disable=g-import-not-at-top,g-bad-import-order
import statistics  # pylint: disable=g-import-not-at-top,g-bad-import-order
import subprocess  # pylint: disable=g-import-not-at-top,g-bad-import-order
import sys  # pylint: disable=g-import-not-at-top,g-bad-import-order
import tempfile  # pylint: disable=g-import-not-at-top,g-bad-import-order
import time  # pylint: disable=g-import-not-at-top,g-bad-import-order
import traceback  # pylint: disable=g-import-not-at-top,g-bad-import-order

import keras  # pylint: disable=g-import-not-at-top,g-bad-import-order
import numpy as np  # pylint: disable=g-import-not-at-top,g-bad-import-order
import tensorflow as tf  # pylint: disable=g-import-not-at-top,g-bad-import-order

from gpipe_tf import keras as gpipe_keras  # pylint: disable=g-import-not-at-top
from gpipe_tf import test_utils  # pylint: disable=g-import-not-at-top

NUM_CELLS = 2
DEVICES: list[str] = []  # Set by Setup() before any TF op runs.
# The flags that make the model and its data: the child gets them from this process.
MODEL_FLAGS = ('vocab', 'length', 'hidden', 'intermediate', 'heads', 'layers')
DATA_FLAGS = MODEL_FLAGS + ('examples',)


def Setup(inter_op: int = NUM_CELLS, num_devices: int = NUM_CELLS) -> None:
    """One thread per op, `inter_op` ops in flight, `num_devices` virtual devices (2 and 2: each
    device is one core). Before any TF op runs (importing Keras runs none)."""
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(inter_op)
    DEVICES[:] = test_utils.ConfigureVirtualCpus(num_devices)


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


def Digest(arrays) -> str:
    """A digest of a nest of arrays (weights, data): equal ones in both processes."""
    digest = hashlib.sha256()
    for array in tf.nest.flatten(arrays):
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()[:16]


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


def FitTimed(model, data, batch: int, epochs: int) -> Timer:
    """`model.fit` on `data` (inputs, labels, sample weights) in order, in batches of `batch`,
    `epochs` epochs of every example, timed. The batches come from one iterator over a repeated
    dataset (`steps_per_epoch`): given arrays, Keras makes a new iterator each epoch and
    deletes the last one, and that waits for the thread of tf.data's autotuning
    (`Model::OptimizeLoop`: 0.6 to 1.1 s of idle CPU before an epoch's first step, measured
    with a stack sampler and gdb, in the pipelined model's process, where it had made a third
    of its epochs' time)."""
    batches = tf.data.Dataset.from_tensor_slices(tuple(data)).batch(
        batch, drop_remainder=True).repeat()
    timer = Timer()
    model.fit(batches, steps_per_epoch=len(data[1]) // batch, epochs=epochs, verbose=0,
              callbacks=[timer])
    return timer


def Fit(model, data, batch: int, epochs: int) -> tuple[list[float], float]:
    """Per-epoch wall seconds and the process's CPU seconds of a fit."""
    cpu = time.process_time()
    timer = FitTimed(model, data, batch, epochs)
    return timer.epochs, time.process_time() - cpu


class Contender:
    """A compiled model in this process, its warm-up done, and its epoch times and cores used
    so far."""

    def __init__(self, name, model, data, batch, inter_op):
        self.name, self.model, self.data, self.batch = name, model, data, batch
        self.examples, self.threading = len(data[1]), {'intra_op': 1, 'inter_op': inter_op}
        Compile(model)
        start = time.perf_counter()
        timer = FitTimed(model, data, batch, 1)
        self.warmup_s, self.first_step_s = time.perf_counter() - start, timer.first_step
        self.Reset()

    def Reset(self) -> None:
        self.epochs, self.cpu_s = [], 0.0

    def Fit(self, epochs: int) -> tuple[list[float], float]:
        return Fit(self.model, self.data, self.batch, epochs)

    def Run(self, epochs: int) -> None:
        seconds, cpu_s = self.Fit(epochs)
        self.epochs += seconds
        self.cpu_s += cpu_s

    @property
    def examples_per_s(self) -> float:
        """From the median epoch."""
        return self.examples / statistics.median(self.epochs)

    @property
    def best_examples_per_s(self) -> float:
        """From the fastest epoch (the least disturbed by other work on the machine)."""
        return self.examples / min(self.epochs)

    @property
    def cores(self) -> float:
        """CPU seconds over wall seconds of the timed epochs."""
        return self.cpu_s / sum(self.epochs)

    @property
    def cpu_ms_per_example(self) -> float:
        """The work: CPU milliseconds per example, all threads (less disturbed than wall time
        by other work on the machine)."""
        return 1e3 * self.cpu_s / (self.examples * len(self.epochs))

    def Summary(self) -> dict:
        return {'examples_per_s': self.examples_per_s,
                'best_examples_per_s': self.best_examples_per_s, 'epoch_s': self.epochs,
                'median_epoch_s': statistics.median(self.epochs), 'cores_used': self.cores,
                'cpu_ms_per_example': self.cpu_ms_per_example, 'warmup_epoch_s': self.warmup_s,
                'first_step_s': self.first_step_s, **self.threading}


class ChildError(RuntimeError):
    """The baseline's process failed (one line: what, and where its log is)."""


class Child:
    """This script in a subprocess (`--_role=plain`) with its own thread pools: the baseline,
    one model per batch size, fitted when asked."""

    def __init__(self, args, inter_op: int):
        self.inter_op = inter_op
        log, self.log = tempfile.mkstemp(prefix=f'keras_functional_throughput_inter_op{inter_op}_',
                                         suffix='.log')
        self.process = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), '--_role=plain',
             f'--inter_op={inter_op}', f'--_parent={os.getpid()}',
             *[f'--{k}={getattr(args, k)}' for k in DATA_FLAGS]],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
        os.close(log)

    def Ask(self, **request) -> dict:
        """Sends `request` as a JSON line; the child's JSON line back."""
        try:
            self.process.stdin.write(json.dumps(request) + '\n')
            self.process.stdin.flush()
            line = self.process.stdout.readline()
        except BrokenPipeError:
            line = ''
        reply = json.loads(line) if line else {}
        if 'error' in reply or not line:
            what = reply.get('error') or f'exited with status {self.process.wait()}'
            raise ChildError(f'the baseline\'s process (inter-op {self.inter_op}, pid '
                             f'{self.process.pid}) failed: {what} (its log: {self.log})')
        return reply

    def Close(self, keep_log: bool = False) -> None:
        """Ends the child (killed if it does not exit at once), and removes its log unless
        `keep_log`."""
        if self.process.poll() is None:
            try:
                self.process.stdin.close()
                self.process.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        if not keep_log:
            os.remove(self.log)


class Remote(Contender):
    """The baseline at `batch` in a child process: built, compiled and warmed up there."""

    def __init__(self, name, child: Child, batch: int, examples: int, digests: dict):
        self.name, self.child, self.batch, self.examples = name, child, batch, examples
        self.threading = {'intra_op': 1, 'inter_op': child.inter_op, 'process': 'child'}
        reply = child.Ask(batch=batch)
        for what, digest in digests.items():
            if reply[what] != digest:
                raise ChildError(f'the baseline\'s {what} in its process differ from this '
                                 f'process\'s ({reply[what]} against {digest})')
        self.warmup_s, self.first_step_s = reply['warmup_s'], reply['first_step_s']
        self.Reset()

    def Fit(self, epochs: int) -> tuple[list[float], float]:
        reply = self.child.Ask(batch=self.batch, epochs=epochs)
        return reply['epoch_s'], reply['cpu_s']


def ServeBaseline(args) -> None:
    """The child (`--_role=plain`): per request line on stdin, {batch} builds, compiles and warms
    up the baseline at that batch size, {batch, epochs} fits it; one JSON line back each."""
    try:  # Linux: killed when the parent dies, however it dies.
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (AttributeError, OSError):
        pass  # Elsewhere: stdin's end (the parent gone) ends it after the request at hand.
    if args._parent and os.getppid() != args._parent:
        return  # The parent died before prctl.
    replies = os.fdopen(os.dup(1), 'w')
    os.dup2(2, 1)  # Anything else printed goes to the log, not into the replies.
    Setup(args.inter_op, num_devices=1)
    data, models = Data(args), {}
    for line in sys.stdin:
        request = json.loads(line)
        try:
            batch = request['batch']
            if 'epochs' in request:
                seconds, cpu_s = models[batch].Fit(request['epochs'])
                reply = {'epoch_s': seconds, 'cpu_s': cpu_s}
            else:
                model = Gpt2(args)
                weights = Digest(model.get_weights())
                models[batch] = Contender('plain', model, data, batch, args.inter_op)
                reply = {'weights': weights, 'data': Digest(data),
                         'warmup_s': models[batch].warmup_s,
                         'first_step_s': models[batch].first_step_s}
        except Exception as e:  # pylint: disable=broad-except
            traceback.print_exc()
            reply = {'error': f'{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ""}'}
        replies.write(json.dumps(reply) + '\n')
        replies.flush()


def Pipelined(args, lm, m: int, unroll, recompute: str, num_cells: int = NUM_CELLS):
    """The task `lm` in `num_cells` stages, cut at its blocks; (model, seconds of
    Functional(...))."""
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


def Ints(value: str) -> list[int]:
    return [int(v) for v in value.split(',')]


def Compare(args, children: list[Child]) -> None:
    """The rows: the pipelined model here against the baselines in `children`."""
    Setup(args.inter_op)
    load = os.getloadavg()
    baselines = ', '.join(f'inter-op {child.inter_op}' for child in children)
    print(f'TensorFlow {tf.__version__}, Keras {keras.__version__}, {os.cpu_count()} CPU cores '
          f'(load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}); pipelined: {NUM_CELLS} virtual '
          f'devices, intra-op 1, inter-op {args.inter_op} threads; baseline in a child process: '
          f'intra-op 1, {baselines}; GPT-2 of {args.layers} blocks, hidden {args.hidden}, '
          f'{args.heads} heads, intermediate {args.intermediate}, length {args.length}, '
          f'vocabulary {args.vocab}; {args.examples} examples an epoch, {args.repeats} x '
          f'{args.epochs} timed epochs each', flush=True)
    data = Data(args)
    data_digest = Digest(data)
    print(f"{'N':>4} {'M':>3} {'unroll':>6} {'recompute':>9} {'base ex/s':>10} "
          f"{'piped ex/s':>10} {'ratio':>6} {'best':>5} {'ideal':>6} {'cores':>9} "
          f"{'cpu ms/ex':>9} {'build s':>8} {'1st step s':>10}"
          + ''.join(f'  inter-op {c.inter_op}: base ex/s, ratio' for c in children[1:])
          + ('  breakdown ex/s: base at N/M, K=1' if args.breakdown else ''), flush=True)
    rows, plains = [], {}
    if args.append and os.path.exists(args.out):
        with open(args.out, encoding='utf-8') as f:
            rows = json.load(f)['rows']
    for batch, m, unroll, recompute in itertools.product(
            Ints(args.batch), Ints(args.micro_batches), [Unroll(v) for v in args.unroll.split(',')],
            args.recompute.split(',')):
        lm = Gpt2(args)
        digests = {'weights': Digest(lm.get_weights()), 'data': data_digest}
        for child in children:
            if (child, batch) not in plains:
                plains[child, batch] = Remote('plain', child, batch, args.examples, digests)
        bases = [plains[child, batch] for child in children]
        model, build_s = Pipelined(args, lm, m, unroll, recompute)
        if args.breakdown:
            # Made before any model here traces: Gpt2 sets the random seed, and a train step
            # traced under another seed is traced again (4 s at M=4) when next called.
            one, _ = Pipelined(args, Gpt2(args), m, unroll, recompute, num_cells=1)
        piped = Contender('pipelined', model, data, batch, args.inter_op)
        contenders = [*bases, piped]
        if args.breakdown:
            micro = Remote('plain_micro', children[0], max(batch // m, 1), args.examples, digests)
            contenders += [micro, Contender('pipelined_k1', one, data, batch, args.inter_op)]
        for base in bases:
            base.Reset()  # Timed alongside this row's contenders only.
        Alternate(contenders, args.repeats, args.epochs)
        ideal = m / (m + NUM_CELLS - 1) * NUM_CELLS
        ratios = [piped.examples_per_s / base.examples_per_s for base in bases]
        best = piped.best_examples_per_s / bases[0].best_examples_per_s
        row = dict(k=NUM_CELLS, m=m, batch=batch, unroll=unroll, recompute=recompute,
                   plain=bases[0].Summary(), pipelined=piped.Summary(), ratio=ratios[0],
                   best_ratio=best, ideal_ratio=ideal, build_s=build_s,
                   first_step_s=piped.first_step_s, inter_op=args.inter_op,
                   baseline_inter_op=bases[0].child.inter_op,
                   examples_per_epoch=args.examples, repeats=args.repeats,
                   epochs_per_repeat=args.epochs, load_before=list(load),
                   load_after=list(os.getloadavg()))
        if bases[1:]:
            row['more_baselines'] = [
                {**base.Summary(), 'ratio': ratio,
                 'best_ratio': piped.best_examples_per_s / base.best_examples_per_s}
                for base, ratio in zip(bases[1:], ratios[1:])]
        extra = ''.join(f'  {base.examples_per_s:.0f}, {ratio:.2f}'
                        for base, ratio in zip(bases[1:], ratios[1:]))
        if args.breakdown:
            row['plain_micro_batch'] = micro.Summary()
            row['pipelined_k1'] = contenders[-1].Summary()
            extra += f'  {micro.examples_per_s:.0f}, {contenders[-1].examples_per_s:.0f}'
            del contenders[len(bases) + 1:], micro, one
        rows.append(row)
        load = os.getloadavg()
        base = bases[0]
        print(f'{batch:4d} {m:3d} {str(unroll):>6} {recompute:>9} {base.examples_per_s:10.1f} '
              f'{piped.examples_per_s:10.1f} {ratios[0]:6.2f} {best:5.2f} {ideal:6.2f} '
              f'{base.cores:4.2f}/{piped.cores:4.2f} '
              f'{base.cpu_ms_per_example:4.2f}/{piped.cpu_ms_per_example:4.2f} '
              f'{build_s:8.2f} {piped.first_step_s:10.1f}' + extra, flush=True)
        os.makedirs(os.path.dirname(args.out) or '.', exist_ok=True)
        with open(args.out, 'w', encoding='utf-8') as f:  # After every row: nothing lost.
            json.dump({'tensorflow': tf.__version__, 'keras': keras.__version__,
                       'cpu_cores': os.cpu_count(),
                       'model': {k: getattr(args, k) for k in MODEL_FLAGS}, 'rows': rows},
                      f, indent=1)
    print(f'wrote {args.out}')


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--micro_batches', default='8', help='Comma-separated M values.')
    parser.add_argument('--batch', default='128', help='Comma-separated examples per step (N).')
    parser.add_argument('--unroll', default='auto', help='Comma-separated: auto, true, false.')
    parser.add_argument('--recompute', default='always', help='Comma-separated: always, never.')
    parser.add_argument('--repeats', type=int, default=3, help='Rounds of the models.')
    parser.add_argument('--epochs', type=int, default=2, help='Timed epochs per round.')
    parser.add_argument('--examples', type=int, default=1024,
                        help='Examples per epoch: a multiple of each --batch (with --breakdown, '
                        'of each micro-batch size too).')
    parser.add_argument('--breakdown', action='store_true',
                        help='Also time the baseline at the micro-batch size and the '
                        'pipelined model at K=1.')
    parser.add_argument('--vocab', type=int, default=188, help='examples/keras_hub_gpt2.py: 188.')
    parser.add_argument('--length', type=int, default=64)
    parser.add_argument('--hidden', type=int, default=64)
    parser.add_argument('--intermediate', type=int, default=256)
    parser.add_argument('--heads', type=int, default=4)
    parser.add_argument('--layers', type=int, default=4)
    parser.add_argument('--inter_op', type=int, default=NUM_CELLS,
                        help='Ops in flight in the pipelined model: 1 runs it on one core (the '
                        'pipeline without its overlap: its extra work).')
    parser.add_argument('--baseline_inter_op', default='1',
                        help='Comma-separated: the baseline\'s ops in flight, one child process '
                        'each (1: one core; 2: as the pipelined model\'s threads); ratios '
                        'against the first.')
    parser.add_argument('--out', default='benchmarks/results/keras_functional_throughput.json')
    parser.add_argument('--append', action='store_true',
                        help='Keep the rows already in --out (another setting\'s run).')
    parser.add_argument('--_role', choices=['pipelined', 'plain'], default='pipelined',
                        help=argparse.SUPPRESS)
    parser.add_argument('--_parent', type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._role == 'plain':  # pylint: disable=protected-access
        try:
            ServeBaseline(args)  # At the batch sizes the parent asks for, checked there.
        except KeyboardInterrupt:
            pass  # The parent's Ctrl-C reaches this process too; the parent reports it.
        return
    for batch, m in itertools.product(Ints(args.batch), Ints(args.micro_batches)):
        sizes = [(batch, '--batch')]
        if args.breakdown:  # It also fits the baseline at the micro-batch size.
            sizes.append((max(batch // m, 1), 'the micro-batch size'))
        for size, flag in sizes:
            if args.examples % size:
                parser.error(f'--examples={args.examples} is not a multiple of {flag} ({size}): '
                             'every epoch fits whole batches of every example')
    # `kill` as Ctrl-C: the `finally` below ends the children and removes their logs.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    children, failed = [], False
    try:
        for inter_op in Ints(args.baseline_inter_op):
            children.append(Child(args, inter_op))
        Compare(args, children)
    except ChildError as e:
        failed = True
        sys.exit(f'error: {e}')
    finally:  # However this process ends (Ctrl-C included), its children end with it.
        for child in children:
            child.Close(keep_log=failed)


if __name__ == '__main__':
    main()
