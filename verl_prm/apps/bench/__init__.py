"""Benchmarks run by `verl-prm bench ...`: each prints ratios measured side by side in one process."""
