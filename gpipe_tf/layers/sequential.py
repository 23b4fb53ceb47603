"""SequentialLayer: layers applied one after another, optionally repeated."""

from __future__ import annotations

from gpipe_tf.layers import base_layer
from gpipe_tf.layers import precision
from gpipe_tf.layers import tied_weights
from gpipe_tf.layers.base_layer import BaseLayer, LayerMeta


def ExpandRepeats(sub: list, repeat: int) -> list:
    """The layer params of `sub` repeated `repeat` times (copies, so each repeat has its own
    variables), named `<name>_r<i>` when repeated."""
    if repeat < 1:
        raise ValueError(f'repeat must be >= 1, got {repeat}.')
    out = []
    for r in range(repeat):
        for i, p in enumerate(sub):
            p = p.Copy()
            name = p.name or f'{p.cls.__name__.lower()}_{i}'
            p.name = f'{name}_r{r}' if repeat > 1 else name
            out.append(p)
    names = [p.name for p in out]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f'Sub-layer names must be unique, got duplicates {duplicates}.')
    return out


def Apply(layers: list, theta, *inputs):
    """`layers` applied in order, each to the previous one's outputs (a tuple is spread over the
    next layer's arguments), each with `theta[<its name>]`; a single output is returned as is."""
    args = inputs
    for layer in layers:
        args = base_layer.AsArgs(layer.FProp(theta[layer.p.name], *args))
    return args[0] if len(args) == 1 else args


# FPropMeta is a pure function of a layer's Params (its name aside) and its input shapes, and a
# model's layers mostly repeat (the largest Transformer has 1663 equal layers): `Meta` computes
# each distinct (Params, shapes) once. Metas are treated as values: nothing changes one.
_METAS: dict = {}
_MAX_METAS = 4096


def Meta(p, *input_shapes) -> LayerMeta:
    """`p.cls.FPropMeta(p, *input_shapes)`, computed once per distinct Params and shapes."""
    text = ''.join(line for line in p.ToText().splitlines(keepends=True)
                   if not line.startswith('name : '))
    # A Params without a fprop_dtype computes in the one its enclosing FPropMeta passes down.
    inherited = None if p.fprop_dtype is not None else precision.InheritedFPropDtype()
    key = (p.cls, text, repr(input_shapes), repr(inherited))
    meta = _METAS.get(key)
    if meta is None:
        meta = p.cls.FPropMeta(p, *input_shapes)
        if len(_METAS) >= _MAX_METAS:
            _METAS.clear()
        _METAS[key] = meta
    return meta


def ChainMeta(layer_params: list, *input_shapes) -> tuple[LayerMeta, list[LayerMeta]]:
    """FPropMeta of layers applied in sequence: the total, and each layer's own."""
    metas = []
    args = input_shapes
    for p in layer_params:
        meta = Meta(p, *args)
        metas.append(meta)
        args = base_layer.AsArgs(meta.out_shapes)
    out = metas[-1].out_shapes if metas else (
        input_shapes[0] if len(input_shapes) == 1 else tuple(input_shapes))
    # TF frees an output that neither its layer's backward nor the next layer's reads (batch
    # norm's before a ReLU, a convolution's before average pooling) once the next layer has run.
    unread = sum(min(base_layer.ActivationBytes(m.out_shapes, p), m.activation_bytes)
                 for p, m, after in zip(layer_params, metas, metas[1:])
                 if not m.reads_output and not after.reads_input)
    total = LayerMeta(out, sum(m.flops for m in metas), sum(m.num_params for m in metas),
                      sum(m.activation_bytes for m in metas) - unread,
                      reads_input=metas[0].reads_input if metas else False,
                      reads_output=metas[-1].reads_output if metas else False,
                      sparse_params=sum(m.sparse_params for m in metas),
                      sparse_gradient_bytes=sum(m.sparse_gradient_bytes for m in metas),
                      tied_params=sum(m.tied_params for m in metas))
    return total, metas


def ChainPassed(layer_params: list) -> dict[int, int]:
    """`BaseLayer.PassedLeaves` of layers applied in sequence: the input leaves that every one
    of them gives on unread, each to the next one's."""
    passed = None
    for p in layer_params:
        step = p.cls.PassedLeaves(p)
        passed = dict(step) if passed is None else {
            i: step[o] for i, o in passed.items() if o in step}
    return passed or {}


class SequentialLayer(BaseLayer):
    """Applies `sub` layers in order, `repeat` times; each output feeds the next layer.

    A tuple output is spread over the next layer's arguments; anything else (a tensor, a
    NestedMap) is passed as its single argument.
    """

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('sub', [], 'List of layer Params applied in order.')
        p.Define('repeat', 1, 'How many times `sub` is repeated (each repeat has own weights).')
        p.Define('tied_weights', [], tied_weights.PARAM_HELP)
        return p

    def __init__(self, params):
        super().__init__(params)
        self._sequence = [self.CreateChild(sp.name, sp)
                          for sp in ExpandRepeats(self.p.sub, self.p.repeat)]
        tied_weights.Apply(self._sequence, self.p.tied_weights, self.path)

    @property
    def sequence(self) -> list:
        """The layers in the order they are applied."""
        return list(self._sequence)

    def FProp(self, theta, *inputs):
        return Apply(self._sequence, theta, *inputs)

    @classmethod
    def FPropMeta(cls, p, *input_shapes):
        return ChainMeta(ExpandRepeats(p.sub, p.repeat), *input_shapes)[0]
