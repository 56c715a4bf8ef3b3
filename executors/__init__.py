"""Executors: the code that runs on each rank of a compiled plan (models, algorithms, runtime)."""
