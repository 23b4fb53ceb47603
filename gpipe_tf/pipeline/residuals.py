"""A cell's forward and the parts of its backward as separate functions, joined by the tensors
the backward reads of the forward (the residuals).

Unrolled, the backward of a micro-batch is tf.gradients of the forward's call op, which finds
the intermediates the call kept. In a loop (`looped.py`) the forward and the backward of one
micro-batch run in different iterations: what the backward reads must be handed on, in
TensorArrays. TensorFlow computes exactly that set when it differentiates a function (the
forward then returns its intermediates), but not through a public API; so `Parts` traces the
cell's forward and its gradient in one graph (`tf.compat.v1.wrap_function`), finds where the
gradient's ops read values of the forward, and prunes the graph (`WrappedFunction.prune`) into:

* `Forward`: the cell's outputs, its statistics and the residuals (per layer its activations,
  whatever each gradient reads: a batch norm's saved moments, a dropout mask);
* `Backward` (B): the weight and input gradients from the residuals and the outputs' gradient;
* `Input` (I) and `Weight` (W), a zero-bubble stage's halves: I computes the input gradient and
  what W reads of its values (each layer's pre-activation gradient); W, the weight gradients.

No forward runs again in a backward and W recomputes nothing I computed. Values that depend on
the weights, the step and constants alone (a weight's cast, a dropout mask's seed) are not
residuals: each part computes its own, so nothing of the weights' size is kept per micro-batch.
"""

from __future__ import annotations

import tensorflow as tf

from gpipe_tf.pipeline import leaves

# Classes of the traced graph's ops: computed from the weights, step and constants alone (each
# part computes its own); from the cell's input (the forward); from the outputs' gradient (the
# backward).
_FREE, _FORWARD, _BACKWARD = 0, 1, 2


