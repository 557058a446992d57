"""Write the GPU-compiled HLO texts that tests/test_gpu_timing.py reads (tests/fixtures/gpu_hlo/).

    python scripts/make_gpu_hlo_fixtures.py [--out tests/fixtures/gpu_hlo]

Needs XLA's GPU compiler (``pip install -e '.[gpu-plan]'``) but no GPU: the programs are compiled
deviceless for the compile-only devices of the ``h100-sxm-8`` topology
(:func:`meshpar.plan.gpu_target.devices`), so the texts are the programs XLA makes for that GPU.
The ``library`` program also needs cuDNN's library on this host (``pip install
nvidia-cudnn-cu12``, or its ``lib`` folder on ``LD_LIBRARY_PATH``): jax checks its version
before it emits cuDNN's fused attention. Each program with a GEMM is compiled under both GEMM lowerings, in
a child process each (XLA reads its flags once): the default, where XLA emits Triton GEMM
fusions (files ``*.triton.*``), and ``--xla_gpu_enable_triton_gemm=false``, where every GEMM is a
cuBLAS custom-call (``*.cublas.*``).

Programs:

- ``lm_rolled`` / ``lm_unrolled``: a 4-layer Transformer train step (quickstart's layout,
  data:4,model:2 on 8 devices) with the layer loop rolled (``model.scan_unroll=1``, one layer per
  trip of a ``while`` over stacked weights) and unrolled (``model.scan_unroll=4``: no loop);
  ``lm8_rolled``: the same with 8 layers, rolled. Its weights outweigh its activations, so a loop
  billed the whole weight stack per trip would show.
- ``collectives``: a shard_map program on 4 devices with one of each async collective
  (all-to-all, collective-permute, reduce-scatter, all-gather) and a GEMM, kept as
  ``compiled.as_text()`` prints it (metadata and the FileNames…StackFrames header included).
- ``library``: cuDNN calls on one device: a 3×3 convolution's forward and both backward
  passes, and fused attention forward and backward, causal and not (no GEMM: compiled once).

The LM texts have their ``metadata={...}`` attributes and header blocks stripped and are
gzipped (``.hlo.gz``: ~50 KB each instead of ~450 KB); the others are plain ``.hlo``. Each
program's parameters go in ``manifest.json``, for the tests' expected figures.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshpar.configuration import config
from meshpar.plan import gpu_target, topology
from meshpar.step import parts

TOPOLOGY = "h100-sxm-8"
# The model the LM programs train: weights (d_model 128, d_ff 512) outweigh the activations
# (8 sequences of 16 tokens over 4 data shards).
LM = (
    "experiments/quickstart.yaml",
    "model.d_model=128", "model.n_heads=4", "model.d_head=32", "model.d_ff=512", "model.max_length=16",
    "data.length=16", "data.max_bytes=200000", "train.batch_size=8", "train.progress=false",
)  # fmt: skip
LOWERINGS = {"triton": "", "cublas": "--xla_gpu_enable_triton_gemm=false"}
# The library program's shapes.
CONV = {"x": (8, 32, 32, 16), "w": (3, 3, 16, 32)}  # NHWC input, HWIO kernel, SAME padding
ATTENTION = (2, 128, 4, 64)  # q, k, v [batch, length, heads, head dim]


ROOT = pathlib.Path(__file__).resolve().parent.parent


def strip(text: str) -> str:
    """The HLO text without metadata attributes and the source-location header blocks."""
    text = re.sub(r",? metadata=\{[^}]*\}", "", text)
    return re.sub(r"\nFileNames\n.*?\nStackFrames\n(?:\d+ \{[^\n]*\}\n)*", "\n", text, flags=re.DOTALL)


def scrub(text: str) -> str:
    """Source paths made relative (to this repository, or to the installed package's folder)."""
    text = text.replace(f"{ROOT}/", "")
    return re.sub(r'"[^"\n]*/site-packages/', '"', text)


def devices(n: int) -> list:
    """The first `n` compile-only devices of the topology."""
    return list(gpu_target.devices(topology.load(TOPOLOGY))[:n])


def lm_step(layers: int, unroll: int) -> tuple[str, dict]:
    overrides = [*LM[1:], f"model.n_layers={layers}", f"model.scan_unroll={unroll}"]
    cfg = config.load(LM[0], overrides)
    step = parts.abstract_step(cfg, devices=devices(8))
    text = strip(step.lower().compile().as_text())
    return text, {"config": LM[0], "overrides": overrides, "mesh": dict(step.mesh.shape)}


def collectives() -> tuple[str, dict]:
    mesh = Mesh(devices(4), ("x",))

    def body(a, w):  # a: [64, 64] per device, w: [16, 64]
        b = jax.lax.all_to_all(a, "x", 1, 0, tiled=True)  # [256, 16]
        c = jax.lax.ppermute(b, "x", [(i, (i + 1) % 4) for i in range(4)])
        d = jax.lax.psum_scatter(c @ w, "x", scatter_dimension=0, tiled=True)  # [256, 64] → [64, 64]
        return jax.lax.all_gather(d, "x", axis=0, tiled=True)  # [256, 64]

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x")))
    a = jax.ShapeDtypeStruct((256, 64), jnp.float32, sharding=NamedSharding(mesh, P("x")))
    w = jax.ShapeDtypeStruct((16, 64), jnp.float32, sharding=NamedSharding(mesh, P()))
    return step.lower(a, w).compile().as_text(), {"mesh": {"x": 4}}


def library() -> tuple[str, dict]:
    mesh = Mesh(devices(1), ("x",))
    whole = NamedSharding(mesh, P())

    def loss(x, w, q, k, v):
        y = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        causal = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        full = jax.nn.dot_product_attention(q, k, v, is_causal=False, implementation="cudnn")
        return sum(jnp.sum(t.astype(jnp.float32) ** 2) for t in (y, causal, full))

    shapes = [CONV["x"], CONV["w"], ATTENTION, ATTENTION, ATTENTION]
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=whole) for s in shapes]
    text = jax.jit(jax.grad(loss, argnums=tuple(range(5)))).lower(*args).compile().as_text()
    return strip(text), {"conv": CONV, "attention": ATTENTION}


