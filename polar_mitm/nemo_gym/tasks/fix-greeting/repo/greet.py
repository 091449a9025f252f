"""A tiny module with one bug: the task's test finds it."""


def greet(name: str) -> str:
    return "Hello " + name
