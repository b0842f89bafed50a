"""Config sections owned by each stage (one module per stage).

Every section forbids unknown keys, so a typo is an error naming the key.
"""

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())
