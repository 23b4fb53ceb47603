"""AmoebaNet (Real et al.) as a flat stack of pipelineable layers, after TensorFlow's reference.

The network is the reference's `model_builder._build_network_base` (tensorflow/tpu,
models/official/amoeba_net): a stem (a 3x3 convolution, then `num_stem_cells` reduction cells for
ImageNet), L normal cells in three stacks split by two reduction cells (filters double at each
reduction), an optional auxiliary head after the second stack, and a head (ReLU, global average
pool, dropout, dense, softmax cross-entropy). `NetworkLayers` lists it as one Params per layer, each
with an `FPropMeta`, so PipeliningLayer balances its cells by FLOPs; `PipelineParams` builds the
PipeliningLayer. With the reference's normal-cell concat (states 0, 3, 4, 6) this reproduces the
GPipe paper's parameter counts (tests/test_amoebanet.py).
The genotypes and each operation's layers are in `gpipe_tf.models.amoebanet.ops`.

"Cell" below is AmoebaNet's word for its repeated block (one layer here); a pipeline's cells are
its partitions, groups of these layers.

Between layers flows one NestedMap, every leaf batch-major:
  pipeline input  NestedMap(images=[B, H, W, C] float, labels=[B] int)
  after the stem  NestedMap(cur=[B, H', W', 32], labels)
  after a cell    NestedMap(prev=the cell's input cur, cur=the cell's output, labels)
  after aux head  ... plus aux_per_example_loss=[B]
  head output     NestedMap(logits=[B, classes], per_example_loss=[B], weight=[B], correct=[B])
A layer passes on entries it does not read (labels, the aux loss). Scalars cannot be concatenated
over micro-batches, so the loss is reduced after the pipeline (`Metrics`).

Drop path (the reference's drop_path, "drop connect") zeroes a whole example's branch output
with probability 1 - drop_path_keep_prob, with a mask drawn per example from `StepSeed()`, the
branch and the example's index in the mini-batch (`example_random.Uniform`): it is the same in a
pipeline's re-materialized forward and at every M and R. The keep probability is constant; the
reference's burn-in schedule over training steps is not implemented.
"""

from __future__ import annotations

import tensorflow as tf

from gpipe_tf import hyperparams
from gpipe_tf.layers import base_layer
from gpipe_tf.layers import basic
from gpipe_tf.layers import conv
from gpipe_tf.layers import example_random
from gpipe_tf.layers import fprop_context
from gpipe_tf.layers import losses
from gpipe_tf.layers import pooling
from gpipe_tf.layers import sequential
from gpipe_tf.pipeline import pipelining_layer
from gpipe_tf.models.amoebanet.ops import (GENOTYPES, NUM_COMBINATIONS, BatchNorm, CellSpec,
                                           Conv, DefineBatchNorm, FactorizedReductionLayer,
                                           OperationLayers, ReluConvBn, Sequence, SumMetas)
from gpipe_tf.layers.base_layer import BaseLayer, LayerMeta
from gpipe_tf.nested_map import NestedMap


# ---- shape and cost helpers ---------------------------------------------------------------------
def _ChainMeta(name: str, layers: list, *shapes) -> LayerMeta:
    layers = [lp.Copy().Set(name=f'{name}.{lp.name}') for lp in layers]
    return sequential.ChainMeta(layers, *shapes)[0]


def _StateShapes(shapes, layer: str, required) -> NestedMap:
    missing = [k for k in required if k not in shapes]
    if missing:
        raise ValueError(f'{layer}: the input NestedMap lacks {missing}; it has {sorted(shapes)}.')
    shapes = NestedMap(shapes)
    for key in required:
        shapes[key] = tf.TensorShape(shapes[key])
    return shapes

