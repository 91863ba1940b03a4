"""DistributedDataParallel over PyTorch's fake process group, for the process that runs fake ranks."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["DDP_ON_FAKE_RANKS", "ddp_on_fake_ranks"]

#: what DistributedDataParallel cannot do over the fake process group
DDP_ON_FAKE_RANKS = (
    "DistributedDataParallel ran into something the fake process group cannot give: fake ranks run DDP "
    "with its default all-reduce (gradient_as_bucket_view, bucket_cap_mb and broadcast_buffers as you "
    "set them), but not a communication hook of your own (its collectives return no values) nor "
    "find_unused_parameters=True or static_graph=True (DDP reads which parameters were used from tensor "
    "values); predict this step on real ranks (fake=False)"
)

_COMM_HOOK_ON_FAKE_RANKS = (
    "a DDP communication hook cannot run on fake ranks: the fake process group's collectives return no "
    "values for it to use; fake ranks run DDP's default all-reduce (in place, as on real ranks): drop the "
    "hook for the prediction, or predict on real ranks (fake=False)"
)


def _in_place_all_reduce(state: object, bucket: Any) -> Any:
    """DDP's all-reduce over the fake process group: the bucket itself, as a done future (as a real one yields)."""
    future: Any = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


# DDP checks a hook's annotations against its own classes; postponed ones are strings it rejects
_in_place_all_reduce.__annotations__ = {}


def ddp_on_fake_ranks() -> None:
    """Let DistributedDataParallel run in this process, which runs fake ranks only.

    The parameter-shape check across ranks is left out, the all-reduce yields the bucket in place, and the first bucket
    rebuild runs its bookkeeping on real tensors; a user's communication hook raises :class:`FakeModeError`.
    """
    import torch.nn.parallel.distributed as ddp
    from torch._C._distributed_c10d import Reducer

    from pytest_gpumem.measurement.engines.fake import FakeModeError, real_bookkeeping

    model_class = ddp.DistributedDataParallel
    if getattr(model_class, "_gpumem_fake_ranks", False):
        return
    ddp._verify_param_shape_across_processes = lambda *args, **kwargs: None  # type: ignore[attr-defined]
    rebuild = Reducer._rebuild_buckets

    def rebuild_buckets(reducer: Any) -> bool:
        with real_bookkeeping():
            return bool(rebuild(reducer))

    Reducer._rebuild_buckets = rebuild_buckets  # type: ignore[method-assign,assignment]
    built = model_class.__init__
    register = model_class.register_comm_hook

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        built(self, *args, **kwargs)
        if self.find_unused_parameters or self.static_graph:
            raise FakeModeError(DDP_ON_FAKE_RANKS)
        register(self, None, _in_place_all_reduce)

    def refuse_hook(self: Any, *args: Any, **kwargs: Any) -> None:
        raise FakeModeError(_COMM_HOOK_ON_FAKE_RANKS)

    model_class.__init__ = __init__  # type: ignore[method-assign]
    model_class.register_comm_hook = refuse_hook  # type: ignore[method-assign]
    model_class._register_builtin_comm_hook = refuse_hook  # type: ignore[method-assign]
    model_class._gpumem_fake_ranks = True  # type: ignore[attr-defined]
