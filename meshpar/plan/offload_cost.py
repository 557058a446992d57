"""What host offload costs, next to the other ways of freeing device memory: a per-layer model
after the 2019 out-of-core training study's.

**The model.** Per device, per microbatch, each layer of the layer loop costs, forward and
backward, its compute and its transfers:

* compute — the layer's matmul FLOPs (:func:`meshpar.plan.offload_plan.profile`, traced at one
  device's shapes) at the topology's peak for the compute dtype × its step efficiency: F
  forward, 2F backward, plus what the backward recomputes (``remat: full`` and activation
  offload of ``layer_outputs``: F again; ``remat: dots`` and offload of ``dots``: attention's
  batched contractions, whose scores no policy keeps). A layer cannot run faster than it reads
  its weights from device memory: once forward, twice backward (gradient of the input, of the
  weight), so compute is the larger of the FLOP time and those bytes at the memory bandwidth.
* host transfers — bytes moved / the host-link bandwidth of one device: the topology's
  ``host_link``, and where devices share an uplink (``host_groups``), the uplink divided among
  the mesh's devices under it (they all transfer at once), plus the link's latency per
  transfer. PCIe is full duplex: host→device and device→host bytes move at the same time, each
  at that bandwidth. Forward: parameter offload brings the layer's weights in, activation
  offload sends its named values out; backward: both come in again, and the weights' gradients
  go out (the gradient of a host array is a host array, :mod:`meshpar.offload`).
* device transfers (``param_layout`` FSDP) — the layer's weights all-gathered to their compute
  layout forward (and again backward under remat, which does not keep them), their gradients
  reduce-scattered backward: bytes × (n−1)/n / the device link's bandwidth, plus its latency
  per ring step.

With overlap (the default: XLA issues a layer's copies ahead of it, behind the previous
layer's compute) each pass over the L layers is a pipeline: the first layer's transfers, which
nothing hides, then L − 1 steps of max(compute, host transfers, device transfers), then the
last layer's compute; without overlap, every layer costs the sum. The weights
outside the layers (embedding, output) cost their FLOPs, and under parameter offload a fetch
forward and backward that nothing hides.

**Optimizer (and parameter) state for the update**, once per step, never overlapped: the
state (under parameter offload also the gradients) comes in after the backward pass (brought
any earlier it would sit on the device through the backward pass's peak, and the memory plan
counts only the largest parameter's state there) and goes back after its update, leaf by
leaf; in and out share the duplex link, so the step pays ``max(bytes in, bytes out) /
bandwidth``.

**What is left out**, equal for every option unless said: the config's own collectives (from
the compiled HLO, :mod:`meshpar.plan.timing`; remat's recomputed forward repeats a tensor-
parallel layout's collectives, not counted), the optimizer update's own compute, elementwise
ops' memory traffic (so ``remat: dots`` looks cheaper than it is), the feed. The model ranks
ways of freeing memory; the step time itself comes from :mod:`meshpar.plan.timing`. Figures on
a GPU: ``scripts/bench_offload.py`` and ``scripts/device_check.sh``.
"""

from __future__ import annotations

import dataclasses
import math

from meshpar import aot, throughput
from meshpar import config as config_lib
from meshpar import layout as layout_lib
from meshpar.config import Config, ConfigError
from meshpar.plan import candidates as candidates_lib
from meshpar.plan import memory, offload_plan


@dataclasses.dataclass(frozen=True)
class Option:
    """One way of running the config: a label and the overrides that make it."""

    label: str
    overrides: tuple[str, ...]
    frees: str = ""  # what it frees: "state" (parameters, optimizer), "activations" or "both"


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
    # (meshpar.plan.timing: collectives and feed included) plus what this option adds in this
    # model; 0 when no reference was given.
    predicted_s: float = 0.0

    @property
    def exposed_s(self) -> float:
        """What the transfers add to the compute."""
        return self.step_s - self.compute_s


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


def _recompute(cfg: Config, prof: offload_plan.Profile) -> float:
    """FLOPs the backward pass of one layer runs again (see the module docstring)."""
    policy = getattr(cfg.offload, "activations", "none")
    if policy == "none":
        policy = {"none": "none", "full": "layer_outputs", "dots": "dots"}[getattr(cfg.model, "remat", "none")]
    return {"none": 0.0, "layer_outputs": prof.layer_flops, "dots": prof.batched_flops}[policy]


