"""The planner's shared figures (meshpar.plan.cost): each defined once, and every consumer
reading the one definition."""

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest
import yaml

from meshpar.backend import allocator
from meshpar.configuration import config
from meshpar.configuration.config import ConfigError
from meshpar.plan import cost, topology
from meshpar.plan.search import layouts as search

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = str(REPO / "experiments" / "quickstart.yaml")
GIB = 1 << 30


@pytest.fixture
def no_fraction(monkeypatch):
    for name in allocator.FRACTION_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_allocator_fraction_reads_the_new_name_first_then_the_old(no_fraction):
    assert allocator.allocator_fraction() == (0.75, "0.75 by default")
    no_fraction.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")
    assert allocator.allocator_fraction()[0] == 0.6
    no_fraction.setenv("XLA_CLIENT_MEM_FRACTION", "0.9")
    assert allocator.allocator_fraction() == (0.9, "XLA_CLIENT_MEM_FRACTION=0.9")


@pytest.mark.parametrize("value", ["abc", "0", "1.5", "-0.2"])
def test_a_bad_allocator_fraction_is_one_line_naming_the_variable(no_fraction, value):
    no_fraction.setenv("XLA_CLIENT_MEM_FRACTION", value)
    with pytest.raises(ConfigError, match=r"^XLA_CLIENT_MEM_FRACTION: is "):
        allocator.allocator_fraction()


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


# NCCL all-reduce (nccl-tests, float32, out of place) measured on N A100 SXM4 of one node: µs at
# message sizes none of which a100-sxm-8.yaml lists (it keeps 1, 2, 4, ... 1024 MiB), so the
# model's figure between its listed points is checked against measurements it was not given.
# Source: vTrain (Bang et al., MICRO'24; github.com/VIA-Research/vTrain,
# trace/a100/AR_GPU{N}_1M_1024M_LUT, MIT licence), ../shared/published/nccl_allreduce_a100/.
MEASURED_MIB = (3, 6, 12, 24, 48, 96, 192, 384, 768)
MEASURED_US = {
    2: (56.3, 72.7, 109.1, 176.5, 313.0, 572.0, 1104.7, 2142.9, 4151.0),
    3: (77.5, 88.8, 134.0, 209.5, 388.3, 708.5, 1367.8, 2629.2, 5120.7),
    4: (64.9, 104.1, 139.2, 220.2, 396.4, 762.7, 1442.3, 2820.7, 5493.5),
    5: (68.0, 102.6, 154.3, 244.2, 442.7, 828.3, 1529.4, 2951.9, 5799.1),
    6: (74.7, 105.3, 177.1, 270.2, 433.2, 852.6, 1587.3, 3063.0, 5949.0),
    7: (79.1, 105.6, 172.5, 287.6, 468.1, 838.1, 1681.6, 3129.2, 6102.6),
    8: (92.6, 108.4, 175.7, 265.3, 439.4, 828.5, 1610.2, 3147.1, 6187.0),
}
# The same rows' bus bandwidth at 768 MiB, GB/s, as nccl-tests reports it: its definition of
# bus bandwidth (algorithm bandwidth x the share of the buffer a ring all-reduce sends per
# device) is the published statement of what an all-reduce moves.
MEASURED_BUSBW_768 = {2: 194.00, 3: 209.69, 4: 219.89, 5: 222.19, 6: 225.61, 7: 226.22, 8: 227.78}


