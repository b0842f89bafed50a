"""Which of a suite's tasks a model can run, and the note of each one it skips.

`runnable_tasks` splits a suite (lm_eval tasks only against an endpoint, image tasks only
on a model whose images reach it); `processor_problem` says why an image-text checkpoint's
processor cannot be built here. Used by the in-process runners (runners.evaluate) and
the endpoint runner.
"""

from __future__ import annotations

from pathlib import Path

from moeflow.core.errors import UserError
from moeflow.evaluation.suite import Suite, Task


def runnable_tasks(suite: Suite, multimodal: bool, why: str,
                   endpoint: bool = False) -> tuple[list[Task], dict[str, str]]:
    """Split a suite into tasks this model can run and skipped ones (with a note).

    `lm_eval` tasks run only against an endpoint (`endpoint=True`).

    Raises:
        UserError: a task marked `required` cannot run on this model.
    """
    keep, skipped = [], {}
    for task in suite.tasks:
        if task.spec.type == "lm_eval" and not endpoint:
            if task.spec.required:
                raise UserError(f"{suite.path}: task {task.name} is required but lm_eval "
                                f"tasks run only against a served model (--endpoint URL)")
            skipped[task.name] = (f"skipped: task {task.name} is an lm_eval task; it runs "
                                  f"only against a served model (--endpoint URL)")
        elif task.spec.type == "multimodal" and not multimodal:
            note = f"skipped: task {task.name} needs images; {why}"
            if task.spec.required:
                raise UserError(f"{suite.path}: task {task.name} is required but {why}")
            skipped[task.name] = note
        else:
            keep.append(task)
    return keep, skipped


def processor_problem(model_dir: str | Path) -> str | None:
    """Why an image-text checkpoint's processor cannot be built here (None: it can).

    Without one no image reaches the model, so the suite's multimodal tasks are
    skipped with this note rather than failing the whole evaluation (e.g. a
    checkpoint without preprocessor_config.json, or a processor needing torchvision).
    """
    # lazy: transformers: heavy, loaded only when this runs; loads torch, which importing this module does not
    from transformers import AutoTokenizer

    from moeflow.model.multimodal import load_processor

    try:
        load_processor(model_dir, AutoTokenizer.from_pretrained(str(model_dir)))
    except (UserError, OSError, ValueError, ImportError) as exc:
        return f"its processor cannot be built: {str(exc).strip().splitlines()[0]}"
    return None
