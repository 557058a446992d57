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
  pass (:func:`saved_activations`). They are JAX's own residuals of the model's loss under the
  ``model.remat`` policy in use (``jax.vjp``'s forward jaxpr), traced at one device's shapes
  (every parameter at its shard in the activation layout, the batch at its per-device rows
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
  Each is labelled by the ``checkpoint_name`` tag the model gave it, where it has one.

  **Gathered parameters** (``param_layout``; :func:`_gathers`): a parameter stored on a smaller
  shard than compute uses (its shard in the activation layout) is gathered into a buffer of its
  own. A parameter the backward reads (a residual that is a parameter) keeps that gathered copy
  for it: the forward's copy as a residual, or under ``model.remat`` a second gather by the
  recomputed forward (XLA does not merge the two). Outside the layer loop XLA schedules these
  gathers, which read only arguments, at the step's start, so every pass's copies of those
  parameters are live at once, plus one more copy of the largest gathered along a dim after its
  leading one (gathered in a transposed layout, then copied back); with microbatches they leave
  the accumulation loop and stay live through it. Inside the layer loop each layer's copy is
  gathered in its iteration (a residual of every layer under ``remat: none``). When the layer
  loop runs as a loop, the stacked parameters are gathered along a dim after ``layers``: XLA
  copies each whole stack, at its stored shard, into the transposed layout once, outside the
  loops (live through the backward), and under ``model.remat`` the backward's iteration holds
  that layer's gathered copies (``Gathers.loop``, in the backward phase). When it is unrolled,
  under ``model.remat`` and with microbatches: ``Gathers.layers`` (the backward phase, below).
* ``workspace`` (estimate) — what the step's peak holds beyond gradients and activations. The
  step's working set is the largest of three phases, not a sum of categories:

  - gather (``param_layout`` only): every gathered copy of the parameters outside the layer
    loop and the transposed-layout copy (above), at the step's start;
  - backward (:func:`_backward_walk`): the most held at once walking the forward's program order
    in reverse, as the backward runs: the residuals die in reverse order (each after the op
    that reads it) while the gradients are produced (each at its parameter's last use in the
    forward). At each kept residual: every residual made up to it, plus its cotangent (a
    cotangent has its value's shape; it exists while the op that saved the residual is
    differentiated); at each parameter's last use: the residuals made before it plus that op's
    output as cotangent (a loop's: its largest per-iteration residual, its stacks still live).
    Gradients held together (see ``grads``; those of gathered parameters outside the layer loop
    at their compute shard, until reduced) count from where each is produced on; one at a time,
    each only where it is produced, with what applying it holds (the update below) when there
    are no microbatches (with them it is added to the running sum, held throughout). Plus under
    ``model.remat`` one layer's recomputed residuals (what ``remat: none`` keeps per layer-loop
    iteration less what the policy keeps per iteration). In a layer loop that runs as a loop,
    the backward's iteration reads its residuals as slices of their stacks: one a matmul reads,
    or more than one op reads, is written out (a dynamic slice fuses into one elementwise
    consumer only), so one iteration's such slices are held besides the stacks, counted on the
    traced backward loop's body (:func:`meshpar.plan.residuals.backward_slices`; under ``model.remat`` the body also
    recomputes, and the residuals a matmul reads are counted instead: ``residuals.Residual.sliced``);
  - update: the gradients as the backward produces them (each parameter at its shard in the
    activation layout), plus a second, reduced copy of every gradient the devices must sum (a
    parameter not split over every mesh axis the batch is split on: data parallel's
    all-reduce) or re-place (``param_layout``: reduce-scattered to its own shard; XLA:CPU has
    no reduce-scatter and all-reduces the whole gradient before slicing it, so outside the
    layer loop the copy there is the compute shard), plus with microbatches the float32
    running sum; when the gradients are not needed together (see ``grads``), the largest
    gradient alone, plus the running sum, plus what one leaf's update holds beyond its gradient
    and its state (:func:`_update_copies`, traced from the optimizer's own update at one leaf's
    shape: each function of the gradient alone that both the update and the gradient-norm metric
    compute, AdamW's square of the gradient, which XLA computes once and writes out for the
    reduction and the update's fusion to read; the largest leaf's). Held together, the reduced
    copies free the unreduced gradients' room before the updates run, and nothing is added.

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
  stays alive while the next is placed; see :mod:`meshpar.loop`).
