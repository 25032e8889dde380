"""What every ``spikeops`` command shares: its exit statuses."""

from __future__ import annotations

__all__ = ["EXIT_OK", "EXIT_NOTHING", "EXIT_USAGE", "EXIT_INTERNAL"]

EXIT_OK = 0
#: ``collect`` reached no node at all; ``verify`` found a bad file; ``pick`` found nothing.
EXIT_NOTHING = 1
EXIT_USAGE = 2
EXIT_INTERNAL = 70
