"""Typed run configuration: model, data, train and eval sections; decoding settings.

Every field here is reachable from YAML and from `--set section.field=value`.
Unknown keys are rejected (the loader suggests the closest valid name).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from attnlab.errors import ConfigError
from attnlab.sections import Section  # unknown keys refused; numbers finite, booleans not numbers

from .tasks import TASK_NAMES, task_name


class ModelSection(Section):
    """The decoder LM: its token mixer and its size.

    These are also the fields of the model config: `attnlab.models.AttnLabConfig` takes each one over by name, with
    its type, default and bounds, so a field added here is a field of every model (and of its config.json)."""

    mixer: str = Field("gla", description="token mixer or preset by registered name: gla, softmax, nsa, mamba2, 2mamba, ... (docs/mixers.md)")
    hidden_size: int = Field(128, gt=0, description="residual stream width")
    num_layers: int = Field(4, gt=0, description="number of decoder blocks")
    num_heads: int = Field(4, gt=0, description="heads of the token mixer")
    intermediate_size: int | None = Field(None, ge=0, description="SwiGLU width; null = 8/3 * hidden, rounded up to 32; 0 = blocks without an MLP (Mamba-2's layout)")
    vocab_size: int | None = Field(None, gt=0, description="null = the tokenizer's size (data.source=mqar: data.mqar.vocab_size, the task's ids)")
    mixer_options: dict[str, Any] = Field(default_factory=dict, description="options of the chosen mixer")
    max_position_embeddings: int = Field(2048, gt=0, description="longest sequence the model is configured for")
    rope_theta: float = Field(10000.0, gt=0, description="RoPE base (mixers with rotary positions)")
    norm_eps: float = Field(1e-6, gt=0, description="RMSNorm epsilon")
    tie_word_embeddings: bool = Field(True, description="share the input embedding with the LM head")
    initializer_range: float = Field(0.02, gt=0, description="std of the normal weight init")
    kernels: Literal["auto", "torch", "fla"] = Field("auto", description="auto = Triton kernels on CUDA (fla's, and attnlab's for the attention family) when installed, else the PyTorch reference; torch = always the reference")


class MqarSection(Section):
    """Multi-query associative recall (Zoology's MQAR), generated on the fly: key-value pairs, then some keys again."""

    vocab_size: int = Field(256, ge=3, description="token ids of the task: keys from the lower half of 1..vocab_size-1, values from the upper half (at most the model's vocabulary)")
    num_pairs: int = Field(8, gt=0, description="key-value pairs at the start of every sequence")
    num_queries: int = Field(8, gt=0, description="keys asked again later in the sequence, each followed by its value (distinct keys, at most num_pairs); the loss and the accuracy are on these values only")
    filler: Literal["blank", "random"] = Field("blank", description="the tokens between the queries: 'blank' (token 0, Zoology's default) or 'random' (any id but the sequence's keys, Zoology's random_non_queries; the recall suite's: softmax learns it far sooner, docs/eval.md)")
    seed: int = Field(0, ge=0, lt=2**32, description="seeds the examples (the training and evaluation streams differ)")


class DataSection(Section):
    """Where the text comes from, how it is tokenised and cut into blocks."""

    source: str = Field("shakespeare", description="'shakespeare', a file, directory or glob (txt/jsonl/parquet), a saved HF dataset, hf://NAME from the local cache, a directory written by attnlab data prepare (read lazily), or 'mqar' (synthetic associative recall, data.mqar; its accuracy is evaluated as eval task mqar)")
    text_field: str = Field("text", description="field holding the text in JSONL/parquet/HF data")
    val_source: str | None = Field(None, description="separate validation data; null = hold out val_fraction of source")
    val_fraction: float = Field(0.05, ge=0.0, lt=1.0, description="share of the corpus held out for validation")
    tokenizer: str = Field("byte", description="'byte' or a local HF tokenizer directory")
    seq_len: int = Field(128, gt=1, description="tokens per training block")
    prepare_above_mb: float | None = Field(64.0, ge=0, description="raw text sources larger than this (MB) are prepared once into data.cache_dir and read lazily from memory maps; 0 = always, null = never (a prepared directory as data.source is always read lazily)")
    cache_dir: str | None = Field(None, description="where data.prepare_above_mb prepares raw sources; null = $XDG_CACHE_HOME/attnlab/prepared (else ~/.cache/attnlab/prepared)")
    verify_shards: bool = Field(False, description="check the SHA-256 of every shard of a prepared corpus before training (reads the whole corpus once); sizes are always checked")
    mqar: MqarSection = Field(default_factory=MqarSection, description="data.source=mqar: the task's options")

    @model_validator(mode="after")
    def _mqar_fits(self) -> "DataSection":
        if self.source != "mqar":
            return self
        m = self.mqar
        if m.num_queries > m.num_pairs:
            raise ValueError(f"mqar.num_queries ({m.num_queries}) is larger than data.mqar.num_pairs ({m.num_pairs}): every query asks "
                             f"for a different key. Lower data.mqar.num_queries to at most {m.num_pairs}.")
        need = 2 * m.num_pairs + 2 * m.num_queries
        if need > self.seq_len:
            raise ValueError(f"mqar.num_pairs ({m.num_pairs}) and data.mqar.num_queries ({m.num_queries}) take {need} tokens "
                             f"(2 * num_pairs + 2 * num_queries), more than data.seq_len={self.seq_len}. Raise data.seq_len "
                             f"to at least {need}, or lower data.mqar.num_pairs / data.mqar.num_queries.")
        keys, values = (m.vocab_size - 1) // 2, m.vocab_size - 1 - (m.vocab_size - 1) // 2
        if min(keys, values) < m.num_pairs:
            raise ValueError(f"mqar.vocab_size ({m.vocab_size}) leaves {keys} key and {values} value ids (id 0 unused, the rest "
                             f"halved), fewer than the {m.num_pairs} distinct keys and values of data.mqar.num_pairs. Raise "
                             f"data.mqar.vocab_size to at least {2 * m.num_pairs + 1}.")
        return self


class TrainSection(Section):
    """Optimisation, cadence, precision and logging."""

    seed: int = Field(0, ge=0, lt=2**32, description="seeds init, data order and samples (0 to 2^32 - 1, numpy's range)")
    init_from: str | None = Field(None, description="continue pretraining from this model instead of random weights: an attnlab model or run directory, a checkpoint attnlab converts (attnlab convert --help), or any HF causal LM directory (trained as it is); model.* fields left at their defaults are taken from it, others must agree")
    max_steps: int = Field(400, gt=0, description="optimizer steps")
    batch_size: int = Field(32, gt=0, description="sequences per micro-batch, across all processes (split evenly under torchrun)")
    grad_accum: int = Field(1, gt=0, description="micro-batches per optimizer step")
    lr: float = Field(3e-3, gt=0, description="peak learning rate (AdamW)")
    weight_decay: float = Field(0.1, ge=0, description="AdamW decoupled weight decay (not on norms and biases)")
    beta1: float = Field(0.9, gt=0, lt=1, description="AdamW beta1")
    beta2: float = Field(0.95, gt=0, lt=1, description="AdamW beta2")
    warmup_steps: int = Field(50, ge=0, description="linear warmup steps")
    schedule: Literal["cosine", "linear", "constant", "wsd"] = Field("cosine", description="decay after warmup: cosine (ends at 10% of lr), linear (to 0), constant, or wsd (warmup-stable-decay: lr until the last decay_fraction of the steps, then linearly to 0; extends cleanly when a run is resumed with more steps)")
    decay_fraction: float = Field(0.2, gt=0, le=1, description="train.schedule=wsd: share of max_steps spent in the final decay")
    grad_clip: float = Field(1.0, ge=0, description="max gradient norm; 0 = off")
    precision: Literal["auto", "fp32", "bf16"] = Field("auto", description="auto = bf16 on CUDA, fp32 on CPU")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = CUDA when visible")
    gradient_checkpointing: bool = Field(False, description="recompute block activations in backward (non-reentrant; captured with the step on CUDA)")
    cuda_graphs: bool = Field(True, description="on CUDA, capture the step's forward and backward as CUDA graphs and replay them (attnlab models and HF Llama; one process or DDP, with or without gradient checkpointing; FSDP with FSDP's gathers and reduce-scatters inside the graphs, with or without accumulation and checkpointing; other runs train eagerly and say why)")
    compile: bool | Literal["auto"] = Field("auto", description="where the training step of an attnlab model runs eagerly on CUDA (train.cuda_graphs off, a capture refused or failed), compile its blocks with torch.compile: the glue around the mixer fused by Inductor, the mixers' kernels traced into the graph where that is verified (softmax, mamba2, the attention family's variants up to the length of their chunked form) and a graph break otherwise; in one process the blocks compile as one graph, under several block by block; not with eager gradient checkpointing. auto = only where every block's mixer compiles whole; true = every attnlab model. Eager over captured tokens/s at 9 x 1024 on an H200 with auto: linear__output_norm 1.04, 2mamba 0.97, mamba2 0.76, 2mamba-e 0.71, gated_softmax 0.68, softmax 0.58 (as written 0.28-0.53). The first step takes a minute or two longer while the blocks compile")
    strategy: Literal["ddp", "fsdp"] = Field("ddp", description="how several processes under torchrun share the model: ddp replicates it, fsdp (CUDA only) shards parameters, gradients and optimizer state (FULL_SHARD); one process ignores it")
    grad_reduce_dtype: Literal["fp32", "bf16"] = Field("fp32", description="the dtype in which several processes average their gradients (DDP's all-reduce, FSDP's reduce-scatter): bf16 halves that traffic (as DDP's bf16_compress_hook; the averaged gradients are fp32 again, with bf16's 8-bit mantissa); one process ignores it")
    eval_every: int = Field(200, ge=0, description="validate every N steps (and at the end); 0 = only at the end")
    eval_batches: int = Field(16, gt=0, description="validation batches per evaluation")
    save_every: int = Field(200, ge=0, description="checkpoint every N steps (and at the end); 0 = no checkpoints")
    keep_last: int = Field(3, gt=0, description="checkpoints kept")
    log_every: int = Field(10, gt=0, description="heartbeat / metrics / TensorBoard every N steps; a log between checkpoints and validations is written once the next step is under way, so that the host never waits for the GPU to log")
    progress_every_s: float = Field(30.0, ge=0, description="when the output is not a terminal (nohup, tmux logs, job logs): a plain progress line every N seconds instead of the bar; 0 = every step")
    sample_prompt: str = Field("ROMEO:\n", description="prompt of the sample generated at each validation")
    sample_tokens: int = Field(160, ge=0, description="tokens sampled at each validation; 0 = no samples")
    profile: Literal["default", "production"] = Field("default", description="'production' turns preflight warnings about precision and memory into errors")
    profile_steps: int = Field(0, ge=0, description="profile this many optimizer steps under torch's profiler, each a whole cycle of the trainer (its batch, forward, backward, clipping, optimizer, log): the wall time, the GPU's kernel time, the host's waits on the GPU, the host operations and kernels that take the time, in the run directory's profile_rank0.txt (and .json), and the timeline (profile_rank0.pt.trace.json.gz, for Perfetto); 0 = off")
    profile_from: int = Field(5, ge=2, description="the first step train.profile_steps profiles (the first steps compile, capture and autotune)")
    wandb: bool = Field(False, description="also log to Weights & Biases (needs the wandb extra)")
    wandb_project: str = Field("attnlab", description="W&B project when train.wandb is on")

    @model_validator(mode="after")
    def _warmup_fits(self) -> "TrainSection":
        if self.warmup_steps > self.max_steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) is larger than max_steps ({self.max_steps}): lower "
                             f"train.warmup_steps (e.g. --set train.warmup_steps={self.max_steps // 10}) or raise train.max_steps")
        return self

    @model_validator(mode="after")
    def _profile_fits(self) -> "TrainSection":
        last = self.profile_from + self.profile_steps - 1
        if self.profile_steps and last > self.max_steps:
            raise ValueError(f"train.profile_steps ({self.profile_steps}) from train.profile_from ({self.profile_from}) "
                             f"would end at step {last}, past train.max_steps ({self.max_steps}): lower either, "
                             f"e.g. --set train.profile_from={max(2, self.max_steps - self.profile_steps + 1)}")
        return self

    @model_validator(mode="after")
    def _wsd_fits(self) -> "TrainSection":
        decay = max(1, round(self.decay_fraction * self.max_steps))
        if self.schedule == "wsd" and self.warmup_steps + decay > self.max_steps:
            raise ValueError(f"train.schedule=wsd: train.warmup_steps ({self.warmup_steps}) plus the decay "
                             f"(train.decay_fraction {self.decay_fraction:g} of {self.max_steps} steps = {decay}) exceed train.max_steps")
        return self