# ---- the layers of the network ------------------------------------------------------------------
class AmoebaStemLayer(BaseLayer):
    """The stem's convolution: NestedMap(images, ...) -> NestedMap(cur, ...).

    A 3x3 VALID convolution (stride 2 in the ImageNet stem, 1 in the basic one), no bias, then
    batch norm. Entries other than `images` pass through.
    """

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('input_dim', 3, 'Channels of the images.')
        p.Define('num_filters', 32, 'Output channels (the reference\'s stem_reduction_size).')
        p.Define('stride', 2, 'Stride of the convolution: 2 (ImageNet stem) or 1 (basic stem).')
        DefineBatchNorm(p)
        return p

    @classmethod
    def _ChildParams(cls, p) -> dict:
        return {'conv': Conv('conv', p, (3, 3), p.input_dim, p.num_filters,
                              (p.stride, p.stride), 'VALID'),
                'bn': BatchNorm('bn', p, p.num_filters)}

    def __init__(self, params):
        super().__init__(params)
        for name, child in self._ChildParams(self.p).items():
            self.CreateChild(name, child)

    def FProp(self, theta, inputs: NestedMap) -> NestedMap:
        outputs = NestedMap({k: v for k, v in inputs.items() if k != 'images'})
        outputs.cur = self.bn.FProp(theta.bn, self.conv.FProp(theta.conv, inputs.images))
        return outputs

    @classmethod
    def FPropMeta(cls, p, input_shapes) -> LayerMeta:
        layer = p.name or cls.__name__
        shapes = _StateShapes(input_shapes, layer, ['images'])
        children = cls._ChildParams(p)
        meta = _ChainMeta(layer, [children['conv'], children['bn']], shapes.images)
        out = NestedMap({k: v for k, v in shapes.items() if k != 'images'})
        out.cur = meta.out_shapes
        return SumMetas(out, [meta])


class _TensorDataflow:
    """AmoebaCellLayer's dataflow on tensors: runs children, draws drop-path masks."""

    def __init__(self, layer: 'AmoebaCellLayer', theta: NestedMap):
        self._layer, self._theta = layer, theta
        self._training = fprop_context.Current().training

    def Apply(self, name: str, x):
        return getattr(self._layer, name).FProp(self._theta[name], x)

    def DropPath(self, index: int, x):
        keep_prob = self._layer.p.drop_path_keep_prob
        if keep_prob == 1.0 or not self._training:
            return x
        seed = tf.random.experimental.stateless_fold_in(self._layer.StepSeed(), index)
        shape = tf.concat([tf.shape(x)[:1], tf.ones([x.shape.rank - 1], tf.int32)], 0)
        keep = tf.cast(example_random.Uniform(seed, shape, batch_dim=0) < keep_prob, x.dtype)
        return x * (keep / keep_prob)

    def Add(self, a, b):
        return a + b

    def Concat(self, states: list):
        return tf.concat(states, axis=-1)


class _ShapeDataflow:
    """AmoebaCellLayer's dataflow on shapes: collects the children's and its own costs.

    What a backward keeps is counted per tensor of the cell: a state is kept when the
    operation that made it or one that reads it has a backward that reads it (`LayerMeta`'s
    reads_output, reads_input). Additions, drop path (a per-example scale) and the
    concatenation read none of theirs, so a state only they touch is freed after the forward.
    """

    def __init__(self, p, layer: str, children: dict):
        self._p, self._layer, self._children = p, layer, children
        self.metas, self.flops, self.reads_input = [], 0, False
        self._inside = 0  # What the children keep besides their outputs.
        self._states = {}  # id(shape) -> [shape, bytes, whether a backward reads it].

    @property
    def activation_bytes(self) -> int:
        return self._inside + sum(size for _, size, read in self._states.values() if read)

    def _Made(self, shape, read: bool):
        """A new state of `shape` (a copy: the cached metas share their shape objects)."""
        shape = tf.TensorShape(shape)
        self._states[id(shape)] = [shape, base_layer.ActivationBytes(shape, self._p), read]
        return shape

    def _Elementwise(self, shape, flops_per_element: int):
        self.flops += flops_per_element * shape.num_elements()
        return self._Made(shape, read=False)

    def Apply(self, name: str, x):
        child = self._children[name].Copy().Set(name=f'{self._layer}.{name}')
        meta = child.cls.FPropMeta(child, x)
        self.metas.append(meta)
        if meta.reads_input:
            if id(x) in self._states:
                self._states[id(x)][2] = True
            else:  # One of the cell's inputs.
                self.reads_input = True
        out = self._Made(meta.out_shapes, meta.reads_output)
        self._inside += max(meta.activation_bytes - self._states[id(out)][1], 0)
        return out

    def DropPath(self, index: int, x):
        if self._p.drop_path_keep_prob < 1.0:
            return self._Elementwise(x, 2)
        return x

    def Add(self, a, b):
        if a != b:
            raise ValueError(f'{self._layer}: a combination adds states of shapes {a} and {b}; '
                             'check the genotype and the stride.')
        return self._Elementwise(a, 1)

    def Concat(self, states: list):
        if len({tuple(s[:-1]) for s in states}) > 1:
            raise ValueError(f'{self._layer}: the concatenated states differ in size: '
                             f'{[str(s) for s in states]}; a cell whose unused inputs need '
                             'reducing is not supported.')
        # The cell's output: what reads it is the next layer's to say, so it counts as kept
        # (`LayerMeta.activation_bytes`), as the pipeline's memory planner expects of a cell.
        return self._Made(states[0][:-1].concatenate([sum(s[-1] for s in states)]), read=True)


