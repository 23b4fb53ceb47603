"""The context a forward pass runs in: training or not, step, which examples, update collector.

Layers read it instead of taking extra arguments, so `FProp(theta, *inputs)` stays the one
signature. PipeliningLayer sets the index of a micro-batch's first example in the mini-batch (a
tensor, so one traced cell serves all micro-batches), by which randomness is drawn per example
(`example_random`), and collects the layers' training updates; a trainer sets the step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any


@dataclasses.dataclass(frozen=True)
class FPropContext:
    """Attributes:
      training: whether this is a training pass (batch statistics, dropout on).
      step: the training step (int or scalar int tensor); seeds randomness.
      first_example: the index in the mini-batch of the first example being computed (int or
        scalar int tensor): 0 for a whole batch, m * n for micro-batch m of n examples.
      batch_dim: the inputs' batch dimension, along which `first_example` counts.
      update_collector: where layers' training updates go; None applies them at once.
      seed_observer: None, or a function called (without arguments) whenever a layer draws its
        seed (`BaseLayer.StepSeed`): a traced cell learns that its trace holds its own layers'
        seeds, and so cannot serve other cells of its structure.
      loss_scale: None, or the scalar float32 tensor the training loss is multiplied by before
        its gradients (dynamic loss scaling, float16): a pipeline that computes its loss
        inside (`FPropLoss`) scales the gradient entering its backward by it.
    """
    training: bool = True
    step: Any = 0
    first_example: Any = 0
    batch_dim: int = 0
    update_collector: Any = None
    seed_observer: Any = None
    loss_scale: Any = None


_STATE = threading.local()


def _Stack() -> list:
    if not hasattr(_STATE, 'stack'):
        _STATE.stack = [FPropContext()]
    return _STATE.stack


def Current() -> FPropContext:
    """The innermost active context (the default one is training, step 0, first example 0)."""
    return _Stack()[-1]


@contextlib.contextmanager
def Scope(**changes):
    """Runs the body with the current context's fields replaced by `changes`."""
    stack = _Stack()
    stack.append(dataclasses.replace(stack[-1], **changes))
    try:
        yield stack[-1]
    finally:
        stack.pop()


def Inference():
    """The scope of an inference pass (serving, decoding, predicting): training off, so batch
    norm normalises with its moving statistics and dropout and drop-path are off, and a layer
    that reports a training update anyway is an error (`NoUpdates`) instead of assigning its
    state. Every inference entry point runs its forward in it: an example's answer then does
    not depend on the other examples of its request, and serving changes no variable."""
    return Scope(training=False, update_collector=NoUpdates())


class UpdateCollector:
    """Gathers the statistics layers report through `BaseLayer.AddUpdate`, keyed by layer."""

    def __init__(self):
        self._layers = {}
        self._stats = {}

    def Add(self, layer, stats) -> None:
        if layer.path in self._stats:
            raise ValueError(f'Layer {layer.path} reported updates twice in one forward pass.')
        self._layers[layer.path] = layer
        self._stats[layer.path] = stats

    def Items(self) -> list[tuple[Any, Any]]:
        """(layer, stats) pairs in the order layers reported them."""
        return [(self._layers[k], self._stats[k]) for k in self._stats]

    def __len__(self) -> int:
        return len(self._stats)


class NoUpdates:
    """The collector of an inference pass: reporting a training update there is a bug."""

    def Add(self, layer, stats) -> None:
        del stats
        raise ValueError(f'Layer {layer.path} reported a training update in an inference pass; '
                         'inference changes no variable.')

    def Items(self) -> list:
        return []

    def __len__(self) -> int:
        return 0
