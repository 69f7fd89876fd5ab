"""Apache Beam building blocks for the DSpark batch job: reading and validating Parquet shards,
rendering prompts, calling the engine in batches, per-shard metrics and the output sinks.

No model math lives here (that is `dspark/`); `dspark/` never imports Beam.
"""
