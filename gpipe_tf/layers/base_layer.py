"""BaseLayer: configured by Params, functional `FProp(theta, *inputs)`, cost-aware `FPropMeta`.

A layer owns variables and child layers; `theta` is a NestedMap of the variables' current values
(its own and its children's), and `FProp` computes only from the theta it is given. That makes the
same code differentiable with respect to explicit tensors, which re-materialization and pipelining
rely on, and lets it run in eager mode, in a `tf.function` and in a `tf.compat.v1` graph.

`FPropMeta(p, *input_shapes)` is a classmethod working on Params and `tf.TensorShape`s alone: the
partitioner and the paper-size parameter tables use it without building a single variable.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import zlib
from typing import Any

import numpy as np
import tensorflow as tf
# NoDependency: no public API keeps an attribute of a tf.Module out of its checkpoint.
from tensorflow.python.trackable import data_structures  # pylint: disable=g-direct-tensorflow-import

from gpipe_tf import hyperparams
from gpipe_tf.layers import fprop_context
from gpipe_tf.layers import precision
from gpipe_tf.nested_map import NestedMap


# ---- weight initialisation ----------------------------------------------------------------------
class WeightInit(hyperparams.Params):
    """How a variable is initialised: a method name and a scale."""

    METHODS = ('xavier', 'gaussian', 'truncated_gaussian', 'uniform', 'constant',
               'gaussian_sqrt_fanin', 'uniform_sqrt_fanin')

    def __init__(self, method: str = 'xavier', scale: float = 1.0):
        super().__init__()
        if method not in self.METHODS:
            raise ValueError(f'Unknown init method {method!r}; expected one of {self.METHODS}.')
        self.Define('method', method, f'One of {self.METHODS}.')
        self.Define('scale', scale, 'Scale: stddev, limit, constant value or Xavier gain.')

    @staticmethod
    def Xavier(scale: float = 1.0) -> 'WeightInit':
        return WeightInit('xavier', scale)

    @staticmethod
    def Gaussian(scale: float = 1.0) -> 'WeightInit':
        return WeightInit('gaussian', scale)

    @staticmethod
    def TruncatedGaussian(scale: float = 1.0) -> 'WeightInit':
        return WeightInit('truncated_gaussian', scale)

    @staticmethod
    def Uniform(scale: float = 1.0) -> 'WeightInit':
        return WeightInit('uniform', scale)

    @staticmethod
    def Constant(scale: float = 0.0) -> 'WeightInit':
        return WeightInit('constant', scale)

    @staticmethod
    def GaussianSqrtFanIn(scale: float = 1.0) -> 'WeightInit':
        return WeightInit('gaussian_sqrt_fanin', scale)

    @staticmethod
    def UniformSqrtFanIn(scale: float = 1.0) -> 'WeightInit':
        return WeightInit('uniform_sqrt_fanin', scale)


def _Fans(shape) -> tuple[int, int]:
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return shape[0], shape[0]
    receptive = int(np.prod(shape[:-2])) if len(shape) > 2 else 1
    return shape[-2] * receptive, shape[-1] * receptive


def InitialValue(init: WeightInit, shape, dtype: tf.DType, seed) -> tf.Tensor:
    """Deterministic (stateless) initial value of `shape` for `seed` (shape [2] ints)."""
    shape = list(shape)
    fan_in, fan_out = _Fans(shape)
    scale = float(init.scale)
    method = init.method
    if method == 'constant':
        return tf.fill(shape, tf.cast(scale, dtype))
    if method == 'xavier':
        limit = scale * np.sqrt(6.0 / (fan_in + fan_out))
        return tf.random.stateless_uniform(shape, seed, -limit, limit, dtype=dtype)
    if method == 'uniform':
        return tf.random.stateless_uniform(shape, seed, -scale, scale, dtype=dtype)
    if method == 'uniform_sqrt_fanin':
        limit = scale / np.sqrt(fan_in)
        return tf.random.stateless_uniform(shape, seed, -limit, limit, dtype=dtype)
    if method == 'gaussian':
        return tf.random.stateless_normal(shape, seed, stddev=scale, dtype=dtype)
    if method == 'gaussian_sqrt_fanin':
        return tf.random.stateless_normal(shape, seed, stddev=scale / np.sqrt(fan_in), dtype=dtype)
    if method == 'truncated_gaussian':
        return tf.random.stateless_truncated_normal(shape, seed, stddev=scale, dtype=dtype)
    raise ValueError(f'Unknown init method {method!r}.')


@dataclasses.dataclass
class WeightParams:
    """What `CreateVariable` builds: shape, initialiser, dtype and trainability."""
    shape: tuple
    init: WeightInit | None = None
    dtype: tf.DType | None = None
    trainable: bool = True


def PathSeed(path: str, random_seed: int | None) -> int:
    """A 31-bit seed that depends only on a layer path and the configured seed."""
    return (zlib.crc32(path.encode()) ^ (random_seed or 0)) & 0x7FFFFFFF


# ---- cost metadata -------------------------------------------------------------------------------
@dataclasses.dataclass
class LayerMeta:
    """What `FPropMeta` reports for one forward pass of a layer.

    Attributes:
      out_shapes: the output shape: a `tf.TensorShape`, or a NestedMap / tuple of them.
      flops: floating point operations of one forward pass (a multiply-add counts 2).
      num_params: number of scalar parameters the layer creates (trainable or not).
      activation_bytes: bytes of activations a backward pass keeps alive without
        re-materialization: its output (counted here whatever reads it), and what it makes
        inside that its backward reads (for a composite layer, its sub-layers' outputs that
        a backward reads).
      reads_input: whether the layer's backward reads its input (a convolution's or a matrix
        product's weight gradient does; ReLU's, an addition's and average pooling's do not).
      reads_output: whether its backward reads its output (ReLU and tanh do; a convolution
        without an activation and batch norm do not). An output that neither its layer nor the
        next layer reads is freed after the forward: `sequential.ChainMeta` leaves it out. The
        defaults count every output kept.
      sparse_params: of num_params, those whose gradient is sparse (IndexedSlices: a
        gather's, an embedding table's), which the pipeline sums over micro-batches as the
        rows they read, not the table (`pipeline/gradient_sums.py`).
      sparse_gradient_bytes: the bytes of those gradients for one forward pass: per row read,
        its values and its index (counted as 8 bytes: int32 or int64).
      tied_params: parameters the layer reads from another layer's variable (a tied weight,
        `tied_weights`), not in num_params: its cell holds their value, read there, and their
        dense gradient, but no optimizer slots.
    """
    out_shapes: Any
    flops: int = 0
    num_params: int = 0
    activation_bytes: int = 0
    reads_input: bool = True
    reads_output: bool = True
    sparse_params: int = 0
    sparse_gradient_bytes: int = 0
    tied_params: int = 0


def FlattenShapes(shapes) -> list[tf.TensorShape]:
    """The TensorShapes of a TensorShape, or of a NestedMap / tuple of them, in tf.nest order."""
    if isinstance(shapes, tf.TensorShape):
        return [shapes]
    if isinstance(shapes, dict):
        return [s for k in sorted(shapes) for s in FlattenShapes(shapes[k])]
    if isinstance(shapes, (list, tuple)):
        return [s for item in shapes for s in FlattenShapes(item)]
    raise TypeError(f'Expected TensorShapes, got {shapes!r}.')


def OutputBytes(shapes, dtype: tf.DType) -> int:
    """Bytes of activations of `shapes` (TensorShape, or NestedMap/tuple of them) in `dtype`:
    a layer's are in `FPropDtype(p)`."""
    return sum(int(s.num_elements()) for s in FlattenShapes(shapes)) * tf.as_dtype(dtype).size