class AmoebaCellLayer(BaseLayer):
    """One AmoebaNet cell (normal or reduction): NestedMap(prev, cur, ...) -> same keys.

    As the reference's `BaseCell`: state 0 is ReLU-1x1 conv-BN of `cur` (the previous cell's
    output); state 1 is `prev` (the output before that), brought to state 0's shape by a
    factorized reduction when it has twice the resolution, or by ReLU-1x1 conv-BN when only its
    channels differ. Five combinations add two operations' outputs each (drop path on each
    operation but 'none'); the output concatenates the unused states. The output NestedMap has
    `prev` = the input's `cur` and `cur` = the cell's output; other entries pass through.

    The first cell after the stem has no `prev` (prev_dim = 0): state 1 is `cur` itself,
    unreduced, as in the reference.
    """

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('operations', [], 'The 10 operations, two per combination (see CellSpec).')
        p.Define('hiddenstate_indices', [], 'The state each operation reads (see CellSpec).')
        p.Define('used_hiddenstates', [],
                 '7 flags: 1 for states consumed inside the cell; the others are concatenated.')
        p.Define('num_filters', 0, 'Channels of each state (the cell\'s filter size).')
        p.Define('stride', 1, 'Stride of operations on states 0 and 1: 2 in a reduction cell.')
        p.Define('cur_dim', 0, 'Channels of the input `cur`.')
        p.Define('prev_dim', 0, 'Channels of the input `prev`; 0 when there is no prev.')
        p.Define('prev_stride', 1,
                 '2 when `prev` has twice the resolution of `cur` (a reduction lies between).')
        p.Define('drop_path_keep_prob', 1.0,
                 'Probability of keeping an operation\'s output for an example (drop path).')
        DefineBatchNorm(p)
        return p

    @classmethod
    def OutputDim(cls, p) -> int:
        """Channels of the cell's output."""
        return p.num_filters * sum(1 for used in p.used_hiddenstates if not used)

    @classmethod
    def _CheckParams(cls, p, layer: str) -> None:
        num_ops = 2 * NUM_COMBINATIONS
        if len(p.operations) != num_ops or len(p.hiddenstate_indices) != num_ops:
            raise ValueError(f'{layer}: expected {num_ops} operations and hiddenstate_indices, '
                             f'got {len(p.operations)} and {len(p.hiddenstate_indices)}.')
        for j, index in enumerate(p.hiddenstate_indices):
            if not 0 <= index < 2 + j // 2:
                raise ValueError(f'{layer}: operation {j} reads state {index}, which does not '
                                 f'exist yet (states 0 .. {1 + j // 2}).')
        if len(p.used_hiddenstates) != 2 + NUM_COMBINATIONS or all(p.used_hiddenstates):
            raise ValueError(f'{layer}: expected {2 + NUM_COMBINATIONS} used_hiddenstates flags '
                             f'with at least one 0, got {p.used_hiddenstates}.')
        if p.num_filters <= 0 or p.cur_dim <= 0 or p.prev_dim < 0:
            raise ValueError(f'{layer}: num_filters and cur_dim must be positive and prev_dim '
                             f'non-negative, got {p.num_filters}, {p.cur_dim}, {p.prev_dim}.')
        if p.stride not in (1, 2) or p.prev_stride not in (1, 2):
            raise ValueError(f'{layer}: stride and prev_stride must be 1 or 2, got {p.stride} '
                             f'and {p.prev_stride}.')
        if not 0.0 < p.drop_path_keep_prob <= 1.0:
            raise ValueError(f'{layer}: drop_path_keep_prob must be in (0, 1], got '
                             f'{p.drop_path_keep_prob}.')

    @classmethod
    def _ChildParams(cls, p, layer: str) -> dict:
        """The children's Params by name; identity operations have none."""
        cls._CheckParams(p, layer)
        f = p.num_filters
        children = {'cur_1x1': Sequence(p, ReluConvBn('1x1', p, (1, 1), p.cur_dim, f))}
        if p.prev_dim and p.prev_stride == 2:
            children['prev_reduction'] = FactorizedReductionLayer.Params().Set(
                dtype=p.dtype, params_init=p.params_init.Copy(), input_dim=p.prev_dim,
                output_dim=f, batch_norm_decay=p.batch_norm_decay,
                batch_norm_epsilon=p.batch_norm_epsilon)
        elif p.prev_dim and p.prev_dim != f:
            children['prev_1x1'] = Sequence(p, ReluConvBn('1x1', p, (1, 1), p.prev_dim, f))
        dims = [f, f if p.prev_dim else p.cur_dim]
        for j, (op, index) in enumerate(zip(p.operations, p.hiddenstate_indices)):
            stride = p.stride if index < 2 else 1
            layers = OperationLayers(op, dims[index], f, stride, p)
            if layers:
                children[_BranchName(j)] = Sequence(p, layers)
            if j % 2:
                dims.append(f)
        return children

    def __init__(self, params):
        super().__init__(params)
        for name, child in self._ChildParams(self.p, self.path).items():
            self.CreateChild(name, child)

    @classmethod
    def _Dataflow(cls, p, cur, prev, flow, children):
        """The cell's computation on tensors or on shapes, as `flow` implements the steps."""
        states = [flow.Apply('cur_1x1', cur)]
        if 'prev_reduction' in children:
            states.append(flow.Apply('prev_reduction', prev))
        elif 'prev_1x1' in children:
            states.append(flow.Apply('prev_1x1', prev))
        else:
            states.append(prev if p.prev_dim else cur)
        for i in range(NUM_COMBINATIONS):
            branches = []
            for j in (2 * i, 2 * i + 1):
                x = states[p.hiddenstate_indices[j]]
                if _BranchName(j) in children:
                    x = flow.Apply(_BranchName(j), x)
                if p.operations[j] != 'none':
                    x = flow.DropPath(j, x)
                branches.append(x)
            states.append(flow.Add(*branches))
        return flow.Concat([s for s, used in zip(states, p.used_hiddenstates) if not used])

    def FProp(self, theta, inputs: NestedMap) -> NestedMap:
        """Runs the cell on `inputs.cur` (and `inputs.prev`); see the class docstring."""
        prev = inputs.prev if self.p.prev_dim else None
        outputs = inputs.copy()
        outputs.cur = self._Dataflow(self.p, inputs.cur, prev, _TensorDataflow(self, theta),
                                     self.children)
        outputs.prev = inputs.cur
        return outputs

    @classmethod
    def FPropMeta(cls, p, input_shapes) -> LayerMeta:
        layer = p.name or cls.__name__
        children = cls._ChildParams(p, layer)
        shapes = _StateShapes(input_shapes, layer, ['cur', 'prev'] if p.prev_dim else ['cur'])
        if not p.prev_dim and 'prev' in shapes:
            raise ValueError(f'{layer}: prev_dim is 0 but the input has a prev {shapes.prev}.')
        conv.ImageShape(shapes.cur, layer, p.cur_dim)
        if p.prev_dim:
            conv.ImageShape(shapes.prev, layer, p.prev_dim)
        flow = _ShapeDataflow(p, layer, children)
        out = NestedMap(shapes)
        out.cur = cls._Dataflow(p, shapes.cur, shapes.get('prev'), flow, children)
        out.prev = shapes.cur
        return LayerMeta(out, sum(m.flops for m in flow.metas) + flow.flops,
                         sum(m.num_params for m in flow.metas), flow.activation_bytes,
                         reads_input=flow.reads_input)


