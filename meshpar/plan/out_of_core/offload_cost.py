"""What host offload costs, next to the other ways of freeing device memory: a per-layer model
after the 2019 out-of-core training study's.

Per device and microbatch, each layer costs its compute and its transfers (over the host link,
and under FSDP the device links), overlapped layer by layer or summed; the optimizer state's
round trip for the update is paid once per step; unified memory's page faults come from
:mod:`meshpar.plan.out_of_core.unified`. The model ranks ways of freeing memory; the step time
itself comes from :mod:`meshpar.plan.time.timing`. The spec: docs/out-of-core-model.md; figures
on a GPU: ``scripts/bench_offload.py`` and ``scripts/device_check.sh``.
"""

from __future__ import annotations

import dataclasses

from meshpar import models
from meshpar.configuration import config as config_lib
from meshpar.configuration.config import Config, ConfigError
from meshpar.plan import cost as cost_lib
from meshpar.plan.memory import analytic as memory
from meshpar.plan.memory import trace
from meshpar.plan.out_of_core import offload_plan, unified
from meshpar.plan.search import candidates as candidates_lib
from meshpar.plan.time import timing
from meshpar.step import parts, throughput


@dataclasses.dataclass(frozen=True)
class Option:
    """One way of running the config: a label and the overrides that make it."""

    label: str
    overrides: tuple[str, ...]
    frees: str = ""  # what it frees: "state" (parameters, optimizer), "activations" or "both"
    kind: str = "none"  # none, swap (an offload setting), unified, remat, microbatches or fsdp


@dataclasses.dataclass(frozen=True)
class Cost:
    """One option's predicted memory per device and step time by term (seconds)."""

    option: Option
    device_bytes: int  # the memory plan's device total
    host_bytes: int  # its host column
    compute_s: float  # layers and the rest, recomputation included
    host_s: float  # every host transfer, hidden or not
    device_s: float  # FSDP's gathers and reduce-scatters, hidden or not
    update_s: float  # the state's trip to the device and back for the update (exposed)
    step_s: float  # what the step costs in this model
    # The step time predicted for it: the config's own step from its compiled HLO
    # (meshpar.plan.time.timing: collectives and feed included) plus what this option adds in this
    # model; 0 when no reference was given.
    predicted_s: float = 0.0
    # Unified memory (meshpar.plan.out_of_core.unified): bytes beyond the device's memory, paged to host
    # memory and back each step (in host_bytes too; device_bytes is what stays on the device),
    # and the page faults per step.
    migrated_bytes: int = 0
    faults: int = 0
    unified_bytes: int = 0  # what the oversubscribed allocator may hand out (usable); 0: no unified memory
    migration: object = dataclasses.field(default=None, repr=False, compare=False)  # unified.Migration
    layer: Layer | None = None  # one layer's figures: the study's single-layer view

    @property
    def exposed_s(self) -> float:
        """What the transfers add to the compute."""
        return self.step_s - self.compute_s

    def fits(self, usable: int) -> bool:
        """Whether it runs on a device of `usable` bytes: its device bytes fit, or under unified
        memory all it needs fits the oversubscribed allocator."""
        if self.unified_bytes:
            return self.device_bytes + self.migrated_bytes <= self.unified_bytes
        return self.device_bytes <= usable


@dataclasses.dataclass(frozen=True)
class Layer:
    """One layer of the layer loop under an option, per device and step (its microbatches
    summed): what it holds on the device while its backward runs (its weights in the compute
    layout, its residuals, its gradient), what of it moves to and from host memory (offloaded
    residuals, swapped weights and gradient; under unified memory the bytes its passes page in
    and out), and its forward and backward time, transfers included as the step pays them.
    Under unified memory the layer is the one that pages most (`index`), else any (all are
    alike)."""

    index: int
    device_bytes: int
    host_bytes: int
    forward_s: float
    backward_s: float
    migrated_bytes: int = 0


