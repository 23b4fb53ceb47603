"""A cell: consecutive layers of a pipeline, run as one unit on one device, and how it runs
there: its traced forward, its backward (re-materializing the forward or reading what it kept)
and its backward split into the parts a schedule runs apart (B, or I and W).

A cell is not a layer of its own. Its layers are the pipeline's children, named by their place in
the model (`model.layer_003`), so nothing a layer is known by depends on the partition: not its
path, its variables' names, its checkpoint keys or its random seeds. A checkpoint written at one K
restores at any other, and the same seed gives the same initial weights at every K. `Cell` only
groups the layers: their variables, their theta, and their forward in order.

`CellFunctions` runs a cell on its device. Each cell is traced once into a forward function and
once into a backward function, and both are called once per micro-batch, so the graph grows with
M by one call op, not by the cell's layers. Cells of one structure (the same layer classes and
Params but for their names: a Transformer's middle cells, a pipeline's replicas) share their
traces, the cell's weights being arguments, unless a trace draws random numbers (dropout): a
layer's seed is a constant of its path, so such a cell traces its own (docs/performance.md,
"Shared traces", says what that saves).

The backward function recomputes the cell's forward from the cell's input and then differentiates
it. Its recompute waits on the incoming gradient (a control dependency on `dy`), so it runs during
backprop in every mode; `tf.recompute_grad` recomputes during the forward pass in a tf.compat.v1
graph, saving nothing there, which is why the backward is written here. `CellSplit` is the
backward as separate functions joined by the tensors it reads of the forward (the residuals,
`residuals.Parts`), for the loop and for schedules that run I apart from W.
"""

from __future__ import annotations

import tensorflow as tf

from gpipe_tf.layers import base_layer
from gpipe_tf.layers import fprop_context
from gpipe_tf.layers import sequential
from gpipe_tf.nested_map import NestedMap
from gpipe_tf.pipeline import leaves
from gpipe_tf.pipeline import residuals
from gpipe_tf.pipeline import unfolded

# The name scope of a backward's re-materialized forward, so a trace tells it from the gradients.
RECOMPUTE_SCOPE = 'recompute'


class Cell:
    """Layers applied one after another, grouped for one stage of the pipeline.

    Args:
      layers: the layers, in the order they are applied (children of the pipeline).
      path: a name for the cell's traced functions, e.g. `model.cell_1`; no variable or seed
        uses it.
    """

    def __init__(self, layers: list, path: str):
        self._layers = list(layers)
        self.path = path

    @property
    def sequence(self) -> list:
        """The layers in the order they are applied."""
        return list(self._layers)

    @property
    def names(self) -> list[str]:
        return [layer.p.name for layer in self._layers]

    @property
    def passed_leaves(self) -> dict[int, int]:
        """The leaves of the cell's input that its layers give on unread: {input leaf: output
        leaf} (`BaseLayer.PassedLeaves`)."""
        return sequential.ChainPassed([layer.p for layer in self._layers])

    @property
    def vars(self) -> NestedMap:
        """Each layer's variables, keyed by the layer's name."""
        return NestedMap({layer.p.name: layer.vars for layer in self._layers})

    @property
    def variables(self) -> list:
        return [v for layer in self._layers for v in layer.variables]

    @property
    def trainable_variables(self) -> list:
        return [v for layer in self._layers for v in layer.trainable_variables]

    @property
    def theta(self) -> NestedMap:
        """The current values of `vars`."""
        return NestedMap({layer.p.name: layer.theta for layer in self._layers})

    def Theta(self, theta: NestedMap) -> NestedMap:
        """The cell's part of a pipeline's theta (keyed by layer name)."""
        return NestedMap({name: theta[name] for name in self.names})

    def FProp(self, theta: NestedMap, *inputs):
        """The layers applied in order, each to the previous one's outputs; `theta` is the cell's
        (`Theta`)."""
        return sequential.Apply(self._layers, theta, *inputs)


