"""AmoebaNet-D: the genotype's operations (`ops`), its cells, stem and heads, and the network
assembled as a pipeline (`network`)."""
