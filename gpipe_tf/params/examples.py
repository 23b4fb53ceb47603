"""A tiny registered model that exercises the model registry end to end."""

from __future__ import annotations

from gpipe_tf import hyperparams
from gpipe_tf import model_registry
from gpipe_tf.layers import basic
from gpipe_tf.layers import pipeline


def SyntheticInputParams() -> hyperparams.Params:
    """Input params of synthetic classification data: Gaussian features, uniform labels.

    A stand-in until Params-driven tf.data input generators exist; it only describes the data
    (shapes, size, seed), and callers draw batches from it.
    """
    p = hyperparams.Params()
    p.Define('batch_size', 32, 'Examples per mini-batch.')
    p.Define('num_examples', 1024, 'Examples in the dataset.')
    p.Define('input_dim', 16, 'Size of each example\'s feature vector.')
    p.Define('num_classes', 10, 'Number of label classes.')
    p.Define('seed', 0, 'Seed the features and labels are drawn from.')
    return p


@model_registry.RegisterSingleTaskModel
class PipelinedMLP:
    """A 16 -> 64 -> 64 -> 64 -> 10 ReLU MLP pipelined over 4 cells and 8 micro-batches."""

    INPUT_DIM = 16
    HIDDEN_DIMS = (64, 64, 64)
    NUM_CLASSES = 10
    BATCH_SIZE = 64

    def Task(self) -> hyperparams.Params:
        dims = (self.INPUT_DIM,) + self.HIDDEN_DIMS + (self.NUM_CLASSES,)
        layers = []
        for i, (input_dim, output_dim) in enumerate(zip(dims[:-1], dims[1:])):
            last = i == len(dims) - 2
            layers.append(basic.DenseLayer.Params().Set(
                name=f'dense_{i}', input_dim=input_dim, output_dim=output_dim,
                activation='none' if last else 'relu'))
        return pipeline.PipeliningLayer.Params().Set(
            name='mlp', layer_tpl=layers, num_cells=4, num_micro_batches=8,
            input_shapes=[self.BATCH_SIZE, self.INPUT_DIM])

    def _Input(self) -> hyperparams.Params:
        return SyntheticInputParams().Set(input_dim=self.INPUT_DIM, num_classes=self.NUM_CLASSES)

    def Train(self) -> hyperparams.Params:
        return self._Input().Set(batch_size=self.BATCH_SIZE, num_examples=32768, seed=1)

    def Test(self) -> hyperparams.Params:
        return self._Input().Set(batch_size=self.BATCH_SIZE, num_examples=1024, seed=2)
