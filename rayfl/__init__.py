"""rayfl: Ray-powered simulation of model-heterogeneous personalized federated learning."""

__version__ = "0.1.0"
