"""The one thing a model knows about running its routed experts: an :class:`ExpertRunner`.

The model routes (its router block gives expert ids and weights per token) and hands the routed-expert call to the
runner it was given. Whether an expert was resident on the GPU, copied in over PCIe, computed on the CPU from host
memory or read in place is the runner's business (``freetoken.engine.experts``): the model holds math, not policy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from freetoken.formats import RecordLayout
from freetoken.formats.parts import ExpertParts


class ExpertRunner(ABC):
    """Runs the routed experts of a model's MoE layers (numbered 0 .. n_moe - 1 in model order).

    A forward pass calls :meth:`begin` once with its token count, then :meth:`run` once per MoE layer in order, then
    :meth:`end`; a prompt run in chunks is one such pass per chunk, the first with ``first=True``, the next ones with
    ``first=False`` (the same prompt goes on). ``layouts[m]`` is the record layout (expert formats and shape) MoE
    layer m's experts are held in: one for every layer, or per layer (a GGUF Q4_K_M file keeps some layers' down
    matrices in Q6_K); ``layout`` is the one with the largest record. ``parts[m]`` says how layer m's experts are
    held by layout: one part of all E experts, or (an FTW file that mixes formats in a layer) several, each a layout
    and its experts."""

    layouts: list[RecordLayout]
    layout: RecordLayout
    parts: list[ExpertParts]
    #: True when the runner reads its expert records itself (a host tier over the weight file, ``--host-memory``):
    #: the model then does not hand it the layers' banks at load (:meth:`load_layer` is not called).
    reads_own_experts: bool = False

    @abstractmethod
    def load_layer(self, layer: int, banks: dict, part: int = 0) -> None:
        """Take MoE layer ``layer``'s expert records of part ``part`` (host banks ``[n, ...]`` per the part's
        layout's ``bank_specs()``, rows in the order of ``parts[layer].experts[part]``)."""

    def load_target(self, layer: int, part: int = 0) -> dict | None:
        """The writable host arrays (``[n, ...]`` by bank name, in :meth:`load_layer`'s row order) where the runner
        keeps part ``part`` of MoE layer ``layer``, for a loader that can write the records there directly (an FTW
        file's records, copied straight into the pinned host pool: no per-layer temporary); None: the loader hands
        the banks to :meth:`load_layer`."""
        return None

    def begin(self, tokens: int, first: bool = True) -> None:  # noqa: B027 - runners without per-pass state
        """A forward pass of ``tokens`` tokens starts (a prompt, a chunk of one, or a decode step); ``first``: False
        for the second and later chunks of a prompt."""

    @abstractmethod
    def run(self, layer: int, h, ids, weights):
        """``y [T, H]`` float32 on the device: ``sum_j weights[t, j] * expert_{ids[t, j]}(h[t])`` for MoE layer
        ``layer``; ``h [T, H]`` float32, ``ids`` int32 ``[T, k]`` expert indices, ``weights`` float32 ``[T, k]``."""

    def end(self) -> None:  # noqa: B027
        """The forward pass finished."""
