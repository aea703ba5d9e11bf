"""Proof, on a machine without a GPU, that the engine's Triton kernels compile for real GPUs.

Semantics::

    with record_launches() as log:  run the engine (or the launchers)   # log.launches: Launch records
    results = compile_launches([with_dtype(l, torch.bfloat16) for l in log.launches], (80, 90))
    print(summary_table(results))                                       # shared memory per kernel

A :class:`Launch` is what Triton itself would compile for one launch: each argument's type
string (``"*bf16"``, ``"i32"``, ``"constexpr"``), the constexpr values, the ints Triton
specializes (an int equal to 1 becomes a constexpr; pointers and ints divisible by 16 get the
``tt.divisibility`` hint), ``num_warps`` and ``num_stages``. Recording wraps the ``run`` method
that ``kernel[grid](...)`` calls on each of the seven ``@triton.jit`` objects, so it sees the
launches of the real launchers, compiled (``JITFunction``) or interpreted (``InterpretedFunction``
under ``TRITON_INTERPRET=1``) alike; with ``execute=False`` the kernel is not run at all, so the
launchers can be driven with ``meta`` tensors of a real model's sizes (:func:`engine_shapes`).

Compiling needs no driver (Triton ships ``ptxas``), but it cannot happen in a process that
imported Triton with ``TRITON_INTERPRET=1``: Triton's standard library (``tl.sum``, ...) was then
built as interpreter functions, which the code generator cannot call. :func:`compile_launches`
therefore compiles in the process when it can and otherwise in child processes started without
``TRITON_INTERPRET`` (this file run as a script, jobs as JSON on stdin), which import each kernel
from its module by name. A test tool, so it lives with the tests' helpers, not in the kernels
package the engine ships.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

ConstValue = int | float | str | bool | None

# (module, name) of every kernel the engine launches, through kernels/ops.py and dispatch.py.
ENGINE_KERNELS: tuple[tuple[str, str], ...] = (
    ("loraplane.kernels.sgmv", "_sgmv_shrink_kernel"),
    ("loraplane.kernels.sgmv", "_sgmv_expand_kernel"),
    ("loraplane.kernels.bgmv", "_bgmv_shrink_kernel"),
    ("loraplane.kernels.bgmv", "_bgmv_expand_kernel"),
    ("loraplane.kernels.paged_bgmv", "_paged_shrink_kernel"),
    ("loraplane.kernels.paged_bgmv", "_paged_expand_kernel"),
    ("loraplane.kernels.paged_attention", "_paged_attention_kernel"),
    ("loraplane.kernels.rms_norm", "_rms_norm_kernel"),
    ("loraplane.kernels.rotary", "_rotary_kernel"),
    ("loraplane.kernels.activation", "_silu_and_mul_kernel"),
    ("loraplane.kernels.kv_write", "_kv_write_kernel"),
    ("loraplane.kernels.seeded_noise", "_seeded_noise_kernel"),
    ("loraplane.kernels.top_k_top_p", "_top_k_top_p_kernel"),
    ("loraplane.kernels.race", "_race_kernel"),
)
CAPABILITIES = (80, 90)  # A100, H100/H200

_TYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
    torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8", torch.bool: "u1",
    torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5",
}  # fmt: skip
_OPTIONS = ("num_warps", "num_stages")

# The pointers that carry the model dtype on a GPU, per kernel; every other pointer keeps its type.
# Static slots and activations take the model dtype there (builder.py: slot_dtype = dtype on CUDA),
# while the shrink buffers (out_ptr/buf_ptr) and the scalings stay float32. Under unified paging
# the adapter product runs in the pool's float32 (LoraLinear converts x and accumulates y in the
# slots' dtype), so the paged kernels see float32 whatever the model dtype. Attention's q, out and
# KV cache (its own tensors, or model-dtype views of the page pool) are the model dtype.
MODEL_DTYPE_POINTERS: dict[str, tuple[str, ...]] = {
    "_sgmv_shrink_kernel": ("x_ptr", "a_ptr"),
    "_sgmv_expand_kernel": ("b_ptr", "y_ptr"),
    "_bgmv_shrink_kernel": ("x_ptr", "a_ptr"),
    "_bgmv_expand_kernel": ("b_ptr", "y_ptr"),
    "_paged_shrink_kernel": (),
    "_paged_expand_kernel": (),
    "_paged_attention_kernel": ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr"),
    "_rms_norm_kernel": ("x_ptr", "residual_ptr", "weight_ptr", "out_ptr"),
    "_rotary_kernel": ("q_ptr", "k_ptr"),  # cos and sin stay float32 tables
    "_silu_and_mul_kernel": ("gate_up_ptr", "out_ptr"),
    "_kv_write_kernel": ("k_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr"),
    "_seeded_noise_kernel": (),  # the sampler works in float32 whatever the model's dtype
    "_top_k_top_p_kernel": (),
    "_race_kernel": (),
}


@dataclass(frozen=True, eq=False)
class Launch:
    """One specialization of a kernel, as ``triton.compile`` takes it. Equal when they compile alike
    and stand for the same model dtype (``dtype``, the label :func:`with_dtype` sets)."""

    kernel: Any  # the @triton.jit object: JITFunction, or InterpretedFunction under TRITON_INTERPRET=1
    signature: dict[str, str]
    constexprs: dict[str, ConstValue]
    num_warps: int | None = None  # None: the launcher left it to Triton's default
    num_stages: int | None = None
    aligned: frozenset[str] = frozenset()  # arguments Triton specializes as divisible by 16
    dtype: str = "fp32"

    @property
    def name(self) -> str:
        return str(self.kernel.fn.__name__)

    @property
    def declared_constexprs(self) -> dict[str, ConstValue]:
        """The kernel's own ``tl.constexpr`` parameters (not the ints Triton specialized to 1)."""
        declared = _constexpr_params(self.kernel)
        return {k: v for k, v in self.constexprs.items() if k in declared}

    def compile_key(self) -> tuple[object, ...]:
        fn = self.kernel.fn
        return (
            fn.__module__, fn.__qualname__, tuple(self.signature.items()), tuple(sorted(self.constexprs.items(), key=str)),
            tuple(sorted(self.aligned)), self.num_warps, self.num_stages,
        )  # fmt: skip

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Launch) and (self.compile_key(), self.dtype) == (other.compile_key(), other.dtype)

    def __hash__(self) -> int:
        return hash((self.compile_key(), self.dtype))


