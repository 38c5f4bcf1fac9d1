"""Running a loaded model, in rooms that import only those below them (tests/test_layering.py): :mod:`.options`
(what a load is told), :mod:`.experts` (the routed experts' runners), :mod:`.reuse` (prefix cache, anchors, state
snapshots), :mod:`.generation` (the loaded Model, sampling, grammars, chat), :mod:`.loading` (files -> Model) and
:mod:`.batching` (the scheduler and step loop)."""
