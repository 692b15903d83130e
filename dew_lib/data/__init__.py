"""Training data: the Dataset contract, loading options and chat roles."""

from dew_lib.data.chat import Role
from dew_lib.data.dataset import Batch, Dataset, Partition
from dew_lib.data.loading import Loading

__all__ = ["Batch", "Dataset", "Loading", "Partition", "Role"]
