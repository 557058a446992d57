"""The sections of an experiment config: one frozen dataclass per section (``data``,
``train``, ``checkpoint``, ...) and :class:`Config`, which holds them. Each field's comment is its
documentation (the config reference is rendered from them); its ``metadata`` holds its bounds.
Reading and checking a config are :mod:`meshpar.configuration.loading` and
:mod:`meshpar.configuration.checks`.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any, Literal

# layout before anything that imports jax: it imports meshpar.sharding.mesh first, which keeps
# a bad JAX_NUM_CPU_DEVICES from breaking `import jax` (see there).
from meshpar.sharding import layout as layout_lib  # isort: skip
from meshpar import sources
from meshpar.configuration.schema import INT32_MAX, MAX_TIMEOUT_S, SEED_MAX, at_least, between


@dataclasses.dataclass(frozen=True)
class DataConfig:
    # Where examples come from: synthetic (seeded teacher-network task), tfds (array_record on
    # disk), text (token windows of a directory of .py files; default the Python standard
    # library), tfds_text (token windows of a tfds Text feature); tokens as data.tokenizer says;
    # tokens (windows of a corpus prepared by `python -m meshpar.data prepare`, at data.path).
    source: Literal[sources.names()] = "synthetic"
    # synthetic: train / eval rows, input width ("pixels") and number of classes (labels are int32).
    num_examples: int = dataclasses.field(default=16384, metadata=at_least(1))
    num_eval_examples: int = dataclasses.field(default=2048, metadata=at_least(0))
    num_features: int = dataclasses.field(default=784, metadata=at_least(1))
    num_classes: int = dataclasses.field(default=10, metadata=between(2, INT32_MAX))
    # tfds: dataset name, offline data_dir (prepared as array_record), splits, and which
    # features become the fields `inputs` and `targets`.
    name: str = ""
    data_dir: str = ""
    split: str = "train"
    eval_split: str = ""
    fields: dict[str, str] = dataclasses.field(default_factory=lambda: {"inputs": "image", "targets": "label"})
    # text / tfds_text: tokens per example window ("length"), the corpus ("" = the Python
    # standard library's own sources), the share of files held out for eval (chosen by a hash
    # of each file's path, so a file is never in both), a cap on bytes read per split (0 = all),
    # and the tfds Text feature to read.
    length: int = dataclasses.field(default=128, metadata=at_least(1))
    corpus_dir: str = ""
    eval_fraction: float = dataclasses.field(default=0.05, metadata=between(0.0, 1.0))
    max_bytes: int = dataclasses.field(default=0, metadata=at_least(0))
    text_feature: str = "text"
    # text / tfds_text: how text becomes token ids. byte = one token per byte (vocabulary 256);
    # a path = a Hugging Face tokenizer (its tokenizer.json, or a folder holding one), read with
    # `tokenizers`; "" = the tokenizer of checkpoint.init_from when it has one, else byte.
    # model.vocab_size must be at least the tokenizer's. Token streams are cached in
    # ~/.cache/meshpar/tokens (environment variable MESHPAR_TOKEN_CACHE; "" = no cache).
    tokenizer: str = ""
    # tokens: the prepared corpus's folder (its manifest.json names the tokenizer, which
    # data.tokenizer may repeat but not contradict); data.split / data.eval_split name its
    # splits (prepare writes train and eval; eval_split "" = no eval). Windows of data.length + 1:
    # packed = documents end to end with the end-of-document token between them; document =
    # windows never cross a document (the tail of each that does not fill a window is dropped).
    # verify: check every shard's sha256 against the manifest when the corpus opens (one read
    # of the corpus; ids beyond the vocabulary are refused on every read either way).
    path: str = ""
    windows: Literal["packed", "document"] = "packed"
    verify: bool = True
    # Worker processes that assemble host batches (Grain, spawned; batches reach this process
    # through shared memory); 0 = in the training process. Every batch's content and order are
    # the same for every value, so a run may resume with another; eval reads in this process.
    # At most 256 (no host needs more, and each costs a process's start-up and memory).
    workers: int = dataclasses.field(default=0, metadata=between(0, 256))


@dataclasses.dataclass(frozen=True)
class FeedConfig:
    # direct: each device gets its own slice from the host; routed: the whole batch goes to
    # the mesh's first device, which then hands out slices (Mesh TensorFlow's GPU path).
    mode: Literal["direct", "routed"] = "direct"
    # Batches kept already placed on the devices ahead of the step (0 = place on demand).
    prefetch: int = dataclasses.field(default=2, metadata=at_least(0))
    # Read host batches into a pool of reused aligned buffers (synthetic source only); a buffer
    # that a placed batch aliases (CPU zero-copy) is never reused.
    reuse_buffers: bool = False


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    # The optax optimizer, and its learning rate (after warmup; the peak of a cosine schedule).
    name: Literal["adam", "adamw", "sgd", "lion"] = "adamw"
    learning_rate: float = dataclasses.field(default=1e-3, metadata=at_least(0.0))
    # Learning-rate schedule: constant, or cosine decay to 0 over decay_steps; both after warmup.
    schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = dataclasses.field(default=0, metadata=between(0, INT32_MAX))
    # The schedule's horizon in steps (warmup included). 0 = train.steps of the run's first
    # launch; checkpoints keep it, so `--resume train.steps=<more>` extends a run without
    # reshaping its schedule.
    decay_steps: int = dataclasses.field(default=0, metadata=between(0, INT32_MAX))
    b1: float = 0.9  # adam/adamw/lion first moment; sgd momentum (0 = plain SGD)
    b2: float = 0.999  # adam/adamw/lion second moment
    weight_decay: float = dataclasses.field(default=0.0, metadata=at_least(0.0))  # adamw/lion decoupled decay
    # Clip the global gradient norm to this (0 = no clipping).
    grad_clip_norm: float = dataclasses.field(default=0.0, metadata=at_least(0.0))


@dataclasses.dataclass(frozen=True)
class ProfileConfig:
    # Trace steps start .. start + steps - 1 (numbered as in metrics.jsonl, the first step is 1)
    # with jax.profiler into <workdir>/profile: the .xplane.pb that TensorBoard's profile plugin
    # reads and a Perfetto trace (perfetto_trace.json.gz, for ui.perfetto.dev). steps 0 = off.
    start: int = dataclasses.field(default=2, metadata=between(1, INT32_MAX))
    steps: int = dataclasses.field(default=0, metadata=between(0, INT32_MAX))


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    # Train up to this step; a resumed run continues from its checkpoint to it (0 steps left = done).
    steps: int = dataclasses.field(default=100, metadata=between(1, INT32_MAX))
    # Global batch size, summed over all devices and processes.
    batch_size: int = dataclasses.field(default=128, metadata=at_least(1))
    # Seeds parameter init, dropout and data order.
    seed: int = dataclasses.field(default=0, metadata=between(0, SEED_MAX))
    # Write metrics.jsonl / TensorBoard every this many steps (the last step is always logged).
    log_every: int = dataclasses.field(default=10, metadata=at_least(1))
    # Validation every this many steps (0 = never); on `eval_batches` batches of the eval split.
    eval_every: int = dataclasses.field(default=0, metadata=at_least(0))
    eval_batches: int = dataclasses.field(default=4, metadata=at_least(1))
    # Gradient accumulation: each step's batch is split into this many microbatches inside the
    # jitted step (each device splits its own rows), their gradients summed, one update. Under a
    # stage axis (layers:<axis> in the layout) they are the pipeline's microbatches instead: the
    # stages pass them along, one per tick (see the pipeline section); the update is the same.
    microbatches: int = dataclasses.field(default=1, metadata=between(1, INT32_MAX))
    # Show the rich progress bar (off in tests and under CI logs).
    progress: bool = True
    # Fetch every step's loss right after dispatching it (the host waits for each step). By
    # default a step's loss and gradient norm are fetched one step late, after the next step is
    # dispatched, so the host never leaves the devices idle; the results are bit-identical.
    # true helps debugging: an error surfaces at its own step and step times are one step each.
    sync_every_step: bool = False
    # A jax.profiler trace of a stretch of steps under <workdir>/profile.
    profile: ProfileConfig = ProfileConfig()


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    # Save the train state and input position every this many steps, at the end, and on
    # SIGINT/SIGTERM (orbax, async). 0 = no checkpoints at all.
    every: int = dataclasses.field(default=0, metadata=at_least(0))
    # Checkpoints kept, oldest deleted first (0 = all).
    keep: int = dataclasses.field(default=3, metadata=at_least(0))
    # Folder ("" = <workdir>/checkpoints).
    dir: str = ""
    # never: start from scratch; auto: continue from the newest complete checkpoint, if any
    # (the CLI's --resume sets auto). The mesh and layout may differ from the saved run's.
    resume: Literal["never", "auto"] = "never"
    # A fresh run into a checkpoint folder that already holds steps is refused (it would mix
    # two runs); true replaces the earlier run: its steps, metrics, summary and TensorBoard
    # events are removed before the first step.
    overwrite: bool = False
    # Keys (or whole sections) a resumed run may change from what its checkpoint was saved with,
    # e.g. [optimizer.learning_rate]. Without them, --resume refuses a changed seed, batch size,
    # model, optimizer or data setting.
    allow_changes: tuple[str, ...] = ()
    # A fresh run starts from these weights instead of random ones (fine-tuning: a new run with
    # its own record, optimizer state and step count from zero): a Hugging Face model folder
    # (config.json + safetensors) or a meshpar run (its workdir or checkpoint folder; the newest
    # step's parameters). "" = random init. A resumed run continues from its own checkpoint.
    init_from: str = ""


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    # Multi-process (multi-host) runs on jax.distributed: every process runs the same command
    # with its own process_id. num_processes 1 = a single process, nothing to join. An empty
    # coordinator ("host:port" of process 0) or process_id -1 lets jax.distributed detect them
    # from the cluster environment (SLURM, Open MPI, TPU pods, ...).
    num_processes: int = dataclasses.field(default=1, metadata=between(1, INT32_MAX))
    process_id: int = dataclasses.field(default=-1, metadata=between(-1, INT32_MAX))
    coordinator: str = ""
    # Seconds to wait for the coordinator and every peer to join before giving up.
    initialization_timeout: int = dataclasses.field(default=50, metadata=between(1, MAX_TIMEOUT_S))
    # Seconds without a heartbeat after which a process counts as lost and the job stops: every
    # survivor ends with `training error: lost process K (no heartbeat for N s); last
    # checkpoint: ...`, exit status 1 (meshpar's own check, from a thread: a long compile or
    # checkpoint save is no silence). jax's own heartbeat timeout is set to 2 * (this + 10) as
    # the backstop (meshpar.processes.together).
    heartbeat_timeout_seconds: int = dataclasses.field(default=10, metadata=between(1, MAX_TIMEOUT_S))
    # Seconds a process waits at exit for the others to reach their exit too.
    shutdown_timeout_seconds: int = dataclasses.field(default=30, metadata=between(1, MAX_TIMEOUT_S))


@dataclasses.dataclass(frozen=True)
class HardwareConfig:
    # Peak TFLOP/s per device for MFU; 0 = built-in bf16 figure for H100/H200/A100, or on CPU
    # a matmul measured at start.
    peak_tflops: float = dataclasses.field(default=0.0, metadata=at_least(0.0))
    # Memory per device in GiB that the memory plan checks a layout against. 0 = the backend's
    # own limit where it reports one (on GPU XLA's allocator limit: by default 75% of the
    # device, XLA_PYTHON_CLIENT_MEM_FRACTION), else on CPU the host RAM divided by the number of
    # simulated devices. A value set here never exceeds the backend's limit; set it low to
    # plan for a smaller device than this one. Under offload.unified_memory it is the device's
    # own memory, which the plan may oversubscribe.
    memory_gib: float = dataclasses.field(default=0.0, metadata=at_least(0.0))


@dataclasses.dataclass(frozen=True)
class PlanConfig:
    # Check, before anything is allocated, that the run fits each device's memory (the
    # capacity from hardware.memory_gib or the backend): the analytic memory model first (a
    # layout that cannot fit is refused without compiling), then XLA's figures for the train
    # step compiled ahead of time, whose program the run then uses. A refusal is one line with
    # what is needed, what is usable, the largest category and a change that fits, chosen from
    # a fixed list of candidates (meshpar.plan.preflight). false = no check; the train step
    # compiles at its first call.
    check: bool = True


@dataclasses.dataclass(frozen=True)
class OffloadConfig:
    # Out-of-core training through JAX memory kinds (meshpar.sharding.offload): what lives in the
    # host's pinned memory instead of on the devices. Offload changes where bytes live, never
    # the arithmetic: losses are bit-identical with it on or off (activations: see below).
    # The optimizer state lives in pinned host memory between steps; the step brings it to
    # the devices for the update and writes it back (the state is donated, as always).
    optimizer: bool = False
    # The parameters too: each scanned layer's weights are brought to the devices inside the
    # layer loop, and every parameter once more for the update (see meshpar.sharding.offload).
    params: bool = False
    # Residuals the backward pass reads, saved in host memory instead of on the devices:
    # none; layer_outputs = each layer's input and its residual stream after attention
    # (layer_in, attn_residual); dots = every named matmul output the layer keeps (query,
    # key, value, context, mlp_hidden, plus layer_in and attn_residual). Needs the
    # layer loop (model.scan_layers, a loop left by scan_unroll), like remat, and takes
    # model.remat's place (model.remat must be none); the mlp has no layer loop. Compare it
    # with the same names saved on the devices (scripts/bench_offload.py), not with none: a
    # remat policy changes the compiled program, so the losses differ from none's by rounding.
    activations: Literal["none", "layer_outputs", "dots"] = "none"
    # CUDA Unified Memory (meshpar.backend.unified_memory), the other out-of-core method: XLA's GPU
    # allocator (BFC) takes managed memory, which the CUDA driver pages between the GPU and
    # host memory on demand (2 MiB pages, on a page fault), so a step may need more than the
    # device holds. meshpar.train sets TF_FORCE_UNIFIED_MEMORY=1, the allocator fraction
    # (oversubscription) and XLA_PYTHON_CLIENT_PREALLOCATE=false before jax's backend starts;
    # variables set already win and are reported. A CUDA GPU only: a config error elsewhere.
    # It composes with every layout and with the offload settings above. The planner prices
    # it beside them: python -m meshpar.plan --topology T --compare-out-of-core.
    unified_memory: bool = False
    # With unified_memory: how many times the device's memory XLA's allocator may take
    # (XLA_CLIENT_MEM_FRACTION); the plan accepts up to that, and the bytes beyond the device's
    # memory are "migrated": paged to host memory and back every step. At most 16 (host memory
    # holds the rest).
    oversubscription: float = dataclasses.field(default=1.5, metadata=between(1.0, 16.0))


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    # Pipeline parallelism (meshpar.sharding.stages), on when the layout puts layers on a mesh axis,
    # the stage axis (layers:stage): its size is the number of stages, train.microbatches the
    # microbatches. gpipe: stage s holds the s-th contiguous slice of the layers; each
    # microbatch passes the stages once (bubble (S-1)/(M+S-1)). circular: each stage holds
    # `repeats` groups of layers, not contiguous, and a microbatch passes the stages `repeats`
    # times (bubble (S-1)/(R*M+S-1)); needs microbatches >= stages. Checkpoints keep layers in
    # their canonical order either way.
    schedule: Literal["gpipe", "circular"] = "gpipe"
    # Groups of layers per stage for the circular schedule (gpipe: must be 1); the layers must
    # divide by stages × repeats.
    repeats: int = dataclasses.field(default=1, metadata=between(1, INT32_MAX))


@dataclasses.dataclass(frozen=True)
class CompileCacheConfig:
    # JAX's persistent compilation cache: compiled programs are kept in this folder and reused
    # by the next start of the same program ("~" is the home folder; "" = no cache). The
    # environment variable JAX_COMPILATION_CACHE_DIR, when set, wins over this key.
    dir: str = "~/.cache/meshpar/jax"
    # Programs that compile faster than this are not kept (jax's own default, 1 s, would leave
    # out the quickstart's train step on CPU). JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS wins.
    min_compile_secs: float = dataclasses.field(default=0.1, metadata=at_least(0.0))


@dataclasses.dataclass(frozen=True)
class XlaConfig:
    # XLA compiler flags for every program of the run, and for the plan's compiles of them: a
    # field of XLA's DebugOptions (--xla_... of XLA_FLAGS without the dashes) → its value
    # (true/false, a number or a string), e.g. xla_gpu_enable_latency_hiding_scheduler: true.
    # Given to each compile as jax's compiler_options, which win over the same flag in the
    # environment's XLA_FLAGS. A name the installed jaxlib has no field of, or a value of the wrong
    # kind, is a config error. GPU flags are accepted on CPU (its compiler ignores them).
    flags: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Compiles for a GPU (a GPU run, or the planner's XLA:GPU target) start from NVIDIA
    # JAX-Toolbox's recommended flags (meshpar.backend.xla_flags.GPU_DEFAULTS, listed with their
    # sources in docs/running.md), xla.flags overriding them flag by flag; false = XLA's own
    # defaults. No effect on other platforms.
    gpu_defaults: bool = True


@dataclasses.dataclass(frozen=True)
class Config:
    # Device mesh: "data:4,model:2", or Mesh TensorFlow's "data:4;model:2" (pairs separated by
    # ';', ',', '.' or spaces), or a mapping; one axis may be -1 (= the remaining devices).
    mesh: tuple[tuple[str, int], ...] = (("data", -1),)
    # Logical dim → mesh axis: "batch:data; hidden:model" (separators as for the mesh), or a
    # mapping. Unnamed dims replicate. A rule whose dim no tensor of the model has, or whose mesh
    # axis the mesh lacks, is left out and said once on stderr at start, as Mesh TensorFlow
    # ignores it (its default rules name ensemble and experts).
    layout: tuple[tuple[str, str], ...] = (("batch", "data"),)
    # Rules for parameters and optimizer state only, on top of `layout` (a dim named here
    # follows this rule, any other follows `layout`), e.g. "embed:data" splits them over the
    # data axis too (FSDP / ZeRO-3); each layer's weights are gathered where they are used.
    # A dim may take several axes: "embed:(replica,data)". Rules that cannot apply are left out
    # as for `layout`, but a param_layout that splits no parameter at all is an error.
    param_layout: tuple[tuple[str, str], ...] = ()
    model: Any = None  # the family's config, by model.name: built-in, or an import path package.module:ATTRIBUTE
    data: DataConfig = DataConfig()  # where examples come from
    feed: FeedConfig = FeedConfig()  # how batches reach the devices: direct or routed, prefetch
    optimizer: OptimizerConfig = OptimizerConfig()  # optimizer, learning-rate schedule, clipping
    train: TrainConfig = TrainConfig()  # steps, batch, seed, logging, eval, microbatches, profiling
    checkpoint: CheckpointConfig = CheckpointConfig()  # saving, rotation and resuming
    distributed: DistributedConfig = DistributedConfig()  # joining the processes of a multi-process run
    hardware: HardwareConfig = HardwareConfig()  # peak TFLOP/s (for MFU) and memory per device
    plan: PlanConfig = PlanConfig()  # the memory pre-flight before a run allocates anything
    offload: OffloadConfig = OffloadConfig()  # host offload of optimizer state, parameters, activations
    pipeline: PipelineConfig = PipelineConfig()  # the schedule of a stage axis (layers:<axis> in the layout)
    compile_cache: CompileCacheConfig = CompileCacheConfig()  # JAX's persistent compilation cache
    xla: XlaConfig = XlaConfig()  # XLA compiler flags for the run's programs (and the plan's compiles)
    # Output folder: metrics.jsonl, summary.json, tb/.
    workdir: str = "runs/default"

    @property
    def mesh_str(self) -> str:
        return ",".join(f"{a}:{n}" for a, n in self.mesh)

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.dir or str(pathlib.Path(self.workdir) / "checkpoints")

    @property
    def layout_str(self) -> str:
        return layout_lib.format_rules(self.layout)