def host_bandwidth(topo, devices: int) -> float:
    """Bytes/s one device moves to or from host memory while `devices` (the first ones of the
    machine) all do: its own link, or its share of the uplink its group shares."""
    bandwidth = topo.host_link.bandwidth
    if topo.uplink is not None:
        for group in topo.host_groups:
            sharing = sum(1 for d in group if d < devices)
            if sharing:
                bandwidth = min(bandwidth, topo.uplink.bandwidth / sharing)
    return bandwidth


def paging(blocks: unified.Blocks, need: int, capacity: cost_lib.Capacity, topo, devices: int):
    """Unified memory's steady-state migration of a step of `blocks` needing `need` bytes on a
    device of `capacity` (its own memory: ``device_usable_bytes``) of `topo`, `devices` of them
    transferring at once, and the seconds its faults stall the step (:mod:`meshpar.plan.out_of_core.unified`)."""
    moved = unified.migration(blocks, capacity.device_usable_bytes, topo.page_bytes, need)
    return moved, moved.stall_s(host_bandwidth(topo, devices), topo.fault_s)


def _recompute(p: Prepared) -> float:
    """FLOPs the backward pass of one layer runs again (see docs/out-of-core-model.md): under
    activation offload its policy's, else what ``model.remat``'s policy runs again, traced."""
    policy, prof = getattr(p.cfg.offload, "activations", "none"), p.prof
    if policy == "none":
        return trace.recompute(p.step).again / max(prof.layers, 1)
    return {"layer_outputs": prof.layer_flops, "dots": prof.batched_flops}[policy]


def _fsdp_ways(w: offload_plan.Weights) -> int:
    """How many ways ``param_layout`` splits the layer weights beyond their compute layout."""
    return max(round(w.layer_compute / w.layer), 1) if w.layer else 1


@dataclasses.dataclass(frozen=True)
class Prepared:
    """An option applied to the config and planned: all that :func:`price` reads that does not
    depend on the machine, so that one preparation is priced on any number of topologies."""

    option: Option
    cfg: Config  # with the option's overrides
    step: parts.AbstractStep
    plan: memory.Breakdown
    prof: offload_plan.Profile
    weights: offload_plan.Weights
    place: offload_plan.Placement


@dataclasses.dataclass(frozen=True)
class Skipped:
    """An option that does not apply to the config, and why (one line)."""

    label: str
    overrides: tuple[str, ...]
    reason: str

    def __str__(self) -> str:
        return f"{self.label}: {self.reason}"


def prepare(step: parts.AbstractStep, option: Option) -> Prepared:
    """`option` on `cfg` (already with its overrides), planned as `step`: its memory plan, the
    layer profile, the weights and where the state lives. Raises what planning it raises."""
    cfg = step.cfg
    return Prepared(
        option, cfg, step, memory.analytic(step), offload_plan.profile(step),
        offload_plan.weights(step.plan, step.layout, step.mesh), offload_plan.placement(cfg, step.plan),
    )  # fmt: skip


def cost(step: parts.AbstractStep, topo, option: Option, overlap: bool = True) -> Cost:
    """Predicted memory and step time of `cfg` (already with `option`'s overrides) on `topo`."""
    return price(prepare(step, option), topo, overlap)


def _host_seconds(topo, devices: int, bytes_in: float, bytes_out: float) -> float:
    """One transfer over the host link each way at once, with `devices` transferring: the larger
    direction and the link's latency (0 for none)."""
    if not (bytes_in or bytes_out):
        return 0.0
    return max(bytes_in, bytes_out) / host_bandwidth(topo, devices) + topo.host_link.latency


def _rates(cfg: Config, topo) -> tuple[float, float]:
    """(FLOP/s the matmuls run at: the peak for the compute dtype × efficiency, device memory bytes/s)."""
    return topo.peak(throughput.compute_dtype(cfg.model)) * topo.efficiency, topo.device_memory_bandwidth or float(
        "inf"
    )


def _layer_bytes(p: Prepared) -> tuple[int, int]:
    """(the residuals of one layer sent to host memory, its weights fetched from there) under `p`'s placement."""
    offloaded = p.prof.named_bytes(models.family(p.cfg.model.name).kept_activations(p.place.activations))
    return offloaded, p.weights.layer if p.place.params else 0