class EvalTaskSpec(Section):
    """One task evaluated during training."""

    task: str = Field(..., description="spider, dart, samsum, perplexity, or mqar (runs on data.source=mqar)")
    data: str | None = Field(None, description="the task's data in its official layout; null = the bundled fixture")
    split: str = Field("dev", description="split to evaluate (dev, test, train)")
    limit: int | None = Field(None, gt=0, description="first N examples (perplexity: windows; mqar: held-out examples, null = 256); null = all")
    template: str | None = Field(None, description="prompt template; null = the task's default")

    @field_validator("task")
    @classmethod
    def _known(cls, value: str) -> str:
        try:
            return task_name(value)
        except ConfigError:
            raise ValueError(f"unknown task {value!r}; choose one of {', '.join(TASK_NAMES)}") from None


class EvalSection(Section):
    """Evaluation on generation tasks and perplexity during training: which tasks, how often, with which decoding
    settings, and which metric picks the best checkpoint.

        eval:
          every: 200                       # steps; 0 = only at the end
          tasks:
            - {task: spider, data: data/spider, limit: 100}
            - {task: perplexity, data: data/heldout.txt, limit: 16}
          generation: {max_new_tokens: 128, batch_size: 16}
          best_metric: spider/execution_accuracy
          best_mode: max
    """

    tasks: list[EvalTaskSpec] = Field(default_factory=list, description="tasks to evaluate; empty = none")
    every: int = Field(0, ge=0, description="evaluate every N optimizer steps (and at the end); 0 = only at the end")
    generation: dict[str, Any] = Field(default_factory=dict, description="decoding settings as for attnlab generate, e.g. {max_new_tokens: 128}; the task's defaults fill the rest")
    best_metric: str | None = Field(None, description="'task/metric' that picks the best step, e.g. spider/execution_accuracy")
    best_mode: Literal["max", "min"] = Field("max", description="whether a larger or a smaller best_metric is better")

    @field_validator("generation")
    @classmethod
    def _valid_generation(cls, value: dict[str, Any]) -> dict[str, Any]:
        GenerateConfig(**value)  # unknown keys and impossible settings fail here, with GenerateConfig's messages
        return value

    @model_validator(mode="after")
    def _best_metric_is_evaluated(self) -> "EvalSection":
        if self.best_metric is not None:
            task, sep, metric = self.best_metric.partition("/")
            names = [t.task for t in self.tasks]
            if not sep or not metric:
                raise ValueError(f"best_metric must look like 'task/metric', e.g. 'spider/execution_accuracy', not {self.best_metric!r}")
            if task not in names:
                raise ValueError(f"best_metric {self.best_metric!r} names task {task!r}, which is not in eval.tasks ({', '.join(names) or 'none'})")
        return self


