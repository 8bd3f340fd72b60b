"""Layer 1: the vertical data model and everything that makes one."""

from partialvfl.data.dataset import CoordinatorView, DataValidationError, PartyView, Task, VerticalDataset
from partialvfl.data.preprocessing import Standardizer

__all__ = ["CoordinatorView", "DataValidationError", "PartyView", "Standardizer", "Task", "VerticalDataset"]