* ``relay_inputs`` (routed only, exact) — the relay also holds the whole process batch it
  received and, while placing, every other slice cut from it
  (:func:`meshpar.plan.feed_time.relay_bytes`).

``Breakdown.total`` is the sum of the categories: params + optimizer + the inputs (exact) plus
the step's working set (grads + activations + workspace, the estimate).

**Host offload** (the ``offload`` section; what lives where: :func:`meshpar.plan.offload_plan.placement`)
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
  each layer tags with the offloaded names (:data:`meshpar.plan.offload_plan.OFFLOADED_NAMES`),
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
  ``remat: none`` keeps within fusion's reach): one iteration's, not a loop's stacks;
* **matmul scratch**: beside a running matmul's operands and output, its GEMM writes buffers of
  its own — under cuBLAS (``xla_gpu_enable_triton_gemm`` off) a workspace, the ``s8`` second
  element of each ``__cublas$lt$matmul``'s result (4 MiB in jaxlib 0.10 on every compute
  capability; a deviceless compile cannot shrink it to the chosen algorithm's need), alive
  through the call, one call at a time, and calls run all through the backward: the largest is
  added to the backward phase; under Triton GEMM fusions (the default) split-K partial results
  (a whole float32 result per slice of the contracted dim, the split chosen by XLA's tiling
  heuristics from the shapes and the GPU's core count), alive until their reduction runs: the
  backward walk adds, at each place in the forward's program order, the largest of one matmul
  the backward runs there. The figures are XLA's own (:func:`meshpar.plan.gemm.matmul_scratch`): every matmul of
  the backward of each place (a layer loop: every matmul of its body, and the body's own under
  recomputation) compiled alone for the target device with the step's compiler options, the
  GEMM's buffers read from the compiled program;
* collectives: the data-parallel gradients are summed by one combined all-reduce (concatenated,
  and the summed result: two copies, as above); a gradient ``param_layout`` re-places outside
  the layer loop is all-reduced whole, then sliced (the combining comes before any could become
  a reduce-scatter), as on XLA:CPU; the gradient of a stacked parameter of a layer loop that
  runs as a loop, cast from the compute dtype to its own, is summed before the cast, a layer at
  a time inside the backward loop, into the stack: no second copy;
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
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from meshpar import aot, jaxprs, parts, trainer
from meshpar import layout as layout_lib
from meshpar.config import Config
from meshpar.models import MODELS
from meshpar.plan import cost, gemm, offload_plan, programs, residuals, shapes

CATEGORIES = ("params", "grads", "optimizer", "activations", "workspace", "inputs", "queued_inputs", "relay_inputs")
EXACT = frozenset({"params", "optimizer", "inputs", "queued_inputs", "relay_inputs"})
HOST_EXACT = frozenset({"params", "optimizer", "activations"})  # host offload's column (see above)

@dataclasses.dataclass(frozen=True)
class Breakdown:
    """Per-device bytes on the most loaded device, by category (see the module docstring)."""

    categories: dict[str, int]  # in CATEGORIES order; relay_inputs only in routed feeding
    exact: frozenset[str]  # the categories computed exactly; the others are estimates
    # Per-device bytes in pinned host memory (host offload), by category; empty without offload.
    host: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def total(self) -> int:
        """Device bytes: the sum of the categories (host bytes are not in it)."""
        return sum(self.categories.values())

    @property
    def host_total(self) -> int:
        return sum(self.host.values())


def _local_loss(cfg: Config, step: parts.AbstractStep, remat: str | None = None, unrolled: bool = False):
    """The model's loss as a function of the parameters and the batch, and the parameters at one
    device's shapes (see :func:`saved_activations` for `remat` and `unrolled`)."""
    state, batch, _ = step.args
    params = shapes.local_params(state.params, step.layout, step.mesh)
    graphdef = step.plan.graphdef
    offloads = getattr(getattr(cfg, "offload", None), "activations", "none") != "none"  # the step's own policy differs
    model = cfg.model
    if unrolled and hasattr(model, "scan_unroll") and hasattr(model, "n_layers"):
        model = dataclasses.replace(model, scan_unroll=model.n_layers)
    if remat is not None and (remat != getattr(cfg.model, "remat", remat) or offloads) or model is not cfg.model:
        spec = {k: (tuple(b.shape[1:]), b.dtype) for k, b in batch.items()}
        model = dataclasses.replace(model, remat=remat) if remat is not None else model
        build = functools.partial(MODELS[cfg.model.name].build, model, spec)
        graphdef, _ = trainer.abstract_model(build)

    def loss(params, batch):
        batch = jax.tree.map(jax.lax.stop_gradient, batch)  # the step differentiates the params only
        rngs = nnx.Rngs(dropout=jax.random.key(0))
        return nnx.merge(graphdef, params).loss(batch, rngs=rngs)[0]

    return loss, params


def saved_activations(
    cfg: Config, step: parts.AbstractStep, remat: str | None = None, read: set[int] | None = None,
    uses: dict | None = None, slices: list | None = None, casts: list | None = None, unrolled: bool = False,
    matmuls_at: dict | None = None,
) -> list[residuals.Residual]:
    """What one device keeps for the backward pass of one microbatch
    (:func:`meshpar.plan.residuals.kept_residuals` of the model's loss at per-device shapes, no
    layout active). `remat`: trace the model under this ``model.remat`` instead of the config's.
    `read` (when given) receives the indices of the parameter leaves the backward pass reads
    (residuals that are parameters); `uses`, where each leaf's gradient is produced (the
    parameters first, then the batch); `slices`, where the layer loop runs as a loop, what one
    backward iteration writes out of the residual stacks
    (:func:`meshpar.plan.residuals.backward_slices`); `casts`, the parameters' widening casts
    that are not residuals. `unrolled`: trace the layer loop as straight-line code (every layer
    in one iteration), as the backward recomputes one layer under remat, within fusion's reach.
    `matmuls_at`: the matmuls each place in the forward's program order runs
    (:func:`meshpar.plan.residuals.kept_residuals`)."""
    loss, params = _local_loss(cfg, step, remat, unrolled)
    local = shapes.device_batch(cfg, step)
    with shapes.on_target(step):  # the layer loop's form and the attention kernel the target's
        kept = residuals.kept_residuals(loss, params, local, read=read, uses=uses, casts=casts, matmuls_at=matmuls_at)
        if slices is not None and any(r.rolled for r in kept):
            slices.append(residuals.backward_slices(loss, params, local))
    return kept


def out_of_scope(cfg: Config, platform: str) -> str | None:
    """Why the model gives no figure for `cfg` compiled for `platform` (``jax.default_backend()``
    names: ``cpu``, ``gpu``, ``tpu``), in one line; None when the config is in its scope."""
    model = cfg.model
    if platform == "cpu" and getattr(model, "compute_dtype", "float32") == "bfloat16":
        return "bfloat16 compute on XLA:CPU (it computes bfloat16 matmuls in float32 and keeps float32 copies)"
    if getattr(model, "dropout", 0.0) > 0.0:
        return "dropout (XLA keeps the 32-bit random bits behind each mask)"
    axes = {name for name, size in cfg.mesh if size != 1}
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


def _loop_iteration(residuals: list[residuals.Residual]) -> int:
    """Bytes of one iteration of the layer loop: the per-iteration residuals of the largest loop
    (a stack of one layer is a loop of one iteration: its residuals are that iteration's)."""
    loops: dict[int, int] = {}
    for r in residuals:
        if r.loop:
            loops[r.copies] = loops.get(r.copies, 0) + r.nbytes
    return max(loops.values(), default=0)


def _backward_walk(kept: list[residuals.Residual], uses: dict, nparams: int, together: int | None, apply: dict,
                   scratch: dict | None = None) -> int:  # fmt: skip
    """The most the backward pass holds of residuals, cotangents and gradients at once, walking
    the forward's program order in reverse (see the module docstring): at each kept residual the
    residuals made up to there and its cotangent; at each parameter's last use (where its
    gradient is produced) the residuals made before it and that op's cotangent. `together`:
    the gradients' bytes when they are all held to the end (each held from its production on,
    in proportion to its traced bytes), None when each is applied as it is produced (then
    `apply`: parameter leaf -> what applying its gradient holds, the gradient included).
    `scratch`: place -> the partial results the backward's matmuls there hold beside their
    operands and outputs (:func:`meshpar.plan.gemm.matmul_scratch`; XLA:GPU's Triton GEMMs)."""
    scratch = scratch or {}
    made: dict[int, int] = {}  # place -> bytes of the residuals made there
    cots: dict[int, int] = {}
    for r in kept:
        made[r.at] = made.get(r.at, 0) + r.total
        cots[r.at] = max(cots.get(r.at, 0), r.nbytes)
    grads = {i: u for i, u in uses.items() if i < nparams}
    scale = together / max(sum(u[2] for u in grads.values()), 1) if together is not None else 0.0
    places = sorted(set(made) | {u[0] for u in grads.values()}, reverse=True)
    before = sum(made.values())  # residuals made before the place being walked
    produced, peak = 0, together or 0
    for p in places:
        here = made.get(p, 0)
        before -= here
        born = [i for i, u in grads.items() if u[0] == p]
        produced += sum(grads[i][2] for i in born)
        held = produced * scale
        if here:  # its residuals read: their cotangent live, and every residual made before
            peak = max(peak, before + here + cots[p] + held + scratch.get(p, 0))
        for i in born:  # the gradient produced: the op's cotangent (a loop's: its largest residual's, its stacks live)
            _, cot, own = grads[i]
            live = before + (here if cot is None else 0) + (cots.get(p, 0) if cot is None else cot)
            peak = max(peak, live + (held if together is not None else apply.get(i, own)) + scratch.get(p, 0))
    return int(peak)


def _unary_of_first(fn, *avals) -> set:
    """The elementwise ops `fn` applies to its first argument alone (a square in either spelling
    is one op: XLA lowers both to the same multiply)."""
    jaxpr = jax.make_jaxpr(fn)(*avals).jaxpr
    g, found = jaxpr.invars[0], set()
    for eqn in jaxpr.eqns:
        ins = [v for v in eqn.invars if not jaxprs.is_literal(v)]
        if not jaxprs.is_cheap(eqn) and jaxprs.op(eqn) not in ("sqrt", "exp", "log", "abs") or ins != [g] * len(ins) or not ins:
            continue
        name, y = jaxprs.op(eqn), eqn.params.get("y")
        if name == "square" or (name == "integer_pow" and y == 2) or (name == "mul" and len(ins) == 2):
            found.add("square")
        elif not (name == "integer_pow" and y == 1):
            found.add((name, str(sorted(eqn.params.items()))))
    return found


@functools.cache
def _update_copies(tx, shape: tuple, dtype) -> int:
    """Leaf-sized values one leaf's update holds beyond its gradient and its state: each function
    of the gradient alone that both the optimizer's update and the gradient-norm metric compute
    (AdamW's square of the gradient): XLA computes it once, and a reduction and the update's
    fusion both read it, so it is written out. Traced at one leaf's shape."""
    import optax

    leaf = jax.ShapeDtypeStruct(shape, dtype)
    state = jax.eval_shape(tx.init, leaf)
    update = _unary_of_first(lambda g, p, s: optax.apply_updates(p, tx.update(g, s, p)[0]), leaf, leaf, state)
    return len(update & _unary_of_first(optax.tree.norm, leaf))


def _update_extra(cfg: Config, step: parts.AbstractStep, uses: dict) -> dict:
    """Parameter leaf -> the bytes its update holds beyond its gradient (:func:`_update_copies`),
    at the shape the backward produces the gradient in."""
    tx = step.tx or trainer.make_optimizer(cfg.optimizer, max(cfg.train.steps, 1))  # the schedule does not matter here
    leaves = jax.tree.leaves(shapes.local_params(step.args[0].params, step.layout, step.mesh))
    return {i: _update_copies(tx, tuple(a.shape), a.dtype) * residuals.nbytes(a) for i, a in enumerate(leaves)}


def _update_phase(cfg: Config, step: parts.AbstractStep, rolled: bool = False) -> int:
    """Bytes the update phase holds beyond the state (see the module docstring): every gradient
    at its activation-layout shard, and a reduced copy where the devices must sum or re-place it
    — but on XLA:GPU for a stacked (``layers``) parameter of a layer loop that runs as a loop
    (`rolled`) whose gradient is cast to its own dtype from the compute dtype: the partitioner
    sums it before the cast, inside the backward loop, one layer at a time, into the stack. On
    XLA:GPU with microbatches, the float32 running sum in the parameters' shardings (each
    microbatch's gradient re-placed inside the accumulation loop: a reduce-scatter there), and
    a summed copy of it where the devices must sum it (the combined all-reduce's output)."""
    compute = getattr(cfg.model, "compute_dtype", None)
    plan, (_, batch, _) = step.plan, step.args
    batch_axes = set()
    for b in batch.values():
        batch_axes |= set(jax.tree.leaves(tuple(b.sharding.spec)[:1]))
    variables = jax.tree.leaves(plan.abstract.params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    gpu = _platform(step) == "gpu"
    total, accumulated = 0, cfg.train.microbatches > 1 and gpu
    for var, act, own in zip(variables, shapes.act_shardings(plan.abstract.params, step.layout, step.mesh),
                             jax.tree.leaves(plan.shardings.params)):  # fmt: skip
        a, dims = var.get_value(), var.get_metadata().get("dims") or ()
        computed = math.prod(act.shard_shape(a.shape)) * a.dtype.itemsize
        placed = math.prod(own.shard_shape(a.shape)) * a.dtype.itemsize
        summed = not batch_axes <= set(jax.tree.leaves(tuple(act.spec)))
        if accumulated:  # the running sum, and its all-reduced copy
            total += math.prod(own.shard_shape(a.shape)) * 4 * (2 if summed and own.spec == act.spec else 1)  # float32
            continue
        if own.spec != act.spec and computed > placed and not (dims and dims[0] == "layers"):
            # XLA:CPU has no reduce-scatter, and XLA:GPU combines the gradients' all-reduces into one
            # (a concatenation) before any could become a reduce-scatter: each reduces the whole gradient, then slices
            placed = computed
        cast = compute is not None and jnp.dtype(compute) != a.dtype
        if gpu and rolled and cast and dims and dims[0] == "layers" and own.spec == act.spec:
            summed = False  # reduced layer by layer in the loop (before the cast), not as a whole afterwards
        total += computed + (placed if summed or own.spec != act.spec else 0)
    return total


def _platform(step: parts.AbstractStep) -> str:
    """The platform the step is compiled for (``cpu``, ``gpu``, ``tpu``): its mesh's devices'."""
    return step.mesh.devices.flat[0].platform


def _cpu(step: parts.AbstractStep) -> bool:
    return _platform(step) == "cpu"


@dataclasses.dataclass(frozen=True)
class Gathers:
    """What gathering the parameters that ``param_layout`` stores split but compute uses whole
    costs one device, in bytes (see the module docstring)."""

    kept: int  # the gathered copies the backward reads, held for it (a residual, or re-gathered under remat)
    copies: int  # every pass's copies of the parameters outside the layer loop
    rest: int  # those of `copies` not in `kept`
    relayout: int  # the largest one gathered along a later dim, once more (its transposed layout)
    grads: int  # the backward's gradients beyond their stored shards (outside the layer loop)
    # a layer loop that runs as a loop: its stacked parameters' transposed-layout copy (hoisted out
    # of the loops: every layer at its stored shard), and under remat one layer's gathered copies
    loop: int = 0
    # a layer loop unrolled, under remat: every layer's forward copy (it reads only arguments) and
    # one layer's copies the backward gathers again (behind remat's barrier, in its iteration)
    layers: int = 0


def _gathers(cfg: Config, step: parts.AbstractStep, read: set[int], rolled: bool = False) -> Gathers:
    """The gathered copies of the parameters stored smaller than compute uses them (``param_layout``),
    from their shardings; `read`: the parameter leaves the backward reads (:func:`saved_activations`);
    `rolled`: the layer loop runs as a loop."""
    plan, gpu = step.plan, _platform(step) == "gpu"
    remat = getattr(cfg.model, "remat", "none") != "none"
    variables = jax.tree.leaves(plan.abstract.params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    kept = forward = again = relayout = grads = outside = loop = layers = 0
    for i, (var, act, own) in enumerate(zip(variables, shapes.act_shardings(plan.abstract.params, step.layout, step.mesh),
                                            jax.tree.leaves(plan.shardings.params))):  # fmt: skip
        a, dims = var.get_value(), var.get_metadata().get("dims") or ()
        used, stored = (math.prod(s.shard_shape(a.shape)) * a.dtype.itemsize for s in (act, own))
        if used <= stored:
            continue  # not gathered
        if dims and dims[0] == "layers":  # gathered one layer at a time inside the layer loop
            kept += used if i in read and not remat else 0  # each layer's copy a residual
            if rolled:  # gathered along a dim after `layers`: the whole stack relaid out once, then per layer
                loop += stored + (used // a.shape[0] if remat else 0)
            elif remat:
                layers += used + (used // a.shape[0] if i in read else 0)
            continue
        forward += used
        grads += used - stored
        if i in read:
            kept, outside = kept + used, outside + used
            again += used if remat else 0  # the recomputed forward gathers it again
        # gathered along a dim after the leading one: XLA gathers it in a transposed layout, then copies it back
        shard = own.shard_shape(a.shape)
        lead = next((d for d, n in enumerate(a.shape) if n > 1), 0)
        if any(s != n for d, (s, n) in enumerate(zip(shard, act.shard_shape(a.shape))) if d > lead):
            relayout = max(relayout, stored if gpu else used)
    if gpu and cfg.train.microbatches == 1:  # gathered where each pass uses it: one pass's copies at a time
        return Gathers(kept=kept, copies=forward, rest=forward - outside, relayout=relayout, grads=grads, loop=loop,
                       layers=layers)  # fmt: skip
    return Gathers(kept=kept, copies=forward + again, rest=forward + again - outside, relayout=relayout, grads=grads, loop=loop, layers=layers)


def _gradients_together(cfg: Config, step: parts.AbstractStep) -> int | None:
    """None when something needs every gradient at once: clipping by their global norm, or a sum
    over devices (XLA combines the gradients' all-reduces into one) or a re-placement
    (``param_layout``'s reduce-scatter); else the largest gradient (at its activation-layout
    shard), the most the update holds: it updates each parameter from its own gradient as the
    backward produces it, in the donated state's buffers, and the gradient dies there."""
    plan, (_, batch, _) = step.plan, step.args
    if getattr(cfg.optimizer, "grad_clip_norm", 0.0) > 0:
        return None
    batch_axes = set()
    for b in batch.values():
        batch_axes |= set(jax.tree.leaves(tuple(b.sharding.spec)[:1]))
    largest = 0
    for a, act, own in zip(jax.tree.leaves(plan.abstract.params), shapes.act_shardings(plan.abstract.params, step.layout, step.mesh),
                           jax.tree.leaves(plan.shardings.params)):  # fmt: skip
        if not batch_axes <= set(jax.tree.leaves(tuple(act.spec))) or own.spec != act.spec:
            return None
        largest = max(largest, math.prod(act.shard_shape(a.shape)) * a.dtype.itemsize)
    return largest


def analytic(cfg: Config, step: parts.AbstractStep | None = None, compiler_options: dict | None = None) -> Breakdown:
    """The config's per-device memory by category (nothing allocated; the step is not compiled —
    for a GPU, each distinct matmul is, alone, to read what XLA:GPU's lowering of it holds:
    :func:`meshpar.plan.gemm.matmul_scratch`). `compiler_options`: those the step will be compiled with
    (``Lowered.compile``'s; on a GPU the matmuls' lowering follows them)."""
    step = step or parts.abstract_step(cfg)
    plan, (_, batch, _) = step.plan, step.args
    params = aot.shard_bytes(plan.abstract.params, plan.shardings.params)
    running_sum = 0
    if cfg.train.microbatches > 1:  # the float32 running sum, in the parameters' shardings
        f32 = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32), plan.abstract.params)
        running_sum = aot.shard_bytes(f32, plan.shardings.params)
    grads = params + running_sum
    rest = (plan.abstract.opt_state, plan.abstract.step, plan.abstract.rng)
    optimizer = aot.shard_bytes(rest, (plan.shardings.opt_state, plan.shardings.step, plan.shardings.rng))
    place, host, fetched = offload_plan.placement(cfg, plan), {}, 0
    exact = EXACT
    if place.optimizer:  # the state lives on the host; the update fetches it (module docstring)
        host["optimizer"] = aot.shard_bytes(plan.abstract.opt_state, plan.shardings.opt_state)
        optimizer -= host["optimizer"]
        fetched += offload_plan.largest_moments(plan)
    if place.params:  # one layer's weights (and its gradient) on the device at a time
        w = offload_plan.weights(plan, step.layout, step.mesh)
        host["params"], host["grads"] = params, params
        grads, params = running_sum + w.layer, w.layer + w.other
        fetched += 2 * offload_plan.largest_param(plan)  # a parameter and its gradient
        exact = exact - {"params"}
    remat = getattr(cfg.model, "remat", "none")
    if place.activations != "none":  # the named residuals on the host, the rest recomputed
        prof, remat = offload_plan.profile(cfg, step), "full"
        host["activations"] = prof.named_bytes(offload_plan.OFFLOADED_NAMES[place.activations]) * prof.layers
    read: set[int] = set()  # the parameters the backward reads
    uses: dict = {}  # where the backward produces each gradient
    slices: list[int] = []  # a layer loop run as a loop: one backward iteration's slices of the stacks
    casts: list[int] = []  # the parameters' widening casts that are not residuals
    matmuls_at: dict = {}  # place -> the matmuls there (XLA:GPU's scratch beside them)
    kept = saved_activations(cfg, step, remat if place.activations != "none" else None, read=read, uses=uses,
                             slices=slices if remat == "none" else None, casts=casts, matmuls_at=matmuls_at)
    rolled = any(r.rolled for r in kept)  # the layer loop runs as a loop
    gathered = _gathers(cfg, step, read, rolled)  # param_layout: stored split, used whole
    activations = sum(r.total for r in kept) + gathered.kept
    if place.params and remat == "none":  # every layer's fetched weights kept for the backward
        activations += (offload_plan.profile(cfg, step).layers - 1) * w.layer_compute
    transient = _loop_iteration([r for r in kept if r.sliced])  # one iteration's slices a matmul reads
    if slices and remat == "none":  # nothing recomputed: one backward iteration's slices of the stacks, traced
        transient = slices[0]
    if remat != "none":  # one layer's recomputed residuals, live during its backward
        recomputed = _loop_iteration(saved_activations(cfg, step, "none", unrolled=True))
        transient += max(recomputed - _loop_iteration(kept), 0)
    one_at_a_time = None if place.params else _gradients_together(cfg, step)
    if one_at_a_time is None:
        # on XLA:GPU the update phase holds the running sum in its place (see _update_phase)
        held = 0 if _platform(step) == "gpu" else running_sum
        update = _update_phase(cfg, step, rolled) + held + fetched
    else:  # each gradient applied as it is produced: one at a time (and the running sum)
        grads = running_sum + one_at_a_time
        update = grads + fetched
    extra = _update_extra(cfg, step, uses)  # what each leaf's update holds beyond its gradient
    if cfg.train.microbatches == 1:  # applied where the backward produces it, else after the accumulation
        apply = {i: u[2] + extra.get(i, 0) for i, u in uses.items()}
    else:
        apply = {}
    if one_at_a_time is not None:  # held together, the reduced copies' room is freed before the updates run
        update += max(extra.values(), default=0)
    together = None if one_at_a_time is not None else grads - running_sum + gathered.grads
    if cfg.train.microbatches > 1 and _platform(step) == "gpu":
        # each gradient is added to the running sum as it is produced, in place (the matmul's
        # accumulating epilogue); one re-placed to a smaller shard exists whole until reduce-scattered
        # the backward layer loop writes every stacked parameter's gradient into a stack of its own,
        # all live until the loop ends (its outputs), and only then added to the running sum
        # (re-placed ones reduce-scattered layer by layer into stacks at their own shard)
        variables = jax.tree.leaves(plan.abstract.params, is_leaf=lambda x: isinstance(x, nnx.Variable))
        own = jax.tree.leaves(plan.shardings.params)
        act = shapes.act_shardings(plan.abstract.params, step.layout, step.mesh)
        stacks = {i: math.prod(own[i].shard_shape(v.get_value().shape)) * v.get_value().dtype.itemsize
                  for i, v in enumerate(variables) if rolled and (v.get_metadata().get("dims") or ("",))[0] == "layers"}
        stacked = sum(stacks.values())
        replaced = {i for i in range(len(own)) if own[i].spec != act[i].spec}
        together, apply = None, {i: stacked if i in stacks else u[2] if i in replaced else 0 for i, u in uses.items()}
    workspace, partials = gemm.matmul_scratch(step, matmuls_at, compiler_options) if _platform(step) == "gpu" else (0, {})
    walk = _backward_walk(kept, uses, len(jax.tree.leaves(plan.abstract.params)), together, apply, partials)
    backward = walk + activations - sum(r.total for r in kept) + running_sum + transient + gathered.loop + workspace
    if cfg.train.microbatches > 1:  # the batch in microbatch-major order: a transposed copy, the loop's input
        backward += cfg.train.microbatches * sum(residuals.nbytes(b) for b in jax.tree.leaves(shapes.device_batch(cfg, step)))
    if cfg.train.microbatches > 1:  # the gathers and casts leave the accumulation loop: every copy held through it
        if _platform(step) == "gpu":  # XLA:GPU gathers inside the accumulation loop, once per microbatch
            backward += gathered.layers + sum(casts)
        else:
            backward += gathered.rest + gathered.layers + sum(casts)
            update += gathered.copies
        nparams = len(jax.tree.leaves(plan.abstract.params))  # the body's own microbatch of what the backward reads
        backward += sum(residuals.nbytes(b) for j, b in enumerate(jax.tree.leaves(shapes.device_batch(cfg, step))) if nparams + j in read)
    one_batch = aot.shard_bytes(batch)
    categories = {
        "params": params, "grads": grads, "optimizer": optimizer, "activations": activations,
        "workspace": max(backward, update, gathered.copies + gathered.relayout) - grads - activations,
        "inputs": one_batch, "queued_inputs": one_batch * cost.resident_batches(cfg),
    }  # fmt: skip
    if cfg.feed.mode == "routed":
        categories["relay_inputs"] = programs.relay_bytes(cfg, batch)
    return Breakdown(categories, exact, host)
