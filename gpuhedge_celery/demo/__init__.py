"""``gpuhedge-celery demo``: everything on one laptop, simulated, no accounts and no spend."""