class Parts:
    """The forward, B, I and W of one cell for inputs of one structure and shapes.

    Args:
      run: `run(layer_thetas, inputs, step, first_example)` -> (outputs, statistics), the
        cell's training forward (`cell._Traced`), traced here once.
      theta: the cell's theta (per layer, one nest each), as specs or tensors: the parts take
        a theta of this structure and give its gradient in it (None for leaves not trainable).
      trainable: per leaf of the flattened theta, whether it gets a gradient.
      input_spec: the cell's input, a nest of TensorSpecs (None leaves allowed).
      step_spec: the spec of the step and of the first example's index.
    """

    def __init__(self, run, theta, trainable, input_spec, step_spec):
        theta_specs = [tf.TensorSpec(t.shape, t.dtype) for t in tf.nest.flatten(theta)]
        self._theta_structure = theta
        self._trainable = list(trainable)
        input_specs = leaves.Present(input_spec)
        traced = {}

        def Trace(theta_flat, input_flat, step, first_example):
            layer_thetas = tf.nest.pack_sequence_as(theta, list(theta_flat))
            given = iter(input_flat)
            inputs = tf.nest.pack_sequence_as(input_spec, [
                None if x is None else next(given) for x in tf.nest.flatten(input_spec)])
            outputs, stats = run(layer_thetas, inputs, step, first_example)
            ys = leaves.FloatLeaves(outputs)
            # The outputs' gradients: fed to the backward parts, never to the whole graph.
            d_ys = [tf.compat.v1.placeholder(y.dtype, y.shape, name='d_output') for y in ys]
            sources = [t for t, keep in zip(theta_flat, trainable) if keep]
            grads = tf.gradients(ys, sources + leaves.FloatLeaves(inputs), grad_ys=d_ys,
                                 unconnected_gradients=tf.UnconnectedGradients.ZERO)
            traced.update(outputs=outputs, stats=stats, d_ys=d_ys,
                          d_theta=grads[:len(sources)], d_x=grads[len(sources):])
            return leaves.Present(outputs), tf.nest.flatten(stats)

        # Traced, and pruned (`_Part`), with no device scope: a trace (and a pruned copy of
        # it) takes the device scope it is made in onto its ops, and the parts serve every
        # cell of the structure, each called on its own device.
        with tf.device(None):
            wrapped = tf.compat.v1.wrap_function(
                Trace, [theta_specs, input_specs, step_spec, step_spec])
        self._output_structure = traced['outputs']
        self._stats_structure = traced['stats']
        n_theta, n_x = len(theta_specs), len(input_specs)
        x_ph = wrapped.inputs[n_theta:n_theta + n_x]
        given = wrapped.inputs[:n_theta] + wrapped.inputs[n_theta + n_x:]  # theta, step, first
        d_ys, d_theta, d_x = traced['d_ys'], traced['d_theta'], traced['d_x']
        order = {op: i for i, op in enumerate(wrapped.graph.get_operations())}
        classes = _Classes(order, x_ph, d_ys)
        # The outputs' gradients are given to a part, never computed by it (W reads one that
        # no input gradient depends on: a cell whose float input is only passed on).
        given_d_ys = {t.op for t in d_ys}
        input_ops = {op for op in _Ancestors(d_x) if classes[op] == _BACKWARD} - given_d_ys
        weight_ops = ({op for op, c in classes.items() if c == _BACKWARD} - input_ops -
                      given_d_ys)
        fed = _Refs(given)

        def Residuals(ops, fetches, exclude=()):
            """What a part's ops (and fetches) read that it does not compute, other than what
            every part is given (theta, step, first example), what it computes from those alone,
            and `exclude`; in the graph's order."""
            found = {}
            # An embedding's gradient is IndexedSlices: its indices are the forward's ids.
            fetched = tf.nest.flatten(list(fetches), expand_composites=True)
            for t in [t for op in ops for t in op.inputs] + fetched:
                if not (t.op in ops or t.ref() in fed or t.ref() in exclude or
                        classes[t.op] == _FREE):
                    # Every output of the op: `prune` cannot feed one output of an op and
                    # compute its others (a gradient's BroadcastGradientArgs for a run-time
                    # batch: the input gradient reads one output, the weight gradient the
                    # other).
                    for sibling in t.op.outputs:
                        found.setdefault(sibling.ref(), sibling)
            return sorted(found.values(), key=lambda t: (order[t.op], t.value_index))

        # B's and I's residuals come from the forward (or are the cell's input itself); W's
        # from the forward, from I's values, or are the outputs' gradients.
        kept = Residuals(input_ops | weight_ops, d_theta + d_x, _Refs(d_ys))
        for_input = Residuals(input_ops, d_x, _Refs(d_ys))
        saved = Residuals(weight_ops, d_theta)
        # In theta's structure, whether each leaf's gradient is IndexedSlices (a gather's;
        # None for leaves not trainable).
        self.sparse_gradients = self._Theta([isinstance(g, tf.IndexedSlices) for g in d_theta])
        self.kept_specs = [tf.TensorSpec(t.shape, t.dtype) for t in kept]
        self.saved_specs = [tf.TensorSpec(t.shape, t.dtype) for t in saved]
        # The kept residuals that are the cell's input are handed on, not fetched.
        self._kept_from_input = [_Index(t, x_ph) for t in kept]
        self._input_positions = [_Index(t, kept) for t in for_input]
        # Per residual of W: ('d_y', i), ('kept', i) or ('computed', None), a value of I's.
        self._saved_sources = [_Source(t, d_ys, kept) for t in saved]
        # Each part is pruned when first called: a fused backward never needs I and W, a split
        # one never needs B (pruning copies the traced graph).
        self._pruned = {}
        self._prune = {
            'forward': lambda: wrapped.prune(
                feeds=given + x_ph,
                fetches=[leaves.Present(traced['outputs']), tf.nest.flatten(traced['stats']),
                         [t for t, i in zip(kept, self._kept_from_input) if i is None]]),
            'backward': lambda: wrapped.prune(feeds=given + kept + d_ys,
                                              fetches=[d_theta, d_x]),
            'input': lambda: wrapped.prune(
                feeds=given + for_input + d_ys,
                fetches=[d_x, [t for t, (source, _) in zip(saved, self._saved_sources)
                               if source == 'computed']]),
            'weight': lambda: wrapped.prune(feeds=given + saved, fetches=d_theta),
        }

    def _Part(self, name: str):
        """The pruned function of part `name` ('forward', 'backward', 'input', 'weight')."""
        if name not in self._pruned:
            with tf.device(None):
                self._pruned[name] = self._prune[name]()
        return self._pruned[name]

    # ---- calling the parts --------------------------------------------------------------------
    def _Given(self, theta, step, first_example) -> list:
        """What every part is given first: the cell's theta (flat), the step, the first example."""
        theta = tf.nest.flatten(theta)
        # As tensors: a variable (the global step) would not bind to a pruned function.
        return [tf.convert_to_tensor(t) for t in theta] + [
            tf.cast(tf.convert_to_tensor(x), tf.int64) for x in (step, first_example)]

    def Forward(self, theta, inputs, step, first_example):
        """(outputs, statistics, the kept residuals as a flat list) for one micro-batch."""
        x = leaves.Present(inputs)
        outputs, stats, kept = self._Part('forward')(*self._Given(theta, step, first_example), *x)
        kept = iter(kept)
        kept = [next(kept) if i is None else x[i] for i in self._kept_from_input]
        outputs = iter(outputs)  # None leaves (an input passed on unread) are not fetched.
        outputs = [None if y is None else next(outputs)
                   for y in tf.nest.flatten(self._output_structure)]
        return (tf.nest.pack_sequence_as(self._output_structure, outputs),
                tf.nest.pack_sequence_as(self._stats_structure, stats), kept)

    def Backward(self, theta, kept, step, first_example, d_outputs):
        """B: (d_theta, the gradients of the input's float leaves) from the kept residuals
        and the float outputs' gradients (`d_outputs`)."""
        d_theta, d_x = self._Part('backward')(*self._Given(theta, step, first_example), *kept,
                                      *d_outputs)
        return self._Theta(d_theta), list(d_x)

    def Input(self, theta, kept, step, first_example, d_outputs):
        """I: (the gradients of the input's float leaves, what W reads as a flat list)."""
        d_x, computed = self._Part('input')(*self._Given(theta, step, first_example),
                                    *[kept[i] for i in self._input_positions], *d_outputs)
        computed = iter(computed)
        saved = []
        for source, i in self._saved_sources:
            if source == 'd_y':
                saved.append(d_outputs[i])
            elif source == 'kept':
                saved.append(kept[i])
            else:
                saved.append(next(computed))
        return list(d_x), saved

    def Weight(self, theta, saved, step, first_example) -> list:
        """W: d_theta from what I saved."""
        return self._Theta(self._Part('weight')(*self._Given(theta, step, first_example), *saved))

    def _Theta(self, grads):
        grads = iter(grads)
        return tf.nest.pack_sequence_as(self._theta_structure, [
            next(grads) if keep else None for keep in self._trainable])


