"""Benchmark scaffolding that comes with a source checkout, not with the installed package."""
