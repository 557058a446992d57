"""The analytic per-device memory model (meshpar.plan.memory.analytic)."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshpar.configuration import config
from meshpar.jax_compat import saved_residuals
from meshpar.plan.memory import analytic as memory
from meshpar.plan.memory import gathers, gradients, residuals, trace
from meshpar.plan.time import gemm
from meshpar.run import experiment
from meshpar.step import aot, parts

TINY_TRANSFORMER = [
    "model.d_model=32", "model.n_heads=2", "model.d_head=16", "model.d_ff=64", "model.max_length=16",
    "data.length=16", "data.max_bytes=200000", "train.batch_size=16", "train.eval_every=0", "checkpoint.every=0",
]  # fmt: skip
TINY_LLAMA = [*TINY_TRANSFORMER, "model.n_kv_heads=1", "model.d_ff=48", "model.tie_embeddings=true"]
TINY_MLP = ["model.hidden=[64,32]", "data.num_examples=256", "data.num_eval_examples=0", "train.batch_size=32",
            "data.num_features=48", "train.eval_every=0"]  # fmt: skip


def _device0_bytes(tree) -> int:
    """Bytes of every array of `tree` on the first device, read from the arrays' own shards."""
    device = jax.devices()[0]
    return sum(s.data.nbytes for a in jax.tree.leaves(tree) for s in a.addressable_shards if s.device == device)


@pytest.mark.parametrize(
    "path, overrides",
    [
        ("experiments/transformer_fsdp.yaml", TINY_TRANSFORMER),
        ("experiments/mlp_model_parallel.yaml", [*TINY_MLP, "param_layout=pixels:data", "feed.mode=routed"]),
    ],
)
def test_params_optimizer_and_inputs_are_the_bytes_of_the_real_shards(tmp_path, path, overrides):
    cfg = config.load(path, [*overrides, f"workdir={tmp_path}"])
    plan = memory.analytic(parts.abstract_step(cfg))
    assert plan.exact == {"params", "optimizer", "inputs", "queued_inputs", "relay_inputs"}
    assert list(plan.categories)[:7] == [
        "params", "grads", "optimizer", "activations", "workspace", "inputs", "queued_inputs"
    ]  # fmt: skip
    ex = experiment.build(cfg)
    state = ex.state
    assert plan.categories["params"] == _device0_bytes(state.params)
    assert plan.categories["optimizer"] == _device0_bytes((state.opt_state, state.step, state.rng))
    with ex.inputs.batches(0, 1) as batches:
        arrays = next(iter(batches)).arrays
        one_batch = _device0_bytes(arrays)
        relay = ex.inputs.feeder.relay
        peak = ex.inputs.feeder.memory_report()["peak_input_bytes"][str(relay.id)]
    assert plan.categories["inputs"] == one_batch  # the step's own batch
    assert plan.categories["queued_inputs"] == one_batch * (cfg.feed.prefetch + 1)  # prefetched + one dispatched step's
    if (
        cfg.feed.mode == "routed"
    ):  # the relay's staging copy of the whole batch and its slices, as the feeder counts them
        assert plan.categories["relay_inputs"] == peak - one_batch
    else:
        assert "relay_inputs" not in plan.categories
    assert plan.total == sum(plan.categories.values())


def test_activations_fall_with_remat_and_with_microbatches():
    def activations(*overrides):
        return memory.analytic(
            parts.abstract_step(config.load("experiments/quickstart.yaml", [*TINY_TRANSFORMER, *overrides]))
        ).categories["activations"]

    none, dots, full = (activations(f"model.remat={r}") for r in ("none", "dots", "full"))
    assert full < dots < none
    assert activations("train.microbatches=4") < activations("train.microbatches=2") < none
    # FSDP changes where the weights live, not what one device computes with: the same residuals,
    # plus the gathered copies of the weights the backward reads (stored split, used whole) where
    # the unrolled layer loop keeps each layer's slice of the stored stacks
    plain = config.load("experiments/quickstart.yaml", TINY_TRANSFORMER)
    plain_step, plain_read = parts.abstract_step(plain), set()
    kept = sum(r.total for r in trace.saved_activations(plain_step, read=plain_read))
    sliced = gathers.gathers(plain_step, plain_read).kept  # every layer's slice of each weight stack
    assert sliced > 0 and none == kept + sliced
    cfg = config.load("experiments/transformer_fsdp.yaml", TINY_TRANSFORMER)
    step, read = parts.abstract_step(cfg), set()
    assert sum(r.total for r in trace.saved_activations(step, read=read)) == kept
    gathered = gathers.gathers(step, read).kept
    assert gathered > sliced and memory.analytic(step).categories["activations"] == kept + gathered


