"""Config sections owned by each stage (one module per stage).

Every section forbids unknown keys, so a typo is an error naming the key.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, get_args, get_origin

from pydantic import BaseModel, ConfigDict


@dataclass(frozen=True)
class PathRole:
    """Marks a config field as a local path, so the runner knows to make it absolute before
    handing the config to Ray workers (which may start in another directory).

    must_exist: resolve only when the path exists here; otherwise the value may be a name
    (a shipped suite, a hardware spec in cluster/hardware/, a repo-relative profile).
    """

    must_exist: bool


LocalPath = Annotated[str, PathRole(must_exist=False)]  # relative to the driver's directory
ExistingPath = Annotated[str, PathRole(must_exist=True)]  # a path when it exists here, else a name


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


def path_role(field) -> PathRole | None:
    """The PathRole of a pydantic field (`LocalPath`, `ExistingPath | None`, ...), if any."""
    for meta in field.metadata:
        if isinstance(meta, PathRole):
            return meta
    todo = [field.annotation]
    while todo:
        ann = todo.pop()
        if get_origin(ann) is Annotated:
            role = next((m for m in ann.__metadata__ if isinstance(m, PathRole)), None)
            if role:
                return role
        todo += [a for a in get_args(ann) if a is not type(None)]
    return None


def absolute_paths(model: type[BaseModel], data: dict[str, Any]) -> dict[str, Any]:
    """`data` (a `model_dump` of `model`) with every field typed as a local path made
    absolute, in the sections and in dicts of sections (tenant adapters); store URIs
    (`s3://...`) and empty values are left alone."""
    for name, field in model.model_fields.items():
        value = data.get(name)
        role = path_role(field)
        if role and isinstance(value, str) and value and "://" not in value and not Path(value).is_absolute():
            if not role.must_exist or Path(value).exists():
                data[name] = str(Path(value).resolve())
        for sub in _models(field.annotation):
            if isinstance(value, dict) and get_origin(field.annotation) is dict:
                for item in value.values():
                    if isinstance(item, dict):
                        absolute_paths(sub, item)
            elif isinstance(value, dict):
                absolute_paths(sub, value)
    return data


def _models(annotation) -> list[type[BaseModel]]:
    """The pydantic models a field's annotation holds (itself, a dict's values, a union's)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _models(arg)]
