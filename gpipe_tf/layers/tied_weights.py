"""Tied weights: one variable that two layers read (GPT-2's token embedding is also its logits'
projection), given to a parent layer (a SequentialLayer, a PipeliningLayer) as pairs of paths.

A tie `['softmax.softmax.w', 'embedding.token_emb.emb']` says: the variable at the second path
(created by its layer, on that layer's device) is also the variable at the first path. The
consumer creates no variable there (a Param of its own tells it, e.g.
`SoftmaxCrossEntropyLayer.tied_weight`); when the parent has built its children, the consumer
is given the producer's variable (`BaseLayer.TieVariable`), so its vars, its theta and whatever
reads them (a cell's traced functions, the un-partitioned layers) see one variable at both
paths. In one TensorFlow graph a tied weight needs no copy: the consumer reads it where it
lives (across cells, one transfer between their devices), and its gradient is the sum over
its reads that differentiation adds up, over layers, cells, micro-batches and replicas alike.
Its name, seed and checkpoint key are the producer's, so nothing about it depends on the
partition.

Paths are dotted: a layer's name, its children's names, the variable's name.
"""

from __future__ import annotations

from gpipe_tf import errors

PARAM_HELP = ('Tied weights: pairs [consumer path, producer path] of dotted paths (a layer, its '
              'children, a variable: ["softmax.softmax.w", "embedding.token_emb.emb"]): the '
              'consumer, which creates no variable there, reads the producer\'s variable; its '
              'gradient is the sum over both reads (layers/tied_weights.py).')


def _Layer(layers: dict, path: list, tie, where: str):
    """The layer at `path` (names) from `layers` (by name), or a ConfigError naming the tie."""
    node = layers.get(path[0])
    for name in path[1:]:
        children = node.children if node is not None else {}
        node = children.get(name) if hasattr(children, 'get') else None
    if node is None:
        raise errors.ConfigError(
            f'{where}: tied_weights {tie!r}: no layer {".".join(path)!r} (the layers are '
            f'{", ".join(sorted(layers))}).')
    return node


def Apply(layers: list, ties, where: str) -> None:
    """Gives each tie's consumer layer its producer's variable.

    Args:
      layers: the parent's children (built), each known by its name.
      ties: pairs [consumer path, producer path].
      where: the parent's path, for messages.

    Raises:
      errors.ConfigError: for a pair that is not two paths, a path that names no layer, a
        producer that is no variable, a consumer that has a variable of its own there.
    """
    by_name = {layer.p.name: layer for layer in layers}
    for tie in ties:
        if not isinstance(tie, (list, tuple)) or len(tie) != 2 or not all(
                isinstance(path, str) and '.' in path for path in tie):
            raise errors.ConfigError(
                f'{where}: each tied_weights entry must be a pair [consumer path, producer '
                f'path] like ["softmax.softmax.w", "embedding.token_emb.emb"]; got {tie!r}.')
        consumer, producer = (path.split('.') for path in tie)
        owner = _Layer(by_name, producer[:-1], tie, where)
        variable = owner.vars.get(producer[-1])
        if variable is None or isinstance(variable, dict):
            raise errors.ConfigError(
                f'{where}: tied_weights producer {tie[1]!r} is no variable; {owner.path} has '
                f'{", ".join(sorted(owner.vars)) or "none"}.')
        reader = _Layer(by_name, consumer[:-1], tie, where)
        if consumer[-1] in reader.vars:
            raise errors.ConfigError(
                f'{where}: tied_weights consumer {tie[0]!r} has a variable of its own; '
                'configure the layer to read a tied weight there (e.g. '
                'SoftmaxCrossEntropyLayer.tied_weight=True).')
        reader.TieVariable(consumer[-1], variable)
