"""Builders of test models and fixtures (toy task data, tiny offline Marian directories): for tests and benchmarks, never imported by the product."""
