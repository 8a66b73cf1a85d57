"""Benchmarks for the numbers of DESIGN section 6, each against a baseline measured in the same run."""
