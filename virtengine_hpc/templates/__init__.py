"""Workload templates: the document, the built-ins, validation of jobs against them, and rendering.

Pure code (no I/O besides reading the packaged built-in files); ``activities/templates.py`` resolves templates
from the chain and renders them for a scheduler adapter. See ``docs/templates.md``.
"""

from virtengine_hpc.templates.builtins import BUILTIN_IDS, builtin_templates, is_builtin
from virtengine_hpc.templates.model import (
    TEMPLATE_DOMAIN,
    ParameterSpec,
    SignedTemplate,
    TemplateRecord,
    WorkloadTemplate,
    sign_template,
)
from virtengine_hpc.templates.render import LaunchProfile, render
from virtengine_hpc.templates.validate import check_job, check_parameters, check_resources

__all__ = [
    "BUILTIN_IDS",
    "TEMPLATE_DOMAIN",
    "LaunchProfile",
    "ParameterSpec",
    "SignedTemplate",
    "TemplateRecord",
    "WorkloadTemplate",
    "builtin_templates",
    "check_job",
    "check_parameters",
    "check_resources",
    "is_builtin",
    "render",
    "sign_template",
]
