"""partialvfl: vertical federated learning when parties, alignments and labels are partial."""

from partialvfl.data.dataset import CoordinatorView, DataValidationError, PartyView, Task, VerticalDataset

__version__ = "0.1.0"

__all__ = ["CoordinatorView", "DataValidationError", "PartyView", "Task", "VerticalDataset", "__version__"]
