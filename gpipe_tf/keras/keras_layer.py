"""`KerasLayer`: a Keras 3 layer as a gpipe_tf layer, so that a pipeline's cells can be Keras's
own layers (`keras.layers`, keras_hub's Transformer blocks).

Keras 3 computes a layer functionally: inside a `keras.StatelessScope` mapping each of its
variables to a tensor, the layer reads those tensors instead of its variables and assigns
nothing (`Layer.stateless_call` is built on it). That is gpipe_tf's `FProp(theta, *inputs)`:
theta holds the Keras variables' tf.Variables read as tensors, the pipeline differentiates the
call with respect to them, and re-materialization re-runs it.

**The layer object.** Params hold a handle to the Keras layer (`Handle`), not the layer: Params
are copied, compared and written as text everywhere (the partitioner's cost cache, the traced
cells' structure keys), and a handle is text that names one layer object for the life of the
process. The layer itself is the user's: its weights are the pipeline's (`get_weights()`
reads what training changed), and it is built when the pipeline builds its cells, so under
its cell's `tf.device`, which places its variables there.

**State.** A Keras layer's non-trainable variables are of two kinds:
- Random seed state (a `keras.random.SeedGenerator`'s, as dropout has): each call gets the
  state folded with the step and the micro-batch's first example (`fprop_context`), so the
  micro-batches of a step draw different masks, a re-materialized forward (the same step and
  micro-batch) replays its mask, and the next step draws new ones. The state variable itself is
  left as it is: the step moves the masks on. A mask is drawn per call, so per micro-batch: it
  depends on M, unlike gpipe_tf's own dropout, which draws per example.
- Float state that training changes (BatchNormalization's moving mean and variance): each
  micro-batch's call computes the new value Keras would assign; the pipeline averages them
  over the micro-batches, weighted by their examples, and assigns the average once per step.
  For BatchNormalization that moves the moving mean towards the mini-batch's mean, exactly, and
  the moving variance towards the mean of the micro-batches' variances (smaller than the
  mini-batch's variance by the spread of the micro-batches' means). Normalisation itself uses
  each micro-batch's own statistics, as in GPipe.
Other state a call changes (an integer counter, a metric's) cannot be combined over
micro-batches and is a ConfigError.

**Several inputs and outputs.** A layer's outputs are the next layer's inputs: a tensor, or a
tuple (or list) of tensors, which crosses a cell boundary as any nest does. As keras.Sequential
does, a layer gets a tuple as one argument (Add, Concatenate and Attention take a list of
inputs), unless its `call` requires several positional arguments (MultiHeadAttention's query
and value, a `call(self, h, aux)`): then one each, which keras.Sequential refuses. The last
layer's outputs are the pipeline's, so a model may have several outputs. A layer that returns a
dict is a ConfigError: between layers a dict is the keyword inputs.

**Keyword inputs.** A dict as the last input (attention or padding masks, say: `(x,
{'padding_mask': mask})`) holds keyword arguments: each layer is called with those its `call`
takes, and the dict is passed on, after the layer's outputs, to the next layer, so every block
of a stack sees the same masks. Keras's implicit masks (`mask_zero=True`, a tensor's
`_keras_mask`) do not cross cells: pass a mask as a keyword input instead.

**Losses.** A call that adds a loss (`add_loss`, `activity_regularizer=`) is a ConfigError in
training: the loss belongs to a micro-batch on an earlier stage, and the pipeline carries only
the layers' outputs on. Weight regularizers are the model's to add (`Sequential` does, once per
step).

**Costs.** Keras reports no FLOPs: `FPropMeta` estimates a layer's as 2 multiply-adds per
trainable parameter and input position (exact for Dense, a lower bound for convolutions), and
counts parameters exactly; balance Keras cells by parameters or explicit boundaries.
"""

from __future__ import annotations

import copy
import inspect
import itertools
import math
import threading
import weakref

import keras
import tensorflow as tf

from gpipe_tf import errors
from gpipe_tf.layers import base_layer
from gpipe_tf.layers import embedding
from gpipe_tf.layers import fprop_context
from gpipe_tf.nested_map import NestedMap

# ---- handles: a Keras layer named by text --------------------------------------------------------
_HANDLES = weakref.WeakValueDictionary()  # handle -> layer
_LAYER_HANDLES = weakref.WeakKeyDictionary()  # layer -> handle
_COUNTER = itertools.count()
_LOCK = threading.Lock()

# The suffix of a `keras.random.SeedGenerator` state variable's name (dropout's, say).
SEED_STATE = 'seed_generator_state'


