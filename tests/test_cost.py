"""The planner's shared figures (meshpar.plan.cost): each defined once, and every consumer
reading the one definition."""

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

from meshpar import config
from meshpar.config import ConfigError
from meshpar.plan import cost, search, topology

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = str(REPO / "experiments" / "quickstart.yaml")
GIB = 1 << 30


@pytest.fixture
def no_fraction(monkeypatch):
    for name in cost.FRACTION_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_allocator_fraction_reads_the_new_name_first_then_the_old(no_fraction):
    assert cost.allocator_fraction() == (0.75, "0.75 by default")
    no_fraction.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")
    assert cost.allocator_fraction()[0] == 0.6
    no_fraction.setenv("XLA_CLIENT_MEM_FRACTION", "0.9")
    assert cost.allocator_fraction() == (0.9, "XLA_CLIENT_MEM_FRACTION=0.9")


@pytest.mark.parametrize("value", ["abc", "0", "1.5", "-0.2"])
def test_a_bad_allocator_fraction_is_one_line_naming_the_variable(no_fraction, value):
    no_fraction.setenv("XLA_CLIENT_MEM_FRACTION", value)
    with pytest.raises(ConfigError, match=r"^XLA_CLIENT_MEM_FRACTION: is "):
        cost.allocator_fraction()


def test_an_80_gib_gpu_plans_with_memory_times_fraction_less_headroom(no_fraction):
    cfg = config.load(QUICKSTART)
    h100 = topology.load("h100-sxm-8")
    assert h100.memory_bytes == 80 * GIB
    cap = cost.machine_capacity(cfg, h100)
    assert cap.bytes == 60 * GIB and cap.usable_bytes == 57 * GIB
    no_fraction.setenv("XLA_CLIENT_MEM_FRACTION", "0.5")
    assert cost.machine_capacity(cfg, h100).bytes == 40 * GIB
    small = config.load(QUICKSTART, ["hardware.memory_gib=16"])
    assert cost.machine_capacity(small, h100).bytes == 16 * GIB  # a smaller device planned for


def test_ring_collectives():
    link = topology.Link(bandwidth=100.0, latency=1.0)
    assert cost.collective_seconds("all-reduce", 400.0, 4, link) == pytest.approx(400 * 1.5 / 100 + 6)
    assert cost.collective_seconds("all-gather", 400.0, 4, link, executions=2) == pytest.approx(2 * (3 + 3))
    assert cost.collective_seconds("collective-permute", 400.0, 4, link) == pytest.approx(4 + 1)
    assert cost.collective_seconds("all-reduce", 400.0, 1, link) == 0.0  # one device: nothing moves


def test_a_collective_over_two_axes_runs_at_the_slower_link():
    pcie = topology.load("rtx4090-x4")
    shape = {"data": 2, "model": 2}
    both = cost.axis_link(pcie, shape, "data,model")
    assert both == cost.axis_link(pcie, shape, ("model", "data"))
    assert both.bandwidth == min(pcie.axis_link(shape, "data").bandwidth, pcie.axis_link(shape, "model").bandwidth)


def test_the_exposed_feed_is_the_feed_beyond_compute_only_when_prefetched():
    assert cost.exposed_feed_seconds(3.0, 1.0, prefetch=1) == 2.0
    assert cost.exposed_feed_seconds(1.0, 3.0, prefetch=2) == 0.0
    assert cost.exposed_feed_seconds(3.0, 1.0, prefetch=0) == 3.0


def test_resident_batches_and_batch_axes():
    cfg = config.load(QUICKSTART, ["feed.prefetch=2"])
    assert cost.resident_batches(cfg) == 3 - cfg.train.sync_every_step
    synced = config.load(QUICKSTART, ["feed.prefetch=2", "train.sync_every_step=true"])
    assert cost.resident_batches(synced) == 2
    assert cost.batch_axes((("batch", ("data", "model")), ("heads", "model"))) == ("data", "model")
    assert cost.batch_axes((("heads", "model"),)) == ()


def _code(path: Path) -> str:
    """`path`'s code without comments and strings (docstrings included)."""
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return " ".join(t.string for t in tokens if t.type not in (tokenize.COMMENT, tokenize.STRING))


# What is defined once, and how a second definition would show in code.
ONCE = {
    "the ring factors": re.compile(r"\(\s*n\s*-\s*1\s*\)\s*/\s*n|\(\s*ways\s*-\s*1\s*\)\s*/\s*ways"),
    "the exposed feed": re.compile(r"feed_s\s*-\s*compute_s"),
    "the resident batches": re.compile(r"sync_every_step"),
    "the headroom": re.compile(r"HEADROOM_FRACTION\s*\)|1\s*-\s*\w*HEADROOM"),
}


def test_each_shared_figure_is_computed_in_the_cost_module_only():
    found = {}
    for path in (REPO / "meshpar" / "plan").glob("*.py"):
        if path.name == "cost.py":
            continue
        code = _code(path)
        for what, pattern in ONCE.items():
            if pattern.search(code):
                found.setdefault(what, []).append(path.name)
    assert found == {}
    cost_code = _code(REPO / "meshpar" / "plan" / "cost.py")
    assert all(pattern.search(cost_code) for what, pattern in ONCE.items() if what != "the headroom")


def test_only_the_cost_module_reads_the_allocator_fraction():
    readers = set()
    for path in (REPO / "meshpar").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in cost.FRACTION_VARIABLES:
                readers.add(path.name)
    assert readers == {"cost.py"}


def test_the_search_ranks_with_the_machines_capacity(no_fraction):
    """search.search's capacity on a GPU machine is cost.machine_capacity's (no second formula)."""
    assert not hasattr(search, "capacity") and not hasattr(search, "GPU_MEM_FRACTION")
