"""Layer 1: the vertical data model and everything that makes one."""

from partialvfl.data.builders import from_arrays, from_blocks, from_csv, from_parquet, from_source, from_tables
from partialvfl.data.dataset import CoordinatorView, DataValidationError, PartyView, Task, VerticalDataset
from partialvfl.data.mechanisms import Mechanism, parse_mechanism
from partialvfl.data.preprocessing import Standardizer
from partialvfl.data.protocol import ProtocolConfig, describe, make_protocol
from partialvfl.data.splitters import parse_splitter, split_source_array

__all__ = [
    "CoordinatorView",
    "DataValidationError",
    "Mechanism",
    "PartyView",
    "ProtocolConfig",
    "Standardizer",
    "Task",
    "VerticalDataset",
    "describe",
    "from_arrays",
    "from_blocks",
    "from_csv",
    "from_parquet",
    "from_source",
    "from_tables",
    "make_protocol",
    "parse_mechanism",
    "parse_splitter",
    "split_source_array",
]
