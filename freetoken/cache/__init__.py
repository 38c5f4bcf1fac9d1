"""Expert residency: the host pool (authoritative records), or the host tier over the weight file when host memory
holds only some of them, and the device slot cache shared by all MoE layers.

The NumPy model of the cache (the oracle of its kernels) is ``freetoken.testing.reference.cache.CacheModel``."""

from freetoken.cache.expert_cache import CacheError, ExpertCache
from freetoken.cache.host_pool import HostPool
from freetoken.cache.host_tier import HostTier, HostTierError

__all__ = ["CacheError", "ExpertCache", "HostPool", "HostTier", "HostTierError"]