def StructureKey(cell) -> tuple:
    """Cells with equal keys compute the same function of their theta (given per layer, in
    order) and inputs, but for their layers' seeds: the same layer classes, in the same order,
    built from the same Params but for the layers' names."""
    return tuple((type(layer).__module__, type(layer).__qualname__,
                  layer.params.Copy().Set(name='').ToText()) for layer in cell.sequence)


class _Traced:
    """The traced forward and backward functions shared by the cells of one structure
    (`StructureKey`), on every device and replica: traced once, with the first such cell's
    layers. A cell's theta (a list with one entry per layer, in order) is an argument; no device
    is set inside, so the call op's device places the body. A function whose trace drew random
    numbers holds its cell's seeds and serves that cell alone (`Shareable`).

    Args:
      cell: the cell whose layers are traced.
      batch_dim: the inputs' batch dimension.
    """

    def __init__(self, cell, batch_dim: int):
        self.cell = cell
        self.batch_dim = batch_dim
        self.layers = [d for layer in cell.sequence for d in layer.Descendants()]
        self.trainable = [v.trainable for v in tf.nest.flatten(cell.vars)]
        # Positions in `layers` of the layers that report training updates, in the order they
        # report them; set when the training forward is first traced.
        self.update_positions: list | None = None
        # Per function traced ('fwd_True', 'fwd_False', 'bwd', 'split'),
        # whether its trace drew a layer's seed.
        self._seeded = {}
        name = cell.path.replace('.', '_')
        self.forward = {}
        for training in (True, False):
            forward = self._MakeForward(training)
            forward.__name__ = f'{name}_fwd'
            # The inference forward stays a call (not inlined into the caller): inside a while
            # loop (a served model's loop over a request's batches), grappler's arithmetic
            # optimizer made the inlined calls, ordered by `executor._Done`'s control
            # dependencies, a graph it could not sort ("topological sort failed" error lines,
            # and the step left unoptimised). Nothing is recorded for a backward there.
            attributes = None if training else {'_noinline': True}
            self.forward[training] = tf.function(forward, autograph=False,
                                                 experimental_attributes=attributes)
        self.backward = tf.function(self._Backward, autograph=False)
        self._splits = {}  # `Split`'s, by input specs.

    def _Theta(self, layer_thetas) -> NestedMap:
        return NestedMap({layer.p.name: t for layer, t in zip(self.cell.sequence, layer_thetas)})

    def _PerLayer(self, flat) -> list:
        """A flat list over the leaves of the cell's theta as a list with one entry per layer."""
        packed = tf.nest.pack_sequence_as(self.cell.vars, list(flat))
        return [packed[layer.p.name] for layer in self.cell.sequence]

    def Shareable(self, kind: str) -> bool:
        """Whether function `kind` is traced and serves other cells of this structure: its
        trace drew no random numbers (which would hold this cell's seeds)."""
        return self._seeded.get(kind) is False

    def _Start(self, kind: str) -> None:
        """Called as the trace of function `kind` begins."""
        self._seeded[kind] = False
        self._kind = kind

    def _Seeded(self) -> None:
        self._seeded[self._kind] = True

    def _Scope(self, step, first_example, training, collector=None):
        """The layers' context for one micro-batch; updates go to `collector` (by default one
        that is dropped: a recompute's statistics were already reported by the forward)."""
        return fprop_context.Scope(
            training=training, step=step, first_example=first_example, batch_dim=self.batch_dim,
            update_collector=(fprop_context.UpdateCollector() if collector is None else collector),
            seed_observer=self._Seeded)

    def _Run(self, theta, inputs, step, first_example, training):
        collector = fprop_context.UpdateCollector()
        with self._Scope(step, first_example, training, collector):
            outputs = self.cell.FProp(theta, *base_layer.AsArgs(inputs))
        if training and self.update_positions is None:
            position = {id(layer): i for i, layer in enumerate(self.layers)}
            self.update_positions = [position[id(layer)] for layer, _ in collector.Items()]
        stats = [tf.nest.map_structure(tf.stop_gradient, s) for _, s in collector.Items()]
        return outputs, stats

    def _MakeForward(self, training: bool):
        def Forward(layer_thetas, inputs, step, first_example):
            self._Start(f'fwd_{training}')
            return self._Run(self._Theta(layer_thetas), inputs, step, first_example, training)
        return Forward

    def _Backward(self, layer_thetas, inputs, step, first_example, d_outputs):
        """Recomputes the forward once `d_outputs` (gradients of the float outputs) exist, then
        differentiates it.

        Returns:
          (d_theta per layer (None where a leaf is not trainable), d_inputs flat over the
          leaves of `inputs` (None where not floating point)).
        """
        self._Start('bwd')
        with tf.name_scope(RECOMPUTE_SCOPE):
            with tf.control_dependencies(d_outputs):
                theta = leaves.Identity(self._Theta(layer_thetas))
                inputs = leaves.Identity(inputs)
            outputs, _ = self._Run(theta, inputs, step, first_example, training=True)
        d_theta, d_inputs = Differentiate(outputs, theta, inputs, d_outputs, self.trainable)
        return self._PerLayer(d_theta), d_inputs

    def Split(self, layer_thetas, input_spec, step_spec) -> residuals.Parts:
        """The cell's forward and backward parts joined by residuals (`residuals.Parts`)
        for inputs of `input_spec`, traced when first asked for."""
        key = repr(tf.nest.map_structure(lambda x: x, input_spec))
        if key not in self._splits:
            def Run(layer_thetas, inputs, step, first_example):
                self._Start('split')
                return self._Run(self._Theta(layer_thetas), inputs, step, first_example, True)
            trainable = [v.trainable for layer in self.cell.sequence
                         for v in tf.nest.flatten(layer.vars)]
            self._splits[key] = residuals.Parts(Run, layer_thetas, trainable, input_spec,
                                                    step_spec)
        return self._splits[key]