class RunConfig(Section):
    """One training run. `attnlab train` with no argument uses the defaults below."""

    model: ModelSection = Field(default_factory=ModelSection)
    data: DataSection = Field(default_factory=DataSection)
    train: TrainSection = Field(default_factory=TrainSection)
    eval: EvalSection = Field(default_factory=EvalSection)

    @model_validator(mode="before")
    @classmethod
    def _mqar_is_evaluated(cls, values: Any) -> Any:
        """A run on data.source=mqar evaluates the task's accuracy: eval task mqar is added when not listed."""
        if not isinstance(values, dict):
            return values
        data = values.get("data")
        source = data.get("source") if isinstance(data, dict) else getattr(data, "source", None)
        if source != "mqar":
            return values
        section = values.get("eval") or {}
        section = section.model_dump() if isinstance(section, EvalSection) else section
        if not isinstance(section, dict) or not isinstance(section.get("tasks", []), list):
            return values
        tasks = list(section.get("tasks") or [])
        if not any((t.get("task") if isinstance(t, dict) else getattr(t, "task", None)) == "mqar" for t in tasks):
            values = {**values, "eval": {**section, "tasks": tasks + [{"task": "mqar"}]}}
        return values

    @model_validator(mode="after")
    def _mqar_consistent(self) -> "RunConfig":
        if self.data.source != "mqar":
            if any(t.task == "mqar" for t in self.eval.tasks):
                raise ValueError("eval task mqar measures associative recall on the task a run trains on with data.source=mqar; "
                                 "this run trains on text: remove mqar from eval.tasks, or set data.source=mqar")
            return self
        vocab = self.model.vocab_size
        if vocab is not None and vocab < self.data.mqar.vocab_size:
            raise ValueError(f"data.mqar.vocab_size ({self.data.mqar.vocab_size}) is larger than model.vocab_size ({vocab}): "
                             f"task ids would fall outside the embedding. Set model.vocab_size to at least {self.data.mqar.vocab_size}.")
        return self


