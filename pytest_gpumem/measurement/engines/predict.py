"""The prediction engine: a CPU run counted as a target GPU's caching allocator would (see docs/prediction.md)."""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from pytest_gpumem.measurement.engines.base import Reading
from pytest_gpumem.measurement.engines.cpu import CpuEngine
from pytest_gpumem.measurement.engines.storages import Block, Kinds, instances_among, sort_scanned, tensors_among
from pytest_gpumem.measurement.engines.tracker import OTHER, StorageTracker
from pytest_gpumem.targets import AttentionBackend, Target, Workspace
from pytest_gpumem.targets.allocator import CachingAllocatorModel

__all__ = ["PredictEngine"]

#: The thread a workspace belongs to: the caller's, or the autograd engine's device thread (a CUDA backward's).
_MAIN, _BACKWARD = "main", "backward"


class _TargetTracker(StorageTracker):
    """The prediction's storage tracker: what the target keeps on its host is not counted."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: key of a storage on the target's host → a weak reference to a tensor that holds it (dead: forgotten)
        self._host: dict[int, weakref.ref[torch.Tensor]] = {}

    def on_host(self, tensor: torch.Tensor) -> None:
        """``tensor``'s storage is on the target's host: not counted while ``tensor`` lives."""
        with self._lock:
            key = int(tensor.untyped_storage()._cdata)
            self._host[key] = weakref.ref(tensor)
            entry = self._entries.get(key)
            if entry is not None:
                self._on_freed(entry)

    def _not_on_host(self, tensor: Any) -> bool:
        try:
            key = int(tensor.untyped_storage()._cdata)
        except (AttributeError, RuntimeError, NotImplementedError):
            return True
        ref = self._host.get(key)
        if ref is not None and ref() is None:
            del self._host[key]
            ref = None
        return ref is None

    def _register(self, tensors: Iterable[torch.Tensor], category: str | None) -> None:
        super()._register([t for t in tensors if self._not_on_host(t)], category)

    def _register_scanned(self, objects: list[Any], extra: Iterable[object]) -> None:
        """The others, then the parameters (fake ones too), then their gradients in the parameters' order: the
        allocator model's blocks do not depend on when Python made each tensor's object (at once for a fake tensor,
        at its first use from Python for a real one)."""
        for tensor in optimizer_host_state(objects):
            self.on_host(tensor)
        params, _, others = sort_scanned(itertools.chain(tensors_among(objects), tensors_among(list(extra))))
        params += [tensor for tensor in others if isinstance(tensor, torch.nn.Parameter)]  # a fake one is a FakeTensor
        grads = [param.grad for param in params if param.grad is not None]
        placed = {id(tensor) for tensor in itertools.chain(params, grads)}
        self.register([tensor for tensor in others if id(tensor) not in placed])
        self.register(params, "parameters")
        self.register(grads, "gradients")


class _ModelObserver:
    """The target's caching allocator model, following the tracker's blocks."""

    def __init__(self, model: CachingAllocatorModel) -> None:
        self.model = model

    def allocated(self, key: int, nbytes: int) -> None:
        self.model.malloc(key, nbytes)

    def freed(self, key: int) -> None:
        if key in self.model:  # not if resized to nothing before
            self.model.free(key)

    def resized(self, key: int, nbytes: int) -> None:
        """A storage resized in place is, to the caching allocator, a free and a new block."""
        if key in self.model:
            self.model.free(key)
        if nbytes:
            self.model.malloc(key, nbytes)


@contextmanager
def _set_aside() -> Iterator[None]:
    """Run CPU code the target would not run, unseen: no dispatch mode, target kernels or saved-tensor hooks."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import _disable_current_modes

    with contextlib.ExitStack() as stack:
        stack.enter_context(_without_device_kernels())
        popped = stack.enter_context(_disable_current_modes())
        # fake tensors stay fake (fake=True): the kernels' own tensors (a mask's scalars) must be too
        for mode in reversed(popped):
            if isinstance(mode, FakeTensorMode):
                stack.enter_context(mode)
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(_same, _same))
        yield


@contextmanager
def _without_device_kernels() -> Iterator[None]:
    """The torch-function modes but :class:`_DeviceKernels` while the block runs."""
    modes = _get_current_function_mode_stack()
    if not any(isinstance(mode, _DeviceKernels) for mode in modes):
        yield
        return
    for _ in modes:
        torch._C._pop_torch_function_stack()
    try:
        for mode in modes:
            if not isinstance(mode, _DeviceKernels):
                torch._C._push_on_torch_function_stack(mode)
        yield
    finally:
        while torch._C._len_torch_function_stack():
            torch._C._pop_torch_function_stack()
        for mode in modes:
            torch._C._push_on_torch_function_stack(mode)


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


