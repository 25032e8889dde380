"""spikeops: the incident pipeline for loss spikes and NaNs in large GPU training runs.

The core (this package) parses evidence, diagnoses, verifies checkpoints, talks SSH and
schedulers, and formats messages. It never imports Prefect: the ``tasks`` and ``flows``
packages wrap it for orchestration.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
