"""Internals of the SGLang stand-in (not part of SGLang's API)."""
