"""Analytic per-device memory of a config's training run, by category, before anything exists.

Everything comes from the real abstract train state (``eval_shape``), its shardings and the
model's own code traced at per-device shapes; nothing is kept by hand for one model, and no
factor is fitted to a measurement. Per device (the most loaded one: the relay device in routed
feeding), in bytes:

* ``params`` (exact) — every parameter's shard under the layout with ``param_layout`` on top.
* ``grads`` (estimate) — one gradient per parameter, in the parameter dtype, placed like the
  parameter, when the update needs them together (clipping by their global norm, or a sum or
  re-placement over devices: XLA combines those collectives into one); otherwise the largest
  gradient at its activation-layout shard alone (each parameter is updated from its own gradient
  as the backward produces it, in the donated state's buffers, and the gradient dies there);
  with ``train.microbatches`` > 1 also the float32 running sum the accumulation keeps in the
  parameters' shardings.
* ``optimizer`` (exact) — every optimizer-state leaf's shard (moments placed like their
  parameters, counts and scalars whole), plus the step counter and the RNG key.
* ``activations`` (estimate) — the residuals of one microbatch that XLA keeps for the backward
  pass (:func:`meshpar.plan.memory.trace.saved_activations`). They are JAX's own residuals of
  the model's loss under the ``model.remat`` policy in use (``jax.vjp``'s forward jaxpr), traced
  at one device's shapes (every parameter at its shard in the activation layout, the batch at its per-device rows
  divided by ``train.microbatches`` and every other dim at the shard the model first places it
  in: the MLP's ``pixels`` under Mesh TensorFlow's mnist layout), each stacked over the layer
  loop it comes from (a stack of one layer is a loop of one iteration), filtered
  by what XLA must hold in memory (checked against XLA:CPU's buffer assignment):

  - a residual behind a relabelling op (reshape, squeeze, ``checkpoint_name``, ``stop_gradient``)
    is its operand,
    counted once;
  - kept: outputs of matmuls, reductions, gathers, transcendentals (tanh, exp, rsqrt, …: XLA
    does not duplicate them), random bits and loops; a value a matmul reads (an operand is
    written out before the matmul runs); a value multiplied by one broadcast along leading
    dims (a per-feature scale: its gradient is a reduction over the batch rows of that value,
    and XLA:CPU fuses reductions over the minor dim only); the carry of the layer loop;
  - otherwise, the output of a cheap elementwise or data-movement op (add, mul, select,
    broadcast, transpose, slice, concatenate, convert, …) is recomputed where the backward
    reads it (XLA fuses it there) from the values it is made of: those already kept and the
    arguments cost nothing more; any other (say a tanh output that two such residuals are
    made of) is kept instead, once, when it is no larger than the residual, else the
    residual itself is kept;
  - in a layer loop that runs as a loop (``scan_unroll`` below the depth: on CPU whenever
    ``remat`` is on, on accelerators by default), every residual the body hands out is kept:
    it leaves the body stacked, beyond fusion's reach (one stack per value, however often the
    body hands it out).

  Residuals that are the arguments (parameters, batch) are counted in their own categories.
  Each is labelled by the ``checkpoint_name`` tag the model gave it, where it has one. A
  residual the forward casts to a wider dtype (a bfloat16 matmul's output computed on in
  float32: the logits) gets its cotangent back in that dtype (``Residual.cot``).

  **Gathered parameters** (``param_layout``; :func:`meshpar.plan.memory.gathers.gathers`): a parameter stored on a smaller
  shard than compute uses (its shard in the activation layout) is gathered into a buffer of its
  own, in the dtype the forward computes with it (``use`` casts it where it is stored, then
  gathers the cast). A parameter the backward reads (a residual that is a parameter) keeps that gathered copy
  for it: the forward's copy as a residual, or under ``model.remat`` a second gather by the
  recomputed forward (XLA does not merge the two). Outside the layer loop XLA schedules these
  gathers, which read only arguments, at the step's start, so every pass's copies of those
  parameters are live at once, plus one more copy of the largest gathered along a dim after its
  leading one (gathered in a transposed layout, then copied back); with microbatches they leave
  the accumulation loop and stay live through it. Inside the layer loop each layer's copy is
  gathered in its iteration (a residual of every layer under ``remat: none``; without
  ``param_layout``, a layer loop of more than one layer unrolled under ``remat: none`` likewise
  writes out each layer's slice of a stacked weight the backward reads, a residual of every
  layer: one layer's slice is the stack itself). When the layer loop runs as a loop, the
  stacked parameters are gathered along a dim after ``layers``: XLA
  copies each whole stack, at its stored shard, into the transposed layout once, outside the
  loops (live through the backward; XLA:GPU only a stack gathered along a dim after a layer's
  leading one), and under ``model.remat`` the backward's iteration holds that layer's gathered
  copies (``Gathers.loop`` and ``Gathers.iteration``, in the backward phase); without
  ``param_layout`` it holds the layer's slices of the stacks its matmuls read, written out. When it is unrolled,
  under ``model.remat`` and with microbatches: ``Gathers.layers`` (the backward phase, below).
* ``workspace`` (estimate) — what the step's peak holds beyond gradients and activations. The
  step's working set is the largest of three phases, not a sum of categories:

  - gather (``param_layout`` only): every gathered copy of the parameters outside the layer
    loop and the transposed-layout copy (above), at the step's start;
  - backward (:func:`meshpar.plan.memory.backward.walk`): the most held at once walking the forward's
    program order in reverse, as the backward runs: the residuals die in reverse order (each
    after the op that reads it) while the gradients are produced (each at its parameter's last
    use in the forward). At each kept residual: every residual made up to it, plus its
    cotangent (a cotangent has its value's shape; it exists while the op that saved the
    residual is differentiated); at each parameter's last use: the residuals made before it
    plus that op's output as cotangent (a loop's: its largest per-iteration residual, its
    stacks still live). A gathered parameter the backward reads (above) is such a residual,
    made where the forward reads it. Gradients are produced in the dtype the forward reads
    their parameters in (the compute dtype where ``use`` casts them) and, held together, count
    from where each is produced on (:func:`meshpar.plan.memory.gradients.held`: whole at its compute
    shard until reduced; a stacked parameter's of a layer loop that runs as a loop, its stack
    at the stored shard); one at a time, each only where it is produced, with what applying it holds (the update below) when
    there are no microbatches (with them it is added to the running sum, held throughout).
    Two kinds are accumulated into buffers XLA zeroes before the backward begins, so they are
    held from its first step (:func:`meshpar.plan.memory.gradients.accumulated`): a parameter a gather
    reads (the embedding: the gather's gradient adds the rows' cotangents into a zeroed table
    of the parameter's shape; XLA:GPU zeroes it that early only where the table's gradient is
    reduce-scattered, else where it is added to) and, in a layer loop that runs as a loop,
    every stacked parameter (each layer's gradient written into a zeroed stack, the loop's
    output). A parameter the forward reads as several values (tied embeddings: the table
    gathered and multiplied by, each through its own ``use``) has a gradient part for each,
    each reduced on its own, added after. On XLA:CPU the weight gradient of a matmul whose
    output has more than two dims (the logits' ``[batch, length, vocab]``) contracts the
    cotangent over several dims, and XLA:CPU's matmuls read that operand written out
    transposed: a second copy of the cotangent beside it.
    Where the walk reaches the layer loop (every output of the loop is made at the loop's one
    place), one backward iteration's extras (``loops``): under ``model.remat`` the layer's
    recomputed residuals (what ``remat: none`` keeps per layer-loop iteration less what the
    policy keeps per iteration) with its gathered weights or its slices of the weight stacks —
    or, once those have died at the iteration's end, the layer's gradients and their reduced
    copies (:func:`meshpar.plan.memory.gradients.update_phase`), whichever is larger. Gradients held
    together that the loop produces count every layer's by then, the last iteration's one
    weight at a time beside its extras (the largest layer gradient), or all of that layer's
    once they have died. In a layer loop that runs as a loop, the backward's iteration reads its
    residuals as slices of their stacks: one a matmul reads, or more than one op reads, is
    written out (a dynamic slice fuses into one elementwise consumer only), so one iteration's
    such slices are held besides the stacks, counted on the traced backward loop's body
    (:func:`meshpar.plan.memory.residuals.backward_slices`; under ``model.remat`` the body also
    recomputes, and the residuals a matmul reads are counted instead: ``residuals.Residual.sliced``);
  - update (:func:`meshpar.plan.memory.gradients.update_phase`): the gradients as the backward
    produces them (each parameter at its shard in the activation layout, in the dtype the
    forward reads it in), plus a second, reduced copy of every gradient the devices must sum
    (a parameter not split over every mesh axis the batch is split on: data parallel's
    all-reduce) or re-place (``param_layout``: reduce-scattered to its own shard; XLA:CPU has
    no reduce-scatter and all-reduces the whole gradient before slicing it, so the copy there
    is the compute shard, a stacked parameter's too where the layer loop is unrolled, each
    layer's whole gradient held until then), plus with microbatches the float32
    running sum — but a stacked parameter of a layer loop that runs as a loop has its stack
    alone, at its stored shard: the backward loop reduces each layer's gradient in its
    iteration and writes it into the stack (the iteration's copies count in the backward
    phase); when the gradients are not needed together (see ``grads``), the largest
    gradient alone, plus the running sum, plus what one leaf's update holds beyond its gradient
    and its state (:func:`meshpar.plan.memory.gradients.update_copies`, traced from the optimizer's own
    update at one leaf's shape: each function of the gradient alone that both the update and
    the gradient-norm metric compute, AdamW's square of the gradient, which XLA computes once
    and writes out for the reduction and the update's fusion to read; the largest leaf's). Held
    together, the reduced copies free the unreduced gradients' room before the updates run, and
    nothing is added.

  With microbatches the backward phase also holds the batch's microbatch-major copy (the
  accumulation loop's input: splitting rows i, i + k, … into microbatch i is a transpose, which
  XLA writes out, at the shard the model places the batch in), and both the backward and the update phase also hold every gathered copy of
  the parameters outside the layer loop (above). The backward phase also holds, with
  microbatches: the loop body's slice of its microbatch of each batch leaf the backward reads
  (a residual that is the batch: a matmul reads it, so the dynamic slice is written out); every
  cast of a parameter to a wider dtype (a bfloat16 parameter computed in float32) that is not
  a residual, every layer's (it reads only arguments, so XLA hoists it out of the accumulation
  loop, at its compute shard, live through the loop); and under ``model.remat`` with the layer
  loop unrolled, every layer's gathered copy of its parameters (``param_layout``: the forward's
  gathers, hoisted out of the loop likewise) plus one layer's copies of those the backward reads
  (gathered again behind remat's barrier, in the backward's iteration). ``workspace`` = the largest phase −
  gradients − activations: negative where the residuals die before the last gradients are
  produced (grads + activations is then more than is ever live at once).
* ``inputs`` (exact) — this device's slice of the batch the step is given.
* ``queued_inputs`` (exact) — the other batches resident on the device, outside the step:
  ``feed.prefetch`` placed ahead, and one more under the lagged loop (a dispatched step's batch
  stays alive while the next is placed; see :mod:`meshpar.run.loop`).
* ``relay_inputs`` (routed only, exact) — the relay also holds the whole process batch it
  received and, while placing, every other slice cut from it
  (:func:`meshpar.plan.time.feed_time.relay_bytes`).

``Breakdown.total`` is the sum of the categories: params + optimizer + the inputs (exact) plus
the step's working set (grads + activations + workspace, the estimate).

**A stage axis** (``layers:<axis>``, :mod:`meshpar.sharding.stages`): params and optimizer state as
above (the stack's are split over the stages by the layout); ``grads`` one per parameter (no
running sum: the microbatches are the pipeline's); ``activations`` the tick loop's residual
stacks (T/R × a stage's residuals of one microbatch) and the residuals outside the stack for the
whole batch (the embedding's dropout mask among them; the stack's dropout keeps only each
layer's key per tick, the bits drawn again in the backward); ``workspace`` the rest of the most
the step holds at once — the head's backward (its logits' float32 cotangent), the backward tick
loop (the stage's gradient accumulators and one tick's gradient stacks) or the update, in the
better of XLA's two orders (:mod:`meshpar.plan.memory.stage_axis`). That is XLA:GPU's program (0.95-1.03 of
its figure on 49 published pipelined rows: ``scripts/validate_published.py --memory``); a step
compiled for XLA:CPU keeps the earlier accounting (a stage's residuals over the ticks, the
pipeline's buffers as workspace: :func:`meshpar.plan.memory.pipelined.cpu_categories`), checked
against XLA:CPU by ``scripts/validate_memory.py``.

**Host offload** (the ``offload`` section; what lives where: :func:`meshpar.plan.out_of_core.offload_plan.placement`)
moves bytes from these device categories to ``Breakdown.host``, per device, in pinned host memory:

* ``host["optimizer"]`` (exact) — with ``offload.optimizer``, every optimizer-state leaf's shard;
  the device keeps the step counter and the RNG key. The update brings the state to the device:
  the update phase holds, beyond what it held before, the state of the parameter whose state
  is largest (AdamW: two moments) — an estimate and a lower bound, for XLA fetching it leaf by
  leaf before each leaf's update (all at once needs all of it); a GPU's ``memory_stats()``
  peak in the device check settles it.
* ``host["params"]`` (exact), ``host["grads"]`` (estimate) — with ``offload.params``, every
  parameter's shard, and its gradient (the gradient of a host array is a host array: each
  layer's goes back in the backward pass). The device holds (estimates) one layer's slice of
  the stacked ``layers`` weights and its gradient, the weights outside the layers, the float32
  microbatch sum; under ``remat: none`` every layer's fetched weights, kept as residuals
  (``activations``); the update phase adds the largest parameter and its gradient (as above).
* ``host["activations"]`` (exact, given the names) — with ``offload.activations``, the values
  each layer tags with the offloaded names (:data:`meshpar.plan.out_of_core.offload_plan.OFFLOADED_NAMES`),
  one microbatch, every layer. Everything else in the layer is recomputed, so the device's
  ``activations`` (estimate) are what ``model.remat: full`` keeps (the layer inputs the loop
  carries: offloading a carry does nothing, so ``layer_in`` counts on both sides), and the
  backward phase holds one layer's recomputed and fetched residuals, as under remat.

**On XLA:GPU** (the step's devices are GPUs, as a GPU machine's compiled deviceless through
:mod:`meshpar.plan.gpu_target`) the program differs from XLA:CPU's; the model follows it
(checked against XLA:GPU's buffer assignment and live ranges at its peak), so:

* the model is traced as the target's program is (:func:`meshpar.plan.shapes.on_target`): the
  layer loop runs as a loop (XLA:CPU's short stacks are unrolled), every residual its body hands
  out stacked (the rules above), and attention is the kernel the target gets (cuDNN's fused
  attention for bfloat16 where jax's checks allow it: no probabilities kept). On every platform
  the layer the backward recomputes under ``model.remat`` is traced as straight-line code (what
  ``remat: none`` keeps within fusion's reach): one iteration's, not a loop's stacks. XLA:GPU's
  fusion counts float32 and float16 ``exp``, divide, ``sqrt`` and ``rsqrt`` cheap and
  recomputes them in every consumer (:data:`meshpar.plan.memory.residuals.GPU_CHEAP`): the
  cross-entropy keeps the logits, not their exponentials;
* **matmul scratch**: beside a running matmul's operands and output, its GEMM writes buffers of
  its own — under cuBLAS (``xla_gpu_enable_triton_gemm`` off) a workspace, the ``s8`` second
  element of each ``__cublas$lt$matmul``'s result (4 MiB in jaxlib 0.10 on every compute
  capability; a deviceless compile cannot shrink it to the chosen algorithm's need), alive
  through the call, one call at a time, and calls run all through the backward: the largest is
  added to the backward phase; under Triton GEMM fusions (the default) split-K partial results
  (a whole float32 result per slice of the contracted dim, the split chosen by XLA's tiling
  heuristics from the shapes and the GPU's core count), alive until their reduction runs: the
  backward walk adds, at each place in the forward's program order, the largest of one matmul
  the backward runs there. The figures are XLA's own (:func:`meshpar.plan.time.gemm.matmul_scratch`): every matmul of
  the backward of each place (a layer loop: every matmul of its body, and the body's own under
  recomputation) compiled alone for the target device with the step's compiler options, the
  GEMM's buffers read from the compiled program;
* collectives: the data-parallel gradients are summed by combined all-reduces (concatenated,
  and the summed result: two copies, as above), each combination up to XLA's combine threshold
  (:data:`meshpar.plan.memory.gradients.COMBINE_THRESHOLD`, or the compiler option
  ``xla_gpu_all_reduce_combine_threshold_bytes``); a gradient that large is all-reduced alone,
  in place: one copy. A gradient ``param_layout`` re-places outside the layer loop is reduced
  alone, whole at its compute shard (a reduce-scatter, or an all-reduce in place where the
  gradient norm reads the whole sum), beside its stored shard: no second whole copy. The
  gradient of a stacked parameter of a layer loop that runs as a loop is reduced in the
  compute dtype, a layer at a time inside the backward loop, into the stack (as on XLA:CPU);
* the weight gradient of a matmul outside the layer loop after it (the output projection's)
  is computed after the backward's layer loop, next to its reduction: its cotangent (the
  logits', in the compute dtype) is held through the loop instead, and at the end both;
* gathered parameters (``param_layout``) are gathered where each pass uses them (XLA:GPU's
  latency-hiding scheduler), so one pass's copies at a time, and the transposed layout is the
  stored shard transposed before the gather (the ``relayout`` copy is the shard's size);
* with microbatches the gathers stay in the accumulation loop (once per microbatch), each
  microbatch's gradient is added to the float32 running sum as the backward produces it, in
  place (the matmul's accumulating epilogue) — except a gradient re-placed to a smaller shard
  (whole until reduce-scattered, in the loop) and the stacked gradients of a layer loop that
  runs as a loop (every stack held until that loop ends); the update phase holds the running
  sum, and its all-reduced copy where the devices sum it, nothing beside them;
* not modelled: how XLA:GPU packs the step's temp buffers into one block (a small step's temp
  can be a few MiB above the most live at its peak, worst beside a 4 MiB cuBLAS workspace), and
  the scheduler's choices of which matmuls' scratch overlap (straight-line backward code can
  run both matmuls of one matmul's backward before either partial result is reduced). Steps of
  a few MiB, and model-parallel MLPs with long contractions, are where these show (the
  validation's spread).

Out of scope (:func:`out_of_scope` names the reason, and no figure stands for these): on
XLA:CPU, bfloat16 compute (it computes bfloat16 matmuls in float32 and keeps float32 copies of
their operands) and host offload (memory kinds are ignored inside the step); on a GPU compiled
deviceless (a GPU platform on a host whose backend is not one), host offload (compile-only
devices have no ``pinned_host`` memory: the step is compiled with everything on the device);
dropout (XLA keeps the 32-bit random bits behind each mask); a sequence split (XLA's partitioner
gathers keys and values over ``length``).
"""