@dataclass
class LaunchLog:
    """What :func:`record_launches` saw: distinct launches in order, and how often each kernel ran."""

    launches: list[Launch] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)
    _seen: set[Launch] = field(default_factory=set, repr=False)

    def add(self, launch: Launch) -> None:
        self.counts[launch.name] += 1
        if launch not in self._seen:
            self._seen.add(launch)
            self.launches.append(launch)

    @property
    def names(self) -> set[str]:
        return set(self.counts)


@dataclass(frozen=True)
class CompileResult:
    kernel: str
    capability: int
    dtype: str
    constexprs: dict[str, ConstValue]
    num_warps: int = 0
    num_stages: int = 0
    shared: int = 0  # bytes of shared memory (compiled.metadata.shared)
    cubin: bool = False  # ptxas produced a cubin
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.cubin


def engine_kernels() -> list[Any]:
    """The seven ``@triton.jit`` objects, as the launchers see them."""
    return [getattr(importlib.import_module(module), name) for module, name in ENGINE_KERNELS]


def _constexpr_params(kernel: Any) -> set[str]:
    # Our kernel modules use `from __future__ import annotations`: the annotation is the string "tl.constexpr".
    out = set()
    for p in inspect.signature(kernel.fn).parameters.values():
        ann = p.annotation
        if ann is tl.constexpr or (isinstance(ann, str) and "constexpr" in ann):
            out.add(p.name)
    return out


