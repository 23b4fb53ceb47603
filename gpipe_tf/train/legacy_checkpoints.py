"""Reading checkpoints whose pipeline layers were keyed by cell.

Until layers became the pipeline's own children, a PipeliningLayer's layers sat under a layer per
cell: the checkpoint's object graph reaches layer `dense_3` as
`model/_layer_children/cell_1/_layer_children/dense_3`, where today it is
`model/_layer_children/dense_3`. Such a checkpoint is read through a converted copy whose object
graph reaches every layer by name, whatever cell held it: the values are the same tensors under
the same keys, only the object graph's edges change, so the copy restores at any K (optimizer
slots included, since they hang off their variables' nodes).

The copy is written once, next to the checkpoint (`<dir>/converted/ckpt-N`), and reused; the
original is never changed. Checkpoints saved after the restore are keyed by layer.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import tempfile

import tensorflow as tf
from absl import logging
from tensorflow.core.protobuf import trackable_object_graph_pb2

CONVERTED_DIR = 'converted'
_OBJECT_GRAPH_KEY = '_CHECKPOINTABLE_OBJECT_GRAPH'
_CELL = re.compile(r'^cell_(\d+)$')


def _Child(node, name: str) -> int | None:
    for child in node.children:
        if child.local_name == name:
            return child.node_id
    return None


def _CellKeyedPipelines(graph) -> list[tuple[int, int, list[int]]]:
    """(pipeline node, its `_layer_children` node, its cell nodes in order) of every pipeline
    of the old layout: a `_layer_children` dict with edges `cell_0`.. `cell_<K-1>` to the very
    nodes its `_cells` list holds (an old PipeliningLayer's signature, which a layer that is
    merely named `cell_<k>` does not have)."""
    found = []
    for index, node in enumerate(graph.nodes):
        children, cells = _Child(node, '_layer_children'), _Child(node, '_cells')
        if children is None or cells is None:
            continue
        by_name = {c.local_name: c.node_id for c in graph.nodes[children].children
                   if _CELL.match(c.local_name)}
        listed = [c.node_id for c in sorted(graph.nodes[cells].children,
                                            key=lambda c: int(c.local_name))]
        if listed and [by_name.get(f'cell_{k}') for k in range(len(listed))] == listed:
            found.append((index, children, listed))
    return found


def _ObjectGraph(reader):
    graph = trackable_object_graph_pb2.TrackableObjectGraph()
    graph.ParseFromString(reader.get_tensor(_OBJECT_GRAPH_KEY))
    return graph


def IsCellKeyed(prefix: str) -> bool:
    """Whether the checkpoint at `prefix` keys a pipeline's layers by cell."""
    reader = tf.train.load_checkpoint(prefix)
    if not reader.has_tensor(_OBJECT_GRAPH_KEY):
        return False
    return bool(_CellKeyedPipelines(_ObjectGraph(reader)))


def Rewrite(graph) -> int:
    """Re-links every old-layout pipeline of object graph `graph` (in place): each layer of a
    cell becomes an edge of the pipeline's `_layer_children`, the cells and their list are
    unlinked. Returns the number of pipelines rewritten."""
    pipelines = _CellKeyedPipelines(graph)
    for index, children, cells in pipelines:
        layers = []
        for cell in cells:
            cell_children = _Child(graph.nodes[cell], '_layer_children')
            layers += [(c.local_name, c.node_id) for c in graph.nodes[cell_children].children]
        kept = [c for c in graph.nodes[children].children if not _CELL.match(c.local_name)]
        del graph.nodes[children].children[:]
        graph.nodes[children].children.extend(kept)
        for name, node_id in layers:
            graph.nodes[children].children.add(node_id=node_id, local_name=name)
        kept = [c for c in graph.nodes[index].children if c.local_name != '_cells']
        del graph.nodes[index].children[:]
        graph.nodes[index].children.extend(kept)
    return len(pipelines)


def ConvertedPath(prefix: str, directory: str | None = None) -> str:
    """Where the converted copy of `prefix` goes: `directory`, by default `converted/` beside
    the checkpoint."""
    checkpoint_dir, name = os.path.split(prefix)
    return os.path.join(directory or os.path.join(checkpoint_dir, CONVERTED_DIR), name)


def Convert(prefix: str, directory: str | None = None) -> str:
    """Writes the converted copy of old-layout checkpoint `prefix` into `directory` (default:
    `ConvertedPath`'s), unless a complete one is there; returns its prefix. Every tensor is
    copied under its own key."""
    converted = ConvertedPath(prefix, directory)
    if tf.io.gfile.exists(converted + '.index'):
        return converted
    reader = tf.train.load_checkpoint(prefix)
    graph = _ObjectGraph(reader)
    Rewrite(graph)
    names = sorted(reader.get_variable_to_shape_map())
    directory = os.path.dirname(converted)
    tf.io.gfile.makedirs(directory)
    # Written under a temporary name, then moved into place, index last: a reader that finds
    # the index finds a complete copy.
    temp = os.path.join(directory, f'.converting-{os.getpid()}-{os.path.basename(converted)}')
    try:
        with tf.Graph().as_default(), tf.compat.v1.Session() as session:
            dtypes = reader.get_variable_to_dtype_map()
            holders = [tf.compat.v1.placeholder(dtypes[n]) for n in names]
            save = tf.raw_ops.SaveV2(prefix=temp, tensor_names=names,
                                     shape_and_slices=[''] * len(names), tensors=holders)
            session.run(save, {h: graph.SerializeToString() if n == _OBJECT_GRAPH_KEY else
                               reader.get_tensor(n) for h, n in zip(holders, names)})
        written = sorted((n for n in tf.io.gfile.listdir(directory)
                          if n.startswith(os.path.basename(temp) + '.')),
                         key=lambda n: n.endswith('.index'))
        for name in written:
            tf.io.gfile.rename(os.path.join(directory, name),
                               converted + name[len(os.path.basename(temp)):], overwrite=True)
    finally:
        for leftover in tf.io.gfile.glob(temp + '*'):
            tf.io.gfile.remove(leftover)
    return converted


def Readable(prefix: str) -> str:
    """The prefix to restore `prefix` from: itself, or for an old-layout checkpoint its
    converted copy (made now if needed), with a warning."""
    if not IsCellKeyed(prefix):
        return prefix
    try:
        converted = Convert(prefix)
    except (tf.errors.OpError, OSError) as error:
        # A logdir this process may not write (eval of a read-only bucket, say): a private
        # copy, kept until the process ends (optimizer slots restore when first used).
        directory = tempfile.mkdtemp(prefix='gpipe_converted_')
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
        logging.warning('Cannot write the converted copy beside %s (%s); writing it to %s.',
                        prefix, error, directory)
        converted = Convert(prefix, directory)
    logging.warning('Checkpoint %s keys the pipeline\'s layers by cell (written before '
                    'checkpoints became independent of the partition); it is read through a '
                    'converted copy, %s. Checkpoints saved from now on restore at any K.',
                    prefix, converted)
    return converted