def Handle(layer: keras.layers.Layer) -> str:
    """The text that names `layer` in Params, the same on every call for one layer object.

    Handles count up and are never reused within a process, so two layer objects never share
    one (unlike their ids, which Python reuses after a layer is freed).
    """
    with _LOCK:
        handle = _LAYER_HANDLES.get(layer)
        if handle is None:
            handle = f'{layer.name}#{next(_COUNTER)}'
            _LAYER_HANDLES[layer] = handle
            _HANDLES[handle] = layer
        return handle


def Resolve(handle: str) -> keras.layers.Layer:
    """The Keras layer of `handle`.

    Raises:
      errors.ConfigError: if it names no layer alive in this process (Params text from another
        process, or a layer that has been freed).
    """
    layer = _HANDLES.get(handle) if isinstance(handle, str) else None
    if layer is None:
        raise errors.ConfigError(
            f'KerasLayer: {handle!r} names no Keras layer of this process. Params of Keras '
            'layers hold a handle to the layer object, not the layer; build them with '
            'gpipe_tf.keras.Pipeline.FromKeras(layers, ...), and save the Keras model '
            '(model.save), not the Params text.')
    return layer


def InputSpecs(shapes) -> list:
    """`keras.KerasTensor`s for a layer's inputs: one per shape in `shapes` (each a list, batch
    included, None where unknown)."""
    return [keras.KerasTensor(tuple(shape)) for shape in shapes]


def Shapes(outputs) -> tuple:
    """The TensorShapes of a Keras layer's symbolic outputs, in its structure (one
    TensorShape, or a tuple of them).

    Raises:
      errors.ConfigError: for outputs that are not a tensor or a flat tuple or list of
        tensors: between layers a dict is the keyword inputs (see the module docstring).
    """
    if isinstance(outputs, (list, tuple)) and outputs and all(
            hasattr(o, 'shape') and not isinstance(o, (list, tuple, dict)) for o in outputs):
        return tuple(tf.TensorShape(o.shape) for o in outputs)
    if hasattr(outputs, 'shape') and not isinstance(outputs, (list, tuple, dict)):
        return tf.TensorShape(outputs.shape)
    raise errors.ConfigError(
        f'its outputs are {Structure(outputs)}; a pipeline passes a tensor or a tuple of '
        'tensors from layer to layer (a dict is the keyword inputs): return a tuple')


def Arguments(layer: keras.layers.Layer, inputs: tuple) -> tuple:
    """The positional arguments `layer` is called with on `inputs`, the previous layer's
    outputs (or the pipeline's inputs). One input is one argument. Several are one argument, a
    tuple, as keras.Sequential passes them (Add, Concatenate and Attention take a list of
    inputs), unless the layer's `call` requires several positional arguments
    (MultiHeadAttention's query and value): then each input is one of them, which
    keras.Sequential refuses."""
    if len(inputs) > 1 and _RequiredPositional(layer) < 2:
        return (tuple(inputs),)
    return tuple(inputs)


def _RequiredPositional(layer: keras.layers.Layer) -> int:
    """The number of positional arguments without a default the layer's `call` takes."""
    return sum(1 for q in inspect.signature(layer.call).parameters.values()
               if q.kind in (inspect.Parameter.POSITIONAL_ONLY,
                             inspect.Parameter.POSITIONAL_OR_KEYWORD)
               and q.default is inspect.Parameter.empty)


def Structure(value) -> str:
    """`value`'s nest with each leaf as its type's name, for messages."""
    return repr(tf.nest.map_structure(lambda x: type(x).__name__, value))


def Clone(layer: keras.layers.Layer) -> keras.layers.Layer:
    """An unbuilt copy of `layer`, to measure (output shapes, parameters, time) without
    building the layer itself: from its config, as Keras copies layers, or a deep copy where
    the config does not load back (a `Lambda` of a Python lambda, which Keras's safe mode
    refuses; arguments a config cannot hold). The layer is this process's own object, so no
    code from a file runs.

    Raises:
      errors.ConfigError: if neither works.
    """
    try:
        return type(layer).from_config(layer.get_config())
    except Exception as config_error:  # pylint: disable=broad-except
        try:
            return copy.deepcopy(layer)
        except Exception:  # pylint: disable=broad-except
            raise errors.ConfigError(
                f'KerasLayer: the Keras layer {layer.name} ({type(layer).__name__}) cannot be '
                f'copied, from its config ({type(config_error).__name__}: {config_error}) or '
                'by copy.deepcopy; a pipeline builds a copy to count its parameters before '
                'building the layer on its cell\'s device. Give the layer a get_config that '
                'from_config reads back, or build it first under its cell\'s tf.device.'
            ) from None


def CallSymbolically(layer: keras.layers.Layer, shapes):
    """`layer` called on KerasTensors of `shapes` (building it if it is not built): its
    symbolic outputs."""
    return layer(*Arguments(layer, tuple(InputSpecs(shapes))))


