"""Split models (extractor + head), the architecture zoo and heterogeneity families."""

from rayfl.models.base import SplitModel, build_model

__all__ = ["SplitModel", "build_model"]
