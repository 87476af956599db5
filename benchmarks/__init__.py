"""Benchmarks: ``make bench`` prints JSON lines of ratios measured side by side in the same run."""