def _passes(p: Prepared, topo) -> tuple[tuple[float, float, float], ...]:
    """(compute, host transfer, device transfer) seconds of one layer, forward then backward:
    compute at the peak for its dtype or its weights' read at memory bandwidth, the slower;
    offloaded residuals out and in, fetched weights in and their gradient out; FSDP's gathers
    (again in the backward under remat) and reduce-scatter."""
    cfg, prof, w = p.cfg, p.prof, p.weights
    rate, hbm = _rates(cfg, topo)
    devices, ways = p.step.mesh.size, _fsdp_ways(w)
    ring = cost_lib.collective_seconds("all-gather", w.layer_compute, ways, topo.device_link)  # or a reduce-scatter
    offloaded, weights_in = _layer_bytes(p)
    remat = p.place.activations != "none" or models.traits(cfg.model).remat_on
    return (
        (max(prof.layer_flops / rate, w.layer_compute / hbm),
         _host_seconds(topo, devices, weights_in, offloaded), ring),
        (max((2 * prof.layer_flops + _recompute(p)) / rate, 2 * w.layer_compute / hbm),
         _host_seconds(topo, devices, weights_in + offloaded, weights_in), ring * (2 if remat else 1)),
    )  # fmt: skip


def _outside_layers(p: Prepared, topo) -> tuple[float, float]:
    """(compute, host transfer) seconds of the work outside the layers in one microbatch: its
    forward and backward, and under parameter offload its weights in for each pass and their
    gradients out (with microbatches every gradient comes back to be added to the running sum)."""
    w, plan, devices = p.weights, p.plan, p.step.mesh.size
    rate, hbm = _rates(p.cfg, topo)
    compute = max(3 * p.prof.other_flops / rate, 3 * w.other_compute / hbm)
    host = 0.0
    if p.place.params:
        host = _host_seconds(topo, devices, w.other, 0) + _host_seconds(topo, devices, w.other, w.other)
        host += _host_seconds(topo, devices, plan.host["grads"], 0) if p.cfg.train.microbatches > 1 else 0.0
    return compute, host


def _update_seconds(p: Prepared, topo) -> float:
    """The update's trip over the host link: the host state in (and the parameters' gradients,
    on the host under parameter offload), the new state back."""
    host = p.plan.host
    back = host.get("optimizer", 0) + host.get("params", 0)
    return _host_seconds(topo, p.step.mesh.size, back + host.get("grads", 0), back)


def price(prepared: Prepared, topo, overlap: bool = True) -> Cost:
    """Predicted memory and step time of a prepared option on `topo` (see docs/out-of-core-model.md)."""
    p = prepared
    plan, w, k = p.plan, p.weights, p.cfg.train.microbatches
    layers = max(p.prof.layers, 1)
    passes = _passes(p, topo)
    if overlap:  # a pipeline: layer i+1's transfers behind layer i's compute; the first exposed
        layers_s = sum(h + d + (layers - 1) * max(c, h, d) + c for c, h, d in passes)
    else:
        layers_s = layers * sum(c + h + d for c, h, d in passes)
    rest_compute, rest_host = _outside_layers(p, topo)
    compute_s = k * (layers * sum(c for c, _, _ in passes) + rest_compute)
    host_s = k * (layers * sum(h for _, h, _ in passes) + rest_host)
    device_s = k * layers * sum(d for _, _, d in passes)
    update_s = _update_seconds(p, topo)
    blocks = unified.blocks(plan.categories, p.prof.layers, w.layer, plan.residual_split, k)
    one = [k * (max(c, h, d) if overlap else c + h + d) for c, h, d in passes]  # a layer inside the loop
    offloaded, weights_in = _layer_bytes(p)
    layer = Layer(
        0, w.layer_compute + blocks.per_layer + blocks.layer_grads, offloaded + 2 * weights_in, one[0], one[1]
    )
    step_s = k * (layers_s + rest_compute + rest_host) + update_s
    out = Cost(p.option, plan.total, plan.host_total, compute_s, host_s + update_s, device_s, update_s, step_s,
               layer=layer)  # fmt: skip
    return out if cost_lib.oversubscription(p.cfg) is None else _paged(p, topo, out, blocks)


