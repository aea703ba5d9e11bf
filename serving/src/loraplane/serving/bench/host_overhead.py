"""The engine's CUDA code path with the device's work taken out: what the host does per step,
timed, and what it asks of the device, counted (kernel launches, graph replays, copies each way).

Why a recording backend rather than fake or meta tensors: both compute every output's shape in
Python (torch's meta functions, ``FakeTensorMode``'s dispatch), some 100 to 400 us an op here,
which would bury the host work being measured under the stand-in's own. Here every device tensor
is a :class:`DeviceFree` tensor, a wrapper with a device (``cuda``), a shape and no storage, and
:class:`Recorder` (a ``TorchDispatchMode``) answers each operation on them: the first time an
operation is seen with given argument shapes it runs on ``meta`` tensors to learn its outputs'
shapes, and every later time it builds those outputs from the cache (about 10 us an op on the
2-core machines here, of the order of what eager PyTorch spends on the host per CUDA kernel).

What it checks and counts, per step:

- **launches**: every operation that would run a kernel on the device (views, reshapes and
  allocations do not), each custom op by the kernels it declares (``kernels.ops.LAUNCHES``);
- **graph replays**: a captured graph (decode, or a step with prompts) replays as one count and
  none of its launches;
- **read-backs**: the engine's declared ones (``transfers.to_host``, answered with zeros);
  anything else that would wait for the device (``.item()``, ``.tolist()``, a copy to the host,
  a data-dependent shape) raises :class:`HostSync`;
- **copies to the device** (host-to-device transfers) and the operations that mix devices, which
  raise :class:`DeviceMismatch`, as they fail on a GPU.

Host time is the step's wall time here: the engine's Python, the dispatch of every operation, and
the recorder's own small cost per operation, printed beside it.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from loraplane.kernels.ops import LAUNCHES

aten = torch.ops.aten

# Operations that run no kernel: metadata, views and allocations.
NO_KERNEL = {
    "view", "_unsafe_view", "reshape", "t", "transpose", "permute", "slice", "select", "expand", "as_strided",
    "unsqueeze", "squeeze", "detach", "alias", "unbind", "split", "split_with_sizes", "chunk", "narrow", "view_as",
    "empty", "empty_strided", "empty_like", "lift_fresh", "_reshape_alias", "unflatten", "flatten", "diagonal",
    "movedim", "_to_copy_noop", "set_", "resize_", "new_empty", "new_empty_strided",
}  # fmt: skip
DEVICE = torch.device("cuda", 0)


class HostSync(RuntimeError):
    """An operation that would make the host wait for the device, outside the declared read-backs."""


class DeviceMismatch(RuntimeError):
    """An operation that mixes device and host tensors, which a GPU refuses."""


class DeviceFree(torch.Tensor):
    """A device tensor without storage: its device, shape, strides and dtype are all there is."""

    @staticmethod
    def __new__(cls, shape: Any, stride: Any, dtype: torch.dtype, device: torch.device = DEVICE) -> DeviceFree:
        t: DeviceFree = torch.Tensor._make_wrapper_subclass(cls, shape, strides=stride, dtype=dtype, device=device)
        return t

    # Only the dispatch level: the Python-level subclass handling would cost more per call than
    # the dispatch itself.
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        raise RuntimeError(f"{func} on a device-free tensor outside the recorder")

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]  # the default reads the data
        return f"DeviceFree({list(self.shape)}, {self.dtype}, {self.device})"


@dataclass
class Tally:
    """What one stretch of host work asked of the device."""

    launches: int = 0
    graph_replays: int = 0
    read_backs: int = 0
    read_back_bytes: int = 0
    copies_in: int = 0
    ops: int = 0
    by_op: Counter[str] = field(default_factory=Counter)

    def __sub__(self, other: Tally) -> Tally:
        return Tally(
            self.launches - other.launches, self.graph_replays - other.graph_replays, self.read_backs - other.read_backs,
            self.read_back_bytes - other.read_back_bytes, self.copies_in - other.copies_in, self.ops - other.ops,
            self.by_op - other.by_op,
        )  # fmt: skip

    def copy(self) -> Tally:
        return Tally(
            self.launches,
            self.graph_replays,
            self.read_backs,
            self.read_back_bytes,
            self.copies_in,
            self.ops,
            Counter(self.by_op),
        )


def _meta(x: Any) -> Any:
    if isinstance(x, DeviceFree):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    return x


def _is_device(x: Any) -> bool:
    return type(x) is DeviceFree


class _Out:
    """An output as the cache keeps it."""

    __slots__ = ("alias", "dtype", "shape", "stride")

    def __init__(self, t: torch.Tensor, alias: int | None) -> None:
        self.shape, self.stride, self.dtype, self.alias = tuple(t.shape), t.stride(), t.dtype, alias


def _written_operand(func: Any) -> int | None:
    """The position of the argument an in-place (or ``out=``) operation returns, from its schema."""
    returns = func._schema.returns
    if len(returns) != 1 or returns[0].alias_info is None or not returns[0].alias_info.is_write:
        return None
    target = returns[0].alias_info.before_set
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.before_set == target and not arg.kwarg_only:
            return i
    return None


_CHECKED_EVERY_TIME = frozenset({"copy_", "_to_copy", "to"})


def _target_device(args: Any, kwargs: dict[str, Any]) -> torch.device:
    """Where ``to``/``_to_copy`` sends its tensor: a ``device`` argument, else where it is."""
    given = kwargs.get("device") or next((a for a in args[1:] if isinstance(a, (torch.device, str))), None)
    return torch.device(given) if given is not None else args[0].device


def _leaves(items: Any) -> Iterator[Any]:
    """Arguments and the members of list arguments (``cat``'s tensors, ``index``'s indices)."""
    for x in items:
        if isinstance(x, (list, tuple)):
            yield from x
        else:
            yield x


def _signature(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return (x.shape, x.stride(), x.dtype, type(x) is DeviceFree)
    if isinstance(x, (list, tuple)):
        return tuple([_signature(y) for y in x])
    return x


def _wants_device(kwargs: dict[str, Any], args: Any = ()) -> bool:
    """A device tensor asked for by a ``device`` argument (a factory, or ``to``)."""
    device = kwargs.get("device") or next((a for a in args if isinstance(a, torch.device)), None)
    return device is not None and torch.device(device).type == "cuda"


class Recorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Answers device operations from a cache of output shapes and counts what they would do."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.cache: dict[Any, Any] = {}
        self.tally = Tally()
        self.capturing = False  # inside a graph capture: launches go to the graph, not the step
        self.captured = 0  # launches recorded into graphs so far
        self.graph_launches: dict[tuple[str, int], int] = {}  # (graph kind, bucket): launches it replays

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        # Hand-rolled rather than pytree: this runs for every operation, and is most of the
        # recorder's cost per operation.
        flat = [*_leaves(args), *_leaves(kwargs.values())]
        on_device = [x for x in flat if type(x) is DeviceFree]
        if not on_device and not _wants_device(kwargs, args):
            with unset_fake_temporarily():
                return func(*args, **kwargs)  # the host's own tensors: real work
        key = (func, _signature(args), _signature(tuple(kwargs.items())) if kwargs else None)
        entry = self.cache.get(key)
        if entry is None:
            name = func._schema.name if func.namespace != "aten" else func._schema.name.split("::")[-1]
            self._check(func, name, args, kwargs, flat, on_device)
            is_view = any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)
            entry = self.cache[key] = (name, self._learn(func, args, kwargs), is_view)
        else:
            name = entry[0]
            if name in _CHECKED_EVERY_TIME:  # copies: which way they go is in the key, but counted per call
                self._check(func, name, args, kwargs, flat, on_device)
        outs = entry[1]
        if not self.capturing:
            t = self.tally
            t.ops += 1
            t.by_op[name] += 1
            t.launches += self._launches(func, name, args, kwargs)
        else:
            self.captured += self._launches(func, name, args, kwargs)
        if type(outs) is _Out and not entry[2]:
            return self._build(outs, args)
        # A view is made outside inference mode: it takes its base's version counter, which an
        # inference tensor refuses (the engine steps under inference_mode; its weights are not).
        with torch.inference_mode(False):
            if type(outs) is _Out:
                return self._build(outs, args)
            if isinstance(outs, (tuple, list)):
                return type(outs)(self._build(o, args) if type(o) is _Out else o for o in outs)
            return outs

    @staticmethod
    def _launches(func: Any, name: str, args: Any, kwargs: dict[str, Any]) -> int:
        """Kernels this operation runs on the device: none for views and allocations, none for a
        copy in (a transfer, counted apart) or a conversion to what the tensor already is."""
        if func.namespace != "aten":
            return LAUNCHES.get(name, 1)
        if name in NO_KERNEL:
            return 0
        if name in ("to", "_to_copy"):
            src = args[0]
            dtype = kwargs.get("dtype", next((a for a in args[1:] if isinstance(a, torch.dtype)), src.dtype))
            return int(_is_device(src) and dtype != src.dtype)
        if name == "copy_":
            return int(_is_device(args[1]))
        if name == "contiguous":
            return int(not args[0].is_contiguous())
        return 1

    def _check(self, func: Any, name: str, args: Any, kwargs: dict[str, Any], flat: list[Any], on_device: list[Any]) -> None:
        """Raises for what a GPU would wait on or refuse; counts copies to the device."""
        if name in ("_local_scalar_dense", "item", "equal", "is_nonzero", "_assert_async"):
            raise HostSync(f"{func} reads a device value on the host")
        if name == "copy_":
            dst, src = args[0], args[1]
            if not _is_device(dst):
                raise HostSync("a device tensor copied into a host one outside transfers.to_host")
            self.tally.copies_in += not _is_device(src) and not self.capturing
            return
        if name in ("to", "_to_copy"):
            src, target = args[0], _target_device(args, kwargs)
            if _is_device(src) and target.type == "cpu":
                raise HostSync("a device tensor moved to the host outside transfers.to_host")
            self.tally.copies_in += not _is_device(src) and not self.capturing
            return
        if _wants_device(kwargs):  # a factory, or *_like with a device: reads no host data
            return
        host = [x for x in flat if isinstance(x, torch.Tensor) and not _is_device(x) and x.dim() > 0]
        if host:  # a host scalar (0-d) is fine, as on a GPU
            shapes = [list(x.shape) for x in host]
            raise DeviceMismatch(f"{func} mixes device tensors with host tensors {shapes}")

    def _learn(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        meta_args, meta_kwargs = tree_map(_meta, args), tree_map(_meta, kwargs)
        if _wants_device(meta_kwargs):
            meta_kwargs = {**meta_kwargs, "device": torch.device("meta")}
        meta_args = tuple(torch.device("meta") if isinstance(a, torch.device) and a.type == "cuda" else a for a in meta_args)
        host_inputs = {id(x): x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor) and not _is_device(x)}
        if host_inputs:  # a copy to the device: its source's shape on meta
            meta_args = tree_map(lambda x: x.to("meta") if isinstance(x, torch.Tensor) and id(x) in host_inputs else x, meta_args)
            meta_kwargs = tree_map(
                lambda x: x.to("meta") if isinstance(x, torch.Tensor) and id(x) in host_inputs else x, meta_kwargs
            )
            if "device" in meta_kwargs:
                meta_kwargs["device"] = torch.device("meta")
        try:
            with unset_fake_temporarily():
                out = func(*meta_args, **meta_kwargs)
        except Exception as err:
            if "data-dependent" in str(err) or "meta" in str(err).lower():
                raise HostSync(f"{func} has an output whose shape depends on device values ({err})") from err
            raise
        written = _written_operand(func)
        if isinstance(out, torch.Tensor):
            return _Out(out, written)
        if isinstance(out, (tuple, list)):
            return type(out)(_Out(o, written) if isinstance(o, torch.Tensor) else o for o in out)
        return out

    def _build(self, o: _Out, args: Any) -> torch.Tensor:
        if o.alias is not None:  # an in-place operation hands back the operand it wrote
            return args[o.alias]  # type: ignore[no-any-return]
        return DeviceFree(o.shape, o.stride, o.dtype)

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """A graph being recorded: its launches are the graph's, run later by one replay."""
        self.capturing, before = True, self.capturing
        try:
            yield
        finally:
            self.capturing = before


