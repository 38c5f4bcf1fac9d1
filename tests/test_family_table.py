"""The family registry (freetoken/models/families/) is the one source of the families' names: HF model types that
transformers knows, GGUF architectures that gguf-py knows, every written architecture read back as a family, and
the readers' and the writer's maps derived from it."""

from gguf.constants import MODEL_ARCH_NAMES
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

from freetoken.convert.gguf_export import ARCHS
from freetoken.models import config
from freetoken.models.families import BY_NAME, GGUF_READS, GGUF_WRITES, ROWS

#: model types read as a family that transformers itself does not name (Kimi-K2's config.json says "kimi_k2" and
#: ships its own code; its layout is DeepSeek-V3's)
OUTSIDE_TRANSFORMERS = {"kimi_k2"}


def test_names_are_known_upstream():
    types = [t for f in ROWS for t in f.model_types]
    assert len(types) == len(set(types)) and len(BY_NAME) == len(ROWS)
    assert {t for t in types if t not in CONFIG_MAPPING_NAMES} == OUTSIDE_TRANSFORMERS
    assert {f.gguf_arch for f in ROWS} <= set(MODEL_ARCH_NAMES.values())


def test_every_written_file_is_read_back():
    for f in ROWS:
        read_as = GGUF_READS[f.gguf_arch]
        assert read_as == f.name if f.reads_gguf else BY_NAME[read_as].gguf_arch == f.gguf_arch, f.name
    assert len(GGUF_READS) == len({f.gguf_arch for f in ROWS})  # one reader per architecture


def test_maps_are_derived():
    assert config.FAMILIES == {t: f.name for f in ROWS for t in f.model_types}
    assert config.GGUF_FAMILIES == GGUF_READS and ARCHS == GGUF_WRITES
    assert config.HYBRID_FAMILIES == tuple(f.name for f in ROWS if f.hybrid)


def test_one_family_one_module():
    """Every module of freetoken/models/families that defines a FAMILY is registered, under its own module name;
    families that share a GGUF architecture read and write it with the same tensor names."""
    import importlib
    from pathlib import Path

    from freetoken.models import families

    modules = {p.stem: importlib.import_module(f"freetoken.models.families.{p.stem}")
               for p in Path(families.__file__).parent.glob("*.py") if p.stem != "__init__"}
    defined = {name: m.FAMILY for name, m in modules.items() if hasattr(m, "FAMILY")}
    assert set(defined) == set(BY_NAME)
    for name, fam in defined.items():
        assert BY_NAME[name] is fam and fam.name == name
    for f in ROWS:
        for g in ROWS:
            if f.gguf_arch == g.gguf_arch:
                assert dict(f.gguf_layer_names) == dict(g.gguf_layer_names), (f.name, g.name)


def test_family_tensor_names_are_canonical_keys():
    """A family's own HF names override common keys (or add the fused ones it stores); a typo would fall through
    to the common name silently."""
    from freetoken.models import weights

    fused = {"lin_qkvz", "lin_ba"}
    for f in ROWS:
        assert set(f.hf_layer_names) <= set(weights._HF_LAYER) | fused, f.name
        assert set(f.gguf_layer_names) <= set(weights.GGUF_LAYER_NAMES), f.name
