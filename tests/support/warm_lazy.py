"""A warm runner module that only tests/test_model_runners.py loads, to see when it is imported."""

from __future__ import annotations


class Model:
    def run(self, request):
        return {"lazy": request}
