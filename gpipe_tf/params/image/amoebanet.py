"""AmoebaNet models of the GPipe paper, registered as `image.amoebanet.<ClassName>`.

AmoebaNet-D (L, D) has L normal cells and D filters (see `gpipe_tf.models.amoebanet.network`). The
Table 1 models are registered with that column's number of partitions K; parameter counts from
`FPropMeta` (tests/test_amoebanet.py, 1000 classes, aux head, batch norm moving statistics
included):

    model                   paper   ours            K   column
    AmoebaNetD_18_208         82M    81,948,371     1   Naive-1 (no GPipe: M = 1, no recompute)
    AmoebaNetD_18_416        318M   318,603,556     1   Pipeline-1
    AmoebaNetD_18_544        542M   541,412,516     2   Pipeline-2
    AmoebaNetD_36_544       1.05B 1,054,898,468     4   Pipeline-4
    AmoebaNetD_72_512        1.8B 1,844,884,624     8   Pipeline-8
    AmoebaNetB_18_512        557M   559,552,025     4   ImageNet run (§4), 480 x 480
    AmoebaNetD_18_256           -   122,779,856     8   Table 2's throughput model

The paper states no M for Table 1; Pipeline-K models use M = 32 (M >= 4K, where the paper finds
the bubble negligible). `AmoebaNetD_Small` is a Fashion-MNIST-sized model that trains on a CPU.
"""

from __future__ import annotations

from gpipe_tf import hyperparams
from gpipe_tf import learning_rate
from gpipe_tf import model_registry
from gpipe_tf import optimizer
from gpipe_tf.input import image
from gpipe_tf.models.amoebanet import network as amoebanet
from gpipe_tf.tasks import classifier


class _AmoebaNet:
    """An AmoebaNet pipelined over K cells; subclasses set the class attributes."""

    GENOTYPE = 'amoeba_net_d'
    NUM_NORMAL_CELLS = 18  # L
    NUM_FILTERS = 256  # D
    IMAGE_SIZE = 224
    NUM_CHANNELS = 3
    NUM_CLASSES = 1000
    BATCH_SIZE = 128
    NUM_CELLS = 1  # K, the pipeline's partitions.
    NUM_MICRO_BATCHES = 32  # M
    RECOMPUTE = 'always'

    def Network(self) -> hyperparams.Params:
        """The network's hyperparameters (the reference's ImageNet defaults otherwise)."""
        return amoebanet.NetworkParams().Set(
            genotype=self.GENOTYPE, num_normal_cells=self.NUM_NORMAL_CELLS,
            num_filters=self.NUM_FILTERS, image_size=self.IMAGE_SIZE,
            num_channels=self.NUM_CHANNELS, num_classes=self.NUM_CLASSES)

    def Pipeline(self) -> hyperparams.Params:
        """The PipeliningLayer Params: the network as a flat layer list over K cells."""
        return amoebanet.PipelineParams(self.Network(), self.BATCH_SIZE, self.NUM_CELLS,
                                        self.NUM_MICRO_BATCHES, self.RECOMPUTE)

    def TrainRecipe(self, p: hyperparams.Params) -> hyperparams.Params:
        """The reference's ImageNet recipe: RMSProp (decay 0.9, momentum 0.9, epsilon 1.0),
        learning rate 0.015 per 256 examples decayed by 0.97 every 2.4 epochs after 3 warm-up
        epochs, weight decay 4e-5, gradients clipped to global norm 10 (ImageNet: 1.28M
        examples)."""
        steps_per_epoch = 1281167 // self.BATCH_SIZE
        return p.Set(
            optimizer=optimizer.RMSProp.Params(),
            learning_rate=0.015 * self.BATCH_SIZE / 256,
            lr_schedule=learning_rate.ExponentialDecay.Params().Set(
                decay_rate=0.97, decay_steps=int(2.4 * steps_per_epoch),
                warmup_steps=3 * steps_per_epoch),
            weight_decay=4e-5, clip_gradient_norm_to_value=10.0,
            max_steps=100 * steps_per_epoch, save_interval_steps=5000,
            eval_interval_steps=steps_per_epoch)

    def Task(self) -> hyperparams.Params:
        p = classifier.ClassifierTask.Params().Set(name=self.__class__.__name__,
                                                   model=self.Pipeline())
        self.TrainRecipe(p.train)
        return p

    def _Input(self) -> hyperparams.Params:
        """Synthetic images of the model's shape: ImageNet is not something a CPU machine can
        fetch or train on; these models are for inspecting, planning and benchmarks."""
        return image.SyntheticImageInput.Params().Set(
            batch_size=self.BATCH_SIZE, image_size=self.IMAGE_SIZE,
            num_channels=self.NUM_CHANNELS, num_classes=self.NUM_CLASSES)

    def Train(self) -> hyperparams.Params:
        return self._Input().Set(seed=1)

    def Test(self) -> hyperparams.Params:
        return self._Input().Set(seed=2, shuffle=False)