def _unspecialized(kernel: Any, option: str) -> set[str]:
    """``do_not_specialize``-style options, as names (JITFunction keeps them, InterpretedFunction in kwargs)."""
    values = getattr(kernel, option, None) or getattr(kernel, "kwargs", {}).get(option) or ()
    names = list(inspect.signature(kernel.fn).parameters)
    return {names[v] if isinstance(v, int) else str(v) for v in values}


def _aligned(t: torch.Tensor) -> bool:
    try:
        return int(t.data_ptr()) % 16 == 0  # meta tensors report storage_offset * itemsize from 0
    except RuntimeError:  # fake tensors have no storage: model the allocator's aligned base
        return (t.storage_offset() * t.element_size()) % 16 == 0


def _argument(value: object, specialize: bool, align: bool) -> tuple[str, ConstValue, bool]:
    """(type string, constexpr value when the type is "constexpr", divisible-by-16 hint): Triton's rules."""
    if isinstance(value, torch.Tensor):
        if value.dtype not in _TYPE_NAMES:
            raise TypeError(f"no Triton type for a {value.dtype} tensor")
        return "*" + _TYPE_NAMES[value.dtype], None, align and _aligned(value)
    if value is None:
        return "constexpr", None, False
    if isinstance(value, bool):
        return "u1", None, False
    if isinstance(value, int):
        if specialize and value == 1:
            return "constexpr", 1, False
        ty = "i32" if -(2**31) <= value < 2**31 else "u64" if value >= 2**63 else "i64"
        return ty, None, specialize and align and value % 16 == 0
    if isinstance(value, float):
        return "fp32", None, False
    raise TypeError(f"cannot type a kernel argument of type {type(value).__name__}")


def describe_launch(kernel: Any, args: tuple[object, ...], kwargs: dict[str, object]) -> Launch:
    """The :class:`Launch` for ``kernel[grid](*args, **kwargs)``."""
    sig = inspect.signature(kernel.fn)
    options = {k: v for k, v in kwargs.items() if k not in sig.parameters}
    unknown = set(options) - set(_OPTIONS)
    if unknown:
        raise ValueError(f"{kernel.fn.__name__}: launch options {sorted(unknown)} are not modelled here")
    bound = sig.bind(*args, **{k: v for k, v in kwargs.items() if k in sig.parameters})
    bound.apply_defaults()
    declared = _constexpr_params(kernel)
    no_spec, no_align = _unspecialized(kernel, "do_not_specialize"), _unspecialized(kernel, "do_not_specialize_on_alignment")
    signature: dict[str, str] = {}
    constexprs: dict[str, ConstValue] = {}
    aligned = set()
    for name, value in bound.arguments.items():
        if name in declared:
            signature[name] = "constexpr"
            constexprs[name] = getattr(value, "value", value)  # tl.constexpr(...) or a plain value
            continue
        ty, const, hint = _argument(value, name not in no_spec, name not in no_spec | no_align)
        signature[name] = ty
        if ty == "constexpr":
            constexprs[name] = const
        if hint:
            aligned.add(name)
    pointers = [signature[p] for p in MODEL_DTYPE_POINTERS.get(kernel.fn.__name__, ())]
    return Launch(
        kernel, signature, constexprs, options.get("num_warps"), options.get("num_stages"),  # type: ignore[arg-type]
        frozenset(aligned), pointers[0][1:] if pointers else "fp32",
    )  # fmt: skip


def _wrap(kernel: Any, previous: Any, log: LaunchLog, execute: bool) -> Any:
    def run(*args: object, grid: object, warmup: bool = False, **kwargs: object) -> object:
        if not warmup:
            log.add(describe_launch(kernel, args, kwargs))
        if execute or warmup:
            return previous(*args, grid=grid, warmup=warmup, **kwargs)
        return None

    return run


