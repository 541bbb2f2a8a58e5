"""Split models (extractor + head), the architecture zoo and heterogeneity families.

Importing this package registers the built-in architectures (`MODELS`) and families
(`FAMILIES`).
"""

from rayfl.models import zoo  # noqa: F401  (registration)
from rayfl.models.base import MODELS, SplitModel, build_model
from rayfl.models.families import FAMILIES

__all__ = ["FAMILIES", "MODELS", "SplitModel", "build_model"]