@contextlib.contextmanager
def recording() -> Iterator[Recorder]:
    """A recorder over a fake-tensor mode that itself runs nothing: its presence is what tells torch
    not to start CUDA for a device tensor, and tells the engine (``cuda_runtime``) that no real
    CUDA work, streams or graph captures may be issued. Every operation reaches the recorder first."""
    with FakeTensorMode(allow_non_fake_inputs=True), Recorder() as recorder:
        yield recorder


@dataclass
class StepFigures:
    """One step's host time and what it asked of the device."""

    seconds: float
    tally: Tally


def measure(recorder: Recorder, step: Callable[[], Any]) -> StepFigures:
    before = recorder.tally.copy()
    start = time.perf_counter()
    step()
    seconds = time.perf_counter() - start
    return StepFigures(seconds, recorder.tally - before)


def per_op_cost(recorder: Recorder, repeats: int = 2000) -> float:
    """The recorder's own seconds per operation (an add on two device tensors), to print beside
    the figures it took."""
    a = DeviceFree((64, 64), (64, 1), torch.bfloat16)
    a + a
    before = recorder.tally.copy()
    start = time.perf_counter()
    for _ in range(repeats):
        a + a
    cost = (time.perf_counter() - start) / repeats
    recorder.tally = before
    return cost


