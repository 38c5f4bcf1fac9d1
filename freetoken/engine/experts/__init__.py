"""Expert runners: the ways a loaded model's routed experts run (:class:`freetoken.models.experts.ExpertRunner`).

* :class:`HostExperts`: in place on the host (the cpu device);
* :class:`CachedExperts`: through the GPU's expert cache (gpu/emu), every miss fetched (``--moe-mode gpu``) or
  split between PCIe copies and the CPU (``cpu``, ``hybrid``, ``auto``), with optional next-layer prefetch.

:func:`make_runner` picks one for a device and :class:`freetoken.engine.options.ExpertOptions`.
"""

from __future__ import annotations

from freetoken.engine.experts.base import RunnerBase
from freetoken.engine.experts.cached import CachedExperts
from freetoken.engine.experts.host import HostExperts
from freetoken.engine.options import ExpertOptions


def make_runner(device, layouts, num_layers: int, num_experts: int, top_k: int,
                opts: ExpertOptions | None = None, reader=None) -> RunnerBase:
    """The runner of ``num_layers`` MoE layers on ``device`` (``layouts``: one :class:`RecordLayout` for every layer,
    or a list, one per layer, each a layout or an :class:`~freetoken.formats.parts.ExpertParts`): the host device
    reads experts in place, a device with its own memory (gpu, or emu standing in for one) caches them. ``reader``
    (an FTW file's :class:`~freetoken.loaders.ftw_records.FTWRecordReader`): host memory holds ``opts.host_memory``
    bytes of records, a :class:`~freetoken.cache.HostTier` over the file, instead of every record."""
    opts = opts or ExpertOptions()
    if device.kind == "cpu" or num_layers == 0:
        return HostExperts(device, layouts, num_layers, num_experts, opts.cpu_activations, reader=reader,
                           host_memory=opts.host_memory)
    return CachedExperts(device, layouts, num_layers, num_experts, top_k, opts, reader=reader)


__all__ = ["CachedExperts", "HostExperts", "RunnerBase", "make_runner"]