def _BranchName(index: int) -> str:
    return f'comb_{index // 2}_{"left" if index % 2 == 0 else "right"}'


class AmoebaAuxHeadLayer(BaseLayer):
    """The auxiliary classifier: adds aux_per_example_loss [B] to the NestedMap.

    As the reference's `_build_aux_head` on ReLU(cur): 5x5 stride-3 VALID average pool, 1x1 conv
    to proj_dim, BN, ReLU, a VALID conv over the whole remaining map to hidden_dim, BN, ReLU, then
    a dense softmax classifier; its per-example cross-entropy rides along to the head.
    """

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('input_dim', 0, 'Channels of `cur`.')
        p.Define('feature_size', (0, 0), '(height, width) of `cur`.')
        p.Define('proj_dim', 128, 'Channels of the 1x1 projection.')
        p.Define('hidden_dim', 768, 'Channels of the convolution over the pooled map.')
        p.Define('num_classes', 0, 'Number of classes.')
        p.Define('label_smoothing', 0.0, 'Label smoothing of the cross-entropy.')
        DefineBatchNorm(p)
        return p

    @classmethod
    def _ChildParams(cls, p, layer: str) -> dict:
        height, width = conv.CheckPositiveInts(p.feature_size, 2, 'feature_size', layer)
        try:
            pooled = [conv.OutputSize(size, 5, 3, 'VALID') for size in (height, width)]
        except ValueError as e:
            raise ValueError(f'{layer}: feature_size {p.feature_size} is too small for the aux '
                             f'head\'s 5x5 pool: {e}') from None
        return {
            'pool': pooling.Pooling2DLayer.Params().Set(
                name='pool', dtype=p.dtype, pooling_type='AVG', window_shape=(5, 5),
                window_stride=(3, 3), padding='VALID'),
            'proj': Conv('proj', p, (1, 1), p.input_dim, p.proj_dim),
            'proj_bn': BatchNorm('proj_bn', p, p.proj_dim),
            'conv': Conv('conv', p, pooled, p.proj_dim, p.hidden_dim, padding='VALID'),
            'conv_bn': BatchNorm('conv_bn', p, p.hidden_dim),
            'softmax': losses.SoftmaxCrossEntropyLayer.Params().Set(
                name='softmax', dtype=p.dtype, params_init=p.params_init.Copy(),
                input_dim=p.hidden_dim, num_classes=p.num_classes,
                label_smoothing=p.label_smoothing),
        }

    def __init__(self, params):
        super().__init__(params)
        for name, child in self._ChildParams(self.p, self.path).items():
            self.CreateChild(name, child)

    def FProp(self, theta, inputs: NestedMap) -> NestedMap:
        x = self.pool.FProp(theta.pool, tf.nn.relu(inputs.cur))
        x = tf.nn.relu(self.proj_bn.FProp(theta.proj_bn, self.proj.FProp(theta.proj, x)))
        x = tf.nn.relu(self.conv_bn.FProp(theta.conv_bn, self.conv.FProp(theta.conv, x)))
        x = tf.reshape(x, [-1, self.p.hidden_dim])
        xent = self.softmax.FProp(theta.softmax, NestedMap(features=x, labels=inputs.labels))
        outputs = inputs.copy()
        outputs.aux_per_example_loss = xent.per_example_loss
        return outputs

    @classmethod
    def FPropMeta(cls, p, input_shapes) -> LayerMeta:
        layer = p.name or cls.__name__
        children = cls._ChildParams(p, layer)
        shapes = _StateShapes(input_shapes, layer, ['cur', 'labels'])
        n, h, w, _ = conv.ImageShape(shapes.cur, layer, p.input_dim)
        if (h, w) != tuple(p.feature_size):
            raise ValueError(f'{layer}: expected cur of height and width {p.feature_size}, got '
                             f'shape {shapes.cur}.')
        convs = _ChainMeta(layer, [children[k] for k in ('pool', 'proj', 'proj_bn', 'conv',
                                                         'conv_bn')], shapes.cur)
        features = tf.TensorShape([n, p.hidden_dim])
        xent = children['softmax'].cls.FPropMeta(
            children['softmax'], NestedMap(features=features, labels=shapes.labels))
        out = NestedMap(shapes)
        out.aux_per_example_loss = tf.TensorShape([n])
        relu_flops = shapes.cur.num_elements() + 2 * features.num_elements()
        return SumMetas(out, [convs, xent], relu_flops)


