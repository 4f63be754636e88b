"""Webhook completions: providers push a job's end instead of being polled for it.

- :mod:`.settings`: ``GPUHEDGE_WEBHOOK_URL`` (the receiver's public base URL, behind the
  operator's TLS ingress), ``GPUHEDGE_WEBHOOK_SECRET`` (never logged), the fallback poll
  interval and the body cap;
- :mod:`.token`: the per-attempt token (an HMAC of race and attempt) each job's URL carries;
- :mod:`.apply`: a valid delivery becomes the engine event a poll would have produced, applied
  through the race driver (the same ``conclude`` a poll uses);
- :mod:`.app`: the ASGI application ``gpuhedge-celery webhooks`` serves with uvicorn.
"""
