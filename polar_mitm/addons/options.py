"""What the addons share: option errors (one line at start-up, OptionsError later), duration
options, and the `polar_mitm` logger."""

from __future__ import annotations

import logging

from mitmproxy import exceptions

log = logging.getLogger("polar_mitm")


class _StartupErrors:
    """Option errors: at start-up one logged line (mitmdump then exits 1, no traceback);
    later, when a user changes an option at runtime, mitmproxy's usual OptionsError."""

    running = False

    def fail(self, message: str) -> None:
        if self.running:
            raise exceptions.OptionsError(message)
        log.error(message)


_errors = _StartupErrors()


def _seconds(name: str, value: str, *, zero_ok: bool = True) -> float | None:
    """A duration option. They are str options: mitmproxy's `--set` cannot parse floats."""
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not (0 < seconds < float("inf") or zero_ok and seconds == 0):
        _errors.fail(f"{name}: {value!r} is not a number of seconds")
        return None
    return seconds
