"""Small models that exercise astrai end to end."""

from .tiny_decoder import DecoderConfig, TinyDecoder

__all__ = ["DecoderConfig", "TinyDecoder"]
