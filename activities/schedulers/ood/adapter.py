"""The Open OnDemand adapter: what OOD itself does, for tenants instead of browser users.

Open OnDemand has no job-submission REST API. Its dashboard authenticates a person through the site's OIDC
provider, maps the identity to a cluster account (``user_map_match``/``user_map_cmd``), and that account's
per-user server submits through the cluster's scheduler (``sbatch``, ``msub``... possibly over SSH to a submit
host). This adapter does the same: the tenant's chain address is mapped to a cluster user
(``hpc.tenants``, the mapping every scheduler uses: a fixed account or one from the pool), an OIDC
client-credentials token vouches for the provider's client (and, with ``oidc_users_claim``, for the user), and the job is submitted through the configured scheduler adapter *as that
user* (``underlying_scheduler``: its SSH login, MWS job user or REST user becomes the mapped user).

Scheduler job ids are ``<user>/<native id>`` (``/session`` appended for interactive sessions), so status, usage
and cancel go to the right user's adapter after a worker restart. Status is one query per cluster user with
active jobs per round (each user's own scheduler view, as OOD's per-user servers see it). A running interactive
session's reason carries the dashboard page where the tenant's session card (host, port, connect button) is:
``<dashboard_url>/pun/sys/dashboard/batch_connect/sessions``.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence

from activities.schedulers.base import (
    Accounting,
    NativeStatus,
    SchedulerAdapter,
    SubmitRequest,
    SubmitResult,
    hold_back_taken,
)
from activities.schedulers.batch.base import AccountExecutors
from activities.schedulers.batch.workdir import TenantDirs, remote_lstat
from activities.schedulers.ood.oidc import OIDCClient
from activities.schedulers.registry import adapter_class
from activities.tenant_accounts import TenantAccounts
from virtengine_hpc.config import Config, OODConfig, Secrets, TenantsConfig
from virtengine_hpc.errors import ConfigError, JobNotFound, SecurityError
from virtengine_hpc.states import JobState

log = logging.getLogger(__name__)

SESSION_TEMPLATE = "interactive-session"
SESSIONS_PAGE = "/pun/sys/dashboard/batch_connect/sessions"
ACTIVE_JOBS_PAGE = "/pun/sys/dashboard/activejobs"


def _user_key(scheduler: str, transport: str | None) -> str | None:
    """The key of the underlying scheduler's section that names the account its commands run as."""
    if scheduler == "moab":
        return "ssh_user" if transport == "ssh" else "mws_job_user"
    if scheduler == "slurm":
        if transport in ("ssh", "rest"):
            return "ssh_user" if transport == "ssh" else "rest_user"
        raise ConfigError(
            "hpc.ood.underlying_scheduler slurm needs hpc.slurm.transport ssh or rest: local commands cannot run "
            "as the tenant's mapped user"
        )
    return None  # the local executor runs every job as the worker's own account (demos)


def split_id(scheduler_job_id: str) -> tuple[str, str, bool]:
    parts = scheduler_job_id.split("/")
    if (
        len(parts) not in (2, 3)
        or not parts[0]
        or not parts[1]
        or (len(parts) == 3 and parts[2] != "session")
    ):
        raise JobNotFound(
            f"{scheduler_job_id[:80]!r} is not an Open OnDemand job id (<user>/<id>)", transient=False
        )
    return parts[0], parts[1], len(parts) == 3