# Fields that change the model or the data it sees: a resume refuses to continue if any differs.
RESUME_LOCKED = ("model", "data", "train.seed", "train.batch_size", "train.grad_accum", "train.init_from")


class GenerateConfig(Section):
    """Decoding settings, with HF `generate` semantics. Impossible or ineffective combinations are rejected."""

    max_new_tokens: int = Field(64, gt=0, description="tokens generated after the prompt, at most")
    min_new_tokens: int = Field(0, ge=0, description="EOS is suppressed until this many tokens are generated")
    num_beams: int = Field(1, gt=0, description="1 = greedy or sampling; > 1 = beam search")
    length_penalty: float = Field(1.0, description="beam search: score = sum log p / length ** length_penalty")
    early_stopping: bool | Literal["never"] = Field(False, description="beam search stopping rule, as in HF generate")
    do_sample: bool = Field(False, description="sample instead of taking the most likely token")
    temperature: float = Field(1.0, gt=0, description="sampling temperature")
    top_k: int = Field(0, ge=0, description="sample from the k most likely tokens; 0 = off")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling mass; 1 = off")
    repetition_penalty: float = Field(1.0, gt=0, description="> 1 discourages tokens already in the prompt or output")
    stop: list[str] = Field(default_factory=list, description="strings that end generation (not included in the text)")
    eos_token_id: int | list[int] | None = Field(None, description="null = the tokenizer's and the model's EOS tokens")
    seed: int = Field(0, ge=0, lt=2**64, description="seed of the sampling generator (0 to 2^64 - 1)")
    num_return_sequences: int = Field(1, gt=0, description="candidates returned per prompt")
    batch_size: int = Field(8, gt=0, description="prompts decoded together")
    output_scores: bool = Field(False, description="also return each sequence's log-probability score")
    cuda_graphs: Literal["auto", "off"] = Field("auto", description="auto = on CUDA, decode attnlab models (fixed-size states and static KV buffers) and HF causal LMs over a static KV cache through CUDA graphs; off = eager steps")

    @model_validator(mode="after")
    def _coherent(self) -> "GenerateConfig":
        problems = []
        if self.min_new_tokens > self.max_new_tokens:
            problems.append(f"min_new_tokens ({self.min_new_tokens}) > max_new_tokens ({self.max_new_tokens})")
        if self.do_sample and self.num_beams > 1:
            problems.append("do_sample with num_beams > 1 (beam sampling) is not supported: choose sampling or beam search")
        if self.num_beams > 1 and self.num_return_sequences > self.num_beams:
            problems.append(f"num_return_sequences ({self.num_return_sequences}) > num_beams ({self.num_beams})")
        if self.num_beams == 1 and not self.do_sample and self.num_return_sequences > 1:
            problems.append("num_return_sequences > 1 with greedy decoding returns copies: set do_sample=true or num_beams")
        explicit = self.model_fields_set
        if not self.do_sample:
            for name in ("temperature", "top_k", "top_p"):
                if name in explicit and getattr(self, name) != GenerateConfig.model_fields[name].default:
                    problems.append(f"{name}={getattr(self, name)} has no effect without do_sample=true")
        if self.num_beams == 1:
            for name in ("length_penalty", "early_stopping"):
                if name in explicit and getattr(self, name) != GenerateConfig.model_fields[name].default:
                    problems.append(f"{name} only applies to beam search (num_beams > 1)")
        if any(not s for s in self.stop):
            problems.append("stop strings must not be empty")
        if problems:
            raise ValueError("; ".join(problems))
        return self
