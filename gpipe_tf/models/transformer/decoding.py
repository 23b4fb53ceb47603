"""Incremental decoding of the encoder-decoder Transformer: O(T) work per sentence.

Greedy decoding by the full forward re-runs the whole model for every target position (O(T^2)
work; `SequenceTask.Decode`'s old way). Here the source is encoded once, and each decoder layer
keeps the keys and values of the positions already decoded (`TransformerLayer.ExtendStep`), so
each new token costs one position's work: the target token's embedding, one query through each
decoder layer, one row of logits. Each layer runs on its own cell's device.

Pipelined: a batch is decoded as M micro-batches of whole examples (the pipeline's M, at most
one per example; one on a single device), each with its own caches. Within a position, cell k
extends micro-batch m while cell k + 1 extends micro-batch m - 1, as the forward-only schedule
runs them: the micro-batches' computations are independent, so TensorFlow's executor overlaps
them across the cells' devices. The source is encoded the same way.

What a step computes equals the full forward's value at that position (the decoder is causal):
`tests/test_decoding.py` checks the tokens against the full forward's greedy decoding.
"""

from __future__ import annotations

import tensorflow as tf

from gpipe_tf.layers import attention
from gpipe_tf.layers import fprop_context
from gpipe_tf.models.transformer import network
from gpipe_tf.nested_map import NestedMap


