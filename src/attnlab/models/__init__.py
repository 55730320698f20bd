"""attnlab language models, registered with the transformers Auto classes."""

from transformers import AutoConfig, AutoModelForCausalLM

from attnlab.data.tokenizer import register_auto_tokenizer
from attnlab.models.cache import AttnLabCache
from attnlab.models.configuration import AttnLabConfig
from attnlab.models.mixers import MIXERS, build_mixer, register_mixer
from attnlab.models.modeling import AttnLabBlock, AttnLabForCausalLM, AttnLabModel, AttnLabPreTrainedModel

AutoConfig.register("attnlab", AttnLabConfig, exist_ok=True)
AutoModelForCausalLM.register(AttnLabConfig, AttnLabForCausalLM, exist_ok=True)
register_auto_tokenizer(AttnLabConfig)  # AutoTokenizer.from_pretrained(run/final) finds the byte tokenizer

__all__ = [
    "MIXERS",
    "AttnLabBlock",
    "AttnLabCache",
    "AttnLabConfig",
    "AttnLabForCausalLM",
    "AttnLabModel",
    "AttnLabPreTrainedModel",
    "build_mixer",
    "register_mixer",
]