# --- the engine on the recorder ---------------------------------------------------------------


@contextlib.contextmanager
def device_free_engine(settings: dict[str, Any]) -> Iterator[tuple[Any, Recorder]]:
    """An engine built from ``settings`` (an ``EngineConfig``'s fields; ``device`` is ``cuda``)
    with every device tensor device-free, its declared read-backs answered with zeros and counted,
    and its step graphs (decode and prompt) recorded once and replayed as a count."""
    from loraplane.serving.config import EngineConfig
    from loraplane.serving.engine import builder, transfers
    from loraplane.serving.engine.step_graphs import StepGraphs

    with recording() as recorder, contextlib.ExitStack() as patches:

        def to_host(t: torch.Tensor) -> torch.Tensor:
            if not _is_device(t):
                raise HostSync("transfers.to_host was handed a host tensor")
            recorder.tally.read_backs += 1
            recorder.tally.read_back_bytes += t.numel() * t.element_size()
            return torch.zeros(tuple(t.shape), dtype=t.dtype)

        def capture(graphs: StepGraphs, size: int) -> None:
            before = recorder.captured
            with recorder.capture():
                graphs.outputs[size] = graphs._forward(size)
            recorder.graph_launches[type(graphs).__name__, size] = recorder.captured - before

            def replay() -> None:
                recorder.tally.graph_replays += 1

            graphs.graphs[size] = replay

        patches.enter_context(_patched(transfers, "to_host", to_host))
        # Random weights would need a CUDA generator; a device-free weight has no values to fill.
        patches.enter_context(_patched(builder, "random_weights", lambda model: None))
        patches.enter_context(_patched(StepGraphs, "capture", capture))
        engine = builder.build_engine(EngineConfig(**{**settings, "device": "cuda", "load_format": "dummy"}))
        try:
            yield engine, recorder
        finally:
            engine.adapters.close()


