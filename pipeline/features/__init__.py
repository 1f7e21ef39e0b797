"""The online feature store: declared features (``spec``), the Redis store (``store``), the
bulk loader (``loader``) and the request log the precompute job reads (``requestlog``)."""

from pipeline.features.spec import FEATURE_SET_VERSION, FEATURES, SPECS, FeatureSpec
from pipeline.features.store import FeatureRow, FeatureStore, Lookup

__all__ = [
    "FEATURES",
    "FEATURE_SET_VERSION",
    "SPECS",
    "FeatureRow",
    "FeatureSpec",
    "FeatureStore",
    "Lookup",
]