FPropDtype = precision.FPropDtype


def ActivationBytes(shapes, p) -> int:
    """Bytes of activations of `shapes` made by a layer of Params `p`: in the dtype it computes
    in (`FPropDtype`), so half of float32's with bfloat16 or float16."""
    return OutputBytes(shapes, FPropDtype(p))


def AsArgs(outputs) -> tuple:
    """How one layer's outputs feed the next: a tuple is spread, anything else is one argument."""
    return outputs if isinstance(outputs, tuple) else (outputs,)


# ---- the layer --------------------------------------------------------------------------------
_BUILD_STACK = threading.local()


def _ParentStack() -> list:
    if not hasattr(_BUILD_STACK, 'layers'):
        _BUILD_STACK.layers = []
    return _BUILD_STACK.layers


# What a tf.function calls a layer by. Layer code is plain graph-building Python (it runs unchanged
# in a v1 graph, where autograph never runs), and autograph converting it when a user's
# tf.function calls a layer cost more than the tracing itself: 18.4 s of tracing against 7.5 s
# for the pipeline of benchmarks/schedule_build.py (looped, K=8, M=32).
_ENTRY_POINTS = ('FProp', 'FPropLoss', '__call__')


def _InFPropDtype(method):
    """`method` (FProp, or another of `THETA_METHODS`) run on its layer's weights and float
    inputs cast to the layer's fprop_dtype (`BaseLayer.ToFPropDtype`); as it is without a
    fprop_dtype."""

    @functools.wraps(method)
    def Method(self, theta, *inputs, **kwargs):
        if self.p.fprop_dtype is not None:
            theta, inputs = self.ToFPropDtype(theta, inputs)
            kwargs = precision.CastFloats(kwargs, tf.as_dtype(self.p.fprop_dtype))
        return method(self, theta, *inputs, **kwargs)

    return Method


