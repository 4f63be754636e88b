"""Benchmarks behind ``gpuhedge-celery bench``: each module with a click ``command`` is one
sub-command; the others (fake servers, shared rows) are their helpers."""
