"""Expert residency: the host pool (authoritative records) and the device slot cache shared by all MoE layers."""

from freetoken.cache.expert_cache import CacheError, ExpertCache
from freetoken.cache.host_pool import HostPool
from freetoken.cache.reference import CacheModel

__all__ = ["CacheError", "CacheModel", "ExpertCache", "HostPool"]