class AmoebaHeadLayer(BaseLayer):
    """The classifier: ReLU, global average pool, dropout, dense, softmax cross-entropy.

    Returns NestedMap(logits [B, classes], per_example_loss [B], weight [B] (ones), correct [B]
    (1.0 where the arg-max logit is the label)). In training, per_example_loss adds
    aux_loss_weight times the aux head's loss when the input carries one (the reference's total
    loss); in evaluation it is the main cross-entropy alone.
    """

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('input_dim', 0, 'Channels of `cur`.')
        p.Define('num_classes', 0, 'Number of classes.')
        p.Define('dropout_keep_prob', 1.0, 'Keep probability of dropout on the pooled features.')
        p.Define('label_smoothing', 0.0, 'Label smoothing of the cross-entropy.')
        p.Define('aux_loss_weight', 0.4, 'Weight of aux_per_example_loss, when present.')
        return p

    @classmethod
    def _ChildParams(cls, p) -> dict:
        return {
            'pool': pooling.GlobalPoolingLayer.Params().Set(name='pool', dtype=p.dtype,
                                                            pooling_type='AVG'),
            'dropout': basic.DropoutLayer.Params().Set(name='dropout', dtype=p.dtype,
                                                       keep_prob=p.dropout_keep_prob),
            'softmax': losses.SoftmaxCrossEntropyLayer.Params().Set(
                name='softmax', dtype=p.dtype, params_init=p.params_init.Copy(),
                input_dim=p.input_dim, num_classes=p.num_classes,
                label_smoothing=p.label_smoothing),
        }

    def __init__(self, params):
        super().__init__(params)
        for name, child in self._ChildParams(self.p).items():
            self.CreateChild(name, child)

    def FProp(self, theta, inputs: NestedMap) -> NestedMap:
        x = self.pool.FProp(theta.pool, tf.nn.relu(inputs.cur))
        x = self.dropout.FProp(theta.dropout, x)
        xent = self.softmax.FProp(theta.softmax, NestedMap(features=x, labels=inputs.labels))
        per_example_loss = xent.per_example_loss
        if 'aux_per_example_loss' in inputs and fprop_context.Current().training:
            # The aux loss crossed the cells after it in fprop_dtype; the sum is the loss's.
            per_example_loss += self.p.aux_loss_weight * tf.cast(inputs.aux_per_example_loss,
                                                                 per_example_loss.dtype)
        predictions = tf.argmax(xent.logits, axis=-1, output_type=inputs.labels.dtype)
        return NestedMap(
            logits=xent.logits, per_example_loss=per_example_loss,
            weight=tf.ones_like(per_example_loss),
            correct=tf.cast(tf.equal(predictions, inputs.labels), per_example_loss.dtype))

    @classmethod
    def FPropMeta(cls, p, input_shapes) -> LayerMeta:
        layer = p.name or cls.__name__
        children = cls._ChildParams(p)
        shapes = _StateShapes(input_shapes, layer, ['cur', 'labels'])
        n = conv.ImageShape(shapes.cur, layer, p.input_dim)[0]
        features = _ChainMeta(layer, [children['pool'], children['dropout']], shapes.cur)
        xent = children['softmax'].cls.FPropMeta(
            children['softmax'], NestedMap(features=features.out_shapes, labels=shapes.labels))
        examples = tf.TensorShape([n])
        out = NestedMap(logits=xent.out_shapes.logits, per_example_loss=examples,
                        weight=examples, correct=examples)
        flops = shapes.cur.num_elements() + 2 * n  # ReLU; aux loss; argmax compare.
        return SumMetas(out, [features, xent], flops)


