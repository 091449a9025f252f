"""``python -m polar_reference [OPTIONS]``: the ``polar-reference`` command."""

from .cli import policy_server

if __name__ == "__main__":
    policy_server()