@model_registry.RegisterSingleTaskModel
class AmoebaNetD_18_208(_AmoebaNet):
    """GPipe Table 1, Naive-1: AmoebaNet-D (18, 208), 82M parameters, on one accelerator
    without GPipe (one micro-batch, no re-materialization)."""
    NUM_FILTERS = 208
    NUM_MICRO_BATCHES = 1
    RECOMPUTE = 'never'


@model_registry.RegisterSingleTaskModel
class AmoebaNetD_18_416(_AmoebaNet):
    """GPipe Table 1, Pipeline-1: AmoebaNet-D (18, 416), 318M parameters, K = 1."""
    NUM_FILTERS = 416


@model_registry.RegisterSingleTaskModel
class AmoebaNetD_18_544(_AmoebaNet):
    """GPipe Table 1, Pipeline-2: AmoebaNet-D (18, 544), 542M parameters, K = 2."""
    NUM_FILTERS = 544
    NUM_CELLS = 2


@model_registry.RegisterSingleTaskModel
class AmoebaNetD_36_544(_AmoebaNet):
    """GPipe Table 1, Pipeline-4: AmoebaNet-D (36, 544), 1.05B parameters, K = 4."""
    NUM_NORMAL_CELLS = 36
    NUM_FILTERS = 544
    NUM_CELLS = 4


@model_registry.RegisterSingleTaskModel
class AmoebaNetD_72_512(_AmoebaNet):
    """GPipe Table 1, Pipeline-8: AmoebaNet-D (72, 512), "1.8B" parameters, K = 8.

    The reference architecture has 1.845B (torchgpipe's port reports 1.84B), which the paper's
    two significant figures print as 1.8B.
    """
    NUM_NORMAL_CELLS = 72
    NUM_FILTERS = 512
    NUM_CELLS = 8


@model_registry.RegisterSingleTaskModel
class AmoebaNetD_18_256(_AmoebaNet):
    """GPipe Table 2: AmoebaNet-D (18, 256), the throughput model; registered at K = 8, M = 32,
    the table's fastest setting (3.48x of K = 2, M = 1). The table states no image or batch
    size; we use Table 1's 224 x 224 and 128."""
    NUM_CELLS = 8


@model_registry.RegisterSingleTaskModel
class AmoebaNetB_18_512(_AmoebaNet):
    """GPipe §4 ImageNet run: AmoebaNet-B (18, 512), 557M parameters, 480 x 480 images, K = 4.

    The B genotype is the reference's `amoeba_net_b` (`model_specs.py`). The paper states no
    batch size or M for this run; we use Table 1's 128 and M = 32.
    """
    GENOTYPE = 'amoeba_net_b'
    NUM_FILTERS = 512
    IMAGE_SIZE = 480
    NUM_CELLS = 4


@model_registry.RegisterSingleTaskModel
class AmoebaNetD_Small(_AmoebaNet):
    """AmoebaNet-D (3, 16) on Fashion-MNIST (28 x 28 x 1, 10 classes; Debian's
    `dataset-fashion-mnist`, or any directory of its IDX files via `input.data_dir`): the basic
    stem, K = 4 cells, M = 8 micro-batches of 8, lighter regularisation and a faster batch norm
    decay than the ImageNet recipe, and Adam with a cosine decay, so that it trains on a 2-core
    CPU in minutes. The README's main job."""
    TRAINS_ON_A_CPU = True  # In minutes, on 2 cores (--list_models says so).
    NUM_NORMAL_CELLS = 3
    NUM_FILTERS = 16
    IMAGE_SIZE = 28
    NUM_CHANNELS = 1
    NUM_CLASSES = 10
    BATCH_SIZE = 64
    NUM_CELLS = 4
    NUM_MICRO_BATCHES = 8
    MAX_STEPS = 2000

    def Network(self) -> hyperparams.Params:
        return super().Network().Set(
            stem_type='imagenet', num_stem_cells=0, stem_filters=16, drop_path_keep_prob=0.9,
            dense_dropout_keep_prob=0.9, aux_scaling=0.1, batch_norm_decay=0.99)

    def TrainRecipe(self, p):
        return p.Set(
            optimizer=optimizer.Adam.Params(), learning_rate=2e-3,
            lr_schedule=learning_rate.CosineDecay.Params().Set(
                total_steps=self.MAX_STEPS, min_value=0.05, warmup_steps=50),
            weight_decay=0.0, clip_gradient_norm_to_value=5.0, max_steps=self.MAX_STEPS,
            save_interval_steps=500, summary_interval_steps=25, eval_interval_steps=1000)

    def _Input(self):
        return image.FashionMnistInput.Params().Set(batch_size=self.BATCH_SIZE)

    def Train(self):
        return self._Input().Set(split='train', seed=1)

    def Test(self):
        return self._Input().Set(split='test', shuffle=False)
