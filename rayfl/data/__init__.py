"""Datasets as numpy arrays, partitioners, and federations (client splits + public split).

Importing this package registers the built-in datasets and partitioners; it never imports
ray or mlflow.
"""

from rayfl.data.datasets import ArrayDataset, load_dataset
from rayfl.data.federated import ClientSplit, Federation, build_federation

__all__ = ["ArrayDataset", "ClientSplit", "Federation", "build_federation", "load_dataset"]
