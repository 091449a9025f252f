"""Tokens: the policy tokenizer (HF dir, tiktoken, GGUF), the conversation a server renders,
prompt counts, retokenizing, drift, and the fidelity checks of every call."""
