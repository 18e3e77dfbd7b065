"""One module per parallel dimension; each ``apply`` does nothing at degree 1."""
