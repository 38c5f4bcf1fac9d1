"""The family table (freetoken/models/families.py) is the one source of the families' names: HF model types that
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
