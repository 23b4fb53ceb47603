"""Tasks: a model (a PipeliningLayer over a flat layer list) plus what training needs around it.

A task turns an input batch into the model's inputs, reduces the model's outputs to metrics
(`loss` is the one minimised), and holds the training recipe in `p.train`: optimizer, learning
rate and schedule, gradient clipping, weight decay, and the trainer's step and interval settings.

    p = model_registry.GetParams('image.amoebanet.AmoebaNetD_Small', 'Train')
    task = p.Instantiate()                       # p.model is the PipeliningLayer
    metrics = task.FPropTower(batch)             # NestedMap name -> (value, weight)

Metrics are (value, weight) pairs: a mean over `weight` items (examples or tokens), so that
evaluation combines batches, including the padding batch at the end, by weighted averages.
"""

from __future__ import annotations

import functools

import tensorflow as tf

from gpipe_tf import hyperparams
from gpipe_tf import learning_rate
from gpipe_tf import loss_scale
from gpipe_tf import optimizer
from gpipe_tf.layers import base_layer
from gpipe_tf.layers import fprop_context
from gpipe_tf.nested_map import NestedMap
from gpipe_tf.pipeline import fields
from gpipe_tf.pipeline import schedule as schedule_lib


def TrainParams() -> hyperparams.Params:
    """The training recipe and the trainer's settings, `task.train`."""
    p = hyperparams.Params()
    p.Define('optimizer', optimizer.Adam.Params(), 'Optimizer Params (gpipe_tf.optimizer).')
    p.Define('learning_rate', 1e-3, 'Base learning rate; the schedule multiplies it.',
             check=hyperparams.Number(greater_than=0))
    p.Define('lr_schedule', learning_rate.Constant.Params(),
             'Learning-rate multiplier schedule (gpipe_tf.learning_rate).')
    p.Define('clip_gradient_norm_to_value', 0.0,
             'Clip gradients to this global norm; 0 disables clipping.',
             check=hyperparams.Number(at_least=0))
    p.Define('weight_decay', 0.0, 'L2 penalty: weight_decay * 0.5 * sum of squares of every '
             'trainable variable of rank >= 2 (weights, not biases or norms) joins the loss.',
             check=hyperparams.Number(at_least=0))
    p.Define('max_steps', 1000, 'Training stops after this many steps.',
             check=hyperparams.Integer(at_least=0))
    p.Define('save_interval_steps', 500, 'Steps between checkpoints (and one at exit).',
             check=hyperparams.Integer(at_least=1))
    p.Define('save_max_to_keep', 3, 'Checkpoints kept; older ones are deleted.',
             check=hyperparams.Integer(at_least=1))
    p.Define('summary_interval_steps', 50, 'Steps between TensorBoard summaries.',
             check=hyperparams.Integer(at_least=1))
    p.Define('eval_interval_steps', 500, 'Steps between evaluations in train_and_eval mode; 0 '
             'or None: only at the end.',
             check=hyperparams.OrNone(hyperparams.Integer(at_least=0)))
    p.Define('eval_dataset', 'Test', 'Dataset evaluated in eval and train_and_eval modes.')
    p.Define('progress_interval_seconds', 5.0, 'Seconds between console progress lines (0: one '
             'line per step).', check=hyperparams.Number(at_least=0))
    p.Define('loss_scale', loss_scale.DynamicLossScale.Params(),
             'Dynamic loss scaling (gpipe_tf.loss_scale), used when a layer of the model '
             'computes in float16 (fprop_dtype).')
    p.Define('plot_pipeline', True, 'Once per run, write pictures of the pipeline to '
             'TensorBoard (train/pipeline/*): its planned cell costs, timeline and memory, and '
             'the timeline of one traced step.')
    return p


def Inference(method):
    """Marks a task method as an inference entry point (`Predict`, `Decode`, ...): its body, and
    so every forward it traces or runs, is in `fprop_context.Inference()` whatever context the
    caller is in (the default context is training's). Serving and decoding set the mode too
    (`train/export.py`, `train/decode.py`); a task's own entry points set it so that a caller
    of the library cannot forget it."""

    @functools.wraps(method)
    def InInferenceMode(*args, **kwargs):
        with fprop_context.Inference():
            return method(*args, **kwargs)

    return InInferenceMode


