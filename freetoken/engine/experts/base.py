"""What every expert runner shares: the routing record of the last forward pass and the counters/report API."""

from __future__ import annotations

from freetoken.formats import RecordLayout
from freetoken.models.experts import ExpertRunner


class RunnerBase(ExpertRunner):
    """``last_routing``: the expert ids of every MoE layer of the last forward pass (device arrays ``[T, k]``, in
    layer order; a prompt run in chunks: all of its chunks, concatenated per layer), for routing traces and
    hot-expert counts."""

    def __init__(self, device, layout: RecordLayout, num_layers: int):
        self.dev, self.layout, self.num_layers = device, layout, num_layers
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
        return f"experts: read in place from host memory ({self.layout.fmt.name})"

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