def _InMetaScope(fprop_meta):
    """`fprop_meta` (an FPropMeta's function) with the children Params it makes inheriting its
    Params' fprop_dtype (`precision.MetaScope`)."""

    @functools.wraps(fprop_meta)
    def FPropMeta(cls, p, *input_shapes):
        with precision.MetaScope(p):
            return fprop_meta(cls, p, *input_shapes)

    return FPropMeta


class BaseLayer(tf.Module):
    """Base class of all layers. Subclasses define `Params`, `__init__`, `FProp`, `FPropMeta`."""

    # Whether FProp reads this layer's weights in fprop_dtype (`ToFPropDtype`). Normalization
    # layers read theirs in dtype: per-channel factors, combined with float32 statistics.
    WEIGHTS_IN_FPROP_DTYPE = True
    # Methods other than FProp that compute from (theta, *inputs), and so read them in
    # fprop_dtype too (an incremental decoder's step, say).
    THETA_METHODS = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # The one place weights and inputs are cast to the compute dtype: each FProp (and
        # THETA_METHODS), as the layer reads them; inside a pipeline's cells, so gradients
        # come back in dtype.
        for name in ('FProp',) + tuple(cls.THETA_METHODS):
            if name in cls.__dict__:
                setattr(cls, name, _InFPropDtype(cls.__dict__[name]))
        if 'FPropMeta' in cls.__dict__:
            cls.FPropMeta = classmethod(_InMetaScope(cls.__dict__['FPropMeta'].__func__))
        for name in _ENTRY_POINTS:
            if name in cls.__dict__:
                setattr(cls, name, tf.autograph.experimental.do_not_convert(cls.__dict__[name]))

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = hyperparams.InstantiableParams(cls)
        p.Define('name', '', 'Name of this layer; also its variable scope.')
        p.Define('dtype', tf.float32, 'Data type of variables (and of activations, unless '
                 'fprop_dtype is set).')
        p.Define('fprop_dtype', None,
                 'Data type the layer computes in (mixed precision: tf.bfloat16 or tf.float16): '
                 'its weights are cast to it as FProp reads them, its float inputs too, while '
                 'variables stay dtype. None: the parent\'s (children inherit it unless they set '
                 'their own), else dtype.',
                 check=hyperparams.Check(precision.IsFPropDtype,
                                         'None or a floating point dtype (tf.bfloat16, '
                                         'tf.float16)'))
        p.Define('params_init', WeightInit.Xavier(1.0), 'Default initialisation of weights.')
        p.Define('random_seed', None,
                 'Seed for initialisation and randomness (dropout); None means 0. Values are '
                 'derived from the seed and the layer path, so rebuilding gives equal weights.')
        return p

    def __init__(self, params: hyperparams.Params):
        if not params.name:
            raise ValueError(f'{type(self).__name__} needs a name (params.name is empty).')
        stack = _ParentStack()
        parent = stack[-1] if stack else None
        super().__init__(name=params.name)
        self._params = params.Copy().Freeze()
        self._path = f'{parent.path}.{params.name}' if parent else params.name
        self._layer_vars = {}
        self._layer_children = {}
        # Other layers' variables read as this layer's (`TieVariable`): not a checkpoint
        # dependency of this layer (tf.Module would track a dict attribute).
        self._tied_vars = data_structures.NoDependency({})

    # -- configuration and identity
    @property
    def params(self) -> hyperparams.Params:
        """The frozen Params this layer was built from."""
        return self._params

    @property
    def p(self) -> hyperparams.Params:
        return self._params

    @property
    def path(self) -> str:
        """Dotted path from the root layer, e.g. `pipeline.cell_1.dense_3`."""
        return self._path

    # -- children
    def CreateChild(self, name: str, params: hyperparams.Params) -> 'BaseLayer':
        """Instantiates `params` as child `name` (its variables nest under this layer)."""
        self._CheckNewName(name)
        child = self._Instantiate(name, params)
        self._layer_children[name] = child
        return child

    def CreateChildren(self, name: str, params_list) -> list:
        """Instantiates a list of children stored under `name`: `name_0`, `name_1`, ..."""
        self._CheckNewName(name)
        children = [self._Instantiate(f'{name}_{i}', p) for i, p in enumerate(params_list)]
        self._layer_children[name] = children
        return children

    def _Instantiate(self, name: str, params: hyperparams.Params) -> 'BaseLayer':
        p = params.Copy()
        p.name = name
        if p.random_seed is None:
            p.random_seed = self.p.random_seed
        if p.fprop_dtype is None:
            p.fprop_dtype = self.p.fprop_dtype
        stack = _ParentStack()
        stack.append(self)
        try:
            return p.Instantiate()
        finally:
            stack.pop()

    def _CheckNewName(self, name: str) -> None:
        if name in self._layer_children or name in self._layer_vars or (
                name in self._tied_vars):
            raise ValueError(f'{self.path}: child or variable {name!r} already exists.')

    def Descendants(self) -> list:
        """This layer and every layer below it, parents first, children by name: layers built
        from equal Params list theirs in the same order."""
        return [self] + [d for child in tf.nest.flatten(self.children) for d in child.Descendants()]

    @property
    def children(self) -> NestedMap:
        return NestedMap({k: list(v) if isinstance(v, list) else v
                          for k, v in self._layer_children.items()})

    def __getattr__(self, name: str):
        children = self.__dict__.get('_layer_children')
        if children is not None and name in children:
            return children[name]
        raise AttributeError(f'{type(self).__name__} has no attribute or child {name!r}.')

    # -- variables
    def CreateVariable(self, name: str, wp: WeightParams) -> tf.Variable:
        """Creates variable `name` of this layer, initialised deterministically from its path."""
        self._CheckNewName(name)
        dtype = wp.dtype or self.p.dtype
        init = wp.init or self.p.params_init
        seed = [PathSeed(f'{self.path}.{name}', self.p.random_seed), 0]
        with tf.name_scope(self.path.replace('.', '/') + '/'):
            # Under a tf.distribute strategy, replicas' updates of state that training assigns
            # (batch norm's moving averages) are averaged; trainable variables are the
            # optimizer's to update.
            var = tf.Variable(
                initial_value=lambda: InitialValue(init, wp.shape, dtype, seed),
                name=name, dtype=dtype, trainable=wp.trainable,
                aggregation=(tf.VariableAggregation.NONE if wp.trainable
                             else tf.VariableAggregation.MEAN))
        self._layer_vars[name] = var
        return var

    def TieVariable(self, name: str, var: tf.Variable) -> None:
        """Makes another layer's variable `var` this layer's variable `name` too (a tied weight,
        `tied_weights.Apply`): in this layer's vars and theta, read where `var` lives. It is
        not tracked here: its name, seed and checkpoint key stay its creator's only (a
        checkpoint of the layer holds it once, and one that has a value of this layer's own at
        `name` does not restore silently into it), and a parent's `variables` lists it once."""
        self._CheckNewName(name)
        self._tied_vars[name] = var

    @property
    def vars(self) -> NestedMap:
        """NestedMap of this layer's and its children's tf.Variables."""
        out = NestedMap(self._layer_vars)
        out.update(self._tied_vars)
        for name, child in self.children.items():
            out[name] = [c.vars for c in child] if isinstance(child, list) else child.vars
        return out

    @property
    def theta(self) -> NestedMap:
        """NestedMap of the current values (read tensors) of `vars`."""
        return self.vars.Transform(lambda v: v.read_value() if isinstance(v, tf.Variable) else v)

    # -- computation
    def FProp(self, theta: NestedMap, *inputs):
        """Forward computation from explicit `theta`. Subclasses override."""
        raise NotImplementedError(f'{type(self).__name__}.FProp')

    def ToFPropDtype(self, theta: NestedMap, inputs: tuple) -> tuple[NestedMap, tuple]:
        """(theta with this layer's own weights, inputs with their float tensors) cast to
        fprop_dtype: what FProp computes with when fprop_dtype is set.

        Weights are the trainable float variables (none where WEIGHTS_IN_FPROP_DTYPE is
        False); children's are cast by the children (each to its own fprop_dtype), and state
        that is not trained (batch norm's moving statistics) stays in dtype.
        """
        dtype = tf.as_dtype(self.p.fprop_dtype)
        own = [name for name, var in {**self._layer_vars, **self._tied_vars}.items()
               if self.WEIGHTS_IN_FPROP_DTYPE and var.trainable and var.dtype.is_floating and
               name in theta and theta[name].dtype != dtype]
        if own:
            theta = NestedMap(theta)
            for name in own:
                theta[name] = tf.cast(theta[name], dtype)
        return theta, precision.CastFloats(inputs, dtype)

    @tf.autograph.experimental.do_not_convert
    def __call__(self, *inputs):
        return self.FProp(self.theta, *inputs)

    @classmethod
    def FPropMeta(cls, p: hyperparams.Params, *input_shapes) -> LayerMeta:
        """Output shapes and costs for `input_shapes`, from Params alone. Subclasses override."""
        raise NotImplementedError(f'{cls.__name__}.FPropMeta')

    @classmethod
    def PassedLeaves(cls, p: hyperparams.Params) -> dict[int, int]:
        """The leaves of the layer's inputs that it gives on unread, as they are: {input leaf:
        output leaf}, positions in `tf.nest.flatten` of its inputs and of its outputs (a skip
        connection a stage only carries). Called with None for such an input leaf, the layer
        gives None for its output leaf, so an executor may send the tensor straight from the
        cell that made it to the cell that reads it. From Params alone; most layers pass
        none."""
        del p
        return {}

    # -- side effects of a training forward pass
    def AddUpdate(self, stats: NestedMap) -> None:
        """Hands statistics of one forward pass to the active collector, or applies them now.

        Layers with state that training updates (batch norm's moving averages) call this from
        FProp. PipeliningLayer collects the statistics of all micro-batches and applies their sum
        once per step; outside a pipeline they are applied at once.
        """
        collector = fprop_context.Current().update_collector
        if collector is not None:
            collector.Add(self, stats)
            return
        update = self.ApplyUpdate(stats)
        if update is not None and not tf.executing_eagerly() and not _InsideFunction():
            tf.compat.v1.add_to_collection(tf.compat.v1.GraphKeys.UPDATE_OPS, update)

    def ApplyUpdate(self, stats: NestedMap):
        """Applies summed statistics to this layer's state; returns the update op (graph mode)."""
        raise NotImplementedError(f'{type(self).__name__} makes no updates.')

    def StepSeed(self) -> tf.Tensor:
        """A [2] int seed for stateless randomness, unique per (layer, step): the same in every
        micro-batch; draw per example from it (`example_random.Uniform`) so that the values do
        not depend on how the batch is split."""
        ctx = fprop_context.Current()
        if ctx.seed_observer is not None:
            ctx.seed_observer()
        base = tf.constant([PathSeed(self.path, self.p.random_seed), 0], tf.int64)
        return tf.random.experimental.stateless_fold_in(base, tf.cast(ctx.step, tf.int64))


def _InsideFunction() -> bool:
    return tf.compat.v1.get_default_graph().building_function