def test_a_model_parallel_split_divides_the_split_weights_state():
    one = memory.analytic(
        parts.abstract_step(config.load("experiments/mlp_model_parallel.yaml", [*TINY_MLP, "mesh=data:8,model:1"]))
    )
    two = memory.analytic(
        parts.abstract_step(config.load("experiments/mlp_model_parallel.yaml", [*TINY_MLP, "mesh=data:4,model:2"]))
    )
    # hidden is split over model: the [48, 64] and [64, 32] kernels and the hidden bias halve
    split = (48 * 64 + 64 + 64 * 32) * 4
    assert one.categories["params"] - two.categories["params"] == split // 2


def test_an_absurd_layer_is_planned_in_seconds_without_allocating(env):
    code = (
        "import time, jax; jax.config.update('jax_num_cpu_devices', 8); t = time.perf_counter()\n"
        "from meshpar.configuration import config; from meshpar.plan.memory import analytic as memory\n"
        "from meshpar.step import parts\n"
        "cfg = config.load('experiments/mlp_model_parallel.yaml', ['model.hidden=[2000000000,256]'])\n"
        "b = memory.analytic(parts.abstract_step(cfg)); print(b.categories['params'], b.total, time.perf_counter() - t)\n"
        "print(sum(a.nbytes for a in jax.live_arrays()))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    (params, total, seconds), (peak,) = (line.split() for line in out.stdout.splitlines())
    # the [784, 2e9] and [2e9, 256] kernels, split 2 ways over model, in float32: ~4 TB per device
    assert int(params) > 2e9 * (784 + 256) * 4 / 2 and int(total) > int(params)
    assert float(seconds) < 20
    assert int(peak) < 1e6  # no array of the plan's size exists: shapes only


@pytest.mark.parametrize(
    "path, overrides",
    [
        ("experiments/mlp_data_parallel.yaml", TINY_MLP),
        ("experiments/quickstart.yaml", TINY_TRANSFORMER),
        ("experiments/llama_tiny.yaml", TINY_LLAMA),
    ],
)
def test_the_step_estimate_is_within_ten_percent_of_xla(path, overrides):
    # data parallel MLP: the peak is the update (gradients beside their all-reduced copy);
    # Transformer: the backward pass (saved activations); Llama: the same, with multi-query
    # attention's one key/value head whole on every device while the query heads are split
    cfg = config.load(path, overrides)
    step = parts.abstract_step(cfg)
    c = memory.analytic(step).categories
    step_total = sum(c[k] for k in ("params", "grads", "optimizer", "activations", "workspace", "inputs"))
    xla = aot.memory(step.lower().compile())["total_bytes"]
    assert abs(step_total - xla) <= 0.10 * xla, (step_total, xla)


FSDP_MLP = ["mesh=data:8", "layout=batch:data", "param_layout=hidden:data", "model.hidden=[1024,256]",
            "data.num_features=512", "train.batch_size=64", "optimizer.name=sgd", "data.num_examples=256",
            "data.num_eval_examples=0", "train.eval_every=0"]  # fmt: skip


@pytest.mark.parametrize("extra", [["model.remat=full"], ["model.remat=none", "train.microbatches=2"]])
def test_gathered_parameters_are_counted_under_param_layout(extra):
    # weights stored split over data but used whole: the gathered copies (forward and, under
    # remat, the backward's second gather, at the step's start) and the whole gradients beside
    # their all-reduced copies dwarf the stored shards; counting only the shards runs ~50% low
    cfg = config.load("experiments/mlp_data_parallel.yaml", [*FSDP_MLP, *extra])
    step = parts.abstract_step(cfg)
    c = memory.analytic(step).categories
    step_total = sum(c[k] for k in ("params", "grads", "optimizer", "activations", "workspace", "inputs"))
    xla = aot.memory(step.lower().compile())["total_bytes"]
    assert abs(step_total - xla) <= 0.10 * xla, (step_total, xla)


# a vocabulary 128 times the width: the table, its gradient and the logits outweigh the layers
LARGE_VOCAB = ["mesh=data:8", "layout=batch:data", "model.vocab_size=4096"]


@pytest.mark.parametrize(
    "path, overrides",
    [
        # FSDP: the gathered output projection kept for the backward, the logits' cotangent and
        # its transposed copy beside the projection's whole gradient, and the embedding's
        # gradient table, zeroed before the backward begins (~20% low without them)
        ("experiments/transformer_fsdp.yaml", [*TINY_TRANSFORMER, *LARGE_VOCAB]),
        # the same with the layer loop run as a loop: each layer's gradient reduced in its
        # iteration into a stack at its stored shard, not every layer's whole beside its copy
        ("experiments/transformer_fsdp.yaml", [*TINY_TRANSFORMER, *LARGE_VOCAB, "model.remat=full"]),
        # tied embeddings, data parallel: the table's gradient in two parts (the gather's and the
        # logits matmul's), each all-reduced before they are added (~27% low without them)
        ("experiments/llama_tiny.yaml", [*TINY_LLAMA, *LARGE_VOCAB]),
    ],
)
def test_a_large_vocabulary_is_counted_as_xla_holds_it(path, overrides):
    cfg = config.load(path, overrides)
    step = parts.abstract_step(cfg)
    c = memory.analytic(step).categories
    step_total = sum(c[k] for k in ("params", "grads", "optimizer", "activations", "workspace", "inputs"))
    xla = aot.memory(step.lower().compile())["total_bytes"]
    assert abs(step_total - xla) <= 0.05 * xla, (step_total, xla)


def test_where_each_gradient_is_produced_and_in_what_dtype():
    table = jax.ShapeDtypeStruct((512, 16), jnp.float32)
    ids = jax.ShapeDtypeStruct((4, 8), jnp.int32)

    def tied(w, ids):  # each read its own cast, as `use` makes them
        x = jnp.take(w.astype(jnp.bfloat16), ids, axis=0)  # [4, 8, 16]
        return jnp.einsum("ble,ve->blv", x, w.astype(jnp.bfloat16)).astype(jnp.float32).sum()

    uses: dict = {}
    residuals.kept_residuals(tied, table, ids, uses=uses)
    u = uses[0]
    # produced in bfloat16 (the casts are the table), by the logits matmul (its weight gradient,
    # over a cotangent of three dims) and the gather (added into a zeroed table), in two parts
    assert u.nbytes == 512 * 16 * 2 and u.cot == 4 * 8 * 512 * 2
    assert u.matmul and u.folded and u.scattered and u.parts == 2


X = np.ones((64, 32), np.float32)
W = jax.ShapeDtypeStruct((32, 16), jnp.float32)
V = jax.ShapeDtypeStruct((16, 8), jnp.float32)
ONE = 64 * 16 * 4  # bytes of one [64, 16] float32 value


def _jax_residual_bytes(fn, *args) -> int:
    """Bytes of the residuals JAX saves that are not the function's own arguments."""
    return sum(r.nbytes for r in saved_residuals(fn, *args) if r.source != "argument")


def test_a_cheap_residual_made_from_kept_ones_is_dropped_unless_a_matmul_reads_it():
    def scaled(w):  # JAX saves y * 2 and what tanh's derivative needs; XLA keeps y alone
        y = jnp.tanh(X @ w)
        return jnp.sum(y * (y * 2.0))

    def fed_to_matmul(w, v):
        y = jnp.tanh(X @ w)
        z = y * 2.0
        return jnp.sum(y * z) + jnp.sum(z @ v)

    assert _jax_residual_bytes(scaled, W) > ONE
    assert [(r.total, r.label) for r in residuals.kept_residuals(scaled, W)] == [(ONE, "tanh")]
    assert sorted(r.label for r in residuals.kept_residuals(fed_to_matmul, W, V)) == ["mul", "tanh"]


def test_a_value_scaled_per_feature_is_kept_for_the_scales_gradient():
    def scaled(w, s):
        y = jnp.tanh(X @ w) * 2.0  # cheap, from the kept tanh output
        return jnp.sum(jnp.sin(y * s))

    per_feature = residuals.kept_residuals(scaled, W, jax.ShapeDtypeStruct((16,), jnp.float32))
    elementwise = residuals.kept_residuals(scaled, W, jax.ShapeDtypeStruct((64, 16), jnp.float32))
    # s broadcast over the rows: its gradient sums y * cotangent over them, so y must exist
    assert sorted(r.label for r in per_feature) == ["cos", "mul", "tanh"]
    assert sorted(r.label for r in elementwise) == ["cos", "tanh"]


def test_a_reshaped_residual_is_counted_once():
    def reshaped(w, v):
        y = jnp.tanh(X @ w)
        return jnp.sum(y.reshape(8, 8, 16) @ v)  # the matmul reads the reshape of y

    assert _jax_residual_bytes(reshaped, W, V) >= 2 * ONE  # tanh's output and its reshape
    assert [(r.total, r.label) for r in residuals.kept_residuals(reshaped, W, V)] == [(ONE, "tanh")]


@pytest.mark.parametrize("unroll", [1, 4])
def test_a_rolled_loop_keeps_every_stacked_residual_an_unrolled_one_fuses(unroll):
    def layers(w):
        def body(c, _):
            y = jnp.tanh(c @ w)
            return (y * (1.0 - y)) @ w.T, None

        return jax.lax.scan(body, X, None, length=4, unroll=unroll)[0].sum()

    kept = residuals.kept_residuals(layers, W)
    assert all(r.copies == 4 for r in kept)  # stacked over the 4 iterations
    if unroll == 1:  # loop outputs: nothing can be recomputed from them
        stacked = [r for r in saved_residuals(layers, W) if r.source == "scan"]
        assert len(kept) == len(stacked) == 5  # the layer input, and four values of the body
        assert sum(r.total for r in kept) == sum(r.nbytes for r in stacked)
    else:  # straight-line: the layer input, tanh's output and the matmul's operand
        assert sorted(r.label for r in kept) == ["loop carry", "mul", "tanh"]


def test_the_batch_is_an_argument_not_a_saved_activation():
    # stop_gradient lowers to nothing: the model's first matmul reads the batch argument itself
    cfg = config.load("experiments/mlp_model_parallel.yaml", TINY_MLP)
    rows = cfg.train.batch_size // 4  # data:4
    kept = trace.saved_activations(parts.abstract_step(cfg))
    assert all(r.nbytes != rows * cfg.data.num_features * 4 for r in kept)


def test_gradients_are_held_together_only_when_the_update_needs_them_together():
    one_by_one = ["mesh=model:8", "layout=hidden:model", "optimizer.name=sgd"]
    cfg = config.load("experiments/mlp_model_parallel.yaml", [*TINY_MLP, *one_by_one])
    plan = memory.analytic(parts.abstract_step(cfg))
    # no clipping, nothing summed or re-placed: each gradient updates its parameter as it is produced
    assert plan.categories["grads"] == 48 * 64 // 8 * 4  # the largest: the [48, 64] kernel's shard
    clipped = memory.analytic(
        parts.abstract_step(
            config.load(
                cfg_path := "experiments/mlp_model_parallel.yaml",
                [*TINY_MLP, *one_by_one, "optimizer.grad_clip_norm=1.0"],
            )
        )
    )
    assert clipped.categories["grads"] == clipped.categories["params"]  # the global norm needs every one
    summed = memory.analytic(
        parts.abstract_step(config.load(cfg_path, TINY_MLP))
    )  # data:4: the devices sum every gradient
    assert summed.categories["grads"] == summed.categories["params"]


def test_microbatches_hold_the_batch_in_microbatch_major_order():
    # splitting rows i, i + k, … into microbatch i is a transpose: XLA writes out a copy of the batch
    overrides = [*TINY_MLP, "model.hidden=[8]", "data.num_features=1024", "train.batch_size=256",
                 "mesh=model:8", "layout=hidden:model", "train.microbatches=2"]  # fmt: skip
    c = memory.analytic(parts.abstract_step(config.load("experiments/mlp_model_parallel.yaml", overrides))).categories
    assert c["grads"] + c["activations"] + c["workspace"] >= 256 * 1024 * 4  # the whole batch, float32


@pytest.mark.parametrize(
    "overrides",
    [
        # data parallel, SGD: the first kernel's gradient is produced after every residual has died
        [
            "mesh=data:8",
            "layout=batch:data",
            "model.hidden=[1024]",
            "data.num_features=256",
            "train.batch_size=1024",
            "model.remat=dots",
            "optimizer.name=sgd",
            "model.activation=tanh",
        ],
        # Mesh TensorFlow's mnist layout, AdamW: each gradient applied as it is produced, beside its square
        [
            "mesh=b1:2,b2:2",
            "layout=pixels:(b1,b2)",
            "model.hidden=[512,512]",
            "data.num_features=784",
            "train.batch_size=200",
            "optimizer.name=adamw",
        ],
    ],
)
def test_residuals_die_in_reverse_order_as_the_gradients_are_produced(overrides):
    # counting every residual beside every gradient and the largest cotangent reads ~12% high on
    # the first; leaving out the square AdamW writes out for the gradient norm, ~15% low on the second
    cfg = config.load(
        "experiments/mlp_data_parallel.yaml",
        [*overrides, "data.num_examples=2048", "data.num_eval_examples=0", "train.eval_every=0"],
    )
    step = parts.abstract_step(cfg)
    c = memory.analytic(step).categories
    step_total = sum(c[k] for k in ("params", "grads", "optimizer", "activations", "workspace", "inputs"))
    xla = aot.memory(step.lower().compile())["total_bytes"]
    assert abs(step_total - xla) <= 0.05 * xla, (step_total, xla)


def test_an_update_holds_what_it_shares_with_the_gradient_norm():
    from meshpar.step import trainer

    def copies(name):
        cfg = config.load("experiments/mlp_data_parallel.yaml", [f"optimizer.name={name}"])
        return gradients.update_copies(trainer.make_optimizer(cfg.optimizer, 10), (8, 4), jnp.float32)

    assert copies("adamw") == 1  # the gradient's square: the second moment's and the norm's
    assert copies("sgd") == 0  # momentum reads the gradient itself


@pytest.mark.parametrize(
    "extra",
    [
        # a layer loop run as a loop: its backward slices each iteration's matmul-read residuals
        # out of their stacks into buffers of their own (~19% low without them)
        [
            "model.scan_unroll=1",
            "model.n_layers=2",
            "mesh=data:2",
            "layout=batch:data",
            "model.n_heads=4",
            "model.d_head=32",
            "model.d_ff=256",
            "model.max_length=64",
            "data.length=64",
        ],
        # the same under FSDP with remat: the stacked weights' transposed-layout copy, hoisted out
        # of the loops, and one layer's gathered copies per iteration (~19% low without them)
        [
            "mesh=data:4,model:2",
            "layout=batch:data; d_ff:model; heads:model; vocab:model",
            "model.d_model=64",
            "model.n_heads=16",
            "model.d_head=32",
            "model.d_ff=1024",
            "model.n_layers=4",
            "data.length=64",
            "model.max_length=64",
            "train.batch_size=32",
            "train.microbatches=4",
            "model.remat=full",
            "param_layout=embed:data",
        ],
    ],
)
def test_a_layer_loop_run_as_a_loop_holds_one_iterations_slices_and_gathers(extra):
    cfg = config.load("experiments/quickstart.yaml", [*TINY_TRANSFORMER, *extra])
    step = parts.abstract_step(cfg)
    c = memory.analytic(step).categories
    step_total = sum(c[k] for k in ("params", "grads", "optimizer", "activations", "workspace", "inputs"))
    xla = aot.memory(step.lower().compile())["total_bytes"]
    assert abs(step_total - xla) <= 0.10 * xla, (step_total, xla)


def _lone_matmul_hlo(*ops: str) -> str:
    """A compiled program of one [64, 8192] x [8192, 64] matmul, as XLA:GPU prints it: `ops` in its ENTRY."""
    return "\n".join([
        "HloModule lone", "",
        "ENTRY %main (p0: f32[64,8192], p1: f32[8192,64]) -> f32[64,64] {",
        "  %p0 = f32[64,8192]{1,0} parameter(0)",
        "  %p1 = f32[8192,64]{1,0} parameter(1)",
        *(f"  {op}" for op in ops),
        "}", "",
    ])  # fmt: skip


TRITON_GEMM = 'kind=kCustom, calls=%g, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}'
SPLIT_K_HLO = _lone_matmul_hlo(
    f"%gemm_fusion_dot = f32[8,64,64]{{2,1,0}} fusion(%p0, %p1), {TRITON_GEMM}",
    "ROOT %loop_reduce_fusion = f32[64,64]{1,0} fusion(%gemm_fusion_dot), kind=kLoop, calls=%r",
)
CUBLAS_HLO = _lone_matmul_hlo(
    "%transpose = f32[64,8192]{1,0} fusion(%p1), kind=kLoop, calls=%t",
    "%cublas-lt-matmul = (f32[64,64]{1,0}, s8[4194304]{0}) custom-call(%p0, %transpose), "
    'custom_call_target="__cublas$lt$matmul"',
    "ROOT %gte = f32[64,64]{1,0} get-tuple-element(%cublas-lt-matmul), index=0",
)


def test_a_gemms_scratch_is_what_it_writes_beside_its_result():
    # Triton's split-K: eight partial results, summed afterwards; cuBLAS: the workspace in its
    # result tuple (the operand's transposed copy around a lone matmul is not the GEMM's)
    assert gemm.gemm_scratch(SPLIT_K_HLO, 64 * 64) == (0, 8 * 64 * 64 * 4)
    assert gemm.gemm_scratch(CUBLAS_HLO, 64 * 64) == (4 * 2**20, 0)
    assert gemm.gemm_scratch(SPLIT_K_HLO.replace("f32[8,64,64]", "f32[64,64]"), 64 * 64) == (0, 0)  # no split


def test_host_offload_on_a_gpu_compiled_deviceless_is_out_of_scope_there_only():
    cfg = config.load("experiments/offload.yaml")
    assert jax.default_backend() == "cpu"  # a GPU platform here is a compile-only target
    assert "compile-only" in memory.out_of_scope(cfg, "gpu")
    assert "XLA:CPU" in memory.out_of_scope(cfg, "cpu")
    assert memory.out_of_scope(config.load("experiments/quickstart.yaml"), "gpu") is None


def test_a_mixture_of_experts_is_in_scope_but_dropless_dispatch_with_split_weights():
    moe = config.load("experiments/moe_tiny.yaml")
    assert all(memory.out_of_scope(moe, p) is None for p in ("cpu", "gpu"))
    split = config.load("experiments/moe_tiny.yaml", ["model.moe_dispatch=dropless"])  # experts:expert
    assert all("expert weights split by experts" in memory.out_of_scope(split, p) for p in ("cpu", "gpu"))
    megatron = config.load(
        "experiments/moe_tiny.yaml", ["model.moe_dispatch=dropless", "layout=batch:data; d_ff:expert"]
    )
    assert "d_ff" in memory.out_of_scope(megatron, "cpu")


def test_dropless_dispatch_with_replicated_experts_is_within_the_target_of_xla():
    """The dropless bound: ragged_dot traced as jax lowers it (a masked copy of the rows per expert)."""
    cfg = config.load("experiments/moe_tiny.yaml", ["model.moe_dispatch=dropless", "layout=batch:(data,expert)",
                                                    "data.max_bytes=200000", "train.progress=false"])  # fmt: skip
    assert memory.out_of_scope(cfg, "cpu") is None
    step = parts.abstract_step(cfg)
    plan = memory.analytic(step)
    xla = aot.memory(step.lower().compile())
    total = plan.total - plan.categories["queued_inputs"]
    assert abs(total - xla["total_bytes"]) / xla["total_bytes"] <= 0.10