def _paged(p: Prepared, topo, out: Cost, blocks: unified.Blocks) -> Cost:
    """`out` under unified memory: what does not fit the device's own memory pages in and out on
    demand, its faults stalling the step; its layer the one that pages most."""
    devices = p.step.mesh.size
    capacity = cost_lib.machine_capacity(p.cfg, topo)
    moved, stall = paging(blocks, p.plan.total, capacity, topo, devices)
    worst = max(range(max(p.prof.layers, 1)), key=lambda i: sum(q.bytes_in + q.bytes_out for q in moved.layer(i)))
    forward, backward = moved.layer(worst)
    paged = sum(q.bytes_in + q.bytes_out for q in (forward, backward))
    bw = host_bandwidth(topo, devices)
    layer = dataclasses.replace(
        out.layer, index=worst, host_bytes=out.layer.host_bytes + paged, migrated_bytes=paged,
        forward_s=out.layer.forward_s + moved.stall_s(bw, topo.fault_s, [forward]),
        backward_s=out.layer.backward_s + moved.stall_s(bw, topo.fault_s, [backward]),
    )  # fmt: skip
    return dataclasses.replace(
        out, device_bytes=moved.device_bytes, host_bytes=out.host_bytes + moved.migrated_bytes,
        host_s=out.host_s + stall, step_s=out.step_s + stall, migrated_bytes=moved.migrated_bytes,
        faults=moved.faults, unified_bytes=capacity.usable_bytes, migration=moved, layer=layer,
    )  # fmt: skip


# Offload settings compared: (label, optimizer, params, activations). The combinations are
# those that free the most of each kind together; the rest add transfers for little.
SETTINGS = (
    ("no offload", False, False, "none"),
    ("offload.optimizer", True, False, "none"),
    ("offload.params", False, True, "none"),
    ("offload.optimizer + params", True, True, "none"),
    ("offload.activations=layer_outputs", False, False, "layer_outputs"),
    ("offload.activations=dots", False, False, "dots"),
    ("offload.optimizer + activations=dots", True, False, "dots"),
    ("offload all (optimizer, params, dots)", True, True, "dots"),
)
NO_OFFLOAD = ("offload.optimizer=false", "offload.params=false", "offload.activations=none",
              "offload.unified_memory=false", f"offload.oversubscription={config_lib.OffloadConfig.oversubscription:g}")  # fmt: skip


def without_unified(cfg: Config) -> Config:
    """`cfg` without unified memory (its other settings as they are)."""
    off = dataclasses.replace(
        cfg.offload, unified_memory=False, oversubscription=config_lib.OffloadConfig.oversubscription
    )
    return dataclasses.replace(cfg, offload=off)


def unified_overrides(cfg: Config) -> tuple[str, ...]:
    """The overrides that run `cfg` under unified memory at its oversubscription (the default's
    when it has none)."""
    return ("offload.unified_memory=true", f"offload.oversubscription={cfg.offload.oversubscription:g}")


def options(step: parts.AbstractStep, skipped: list[Skipped] | None = None) -> list[Option]:
    """Each offload setting (:data:`SETTINGS`; the first, no offload, is the base the others
    are compared with), each without unified memory; unified memory alone and with the state
    swapped (the config's own offload setting instead, when it has unified memory and one);
    then the other ways of freeing memory — ``model.remat``, microbatches ×2 and ×4, FSDP
    ``param_layout`` (the model family's FSDP dims over the batch axes, as the pre-flight adds
    them: :func:`meshpar.plan.search.candidates.fsdp_param_layout`) — each on the config without
    offload. The config's own setting is marked "(as configured)". FSDP that no dim of the
    model can take is recorded in `skipped`, with why."""
    cfg = step.cfg
    return [*_swap_options(cfg), *_unified_options(cfg), *_other_ways(step, skipped)]


def _own(cfg: Config) -> tuple[bool, bool, str]:
    """The config's own offload setting: (optimizer, params, activations)."""
    return cfg.offload.optimizer, cfg.offload.params, cfg.offload.activations


