"""Configuration of the ``http`` adapter: a job API described in YAML, and its small template
language (``${ENV}`` variables, ``{job_id}`` / ``{request...}`` placeholders, dotted paths).

YAML (RunPod-shaped; see docs/configuration.md for every key)::

    http:
      base_url: "${RUNPOD_API_BASE:-https://api.runpod.ai}/v2/${RUNPOD_ENDPOINT_ID}"
      headers: {authorization: "${RUNPOD_API_KEY}"}
      timeouts: {connect_s: 5, read_s: 30}   # read_s bounds a whole response, not one read
      max_response_bytes: 67108864         # a larger response is a ProviderError (64 MiB)
      submit: {method: POST, url: /run, body: {input: "{request}"}, job_id: id}
      status: {method: GET, url: "/status/{job_id}", state: status,
               payload: output.audio_base64, error: error,
               metrics: {delay_ms: delayTime, execution_ms: executionTime}}
      cancel: {method: POST, url: "/cancel/{job_id}"}
      state_map: {DONE: COMPLETED}     # merged over the case-insensitive defaults
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from ..core.jobs import JobState
from ..errors import ConfigError
from .bounded_read import DEFAULT_MAX_RESPONSE_BYTES
from .options import Block

#: provider state names understood without any ``state_map`` (compared case-insensitively)
DEFAULT_STATE_MAP: dict[str, JobState] = {
    "IN_QUEUE": JobState.QUEUED,
    "QUEUED": JobState.QUEUED,
    "PENDING": JobState.QUEUED,
    "IN_PROGRESS": JobState.IN_PROGRESS,
    "RUNNING": JobState.IN_PROGRESS,
    "STARTED": JobState.IN_PROGRESS,
    "COMPLETED": JobState.COMPLETED,
    "SUCCEEDED": JobState.COMPLETED,
    "SUCCESS": JobState.COMPLETED,
    "FAILED": JobState.FAILED,
    "ERROR": JobState.FAILED,
    "CANCELLED": JobState.CANCELLED,
    "CANCELED": JobState.CANCELLED,
    "TIMED_OUT": JobState.TIMEOUT,
    "TIMEOUT": JobState.TIMEOUT,
}

_ENV_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
_PLACEHOLDER_RE = re.compile(r"\{(job_id|request(?:\.[A-Za-z0-9_\-]+)*)\}")
_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")
_SCOPES = ("request", "container", "unknown")


def substitute_env(text: str, env: Mapping[str, str], *, file: str | None, key: str) -> str:
    """Replace ``${VAR}`` / ``${VAR:-default}``; an unset variable without default is an error."""

    def value(match: re.Match[str]) -> str:
        name, default = match.group(1), match.group(2)
        found = env.get(name)
        if found is None or found == "":
            if default is not None:
                return default
            raise ConfigError(f"environment variable {name} is not set", file=file, key=key)
        return found

    return _ENV_RE.sub(value, text)


def env_names(text: str) -> list[str]:
    """The ``${VAR}`` names referenced in ``text``."""
    return [m.group(1) for m in _ENV_RE.finditer(text)]


class MissingField(LookupError):
    """A dotted path that does not exist in a response."""


def get_path(data: Any, path: str) -> Any:
    """Follow a dotted path (``output.audio_base64``, ``items.0.id``) through dicts and lists."""
    current = data
    for part in path.split("."):
        if isinstance(current, Mapping) and part in current:
            current = current[part]
        elif isinstance(current, list) and part.lstrip("-").isdigit():
            index = int(part)
            if not -len(current) <= index < len(current):
                raise MissingField(path)
            current = current[index]
        else:
            raise MissingField(path)
    return current


def render(template: Any, request: Any, job_id: str | None = None) -> Any:
    """Fill a body template: a string that is exactly ``{request}`` / ``{request.a.b}`` /
    ``{job_id}`` becomes that value with its JSON type; inside longer strings, text."""
    if isinstance(template, str):
        whole = _PLACEHOLDER_RE.fullmatch(template)
        if whole:
            return _lookup(whole.group(1), request, job_id)
        return _PLACEHOLDER_RE.sub(lambda m: str(_lookup(m.group(1), request, job_id)), template)
    if isinstance(template, Mapping):
        return {k: render(v, request, job_id) for k, v in template.items()}
    if isinstance(template, list):
        return [render(v, request, job_id) for v in template]
    return template


def _lookup(name: str, request: Any, job_id: str | None) -> Any:
    if name == "job_id":
        return job_id
    if name == "request":
        return request
    try:
        return get_path(request, name[len("request.") :])
    except MissingField:
        raise KeyError(f"request has no field {name[len('request.') :]!r}") from None


def fill_url(template: str, job_id: str | None) -> str:
    """Put the job id into a URL template, percent-encoded (ids may hold ``/`` and ``?``)."""
    if job_id is None:
        return template
    return template.replace("{job_id}", quote(job_id, safe=""))


@dataclass(frozen=True)
class Endpoint:
    """One call of the job API and where its answer keeps the fields we need."""

    method: str
    url: str
    body: Any = None
    job_id: str | None = None
    state: str | None = None
    payload: str | None = None
    error: str | None = None
    metrics: Mapping[str, str] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """``METHOD url-template`` for errors (never the resolved URL: it may hold secrets)."""
        return f"{self.method} {self.url}"

    @classmethod
    def parse(cls, block: Block, *, default_method: str, needs: tuple[str, ...] = ()) -> Endpoint:
        endpoint = cls(
            method=block.string("method", default_method, choices=_METHODS),
            url=block.string("url"),
            body=block.raw("body", None),
            job_id=block.string("job_id", None),
            state=block.string("state", None),
            payload=block.string("payload", None),
            error=block.string("error", None),
            metrics=block.string_map("metrics"),
        )
        for name in needs:
            if getattr(endpoint, name) is None:
                raise block.error(name, "required key is missing (a dotted path in the response)")
        block.finish()
        return endpoint


@dataclass(frozen=True)
class HttpSpec:
    """A parsed ``http:`` block; strings still hold their ``${VAR}`` references."""

    base_url: str
    headers: Mapping[str, str]
    submit: Endpoint
    status: Endpoint
    cancel: Endpoint
    result: Endpoint | None = None
    state_map: Mapping[str, JobState] = field(default_factory=dict)
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 30.0
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES
    poll_interval_s: float = 0.5
    cancel_confirm_s: float = 10.0
    max_poll_errors: int = 3
    reports_queue_state: bool = True
    cancel_scope: str = "request"
    terminal_stops_billing: bool = False
    where: str = ""
    file: str | None = None

    def map_state(self, raw: Any) -> JobState:
        """The JobState for a provider's state string (case-insensitive), UNKNOWN if unmapped."""
        if not isinstance(raw, str):
            return JobState.UNKNOWN
        key = raw.strip().upper()
        return self.state_map.get(key) or DEFAULT_STATE_MAP.get(key) or JobState.UNKNOWN

    @classmethod
    def from_block(cls, block: Block, *, time_scale: float | None = None) -> HttpSpec:
        base_url = block.string("base_url", "")
        headers = block.string_map("headers")
        timeouts = block.mapping("timeouts")
        connect_s = timeouts.number("connect_s", 5.0, positive=True)
        read_s = timeouts.number("read_s", 30.0, positive=True)
        timeouts.finish()
        submit = Endpoint.parse(block.mapping("submit"), default_method="POST", needs=("job_id",))
        status = Endpoint.parse(block.mapping("status"), default_method="GET", needs=("state",))
        cancel = Endpoint.parse(block.mapping("cancel"), default_method="POST")
        result = None
        if block.has("result"):
            result = Endpoint.parse(block.mapping("result"), default_method="GET")
        state_map: dict[str, JobState] = {}
        states_block = block.mapping("state_map")
        for raw, target in block.string_map("state_map").items():
            if target.upper() not in JobState.__members__:
                names = ", ".join(JobState.__members__)
                raise states_block.error(raw, f"expected one of {names}, got {target!r}")
            state_map[raw.strip().upper()] = JobState[target.upper()]
        spec = cls(
            base_url=base_url,
            headers=headers,
            submit=submit,
            status=status,
            cancel=cancel,
            result=result,
            state_map=state_map,
            connect_timeout_s=connect_s,
            read_timeout_s=read_s,
            max_response_bytes=block.number(
                "max_response_bytes", DEFAULT_MAX_RESPONSE_BYTES, integer=True, minimum=1
            ),
            poll_interval_s=block.number("poll_interval_s", 0.5, positive=True),
            cancel_confirm_s=block.number("cancel_confirm_s", 10.0, positive=True),
            max_poll_errors=block.number("max_poll_errors", 3, integer=True, minimum=1),
            reports_queue_state=block.boolean("reports_queue_state", True),
            cancel_scope=block.string("cancel_scope", "request", choices=_SCOPES),
            terminal_stops_billing=block.boolean("terminal_stops_billing", False),
            where=block.where,
            file=block.file,
        )
        for name, endpoint in (("submit", submit), ("status", status), ("cancel", cancel)):
            if not base_url and not endpoint.url.startswith(("http://", "https://", "${")):
                raise block.error(f"{name}.url", "relative URL but no base_url is set")
        for name, endpoint in (("status", status), ("cancel", cancel)):
            if "{job_id}" not in endpoint.url and endpoint.body is None:
                raise block.error(f"{name}.url", "expected a {job_id} placeholder (or a body)")
        block.finish()
        return spec
