"""`AsciiEncoder` gives the Hugging Face tokenizer's own ids (polar_mitm/tokens/ascii_bpe.py)."""

from __future__ import annotations

import itertools
import json
import random

import pytest
from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers

from polar_mitm.assets import qwen3_tokenizer_dir
from polar_mitm.tokens.ascii_bpe import DOMAIN, AsciiEncoder
from polar_mitm.tokens.tokenizer import load_tokenizer

# A member of every class the pre-tokenizer pattern tells apart on DOMAIN: the letters of its
# contractions in both cases, another letter, a digit, each whitespace character, the apostrophe,
# other punctuation.
ALPHABET = [
    "s",
    "S",
    "t",
    "r",
    "e",
    "v",
    "m",
    "l",
    "L",
    "d",
    "x",
    "7",
    " ",
    "\t",
    "\n",
    "\r",
    "'",
    ".",
]


@pytest.fixture(scope="module")
def backend():
    return load_tokenizer(str(qwen3_tokenizer_dir())).impl.backend_tokenizer


@pytest.fixture(scope="module")
def enc(backend):
    e = AsciiEncoder.build(backend)
    assert e is not None
    return e


def test_split_is_the_tokenizers_on_every_short_string(backend, enc):
    """Every string up to length 4 over ALPHABET (length 5 for a smaller one): the pieces are
    the tokenizer's own pre-tokenizer's (its Split, before ByteLevel)."""
    spec = json.loads(backend.to_str())["pre_tokenizer"]["pretokenizers"][0]
    hf = pre_tokenizers.Split(Regex(spec["pattern"]["Regex"]), behavior="isolated")
    for alphabet, up_to in ((ALPHABET, 4), ([" ", "\n", "\r", "s", "'", "x", "7", "."], 5)):
        for n in range(1, up_to + 1):
            for chars in itertools.product(alphabet, repeat=n):
                text = "".join(chars)
                want = [p for p, _ in hf.pre_tokenize_str(text)]
                assert enc.pieces(text) == want, repr(text)
                assert enc._split.findall(text) == want, repr(text)


def test_encode_is_the_tokenizers_on_random_text(backend, enc):
    rng = random.Random(33)
    specials = ["<|im_start|>", "<|im_end|>", "<tool_response>", "</tool_response>", "<think>"]
    words = ["the", "  ", "\n", "\r\n", "\t", "'s", "'LL", "x1", "123456", "==", "  \n  ", "ab'c"]
    printable = [chr(c) for c in range(0x20, 0x7F)] + ["\t", "\n", "\r"]
    for _ in range(3000):
        parts = []
        for _ in range(rng.randint(1, 40)):
            r = rng.random()
            if r < 0.1:
                parts.append(rng.choice(specials))
            elif r < 0.5:
                parts.append(rng.choice(words))
            else:
                parts.append("".join(rng.choice(printable) for _ in range(rng.randint(1, 12))))
        text = "".join(parts)
        assert enc.encode(text) == backend.encode(text, add_special_tokens=False).ids, repr(text)
    # the cache starting over changes nothing
    enc._cache.clear()
    text = "def f(x):\n    return x + 1  # it's 'fine'\r\n\n\n   <|im_end|>"
    assert enc.encode(text) == backend.encode(text, add_special_tokens=False).ids


def test_outside_the_domain_is_left_to_the_tokenizer(enc):
    for text in ("caf\u00e9", "a\x0bb", "a\x0cb", "\x1b[31mred", "a\x1cb", "\x7f", "\u2028"):
        assert DOMAIN.search(text)
        assert enc.encode(text) is None


def test_policy_tokenizer_uses_it_with_the_same_ids():
    tok = load_tokenizer(str(qwen3_tokenizer_dir()))
    backend = tok.impl.backend_tokenizer
    for text in ("hello  world\n\n", "caf\u00e9 \x1b[0m", "<|im_start|>user\nx<|im_end|>\n" * 50):
        assert tok.encode(text) == backend.encode(text, add_special_tokens=False).ids


def test_build_refuses_another_pipeline(backend):
    other = Tokenizer.from_str(backend.to_str())
    other.normalizer = normalizers.NFKC()
    assert AsciiEncoder.build(other) is None
    other = Tokenizer.from_str(backend.to_str())
    other.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    assert AsciiEncoder.build(other) is None