def _swap_options(cfg: Config) -> list[Option]:
    """Each offload setting of :data:`SETTINGS`, without unified memory."""
    own, unified_on = _own(cfg), cfg.offload.unified_memory
    out = []
    for label, optimizer, params, activations in SETTINGS:
        overrides = (f"offload.optimizer={str(optimizer).lower()}", f"offload.params={str(params).lower()}",
                     f"offload.activations={activations}", *NO_OFFLOAD[3:])  # fmt: skip
        frees = {(False, False): "", (True, False): "state", (False, True): "activations"}.get(
            (optimizer or params, activations != "none"), "both"
        )
        mark = " (as configured)" if (optimizer, params, activations) == own and not unified_on else ""
        out.append(
            Option(
                label + mark, overrides, frees, "none" if not (optimizer or params or activations != "none") else "swap"
            )
        )
    return out


def _unified_options(cfg: Config) -> list[Option]:
    """Unified memory alone, and with the config's own offload setting when it has both (else
    with the state swapped)."""
    own, unified_on = _own(cfg), cfg.offload.unified_memory
    um = unified_overrides(cfg)
    label = f"unified memory {cfg.offload.oversubscription:g}x"
    alone = not any(own[:2]) and own[2] == "none"
    out = [
        Option(label + (" (as configured)" if unified_on and alone else ""), (*NO_OFFLOAD[:3], *um), "both", "unified")
    ]
    # Composed with swapping the state (the configuration's own swap setting when it has one):
    # the state leaves the device, unified memory pages what still does not fit.
    state = (True, True, "none")
    for flags in [own] if unified_on and not alone else [state]:
        own_label = next((lbl for lbl, *f in SETTINGS if tuple(f) == flags), None) or (
            f"offload.optimizer={str(flags[0]).lower()}, params={str(flags[1]).lower()}, activations={flags[2]}"
        )
        mark = " (as configured)" if unified_on and flags == own else ""
        out.append(Option(f"{label} + {own_label}{mark}", (
            f"offload.optimizer={str(flags[0]).lower()}", f"offload.params={str(flags[1]).lower()}",
            f"offload.activations={flags[2]}", *um), "both", "unified"))  # fmt: skip
    return out


def _other_ways(step: parts.AbstractStep, skipped: list[Skipped] | None) -> list[Option]:
    """The other ways of freeing memory, each on the config without offload: ``model.remat``,
    microbatches ×2 and ×4, FSDP ``param_layout`` (recorded in `skipped` where no dim takes it)."""

    cfg = step.cfg
    model = step.traits  # a remat change in the field the family names for it (model.remat)
    changes = [
        f"{model.key('remat')}={r}" for r in ("full", "dots") if model.remat not in (None, r) and "remat" in model.keys
    ]
    # custom's names go with custom only
    unsave = (f"{model.key('remat_save')}=[]",) if model.remat_save else ()
    out = [Option(change, (*NO_OFFLOAD, change, *unsave), "activations", "remat") for change in changes]
    k = cfg.train.microbatches
    out += [Option(f"train.microbatches={k * f}", (*NO_OFFLOAD, f"train.microbatches={k * f}"), "activations",
                   "microbatches") for f in (2, 4)]  # fmt: skip
    sizes = dict(step.mesh.shape)
    axes = tuple(a for a in cost_lib.batch_axes(cfg.layout) if a in sizes)
    params = candidates_lib.param_dims(step.plan.abstract.params)
    try:
        rules = candidates_lib.fsdp_param_layout(cfg, step.element_spec, params, axes, sizes)
    except ConfigError as e:
        if skipped is not None:
            skipped.append(Skipped("param_layout", (), str(e).removeprefix(f"{e.key}: ")))
    else:
        out.append(Option(f"param_layout={rules}", (*NO_OFFLOAD, f"param_layout={rules}"), "state", "fsdp"))
    return out


def applied(cfg: Config, overrides) -> Config:
    """`cfg` with `overrides` (``section.key=value``) applied and checked."""
    return config_lib.from_dict(config_lib.apply_overrides(config_lib.to_dict(cfg), list(overrides)))


