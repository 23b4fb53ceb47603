"""A tiny registered model that exercises the registry and the trainer end to end."""

from __future__ import annotations

from gpipe_tf import hyperparams
from gpipe_tf import model_registry
from gpipe_tf.input import image
from gpipe_tf.layers import basic
from gpipe_tf.pipeline import pipelining_layer
from gpipe_tf.tasks import classifier


@model_registry.RegisterSingleTaskModel
class PipelinedMLP:
    """A 16 -> 64 -> 64 -> 64 -> 10 ReLU MLP pipelined over 4 cells and 8 micro-batches, on
    synthetic 4 x 4 images (flattened to 16 features) labelled by a random linear teacher."""
    TRAINS_ON_A_CPU = True  # In minutes, on 2 cores (--list_models says so).

    IMAGE_SIZE = 4
    HIDDEN_DIMS = (64, 64, 64)
    NUM_CLASSES = 10
    BATCH_SIZE = 64

    def Pipeline(self) -> hyperparams.Params:
        dims = (self.IMAGE_SIZE ** 2,) + self.HIDDEN_DIMS + (self.NUM_CLASSES,)
        layers = []
        for i, (input_dim, output_dim) in enumerate(zip(dims[:-1], dims[1:])):
            last = i == len(dims) - 2
            layers.append(basic.DenseLayer.Params().Set(
                name=f'dense_{i}', input_dim=input_dim, output_dim=output_dim,
                activation='none' if last else 'relu'))
        return pipelining_layer.PipeliningLayer.Params().Set(
            name='mlp', layer_tpl=layers, num_cells=4, num_micro_batches=8,
            input_shapes=[self.BATCH_SIZE, dims[0]])

    def Task(self) -> hyperparams.Params:
        p = classifier.ClassifierTask.Params().Set(name='PipelinedMLP', model=self.Pipeline(),
                                                   flatten_images=True)
        p.train.Set(learning_rate=1e-2, max_steps=600, save_interval_steps=200,
                    summary_interval_steps=50, eval_interval_steps=200)
        return p

    def _Input(self) -> hyperparams.Params:
        return image.SyntheticImageInput.Params().Set(
            batch_size=self.BATCH_SIZE, image_size=self.IMAGE_SIZE, num_channels=1,
            num_classes=self.NUM_CLASSES)

    def Train(self) -> hyperparams.Params:
        return self._Input().Set(num_examples_total=32768, seed=1)

    def Test(self) -> hyperparams.Params:
        return self._Input().Set(num_examples_total=1024, seed=2, shuffle=False)