class CellFunctions:
    """The traced forward and backward functions of one cell on one device.

    Args:
      cell: the cell (`Cell`); `cell.FProp(theta, *args)`.
      device: the device string every op of the cell is placed on.
      batch_dim: the inputs' batch dimension (the layers' per-example randomness counts
        examples along it).
      shared: a dict, shared by the cells of one pipeline, of the traced functions by cell
        structure (`StructureKey`): cells of equal structure (a Transformer's middle cells,
        a pipeline's replicas) are traced once. None traces this cell's own.
    """

    def __init__(self, cell, device: str, batch_dim: int = 0, shared: dict | None = None):
        self.cell = cell
        self.device = device
        self.batch_dim = batch_dim
        # Per leaf of the cell's theta, whether it is trainable (and so gets a gradient).
        self.trainable = [v.trainable for v in tf.nest.flatten(cell.vars)]
        shared = {} if shared is None else shared
        key = StructureKey(cell)
        if key not in shared:
            shared[key] = _Traced(cell, batch_dim)
        self._shared = shared[key]
        self._own = None  # This cell's own trace, for functions whose shared one is seeded.
        self._layers = [d for layer in cell.sequence for d in layer.Descendants()]

    def _For(self, kind: str) -> _Traced:
        """The traced functions to run function `kind` with: the shared ones, unless their
        trace drew random numbers with another cell's seeds (or is not made yet)."""
        shared = self._shared
        if shared.cell is self.cell or shared.Shareable(kind):
            return shared
        if self._own is None:
            self._own = _Traced(self.cell, self.batch_dim)
        return self._own

    @property
    def update_layers(self) -> list | None:
        """Layers that report training updates, in the order they report them; None until the
        training forward is first traced."""
        positions = self._For('fwd_True').update_positions
        return None if positions is None else [self._layers[i] for i in positions]

    def _LayerThetas(self, theta) -> list:
        """The traced functions' first argument: this cell's theta, one entry per layer."""
        return [theta[layer.p.name] for layer in self.cell.sequence]

    def Flat(self, layer_thetas) -> list:
        """Per-layer values as a flat list over the leaves of this cell's theta."""
        return tf.nest.flatten(NestedMap(
            {layer.p.name: t for layer, t in zip(self.cell.sequence, layer_thetas)}))

    def ForwardSpecs(self, theta, input_spec, step_spec, training: bool = True):
        """TensorSpecs of the (outputs, statistics) of the cell's forward on inputs of
        `input_spec` (tracing it if it was not)."""
        concrete = _DeviceFree(self._For(f'fwd_{training}').forward[training],
                               self._LayerThetas(theta), input_spec, step_spec, step_spec)
        return tf.nest.map_structure(
            lambda t: None if t is None else tf.TensorSpec(t.shape, t.dtype),
            concrete.structured_outputs)

    def BackwardGradientKinds(self, theta, input_spec, step_spec) -> list:
        """Per leaf of the cell's flat theta, whether its gradient in `Backward` (the
        re-materializing backward) on inputs of `input_spec` is sparse (IndexedSlices, a
        gather's), tracing it if it was not; False for leaves not trainable."""
        outputs, _ = self.ForwardSpecs(theta, input_spec, step_spec)
        concrete = _DeviceFree(self._For('bwd').backward, self._LayerThetas(theta), input_spec,
                               step_spec, step_spec, leaves.FloatLeaves(outputs))
        return [isinstance(g, tf.IndexedSlices)
                for g in self.Flat(concrete.structured_outputs[0])]

    def Forward(self, theta, inputs, step, first_example, training: bool = True):
        """(outputs, update stats) of the cell on one micro-batch whose first example has index
        `first_example` (scalar int64 tensor) in the mini-batch; one call op on the device."""
        return _OnDevice(self._For(f'fwd_{training}').forward[training], self.device,
                         self._LayerThetas(theta), inputs, step, first_example)

    def Backward(self, theta, inputs, step, first_example, d_outputs):
        """(flat d_theta, flat d_inputs) for one micro-batch, recomputing the forward."""
        d_theta, d_inputs = _OnDevice(self._For('bwd').backward, self.device,
                                      self._LayerThetas(theta), inputs, step, first_example,
                                      d_outputs)
        with tf.device(self.device):
            return self.Flat(d_theta), d_inputs

    def Split(self, theta, input_spec, step_spec) -> CellSplit:
        """This cell's forward and backward parts joined by residuals, for inputs of
        `input_spec` (`residuals.Parts`), on this device."""
        return CellSplit(self, self._For('split').Split(self._LayerThetas(theta), input_spec,
                                                        step_spec), input_spec)


