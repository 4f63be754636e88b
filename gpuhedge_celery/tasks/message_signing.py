"""Celery message signing (the ``auth`` serializer), turned on from the environment.

A fleet whose broker others can write to signs every task and remote-control message with a
private key and accepts only messages signed by a certificate it trusts (docs/security.md):

=================================  ==========  ===============================================
variable                           default     meaning
=================================  ==========  ===============================================
GPUHEDGE_SECURITY_KEY              none        PEM private key this process signs with
GPUHEDGE_SECURITY_CERTIFICATE      none        PEM certificate of that key
GPUHEDGE_SECURITY_CERT_STORE       none        trusted certificates: a directory, a file or a
                                               glob (``/etc/gpuhedge/certs/*.pem``)
GPUHEDGE_SECURITY_KEY_PASSWORD     none        the key's passphrase, if it has one
GPUHEDGE_SECURITY_DIGEST           sha256      the signature's digest
=================================  ==========  ===============================================

All three paths or none: signing half-configured is refused at start-up, naming what is
missing. Results and task events stay JSON (they are not commands); a worker refuses any task
or remote-control message that is not signed by a trusted certificate.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError

PATHS = (
    ("key", "GPUHEDGE_SECURITY_KEY"),
    ("certificate", "GPUHEDGE_SECURITY_CERTIFICATE"),
    ("cert_store", "GPUHEDGE_SECURITY_CERT_STORE"),
)
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
        values = {name: (env.get(var) or "").strip() for name, var in PATHS}
        if not any(values.values()):
            return None
        for name, var in PATHS:
            if not values[name]:
                others = ", ".join(v for n, v in PATHS if values[n])
                raise ConfigError(f"message signing needs it too ({others} is set)", key=var)
        for name, var in PATHS[:2]:
            if not os.path.isfile(values[name]):
                raise ConfigError(f"no such file: {values[name]!r}", key=var)
        if not (glob.glob(values["cert_store"]) or os.path.exists(values["cert_store"])):
            raise ConfigError(
                f"no certificate at {values['cert_store']!r}", key="GPUHEDGE_SECURITY_CERT_STORE"
            )
        digest = (env.get("GPUHEDGE_SECURITY_DIGEST") or "sha256").strip()
        return cls(
            key=values["key"],
            certificate=values["certificate"],
            cert_store=values["cert_store"],
            key_password=env.get("GPUHEDGE_SECURITY_KEY_PASSWORD") or None,
            digest=digest,
        )

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
