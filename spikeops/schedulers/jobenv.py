"""A job's own environment, and the environment of the commands spikeops runs.

The incident flow runs with credentials (``SLACK_BOT_TOKEN``, the receiver's token), Prefect
settings and its own virtual environment. None of that may reach a training job or the tools
spikeops calls: a resumed job must start with the interpreter and variables it was submitted
with, plus only the remediation the flow decided. So this module holds, as pure functions:

- ``command_env``: the scrub policy for ``sbatch``, ``scontrol``, ``scancel``, ``squeue``
  (an allowlist: what the Slurm clients need to find their tools, configuration and locale);
- ``parse_slurm_state_env``: Slurm's stored copy of a job's submission environment
  (``StateSaveLocation/hash.N/job.ID/environment``), the source of a resubmission's
  environment (docs/schedulers.md, "The resumed job's environment");
- ``parse_env_file`` and ``format_env_file``: NUL-separated ``NAME=value`` records, the
  format of ``sbatch --export-file``, ``env -0`` and ``/proc/PID/environ``; unlike
  ``--export=NAME=value`` it carries commas, spaces and newlines in values;
- ``resume_environment``: the job's environment plus the remediation, nothing else.

Values are ``str`` decoded with ``surrogateescape``, so a byte that is not UTF-8 survives the
round trip to the resubmitted job unchanged.
"""

from __future__ import annotations

import os
import re
import struct
import sys
from collections.abc import Iterable, Mapping

__all__ = [
    "COMMAND_ENV_KEEP",
    "command_env",
    "orchestrator_prefixes",
    "slurm_state_env_path",
    "parse_slurm_state_env",
    "parse_env_file",
    "format_env_file",
    "resume_environment",
    "EnvFormatError",
    "ENV_FILE_LIMIT",
]

