"""Redis URLs: a plain server (``redis://``, ``rediss://``, ``unix://``), a Sentinel group, or a
Redis Cluster.

A Sentinel group is written the way kombu and Celery write it, Sentinels separated by ``;``,
with the master's name (and, when the Sentinels have their own, their password) in the query::

    sentinel://:PASSWORD@h1:26379/0;sentinel://h2:26379;sentinel://h3:26379?master=mymaster

As in kombu and Celery, the first Sentinel carries the data nodes' (primary and replicas) user
and password and the database; a later one that says another database or password is refused
rather than read differently by the store and by Celery. ``?ssl=true`` speaks TLS to the
Sentinels and the data nodes (``ssl_ca_certs=PATH`` for a private CA). The query is ours:
:func:`celery_url` strips it before Celery or kombu see the URL, and hands the master's name,
the Sentinels' password and TLS over as their options (:func:`celery_transport_options`,
:func:`celery_ssl_options`).

A Redis Cluster is said by its scheme alone, seed nodes separated by ``,``::

    redis+cluster://[USER:PASSWORD@]h1:7000,h2:7001,h3:7002[/0][?ssl_ca_certs=PATH]

``rediss+cluster://`` speaks TLS to every node (``ssl_ca_certs=PATH`` for a private CA). The
user and password are every node's; a cluster has database 0 only. Only the store reads it:
Celery and kombu cannot use a cluster, so the broker and Celery's results then live on
``GPUHEDGE_BROKER_URL`` (``tasks/config.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit

from .errors import ConfigError

SENTINEL = "sentinel"
PLAIN_SCHEMES = ("redis", "rediss", "unix")
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
_CLUSTER_QUERY = ("ssl_ca_certs",)
_TRUE = ("1", "true", "yes", "on")


@dataclass(frozen=True)
class SentinelUrl:
    """A parsed ``sentinel://`` URL (see the module doc)."""

    sentinels: tuple[tuple[str, int], ...]
    master: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_password: str | None = None
    ssl: bool = False
    ssl_ca_certs: str | None = None


@dataclass(frozen=True)
class ClusterUrl:
    """A parsed ``redis+cluster://`` URL (see the module doc)."""

    nodes: tuple[tuple[str, int], ...]
    username: str | None = None
    password: str | None = None
    tls: bool = False
    ssl_ca_certs: str | None = None


def is_sentinel(url: str) -> bool:
    return url.split(":", 1)[0].lower() == SENTINEL


def is_cluster(url: str) -> bool:
    return url.split(":", 1)[0].lower() in CLUSTER_SCHEMES


def _cluster_parts(url: str) -> tuple[str, str, str, str, str]:
    """``url`` cut into scheme, userinfo, hosts, path and query, as written (no checks)."""
    scheme, _, rest = url.partition("://")
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    userinfo, _, hosts = netloc.rpartition("@")
    return scheme.lower(), userinfo, hosts, path, query


def _cluster_node(text: str, url: str, key: str) -> tuple[str, int]:
    if text.startswith("["):  # [IPv6]:port
        host, _, port = text[1:].partition("]")
        port = port.removeprefix(":")
    else:
        host, _, port = text.partition(":")
    if not host:
        raise ConfigError(f"a node without a host in {redact_url(url)!r}", key=key)
    if not port:
        return host, 6379
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"bad port {port!r} in {redact_url(url)!r}", key=key)
    return host, int(port)


