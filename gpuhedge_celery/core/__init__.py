"""The pure core: lease rules, policies, races, receipts, validators and statistics.

Nothing under ``gpuhedge_celery.core`` imports Celery, Redis or httpx; time comes from an
injected :class:`~gpuhedge_celery.core.clock.Clock`. ``tests/test_layering.py`` enforces this.
"""
