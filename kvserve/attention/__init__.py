"""Paged attention: metadata, the plain reference (test oracle) and the fast backend."""
from kvserve.attention.metadata import AttentionMetadata
from kvserve.attention.paged import paged_attention, write_kv

__all__ = ["AttentionMetadata", "paged_attention", "write_kv"]