@contextmanager
def record_launches(*, execute: bool = True) -> Iterator[LaunchLog]:
    """Record every launch of the engine's kernels inside the block; ``execute=False`` skips running them.

    ``kernel[grid](...)`` calls ``kernel.run``; an instance attribute shadows the class's method
    on both ``JITFunction`` and ``InterpretedFunction``, and is removed again on exit.
    """
    log = LaunchLog()
    patched: list[tuple[Any, object]] = []
    try:
        for kernel in engine_kernels():
            own = vars(kernel).get("run")  # set when record_launches blocks nest
            kernel.run = _wrap(kernel, kernel.run, log, execute)
            patched.append((kernel, own))
        yield log
    finally:
        for kernel, own in reversed(patched):
            if own is None:
                del kernel.run
            else:
                kernel.run = own


def _retuned_attention(constexprs: dict[str, ConstValue], dtype: torch.dtype) -> dict[str, ConstValue]:
    """Attention's constexprs for another dtype, from the launcher's own ``launch_config``
    (``DOT_PRECISION`` depends on the dtype); the other sizes must come out as recorded."""
    from loraplane.kernels.paged_attention import launch_config

    group, block_q = constexprs["GROUP"], constexprs["BLOCK_Q"]
    head_dim, block_size = constexprs["HEAD_DIM"], constexprs["BLOCK_SIZE"]
    assert isinstance(group, int) and isinstance(block_q, int) and isinstance(head_dim, int) and isinstance(block_size, int)
    cfg = launch_config(
        num_seqs=1, num_heads=group, kv_heads=1, head_dim=head_dim, block_size=block_size, dtype=dtype, max_query_len=block_q,
        num_tiles=1 if constexprs.get("TILED") else None,
    )  # fmt: skip
    new = dict(constexprs)
    new.update(cfg.constexprs)
    if {k: v for k, v in new.items() if k != "DOT_PRECISION"} != {k: v for k, v in constexprs.items() if k != "DOT_PRECISION"}:
        raise ValueError(f"launch_config no longer reproduces the recorded tile {constexprs}: got {cfg.constexprs}")
    return new


def with_dtype(launch: Launch, dtype: torch.dtype) -> Launch:
    """The same launch with the model in ``dtype``: the pointers in :data:`MODEL_DTYPE_POINTERS`
    retyped (each must hold the launch's current dtype), and dtype-dependent constexprs redone."""
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"the engine runs in float32, float16 or bfloat16, not {dtype}")
    if launch.name not in MODEL_DTYPE_POINTERS:
        raise KeyError(f"no retyping rule for {launch.name}: add it to MODEL_DTYPE_POINTERS")
    new_type = _TYPE_NAMES[dtype]
    signature = dict(launch.signature)
    for arg in MODEL_DTYPE_POINTERS[launch.name]:
        if signature[arg] != f"*{launch.dtype}":
            raise ValueError(f"{launch.name}.{arg} is {signature[arg]}, expected *{launch.dtype} in a {launch.dtype} launch")
        signature[arg] = f"*{new_type}"
    constexprs = launch.constexprs
    if launch.name == "_paged_attention_kernel":
        constexprs = _retuned_attention(constexprs, dtype)
    elif "DOT_PRECISION" in constexprs:  # SGMV's: the launchers' one rule
        from loraplane.kernels.precision import dot_precision

        constexprs = {**constexprs, "DOT_PRECISION": dot_precision(dtype)}
    return replace(launch, signature=signature, constexprs=constexprs, dtype=new_type)


def _job(launch: Launch, capability: int) -> dict[str, Any]:
    fn = launch.kernel.fn
    return {
        "module": fn.__module__, "name": fn.__qualname__, "signature": launch.signature, "constexprs": launch.constexprs,
        "aligned": sorted(launch.aligned), "num_warps": launch.num_warps, "num_stages": launch.num_stages,
        "capability": capability,
    }  # fmt: skip


