"""A tiny module with one bug: the task's test finds it."""


def add(a: int, b: int) -> int:
    return a - b