def prepare_all(step: parts.AbstractStep, skipped: list[Skipped] | None = None) -> list[Prepared]:
    """Every option of :func:`options`, applied to the built `step`'s config and planned, nothing
    compiled. An option the config cannot take — its config or its plan is refused (a
    ConfigError, LayoutError, MeshError or DataError: microbatches that do not divide each
    device's rows, a ``param_layout`` that puts two dims of a parameter on one axis) — is left
    out and recorded in `skipped` with why."""
    cfg = step.cfg
    out = []
    for option in options(step, skipped):
        try:
            new = applied(cfg, option.overrides)
            config_lib.check_batch_size(new, dict(step.mesh.shape))
            out.append(prepare(parts.abstract_step(new, step.mesh, step.element_spec), option))
        except candidates_lib.ILLEGAL as e:
            if skipped is not None:
                skipped.append(Skipped(option.label, option.overrides, str(e)))
    return out


def priced(prepared: list[Prepared], topo, overlap: bool = True, reference_s: float = 0.0) -> list[Cost]:
    """Each prepared option (:func:`prepare_all`) priced on `topo`; `reference_s`: the config's
    predicted step (:func:`reference`), the base of ``predicted_s``."""
    # Unified memory needs a CUDA GPU: not priced on a machine of simulated CPU devices.
    out = [price(p, topo, overlap) for p in prepared if p.option.kind != "unified" or topo.device_link.kind != "memcpy"]
    if not out:
        return []
    if not reference_s:  # model figures alone: step_s is each option's figure
        return out
    # The reference is the config's compiled step, whose HLO holds no host transfers (XLA:CPU
    # drops them), so it stands for the step without offload: the first option.
    return [dataclasses.replace(c, predicted_s=reference_s + c.step_s - out[0].step_s) for c in out]


def compare(
    cfg: Config,
    topo,
    step: parts.AbstractStep | None = None,
    overlap: bool = True,
    reference_s: float = 0.0,
    skipped: list[Skipped] | None = None,
) -> list[Cost]:
    """Every option of :func:`options` on `topo`: memory and time (nothing compiled); one the
    config cannot take is left out, and recorded in `skipped` (:func:`prepare_all`).
    `reference_s`: the config's predicted step (:func:`reference`), the base of ``predicted_s``.
    The first is the config without offload, the base every other is compared with."""
    return priced(prepare_all(step, skipped), topo, overlap, reference_s)


def reference(step: parts.AbstractStep, topo) -> float:
    """The config's step time on `topo` from its compiled HLO, batch placement included
    (:func:`meshpar.plan.time.timing.predict`; compiled here, nothing allocated)."""
    cfg = step.cfg
    return timing.predict(step, step.compile(), topo, cost_lib.feed_seconds(cfg, topo)).total_s


def sweep(
    cfg: Config,
    topo,
    batch_sizes,
    overlap: bool = True,
    with_reference: bool = True,
    mesh=None,
    skipped: list | None = None,
) -> list[tuple[int, list[Cost]]]:
    """:func:`compare` at each global batch size; `with_reference`: each with the config's step
    at that size compiled and predicted (:func:`reference`), else model figures only. `mesh`:
    the config's mesh built already (a compile target's), else this host's. `skipped` receives
    the options left out (once each, with the batch size where that depends on it)."""
    out = []
    for b in batch_sizes:
        sized = applied(cfg, [f"train.batch_size={b}"])
        step = parts.abstract_step(sized, mesh)
        left: list[Skipped] = []
        out.append((b, compare(sized, topo, step, overlap, reference(step, topo) if with_reference else 0.0, left)))
        if skipped is not None:
            skipped += [s for s in left if str(s) not in map(str, skipped)]
    return out


def cheapest(costs: list[Cost], frees: str | None = None) -> Cost | None:
    """The option that frees device memory at the least added time per byte freed (in this
    model; an option that frees nothing is not a candidate); one that frees memory and costs no
    time at all wins outright. `frees`: only among the
    options that free that (``"state"``, ``"activations"``)."""
    base = costs[0]
    useful = [c for c in costs[1:] if c.device_bytes < base.device_bytes and frees in (None, c.option.frees)]
    return min(useful, key=lambda c: max(c.step_s - base.step_s, 0.0) / (base.device_bytes - c.device_bytes),
               default=None)  # fmt: skip
