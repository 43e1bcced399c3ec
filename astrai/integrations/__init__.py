"""Adapters that let other libraries run their attention through astrai.

``astrai.integrations.transformers``: Hugging Face transformers models, dense and paged
(continuous batching). Each adapter imports its library only when it is imported itself.
"""