#: What a command spikeops runs keeps of spikeops' own environment: enough to find the tools
#: (``PATH``, without the orchestrator's virtual environment), Slurm's configuration, the
#: account and the locale. Everything else is dropped: tokens, Prefect settings, spikeops'
#: own settings, and the ``SBATCH_*``/``SQUEUE_*``/``SLURM_*`` input variables that would
#: silently change what ``sbatch`` submits or how ``squeue`` prints.
COMMAND_ENV_KEEP = frozenset({"PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "SLURM_CONF"})
_KEEP_PREFIXES = ("LC_",)
#: The largest environment file read (Slurm's own limit per variable is 256 KiB).
ENV_FILE_LIMIT = 16 << 20
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Slurm's entry splitter: a name of at most 255 bytes, a value under ENV_BUFSIZE (256 KiB).
_SLURM_NAME_MAX = 255
_SLURM_VALUE_MAX = (256 << 10) - 1


class EnvFormatError(ValueError):
    """An environment file that cannot be read as one: the message is one line, for a person."""


def orchestrator_prefixes(environ: Mapping[str, str] | None = None) -> list[str]:
    """The directories of spikeops' own Python environment: its virtual environment (this
    interpreter's ``sys.prefix`` when it is one, ``$VIRTUAL_ENV``) and an active conda
    environment. A ``PATH`` entry under one of them finds spikeops' interpreter first."""
    env = os.environ if environ is None else environ
    found = []
    if sys.prefix != sys.base_prefix:
        found.append(sys.prefix)
    for name in ("VIRTUAL_ENV", "CONDA_PREFIX"):
        if env.get(name):
            found.append(env[name])
    return list(dict.fromkeys(os.path.normpath(p) for p in found))


def _under(entry: str, prefixes: Iterable[str]) -> bool:
    path = os.path.normpath(entry) if entry else entry
    return any(path == p or path.startswith(p.rstrip("/") + "/") for p in prefixes)


def command_env(environ: Mapping[str, str], *, keep: Iterable[str] = (),
                drop_path_under: Iterable[str] = ()) -> dict[str, str]:
    """The environment a Slurm client runs with: ``COMMAND_ENV_KEEP``, ``LC_*`` and the
    names in ``keep`` (a site's own needs, e.g. ``KRB5CCNAME``), taken from ``environ``;
    ``PATH`` without the entries under ``drop_path_under`` (``orchestrator_prefixes()``)."""
    wanted = COMMAND_ENV_KEEP | frozenset(keep)
    out = {name: value for name, value in environ.items()
           if name in wanted or name.startswith(_KEEP_PREFIXES)}
    prefixes = [os.path.normpath(p) for p in drop_path_under if p]
    if "PATH" in out and prefixes:
        out["PATH"] = os.pathsep.join(e for e in out["PATH"].split(os.pathsep) if e and not _under(e, prefixes))
    return out


def slurm_state_env_path(state_save_location: str, job_id: str, array_job_id: str | None = None) -> str:
    """Where slurmctld keeps a batch job's submission environment (``_copy_job_desc_to_file``
    in job_mgr.c, unchanged from 22.05 to 24.11); an array's tasks share the array job's."""
    use = array_job_id if array_job_id and array_job_id.isdigit() else job_id
    if not use.isdigit():
        raise EnvFormatError(f"job id {job_id!r}: Slurm keeps environments only under numeric ids")
    return f"{state_save_location.rstrip('/')}/hash.{int(use) % 10}/job.{int(use)}/environment"


def _decode(record: bytes, where: str) -> tuple[str, str]:
    name, sep, value = record.partition(b"=")
    text = name.decode("utf-8", "surrogateescape")
    if not sep or not _NAME.match(text):
        raise EnvFormatError(f"{where}: {record[:40]!r} is not NAME=value")
    return text, value.decode("utf-8", "surrogateescape")


def parse_slurm_state_env(data: bytes) -> dict[str, str]:
    """Slurm's ``environment`` file: a native-endian uint32 count, then that many
    NUL-terminated ``NAME=value`` strings (``_write_data_array_to_file``)."""
    if len(data) < 4:
        raise EnvFormatError(f"Slurm's environment file is {len(data)} bytes: too short for its count")
    count = struct.unpack("=I", data[:4])[0]
    body = data[4:]
    if count == 0 and not body:
        return {}
    if not body.endswith(b"\0"):
        raise EnvFormatError("Slurm's environment file does not end with a NUL (truncated, or another format)")
    records = body[:-1].split(b"\0")
    if len(records) != count:
        raise EnvFormatError(f"Slurm's environment file says {count} variables and holds {len(records)} "
                             "(another Slurm version's format?)")
    env: dict[str, str] = {}
    for record in records:
        name, value = _decode(record, "Slurm's environment file")
        env[name] = value
    return env


def parse_env_file(data: bytes) -> dict[str, str]:
    """NUL-separated ``NAME=value`` records (``env -0``, ``/proc/PID/environ``, what
    ``preserve`` writes). A file with newlines and no NUL is refused: ``env > file`` cannot
    tell a value's newline from the next variable."""
    if not data:
        return {}
    if b"\0" not in data and b"\n" in data.strip(b"\n"):
        raise EnvFormatError("not NUL-separated (write it with `env -0`, not `env`)")
    env: dict[str, str] = {}
    for record in data.split(b"\0"):
        if record:
            name, value = _decode(record, "environment file")
            env[name] = value
    return env


def format_env_file(env: Mapping[str, str]) -> bytes:
    """``NAME=value\\0`` records, as ``sbatch --export-file`` reads them (every record
    NUL-terminated: sbatch stops at the first record without one). Raises EnvFormatError for
    what sbatch would drop without a word: a bad name, a NUL, a value over Slurm's limit."""
    out = bytearray()
    for name, value in env.items():
        if not _NAME.match(name) or len(name.encode()) > _SLURM_NAME_MAX:
            raise EnvFormatError(f"cannot export {name[:40]!r}: not a variable name sbatch accepts")
        raw = value.encode("utf-8", "surrogateescape")
        if b"\0" in raw:
            raise EnvFormatError(f"cannot export {name}: its value holds a NUL byte")
        if len(raw) > _SLURM_VALUE_MAX:
            raise EnvFormatError(f"cannot export {name}: {len(raw)} bytes, over Slurm's 256 KiB per variable")
        out += name.encode() + b"=" + raw + b"\0"
    return bytes(out)


def resume_environment(job_env: Mapping[str, str], remediation: Mapping[str, str]) -> dict[str, str]:
    """The resumed job's environment: its own, with the remediation's variables set (they
    win over a same-named variable the job had: a previous resume's remediation, say)."""
    return {**dict(job_env), **dict(remediation)}
