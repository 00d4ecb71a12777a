"""Custom workload templates: published signed by a registered publisher key, immutable per version, usable once
governance approved them.
"""

from __future__ import annotations

import asyncio
import sqlite3
from typing import Any, Literal

from activities.chain.ledger.common import _iso
from activities.chain.ledger.core import LedgerCore
from virtengine_hpc.errors import ChainError, SecurityError
from virtengine_hpc.signing import key_id, public_key_from_b64
from virtengine_hpc.templates.builtins import is_builtin
from virtengine_hpc.templates.model import SignedTemplate, TemplateRecord


class TemplatesArea(LedgerCore):
    """Published templates and their publishers' keys."""

    def register_publisher_key(self, publisher: str, public_key_b64: str) -> str:
        """Register a template publisher's Ed25519 public key (raw, base64); returns its key id.

        On a real chain the publisher's account key signs the publishing transaction; here the registry ties
        keys to publisher addresses, so a template claiming a publisher is refused unless that publisher's key
        signed it.
        """
        public_key = public_key_from_b64(public_key_b64)
        kid = key_id(public_key)
        if not publisher or len(publisher) > 256:
            raise ChainError("publisher must be a non-empty string of at most 256 characters")
        with self._tx(write=True) as db:
            db.execute(
                "INSERT OR IGNORE INTO publisher_keys (publisher, key_id, public_key, registered_at) "
                "VALUES (?, ?, ?, ?)",
                (publisher, kid, public_key_b64, _iso(self._now())),
            )
        return kid

    def publisher_keys(self, publisher: str) -> dict[str, str]:
        """``{key_id: public_key_b64}`` of a publisher's registered keys."""
        with self._tx(write=False) as db:
            rows = db.execute(
                "SELECT key_id, public_key FROM publisher_keys WHERE publisher = ?", (publisher,)
            ).fetchall()
        return {r["key_id"]: r["public_key"] for r in rows}

    def publish_template(self, signed: SignedTemplate) -> TemplateRecord:
        """Store a signed custom template as ``pending`` (usable only after ``approve_template``).

        Refused: a bad signature or a key that is not a registered key of the template's publisher
        (``SecurityError``); a built-in id; an id owned by another publisher (``SecurityError``); a version
        already published with other content (versions are immutable). Publishing the same bytes again returns
        the existing record.
        """
        template = signed.template
        if not signed.verify():
            raise SecurityError(
                f"template {template.template_id} {template.version}: signature does not verify"
            )
        if signed.key_id not in self.publisher_keys(template.publisher):
            raise SecurityError(
                f"template {template.template_id}: key {signed.key_id[:16]}... is not a registered key of "
                f"publisher {template.publisher}"
            )
        if is_builtin(template.template_id):
            raise ChainError(f"template id {template.template_id} is a built-in template's")
        now = self._now()
        digest = template.digest()
        with self._tx(write=True) as db:
            owner = db.execute(
                "SELECT publisher FROM templates WHERE template_id = ? LIMIT 1", (template.template_id,)
            ).fetchone()
            if owner is not None and owner["publisher"] != template.publisher:
                raise SecurityError(
                    f"template id {template.template_id} belongs to publisher {owner['publisher']}"
                )
            row = db.execute(
                "SELECT data FROM templates WHERE template_id = ? AND version = ?",
                (template.template_id, template.version),
            ).fetchone()
            if row is not None:
                existing = TemplateRecord.model_validate_json(row["data"])
                if existing.digest != digest:
                    raise ChainError(
                        f"template {template.template_id} {template.version} is already published with other "
                        "content; publish a new version"
                    )
                return existing
            record = TemplateRecord(
                template_id=template.template_id,
                version=template.version,
                publisher=template.publisher,
                status="pending",
                signed=signed,
                digest=digest,
                published_at=now,
                published_height=self.height_at(now),
            )
            db.execute(
                "INSERT INTO templates (template_id, version, publisher, status, data) VALUES (?, ?, ?, ?, ?)",
                (
                    record.template_id,
                    record.version,
                    record.publisher,
                    record.status,
                    record.model_dump_json(),
                ),
            )
            return record

    def _template_row(self, db: sqlite3.Connection, template_id: str, version: str | None) -> sqlite3.Row:
        if version is None:
            row = db.execute(
                "SELECT * FROM templates WHERE template_id = ? ORDER BY seq DESC LIMIT 1", (template_id,)
            ).fetchone()
        else:
            row = db.execute(
                "SELECT * FROM templates WHERE template_id = ? AND version = ?", (template_id, version)
            ).fetchone()
        if row is None:
            what = template_id if version is None else f"{template_id} {version}"
            raise ChainError(f"unknown template {what}", code="template_not_found")
        return row

    def decide_template(
        self,
        template_id: str,
        status: Literal["approved", "rejected", "revoked"],
        *,
        version: str | None = None,
        decided_by: str = "governance",
        reason: str = "",
    ) -> TemplateRecord:
        """Governance's decision on a published version (default: the latest): approve, reject or revoke.

        Approval records the digest of the exact template approved; a template whose content no longer hashes
        to it is refused by providers. Revoking an approved version stops new jobs from using it.
        """
        now = self._now()
        with self._tx(write=True) as db:
            row = self._template_row(db, template_id, version)
            record = TemplateRecord.model_validate_json(row["data"])
            if record.status == status:
                return record
            allowed = {"approved": ("pending",), "rejected": ("pending",), "revoked": ("approved",)}[status]
            if record.status not in allowed:
                raise ChainError(
                    f"template {template_id} {record.version} is {record.status}; it cannot become {status}"
                )
            changed = record.model_copy(
                update={
                    "status": status,
                    "approved_digest": record.digest if status == "approved" else record.approved_digest,
                    "decided_by": decided_by[:256],
                    "decided_at": now,
                    "decided_height": self.height_at(now),
                    "reason": reason[:512],
                }
            )
            db.execute(
                "UPDATE templates SET status = ?, data = ? WHERE seq = ?",
                (status, changed.model_dump_json(), row["seq"]),
            )
            return changed

    def approve_template(
        self, template_id: str, *, version: str | None = None, **kwargs: Any
    ) -> TemplateRecord:
        return self.decide_template(template_id, "approved", version=version, **kwargs)

    def template(self, template_id: str) -> TemplateRecord | None:
        """The version jobs use: the latest approved one, else the latest published (which providers refuse)."""
        with self._tx(write=False) as db:
            row = db.execute(
                "SELECT data FROM templates WHERE template_id = ? "
                "ORDER BY (status = 'approved') DESC, seq DESC LIMIT 1",
                (template_id,),
            ).fetchone()
        return TemplateRecord.model_validate_json(row["data"]) if row else None

    def templates(self, *, status: str | None = None) -> list[TemplateRecord]:
        """Every published version (optionally with one status), oldest first."""
        with self._tx(write=False) as db:
            rows = db.execute(
                "SELECT data FROM templates WHERE (?1 IS NULL OR status = ?1) ORDER BY seq", (status,)
            ).fetchall()
        return [TemplateRecord.model_validate_json(r["data"]) for r in rows]

    async def get_template(self, template_id: str) -> TemplateRecord | None:
        """The chain's record of a custom template (see ``template``); None when none was published."""
        return await asyncio.to_thread(self.template, template_id)
