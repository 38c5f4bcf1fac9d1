"""Every family's sequence can be cut back to a resume point and continued bit-equal: the KV rows of the attention
layers (and, for the hybrid families, the linear layers' state snapshot taken at the end of a prompt) are all a
continuation needs. What prefix reuse, anchors and rollback build on, checked on each family's tiny checkpoint."""

import numpy as np
import pytest
from tiny_models import FAMILIES, make_checkpoint

from freetoken.engine.loading.build import build_decoder
from freetoken.engine.options import LoadOptions
from freetoken.models import from_hf
from freetoken.testing.oracles import need


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory):
    import json

    from safetensors.numpy import load_file

    need("torch")
    path = tmp_path_factory.mktemp(request.param)
    make_checkpoint(request.param, path)
    cfg = from_hf(json.loads((path / "config.json").read_text()))
    return cfg, load_file(str(path / "model.safetensors"))


def test_cut_back_and_continue_is_bit_equal(checkpoint, device):
    cfg, tensors = checkpoint
    dec = build_decoder(cfg, lambda name: tensors[name], device, LoadOptions(ctx=64))
    rng = np.random.default_rng(7)
    first, then = rng.integers(0, cfg.vocab_size, 11), rng.integers(0, cfg.vocab_size, 5)
    dec.forward(first)  # a prompt: its end is a resume point (hybrid families keep their states' snapshot there)
    assert first.size in dec.resume_points()
    want = [dec.forward(then[:3]), *(dec.forward(then[i:i + 1]) for i in range(3, 5))]
    dec.length = first.size
    got = [dec.forward(then[:3]), *(dec.forward(then[i:i + 1]) for i in range(3, 5))]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