# ---- the network --------------------------------------------------------------------------------
STEM_TYPES = ('imagenet', 'basic')


def NetworkParams() -> hyperparams.Params:
    """The network's hyperparameters; defaults are the reference's `imagenet_hparams()`."""
    p = hyperparams.Params()
    p.Define('genotype', 'amoeba_net_d', f'Cell genotype: one of {sorted(GENOTYPES)}.')
    p.Define('num_normal_cells', 18, 'L: normal cells, in num_reduction_layers + 1 stacks.')
    p.Define('num_filters', 256, 'D: filters of the first stack; doubled at each reduction.')
    p.Define('num_reduction_layers', 2, 'Reduction cells between the stacks of normal cells.')
    p.Define('image_size', 224, 'Height and width of the input images.')
    p.Define('num_channels', 3, 'Channels of the input images.')
    p.Define('num_classes', 1000, 'Number of classes.')
    p.Define('stem_type', 'imagenet',
             f'One of {STEM_TYPES}: "imagenet" is a stride-2 3x3 conv then num_stem_cells '
             'reduction cells; "basic" a stride-1 3x3 conv (small images).')
    p.Define('stem_filters', 32, 'Output channels of the stem\'s convolution.')
    p.Define('num_stem_cells', 2,
             'Reduction cells of the ImageNet stem, with D / 2^n, ..., D / 2 filters.')
    p.Define('drop_path_keep_prob', 0.7, 'Drop-path keep probability of each cell operation.')
    p.Define('dense_dropout_keep_prob', 0.5, 'Dropout keep probability before the classifier.')
    p.Define('label_smoothing', 0.1, 'Label smoothing of the cross-entropy losses.')
    p.Define('use_aux_head', True, 'Whether to add the auxiliary head after the second stack.')
    p.Define('aux_scaling', 0.4, 'Scales the aux head\'s 128 and 768 channels.')
    p.Define('aux_loss_weight', 0.4, 'Weight of the aux head\'s loss in the training loss.')
    p.Define('batch_norm_decay', 0.9997, 'Decay of the batch norms\' moving averages.')
    p.Define('batch_norm_epsilon', 1e-3, 'Epsilon of the batch norms.')
    p.Define('dtype', tf.float32, 'Data type of variables and activations.')
    p.Define('params_init', base_layer.WeightInit.Xavier(1.0), 'Initialisation of weights.')
    return p