def _DeviceFree(function, *args):
    """tf.function `function`'s concrete function for `args`, traced with no device scope. A
    trace keeps the device scope it is made in on every op inside (a tf.function's graph starts
    with its caller's device stack), and the trace serves every cell of the structure, on every
    device: traced inside stage 0's scope, the other stages' calls ran their ops on stage 0's
    device (the loop's backwards, all on the first device)."""
    with tf.device(None):
        return function.get_concrete_function(*args)


def _OnDevice(function, device: str, *args):
    """Calls tf.function `function` on `args` as one op on `device`, its trace device-free
    (`_DeviceFree`): the call op's device places the body."""
    concrete = _DeviceFree(function, *args)
    with tf.device(device):
        return concrete(*args)


class CellSplit:
    """A cell's `residuals.Parts` on its device, taking the cell's theta and giving its
    gradients as `CellFunctions.Backward` does: d_theta flat (None for non-trainable leaves),
    d_inputs flat over the input's leaves (None where not floating point)."""

    def __init__(self, functions: CellFunctions, split: residuals.Parts, input_spec):
        self._functions = functions
        self._split = split
        self._input_spec = input_spec
        self.kept_specs = split.kept_specs
        self.saved_specs = split.saved_specs
        # Per leaf of the cell's flat theta, whether its gradient (in Backward and Weight) is
        # sparse (IndexedSlices, a gather's).
        self.sparse_gradients = [bool(x) for x in functions.Flat(split.sparse_gradients)]

    def _Call(self, part, theta, *args):
        fn = self._functions
        with tf.device(fn.device):
            return getattr(self._split, part)(fn._LayerThetas(theta), *args)  # pylint: disable=protected-access

    def Forward(self, theta, inputs, step, first_example):
        """(outputs, statistics, kept residuals) of one micro-batch."""
        return self._Call('Forward', theta, inputs, step, first_example)

    def Backward(self, theta, kept, step, first_example, d_outputs):
        """B: (flat d_theta, flat d_inputs)."""
        d_theta, d_x = self._Call('Backward', theta, kept, step, first_example, d_outputs)
        return self._functions.Flat(d_theta), leaves.WithFloatLeaves(self._input_spec, d_x)

    def Input(self, theta, kept, step, first_example, d_outputs):
        """I: (flat d_inputs, what W reads)."""
        d_x, saved = self._Call('Input', theta, kept, step, first_example, d_outputs)
        return leaves.WithFloatLeaves(self._input_spec, d_x), saved

    def Weight(self, theta, saved, step, first_example) -> list:
        """W: flat d_theta."""
        return self._functions.Flat(self._Call('Weight', theta, saved, step, first_example))