class IncrementalDecoder:
    """Encodes a source batch once, then decodes its targets one position at a time.

    Args:
      model: the translation PipeliningLayer (`network.MtLayers`: embedding, encoder layers,
        hand_off, decoder layers, softmax).
      num_micro_batches: M for `Greedy` and `Beam` (at most one per example); None: the
        model's M, or 1 where all its cells share one device.

    Raises:
      ValueError: for a model of other layers (a language model, say).
    """

    def __init__(self, model, num_micro_batches: int | None = None):
        self._model = model
        if num_micro_batches is None:
            num_micro_batches = (1 if len(set(model.devices)) == 1
                                 else model.p.num_micro_batches or 1)
        if num_micro_batches < 1:
            raise ValueError(f'num_micro_batches must be >= 1, got {num_micro_batches}.')
        self._num_micro_batches = num_micro_batches
        layers = model.Layers()
        names = [layer.p.name for layer in layers]
        first = layers[0].p
        if 'hand_off' not in names or not ('translation' in first and first.translation):
            raise ValueError(f'{model.path}: incremental decoding needs an encoder-decoder '
                             f'Transformer (embedding, encoders, hand_off, decoders, softmax); '
                             f'got layers {names}.')
        hand_off = names.index('hand_off')
        self._embedding = layers[0]
        self._encoder = layers[1:hand_off + 1]  # With the hand-off (the encoder's final LN).
        self._decoder = layers[hand_off + 1:-1]
        self._softmax = layers[-1]
        for layer in self._decoder:
            if not isinstance(layer, attention.TransformerLayer):
                raise ValueError(f'{model.path}: decoder layer {layer.p.name} is a '
                                 f'{type(layer).__name__}, not a TransformerLayer.')
        self._device = {}
        for cell_params, device in zip(model.plan.cells, model.devices):
            for layer_params in cell_params:
                self._device[layer_params.name] = device
        for layer in layers:
            self._device.setdefault(layer.p.name, model.devices[0])  # before_tpl layers.

    def _On(self, layer):
        return tf.device(self._device[layer.p.name])

    def Encode(self, theta, src_ids, src_paddings) -> NestedMap:
        """The encoder's output for a source batch: NestedMap(encoder_vec [B, S, D],
        encoder_paddings [B, S])."""
        zeros = tf.zeros_like(src_ids)
        inputs = NestedMap(src_ids=src_ids, src_paddings=src_paddings, tgt_ids=zeros,
                           tgt_paddings=tf.zeros_like(src_paddings), tgt_labels=zeros,
                           tgt_weights=tf.zeros_like(src_paddings))
        with fprop_context.Inference():
            with self._On(self._embedding):
                x = self._embedding.FProp(theta[self._embedding.p.name], inputs)
            for layer in self._encoder:
                with self._On(layer):
                    x = layer.FProp(theta[layer.p.name], x)
        return NestedMap(encoder_vec=x.encoder_vec, encoder_paddings=x.encoder_paddings)

    def InitialCaches(self, theta, encoded: NestedMap, length: int) -> list:
        """Per decoder layer, its state before position 0."""
        batch = encoded.encoder_vec.shape[0]
        caches = []
        for layer in self._decoder:
            with self._On(layer):
                caches.append(layer.DecodeCache(theta[layer.p.name], batch, length,
                                                encoded.encoder_vec))
        return caches

    def _EmbedTarget(self, theta, ids, t, length: int):
        """Position t's target embedding [B, 1, D] for `ids` [B], as the embedding layer's
        FProp gives it at t."""
        layer = self._embedding
        p, theta = layer.p, theta[layer.p.name]
        vec = layer.token_emb.FProp(NestedMap(emb=theta.token_emb.emb), ids[:, tf.newaxis])
        if p.position_embedding == 'learned':
            position = layer.position_emb.FProp(NestedMap(emb=theta.position_emb.emb),
                                                tf.reshape(t, [1]))
        else:
            # As the embedding layer's FProp: computed in dtype, then cast.
            position = tf.cast(network.SinusoidalPositions(length, p.model_dim, p.dtype)[t][None],
                               vec.dtype)
        return vec + position[tf.newaxis]

    def Step(self, theta, ids, t, caches: list, encoded: NestedMap, length: int):
        """Logits [B, V] of position t from its input tokens `ids` [B] (the previous position's
        output, or <s>), and the caches with position t."""
        with fprop_context.Inference():
            with self._On(self._embedding):
                x = self._EmbedTarget(theta, ids, t, length)
            new_caches = []
            for layer, cache in zip(self._decoder, caches):
                with self._On(layer):
                    x, cache = layer.ExtendStep(theta[layer.p.name], x, cache, t,
                                                encoded.encoder_paddings)
                new_caches.append(cache)
            softmax = self._softmax
            with self._On(softmax):
                theta_s = theta[softmax.p.name]
                features = softmax.final_ln.FProp(theta_s.final_ln, x)
                zeros = tf.zeros(tf.shape(ids)[:1], tf.int32)[:, tf.newaxis]
                out = softmax.softmax.FProp(theta_s.softmax, NestedMap(
                    features=features, labels=zeros, weights=tf.ones_like(features[..., 0])))
        return out.logits[:, 0], new_caches

    # ---- micro-batches ------------------------------------------------------------------
    def _Parts(self, batch: int) -> list:
        """(begin, end) of each micro-batch's examples: M (at most `batch`) near-equal parts."""
        m = min(self._num_micro_batches, batch)
        bounds = [i * batch // m for i in range(m + 1)]
        return list(zip(bounds[:-1], bounds[1:]))

    def _Start(self, theta, src_ids, src_paddings, parts, length: int, repeat: int = 1):
        """Per micro-batch, its encoded source (each example's `repeat` times) and its
        decoder caches before position 0."""
        encoded, caches = [], []
        for begin, end in parts:
            part = self.Encode(theta, src_ids[begin:end], src_paddings[begin:end])
            if repeat > 1:
                part = tf.nest.map_structure(lambda x: tf.repeat(x, repeat, axis=0), part)
            encoded.append(part)
            caches.append(self.InitialCaches(theta, part, length))
        return encoded, caches

    def _Steps(self, theta, ids, t, caches: list, encoded: list, length: int, parts):
        """`Step` on each micro-batch (rows `parts` of `ids`): the logits [B, V] of all, and
        each micro-batch's caches."""
        logits, new_caches = [], []
        for (begin, end), part_caches, part_encoded in zip(parts, caches, encoded):
            part_logits, part_caches = self.Step(theta, ids[begin:end], t, part_caches,
                                                 part_encoded, length)
            logits.append(part_logits)
            new_caches.append(part_caches)
        with self._On(self._softmax):
            return (logits[0] if len(logits) == 1 else tf.concat(logits, 0)), new_caches

    def _Reorder(self, caches: list, parent, k: int) -> list:
        """A micro-batch's caches (per decoder layer, on its device) following its examples'
        surviving hypotheses: `parent` [examples, k], each one's rows' parent hypotheses."""
        rows = tf.reshape(parent + tf.range(tf.shape(parent)[0])[:, tf.newaxis] * k, [-1])
        reordered = []
        for layer, cache in zip(self._decoder, caches):
            with self._On(layer):
                reordered.append(tf.nest.map_structure(lambda c: tf.gather(c, rows), cache))
        return reordered

    def Greedy(self, theta, src_ids, src_paddings, bos_id: int, eos_id: int,
               max_steps: int | None = None):
        """Greedy target ids [B, T] (T the source length): each row the arg-max tokens up to and
        including the first `eos_id`, then 0; what `SequenceTask.Decode` gives."""
        batch, length = src_ids.shape
        steps = min(max_steps or length, length)
        parts = self._Parts(batch)
        encoded, caches = self._Start(theta, src_ids, src_paddings, parts, length)

        def Body(t, ids, decoded, done, caches):
            logits, caches = self._Steps(theta, ids, t, caches, encoded, length, parts)
            token = tf.argmax(logits, axis=-1, output_type=tf.int32)
            token = tf.where(done, 0, token)
            decoded += tf.one_hot(t, length, dtype=tf.int32)[tf.newaxis] * token[:, tf.newaxis]
            return t + 1, token, decoded, done | tf.equal(token, eos_id), caches

        def Continue(t, unused_ids, unused_decoded, done, unused_caches):
            return tf.logical_and(t < steps, tf.logical_not(tf.reduce_all(done)))

        _, _, decoded, _, _ = tf.while_loop(
            Continue, Body, (tf.constant(0), tf.fill([batch], tf.cast(bos_id, tf.int32)),
                             tf.zeros([batch, length], tf.int32), tf.zeros([batch], tf.bool),
                             caches))
        return decoded

    def Beam(self, theta, src_ids, src_paddings, bos_id: int, eos_id: int, beam_size: int,
             length_alpha: float = 0.6, max_steps: int | None = None):
        """Beam search (Lingvo's and GNMT's recipe) on the incremental decoder.

        Each example keeps `beam_size` hypotheses. At each position every live hypothesis is
        extended by every token, a finished one (it produced `eos_id`) only by staying as it is;
        the `beam_size` best candidates by length-normalised log-probability,
        log P / ((5 + length) / 6) ** length_alpha (length counting </s>), are kept. Decoding
        stops when every hypothesis has finished or at the last position.

        Returns:
          (ids [B, T] int32: the best hypothesis per example, laid out as `Greedy`'s (tokens up
          to and including </s>, then 0); scores [B] float32: its log-probability). With
          beam_size 1 the ids are `Greedy`'s.
        """
        if beam_size < 1:
            raise ValueError(f'beam_size must be >= 1, got {beam_size}.')
        batch, length = src_ids.shape
        steps = min(max_steps or length, length)
        k = beam_size
        parts = self._Parts(batch)  # Of examples; micro-batch m has their k rows each.
        # Every example's encoder output once per hypothesis: rows b * k .. b * k + k - 1.
        encoded, caches = self._Start(theta, src_ids, src_paddings, parts, length, repeat=k)
        row_parts = [(begin * k, end * k) for begin, end in parts]
        neg_inf = tf.constant(-1e9, tf.float32)
        # Only hypothesis 0 is live at first: the others would repeat it.
        scores = tf.tile(tf.concat([[0.0], tf.fill([k - 1], neg_inf)], 0)[tf.newaxis],
                         [batch, 1])

        def Penalty(lengths):
            return ((5.0 + tf.cast(lengths, tf.float32)) / 6.0) ** length_alpha

        def Body(t, ids, scores, lengths, finished, sequences, caches):
            logits, caches = self._Steps(theta, ids, t, caches, encoded, length, row_parts)
            log_probs = tf.reshape(tf.nn.log_softmax(tf.cast(logits, tf.float32)),
                                   [batch, k, -1])
            vocab = tf.shape(log_probs)[-1]
            # A finished hypothesis continues only as itself (token 0, no cost, no length).
            stay = tf.concat([tf.zeros([batch, k, 1]),
                              tf.fill([batch, k, vocab - 1], neg_inf)], axis=-1)
            log_probs = tf.where(finished[..., tf.newaxis], stay, log_probs)
            totals = scores[..., tf.newaxis] + log_probs  # [B, k, V]
            new_lengths = lengths[..., tf.newaxis] + tf.cast(
                tf.logical_not(finished), tf.int32)[..., tf.newaxis]
            ranked = totals / Penalty(new_lengths)
            _, top = tf.math.top_k(tf.reshape(ranked, [batch, -1]), k)  # [B, k]
            parent, token = top // vocab, tf.cast(top % vocab, tf.int32)
            caches = [self._Reorder(part, parent[begin:end], k)
                      for (begin, end), part in zip(parts, caches)]
            was_finished = tf.gather(finished, parent, batch_dims=1)
            sequences = tf.gather(sequences, parent, batch_dims=1)
            sequences += (tf.one_hot(t, length, dtype=tf.int32)[tf.newaxis, tf.newaxis] *
                          token[..., tf.newaxis])
            scores = tf.gather(tf.reshape(totals, [batch, -1]), top, batch_dims=1)
            lengths = tf.gather(tf.reshape(tf.broadcast_to(new_lengths, totals.shape),
                                           [batch, -1]), top, batch_dims=1)
            finished = was_finished | tf.equal(token, eos_id)
            return (t + 1, tf.reshape(token, [-1]), scores, lengths, finished, sequences,
                    caches)

        def Continue(t, unused_ids, unused_scores, unused_lengths, finished, *unused):
            return tf.logical_and(t < steps, tf.logical_not(tf.reduce_all(finished)))

        _, _, scores, lengths, _, sequences, _ = tf.while_loop(
            Continue, Body,
            (tf.constant(0), tf.fill([batch * k], tf.cast(bos_id, tf.int32)), scores,
             tf.zeros([batch, k], tf.int32), tf.zeros([batch, k], tf.bool),
             tf.zeros([batch, k, length], tf.int32), caches))
        best = tf.argmax(scores / Penalty(lengths), axis=-1, output_type=tf.int32)
        return (tf.gather(sequences, best, batch_dims=1),
                tf.gather(scores, best, batch_dims=1))
