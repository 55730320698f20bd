"""Generation: one engine for attnlab models and any Hugging Face causal LM."""

from attnlab.config import GenerateConfig

from .engine import Candidate, GenerationResult, generate, generate_ids
from .graphs import release_graphs

__all__ = ["GenerateConfig", "Candidate", "GenerationResult", "generate", "generate_ids", "release_graphs"]