from __future__ import annotations

import dataclasses

import jax

from meshpar import models
from meshpar.configuration.config import Config
from meshpar.plan.memory import gathers, gradients, phases, pipelined, trace, train_state
from meshpar.plan.out_of_core import offload_plan
from meshpar.sharding import layout as layout_lib
from meshpar.sharding import offload
from meshpar.step import parts

CATEGORIES = ("params", "grads", "optimizer", "activations", "workspace", "inputs", "queued_inputs", "relay_inputs")
HOST_EXACT = frozenset({"params", "optimizer", "activations"})  # host offload's column (see above)


@dataclasses.dataclass(frozen=True)
class Breakdown:
    """Per-device bytes on the most loaded device, by category (see the module docstring)."""

    categories: dict[str, int]  # in CATEGORIES order; relay_inputs only in routed feeding
    exact: frozenset[str]  # the categories computed exactly; the others are estimates
    # Per-device bytes in pinned host memory (host offload), by category; empty without offload.
    host: dict[str, int] = dataclasses.field(default_factory=dict)
    # The traced residuals' bytes made before the layer loop, by it (all layers) and after it:
    # where the step makes its activations (meshpar.plan.out_of_core.unified); (0, 0, 0) untraced.
    residual_split: tuple[int, int, int] = (0, 0, 0)

    @property
    def total(self) -> int:
        """Device bytes: the sum of the categories (host bytes are not in it)."""
        return sum(self.categories.values())

    @property
    def host_total(self) -> int:
        return sum(self.host.values())


