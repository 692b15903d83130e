"""Training data: the Dataset contract, loading options, chat roles and the loaders."""

from dew_lib.data.chat import Role
from dew_lib.data.chat_messages import ChatMessages
from dew_lib.data.dataset import Batch, Dataset, Partition
from dew_lib.data.loading import Loading
from dew_lib.data.preference import PreferencePairs
from dew_lib.data.prompts import Prompts, text_field
from dew_lib.data.readers import DataError, HFOptions
from dew_lib.data.template import TemplateRewrite
from dew_lib.data.tokenizer import vocab_size_for
from dew_lib.data.unpaired import UnpairedExamples

__all__ = ["Batch", "ChatMessages", "DataError", "Dataset", "HFOptions", "Loading", "Partition",
           "PreferencePairs", "Prompts", "Role", "TemplateRewrite", "UnpairedExamples", "text_field",
           "vocab_size_for"]
