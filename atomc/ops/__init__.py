"""atomc's custom ops: the contract that models, passes and kernels share.

Importing this package registers every `torch.ops.atomc.*` op (schema + fake impl + reference).
"""

from atomc.ops import attention  # noqa: F401
from atomc.ops import norm  # noqa: F401, E402
from atomc.ops import activation  # noqa: F401, E402
from atomc.ops import rope  # noqa: F401, E402
from atomc.ops import rope_kv  # noqa: F401, E402
from atomc.ops import paged_attention  # noqa: F401, E402