def out_of_scope(cfg: Config, platform: str) -> str | None:
    """Why the model gives no figure for `cfg` compiled for `platform` (``jax.default_backend()``
    names: ``cpu``, ``gpu``, ``tpu``), in one line; None when the config is in its scope."""
    model = models.traits(cfg.model)
    if platform == "cpu" and model.compute_dtype == "bfloat16":
        return "bfloat16 compute on XLA:CPU (it computes bfloat16 matmuls in float32 and keeps float32 copies)"
    if model.dropout > 0.0:
        return "dropout (XLA keeps the 32-bit random bits behind each mask)"
    if model.experts and getattr(cfg.model, "moe_dispatch", "capacity") == "dropless":
        # Traced as jax lowers ragged_dot (meshpar.models.moe._ragged_dot: one masked copy of the
        # rows per expert), dropless dispatch with every expert whole on every device is modelled
        # (validate_memory's rows). Split weights are not: each device gathers its group's tokens,
        # rolls them (copies of every row) and reduces the outputs, or gathers d_ff or embed at the
        # region's edge (meshpar.models.moe._dropless_split): moe_tiny dropless, every other layer,
        # on its own layout 20.5% under XLA:CPU's total (validate_memory.py --ci --beyond-scope).
        weights = ("experts", "d_ff", "embed")
        split = [d for rules in (cfg.layout, cfg.param_layout) for d, _ in layout_lib.on_mesh(rules, {n for n, s in cfg.mesh if s != 1})
                 if d in weights]  # fmt: skip
        if split:
            return (f"dropless mixture-of-experts dispatch with the expert weights split by {', '.join(sorted(set(split)))} "
                    "(the gathered, rolled rows are not modelled)")  # fmt: skip
    if model.experts and model.remat not in (None, "none"):
        # the recomputed dispatch and expert MLPs of a layer's backward keep copies of the expert
        # hidden [groups, experts, capacity, d_ff] (XLA:CPU's transposes for its dots) that the
        # working set does not count: moe_tiny with remat full 25.9% under XLA:CPU's total
        # (validate_memory.py --ci --beyond-scope)
        return f"a mixture of experts under model.remat {model.remat} (the recomputed expert MLPs' copies are not modelled)"
    axes = {name for name, size in cfg.mesh if size != 1}
    if model.experts and any(dim == "layers" for dim, _ in layout_lib.on_mesh(cfg.layout, axes)):
        # the pipeline's accounting (meshpar.plan.memory.stage_axis) counts a stage's dense layers'
        # residuals per tick; the dispatch maps and routed tokens each tick keeps are not in it:
        # moe_tiny on data:2,stage:2,expert:2 18.6% under XLA:CPU's total (validate_memory.py --ci --beyond-scope)
        return "a mixture of experts under a stage axis (the pipeline's accounting leaves out the dispatch buffers)"
    if any(dim == "length" for dim, _ in layout_lib.on_mesh(cfg.layout, axes)):
        # XLA's partitioner gathers keys and values over the split and reshards the dense
        # projections' batch·length rows: the per-device program is not one device's slice
        return "a sequence split (layout puts length on a mesh axis: XLA gathers attention's keys and values)"
    offload = getattr(cfg, "offload", None)
    moved = any(getattr(offload, k, False) for k in ("optimizer", "params"))
    if platform == "cpu" and (moved or getattr(offload, "activations", "none") != "none"):
        return "host offload on XLA:CPU (it ignores memory kinds inside the step: nothing moves to or from the host)"
    offloaded = moved or getattr(offload, "activations", "none") != "none"
    if platform == "gpu" and jax.default_backend() != "gpu" and offloaded:
        # a GPU target on a host without one is compile-only: its devices have no memories to place arrays in
        return ("host offload on a GPU compiled deviceless (compile-only devices have no pinned_host memory: "
                "the step is compiled with everything on the device)")  # fmt: skip
    return None


