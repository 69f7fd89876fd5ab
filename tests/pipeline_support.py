"""Helpers for the pipeline tests (no tests here): a tiny random Llama target saved as a model
folder, shard writers and output readers.

The tiny target is a real model folder (safetensors + tokenizer), so the pipeline loads it
through `--target PATH` exactly as it loads a user's model, in every runner mode.
"""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

TINY_NAME = "tiny-llama-pipeline-test"  # fixed: the engine caches its cost table by model name
TINY_CONTEXT = 384
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def tokenizer_corpus() -> list[str]:
    """Text to train the tiny byte-level BPE on: the bundled sample prompts."""
    root = Path(__file__).resolve().parents[1] / "data" / "sample_shards"
    texts = []
    for path in sorted(root.glob("*.parquet")):
        texts += pq.read_table(path, columns=["text"]).column("text").to_pylist()
    return texts


def build_tiny_model_dir(path: Path, vocab_size: int = 512, seed: int = 0) -> Path:
    """A 2-layer random Llama with its own byte-level BPE tokenizer and chat template."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if (path / "done").is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(tokenizer_corpus(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=TINY_CONTEXT, tie_word_embeddings=True,
        initializer_range=0.2,  # the default 0.02 gives one answer ("\n\n...") to every prompt
        bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(path, safe_serialization=True)
    (path / "done").write_text("ok")
    return path


def write_shard(path: Path, rows: list[dict], schema: pa.Schema | None = None, row_group_size: int | None = None) -> Path:
    table = pa.Table.from_pylist(rows, schema=schema) if schema is not None else pa.Table.from_pylist(rows)
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def read_folder(out: Path, folder: str) -> list[dict]:
    rows: list[dict] = []
    for f in sorted(glob.glob(os.path.join(out, folder, "*.parquet"))):
        rows += pq.read_table(f).to_pylist()
    return rows


def folder_columns(out: Path, folder: str) -> list[list[str]]:
    return [pq.read_schema(f).names for f in sorted(glob.glob(os.path.join(out, folder, "*.parquet")))]


def read_summary(out: Path) -> dict:
    return json.loads((Path(out) / "run_summary.json").read_text())


class InjectedCrash(RuntimeError):
    """A job dying part-way (raised from the pipeline's per-shard progress hook)."""


class CrashAfterShards:
    """A progress hook (see transforms.outputs.ProgressHook) that lets `n` input files complete,
    then crashes the job when the next file's data files are in place but its completion marker
    is not: that file is left partial. Counts through token files in `folder`, so it works across
    worker processes; picklable (Beam ships it to the workers)."""

    def __init__(self, folder: Path, n: int):
        self.folder = str(folder)
        self.n = n

    def __call__(self, shard: str, stage: str) -> None:
        os.makedirs(self.folder, exist_ok=True)
        if stage == "complete":
            (Path(self.folder) / f"{len(os.listdir(self.folder))}-{os.getpid()}").write_text(shard)
        elif stage == "files_written" and len(os.listdir(self.folder)) >= self.n:
            raise InjectedCrash(f"injected crash after {self.n} complete shard(s), while writing {shard}")


class CrashAtFileWrite:
    """A progress hook that crashes the job as the (n+1)-th input file's data files are written,
    however many worker processes race: each write claims the next token `0`, `1`, ... in `folder`
    with an exclusive create, so exactly one write claims token `n`. At most n files can be
    complete at the crash (fewer when another worker dies first). Picklable."""

    def __init__(self, folder: Path, n: int):
        self.folder = str(folder)
        self.n = n

    def __call__(self, shard: str, stage: str) -> None:
        if stage != "files_written":
            return
        os.makedirs(self.folder, exist_ok=True)
        k = 0
        while True:
            try:
                fd = os.open(os.path.join(self.folder, str(k)), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                os.write(fd, str(os.getpid()).encode())  # which process wrote the file
                os.close(fd)
                break
            except FileExistsError:
                k += 1
        if k >= self.n:
            raise InjectedCrash(f"injected crash at input file write {k + 1} ({shard})")
