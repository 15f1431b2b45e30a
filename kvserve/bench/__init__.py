"""Benchmarks that print measured figures beside a peer or the memory roofline of the same run."""
