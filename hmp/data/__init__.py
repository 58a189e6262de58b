"""Datasets for training runs and benchmarks, bundled, synthetic or read from local files (never downloaded), split
into CSR rows (:mod:`.csr`), the :class:`Dataset` type (:mod:`.dataset`), generators (:mod:`.synthetic`), file
loaders (:mod:`.loaders`), specs (:mod:`.spec`), scaling (:mod:`.standardize`) and batches (:mod:`.batches`); every
public name is importable from ``hmp.data``. docs/data.md is the user's guide.
"""

from .batches import ShuffledBatches, shard
from .csr import CSRBatch, CSRRows, is_sparse, take_rows, whole_batch
from .dataset import PARTS, Dataset, DataWarning
from .loaders import SVMLIGHT_LINE, TARGETS, load_diabetes_dataset, load_digits_dataset, load_npz, load_svmlight
from .spec import LOADERS, DatasetSpec, LoaderArgumentsError, NotADataset, load_dataset, select
from .standardize import SCALE_RATIO_WARN, FeatureStats, scale_advice, standardize
from .synthetic import generate_click_data, generate_dense_classification, generate_sparse_classification

__all__ = ["LOADERS", "PARTS", "SCALE_RATIO_WARN", "SVMLIGHT_LINE", "CSRBatch", "CSRRows", "DataWarning", "Dataset",
           "DatasetSpec", "FeatureStats", "LoaderArgumentsError", "NotADataset", "ShuffledBatches", "TARGETS",
           "generate_click_data", "generate_dense_classification", "generate_sparse_classification", "is_sparse",
           "load_dataset", "load_diabetes_dataset", "load_digits_dataset", "load_npz", "load_svmlight", "scale_advice", "select", "shard",
           "standardize", "take_rows", "whole_batch"]
