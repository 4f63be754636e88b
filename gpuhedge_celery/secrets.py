"""Credentials kept out of what the package writes: one scrubber for every adapter's text.

Every text an adapter keeps (an error, a receipt's note, a job's own error message that a
provider echoed back) passes :func:`scrub_secrets` with the adapter's secrets
(:meth:`~gpuhedge_celery.providers.base.Provider.secrets`) before it can reach a receipt, a
race's state, a Celery result, a task event or a log line.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

# An environment variable's name that says its value is a credential.
SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)
MIN_SECRET = 4  # shorter values would blot out ordinary words
MASK = "***"


def scrub_secrets(text: str, secrets: Iterable[str | None]) -> str:
    """``text`` with every secret of :data:`MIN_SECRET` or more characters replaced by
    :data:`MASK`, longest first (a secret that contains another is masked whole)."""
    for secret in sorted({s for s in secrets if s and len(s) >= MIN_SECRET}, key=len, reverse=True):
        text = text.replace(secret, MASK)
    return text


HTTP_CLIENT_LOGGERS = ("httpx", "httpcore")


def quiet_http_client_logs() -> None:
    """Keep httpx's and httpcore's request lines out of the log: httpx logs each request's URL,
    query included, at INFO, and the URLs adapters call carry credentials (an attempt's webhook
    URL in Cerebrium's query, a key an ``http`` adapter's URL names). Every process the package
    configures (workers, the webhook receiver, the CLI) calls this; warnings still show."""
    for name in HTTP_CLIENT_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def log_to_stderr(level: int | str) -> None:
    """The package's log lines on stderr from ``level`` up (the CLI's ``--log-level``, and the
    receiver processes it starts), httpx's request lines still off."""
    import sys

    logging.basicConfig(level=level, stream=sys.stderr, format=LOG_FORMAT)
    quiet_http_client_logs()