_TENSOR_BACKWARD = torch.Tensor.backward

#: the optimizers' scalar states that live on the host unless the optimizer is fused or capturable
HOST_SCALARS = ("step", "mu_product")


_OPTIMIZER_KINDS = Kinds(torch.optim.Optimizer)


def optimizer_host_state(objects: list[Any]) -> Iterator[torch.Tensor]:
    """The scalar states a GPU run keeps on its host (step counters) of the optimizers among ``objects``."""
    for obj in instances_among(objects, _OPTIMIZER_KINDS):
        for group in obj.param_groups:
            if group.get("fused") or group.get("capturable"):
                continue
            for param in group["params"]:
                state = obj.state.get(param) or {}
                for name in HOST_SCALARS:
                    value = state.get(name)
                    if isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_cpu:
                        yield value


def _made_by_an_optimizer() -> bool:
    """Whether a ``torch.optim`` optimizer calls the torch function handled now, with the CPU as default device."""
    if torch.get_default_device().type != "cpu":
        return False
    frame: Any = sys._getframe(2)  # past __torch_function__ and this function
    caller = frame.f_globals.get("__name__", "") if frame is not None else ""
    return isinstance(caller, str) and caller.startswith("torch.optim.")


def _backward_call(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[[], None] | None:
    """``loss.backward(...)`` as a call that starts the autograd engine directly (not the modes again); None if not."""
    import inspect

    try:
        from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
        from torch.autograd.graph import _engine_run_backward
    except ImportError:
        return None
    try:
        bound = inspect.signature(func).bind(*args, **kwargs)
    except TypeError:
        return None
    given = bound.arguments
    if func is _TENSOR_BACKWARD:
        tensors, grads = given.get("self"), given.get("gradient")
    else:
        if given.get("grad_variables") is not None:
            return None
        tensors, grads = given.get("tensors"), given.get("grad_tensors")
    retain_graph, create_graph = given.get("retain_graph"), given.get("create_graph", False)
    inputs = given.get("inputs")
    outputs = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors or ())
    if inputs is None:
        wrt: tuple[torch.Tensor, ...] = ()
    elif isinstance(inputs, torch.Tensor):
        wrt = (inputs,)
    elif isinstance(inputs, (list, tuple)) and inputs:
        wrt = tuple(inputs)
    else:
        return None
    if not outputs or not all(isinstance(t, torch.Tensor) for t in (*outputs, *wrt)):
        return None

    def run() -> None:
        made = _make_grads(outputs, _tensor_or_tensors_to_tuple(grads, len(outputs)), is_grads_batched=False)
        retain = create_graph if retain_graph is None else retain_graph
        _engine_run_backward(outputs, made, retain, create_graph, wrt, allow_unreachable=True, accumulate_grad=True)

    return run


class _DeviceKernels(TorchFunctionMode):
    """Runs the target's kernels where their memory differs from the CPU's (attention, dropout, autocast)."""

    def __init__(self, engine: PredictEngine) -> None:
        super().__init__()
        self.engine = engine
        self.target = engine.target

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is _TENSOR_BACKWARD or func is torch.autograd.backward:
            run = _backward_call(func, args, kwargs)
            if run is not None:
                # with this mode back on, so a checkpoint's recomputed forward runs the target's kernels as before
                with self:
                    return run()
        if func is torch.tensor and kwargs.get("device") in (None, "cpu") and _made_by_an_optimizer():
            # an optimizer's scalar state made on the host (AdamW's step counters, unless fused or capturable)
            with _set_aside():
                out = func(*args, **kwargs)
            self.engine.tracker.on_host(out)  # made while set aside, it lives on the target's host: never counted
            return out
        if func is F.scaled_dot_product_attention and self.target.attention_order:
            return _attention(self.engine, *args, **kwargs)
        if func is F.dropout and self.target.dropout_mask == "bool":
            return _dropout(*args, **kwargs)
        if torch.is_autocast_enabled("cpu"):
            precision = self._autocast(func)
            if precision is not None:
                args, kwargs = _cast((args, kwargs), precision)
        return func(*args, **kwargs)

    def _autocast(self, func: Any) -> torch.dtype | None:
        """The dtype the target's autocast runs ``func`` in, where the CPU's may differ (None: as the CPU)."""
        name = getattr(func, "__name__", "")
        if name.startswith("__") and name.endswith("__"):  # operators: x ** 3 is pow, 3 ** x rpow
            name = name[2:-2]
            if name.startswith("r") and name[1:] in self.target.autocast_fp32:
                name = name[1:]
        if name in self.target.autocast_fp32:
            return torch.float32
        if name in self.target.autocast_lower:
            return torch.get_autocast_dtype("cpu")
        return None


