"""``spikeops demo``: the whole pipeline on one machine (a local cluster of sshd nodes, the
real Slurm when installed, a job replaying a simulated divergence, the watcher and the
incident flow on an ephemeral Prefect server). A driver, not a flow: it lives beside the
flows it runs, so ``flows/`` never depends on the simulator."""

from spikeops.demo.run import SCENARIOS, DemoOptions, DemoResult, default_seed, run_demo, stop_demo

__all__ = ["SCENARIOS", "DemoOptions", "DemoResult", "default_seed", "run_demo", "stop_demo"]
