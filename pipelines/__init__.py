"""Thin command-line entry points (`python -m pipelines.<name>`); the work is in `transforms/` and `dspark/`."""
