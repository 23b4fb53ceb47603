r"""Dev-set decoding of a trained translation model: the full forward's greedy decoding (the
O(T^2) reference, `SequenceTask.DecodeByFullForward`) against incremental decoding on one
micro-batch and pipelined over micro-batches, and beam search.

    python benchmarks/decode_speed.py --logdir=DIR [--model=mt.multilingual.TransformerTiny]
        [--micro_batches=1,4] [--beam=4] [--no_full_forward]
        [--out=benchmarks/results/decode_speed.json]

DIR holds a training run of the model (`gpipe-train --model=... --logdir=DIR`); its newest
checkpoint is decoded, on the model's K virtual CPU devices, in the model's batches (the last
padded). Per method: seconds for the whole dev set (the first batch's tracing included),
sentences whose tokens equal the full forward's, and corpus BLEU (sacrebleu). Prints a table
and writes every row to JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))


def _Batches(rows, batch_size):
    """(rows of a batch, padded with copies of the last row; how many are real)."""
    import numpy as np  # pylint: disable=g-import-not-at-top
    for start in range(0, len(rows), batch_size):
        part = rows[start:start + batch_size]
        count = len(part)
        if count < batch_size:
            part = np.concatenate([part, np.repeat(part[-1:], batch_size - count, 0)])
        yield part, count


def Main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--logdir', required=True)
    parser.add_argument('--model', default='mt.multilingual.TransformerTiny')
    parser.add_argument('--micro_batches', default='1,4',
                        help='comma-separated M for incremental greedy decoding')
    parser.add_argument('--beam', type=int, default=4, help='beam size (0: no beam search)')
    parser.add_argument('--no_full_forward', action='store_true')
    parser.add_argument('--out', default=os.path.join(os.path.dirname(__file__), 'results',
                                                      'decode_speed.json'))
    args = parser.parse_args(argv)
    os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
    import numpy as np  # pylint: disable=g-import-not-at-top
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from gpipe_tf import model_registry  # pylint: disable=g-import-not-at-top
    from gpipe_tf import test_utils  # pylint: disable=g-import-not-at-top
    from gpipe_tf.input import text  # pylint: disable=g-import-not-at-top
    from gpipe_tf.input import vocabulary  # pylint: disable=g-import-not-at-top
    from gpipe_tf.models.transformer import decoding  # pylint: disable=g-import-not-at-top
    from gpipe_tf.train import program  # pylint: disable=g-import-not-at-top

    p = model_registry.GetParams(args.model, 'Train')
    p.model.devices = test_utils.ConfigureVirtualCpus(p.model.num_cells)[:p.model.num_cells]
    task = p.Instantiate()
    path = tf.train.latest_checkpoint(program.CheckpointDir(args.logdir))
    if path is None:
        sys.exit(f'error: no checkpoint under {args.logdir}')
    tf.train.Checkpoint(task=task).restore(path).expect_partial()
    step = int(tf.train.load_checkpoint(path).get_tensor(program.STEP_KEY))
    eval_params = model_registry.GetParams(args.model, p.train.eval_dataset).input
    data = eval_params.Instantiate()
    sentences = data.Sentences()
    examples = data.Examples()
    src_ids = examples.src_ids[:len(sentences)]
    src_paddings = examples.src_paddings[:len(sentences)]
    references = [row[3] for row in sentences]
    theta = task.model.theta

    def Run(name, fn):
        start = time.perf_counter()
        ids = []
        for (ids_part, count), (paddings, _) in zip(_Batches(src_ids, eval_params.batch_size),
                                                    _Batches(src_paddings,
                                                             eval_params.batch_size)):
            ids.append(np.asarray(fn(tf.constant(ids_part, tf.int32),
                                     tf.constant(paddings, tf.float32)))[:count])
        seconds = time.perf_counter() - start
        ids = np.concatenate(ids)
        # As `gpipe_tf.train.decode`: ids beyond the vocabulary (the softmax may be larger)
        # read as <unk>.
        hypotheses = [data.vocab.Decode(np.where(row < data.vocab.size, row, vocabulary.UNK_ID))
                      for row in ids]
        print(f'{name}: {seconds:.1f} s', flush=True)
        return dict(method=name, seconds=round(seconds, 2),
                    bleu=round(text.Bleu(hypotheses, references), 2)), ids

    rows, reference_ids = [], None
    if not args.no_full_forward:
        row, reference_ids = Run('full forward greedy', task.DecodeByFullForward)
        rows.append(row)
    for m in [int(x) for x in args.micro_batches.split(',') if x]:
        decoder = decoding.IncrementalDecoder(task.model, m)
        fn = tf.function(lambda s, q, d=decoder: d.Greedy(theta, s, q, task.p.bos_id,
                                                          task.p.eos_id), autograph=False)
        row, ids = Run(f'incremental greedy M={m}', fn)
        if reference_ids is not None:
            row['identical_sentences'] = int((ids == reference_ids).all(1).sum())
        rows.append(row)
    if args.beam:
        fn = tf.function(lambda s, q: task.BeamIds(s, q, args.beam)[0], autograph=False)
        rows.append(Run(f'beam {args.beam}', fn)[0])
    for row in rows:
        row.update(model=args.model, step=step, sentences=len(sentences),
                   num_cells=p.model.num_cells, batch_size=eval_params.batch_size)
    print(f'{args.model} at step {step}, {len(sentences)} dev sentences, K='
          f'{p.model.num_cells}, batch {eval_params.batch_size}:')
    for row in rows:
        same = (f", identical to the full forward's: {row['identical_sentences']}"
                if 'identical_sentences' in row else '')
        print(f"  {row['method']:28s} {row['seconds']:7.1f} s  BLEU {row['bleu']:5.2f}{same}")
    os.makedirs(os.path.dirname(args.out) or '.', exist_ok=True)
    with open(args.out, 'w') as f:
        json.dump(rows, f, indent=1)
    return rows


if __name__ == '__main__':
    Main()