def WithOtherOutputs(ys: list, d_ys: list) -> tuple:
    """`ys` and their gradients `d_ys` for tf.gradients, with every other float output of the
    call ops that produced them (a cell's statistics; the intermediates an earlier gradient of
    the call made it return) given a zero gradient filled at run time. Left out, tf.gradients
    gives each a zeros_like, which constant folding turns into a constant of its size, held
    while the graph lives (`unfolded`): per micro-batch, every layer's activations once a
    split backward differentiated its calls a second time."""
    ys, d_ys = list(ys), list(d_ys)
    given = {y.ref() for y in ys}
    ops = {y.op.name: y.op for y in ys
           if y.op.type in ('PartitionedCall', 'StatefulPartitionedCall')}
    for op in ops.values():
        for t in op.outputs:
            if t.dtype.is_floating and t.ref() not in given:
                given.add(t.ref())
                ys.append(t)
                d_ys.append(unfolded.ZerosLike(t))
    return ys, d_ys


def Gradients(ys: list, xs: list, d_ys: list, tape=None) -> list:
    """Gradients of `ys` (given theirs, `d_ys`) w.r.t. `xs`, zero where unconnected: from
    `tape` if one recorded them (eager mode), else tf.gradients (`WithOtherOutputs`)."""
    if tape is not None:
        return tape.gradient(ys, xs, output_gradients=d_ys,
                             unconnected_gradients=tf.UnconnectedGradients.ZERO)
    ys, d_ys = WithOtherOutputs(ys, d_ys)
    return tf.gradients(ys, xs, grad_ys=d_ys, unconnected_gradients=tf.UnconnectedGradients.ZERO)


def Differentiate(outputs, theta, inputs, d_outputs, trainable, tape=None):
    """Gradients of `outputs` w.r.t. the trainable leaves of theta and the float leaves of
    `inputs`.

    Args:
      outputs, theta, inputs: the forward computation's outputs, theta and inputs.
      d_outputs: the incoming gradients of the float leaves of `outputs`.
      trainable: per leaf of theta (flattened), whether it is a trainable variable's value;
        the others (batch norm's moving statistics) get no gradient.
      tape: a tape that recorded the forward (eager mode); else tf.gradients (graph mode).

    Returns:
      (flat d_theta with None for non-trainable leaves, flat d_inputs with None for non-float
      leaves).
    """
    ys = leaves.FloatLeaves(outputs)
    dys = list(d_outputs)
    sources = [t for t, keep in zip(tf.nest.flatten(theta), trainable) if keep]
    xs = leaves.FloatLeaves(inputs)
    grads = Gradients(ys, sources + xs, dys, tape)
    theta_grads = iter(grads[:len(sources)])
    d_theta = [next(theta_grads) if keep else None for keep in trainable]
    return d_theta, leaves.WithFloatLeaves(inputs, grads[len(sources):])

