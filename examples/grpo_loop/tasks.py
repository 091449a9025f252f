"""The loop's tasks: prompts for a two-turn exchange and the reward of its last reply.

Two tasks, both scored on the second assistant turn:

- ``word``: the reply uses the given word. Measured base rate of SmolLM2-135M-Instruct about 2/16;
  a policy trained on it alone learns to repeat the word, so it is not a task on its own.
- ``word15`` (the default): the reply uses the word *and* has at most 15 words. Repeating the
  word does not win it; saying little without the word does not either.

Prompts come from a seeded generator: the training prompts of iteration k from (seed, k), the
held-out set from a fixed seed and from words the training prompts never use.
"""

from __future__ import annotations

import random
import re

TOPICS = [
    "the sea", "a city at night", "winter", "a small village", "the desert", "a library",
    "a train journey", "the mountains", "a market", "a thunderstorm", "a garden", "the moon",
    "an old house", "a forest", "a river", "breakfast", "a football match", "a museum",
    "the morning", "a bakery",
]  # fmt: skip
TRAIN_WORDS = [
    "blue", "quiet", "bread", "music", "stone", "light", "paper", "green", "window", "happy",
    "water", "cold", "bright", "friend", "road", "silver", "warm", "clock", "river", "gold",
    "sugar", "wind", "little", "bird",
]  # fmt: skip
HELD_OUT_WORDS = ["orange", "soft", "candle", "glass", "purple", "garden", "honey", "smile"]
HELD_OUT_SEED = 1234
MAX_WORDS = 15


def first_turn(topic: str) -> str:
    return f"Tell me about {topic} in one sentence."


def second_turn(word: str) -> str:
    return f'Now say it again in at most {MAX_WORDS} words, and use the word "{word}".'


def training_prompts(seed: int, iteration: int, n: int) -> list[tuple[str, str]]:
    """(topic, word) pairs for one iteration's groups."""
    rng = random.Random(f"{seed}:{iteration}")
    return [(rng.choice(TOPICS), rng.choice(TRAIN_WORDS)) for _ in range(n)]


def held_out_prompts(n: int) -> list[tuple[str, str]]:
    """The fixed held-out set: the same for every seed and iteration; words never trained on."""
    rng = random.Random(HELD_OUT_SEED)
    return [(rng.choice(TOPICS), HELD_OUT_WORDS[i % len(HELD_OUT_WORDS)]) for i in range(n)]


def words(text: str) -> list[str]:
    return re.findall(r"[A-Za-z0-9']+", text)


def reward(task: str, word: str, reply: str) -> float:
    """1.0 when the last reply does what was asked, else 0.0."""
    ws = [w.lower() for w in words(reply)]
    has = word.lower() in ws
    if task == "word":
        return float(has)
    if task == "word15":
        return float(has and 0 < len(ws) <= MAX_WORDS)
    raise ValueError(f"unknown task {task!r} (word, word15)")


TASKS = ("word15", "word")