def test_collectives_on_a_measured_link_follow_the_published_nccl_times():
    link = topology.load("a100-sxm-8").device_link
    errors = []
    for n, times in MEASURED_US.items():
        for mib, us in zip(MEASURED_MIB, times):
            predicted = cost.collective_seconds("all-reduce", mib * (1 << 20), n, link)
            errors.append(abs(predicted - us * 1e-6) / (us * 1e-6))
    assert max(errors) < 0.15, max(errors)  # every measured point, 3 MiB to 768 MiB, 2 to 8 GPUs
    assert sorted(errors)[len(errors) // 2] < 0.03  # and most of them closely
    # A reduce-scatter and an all-gather of a buffer move what an all-reduce of it moves (the
    # all-reduce is the two in turn): at bandwidth-bound sizes they take its time together.
    for n in (2, 4, 8):
        for mib in (512, 1024):
            nbytes = mib * (1 << 20)
            pair = sum(cost.collective_seconds(k, nbytes, n, link) for k in ("reduce-scatter", "all-gather"))
            assert pair == pytest.approx(cost.collective_seconds("all-reduce", nbytes, n, link), rel=0.05)
    # Twice the bytes at a bandwidth-bound size: about twice the time, as measured (384 -> 768 MiB).
    for n, times in MEASURED_US.items():
        ratio = cost.collective_seconds("all-reduce", 768 << 20, n, link) / cost.collective_seconds(
            "all-reduce", 384 << 20, n, link
        )
        assert ratio == pytest.approx(times[-1] / times[-2], rel=0.05) and 1.8 < ratio < 2.05


def test_ring_collectives():
    """The ring model (a link without a measured curve) against what a ring moves: the share of
    its buffer each device sends is the one nccl-tests' published bus bandwidths imply."""
    mib = 1 << 20
    for n, busbw in MEASURED_BUSBW_768.items():
        # nccl-tests: bus bandwidth = (bytes / time) x the ring's share; read the share off its rows
        share = busbw * 1e9 * MEASURED_US[n][-1] * 1e-6 / (768 * mib)
        link = topology.Link(bandwidth=100e9, latency=0.0)  # bandwidth alone: no per-step cost
        sent = cost.collective_seconds("all-reduce", 768 * mib, n, link) * link.bandwidth
        assert sent / (768 * mib) == pytest.approx(share, rel=0.01)
    link = topology.Link(bandwidth=100e9, latency=5e-6)
    for n in (2, 3, 4, 8):
        for nbytes in (4096.0, 64.0 * mib):
            one = {k: cost.collective_seconds(k, nbytes, n, link) for k in
                   ("all-reduce", "reduce-scatter", "all-gather", "collective-permute")}  # fmt: skip
            # an all-reduce is a reduce-scatter and then an all-gather of the same buffer, steps and all
            assert one["reduce-scatter"] + one["all-gather"] == pytest.approx(one["all-reduce"])
            # a permute sends its buffer once to one peer, however large the group
            assert one["collective-permute"] == pytest.approx(
                cost.collective_seconds("collective-permute", nbytes, 2, link)
            )
            assert one["collective-permute"] >= nbytes / link.bandwidth
            # k executions take k times one
            assert cost.collective_seconds("all-gather", nbytes, n, link, executions=3) == pytest.approx(
                3 * one["all-gather"]
            )
    # Bandwidth-bound: twice the bytes, about twice the time.
    big = [cost.collective_seconds("all-reduce", s, 8, link) for s in (256.0 * mib, 512.0 * mib)]
    assert big[1] / big[0] == pytest.approx(2, rel=0.01)
    # On one link a larger group is never faster per byte: each device sends more of the buffer,
    # in more steps.
    for kind in ("all-reduce", "all-gather", "reduce-scatter"):
        for nbytes in (4096.0, 64.0 * mib):
            times = [cost.collective_seconds(kind, nbytes, n, link) for n in range(2, 9)]
            assert times == sorted(times) and times[-1] > times[0]
    # A faster link is never slower, and one device moves nothing.
    fast = topology.Link(bandwidth=200e9, latency=5e-6)
    assert cost.collective_seconds("all-reduce", 64.0 * mib, 8, fast) < cost.collective_seconds(
        "all-reduce", 64.0 * mib, 8, link
    )
    assert cost.collective_seconds("all-reduce", 400.0, 1, link) == 0.0


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
    for path in (REPO / "meshpar" / "plan").rglob("*.py"):
        if path.name == "cost.py":
            continue
        code = _code(path)
        for what, pattern in ONCE.items():
            if pattern.search(code):
                found.setdefault(what, []).append(path.name)
    assert found == {}
    cost_code = _code(REPO / "meshpar" / "plan" / "cost.py")
    assert all(pattern.search(cost_code) for what, pattern in ONCE.items() if what != "the headroom")


def test_only_the_allocator_module_reads_the_allocator_fraction():
    readers = set()
    for path in (REPO / "meshpar").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in allocator.FRACTION_VARIABLES:
                readers.add(path.name)
    assert readers == {"allocator.py"}


# A one-hidden-layer MLP of 1024 x 1024 weights on 4 devices: its layouts need 5-21 MiB each.
MLP = {
    "mesh": "data:4",
    "layout": "",
    "model": {"name": "mlp", "hidden": [1024]},
    "data": {"num_examples": 64, "num_eval_examples": 0, "num_features": 1024, "num_classes": 10},
    "train": {"steps": 2, "batch_size": 8, "progress": False},
}


def _choice(row) -> tuple:
    return row.cfg.mesh_str, row.cfg.layout_str, row.cfg.param_layout


def test_the_search_ranks_with_the_machines_capacity(no_fraction):
    """On a GPU machine the search plans against the device's memory (its file's figure) x the
    allocator fraction a run's XLA would take, less a little headroom: a smaller fraction drops
    the layouts that no longer fit and ranks them after those that do."""
    cfg = config.from_dict(MLP)
    rtx = topology.load("rtx4090-x4")
    memory = yaml.safe_load((topology.DIR / "rtx4090-x4.yaml").read_text())["memory_gib"] * GIB  # read here
    no_fraction.setenv("XLA_CLIENT_MEM_FRACTION", "1")
    roomy = search.search(cfg, rtx, 4, top=0)
    assert roomy.rows and all(r.fits for r in roomy.rows)
    needs = sorted(r.memory_bytes for r in roomy.rows)
    fraction = (needs[len(needs) // 2] + needs[-1]) / 2 / memory  # room for the smaller layouts only
    no_fraction.setenv("XLA_CLIENT_MEM_FRACTION", repr(fraction))
    tight = search.search(cfg, rtx, 4, top=0)
    fitting = [r for r in tight.rows if r.fits]
    assert 0 < len(fitting) < len(tight.rows)
    usable = tight.capacity.usable_bytes
    assert 0.9 * memory * fraction <= usable <= memory * fraction, (usable, memory * fraction)
    assert {_choice(r) for r in tight.rows} == {_choice(r) for r in roomy.rows}  # the same layouts, judged again
    assert all(r.memory_bytes <= usable for r in fitting)
    assert all(r.memory_bytes > usable for r in tight.rows if not r.fits)
    assert tight.rows[: len(fitting)] == fitting and tight.best is fitting[0]
    # What the pre-flight and the offload comparison plan with too (meshpar.plan.cost).
    assert usable == cost.machine_capacity(cfg, rtx).usable_bytes
