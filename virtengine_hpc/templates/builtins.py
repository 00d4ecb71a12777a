"""The five built-in templates that ship with the protocol, loaded from the YAML files in ``builtin/``.

They are data in the same format a custom-template publisher writes (``docs/templates.md``), so reading one is
the best example of the format. Built-ins ship with the code: they need no signature or approval, and no custom
template may take one of their ids.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

import yaml

from virtengine_hpc.templates.model import BUILTIN_PUBLISHER, WorkloadTemplate

BUILTIN_IDS = ("mpi-standard", "gpu-compute", "batch-standard", "data-processing", "interactive-session")


@cache
def builtin_templates() -> dict[str, WorkloadTemplate]:
    """The built-ins by id, validated (a broken file is a bug of this release: it raises at first use)."""
    folder = resources.files("virtengine_hpc.templates").joinpath("builtin")
    found: dict[str, WorkloadTemplate] = {}
    for template_id in BUILTIN_IDS:
        data = yaml.safe_load(folder.joinpath(f"{template_id}.yaml").read_text(encoding="utf-8"))
        template = WorkloadTemplate.model_validate(data)
        if template.template_id != template_id or template.publisher != BUILTIN_PUBLISHER:
            raise RuntimeError(f"built-in template file {template_id}.yaml is inconsistent")
        found[template_id] = template
    return found


def is_builtin(template_id: str) -> bool:
    return template_id in BUILTIN_IDS
