"""Resolves a job into the program its scheduler runs, after checking it against its offering and its template.

The ``route_job`` activity calls the worker's ``BodyResolver`` for every job (``activities/jobs.py``). The one
built here (``TemplateResolver``, constructed with the chain and the audit log by ``workers/wiring.py``):

1. checks the job against its priced queue (``virtengine_hpc.pricing``): partition and job class of the
   offering, walltime within the queue's duration bounds, and a budget (``max_price``) that covers the most the
   job can cost;
2. for a script job, returns the script;
3. for a template job, finds the template: a built-in (shipped with the code), else a custom template from the
   chain, which must be signed by its publisher, approved by governance, and unchanged since approval; a forged,
   modified or unapproved one is refused with a ``template_rejected`` security audit event;
4. checks the job's resources against the template's bounds and its parameters against the schema;
5. renders the body for the adapter (``srun`` on SLURM, ``mpirun`` elsewhere).

Every refusal is a ``ValidationError``: ``route_job`` audits it (``job_validation_failed``) and the job fails on
chain with the reason, its escrow refunded.
"""

from __future__ import annotations

from activities.audit import AuditLog
from activities.chain.client import ChainClient
from activities.jobs import ResolvedBody
from activities.schedulers.base import SchedulerAdapter
from virtengine_hpc.audit_events import AuditEvent
from virtengine_hpc.errors import ValidationError
from virtengine_hpc.models import JobSpec
from virtengine_hpc.pricing import check_job_against_queue
from virtengine_hpc.templates import (
    LaunchProfile,
    TemplateRecord,
    WorkloadTemplate,
    builtin_templates,
    check_job,
)
from virtengine_hpc.templates import render as render_template

#: Severity of a refused custom template in the audit log (a forged or tampered template is an attack).
REJECTED_SEVERITY = 4


def template_problem(template_id: str, record: TemplateRecord) -> str | None:
    """Why a chain record must not be used (None when it may): approval, signature, integrity, identity."""
    template = record.signed.template
    if template.template_id != template_id or record.template_id != template_id:
        return f"the chain returned template {template.template_id} for {template_id}"
    if template.publisher != record.publisher:
        return f"signed for publisher {template.publisher}, recorded for {record.publisher}"
    if not record.signed.verify():
        return "its publisher signature does not verify (forged or modified)"
    digest = template.digest()
    if digest != record.digest:
        return "its content does not match the digest recorded when it was published (modified)"
    if record.status != "approved":
        return f"it is not approved by governance (status {record.status})"
    if record.approved_digest != digest:
        return "its content is not the content governance approved (modified after approval)"
    return None


def launch_profile(adapter: SchedulerAdapter) -> LaunchProfile:
    return LaunchProfile.of(adapter.name or type(adapter).__name__.lower(), adapter.mpi_launcher)


class TemplateResolver:
    """The worker's ``BodyResolver``. Without a chain it knows only the built-ins and checks no prices."""

    def __init__(self, chain: ChainClient | None = None, audit: AuditLog | None = None) -> None:
        self.chain = chain
        self.audit = audit

    async def __call__(self, job: JobSpec, adapter: SchedulerAdapter) -> ResolvedBody:
        if self.chain is not None:
            await self.check_offering(job)
        return await self.render(job, adapter)

    async def render(self, job: JobSpec, adapter: SchedulerAdapter) -> ResolvedBody:
        """The program alone, for ``submit_job``: the offering was checked when the job was routed; the template
        is looked up (still approved, unmodified) and the parameters checked again, since rendering needs them."""
        if job.script is not None:
            return ResolvedBody(job.script)
        template = await self.template_for(job)
        values = check_job(template, job)
        return ResolvedBody(
            render_template(template, values, job, launch_profile(adapter)),
            exclusive=template.resources.exclusive_nodes,
        )

    async def check_offering(self, job: JobSpec) -> None:
        assert self.chain is not None
        queue = await self.chain.get_queue(job.offering_id)
        if queue is None:
            raise ValidationError(f"offering {job.offering_id} has no priced queue on chain")
        check_job_against_queue(job, queue)

    async def template_for(self, job: JobSpec) -> WorkloadTemplate:
        template_id = job.template_id
        assert template_id is not None
        builtin = builtin_templates().get(template_id)
        if builtin is not None:
            return builtin
        getter = getattr(self.chain, "get_template", None)
        record: TemplateRecord | None = await getter(template_id) if getter is not None else None
        if record is None:
            raise ValidationError(f"unknown template {template_id!r}")
        problem = template_problem(template_id, record)
        if problem is not None:
            message = f"template {template_id} {record.version} refused: {problem}"
            if self.audit is not None:
                self.audit.record(
                    AuditEvent.TEMPLATE_REJECTED,
                    job_id=job.job_id,
                    cluster_id=job.cluster_id,
                    success=False,
                    severity=REJECTED_SEVERITY,
                    error_msg=message,
                    details={
                        "template_id": template_id,
                        "version": record.version,
                        "publisher": record.publisher,
                        "status": record.status,
                        "key_id": record.signed.key_id,
                    },
                )
            raise ValidationError(message)
        return record.signed.template


def make_resolver(chain: ChainClient, audit: AuditLog) -> TemplateResolver:
    """What ``workers/wiring.py`` builds for each worker."""
    return TemplateResolver(chain, audit)


resolve_body = TemplateResolver()
"""Built-ins only, no price checks: for a worker built without a chain."""

__all__ = ["TemplateResolver", "launch_profile", "make_resolver", "resolve_body", "template_problem"]
