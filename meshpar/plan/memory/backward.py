"""The backward phase of the memory model: the most the backward pass holds at once.

:func:`walk` follows the forward's program order in reverse, as the backward runs it: the
residuals die in reverse order (each after the op that reads it) while the gradients are produced
(each at its parameter's last use in the forward). The rules, and what each argument stands for
in the compiled step, are in :mod:`meshpar.plan.memory.analytic`'s docstring.
"""

from __future__ import annotations

from meshpar.plan.memory import residuals


def loop_iteration(kept: list[residuals.Residual]) -> int:
    """Bytes of one iteration of the layer loop: the per-iteration residuals of the largest loop
    (a stack of one layer is a loop of one iteration: its residuals are that iteration's)."""
    loops: dict[int, int] = {}
    for r in kept:
        if r.loop:
            loops[r.copies] = loops.get(r.copies, 0) + r.nbytes
    return max(loops.values(), default=0)


def walk(kept: list[residuals.Residual], uses: dict, nparams: int, together: dict | None, apply: dict,
         scratch: dict | None = None, early: int = 0, transposed: bool = False, loops: dict | None = None,
         weights: dict | None = None, late: set | None = None) -> int:  # fmt: skip
    """The most the backward pass holds of residuals, cotangents and gradients at once, walking
    the forward's program order in reverse (see :mod:`meshpar.plan.memory.analytic`): at each kept
    residual the residuals made up to there and its cotangent; at each parameter's last use
    (where its gradient is produced) the residuals made before it and that op's cotangent.
    `together`: parameter leaf -> the bytes its gradient holds from where it is produced to the
    end, when all are held to the end; None when each is applied as it is produced (then
    `apply`: parameter leaf -> what applying its gradient holds, the gradient included).
    `early`: the bytes of the gradients held from the backward's first step on instead
    (accumulated into buffers zeroed before it: :func:`meshpar.plan.memory.gradients.accumulated`; left
    out of `together` and `apply`). `transposed`: a weight gradient contracting a cotangent of
    more than two dims reads it written out transposed (XLA:CPU). `scratch`: place -> the
    partial results the backward's matmuls there hold beside their operands and outputs
    (:func:`meshpar.plan.time.gemm.matmul_scratch`; XLA:GPU's Triton GEMMs). `loops`: place of a
    layer loop -> what one backward iteration holds beyond its residuals (the layer
    recomputed, its gathered weights, its gradients and their reduced copies); the loop's own
    gradients in `together` count every layer's there but the last iteration's, produced one
    weight at a time as that iteration's extras die (the largest beside them, or all of them
    once they have). `weights`: place -> the gathered weights kept for the backward there
    (residuals whose cotangent is the gradient). `late`: the gradient leaves produced only
    after the backward's layer loop (XLA:GPU runs those weight gradients' matmuls next to their
    reduction, at the backward's end): from their place on the matmul's cotangent is held
    instead, and at the end both (beside every gradient: XLA:GPU may reduce the others first)."""
    scratch, loops, late = scratch or {}, loops or {}, late or set()
    layers, made, cots = _by_place(kept)
    grads = {i: u for i, u in uses.items() if i < nparams}
    weights = weights or {}
    places = sorted(set(made) | set(weights) | {u.at for u in grads.values()}, reverse=True)
    before = sum(made.values())  # residuals made before the place being walked
    before += sum(weights.values())  # ... and the weights read there or before
    held, waiting = early, 0  # `waiting`: the late gradients' cotangents
    peak = early + sum((together or {}).values()) + sum(grads[i].cot or 0 for i in late if i in grads)
    for p in places:
        here = made.get(p, 0)
        before -= here
        born = [i for i, u in grads.items() if u.at == p]
        new = [(together or {}).get(i, 0) for i in born if i not in late]
        held += sum(new)
        extra = scratch.get(p, 0) + _loop_extra(new, layers.get(p, 1), loops.get(p, 0))
        if here:  # its residuals read: their cotangent live, and every residual made before
            peak = max(peak, before + here + cots.get(p, 0) + held + waiting + extra)
        for i in born:  # the gradient produced: the op's cotangent (a loop's: its largest residual's, its stacks live)
            u = grads[i]
            cot = cots.get(p, 0) if u.cot is None else u.cot
            live = before + (here if u.cot is None else 0) + cot + (cot if transposed and u.folded else 0) + waiting
            applied = 0 if together is not None or i in late else apply.get(i, 0)
            peak = max(peak, live + held + applied + extra)
        waiting += sum(grads[i].cot or 0 for i in born if i in late)
        before -= weights.get(p, 0)  # read: dead below
    return int(peak)


def _by_place(kept: list[residuals.Residual]) -> tuple[dict[int, int], dict[int, int], dict[int, int]]:
    """Place -> a loop's iterations, the bytes of the residuals made there, and their largest cotangent."""
    layers = {}  # a loop's place -> its iterations
    for r in kept:
        if r.loop:
            layers[r.at] = max(layers.get(r.at, 1), r.copies)
    made: dict[int, int] = {}  # place -> bytes of the residuals made there
    cots: dict[int, int] = {}
    for r in kept:
        made[r.at] = made.get(r.at, 0) + r.total
        cots[r.at] = max(cots.get(r.at, 0), r.cot or r.nbytes)
    return layers, made, cots


def _loop_extra(new: list[int], n: int, extras: int) -> int:
    """What a loop of `n` iterations holds beyond the held gradients: an iteration's `extras` beside its `new`."""
    # a loop's iteration: its extras beside every gradient produced by then, its own layer's
    # produced one weight at a time as those die (the largest beside them, or all of them)
    share = sum(new) // n
    return max(extras + max(new, default=0) // n, share) - share
