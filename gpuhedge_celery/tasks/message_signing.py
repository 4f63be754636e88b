"""Celery message signing (the ``auth`` serializer), turned on from the environment.

A fleet whose broker others can write to signs every task and remote-control message with a
private key and accepts only messages signed by a certificate it trusts (docs/security.md).
Turned on by the ``GPUHEDGE_SECURITY_*`` variables (``settings.current().signing``, parsed by
:func:`gpuhedge_celery.envvars.signing_values`; docs/configuration.md, *Environment variables*).
All three paths or none: signing half-configured is refused at start-up, naming what is
missing. Results and task events stay JSON (they are not commands); a worker refuses any task
or remote-control message that is not signed by a trusted certificate.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..envvars import SIGNING_PATHS, signing_values

PATHS = SIGNING_PATHS  # (field, variable) of the three paths
# decoders left on besides ``auth``: results and task events are JSON
ALLOWED_SERIALIZERS = ["json"]


@dataclass(frozen=True)
class Signing:
    """Where this process's signing key, its certificate and the trusted certificates are."""

    key: str
    certificate: str
    cert_store: str
    key_password: str | None = field(default=None, repr=False)
    digest: str = "sha256"

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Signing | None:
        """The signing settings of ``env``; None when signing is off (no variable set)."""
        values = signing_values(env)
        return None if values is None else cls(**values)

    def celery_conf(self) -> dict[str, Any]:
        """The Celery settings that sign what this process sends and verify what it takes."""
        return {
            "task_serializer": "auth",
            "accept_content": ["auth"],
            "security_key": self.key,
            "security_certificate": self.certificate,
            "security_cert_store": self.cert_store,
            "security_digest": self.digest,
        }


def enable(celery_app: Any, signing: Signing | None) -> None:
    """Register the ``auth`` serializer on ``celery_app`` (a no-op when signing is off)."""
    if signing is None:
        return
    from kombu.serialization import registry

    password = signing.key_password.encode() if signing.key_password else None
    # registered by an earlier app of this process: kept on, or its own set-up turns it off
    known = ["auth"] if "auth" in registry.name_to_type else []
    celery_app.setup_security(
        allowed_serializers=[*ALLOWED_SERIALIZERS, *known],
        key_password=password,
        digest=signing.digest,
        serializer="json",
    )