class KerasLayer(base_layer.BaseLayer):
    """A Keras 3 layer run functionally as a gpipe_tf layer (see the module docstring)."""

    # The Keras layer's dtype policy casts its weights and inputs as it reads them.
    WEIGHTS_IN_FPROP_DTYPE = False

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('layer', None, 'Handle of the Keras layer (`keras_layer.Handle(layer)`).')
        p.Define('input_shapes', None,
                 'The shape of each of the layer\'s inputs, batch included (None where '
                 'unknown): what the layer is built for.')
        return p

    def __init__(self, params):
        super().__init__(params)
        layer = self.keras_layer
        self._trainable, self._state = self._KerasVariables()
        for i, variable in enumerate(self._trainable):
            self._layer_vars[f'trainable_{i:04d}'] = variable.value
        for i, variable in enumerate(self._state):
            self._layer_vars[f'state_{i:04d}'] = variable.value
        self._seed_states = [v.path.endswith(SEED_STATE) for v in self._state]
        self._takes_training = _TakesTraining(layer)
        self._keywords = Keywords(layer)

    def _KerasVariables(self) -> tuple[list, list]:
        """(the trainable Keras variables, the others) this layer maps in its call, building
        the Keras layer first if it is not built."""
        layer = self.keras_layer
        if not layer.built:
            if self.p.input_shapes is None:
                raise errors.ConfigError(f'{self.path}: the Keras layer {layer.name} is not '
                                         'built, and Params input_shapes is not set.')
            # Under the cell's tf.device, where the pipeline builds its layers: Keras's
            # TensorFlow backend creates the variables there.
            CallSymbolically(layer, self.p.input_shapes)
        return list(layer.trainable_variables), list(layer.non_trainable_variables)

    @property
    def placed_variables(self) -> list:
        """The tf.Variables that should live on the cell's device: all but seed states, which a
        layer may create with itself rather than when it is built (Keras's Dropout makes its
        SeedGenerator in __init__, wherever that runs) and which a call only reads."""
        return [v.value for v in self._trainable] + [
            v.value for v, seed in zip(self._state, self._seed_states) if not seed]

    @property
    def keras_layer(self) -> keras.layers.Layer:
        """The Keras layer."""
        return Resolve(self.p.layer)

    def FProp(self, theta, *inputs):
        ctx = fprop_context.Current()
        layer = self.keras_layer
        trainable = [theta[f'trainable_{i:04d}'] for i in range(len(self._trainable))]
        state = [theta[f'state_{i:04d}'] for i in range(len(self._state))]
        given = [_FoldedSeed(value, ctx) if seed else value
                 for value, seed in zip(state, self._seed_states)]
        inputs, keywords = SplitKeywords(inputs)
        mapping = list(zip(self._trainable, trainable)) + list(zip(self._state, given))
        # Nothing to initialize: every variable is mapped (and initializing the variables
        # other code left uninitialized is not this call's business).
        with keras.StatelessScope(state_mapping=mapping, initialize_variables=False,
                                  collect_losses=True) as scope:
            outputs = self._Call(inputs, keywords, bool(ctx.training))
            new_state = [scope.get_current_value(v) for v in self._state]
        if scope.losses and ctx.training:
            raise errors.ConfigError(
                f'{self.path}: the Keras layer {layer.name} adds a loss in its call (add_loss, '
                'activity_regularizer=), which a pipeline does not carry to the loss (it passes '
                'only the layers\' outputs on). Weight regularizers (kernel_regularizer=) work.')
        if ctx.training:
            self._ReportState(state, given, new_state, inputs)
        if isinstance(outputs, list):
            outputs = tuple(outputs)
        if keywords is not None:
            return base_layer.AsArgs(outputs) + (keywords,)
        return outputs

    def _Call(self, inputs: tuple, keywords: dict | None, training: bool):
        """The Keras layer called on `inputs` (inside the call's stateless scope), with the
        keyword inputs its `call` takes."""
        layer = self.keras_layer
        kwargs = {'training': training} if self._takes_training else {}
        kwargs.update({k: v for k, v in (keywords or {}).items() if k in self._keywords})
        return layer(*Arguments(layer, inputs), **kwargs)

    def _ReportState(self, state, given, new_state, inputs) -> None:
        """Hands the float state this call changed to the pipeline (`AddUpdate`), weighted by
        the micro-batch's examples."""
        stats = NestedMap()
        for i, (old, in_value, new, variable, seed) in enumerate(
                zip(state, given, new_state, self._state, self._seed_states)):
            if new is in_value or seed:
                continue
            if not variable.dtype.startswith(('float', 'bfloat')):
                raise errors.ConfigError(
                    f'{self.path}: the Keras layer {self.keras_layer.name} changes its '
                    f'{variable.dtype} state {variable.path} in a call; a pipeline can '
                    'combine only float state (moving averages) over its micro-batches.')
            stats[f'state_{i:04d}'] = tf.stop_gradient(tf.cast(new, old.dtype) - old)
        if not stats:
            return
        batch_dim = fprop_context.Current().batch_dim
        # The first input the call was given (an unread skip, passed on, is None).
        first = next(x for x in tf.nest.flatten(inputs) if x is not None)
        count = tf.cast(tf.shape(first)[batch_dim], tf.float32)
        stats = stats.Transform(lambda delta: delta * tf.cast(count, delta.dtype))
        stats.count = count
        self.AddUpdate(stats)

    def ApplyUpdate(self, stats: NestedMap):
        """Adds to each changed state variable its change averaged over the examples (`stats`
        summed over micro-batches: each change times its micro-batch's examples, and the
        examples); returns the grouped assign op."""
        updates = []
        for key, total in stats.items():
            if key == 'count':
                continue
            variable = self.vars[key]
            updates.append(variable.assign_add(total / tf.cast(stats.count, total.dtype)))
        return tf.group(updates)

    @classmethod
    def FPropMeta(cls, p, *input_shapes):
        layer = Resolve(p.layer)
        input_shapes, keywords = SplitKeywords(input_shapes)
        shapes = [s.as_list() for s in input_shapes]
        if layer.built:
            outputs = layer.compute_output_spec(*Arguments(layer, tuple(InputSpecs(shapes))))
            num_params = layer.count_params()
            trainable = sum(math.prod(v.shape) for v in layer.trainable_variables)
        else:
            # A copy built in a graph of its own, where its weights take no memory (none is
            # initialized), tells the shapes and parameters.
            clone = Clone(layer)
            with tf.Graph().as_default():
                outputs = CallSymbolically(clone, shapes)
            num_params = sum(math.prod(v.shape) for v in clone.weights)
            trainable = sum(math.prod(v.shape) for v in clone.trainable_variables)
        out_shapes = Shapes(outputs)
        if keywords is not None:
            out_shapes = base_layer.AsArgs(out_shapes) + (keywords,)
        # Positions of the first input: its elements per channel (the last dimension).
        first = input_shapes[0]
        positions = first.num_elements() // max(first[-1], 1) if first.rank else 1
        # An Embedding's table (keras_hub's token embeddings are Embeddings too) gets a
        # gather's gradient, a row per id of the layer's first input.
        tables = [e for e in (layer if layer.built else clone)._flatten_layers()
                  if isinstance(e, keras.layers.Embedding)]
        return base_layer.LayerMeta(
            out_shapes=out_shapes, flops=2 * trainable * positions, num_params=num_params,
            activation_bytes=base_layer.ActivationBytes(out_shapes, p),
            sparse_params=sum(e.input_dim * e.output_dim for e in tables),
            sparse_gradient_bytes=sum(embedding.SparseGradientBytes(
                first.num_elements() if first.rank else 1, e.output_dim, e.embeddings.dtype)
                for e in tables))