def parse_cluster_url(url: str, *, key: str = "GPUHEDGE_REDIS_URL") -> ClusterUrl:
    """``url`` parsed; a :class:`ConfigError` naming ``key`` and what is wrong otherwise."""
    scheme, userinfo, hosts, path, query = _cluster_parts(url)
    if scheme not in CLUSTER_SCHEMES:
        raise ConfigError(f"expected a redis+cluster:// URL, got {redact_url(url)!r}", key=key)
    nodes = tuple(_cluster_node(h.strip(), url, key) for h in hosts.split(",") if h.strip())
    if not nodes:
        raise ConfigError(f"a {scheme}:// URL names no node", key=key)
    if path.strip("/") not in ("", "0"):
        raise ConfigError(
            f"a Redis Cluster has database 0 only, got /{path.strip('/')} in {redact_url(url)!r}",
            key=key,
        )
    options = dict(parse_qsl(query))
    unknown = sorted(set(options) - set(_CLUSTER_QUERY))
    if unknown:
        raise ConfigError(
            f"unknown option {unknown[0]!r} in a {scheme}:// URL (known: ssl_ca_certs)", key=key
        )
    tls = scheme == "rediss+cluster"
    if options.get("ssl_ca_certs") and not tls:
        raise ConfigError("ssl_ca_certs needs TLS: write rediss+cluster://", key=key)
    user, colon, password = userinfo.partition(":")
    return ClusterUrl(
        nodes=nodes,
        username=unquote(user) or None,
        password=unquote(password) if colon else None,
        tls=tls,
        ssl_ca_certs=options.get("ssl_ca_certs") or None,
    )


def _parts(url: str) -> list[str]:
    return [part for part in url.split(";") if part.strip()]


def _query(url: str) -> dict[str, str]:
    found: dict[str, str] = {}
    for part in _parts(url):
        found.update(parse_qsl(urlsplit(part.strip()).query))
    return found


def parse_sentinel_url(url: str, *, key: str = "GPUHEDGE_REDIS_URL") -> SentinelUrl:
    """``url`` parsed; a :class:`ConfigError` naming ``key`` and what is wrong otherwise."""
    sentinels: list[tuple[str, int]] = []
    first: tuple[str | None, str | None, int] | None = None  # user, password, db
    for part in _parts(url):
        pieces = urlsplit(part.strip())
        if pieces.scheme.lower() != SENTINEL:
            raise ConfigError(
                f"every Sentinel in a sentinel:// URL is written sentinel://host:port, got "
                f"{redact_url(part)!r}",
                key=key,
            )
        try:
            port = pieces.port or 26379
        except ValueError:
            raise ConfigError(f"bad port in {redact_url(part)!r}", key=key) from None
        if not pieces.hostname:
            raise ConfigError(f"no Sentinel host in {redact_url(part)!r}", key=key)
        sentinels.append((pieces.hostname, port))
        path = pieces.path.strip("/")
        if path and not path.isdigit():
            raise ConfigError(f"the database must be a number, got {path!r}", key=key)
        user = unquote(pieces.username) if pieces.username else None
        password = unquote(pieces.password) if pieces.password is not None else None
        db = int(path) if path else None
        if first is None:
            first = (user, password, db or 0)
        elif (password is not None and (user, password) != first[:2]) or (
            db is not None and db != first[2]
        ):
            raise ConfigError(
                "the data nodes' password and the database go on the first Sentinel of a "
                "sentinel:// URL (where Celery and kombu read them); a later one says otherwise",
                key=key,
            )
    if first is None:
        raise ConfigError("a sentinel:// URL names no Sentinel", key=key)
    query = _query(url)
    master = query.get("master", "").strip()
    if not master:
        raise ConfigError(
            "a sentinel:// URL needs the master's name: add ?master=NAME or set "
            "GPUHEDGE_REDIS_SENTINEL_MASTER",
            key=key,
        )
    return SentinelUrl(
        sentinels=tuple(sentinels),
        master=master,
        db=first[2],
        username=first[0],
        password=first[1],
        sentinel_password=query.get("sentinel_password") or None,
        ssl=query.get("ssl", "").lower() in _TRUE,
        ssl_ca_certs=query.get("ssl_ca_certs") or None,
    )


def with_sentinel_options(url: str, master: str | None, sentinel_password: str | None) -> str:
    """``url`` with the master's name and the Sentinels' password from the environment added
    to its query where the URL does not already say them; any other URL unchanged."""
    if not is_sentinel(url):
        return url
    query = _query(url)
    extra = {}
    if master and not query.get("master"):
        extra["master"] = master
    if sentinel_password and not query.get("sentinel_password"):
        extra["sentinel_password"] = sentinel_password
    if not extra:
        return url
    return f"{url}{'&' if '?' in url else '?'}{urlencode(extra)}"


