"""AmoebaNet models of the GPipe paper, registered as `image.amoebanet.<ClassName>`.

AmoebaNet-D (L, D) has L normal cells and D filters (see `gpipe_tf.layers.amoebanet`). The
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
from gpipe_tf import model_registry
from gpipe_tf.layers import amoebanet


def ImageInputParams() -> hyperparams.Params:
    """Input params of image classification: what a batch looks like.

    A stand-in until Params-driven tf.data input generators exist; it only describes the data.
    """
    p = hyperparams.Params()
    p.Define('batch_size', 128, 'Examples per mini-batch.')
    p.Define('image_size', 224, 'Height and width of the images.')
    p.Define('num_channels', 3, 'Channels of the images.')
    p.Define('num_classes', 1000, 'Number of label classes.')
    return p


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

    def Task(self) -> hyperparams.Params:
        return amoebanet.PipelineParams(self.Network(), self.BATCH_SIZE, self.NUM_CELLS,
                                        self.NUM_MICRO_BATCHES, self.RECOMPUTE)

    def _Input(self) -> hyperparams.Params:
        return ImageInputParams().Set(batch_size=self.BATCH_SIZE, image_size=self.IMAGE_SIZE,
                                      num_channels=self.NUM_CHANNELS,
                                      num_classes=self.NUM_CLASSES)

    def Train(self) -> hyperparams.Params:
        return self._Input()

    def Test(self) -> hyperparams.Params:
        return self._Input()


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
    """AmoebaNet-D (3, 16) on 28 x 28 x 1 images and 10 classes (Fashion-MNIST's shape): the
    basic stem, K = 4, M = 4, and lighter regularisation and a faster batch norm decay than the
    ImageNet recipe, so that it trains on a CPU in minutes."""
    NUM_NORMAL_CELLS = 3
    NUM_FILTERS = 16
    IMAGE_SIZE = 28
    NUM_CHANNELS = 1
    NUM_CLASSES = 10
    BATCH_SIZE = 32
    NUM_CELLS = 4
    NUM_MICRO_BATCHES = 4

    def Network(self) -> hyperparams.Params:
        return super().Network().Set(
            stem_type='basic', stem_filters=16, drop_path_keep_prob=0.9,
            dense_dropout_keep_prob=0.9, aux_scaling=0.1, batch_norm_decay=0.99)
