"""A placement group whose creator actor died (Ray Train's controller lost with its node) holds
its CPUs until the job ends; the runner releases it when a stage ends, and never a group
the driver, a task or a living actor holds."""

import time

import pytest
import ray
from ray.util.placement_group import placement_group, placement_group_table

from workflows.execute import release_orphaned_placement_groups

pytestmark = pytest.mark.integration


@ray.remote(num_cpus=0)
class Creator:
    def make(self) -> str:
        pg = placement_group([{"CPU": 0.5}])
        ray.get(pg.ready())
        return pg.id.hex()


def _state(pg_id: str) -> str:
    return placement_group_table()[pg_id]["state"]


def test_a_dead_actors_group_is_released_and_no_other(ray_local):
    mine = placement_group([{"CPU": 0.5}])  # the driver's: lives with the job
    ray.get(mine.ready())
    living, dying = Creator.remote(), Creator.remote()
    kept, orphan = ray.get(living.make.remote()), ray.get(dying.make.remote())
    ray.kill(dying)
    deadline = time.time() + 60
    removed: list[str] = []
    while orphan not in removed and time.time() < deadline:  # the GCS learns of the death
        removed += release_orphaned_placement_groups()
        time.sleep(0.5)
    assert removed == [orphan]
    assert _state(orphan) == "REMOVED"
    assert _state(kept) == "CREATED" and _state(mine.id.hex()) == "CREATED"
    assert release_orphaned_placement_groups() == []


def test_a_sigterm_raised_inside_the_sweep_reaches_the_runner(monkeypatch):
    """The SIGTERM handler raises wherever the driver is; inside the sweep's best-effort GCS
    call it must propagate (a run once went on waiting for its stage after a SIGTERM)."""
    from ray._private.state import state

    from workflows.runner import _Interrupted

    def term():
        raise _Interrupted()

    monkeypatch.setattr(state, "_connect_and_get_accessor", term)
    with pytest.raises(_Interrupted):
        release_orphaned_placement_groups()
