"""Model definitions; :mod:`nanovllm.models.registry` says which serves which architecture."""
