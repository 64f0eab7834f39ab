"""mtcfs: a multi-tier checkpoint filesystem for ML training jobs."""

__version__ = "0.1.0"
