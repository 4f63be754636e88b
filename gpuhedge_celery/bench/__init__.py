"""Benchmarks behind ``gpuhedge-celery bench``; each module exposes a click ``command``."""
