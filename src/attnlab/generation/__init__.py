"""Generation: one engine for attnlab models and any Hugging Face causal LM."""

from attnlab.config import GenerateConfig

from .engine import generate, generate_ids
from .results import Candidate, GenerationResult
from .runner import release_graphs

__all__ = ["GenerateConfig", "Candidate", "GenerationResult", "generate", "generate_ids", "release_graphs"]
