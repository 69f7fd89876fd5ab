"""Build the sample Parquet shards that `python -m pipelines.generate` processes when run with
no arguments. Deterministic: rerunning it rewrites identical shards.

    python data/sample_shards/build_sample_shards.py [--prompts data/prompts]

Each shard mixes four domains (chat, math, code, summarisation) so that per-shard metrics are
comparable; prompts are the first turn of each source record, short ones first so that the
default job stays quick on a CPU. Sources and licences: NOTICE.md beside this script.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
DEFAULT_PROMPTS = HERE.parent / "prompts"

# file -> max characters of the first turn (keeps prefill cheap on CPU)
SOURCES = {
    "instructions.jsonl": 600,
    "gsm8k.jsonl": 600,
    "mbpp.jsonl": 400,
    "cnn_dailymail.jsonl": 2500,
}
NUM_SHARDS = 4
ROWS_PER_SOURCE_PER_SHARD = 2


def load_short_prompts(path: Path, max_chars: int, count: int) -> list[dict]:
    """The first `count` records (file order) whose first turn fits in `max_chars`."""
    rows: list[dict] = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            text = record["turns"][0]
            if len(text) <= max_chars:
                rows.append({"id": record["id"], "text": text, "domain": record["domain"], "source": record["source"]})
            if len(rows) == count:
                break
    if len(rows) < count:
        raise SystemExit(f"{path}: only {len(rows)} prompts under {max_chars} characters")
    return rows


def build_shards(prompts_dir: Path) -> list[list[dict]]:
    shards: list[list[dict]] = [[] for _ in range(NUM_SHARDS)]
    for name, max_chars in SOURCES.items():
        rows = load_short_prompts(prompts_dir / name, max_chars, NUM_SHARDS * ROWS_PER_SOURCE_PER_SHARD)
        for i, row in enumerate(rows):
            shards[i % NUM_SHARDS].append(row)
    return shards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS, help="folder of prompt .jsonl files")
    parser.add_argument("--out", type=Path, default=HERE, help="where to write samples-0000N.parquet")
    args = parser.parse_args()
    schema = pa.schema([("id", pa.string()), ("text", pa.string()), ("domain", pa.string()), ("source", pa.string())])
    for i, rows in enumerate(build_shards(args.prompts)):
        table = pa.Table.from_pylist(rows, schema=schema)
        path = args.out / f"samples-{i:05d}.parquet"
        pq.write_table(table, path)
        print(f"{path}: {table.num_rows} rows")


if __name__ == "__main__":
    main()