def celery_url(url: str) -> str:
    """``url`` as Celery and kombu read it: a Sentinel URL without our query (they would pass
    unknown parameters on to redis-py); any other URL unchanged."""
    if not is_sentinel(url):
        return url
    return ";".join(urlsplit(p.strip())._replace(query="").geturl() for p in _parts(url))


def celery_transport_options(url: str) -> dict[str, object]:
    """The transport options Celery's results and kombu's broker need for ``url``: the master's
    name and the Sentinels' own connection settings; empty for any other URL."""
    if not is_sentinel(url):
        return {}
    spec = parse_sentinel_url(url)
    sentinel_kwargs: dict[str, object] = {}
    if spec.sentinel_password:
        sentinel_kwargs["password"] = spec.sentinel_password
    if spec.ssl:
        sentinel_kwargs["ssl"] = True
    if spec.ssl_ca_certs:
        sentinel_kwargs["ssl_ca_certs"] = spec.ssl_ca_certs
    options: dict[str, object] = {"master_name": spec.master}
    if sentinel_kwargs:
        options["sentinel_kwargs"] = sentinel_kwargs
    return options


def celery_ssl_options(url: str) -> dict[str, object] | None:
    """Celery's ``broker_use_ssl`` / ``redis_backend_use_ssl`` for a Sentinel URL with
    ``ssl=true`` (the data nodes then speak TLS too, certificates checked); None otherwise."""
    if not is_sentinel(url):
        return None
    spec = parse_sentinel_url(url)
    if not spec.ssl:
        return None
    options: dict[str, object] = {"ssl_cert_reqs": "required"}
    if spec.ssl_ca_certs:
        options["ssl_ca_certs"] = spec.ssl_ca_certs
    return options


def redact_url(url: str) -> str:
    """``url`` with every password (each Sentinel's userinfo, the Sentinels' own in the query,
    a cluster's) replaced by ``***``, for logs, errors and repr."""
    if is_cluster(url):
        scheme, userinfo, hosts, path, query = _cluster_parts(url)
        user, colon, _ = userinfo.partition(":")
        shown = f"{user}:***@" if colon else (f"{user}@" if user else "")
        rest = f"/{path}" if path else ""
        return f"{scheme}://{shown}{hosts}{rest}{'?' + query if query else ''}"
    return ";".join(_redact_one(part) for part in url.split(";"))


def _redact_one(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is not None:
        user = parts.username or ""
        host = parts.hostname or ""
        try:
            port = f":{parts.port}" if parts.port else ""
        except ValueError:  # a bad port: shown as written, the password still hidden
            port = ":" + parts.netloc.rpartition(":")[2]
        parts = parts._replace(netloc=f"{user}:***@{host}{port}")
    query = parse_qsl(parts.query, keep_blank_values=True)
    if any("password" in k.lower() for k, _ in query):
        hidden = [(k, "***" if "password" in k.lower() else v) for k, v in query]
        parts = parts._replace(query=urlencode(hidden, safe="*"))
    return parts.geturl()


def location(url: str) -> str:
    """Where ``url`` points, without credentials: the Sentinels and the master's name for a
    Sentinel URL (its primary moves), a cluster's seed nodes, else the redacted URL."""
    if is_cluster(url):
        return cluster_location(parse_cluster_url(url))
    if not is_sentinel(url):
        return redact_url(url)
    spec = parse_sentinel_url(url)
    hosts = ",".join(f"{host}:{port}" for host, port in spec.sentinels)
    return f"sentinel://{hosts}/{spec.db} (master {quote(spec.master)})"


def cluster_location(spec: ClusterUrl) -> str:
    """A cluster's seed nodes as a URL without credentials (``rediss+cluster://`` for TLS)."""
    hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in spec.nodes)
    return f"{'rediss' if spec.tls else 'redis'}+cluster://{hosts}/0"