class BaseTask(base_layer.BaseLayer):
    """A model with its input, metrics and training recipe. Subclasses define `ModelInputs`
    and `ComputeMetrics` (and inference entry points, decorated with `Inference`, where the
    task serves: a classifier's `Predict`, a translation task's `Decode`)."""

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('model', None, 'Params of the model: a PipeliningLayer (or any layer whose '
                 'FProp takes the NestedMap that ModelInputs returns).')
        p.Define('input', None, 'Params of the input generator (gpipe_tf.input).')
        p.Define('train', TrainParams(), 'Training recipe and trainer settings.')
        return p

    def __init__(self, params):
        params = SyncInputShapes(params.Copy())
        super().__init__(params)
        if self.p.model is None:
            raise ValueError(f'{self.path}: task Params need a model (p.model is None).')
        self.CreateChild('model', self.p.model)

    def ModelInputs(self, batch: NestedMap):
        """The model's input from an input batch."""
        raise NotImplementedError(f'{type(self).__name__}.ModelInputs')

    def ComputeMetrics(self, batch: NestedMap, outputs) -> NestedMap:
        """NestedMap name -> (value, weight) from the model's outputs; must include `loss`."""
        raise NotImplementedError(f'{type(self).__name__}.ComputeMetrics')

    def FPropTower(self, batch: NestedMap) -> NestedMap:
        """Runs the model on `batch` and returns its metrics (see the module docstring).

        Under a pipeline schedule that starts backwards before the last forward (1f1b,
        interleaved, zero-bubble), the loss is `ComputeMetrics(...).loss` of each micro-batch,
        computed inside the pipeline (`PipeliningLayer.FPropLoss`) and combined by weight: the
        same loss and gradients as on the whole batch. The other metrics are computed on the
        whole batch's outputs.
        """
        inputs = self.ModelInputs(batch)
        if not _LossInsideModel(self.p.model):
            return self.ComputeMetrics(batch, self.model(inputs))

        def MicroBatchLoss(outputs, micro_batch):
            return self.ComputeMetrics(micro_batch, outputs).loss

        outputs, loss, weight = self.model.FPropLoss(self.model.theta, inputs, MicroBatchLoss,
                                                     batch)
        metrics = self.ComputeMetrics(batch, outputs)
        metrics.loss = (loss, weight)
        return metrics

    def RegularizationLoss(self) -> tf.Tensor:
        """weight_decay * 0.5 * sum of squares of the trainable variables of rank >= 2."""
        decay = self.p.train.weight_decay
        weights = [v for v in self.trainable_variables if v.shape.rank >= 2]
        if not decay or not weights:
            return tf.constant(0.0)
        terms = []
        for v in weights:
            with tf.device(v.device):
                terms.append(tf.nn.l2_loss(v))
        return decay * tf.add_n(terms)


def _LossInsideModel(model_params) -> bool:
    """Whether the model is a pipeline whose schedule needs the loss per micro-batch."""
    if 'schedule' not in model_params or not hasattr(model_params.cls, 'FPropLoss'):
        return False
    kind = schedule_lib.SCHEDULE_KINDS.get(model_params.schedule)
    # A name that is no kind goes inside too: the pipeline's plan refuses it, naming it.
    return kind is None or kind.loss_inside_pipeline


def SyncInputShapes(p: hyperparams.Params) -> hyperparams.Params:
    """Sets the batch dimension of `p.model.input_shapes` (the shapes the partitioner plans
    with) to `p.input.batch_size`, so that changing the input's batch size is one override.
    Returns `p` (modified in place)."""
    model, data = p.model, p.input
    if (model is None or data is None or 'input_shapes' not in model or
            model.input_shapes is None or 'batch_size' not in data):
        return p
    batch_dim = model.batch_dim if 'batch_dim' in model else 0
    fields.InputShapes(model)  # A ConfigError for a value that is no shapes, as the user wrote it.

    def Fix(shape):
        if isinstance(shape, dict):
            return {k: Fix(v) for k, v in shape.items()}
        if fields.IsSeveralShapes(shape):
            return type(shape)(Fix(s) for s in shape)
        shape = list(shape)
        if len(shape) > batch_dim:
            shape[batch_dim] = data.batch_size
        return shape

    model.input_shapes = Fix(model.input_shapes)
    return p


def WeightedMean(values: tf.Tensor, weights: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """(sum(values * weights) / sum(weights), sum(weights)); 0 when the weights sum to 0."""
    total = tf.reduce_sum(weights)
    return tf.math.divide_no_nan(tf.reduce_sum(values * weights), total), total
