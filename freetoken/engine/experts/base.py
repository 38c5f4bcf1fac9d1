"""What every expert runner shares: the routing record of the last forward pass and the counters/report API."""

from __future__ import annotations

from freetoken.formats import RecordLayout
from freetoken.models.experts import ExpertRunner


class RunnerBase(ExpertRunner):
    """``last_routing``: the expert ids of every MoE layer of the last forward pass (device arrays ``[T, k]``, in
    layer order; a prompt run in chunks: all of its chunks, concatenated per layer), for routing traces and
    hot-expert counts."""

    def __init__(self, device, layouts: RecordLayout | list[RecordLayout], num_layers: int):
        single = layouts if isinstance(layouts, RecordLayout) else None
        layouts = [single] * num_layers if single else list(layouts)
        if len(layouts) != num_layers:
            raise ValueError(f"{len(layouts)} record layouts for {num_layers} MoE layers")
        self.dev, self.layouts, self.num_layers = device, layouts, num_layers
        # the largest record: what slot sizes and per-record cost estimates go by (None without MoE layers)
        self.layout = single or max(layouts, key=lambda lay: lay.record_bytes, default=None)
        self._routing: list[list] = [[]]  # per chunk of the last pass: the ids of every MoE layer

    def begin(self, tokens: int, first: bool = True) -> None:
        if first:
            self._routing = []
        self._routing.append([])

    def record(self, ids) -> None:
        self._routing[-1].append(ids)

    @property
    def last_routing(self) -> list:
        if len(self._routing) == 1:
            return self._routing[0]
        xp = self.dev.xp
        return [xp.concatenate(per_layer) for per_layer in zip(*self._routing, strict=True)]

    # ---- what a run reports -------------------------------------------------------------------------------------
    mode = "cpu"

    def counters(self) -> dict[str, int]:
        """Counters since load (or the last :meth:`reset`), as numbers; none for a runner that keeps none."""
        return {}

    def summary(self) -> str:
        """One line on where the experts ran (the ``run`` command's stats line)."""
        return f"experts: read in place from host memory ({self.formats_name()})"

    def formats_name(self) -> str:
        """The record formats, "q4_0" or, when layers differ, "q4_k+q6_k / q4_k" (each distinct layout once)."""
        return " / ".join(dict.fromkeys(lay.name for lay in self.layouts)) or "none"

    def memory(self) -> dict[str, int]:
        """Bytes the runner holds, by what they are (the memory report of ``run`` and ``chat``)."""
        return {}

    def report(self) -> str:
        """The miss policy's line ('' when there is no policy)."""
        return ""

    def pin_hot(self, counts, n: int) -> str:
        """Keep the ``n`` most used experts of ``counts`` [layers, experts] resident; returns a note for the report."""
        return "--pin-hot ignored: the cpu device reads every expert from host memory"

    def reset(self) -> None:  # noqa: B027 - a runner without state has nothing to forget
        """Forget residency and counters (after the load-time warm-up pass): as freshly loaded."""

    def close(self) -> None:  # noqa: B027
        """Stop worker threads (the runner is unusable afterwards)."""
