"""The Transformer language model and multilingual translation model: their embedding, hand-off
and softmax layers and the networks assembled from them (`network`)."""