def _fsdp_ways(w: offload_plan.Weights) -> int:
    """How many ways ``param_layout`` splits the layer weights beyond their compute layout."""
    return max(round(w.layer_compute / w.layer), 1) if w.layer else 1


def cost(cfg: Config, step: aot.AbstractStep, topo, option: Option, overlap: bool = True) -> Cost:
    """Predicted memory and step time of `cfg` (already with `option`'s overrides) on `topo`."""
    plan = memory.analytic(cfg, step)
    prof = offload_plan.profile(cfg, step)
    w = offload_plan.weights(step.plan, step.layout, step.mesh)
    place = offload_plan.placement(cfg, step.plan)
    rate = topo.peak(throughput.compute_dtype(cfg.model)) * topo.efficiency
    hbm = topo.device_memory_bandwidth or float("inf")
    bw, latency = host_bandwidth(topo, step.mesh.size), topo.host_link.latency
    link = topo.device_link
    ways = _fsdp_ways(w)
    layers, k = max(prof.layers, 1), cfg.train.microbatches

    def host(bytes_in: float, bytes_out: float) -> float:
        return max(bytes_in, bytes_out) / bw + latency if bytes_in or bytes_out else 0.0

    def ring(nbytes: float) -> float:  # an all-gather or reduce-scatter of `nbytes` gathered
        return nbytes * (ways - 1) / ways / link.bandwidth + link.latency * (ways - 1) if ways > 1 else 0.0

    offloaded = prof.named_bytes(offload_plan.OFFLOADED_NAMES[place.activations])
    weights_in = w.layer if place.params else 0
    remat = place.activations != "none" or getattr(cfg.model, "remat", "none") != "none"
    passes = (  # (compute, host transfer, device transfer) of one layer, forward then backward
        (max(prof.layer_flops / rate, w.layer_compute / hbm), host(weights_in, offloaded), ring(w.layer_compute)),
        (max((2 * prof.layer_flops + _recompute(cfg, prof)) / rate, 2 * w.layer_compute / hbm),
         host(weights_in + offloaded, weights_in), ring(w.layer_compute) * (2 if remat else 1)),
    )  # fmt: skip
    if overlap:  # a pipeline: layer i+1's transfers behind layer i's compute; the first exposed
        layers_s = sum(h + d + (layers - 1) * max(c, h, d) + c for c, h, d in passes)
    else:
        layers_s = layers * sum(c + h + d for c, h, d in passes)
    rest_compute = max(3 * prof.other_flops / rate, 3 * w.other_compute / hbm)
    rest_host = 0.0
    if place.params:  # the other weights in, forward and backward, their gradients out; with
        # microbatches every gradient comes back to be added to the device's running sum
        rest_host = host(w.other, 0) + host(w.other, w.other) + (host(plan.host["grads"], 0) if k > 1 else 0.0)
    per_micro = layers_s + rest_compute + rest_host
    compute_s = k * (layers * sum(c for c, _, _ in passes) + rest_compute)
    host_s = k * (layers * sum(h for _, h, _ in passes) + rest_host)
    device_s = k * layers * sum(d for _, _, d in passes)
    # The update: the host state in (and the parameters' gradients, on the host under parameter
    # offload), the new state back.
    back = plan.host.get("optimizer", 0) + plan.host.get("params", 0)
    update_s = host(back + plan.host.get("grads", 0), back)
    return Cost(option, plan.total, plan.host_total, compute_s, host_s + update_s, device_s, update_s,
                k * per_micro + update_s)  # fmt: skip


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
NO_OFFLOAD = ("offload.optimizer=false", "offload.params=false", "offload.activations=none")


