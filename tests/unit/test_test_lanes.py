"""README's test command's scheduler (tests/conftest.py, `--unit-lane`): the unit lane runs tests/unit, waits
while the example runs, then takes the BACKGROUND files in order; the other worker runs everything else, the
solo tests last, then the last of the BACKGROUND files. Driven with stand-in workers, as xdist's controller would."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests import conftest
from tests.conftest import BACKGROUND, LONGEST_FIRST, SHARED_VARIABLE, UNIT_LANE_WORKER


class Worker:
    def __init__(self, name: str):
        self.gateway = SimpleNamespace(id=name)
        self.shutting_down = False
        self.sent: list[int] = []

    def send_runtest_some(self, indices):
        self.sent += indices

    def shutdown(self):
        self.shutting_down = True


EXAMPLE, PPO = LONGEST_FIRST[0], LONGEST_FIRST[2]
COLLECTION = [f"{EXAMPLE}::test_a", f"{EXAMPLE}::test_b", f"{EXAMPLE}::test_c", f"{PPO}::test_learns",
              f"{PPO}::test_stalled",
              "tests/unit/test_x.py::test_one", "tests/unit/test_y.py::test_two",
              *(f"{path}::test_{i}" for path in (BACKGROUND[0], BACKGROUND[1], BACKGROUND[-1]) for i in range(3))]


def start(tmp_path, monkeypatch, collection: list[str]):
    monkeypatch.setenv(SHARED_VARIABLE, str(tmp_path))  # where the workers name the solo tests
    (tmp_path / "solo-tests.txt").write_text(f"{PPO}::test_stalled")
    options = {"dist": "loadfile", "unit_lane": True, "tx": ["2*popen"]}
    config = SimpleNamespace(getvalue=options.get, option=SimpleNamespace(loadscopereorder=False))
    scheduler = conftest.pytest_xdist_make_scheduler(config, None)
    main, unit = Worker("gw0"), Worker(UNIT_LANE_WORKER)
    for worker in (main, unit):
        scheduler.add_node(worker)
        scheduler.add_node_collection(worker, collection)
    scheduler.schedule()
    return scheduler, main, unit


@pytest.fixture
def lanes(tmp_path, monkeypatch):
    return start(tmp_path, monkeypatch, COLLECTION)


def files(worker) -> list[str]:
    """The files sent to `worker`, in order, each once."""
    return list(dict.fromkeys(COLLECTION[i].split("::")[0] for i in worker.sent))


def run(scheduler, worker, path: str) -> None:
    """`worker` reports every test of `path` it was sent as complete."""
    for i in [i for i in worker.sent if COLLECTION[i].startswith(path + "::")]:
        scheduler.mark_test_complete(worker, i)


def test_the_unit_lane_waits_for_the_example_then_takes_background_files_in_order(lanes):
    scheduler, main, unit = lanes
    assert files(main) == [EXAMPLE] and files(unit) == ["tests/unit/test_x.py", "tests/unit/test_y.py"]
    for path in files(unit):
        run(scheduler, unit, path)
    assert files(unit) == ["tests/unit/test_x.py", "tests/unit/test_y.py"] and not unit.shutting_down  # waits
    run(scheduler, main, EXAMPLE)  # the example is done: the unit lane starts the background files
    assert files(main)[:2] == [EXAMPLE, PPO] and files(unit)[2:] == [BACKGROUND[0]]
    run(scheduler, unit, BACKGROUND[0])
    assert files(unit)[2:] == [BACKGROUND[0], BACKGROUND[1]]


def test_the_main_lane_runs_its_own_files_and_solo_tests_first_then_the_last_background_file(lanes):
    scheduler, main, unit = lanes
    for path in files(unit):
        run(scheduler, unit, path)
    run(scheduler, main, EXAMPLE)
    run(scheduler, main, PPO)  # its non-solo test, then the solo unit
    sent = [COLLECTION[i] for i in main.sent]
    assert sent[:5] == [f"{EXAMPLE}::test_{x}" for x in "abc"] + [f"{PPO}::test_learns", f"{PPO}::test_stalled"]
    assert files(main)[-1] == BACKGROUND[-1] and not main.shutting_down
    run(scheduler, main, BACKGROUND[-1])
    run(scheduler, unit, BACKGROUND[0])
    run(scheduler, unit, BACKGROUND[1])
    assert main.shutting_down and unit.shutting_down
    assert sorted(main.sent + unit.sent) == list(range(len(COLLECTION)))  # every test sent once


def test_with_only_unit_tests_the_remaining_worker_runs_them(tmp_path, monkeypatch):
    """One unit of work for two workers: xdist shuts the last added one (here the unit lane's) down at once."""
    units = [test for test in COLLECTION if test.startswith("tests/unit/")]
    scheduler, main, unit = start(tmp_path, monkeypatch, units)
    assert unit.shutting_down and sorted(main.sent) == [0, 1]
