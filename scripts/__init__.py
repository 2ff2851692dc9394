"""Top-down recipes and benchmarks; run as `python -m scripts.<name>`."""
