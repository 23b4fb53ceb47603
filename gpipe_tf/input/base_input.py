"""Params-driven tf.data input generators over in-memory datasets.

An input generator holds one split of a dataset as a NestedMap of numpy arrays, one row per
example (`Examples()`), and makes two tf.data pipelines of it:

- `TrainDataset(start_step)`: mini-batches forever, in an order that is a function of
  `(seed, step)` alone: epoch e visits the examples in the permutation
  `stateless_shuffle(range(N), seed=[seed, e])`, and step s takes positions [s B, (s + 1) B) of
  the concatenated epochs. Resuming at `start_step` gives exactly the batches an uninterrupted
  run would have seen from that step, without checkpointing the iterator.
- `EvalDataset()`: one pass over the split in order; the last batch is padded with zero rows.

Every batch carries `weights` [B] float32: 1 for a real example, 0 for padding.
Subclasses implement `_LoadExamples()` (and may override `_Preprocess(batch)`, which runs inside
tf.data on whole batches).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from gpipe_tf import errors
from gpipe_tf import hyperparams
from gpipe_tf.nested_map import NestedMap


class BaseInput:
    """Base class of input generators: an in-memory split, batched by tf.data."""

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = hyperparams.InstantiableParams(cls)
        p.Define('name', 'input', 'Name of this input, used in messages.')
        p.Define('batch_size', 32, 'Examples per mini-batch (the pipeline\'s N).',
                 check=hyperparams.Integer(at_least=1))
        p.Define('shuffle', True, 'Visit examples in a seeded random order in TrainDataset; '
                 'False: in file order.')
        p.Define('seed', 0, 'Seed of the example order (and of anything random in the input).')
        p.Define('num_examples', None, 'Use only the first this many examples of the split '
                 '(None: all).', check=hyperparams.OrNone(hyperparams.Integer(at_least=1)))
        return p

    def __init__(self, params: hyperparams.Params):
        self.params = params.Copy()
        self._examples = None

    @property
    def p(self) -> hyperparams.Params:
        return self.params

    def _LoadExamples(self) -> NestedMap:
        """The whole split: a NestedMap of numpy arrays with the same leading dimension."""
        raise NotImplementedError(f'{type(self).__name__} must implement _LoadExamples().')

    def _Preprocess(self, batch: NestedMap) -> NestedMap:
        """Turns a batch of stored rows into the model's input (runs inside tf.data)."""
        return batch

    def Examples(self) -> NestedMap:
        """The split's examples (loaded once), trimmed to `num_examples` when set."""
        if self._examples is None:
            examples = NestedMap(self._LoadExamples())
            sizes = {k: len(v) for k, v in examples.FlattenItems()}
            if len(set(sizes.values())) != 1:
                raise ValueError(f'{self.p.name}: the example arrays differ in length: {sizes}.')
            count = next(iter(sizes.values()))
            if self.p.num_examples is not None:
                if not 0 < self.p.num_examples <= count:
                    raise errors.ConfigError(f'{self.p.name}: num_examples={self.p.num_examples} '
                                             f'but the split has {count} examples; expected at '
                                             f'most {count}.')
                examples = examples.Transform(lambda x: x[:self.p.num_examples])
            if len(next(iter(examples.Flatten()))) == 0:
                # Inputs that read files say which in their own check; this is the fallback.
                raise errors.InputError(f'{self.p.name}: the split has no examples; expected at '
                                        f'least one.')
            self._examples = examples
        return self._examples

    def NumExamples(self) -> int:
        return len(self.Examples().Flatten()[0])

    def _Constants(self) -> NestedMap:
        return self.Examples().Transform(tf.constant)

    def _Gather(self, examples: NestedMap, indices, weights) -> NestedMap:
        batch = examples.Transform(lambda x: tf.gather(x, indices))
        batch = self._Preprocess(batch)
        batch.weights = weights
        return batch

    def TrainDataset(self, start_step: int = 0) -> tf.data.Dataset:
        """Mini-batches forever, from step `start_step` on (see the module docstring)."""
        if start_step < 0:
            raise ValueError(f'{self.p.name}: start_step must be >= 0, got {start_step}.')
        n, batch_size, seed = self.NumExamples(), self.p.batch_size, self.p.seed
        first = start_step * batch_size
        first_epoch, skip = divmod(first, n)

        def Epoch(epoch):
            order = tf.range(n, dtype=tf.int64)
            if self.p.shuffle:
                order = tf.random.experimental.stateless_shuffle(
                    order, seed=tf.stack([tf.constant(seed, tf.int64), epoch]))
            return tf.data.Dataset.from_tensor_slices(order)

        examples = self._Constants()
        ones = tf.ones([batch_size], tf.float32)
        return (tf.data.Dataset.range(first_epoch, np.iinfo(np.int64).max)
                .flat_map(Epoch).skip(skip)
                .batch(batch_size, drop_remainder=True)
                .map(lambda indices: self._Gather(examples, indices, ones))
                .prefetch(2))

    def EvalDataset(self) -> tf.data.Dataset:
        """One pass over the split in order; the last batch is padded (weights 0)."""
        n, batch_size = self.NumExamples(), self.p.batch_size
        padded = -(-n // batch_size) * batch_size
        examples = self._Constants()
        indices = np.minimum(np.arange(padded), n - 1)
        weights = (np.arange(padded) < n).astype(np.float32)

        def Batch(index_batch, weight_batch):
            batch = self._Gather(examples, index_batch, weight_batch)
            # Padding rows repeat the last example; zero them so no real data leaks into them.
            real = tf.reshape(weight_batch > 0, [-1])
            return batch.Transform(
                lambda x: tf.where(tf.reshape(real, [-1] + [1] * (x.shape.rank - 1)), x,
                                   tf.zeros_like(x)) if x.shape.rank else x)

        return (tf.data.Dataset.from_tensor_slices((indices, weights))
                # Padded to whole batches: drop_remainder drops nothing and makes the batch
                # size static, which the pipeline needs to split micro-batches in a v1 graph.
                .batch(batch_size, drop_remainder=True).map(Batch).prefetch(2))
