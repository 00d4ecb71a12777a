"""A MOAB Web Services simulator: ``/mws/rest/jobs?api-version=3`` over HTTPS with HTTP Basic, in front of the same
``MoabSim`` queue the SSH commands use.

Implemented: ``GET /mws/rest/jobs`` (``query`` with equality and ``$in`` on top-level fields, as MWS's
MongoDB-style queries), ``GET /mws/rest/jobs/<name>``, ``POST /mws/rest/jobs`` (``commandScript``, ``customName``,
``credentials``, ``requirements``, ``duration``, ``initialWorkingDirectory``, ``holds``), ``PUT
/mws/rest/jobs/<name>`` (``holds``), ``DELETE /mws/rest/jobs/<name>``. Requests without ``api-version=3`` are
refused. ``fail_with`` makes every request answer that HTTP status (an outage behind a load balancer).
"""

from __future__ import annotations

import base64
import json
import pwd
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from tests.sim.moab import MoabSim


class MwsState:
    def __init__(self, moab: MoabSim, username: str, password: str) -> None:
        self.moab = moab
        self.username = username
        self.password = password
        self.fail_with: int | None = None
        self.requests: list[tuple[str, str]] = []


class MwsHandler(BaseHTTPRequestHandler):
    server: Any

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        return

    @property
    def state(self) -> MwsState:
        return self.server.mws  # type: ignore[no-any-return]

    def _send(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _authorized(self) -> bool:
        header = self.headers.get("Authorization", "")
        if not header.startswith("Basic "):
            return False
        try:
            user, _, password = base64.b64decode(header[6:]).decode().partition(":")
        except ValueError:
            return False
        return user == self.state.username and password == self.state.password

    def _route(self, method: str) -> None:
        self.state.requests.append((method, self.path))
        if self.state.fail_with is not None:
            self._send(self.state.fail_with, {"messages": ["MWS is unavailable (simulated outage)"]})
            return
        if not self._authorized():
            self._send(401, {"messages": ["Unauthorized"]})
            return
        url = urlsplit(self.path)
        params = parse_qs(url.query)
        if params.get("api-version") != ["3"]:
            self._send(400, {"messages": ["api-version=3 is required"]})
            return
        parts = url.path.rstrip("/").split("/")
        if parts[:4] != ["", "mws", "rest", "jobs"]:
            self._send(404, {"messages": [f"no resource {url.path}"]})
            return
        name = parts[4] if len(parts) > 4 else None
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"null") if length else None
        moab = self.state.moab
        with moab.lock:
            if method == "GET" and name is None:
                query = json.loads(params.get("query", ["{}"])[0])
                jobs = [moab.mws_job(j) for j in sorted(moab.jobs.values(), key=lambda j: j.number)]
                results = [j for j in jobs if _matches(j, query)]
                self._send(200, {"totalCount": len(results), "resultCount": len(results), "results": results})
            elif method == "GET":
                job = moab.jobs.get(name or "")
                self._send(200, moab.mws_job(job)) if job else self._send(
                    404, {"messages": [f"job {name} not found"]}
                )
            elif method == "POST" and name is None:
                self._submit(body or {})
            elif method == "DELETE" and name:
                answer = moab.handle(0, 0, "mjobctl", ["-c", name], None)
                status = 200 if answer["code"] == 0 else 404 if "cannot locate" in answer["stderr"] else 400
                self._send(status, {"messages": [answer["stdout"] or answer["stderr"]]})
            elif method == "PUT" and name:
                holds = (body or {}).get("holds")
                flag = "-h" if holds else "-u"
                answer = moab.handle(0, 0, "mjobctl", [flag, "user", name], None)
                status = 200 if answer["code"] == 0 else 404 if "cannot locate" in answer["stderr"] else 400
                self._send(status, {"messages": [answer["stdout"] or answer["stderr"]]})
            else:
                self._send(405, {"messages": [f"{method} not supported on {url.path}"]})

    def _submit(self, body: dict[str, Any]) -> None:
        moab = self.state.moab
        credentials = body.get("credentials") or {}
        user = credentials.get("user") or self.state.username
        try:
            pw = pwd.getpwnam(user)
        except KeyError:
            self._send(400, {"messages": [f"user '{user}' does not exist"]})
            return
        req = (body.get("requirements") or [{}])[0]
        nodes = int(req.get("requiredNodeCountMinimum") or 1)
        tpn = int(req.get("tasksPerNode") or 1)
        mem_per_task = int(((req.get("resourcesPerTask") or {}).get("MEM") or {}).get("dedicated") or 0)
        argv = [
            "-N",
            str(body.get("customName") or "STDIN"),
            "-q",
            str(credentials.get("jobClass") or "batch"),
        ]
        ppn = f"nodes={nodes}:ppn={tpn}" + (f":gpus={int(req['gpus']) // nodes}" if req.get("gpus") else "")
        argv += ["-l", ppn, "-l", f"walltime={int(body.get('duration') or 3600)}"]
        argv += ["-l", f"mem={mem_per_task * tpn * nodes}mb"]
        if req.get("nodeAccessPolicy") == "SINGLEJOB":
            argv += ["-l", "naccesspolicy=singlejob"]
        if credentials.get("account"):
            argv += ["-A", str(credentials["account"])]
        if body.get("initialWorkingDirectory"):
            argv += ["-d", str(body["initialWorkingDirectory"])]
        if body.get("holds"):
            argv.append("-h")
        answer = moab.handle(pw.pw_uid, pw.pw_gid, "msub", argv, str(body.get("commandScript") or ""))
        if answer["code"] != 0:
            self._send(400, {"messages": [answer["stderr"].strip()]})
            return
        job = moab.jobs[answer["stdout"].strip()]
        self._send(201, moab.mws_job(job))

    def do_GET(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        self._route("POST")

    def do_PUT(self) -> None:
        self._route("PUT")

    def do_DELETE(self) -> None:
        self._route("DELETE")


def _matches(job: dict[str, Any], query: dict[str, Any]) -> bool:
    for key, want in query.items():
        have = job.get(key)
        if isinstance(want, dict) and "$in" in want:
            if have not in want["$in"]:
                return False
        elif have != want:
            return False
    return True


def setup(state: MwsState) -> Any:
    def attach(server: ThreadingHTTPServer) -> None:
        server.mws = state  # type: ignore[attr-defined]

    return attach