def _cast(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with its floating-point tensors (but float64) cast to ``dtype``, as autocast casts arguments."""
    if isinstance(value, torch.Tensor):
        eligible = value.is_floating_point() and value.dtype not in (torch.float64, dtype)
        return value.to(dtype) if eligible else value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(item, dtype) for item in value)
    if isinstance(value, dict):
        return {key: _cast(item, dtype) for key, item in value.items()}
    return value


def _dropout(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
    """``F.dropout`` as CUDA runs it: the fused ``native_dropout`` (a bool mask kept for backward)."""
    if training and not inplace and 0 < p < 1 and input.numel() > 0:
        return torch.native_dropout(input, p, True)[0]
    return F.dropout(input, p, training, inplace)


def choose_backend(
    target: Target,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    enable_gqa: bool,
) -> AttentionBackend:
    """The attention backend the target's PyTorch runs for these arguments (its first that accepts)."""
    dtype = str(query.dtype).removeprefix("torch.")
    gqa = enable_gqa and key.size(-3) != query.size(-3)
    for backend in target.attention_order:
        if backend.accepts(dtype, query.size(-1), value.size(-1), attn_mask is not None, gqa):
            return backend
    raise ValueError(f"no attention backend of {target.name!r} accepts {dtype} (its order must end with 'math')")


def _attention(
    engine: PredictEngine,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    if torch.is_autocast_enabled("cpu"):
        # cast here, as the target's autocast would, before its backend is chosen
        query, key, value, attn_mask = _cast((query, key, value, attn_mask), torch.get_autocast_dtype("cpu"))
    backend = choose_backend(engine.target, query, key, value, attn_mask, enable_gqa)
    if backend.name == "math":  # the composite CUDA runs too: its operators are the target's
        out, _ = torch.ops.aten._scaled_dot_product_attention_math(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
        )
        return out  # type: ignore[no-any-return]
    cpu = functools.partial(  # the CPU kernel, for the values
        F.scaled_dot_product_attention, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
    )
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        options = (backend, dropout_p, cpu, engine)
        return _FusedAttention.apply(query, key, value, attn_mask, options)  # type: ignore[no-any-return]
    with _set_aside():
        out = cpu(query, key, value, attn_mask)
    engine.count_new([out])
    return out


class _FusedAttention(torch.autograd.Function):
    """A fused attention kernel's memory (output, log-sum-exp, random state) with the CPU kernel's values."""

    @staticmethod
    def forward(
        ctx: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None,
        options: tuple[Any, ...],
    ) -> torch.Tensor:
        backend, dropout_p, cpu, engine = options
        with _set_aside():
            rng = torch.get_rng_state() if dropout_p > 0 else None
            out: torch.Tensor = cpu(query, key, value, attn_mask)
        engine.count_new([out])
        rows = query.size(-2)
        multiple = backend.logsumexp_row_multiple
        logsumexp = torch.empty((*query.shape[:-2], math.ceil(rows / multiple) * multiple), dtype=torch.float32)
        state = [torch.empty((), dtype=torch.int64) for _ in range(2)] if backend.keeps_rng_state(dropout_p) else []
        ctx.save_for_backward(query, key, value, out, logsumexp, attn_mask, *state)
        ctx.rng = rng
        ctx.options = options
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        query, key, value, _out, _lse, attn_mask, *_ = ctx.saved_tensors
        _, _, cpu, engine = ctx.options
        q, k, v = (t.detach().requires_grad_(t.requires_grad) for t in (query, key, value))
        inputs = [q, k, v]
        wanted = [t for t in inputs if t.requires_grad]
        with _set_aside(), torch.enable_grad(), torch.random.fork_rng(devices=[]):
            if ctx.rng is not None:
                torch.set_rng_state(ctx.rng)
            out = cpu(q, k, v, attn_mask)
            found = iter(torch.autograd.grad(out, wanted, grad_out))
        grads = [next(found) if t.requires_grad else None for t in inputs]
        engine.count_new(grads)
        return (*grads, None, None)


def _has_vector_bias(args: tuple[Any, ...]) -> bool:
    """``addmm(bias, a, b)`` with a one-dimensional bias: ``Linear`` with a bias (cuBLASLt's path)."""
    return bool(args) and isinstance(args[0], torch.Tensor) and args[0].dim() == 1


class PredictEngine(CpuEngine):
    """A CPU run whose figures are those the ``target`` GPU's caching allocator would show, and its workspaces."""

    name = "predict"
    exact = True
    tracker: _TargetTracker
    model: CachingAllocatorModel

    def __init__(self, target: Target) -> None:
        self.target = target
        self.model = CachingAllocatorModel(target.allocator)
        self._blocks: dict[tuple[str, str], Block] = {}
        self._synthetic_keys = itertools.count(1)
        operators = frozenset().union(*(w.operators for w in target.workspaces))
        tracker = _TargetTracker(
            torch.device("cpu"),
            cuda_rounding=True,
            observer=_ModelObserver(self.model),
            operator_hooks={name: functools.partial(self.matrix_product, name) for name in operators},
            thread_contexts=(lambda: _DeviceKernels(self),),
        )
        super().__init__(tracker=tracker)
        self.predicts = target.name
        self.workspaces: int | None = None  #: their bytes, once the first clean state made them

    def count_new(self, tensors: Iterable[torch.Tensor | None]) -> None:
        """Count ``tensors``, made while the tracker was set aside, as this moment's allocations."""
        self.tracker.register([t for t in tensors if t is not None], "temporaries")

    # -- readings and actions ------------------------------------------------------

    def allocated(self) -> int:
        return self.model.allocated

    def reserved(self) -> int | None:
        return self.model.reserved

    def take_window(self, *, defer: bool = False) -> Reading:
        window = self.tracker.take_window()
        model = self.model
        peak, reserved_peak = model.peak_allocated, model.peak_reserved
        model.reset_peaks()
        breakdown = window.breakdown
        if breakdown is not None and peak > window.peak:  # whole blocks the allocator did not split
            parts = list(breakdown)
            parts[OTHER] += peak - window.peak
            breakdown = tuple(parts)
        return Reading(
            peak=peak,
            breakdown=breakdown,
            highest={"reserved": reserved_peak, "saved_activations": window.saved_peak},
            sites=window.sites,
        )

    def clean(self, *, empty_cache: bool = True) -> None:
        """As the CUDA engine's; the model's cache is always emptied (it has no cost to save)."""
        self._clean_count()
        self.warm_workspaces()
        if self.workspaces is None:
            self.workspaces = sum(block.nbytes for block in self._blocks.values())
        self.empty_cache()
        self.take_window()

    def empty_cache(self) -> None:
        self.model.empty_cache()

    # -- workspaces ----------------------------------------------------------------

    def matrix_product(self, name: str, args: tuple[Any, ...]) -> None:  # called under the tracker's lock
        """The thread running operator ``name`` gets the workspaces it uses, if it has none yet."""
        thread = _BACKWARD if torch._C._current_graph_task_id() != -1 else _MAIN
        for workspace in self.target.workspaces:
            if name not in workspace.operators or (workspace.library, thread) in self._blocks:
                continue
            if workspace.when != "bias" or _has_vector_bias(args):
                self._create(workspace, thread)

    def _create(self, workspace: Workspace, thread: str) -> None:
        """The ``thread``'s workspace of ``workspace.library``, unless it has one."""
        if (workspace.library, thread) not in self._blocks:
            key = -next(self._synthetic_keys)  # storages' keys are addresses: never negative
            self._blocks[(workspace.library, thread)] = self.tracker.add_block(key, workspace.nbytes)

    def warm_workspaces(self) -> None:
        """Create every workspace a training step's threads get (the backward thread a plain matrix product's)."""
        for workspace in self.target.workspaces:
            self._create(workspace, _MAIN)
            if "mm" in workspace.operators and workspace.when is None:
                self._create(workspace, _BACKWARD)

    def release_workspaces(self) -> None:
        """Free every workspace (what ``torch._C._cuda_clearCublasWorkspaces()`` does)."""
        for block in self._blocks.values():
            self.tracker.remove_block(block)
        self._blocks.clear()