def analytic(cfg: Config, step: parts.AbstractStep | None = None, compiler_options: dict | None = None) -> Breakdown:
    """The config's per-device memory by category (nothing allocated; the step is not compiled —
    for a GPU, each distinct matmul is, alone, to read what XLA:GPU's lowering of it holds:
    :func:`meshpar.plan.time.gemm.matmul_scratch`). `compiler_options`: those the step will be compiled with
    (``Lowered.compile``'s; on a GPU the matmuls' lowering follows them)."""
    step = step or parts.abstract_step(cfg)
    state = train_state.state_bytes(cfg, step)
    if step.plan.schedule is not None:  # a stage axis: the pipeline's own accounting (meshpar.plan.memory.stage_axis)
        return Breakdown(pipelined.categories(cfg, step, step.plan.schedule, state), state.exact, state.host)
    place, remat = state.place, models.traits(cfg.model).remat or "none"
    if place.activations != "none":  # the named residuals on the host, the rest recomputed
        prof, remat = offload_plan.profile(cfg, step), "full"
        names = offload.activation_names(cfg.model.name, place.activations)
        state.host["activations"] = prof.named_bytes(names) * prof.layers
    traced = trace.traced(cfg, step, remat if place.activations != "none" else None, slices=remat == "none")
    kept = traced.kept
    gathered = gathers.gathers(cfg, step, traced.read, traced.rolled, traced.dtypes)  # param_layout: stored split
    activations = sum(r.total for r in kept) + gathered.kept
    if place.params and remat == "none":  # every layer's fetched weights kept for the backward
        activations += (offload_plan.profile(cfg, step).layers - 1) * state.weights.layer_compute
    extra = gradients.update_extra(cfg, step, traced.uses)  # what each leaf's update holds beyond its gradient
    update, grads, iteration, one_at_a_time = phases.update(cfg, step, state, traced, extra, compiler_options)
    held = phases.held_gradients(cfg, step, state, traced, grads, gathered, extra, together=one_at_a_time is None)
    # one backward iteration of the layer loop: its recomputed residuals and gathered weights
    # while it runs, or at its end, once those have died, its layer's gradients being reduced
    during = max(phases.transient(cfg, step, traced, remat) + gathered.iteration, iteration)
    backward = phases.backward(step, traced, gathered, during, held, compiler_options)
    backward += activations - sum(r.total for r in kept) - gathered.kept + state.running_sum + gathered.loop
    more_backward, more_update = phases.accumulation(cfg, step, traced, gathered)
    backward, update = backward + more_backward, update + more_update
    categories = train_state.categories(
        cfg, step, params=state.params, grads=grads, optimizer=state.optimizer, activations=activations,
        workspace=max(backward, update, gathered.copies + gathered.relayout) - grads - activations,
    )  # fmt: skip
    return Breakdown(categories, state.exact, state.host, phases.residual_split(kept))
