"""graphrl: a declarative dataflow-graph compiler for reinforcement-learning jobs on large language models."""

__version__ = "0.1.0"
