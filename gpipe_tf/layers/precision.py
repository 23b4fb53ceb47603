"""Mixed precision: the dtype a layer computes in (`fprop_dtype`) and the casts around it.

A layer's variables are in its `dtype` (float32, the master weights); with `fprop_dtype` set
(tf.bfloat16 or tf.float16) it computes in that: `BaseLayer` casts its weights as FProp (and
its other `THETA_METHODS`) reads them, and its float inputs, so every activation is in
fprop_dtype. The cast is inside the layer's FProp, so a gradient comes back through it in the
variables' dtype: a pipeline sums its micro-batches' weight gradients in float32. Children
inherit a parent's fprop_dtype unless they set their own (`BaseLayer.CreateChild`, as Lingvo's
`CopyBaseParams`); `FPropMeta` follows the same rule (`MetaScope`), so the planner counts
activations at their real size.

What stays wide (`AtLeastFloat32`): the loss and its softmax, the task's metrics, batch norm's
statistics and layer norm's moments (computed in the variables' dtype).
"""

from __future__ import annotations

import contextlib
import threading

import tensorflow as tf

# The names the trainer's --fprop_dtype and the Keras policies give them.
FPROP_DTYPES = {'bfloat16': tf.bfloat16, 'float16': tf.float16, 'float32': tf.float32}

_STATE = threading.local()


def _Inherited() -> list:
    if not hasattr(_STATE, 'fprop_dtypes'):
        _STATE.fprop_dtypes = []
    return _STATE.fprop_dtypes


def FPropDtype(p) -> tf.DType:
    """The dtype a layer of Params `p` computes in (Lingvo's `py_utils.FPropDtype`): its
    fprop_dtype; else, inside an enclosing layer's FPropMeta, the one that layer passes down
    (`MetaScope`); else its dtype."""
    if p.fprop_dtype is not None:
        return tf.as_dtype(p.fprop_dtype)
    inherited = _Inherited()
    if inherited and inherited[-1] is not None:
        return tf.as_dtype(inherited[-1])
    return tf.as_dtype(p.dtype)


def InheritedFPropDtype():
    """The fprop_dtype an enclosing layer's FPropMeta passes to children that set none, or
    None."""
    inherited = _Inherited()
    return inherited[-1] if inherited else None


@contextlib.contextmanager
def MetaScope(p):
    """The body runs as the FPropMeta of Params `p`: children Params it makes without a
    fprop_dtype of their own compute in p's (or in what p inherits), as CreateChild would
    build them."""
    inherited = _Inherited()
    inherited.append(p.fprop_dtype if p.fprop_dtype is not None else InheritedFPropDtype())
    try:
        yield
    finally:
        inherited.pop()


def IsFPropDtype(value) -> bool:
    """Whether `value` may be a fprop_dtype: None, or a floating point tf.DType."""
    return value is None or (isinstance(value, tf.DType) and value.is_floating)


def CastFloats(nest, dtype: tf.DType):
    """`nest` with its floating point tensors cast to `dtype`; other leaves (ids, labels, None)
    unchanged."""
    return tf.nest.map_structure(
        lambda x: tf.cast(x, dtype) if tf.is_tensor(x) and x.dtype.is_floating else x, nest)


def AtLeastFloat32Dtype(dtype: tf.DType) -> tf.DType:
    """float32 for a floating point dtype narrower than it (bfloat16, float16); else `dtype`."""
    dtype = tf.as_dtype(dtype)
    return tf.float32 if dtype.is_floating and dtype.size < 4 else dtype


def AtLeastFloat32(nest):
    """`nest` with its floating point tensors narrower than float32 (bfloat16, float16) cast to
    float32: what a loss, a softmax and metrics are computed in."""
    return tf.nest.map_structure(
        lambda x: tf.cast(x, AtLeastFloat32Dtype(x.dtype)) if tf.is_tensor(x) else x, nest)