def _Classes(order: dict, inputs, d_outputs) -> dict:
    """Per op of the traced graph (`order`: each op's position in creation order, where every
    op comes after its inputs) its class: _BACKWARD if it depends, through data or control, on
    an output gradient, else _FORWARD if on the cell's input, else _FREE."""
    classes = {}
    seeds = {t.op: _BACKWARD for t in d_outputs}
    seeds.update({t.op: _FORWARD for t in inputs})
    for op in sorted(order, key=order.get):
        found = [classes[t.op] for t in op.inputs] + [classes[c] for c in op.control_inputs]
        classes[op] = max(found + [seeds.get(op, _FREE)])
    return classes


def _Ancestors(tensors) -> set:
    """The ops the tensors are computed from (through data and control inputs)."""
    seen, stack = set(), [t.op for t in tensors]
    while stack:
        op = stack.pop()
        if op not in seen:
            seen.add(op)
            stack += [t.op for t in op.inputs] + list(op.control_inputs)
    return seen


def _Refs(tensors) -> set:
    return {t.ref() for t in tensors}


def _Index(t, tensors):
    """The index of `t` among `tensors` (None where it is not one of them)."""
    return next((i for i, x in enumerate(tensors) if x.ref() == t.ref()), None)


def _Source(t, d_outputs, kept) -> tuple:
    """Where a residual of W comes from: ('d_y', i), the outputs' gradient I was given;
    ('kept', i), a residual of the forward; else ('computed', None), a value I computes."""
    for source, tensors in (('d_y', d_outputs), ('kept', kept)):
        i = _Index(t, tensors)
        if i is not None:
            return source, i
    return 'computed', None
