"""Configuration of the ``cerebrium`` adapter: the ``providers.<name>.cerebrium`` YAML block.

::

    cerebrium:
      project_id: "${CEREBRIUM_PROJECT_ID}"    # p-xxxxxxxx
      app: tts                                 # the app's name
      function: predict                        # the function called
      app_id: null                             # for cancels; default "<project_id>-<app>"
      api_key: "${CEREBRIUM_API_KEY}"          # the inference key (dashboard, API Keys);
                                               # must come from the environment
      rest_token: "${CEREBRIUM_REST_TOKEN}"    # the management API's bearer token (a service
                                               # account's); default: api_key
      api_url: https://api.aws.us-east-1.cerebrium.ai  # inference host of your app's region
                                               # (the host `cerebrium deploy` prints)
      rest_url: https://rest.cerebrium.ai      # management (cancel, login-check)
      payload: result                          # dotted path of the payload in the webhook
                                               # body ("": the whole body)
      timeouts: {connect_s: 5, read_s: 30}

Every key but ``project_id``, ``app``, ``function`` and ``api_key`` is optional. Cerebrium's
management API (``rest_url``) takes a service account's token, which may differ from the
inference key: set ``rest_token`` then, or every cancel is refused with 401.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .options import Block

DEFAULT_API_URL = "https://api.aws.us-east-1.cerebrium.ai"
DEFAULT_REST_URL = "https://rest.cerebrium.ai"
_ENV_ONLY = re.compile(r"^\$\{[A-Za-z_][A-Za-z0-9_]*(?::-[^}]*)?\}\Z")
_SEGMENT = re.compile(r"^(\$\{[A-Za-z_][A-Za-z0-9_]*\}|[A-Za-z0-9_.\-]+)\Z")


@dataclass(frozen=True)
class CerebriumSpec:
    project_id: str
    app: str
    function: str
    api_key: str
    rest_token: str | None = None  # None: the management API takes api_key too
    app_id: str | None = None
    api_url: str = DEFAULT_API_URL
    rest_url: str = DEFAULT_REST_URL
    payload: str = "result"
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 30.0
    where: str = ""
    file: str | None = None

    @classmethod
    def from_block(cls, block: Block) -> CerebriumSpec:
        names = {k: block.string(k) for k in ("project_id", "app", "function")}
        for key, value in names.items():
            if not _SEGMENT.match(value):
                raise block.error(
                    key, f"expected letters, digits, '_', '-', '.' or a ${{VAR}}, got {value!r}"
                )
        api_key = block.string("api_key")
        rest_token = block.string("rest_token", None)
        secrets = (
            ("api_key", api_key, "CEREBRIUM_API_KEY"),
            ("rest_token", rest_token, "CEREBRIUM_REST_TOKEN"),
        )
        for key, value, example in secrets:
            if value is not None and not _ENV_ONLY.match(value.strip()):
                raise block.error(
                    key,
                    f"expected a ${{VAR}} reference (keep the key out of the "
                    f'file: "${{{example}}}"), got a literal value',
                )
        urls = {}
        for key, default in (("api_url", DEFAULT_API_URL), ("rest_url", DEFAULT_REST_URL)):
            url = block.string(key, default).rstrip("/")
            if not url.startswith(("http://", "https://", "${")):
                raise block.error(key, f"expected an http(s):// URL, got {url!r}")
            urls[key] = url
        payload = block.raw("payload", "result")
        if not isinstance(payload, str):
            raise block.error("payload", f'expected a dotted path or "", got {payload!r}')
        timeouts = block.mapping("timeouts")
        spec = cls(
            **names,
            api_key=api_key,
            rest_token=rest_token,
            app_id=block.string("app_id", None),
            **urls,
            payload=payload,
            connect_timeout_s=timeouts.number("connect_s", 5.0, positive=True),
            read_timeout_s=timeouts.number("read_s", 30.0, positive=True),
            where=block.where,
            file=block.file,
        )
        timeouts.finish()
        block.finish()
        return spec
