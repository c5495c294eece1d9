"""A client of NeMo Gym's HTTP protocol: `POST /run` to agent servers, `/aggregate_metrics`, discovery.

Agents are found through the head server (`GET /server_instances` lists every server instance with
its URL) or given directly as name -> URL. Every row is bounded by a timeout and retried
with backoff; a row that fails every attempt raises `GymRowError` naming the row and the server.
While rows are pending, a `HealthMonitor` probes the servers they depend on; a row whose agent,
resources or model server is down fails at once with `GymServerDownError` naming that server, and is
not retried against it.
"""

from __future__ import annotations

import ast
import asyncio
import json
import logging
import re
from collections.abc import Mapping
from typing import Any

import httpx
import yaml

from nemo_rl_ext.gym.health import GymServer, HealthMonitor, servers_from_config

logger = logging.getLogger(__name__)

AGENT_SERVER_TYPE = "responses_api_agents"


class GymError(RuntimeError):
    """A Gym server could not be reached or answered something unusable."""


class GymRowError(GymError):
    """A row failed on every attempt; the message ends with the innermost cause of the last failure.

    `status_code` and `body` are those of the last HTTP answer (None / "" when no answer came: a timeout, a
    refused connection); `cause` is the innermost error text found in the body (see `innermost_gym_error`)
    or the transport error; `servers` are the Gym servers the error passed through, outermost first.
    """

    def __init__(
        self, message: str, *, status_code: int | None = None, body: str = "", cause: str = "",
        servers: tuple[str, ...] = (),
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.body = body
        self.cause = cause
        self.servers = servers

    @property
    def is_data_error(self) -> bool:
        """True when Gym refused the row itself (an HTTP 4xx other than 404, 408 and 429: e.g. 422, its
        request validation): a malformed row, which no retry of the unchanged row can fix. A 404 (no such
        route: a wrong agent URL), a timeout and a rate limit are not the row's fault."""
        code = self.status_code
        return code is not None and 400 <= code < 500 and code not in NOT_DATA_ERRORS

    def record(self) -> dict[str, Any]:
        """What a completion keeps of the error (its `env_extras["gym_error"]`): the whole body included."""
        return {"status_code": self.status_code, "cause": self.cause, "servers": list(self.servers),
                "body": self.body}


NOT_DATA_ERRORS = frozenset({404, 408, 429})
"""HTTP 4xx answers to `/run` that are not the row's fault (see `GymRowError.is_data_error`)."""


_INNER_SERVER = re.compile(
    r"Hit an exception (?:in (?P<server>\S+) )?calling an inner server: (?P<inner>b(?P<q>['\"]).*(?P=q))\s*$",
    re.DOTALL,
)
MAX_ERROR_NESTING = 32
"""Most layers `innermost_gym_error` unwraps (Gym nests one per server; a cycle cannot occur, but bound it)."""


def innermost_gym_error(body: str) -> tuple[str, tuple[str, ...]]:
    """(the innermost error text, the Gym servers it passed through, outermost first) of a Gym error body.

    Each Gym server that gets an error from a server it calls answers 500 with a JSON string
    `"Hit an exception in <server> calling an inner server: b'<the inner body>'"`, so the policy server's
    own `{"error": {"message": ...}}` ends up several escaped layers down. This unwraps the JSON strings and
    bytes literals and reads the message of an OpenAI/FastAPI error object (`error.message`, `detail`).
    Text that is none of these is returned as it is.
    """
    text, servers = body.strip(), []
    for _ in range(MAX_ERROR_NESTING):
        try:
            value = json.loads(text)
        except ValueError:
            value = text
        if isinstance(value, dict):
            value = _error_message(value)
        if not isinstance(value, str):
            return text, tuple(servers)
        match = _INNER_SERVER.match(value.strip())
        if match is None:
            return value.strip(), tuple(servers)
        if match["server"]:
            servers.append(match["server"])
        try:
            inner = ast.literal_eval(match["inner"])
        except (ValueError, SyntaxError):
            return value.strip(), tuple(servers)
        text = (inner.decode("utf-8", errors="replace") if isinstance(inner, bytes) else str(inner)).strip()
    return text, tuple(servers)


def _error_message(value: Mapping[str, Any]) -> Any:
    """The message of an error object: `{"error": {"message": m}}`, `{"error": m}`, `{"message": m}`,
    `{"detail": d}` (FastAPI; a list of validation errors becomes JSON text); else the object itself."""
    error = value.get("error")
    if isinstance(error, Mapping) and isinstance(error.get("message"), str):
        return error["message"]
    for key in ("error", "message"):
        if isinstance(value.get(key), str):
            return value[key]
    if "detail" in value:
        detail = value["detail"]
        return detail if isinstance(detail, str) else json.dumps(detail)
    return value


class GymServerDownError(GymError):
    """A server the row depends on is down; the row was not (or no longer) retried."""


def agent_urls_from_server_instances(instances: list[Mapping[str, Any]]) -> dict[str, str]:
    """Agent name -> base URL from the head server's `GET /server_instances` (the name is `config_path`)."""
    return {
        i["config_path"]: i["url"].rstrip("/")
        for i in instances
        if i.get("server_type") == AGENT_SERVER_TYPE and i.get("config_path") and i.get("url")
    }


def agent_name_of(row: Mapping[str, Any]) -> str:
    """The row's `agent_ref.name`; raises naming what is missing."""
    ref = row.get("agent_ref")
    if not isinstance(ref, Mapping) or not isinstance(ref.get("name"), str):
        raise ValueError(f"row has no agent_ref.name (agent_ref={ref!r})")
    return ref["name"]


def _summary(failure: Mapping[str, Any], limit: int = 400) -> str:
    """One readable line of a failed attempt: status, innermost cause, the servers it passed through."""
    cause = failure.get("cause", "")
    cause = cause if len(cause) <= limit else f"{cause[:limit]}... ({len(cause)} characters)"
    status = f"HTTP {failure['status_code']}: " if failure.get("status_code") is not None else ""
    servers = failure.get("servers") or ()
    return status + cause + (f" (via {' -> '.join(servers)})" if servers else "")


class GymClient:
    """Sends rows to Gym agent servers with a concurrency limit, per-row timeout, retries and health checks."""

    def __init__(
        self,
        *,
        head_server_url: str | None = None,
        agent_urls: Mapping[str, str] | None = None,
        servers: Mapping[str, GymServer] | None = None,
        max_concurrency: int = 64,
        row_timeout_s: float = 600.0,
        max_attempts: int = 3,
        retry_backoff_s: float = 1.0,
        aggregate_timeout_s: float = 30.0,
        health_interval_s: float | None = 1.0,
        health_timeout_s: float = 5.0,
        health_failures: int = 3,
    ) -> None:
        """`servers`: every Gym server with what it calls (from the launcher); agents alone are probed without it.

        `health_interval_s`: seconds between health probes while rows are pending (None: no probes).
        """
        if not head_server_url and not agent_urls:
            raise ValueError("GymClient needs head_server_url or agent_urls")
        self.head_server_url = head_server_url.rstrip("/") if head_server_url else None
        self._agent_urls = {k: v.rstrip("/") for k, v in (agent_urls or {}).items()}
        self.row_timeout_s = row_timeout_s
        self.max_attempts = max_attempts
        self.retry_backoff_s = retry_backoff_s
        self.aggregate_timeout_s = aggregate_timeout_s
        self._semaphore = asyncio.Semaphore(max_concurrency)
        limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(row_timeout_s, connect=10.0), limits=limits)
        self.health: HealthMonitor | None = None
        if health_interval_s is not None:
            self.health = HealthMonitor(servers or {}, interval_s=health_interval_s, timeout_s=health_timeout_s,
                                        failures=health_failures)
            self._know_agents()

    def _know_agents(self) -> None:
        if self.health is not None:
            for name, url in self._agent_urls.items():
                self.health.add(GymServer(name, AGENT_SERVER_TYPE, url))

    async def agent_urls(self) -> dict[str, str]:
        """Agent name -> URL, discovered from the head server on first use."""
        if not self._agent_urls and self.head_server_url:
            url = f"{self.head_server_url}/server_instances"
            try:
                response = await self._http.get(url, timeout=30.0)
                response.raise_for_status()
                instances = response.json()
            except (httpx.HTTPError, ValueError) as exc:
                raise GymError(f"Gym head server {self.head_server_url} unusable ({url}): {exc!r}") from exc
            self._agent_urls = agent_urls_from_server_instances(instances)
            if not self._agent_urls:
                raise GymError(f"Gym head server {self.head_server_url} lists no agent servers")
            if self.health is not None:
                for server in (await self._discover_servers(instances)).values():
                    self.health.add(server)
            self._know_agents()
        return dict(self._agent_urls)

    async def _discover_servers(self, instances: list[Mapping[str, Any]]) -> dict[str, GymServer]:
        """Every server of the head server's config, with what each calls (empty if the config is unreadable)."""
        urls = {i["config_path"]: i["url"] for i in instances if i.get("config_path") and i.get("url")}
        try:
            response = await self._http.get(f"{self.head_server_url}/global_config_dict_yaml", timeout=30.0)
            response.raise_for_status()
            cfg = yaml.safe_load(response.json())  # a JSON string holding YAML
        except (httpx.HTTPError, ValueError, yaml.YAMLError) as exc:
            logger.warning("Gym head server %s: no config to learn server dependencies from (%r); "
                           "only the agents are health-checked", self.head_server_url, exc)
            return {}
        return servers_from_config(cfg, urls) if isinstance(cfg, Mapping) else {}

    async def url_for(self, agent: str) -> str:
        urls = await self.agent_urls()
        if agent not in urls:
            raise GymError(f"unknown Gym agent {agent!r}; known agents: {sorted(urls)}")
        return urls[agent]

    async def _down(self, agent: str, label: str) -> None:
        """Raise GymServerDownError when a server the agent depends on is down (probing it once more first)."""
        if self.health is None:
            return
        names = self.health.closure(agent)
        if self.health.down_reason(names) is not None:
            await self.health.probe_now(names)  # it may be back
            reason = self.health.down_reason(names)
            if reason is not None:
                raise GymServerDownError(f"{label} (agent {agent!r}): {reason}; not retried")

    async def _post(self, url: str, row: Mapping[str, Any], agent: str, label: str) -> httpx.Response:
        """POST the row, bounded by the row timeout and abandoned as soon as a server it needs is down."""
        post = asyncio.wait_for(self._http.post(url, json=dict(row)), self.row_timeout_s)
        if self.health is None:
            return await post
        return await self._post_watched(post, agent, label)

    async def _post_watched(self, call: Any, agent: str, label: str, outcome: str = "not retried") -> httpx.Response:
        """Await the request `call` unless a server the agent needs is found down first (GymServerDownError
        ending in `outcome`)."""
        assert self.health is not None
        post = asyncio.ensure_future(call)
        watch = asyncio.ensure_future(self.health.wait_down(self.health.closure(agent)))
        try:
            await asyncio.wait({post, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (post, watch):
                task.cancel()
        if post.done() and not post.cancelled():
            return post.result()
        raise GymServerDownError(f"{label} (agent {agent!r}): {watch.result()}; {outcome}")

    async def run(self, row: Mapping[str, Any], label: str = "row") -> dict[str, Any]:
        """POST one row to its agent's `/run` and return the result, retrying failures."""
        if "responses_create_params" not in row:
            raise ValueError(f"{label}: missing 'responses_create_params' (keys: {sorted(row)})")
        agent = agent_name_of(row)
        url = f"{await self.url_for(agent)}/run"
        if self.health is None:
            return await self._attempts(row, agent, url, label)
        async with self.health.watching():  # the servers are probed while any row is pending
            return await self._attempts(row, agent, url, label)

    async def _attempts(self, row: Mapping[str, Any], agent: str, url: str, label: str) -> dict[str, Any]:
        delay = self.retry_backoff_s
        last: dict[str, Any] = {}
        for attempt in range(1, self.max_attempts + 1):
            await self._down(agent, label)
            async with self._semaphore:
                await self._down(agent, label)
                try:
                    response = await self._post(url, row, agent, label)
                except (httpx.HTTPError, TimeoutError) as exc:
                    cause = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                    last = {"cause": cause}
                else:
                    if response.status_code == 200:
                        return response.json()
                    cause, servers = innermost_gym_error(response.text)
                    last = {"status_code": response.status_code, "body": response.text, "cause": cause,
                            "servers": servers}
                    if 400 <= response.status_code < 500 and response.status_code not in (408, 429):
                        break  # the row (or its URL) is bad; retrying won't help
            if attempt < self.max_attempts:
                logger.warning("%s -> %s failed (%s); attempt %d/%d in %.1fs", label, url, _summary(last),
                               attempt + 1, self.max_attempts, delay)
                await asyncio.sleep(delay)
                delay *= 2
        await self._down(agent, label)  # say which server is down rather than the last symptom
        raise GymRowError(f"{label} (agent {agent!r}): {_summary(last)} (at {url}, after {attempt} attempt(s))",
                          **last)

    async def aggregate_metrics(self, agent: str, results: list[Mapping[str, Any]]) -> dict[str, Any]:
        """Gym's own aggregate of an agent's results (`POST /aggregate_metrics`), within `aggregate_timeout_s`.

        A server the agent depends on that is known to be down skips the call at once (GymServerDownError
        naming it); one found down during the call abandons it. A timeout raises GymError."""
        url = f"{await self.url_for(agent)}/aggregate_metrics"
        label = "aggregate metrics"
        if self.health is not None:
            reason = self.health.down_reason(self.health.closure(agent))
            if reason is not None:
                raise GymServerDownError(f"{label} (agent {agent!r}): {reason}; skipped")
        call = self._http.post(url, json={"verify_responses": list(results)}, timeout=self.aggregate_timeout_s)
        try:
            if self.health is None:
                response = await asyncio.wait_for(call, self.aggregate_timeout_s)
            else:
                async with self.health.watching():
                    post = asyncio.wait_for(call, self.aggregate_timeout_s)
                    response = await self._post_watched(post, agent, label, "abandoned")
        except (TimeoutError, httpx.TimeoutException):
            raise GymError(f"{url} did not answer within gym.aggregate_timeout_s={self.aggregate_timeout_s:g}") from None
        if response.status_code != 200:
            raise GymError(f"{url} answered HTTP {response.status_code}: {response.text[:300]}")
        return response.json()

    async def aclose(self) -> None:
        if self.health is not None:
            await self.health.aclose()
        await self._http.aclose()