def ReductionCellPositions(num_normal_cells: int, num_reduction_layers: int) -> list[int]:
    """Indices of the normal cells that a reduction cell precedes (`calc_reduction_layers`)."""
    return [int(k / (num_reduction_layers + 1) * num_normal_cells)
            for k in range(1, num_reduction_layers + 1)]


def _CheckNetworkParams(p) -> None:
    if p.genotype not in GENOTYPES:
        raise ValueError(f'Unknown genotype {p.genotype!r}; expected one of {sorted(GENOTYPES)}.')
    if p.stem_type not in STEM_TYPES:
        raise ValueError(f'Unknown stem_type {p.stem_type!r}; expected one of {STEM_TYPES}.')
    if p.num_normal_cells < 1 or p.num_filters < 1 or p.num_reduction_layers < 0:
        raise ValueError(f'num_normal_cells and num_filters must be positive and '
                         f'num_reduction_layers non-negative, got {p.num_normal_cells}, '
                         f'{p.num_filters}, {p.num_reduction_layers}.')
    if p.num_normal_cells < p.num_reduction_layers + 1:
        raise ValueError(f'{p.num_reduction_layers} reduction layers need at least '
                         f'{p.num_reduction_layers + 1} normal cells, got {p.num_normal_cells}.')
    if p.use_aux_head and p.num_reduction_layers < 2:
        raise ValueError(f'The aux head follows the second stack; num_reduction_layers is '
                         f'{p.num_reduction_layers}. Set use_aux_head=False.')


