"""``python -m spikeops`` is the ``spikeops`` command."""

import sys

from spikeops.cli import main

sys.exit(main())