@contextlib.contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    before = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, before)


# --- the steps the benchmark and the test measure ---------------------------------------------


@dataclass(frozen=True)
class Scenario:
    """One kind of step: ``decode`` rows each decoding one token, beside ``prompts`` new prompts of
    ``prompt_len`` tokens each (all in this step's budget)."""

    name: str
    decode: int = 0
    prompts: int = 0
    prompt_len: int = 0
    temperature: float = 0.0  # greedy unless set; then top_p too, and every other row seeded
    top_p: float = 1.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def params(self, tokens: int, row: int) -> Any:
        from loraplane.serving.engine.sampling_params import SamplingParams

        seed = row if self.temperature and row % 2 else None
        return SamplingParams(
            max_tokens=tokens, temperature=self.temperature, top_p=self.top_p, seed=seed, ignore_eos=True,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
        )  # fmt: skip


def run_scenario(engine: Any, recorder: Recorder, s: Scenario, adapters: list[str | None], repeats: int) -> list[StepFigures]:
    """``repeats`` measured steps of scenario ``s`` (after one unmeasured, which learns the shapes
    and captures graphs). Rows take the adapters in turn."""
    figures: list[StepFigures] = []
    turn = iter(range(1 << 30))
    for attempt in range(repeats + 1):
        ids = []
        for row in range(s.decode):  # running sequences, each past its prompt
            ids.append(
                engine.add_request([7] * 8, s.params(engine.max_model_len - 8, row), adapter=adapters[next(turn) % len(adapters)])
            )
        while any(engine.requests[i].num_computed_tokens < 8 for i in ids):
            engine.step()
        for k in range(s.prompts):
            tokens = [11 + (k + j) % 97 for j in range(s.prompt_len)]
            ids.append(engine.add_request(tokens, s.params(1, s.decode + k), adapter=adapters[next(turn) % len(adapters)]))
        if s.prompts == 0:
            engine.step()  # one decode step unmeasured: the batch settles into its graph bucket
        f = measure(recorder, engine.step)
        if attempt:
            figures.append(f)
        for i in ids:
            engine.abort(i)
        engine.step()  # the aborted sequences leave
    return figures


def place_all(engine: Any, names: list[str]) -> None:
    """Every named adapter into a device slot before steps are measured: a step that places one
    pays for its host-to-device copies, which is the adapter tier's cost, not the step's."""
    pending = list(names)
    while pending:
        pending = [name for name in pending if engine.adapters.ensure_device(name) is None]
        if pending:
            engine.adapters.wait_for_loads(timeout=1.0)
            failures = engine.adapters.poll()
            if failures:
                raise RuntimeError(failures[0].message)
