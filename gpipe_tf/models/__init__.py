"""The registered model families, each its layers and its network assembly: AmoebaNet-D
(`amoebanet`) and the Transformer language and multilingual translation models (`transformer`)."""