def SplitKeywords(inputs: tuple) -> tuple[tuple, dict | None]:
    """(the positional inputs, the keyword inputs or None) of a layer's inputs: a single tuple
    or list is spread; a dict last holds the keyword inputs."""
    if len(inputs) == 1 and isinstance(inputs[0], (tuple, list)):
        inputs = tuple(inputs[0])
    if inputs and isinstance(inputs[-1], dict):
        return tuple(inputs[:-1]), inputs[-1]
    return tuple(inputs), None


def Keywords(layer: keras.layers.Layer) -> frozenset:
    """The names of the keyword inputs the layer's `call` names (all its arguments but the
    first and `training`; a `**kwargs` takes none)."""
    parameters = list(inspect.signature(layer.call).parameters.values())
    return frozenset(q.name for q in parameters[1:]
                     if q.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                   inspect.Parameter.KEYWORD_ONLY)) - {'training'}


def _TakesTraining(layer: keras.layers.Layer) -> bool:
    """Whether the layer's `call` takes a `training` argument (Keras passes it only then)."""
    parameters = inspect.signature(layer.call).parameters
    return 'training' in parameters or any(
        q.kind is inspect.Parameter.VAR_KEYWORD for q in parameters.values())


def _FoldedSeed(state: tf.Tensor, ctx: fprop_context.FPropContext) -> tf.Tensor:
    """A seed generator's state folded with the step and the micro-batch's first example: new
    per step and micro-batch, the same when a micro-batch's forward is re-materialized."""
    seed = tf.cast(state, tf.int64)
    seed = tf.random.experimental.stateless_fold_in(seed, tf.cast(ctx.step, tf.int64))
    seed = tf.random.experimental.stateless_fold_in(seed, tf.cast(ctx.first_example, tf.int64))
    return tf.cast(seed, state.dtype)
