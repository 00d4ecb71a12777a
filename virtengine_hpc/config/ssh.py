"""The SSH keys SLURM and MOAB both have, as field types: one description and one constraint for both.

Types rather than a shared base class, so each key keeps its place in its section (and in the generated
reference). ``ssh_host`` and ``ssh_user`` stay in each section: SLURM constrains them with a pattern, MOAB
does not, and this refactor changes no accepted value.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import Field

SshPort = Annotated[int, Field(ge=1, le=65535, description="SSH port of ssh_host.")]
"""``ssh_port``: write ``ssh_port: SshPort = 22``."""
SshKeyPath = Annotated[Path | None, Field(description="Private key file for ssh_user (never a password).")]
"""``ssh_key_path``: write ``ssh_key_path: SshKeyPath = None``."""
KnownHostsPath = Annotated[
    Path | None,
    Field(description="known_hosts file used to check the host key; default ~/.ssh/known_hosts."),
]
"""``known_hosts_path``: write ``known_hosts_path: KnownHostsPath = None``."""