def options(cfg: Config, step: aot.AbstractStep) -> list[Option]:
    """Each offload setting (:data:`SETTINGS`; the first, no offload, is the base the others
    are compared with), then the other ways of freeing memory — ``model.remat``, microbatches
    ×2 and ×4, FSDP ``param_layout`` — each on the config without offload. The config's own
    offload setting is marked "(as configured)"."""
    off = cfg.offload
    own = (off.optimizer, off.params, off.activations)
    out = []
    for label, optimizer, params, activations in SETTINGS:
        overrides = (f"offload.optimizer={str(optimizer).lower()}", f"offload.params={str(params).lower()}",
                     f"offload.activations={activations}")  # fmt: skip
        frees = {(False, False): "", (True, False): "state", (False, True): "activations"}.get(
            (optimizer or params, activations != "none"), "both"
        )
        mark = " (as configured)" if (optimizer, params, activations) == own else ""
        out.append(Option(label + mark, overrides, frees))
    remat = getattr(cfg.model, "remat", None)
    out += [Option(f"model.remat={r}", (*NO_OFFLOAD, f"model.remat={r}"), "activations")
            for r in ("full", "dots") if remat not in (None, r)]  # fmt: skip
    k = cfg.train.microbatches
    out += [Option(f"train.microbatches={k * f}", (*NO_OFFLOAD, f"train.microbatches={k * f}"), "activations")
            for f in (2, 4)]  # fmt: skip
    batch_axes = candidates_lib._batch_axes(cfg)
    ways = math.prod(step.mesh.shape[a] for a in batch_axes if a in step.mesh.shape)
    split = {d for d, _ in cfg.layout} | {d for d, _ in cfg.param_layout}
    dims = (
        candidates_lib.fsdp_dims(candidates_lib.param_dims(step.plan.abstract.params), split, ways) if ways > 1 else []
    )
    if dims:
        axes = batch_axes[0] if len(batch_axes) == 1 else batch_axes
        rules = layout_lib.format_rules((*cfg.param_layout, *((d, axes) for d in dims)))
        out.append(Option(f"param_layout={rules}", (*NO_OFFLOAD, f"param_layout={rules}"), "state"))
    return out


def _apply(cfg: Config, overrides) -> Config:
    return config_lib.from_dict(config_lib.apply_overrides(config_lib.to_dict(cfg), list(overrides)))


def compare(
    cfg: Config, topo, step: aot.AbstractStep | None = None, overlap: bool = True, reference_s: float = 0.0
) -> list[Cost]:
    """Every option of :func:`options` on `topo`: memory and time (nothing compiled). An option
    the config cannot take (microbatches that do not divide each device's rows) is left out.
    `reference_s`: the config's predicted step (:func:`reference`), the base of ``predicted_s``.
    The first is the config without offload, the base every other is compared with."""
    step = step or aot.abstract_step(cfg)
    out = []
    for option in options(cfg, step):
        try:
            new = _apply(cfg, option.overrides)
            config_lib.check_batch_size(new, dict(step.mesh.shape))
        except ConfigError:
            continue
        out.append(cost(new, aot.abstract_step(new, step.mesh, _element_spec(step)), topo, option, overlap))
    # The reference is the config's compiled step, whose HLO holds no host transfers (XLA:CPU
    # drops them), so it stands for the step without offload: the first option.
    return [dataclasses.replace(c, predicted_s=reference_s + c.step_s - out[0].step_s) for c in out]


def reference(cfg: Config, step: aot.AbstractStep, topo) -> float:
    """The config's step time on `topo` from its compiled HLO, batch placement included
    (:func:`meshpar.plan.timing.predict`; compiled here, nothing allocated)."""
    from meshpar.plan import feed_time, timing

    split = feed_time.config_split(cfg, topo)
    mode, n = cfg.feed.mode, split.num_devices
    feed_s = feed_time.placement_time(topo, mode, split.batch_bytes, n, split.shards, split.fields, split.aliased(mode))
    return timing.predict(cfg, step, step.lower().compile(), topo, feed_s).total_s


def _element_spec(step: aot.AbstractStep) -> dict:
    """The train data's element spec, from the abstract batch (so no source is opened again)."""
    return {k: (tuple(b.shape[1:]), b.dtype) for k, b in step.args[1].items()}


def sweep(
    cfg: Config, topo, batch_sizes, overlap: bool = True, with_reference: bool = True
) -> list[tuple[int, list[Cost]]]:
    """:func:`compare` at each global batch size; `with_reference`: each with the config's step
    at that size compiled and predicted (:func:`reference`), else model figures only."""
    out = []
    for b in batch_sizes:
        sized = _apply(cfg, [f"train.batch_size={b}"])
        step = aot.abstract_step(sized)
        out.append((b, compare(sized, topo, step, overlap, reference(sized, step, topo) if with_reference else 0.0)))
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