def _compile_job(job: dict[str, Any], kernel: Any = None) -> dict[str, Any]:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if kernel is None:
        kernel = getattr(importlib.import_module(job["module"]), job["name"])
    if not isinstance(kernel, JITFunction):
        return {"error": f"{job['name']} is a {type(kernel).__name__}, not a JITFunction (TRITON_INTERPRET set?)"}
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in job["aligned"]}
    src = ASTSource(fn=kernel, signature=job["signature"], constexprs=job["constexprs"], attrs=attrs)
    options = {k: job[k] for k in _OPTIONS if job[k] is not None}
    try:
        compiled = triton.compile(src, target=GPUTarget("cuda", job["capability"], 32), options=options)
    except Exception as e:  # a compile error is a result, reported with the others
        return {"error": f"{type(e).__name__}: {e}"}
    meta = compiled.metadata
    return {
        "num_warps": meta.num_warps, "num_stages": meta.num_stages, "shared": meta.shared,
        "cubin": bool(compiled.asm.get("cubin")),
    }  # fmt: skip


def _compiles_here() -> bool:
    """False once Triton's standard library was built for the interpreter (TRITON_INTERPRET=1 at import)."""
    return isinstance(tl.sum, JITFunction)


def _compile_in_children(jobs: list[dict[str, Any]], workers: int) -> list[dict[str, Any]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    chunks = [jobs[i::workers] for i in range(workers)]
    # -P: no working directory on sys.path, where the project's operator/ would shadow the stdlib's.
    command = [sys.executable, "-P", __file__]  # -P: nothing of the working folder shadows an import
    pipe = subprocess.PIPE
    procs = [subprocess.Popen(command, stdin=pipe, stdout=pipe, stderr=pipe, env=env, text=True) for _ in chunks]
    outs: list[list[dict[str, Any]]] = []
    for proc, chunk in zip(procs, chunks, strict=True):
        stdout, stderr = proc.communicate(json.dumps(chunk))
        if proc.returncode != 0:
            raise RuntimeError(f"the compile process failed ({proc.returncode}):\n{stderr[-4000:]}")
        outs.append(json.loads(stdout))
    results: list[dict[str, Any]] = [{}] * len(jobs)
    for w, out in enumerate(outs):
        for i, res in enumerate(out):
            results[w + i * workers] = res
    return results


def compile_launches(
    launches: Iterable[Launch], capabilities: Iterable[int] = CAPABILITIES, *, workers: int | None = None
) -> list[CompileResult]:
    """Compile each launch for each capability (launch-major); identical compiles run once."""
    pairs = [(launch, cap) for launch in launches for cap in capabilities]
    unique: dict[tuple[object, ...], int] = {}
    jobs: list[dict[str, Any]] = []
    kernels: list[Any] = []
    for launch, cap in pairs:
        key = (*launch.compile_key(), cap)
        if key not in unique:
            unique[key] = len(jobs)
            jobs.append(_job(launch, cap))
            kernels.append(launch.kernel)
    if _compiles_here():
        raw = [_compile_job(job, kernel) for job, kernel in zip(jobs, kernels, strict=True)]
    elif jobs:
        raw = _compile_in_children(jobs, max(1, min(workers or os.cpu_count() or 1, len(jobs), 8)))
    else:
        raw = []
    return [
        CompileResult(launch.name, cap, launch.dtype, launch.declared_constexprs, **raw[unique[(*launch.compile_key(), cap)]])
        for launch, cap in pairs
    ]


def compile_launch(launch: Launch, capability: int) -> CompileResult:
    return compile_launches([launch], [capability])[0]


@dataclass(frozen=True)
class ModelShape:
    """A model and serving configuration to record launches for; defaults: Llama 3 8B."""

    hidden: int = 4096
    num_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 14336
    num_layers: int = 32
    block_size: int = 16
    max_rank: int = 64
    max_loras: int = 16
    decode_batch: int = 256
    vocab: int = 128256
    # 8: the short last piece of a chunked prompt beside decodes (attention's 32-row tile).
    prefill_chunks: tuple[int, ...] = (8, 512, 2048)


LLAMA_8B = ModelShape()


def engine_shapes(shape: ModelShape = LLAMA_8B, dtype: torch.dtype = torch.bfloat16) -> list[Launch]:
    """The launches an engine step makes at ``shape``, recorded from the real launchers on ``meta``
    tensors (nothing allocated, nothing run): static slots by BGMV (decode) and SGMV (prefill),
    unified paging by the paged kernels, attention over a dense and a page-pool KV cache."""
    from loraplane.kernels import (
        activation,
        bgmv,
        kv_write,
        paged_attention,
        paged_bgmv,
        race,
        rms_norm,
        rotary,
        seeded_noise,
        sgmv,
        top_k_top_p,
    )

    s = shape

    def t(*size: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.empty(size, dtype=dt, device="meta")

    q_size, kv_size = s.num_heads * s.head_dim, s.kv_heads * s.head_dim
    # (in_features, fused output slices) of qkv, o, gate_up and down, as serving/model/llama.py fuses them
    projections = [(s.hidden, [q_size, kv_size, kv_size]), (q_size, [s.hidden])]
    projections += [(s.hidden, [s.intermediate] * 2), (s.intermediate, [s.hidden])]
    i32, f32 = torch.int32, torch.float32
    ranks, scalings = t(s.max_loras, dt=i32), t(s.max_loras, dt=f32)
    num_blocks = 1024
    pool = t(num_blocks * 2 * s.num_layers * s.block_size * kv_size * 2 // 4, dt=f32)  # bf16/fp16 KV pages as floats
    offsets = t(s.max_loras, s.max_rank, dt=torch.int64)
    caches = [
        t(num_blocks, s.block_size, s.kv_heads, s.head_dim),  # static: the layer's own tensor
        t(num_blocks, 2, s.num_layers, s.block_size, s.kv_heads, s.head_dim)[:, 0].transpose(0, 1)[0],  # unified: a pool view
    ]
    steps = [(s.decode_batch, s.decode_batch, 1)] + [(s.decode_batch - 1 + n, s.decode_batch, n) for n in s.prefill_chunks]
    with record_launches(execute=False) as log:
        for tokens, num_seqs, max_query_len in steps:
            row_slots = t(tokens, dt=i32)
            seg_starts, seg_slots = t(num_seqs + 1, dt=i32), t(num_seqs, dt=i32)
            for k, slices in projections:
                x, out = t(tokens, k), t(tokens, s.max_rank, dt=f32)
                y = t(tokens, sum(slices))
                sgmv.sgmv_shrink(x, t(s.max_loras, s.max_rank, k), ranks, seg_starts, seg_slots, out, max_query_len)
                bgmv.bgmv_shrink(x, t(s.max_loras, s.max_rank, k), ranks, row_slots, out)
                for i, n in enumerate(slices):
                    lora_b, offset = t(s.max_loras, s.max_rank, n), sum(slices[:i])
                    sgmv.sgmv_expand(y, out, lora_b, ranks, scalings, seg_starts, seg_slots, offset, max_query_len)
                    bgmv.bgmv_expand(y, out, lora_b, ranks, scalings, row_slots, offset)
                    xf, yf = t(tokens, k, dt=f32), t(tokens, sum(slices), dt=f32)
                    paged_bgmv.paged_add_lora(yf, xf, pool, offsets, offsets, ranks, scalings, row_slots, offset, n)
            x, hidden = t(tokens, s.hidden), t(tokens, s.hidden)
            rms_norm.rms_norm(x, t(s.hidden), 1e-5, hidden)
            rms_norm.rms_norm(x, t(s.hidden), 1e-5, hidden, residual=t(tokens, s.hidden))
            qkv = t(tokens, q_size + 2 * kv_size)
            q_view = qkv[:, :q_size].view(tokens, s.num_heads, s.head_dim)
            k_view = qkv[:, q_size : q_size + kv_size].view(tokens, s.kv_heads, s.head_dim)
            v_view = qkv[:, q_size + kv_size :].view(tokens, s.kv_heads, s.head_dim)
            rotary.rotary(q_view, k_view, t(tokens, dt=i32), t(8192, s.head_dim, dt=f32), t(8192, s.head_dim, dt=f32))
            activation.silu_and_mul(t(tokens, 2 * s.intermediate), t(tokens, s.intermediate))
            q = t(tokens, s.num_heads, s.head_dim)
            tables, starts, lens = t(num_seqs, 128, dt=i32), t(num_seqs + 1, dt=i32), t(num_seqs, dt=i32)
            for cache in caches:
                kv_write.kv_write(k_view, v_view, cache, cache, t(tokens, dt=i32), t(tokens, dt=i32))
                out = torch.empty_like(q)
                paged_attention.paged_attention(
                    q, cache, cache, tables, starts, lens, out, scale=s.head_dim**-0.5, max_query_len=max_query_len
                )
        seeded = s.decode_batch // 2  # the sampler's noise for a decode batch half of whose rows have a seed
        seeded_noise.seeded_noise(t(s.decode_batch, s.vocab, dt=f32), *(t(seeded, dt=i32) for _ in range(4)))
        n = s.decode_batch
        logits, per_row = t(n, s.vocab, dt=f32), t(n, dt=f32)
        top_k_top_p.threshold(logits, per_row, t(n, dt=i32), per_row, per_row)
        token = t(n, dt=torch.int64)
        race.race(logits, per_row, per_row, per_row, t(n, s.vocab, dt=f32), token)  # sampled rows, cut
        race.race(logits, per_row, None, per_row, t(n, s.vocab, dt=f32), token)  # sampled rows, no cut
        race.race(logits, per_row, None, per_row, None, token)  # greedy rows alone
    return [replace(launch, dtype=_TYPE_NAMES[dtype]) for launch in log.launches]


def summary_table(results: Iterable[CompileResult]) -> str:
    """One row per kernel and tile (its declared constexprs), one column per capability and dtype:
    the most shared memory any of the row's specializations takes, or FAIL."""
    results = list(results)
    columns = sorted({(r.capability, r.dtype) for r in results})
    rows: dict[tuple[str, str], dict[tuple[int, str], list[CompileResult]]] = {}
    for r in results:
        tile = " ".join(f"{k}={v}" for k, v in r.constexprs.items())
        rows.setdefault((r.kernel, tile), {}).setdefault((r.capability, r.dtype), []).append(r)
    header = ["kernel", "tile (constexprs)", "warps", "stages", "specs"] + [f"sm{c} {d}" for c, d in columns]
    lines = [header]
    for (kernel, tile), cells in rows.items():
        every = [r for rs in cells.values() for r in rs if r.ok]
        warps = "/".join(str(w) for w in sorted({r.num_warps for r in every})) or "?"
        stages = "/".join(str(n) for n in sorted({r.num_stages for r in every})) or "?"
        specs = str(max(len(rs) for rs in cells.values()))  # launches that differ only in specialized ints
        values = []
        for col in columns:
            rs = cells.get(col, [])
            values.append("-" if not rs else "FAIL" if not all(r.ok for r in rs) else f"{max(r.shared for r in rs)} B")
        lines.append([kernel, tile, warps, stages, specs, *values])
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() for line in lines)


def _child_main() -> None:
    jobs = json.load(sys.stdin)
    json.dump([_compile_job(job) for job in jobs], sys.stdout)


if __name__ == "__main__":
    _child_main()