# name → (how to make it, the lowerings it is compiled under: the library program has no GEMM).
PROGRAMS = {
    "lm_rolled": (lambda: lm_step(4, 1), tuple(LOWERINGS)),
    "lm_unrolled": (lambda: lm_step(4, 4), tuple(LOWERINGS)),
    "lm8_rolled": (lambda: lm_step(8, 1), tuple(LOWERINGS)),
    "collectives": (collectives, tuple(LOWERINGS)),
    "library": (library, ("triton",)),
}


def path(out: pathlib.Path, name: str, lowering: str) -> pathlib.Path:
    """lm_rolled.cublas.hlo.gz, collectives.triton.hlo, library.hlo."""
    middle = f".{lowering}" if len(PROGRAMS[name][1]) > 1 else ""
    return out / f"{name}{middle}.hlo{'.gz' if name.startswith('lm') else ''}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="tests/fixtures/gpu_hlo")
    parser.add_argument("--child", nargs=2, metavar=("PROGRAM", "LOWERING"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    out = pathlib.Path(args.out)
    if args.child:  # one program under one lowering, with this process's XLA flags
        name, lowering = args.child
        text, params = PROGRAMS[name][0]()
        text = scrub(text)
        target = path(out, name, lowering)
        if target.suffix == ".gz":
            target.write_bytes(gzip.compress(text.encode(), mtime=0))
        else:
            target.write_text(text)
        print(json.dumps(params))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    manifest = {"topology": TOPOLOGY}
    for name, (_, lowerings) in PROGRAMS.items():
        for lowering in lowerings:
            flags = LOWERINGS[lowering]
            xla_flags = " ".join(filter(None, [os.environ.get("XLA_FLAGS", ""), flags]))
            env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags}
            cmd = [sys.executable, __file__, "--out", str(out), "--child", name, lowering]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            if done.returncode:
                print(f"{name} ({lowering}) failed:\n{done.stderr[-3000:]}", file=sys.stderr)
                return done.returncode
            manifest[name] = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"{path(out, name, lowering).name}: {path(out, name, lowering).stat().st_size / 1024:.0f} KiB")
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
