# The two commands a newcomer needs: `make demo` and `make test`.
# Both work on a fresh machine with only Python 3.11 and root: they create .venv, install
# the project with its test extras, install missing Debian packages, then run.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# Debian packages the test suite needs (installed only when missing; see infra/apt-ensure.sh):
# sshd and Slurm for the clusters, ssh for the collector's OpenSSH client, busybox for the collector's runner under a minimal shell,
# Prometheus and Alertmanager for the monitoring chain, Chromium for the Prefect UI checks,
# PostgreSQL for the scale-out layout.
APT_PACKAGES := openssh-server openssh-client munge slurmctld slurmd slurm-client busybox prometheus prometheus-alertmanager chromium chromium-driver postgresql
# The demo's nodes are real sshd servers (Slurm is used when installed, never installed for it).
DEMO_APT_PACKAGES := openssh-server
# ... and the benchmarks' baselines (pdsh; clush comes with ClusterShell from PyPI; GNU time for
# peak memory), the monitoring chain of bench_monitoring.py, and bench_receiver.py's clients
# (wrk; gcc builds bench/storm.c).
BENCH_APT_PACKAGES := openssh-server pdsh time prometheus prometheus-alertmanager wrk gcc libc6-dev

.PHONY: demo test venv apt bench example clean help

help:
	@echo "make demo   - the whole pipeline on one machine: a local cluster, a diverging job, the flow (<1 min)"
	@echo "make test   - run the whole test suite (creates .venv, installs what it needs)"
	@echo "make bench  - run the benchmarks in bench/ (by hand; figures go in bench/README.md)"

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	@touch $(STAMP)

venv: $(STAMP)

apt:
	@infra/apt-ensure.sh $(APT_PACKAGES)

demo: $(STAMP)
	@infra/apt-ensure.sh $(DEMO_APT_PACKAGES)
	$(BIN)/spikeops demo $(if $(SCENARIO),--scenario $(SCENARIO))

test: $(STAMP) apt
	$(BIN)/python -m pytest

bench: $(STAMP)
	@infra/apt-ensure.sh $(BENCH_APT_PACKAGES)
	$(BIN)/python bench/bench_parsers.py
	$(BIN)/python bench/bench_diagnose.py
	$(BIN)/python bench/bench_collect.py
	$(BIN)/python bench/bench_checkpoint.py
	$(BIN)/python bench/bench_train_logger.py
	$(BIN)/python bench/bench_incident.py
	$(BIN)/python bench/bench_receiver.py
	$(BIN)/python bench/bench_monitoring.py
	$(BIN)/python bench/bench_demo.py
	$(BIN)/python bench/bench_ledger.py

example: $(STAMP)
	$(BIN)/python examples/build_example.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info