def NetworkLayers(p) -> list:
    """The network as a flat list of layer Params: stem, cells, aux head, head.

    Args:
      p: `NetworkParams()`.

    Returns:
      Layer Params in order, named stem, stem_reduction_<i>, normal_<i>, reduction_<i>,
      aux_head and head. The first takes NestedMap(images, labels).
    """
    _CheckNetworkParams(p)
    genotype = GENOTYPES[p.genotype]

    def Common() -> dict:
        return dict(dtype=p.dtype, params_init=p.params_init.Copy(),
                    batch_norm_decay=p.batch_norm_decay, batch_norm_epsilon=p.batch_norm_epsilon)

    stride = 2 if p.stem_type == 'imagenet' else 1
    layers = [AmoebaStemLayer.Params().Set(name='stem', input_dim=p.num_channels,
                                           num_filters=p.stem_filters, stride=stride, **Common())]
    # (channels, size) of the last two outputs, as the reference's `cell_outputs`.
    outputs = [None, (p.stem_filters, conv.OutputSize(p.image_size, 3, stride, 'VALID'))]

    def AddCell(name: str, spec: CellSpec, filters: int, cell_stride: int) -> None:
        (cur_dim, cur_size), prev = outputs[-1], outputs[-2]
        prev_stride = 1
        if prev is not None and prev[1] != cur_size:
            prev_stride = 2
            if conv.OutputSize(prev[1], 1, 2, 'SAME') != cur_size:
                raise ValueError(f'{name}: cannot reduce prev of size {prev[1]} to {cur_size}.')
        cell = AmoebaCellLayer.Params().Set(
            name=name, operations=list(spec.operations),
            hiddenstate_indices=list(spec.hiddenstate_indices),
            used_hiddenstates=list(spec.used_hiddenstates), num_filters=filters,
            stride=cell_stride, cur_dim=cur_dim, prev_dim=prev[0] if prev else 0,
            prev_stride=prev_stride, drop_path_keep_prob=p.drop_path_keep_prob, **Common())
        layers.append(cell)
        outputs.append((AmoebaCellLayer.OutputDim(cell),
                        conv.OutputSize(cur_size, 1, cell_stride, 'SAME')))

    if p.stem_type == 'imagenet':
        for i in range(p.num_stem_cells):
            filters = int(p.num_filters / 2 ** (p.num_stem_cells - i))
            AddCell(f'stem_reduction_{i}', genotype.reduction, filters, 2)
    reductions = ReductionCellPositions(p.num_normal_cells, p.num_reduction_layers)
    filters = p.num_filters
    for n in range(p.num_normal_cells):
        if n in reductions:
            filters *= 2
            AddCell(f'reduction_{reductions.index(n)}', genotype.reduction, filters, 2)
        AddCell(f'normal_{n}', genotype.normal, filters, 1)
        if p.use_aux_head and n == reductions[1] - 1:
            channels, size = outputs[-1]
            layers.append(AmoebaAuxHeadLayer.Params().Set(
                name='aux_head', input_dim=channels, feature_size=(size, size),
                proj_dim=int(128 * p.aux_scaling), hidden_dim=int(768 * p.aux_scaling),
                num_classes=p.num_classes, label_smoothing=p.label_smoothing, **Common()))
    layers.append(AmoebaHeadLayer.Params().Set(
        name='head', dtype=p.dtype, params_init=p.params_init.Copy(),
        input_dim=outputs[-1][0], num_classes=p.num_classes,
        dropout_keep_prob=p.dense_dropout_keep_prob, label_smoothing=p.label_smoothing,
        aux_loss_weight=p.aux_loss_weight))
    return layers


def InputShapes(p, batch_size: int) -> dict:
    """Shapes of one mini-batch of the network's input NestedMap, as PipeliningLayer takes them."""
    return {'images': [batch_size, p.image_size, p.image_size, p.num_channels],
            'labels': [batch_size]}


def PipelineParams(p, batch_size: int, num_cells: int, num_micro_batches: int,
                   recompute: str = 'always', name: str = 'amoebanet') -> hyperparams.Params:
    """PipeliningLayer Params running the network in K cells balanced by FLOPs.

    Args:
      p: `NetworkParams()`.
      batch_size: the mini-batch size the cells are balanced for (input_shapes).
      num_cells: K.
      num_micro_batches: M.
      recompute: PipeliningLayer's re-materialization mode.
      name: the layer's name.
    """
    return pipelining_layer.PipeliningLayer.Params().Set(
        name=name, dtype=p.dtype, layer_tpl=NetworkLayers(p), num_cells=num_cells,
        num_micro_batches=num_micro_batches, recompute=recompute,
        input_shapes=InputShapes(p, batch_size), input_dtypes={'labels': 'int32'})


def Metrics(outputs: NestedMap) -> NestedMap:
    """Reduces the head's per-example outputs (of a whole mini-batch) to scalars.

    Returns:
      NestedMap(loss = sum(per_example_loss * weight) / sum(weight), accuracy (weighted fraction
      correct), total_weight = sum(weight)).
    """
    total_weight = tf.reduce_sum(outputs.weight)
    return NestedMap(
        loss=tf.math.divide_no_nan(tf.reduce_sum(outputs.per_example_loss * outputs.weight),
                                   total_weight),
        accuracy=tf.math.divide_no_nan(tf.reduce_sum(outputs.correct * outputs.weight),
                                       total_weight),
        total_weight=total_weight)
