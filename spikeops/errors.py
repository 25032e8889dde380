"""The one exception hierarchy of spikeops.

    SpikeopsError                 every error spikeops raises on purpose
    ├── InputError                a file cannot be read at all (missing, binary, permissions)
    │   └── UnrecognisedInput     readable text, but no parser knows its kind
    ├── ParseError                a parser could not make sense of its input (keeps what it read)
    └── BundleError               an incident bundle cannot be read or written

Every message is one line meant for a person at 3 a.m.: the CLI prints ``str(err)`` and
exits 2, never a traceback. Foreign exceptions (OSError, json, XML) are mapped to these at
the edge with ``raise ... from exc``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SpikeopsError", "InputError", "UnrecognisedInput", "ParseError", "BundleError"]


class SpikeopsError(Exception):
    """Base class; ``str()`` is a single line suitable for a terminal or a Slack message."""


class InputError(SpikeopsError):
    """The input cannot be read at all."""


class UnrecognisedInput(InputError):
    """The input is text, but no registered parser recognises it."""


class ParseError(SpikeopsError):
    """A parser gave up; ``partial`` holds whatever it had read before failing."""

    def __init__(self, message: str, partial: Any = None) -> None:
        super().__init__(message)
        self.partial = partial


class BundleError(SpikeopsError):
    """An incident bundle is missing, malformed, or cannot be written."""
