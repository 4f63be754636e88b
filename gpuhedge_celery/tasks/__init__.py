"""Thin Celery glue: the app, the pooled-inference tasks, the GPU worker role and reconcile.

Importing this package imports nothing heavy; ``gpuhedge_celery.tasks.app`` builds the app.
"""
