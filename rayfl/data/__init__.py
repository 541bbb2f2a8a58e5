"""Datasets as numpy arrays, partitioners, and federations (client splits + public split).

Importing this package registers the built-in datasets (`DATASETS`) and partitioners
(`PARTITIONERS`); it never imports ray or mlflow.
"""

from rayfl.data import images  # noqa: F401  (registration)
from rayfl.data.datasets import DATASETS, ArrayDataset, load_dataset
from rayfl.data.federated import ClientSplit, Federation, build_federation
from rayfl.data.partition import PARTITIONERS

__all__ = [
    "DATASETS",
    "PARTITIONERS",
    "ArrayDataset",
    "ClientSplit",
    "Federation",
    "build_federation",
    "load_dataset",
]