class OODAdapter(SchedulerAdapter):
    """Submission through the underlying scheduler as the tenant's mapped cluster user, after an OIDC check."""

    name = "ood"

    mpi_launcher = "mpirun"

    def __init__(
        self,
        config: Config,
        secrets: Secrets,
        cluster_id: str,
        oidc: OIDCClient,
        tenants: TenantAccounts | None = None,
    ) -> None:
        self.config = config
        self.tenants = tenants or TenantAccounts.from_config(config)
        self.ood: OODConfig = config.hpc.ood
        self.secrets = secrets
        self.cluster_id = cluster_id
        self.oidc = oidc
        self.underlying = self.ood.underlying_scheduler
        self._factory = adapter_class(self.underlying)
        self._adapters: dict[str, SchedulerAdapter] = {}
        self.dashboard = (self.ood.dashboard_url or "").rstrip("/")
        _user_key(self.underlying, getattr(getattr(config.hpc, self.underlying), "transport", None))

    @classmethod
    def from_config(cls, config: Config, secrets: Secrets, cluster_id: str) -> OODAdapter:
        o = config.hpc.ood
        missing = [k for k in ("oidc_token_url", "oidc_issuer", "oidc_client_id") if not getattr(o, k)]
        if missing:
            raise ConfigError(f"hpc.ood: {', '.join(missing)} required (OIDC client credentials)")
        if secrets.ood_oidc_client_secret is None:
            raise ConfigError("OOD_OIDC_CLIENT_SECRET is not set: the OOD adapter authenticates with it")
        tenants = TenantAccounts.from_config(config)
        if not tenants.isolated or not tenants.accounts():
            raise ConfigError(
                "hpc.tenants: Open OnDemand submits as each tenant's own cluster account; name them in "
                "hpc.tenants.accounts or hpc.tenants.pool (isolation per_tenant)"
            )
        assert o.oidc_token_url and o.oidc_issuer and o.oidc_client_id
        oidc = OIDCClient(
            token_url=o.oidc_token_url,
            issuer=o.oidc_issuer,
            client_id=o.oidc_client_id,
            client_secret=secrets.ood_oidc_client_secret,
            audience=o.oidc_audience,
            scope=o.oidc_scope,
            jwks_url=o.oidc_jwks_url,
            users_claim=o.oidc_users_claim,
            ca_cert=o.ca_cert,
            timeout=o.connection_timeout.total_seconds(),
        )
        return cls(config, secrets, cluster_id, oidc, tenants)

    # ---- the underlying scheduler, per cluster user -------------------------------------------------------------
    def adapter_for(self, user: str) -> SchedulerAdapter:
        """The underlying scheduler's adapter acting as ``user`` (built once per user)."""
        adapter = self._adapters.get(user)
        if adapter is None:
            section = getattr(self.config.hpc, self.underlying)
            key = _user_key(self.underlying, getattr(section, "transport", None))
            update: dict[str, object] = {key: user} if key else {}
            if (
                getattr(section, "work_dir", None) is not None
            ):  # each user's own directory, never a shared one
                update["work_dir"] = section.work_dir / user
            # The underlying adapter acts as this one user: the tenant mapping was applied here already.
            as_user = self.config.model_copy(
                update={
                    "hpc": self.config.hpc.model_copy(
                        update={
                            "scheduler_type": self.underlying,
                            self.underlying: section.model_copy(update=update),
                            "tenants": TenantsConfig(isolation="none"),
                        }
                    )
                }
            )
            adapter = self._factory.from_config(as_user, self.secrets, self.cluster_id)
            adapter.on_refused_adoption(self.tell_refused)
            self._adapters[user] = adapter
        return adapter

    def user_of(self, tenant: str) -> str:
        """The tenant's cluster account (``TenantAccountError`` when it has none, or a privileged one)."""
        section = getattr(self.config.hpc, self.underlying)
        key = _user_key(self.underlying, getattr(section, "transport", None))
        submit_account = getattr(section, key, None) if key else None
        return self.tenants.account_for(tenant, submit_account=submit_account)

    def expected_account(self, tenant: str) -> str | None:
        return self.tenants.assigned(tenant)

    # ---- the adapter interface ------------------------------------------------------------------------------
    async def submit(
        self, request: SubmitRequest, *, on_submitted: Callable[[str], None] | None = None
    ) -> SubmitResult:
        # As on SLURM and MOAB: an unassigned pool account the scheduler shows jobs of is never handed out.
        await hold_back_taken(self, self.tenants, request.job.tenant, cluster_id=self.cluster_id)
        user = await asyncio.to_thread(self.user_of, request.job.tenant)
        await self.oidc.authorize(user)
        suffix = "/session" if request.job.template_id == SESSION_TEMPLATE else ""

        def full(native: str) -> str:
            return f"{user}/{native}{suffix}"

        if request.known_job_id is not None:  # the scheduler under OOD knows the job by its native id
            known_user, native, _ = split_id(request.known_job_id)
            request = request.model_copy(update={"known_job_id": native if known_user == user else None})
        adapter = self.adapter_for(user)
        if request.job.working_directory is None:
            await self._check_dir(adapter, user)
        result = await adapter.submit(
            request, on_submitted=(lambda native: on_submitted(full(native))) if on_submitted else None
        )
        return SubmitResult(
            scheduler_job_id=full(result.scheduler_job_id),
            adopted=result.adopted,
            duplicates_cancelled=[full(native) for native in result.duplicates_cancelled],
        )

    async def _check_dir(self, adapter: SchedulerAdapter, user: str) -> None:
        """The user's job directory ``<work_dir>/<user>`` is the user's own, 0700, in a ``work_dir`` owned by root
        or the provider's account (``batch.workdir``), checked through the user's own login before every
        submission: outputs in a directory every user writes could be taken by a link another user planted under
        a name it read in the queue. Transports with no view of the file system (MWS, slurmrestd) leave it to
        the operator."""
        section = getattr(self.config.hpc, self.underlying)
        work_dir = getattr(section, "work_dir", None)
        executors = getattr(getattr(adapter, "backend", None), "executors", None)
        if work_dir is None or not isinstance(executors, AccountExecutors):
            return
        provider = getattr(section, "ssh_user", None)
        trusted = {"root", provider} if provider else {"root"}
        await TenantDirs(remote_lstat(executors.stat), trusted=trusted).ensure(str(work_dir), user)

    async def find(self, workflow_id: str, tenant: str | None = None) -> str | None:
        """The job of ``workflow_id`` under ``tenant``'s own cluster user only (a job under another mapped user
        is never this tenant's); without a tenant, under every mapped user."""
        if tenant is not None:
            user = await asyncio.to_thread(self.tenants.assigned, tenant)
            users = [user] if user is not None else []
        else:
            users = sorted(self.tenants.accounts())
        found = await asyncio.gather(
            *(self.adapter_for(u).find(workflow_id) for u in users), return_exceptions=True
        )
        hits = []
        for user, job in zip(users, found, strict=True):
            if isinstance(job, SecurityError):  # cannot log in as that user: it cannot hold our job either
                log.warning("find %s: skipping cluster user %s: %s", workflow_id, user, job)
            elif isinstance(job, BaseException):
                raise job
            elif job is not None:
                hits.append(f"{user}/{job}")
        return hits[0] if hits else None

    async def accounts_in_use(self, accounts: Sequence[str]) -> dict[str, str]:
        """Which of ``accounts`` the scheduler shows jobs of, asked as OOD's Active Jobs app asks: each user's
        jobs through the underlying scheduler as that user (live, and on MOAB completed). A user this worker
        cannot log in as is skipped (logged): no job of this provider can run as it either."""
        answers = await asyncio.gather(
            *(self.adapter_for(a).accounts_in_use([a]) for a in accounts), return_exceptions=True
        )
        found: dict[str, str] = {}
        for account, answer in zip(accounts, answers, strict=True):
            if isinstance(answer, SecurityError):
                log.warning("jobs of cluster user %s: cannot ask as that user: %s", account, answer)
            elif isinstance(answer, BaseException):
                raise answer
            else:
                found.update(answer)
        return found

    async def status_batch(self, scheduler_job_ids: Iterable[str]) -> dict[str, NativeStatus]:
        out: dict[str, NativeStatus] = {}
        by_user: dict[str, list[tuple[str, str, bool]]] = defaultdict(list)
        for full in dict.fromkeys(scheduler_job_ids):
            try:
                user, native, session = split_id(full)
            except JobNotFound as exc:
                out[full] = NativeStatus(scheduler_job_id=full, found=False, reason=str(exc))
                continue
            by_user[user].append((full, native, session))
        users = list(by_user)
        answers = await asyncio.gather(
            *(self.adapter_for(u).status_batch([native for _, native, _ in by_user[u]]) for u in users)
        )
        for user, answer in zip(users, answers, strict=True):
            for full, native, session in by_user[user]:
                status = answer.get(native) or NativeStatus(scheduler_job_id=native, found=False)
                out[full] = self._surface(status.model_copy(update={"scheduler_job_id": full}), session)
        return out

    def _surface(self, status: NativeStatus, session: bool) -> NativeStatus:
        """Running jobs name the dashboard page where the tenant's user sees them (sessions: the session card)."""
        if not self.dashboard or status.state != JobState.RUNNING:
            return status
        page = SESSIONS_PAGE if session else ACTIVE_JOBS_PAGE
        where = "connect" if session else "see it"
        return status.model_copy(update={"reason": f"{status.reason}; {where} at {self.dashboard}{page}"})

    async def cancel(self, scheduler_job_id: str) -> None:
        user, native, _ = split_id(scheduler_job_id)
        await self.adapter_for(user).cancel(native)

    async def usage(self, scheduler_job_id: str) -> Accounting:
        user, native, _ = split_id(scheduler_job_id)
        accounting = await self.adapter_for(user).usage(native)
        return accounting.model_copy(update={"scheduler_job_id": scheduler_job_id})

    async def close(self) -> None:
        for adapter in self._adapters.values():
            await adapter.close()
        await self.oidc.close()
