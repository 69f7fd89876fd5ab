"""Thin entry points: `python -m pipelines.generate` (the Beam batch job) and its benchmark."""
