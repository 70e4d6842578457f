"""EngineArgs (flat, what the CLI and LLM() take) and the EngineConfig built from it."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, PretrainedConfig

from asyncllm.model_files.generation_config import sampling_defaults
from asyncllm.model_files.gguf_convert import complete_config
from asyncllm.model_files.model_path import resolve_model_path

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# fp8: keys and values divided by the checkpoint's per-layer scales (else 1.0), in e4m3
_KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}


@dataclass
class EngineArgs:
    model: str | None = None  # HF folder or .gguf file; None: the default SmolLM2-135M-Instruct
    # float32 on CPU, bfloat16 on CUDA; bfloat16 on CPU: bf16 weights and KV cache, fp32 the rest
    dtype: str = "auto"
    device: str = "auto"
    load_format: str = "auto"  # auto | dummy
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes for the KV cache; default sized from free memory
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None  # exact block count, overrides the memory settings
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # when positive, the most prompt tokens one request computes in a step (vLLM's flag of the
    # same name): a long prompt then takes several steps, so no single step stalls the streams
    # decoding beside it for long
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"
    attention_backend: str = "auto"  # auto | torch | triton
    enforce_eager: bool = False
    # schedule step N+1 while step N runs; None: on when the model runs on a GPU
    async_scheduling: bool | None = None
    # AsyncLLM runs the engine core in a process of its own; None: on when the model runs on a GPU
    engine_process: bool | None = None
    seed: int = 0
    max_logprobs: int = 20
    # the engine core's torch profiler traces go here (POST /start_profile, /stop_profile);
    # None: $ASYNCLLM_TORCH_PROFILER_DIR, else profiling is off
    profiler_dir: str | None = None
    # where the defaults of the sampling fields a request leaves out come from (vLLM's flag):
    # auto (the model's generation_config.json), vllm (SamplingParams' own) or a path
    generation_config: str = "auto"
    override_generation_config: str | None = None  # JSON laid over them, e.g. '{"temperature": 0}'
    # ranks the model is split across, one worker each (tensor parallelism)
    tensor_parallel_size: int = 1
    # mp: worker processes on this machine; ray: Ray actors, on the machines of a Ray cluster
    distributed_executor_backend: str = "mp"
    # vLLM's --speculative-config: a JSON object (a dict from Python) with method,
    # num_speculative_tokens, model, prompt_lookup_min and prompt_lookup_max
    speculative_config: dict | str | None = None
    # fp8 (or int8, on CPU) quantizes a 16-bit checkpoint's weights at load; a quantized
    # checkpoint's own quantization_config needs no flag (given, it must agree)
    quantization: str | None = None
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | fp8 (e4m3, half a bf16 cache)

    def create_engine_config(self) -> EngineConfig:
        model = ModelConfig.from_args(self)
        cache = CacheConfig(
            block_size=self.block_size,
            kv_cache_memory=self.kv_cache_memory,
            gpu_memory_utilization=self.gpu_memory_utilization,
            num_blocks=self.num_kv_blocks,
            enable_prefix_caching=self.enable_prefix_caching,
            kv_cache_dtype=self.kv_cache_dtype,
        )
        scheduler = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=max(self.max_num_batched_tokens, self.max_num_seqs),
            max_model_len=model.max_model_len,
            policy=self.scheduling_policy,
            enable_chunked_prefill=self.enable_chunked_prefill,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
        )
        if (
            not self.enable_chunked_prefill
            and scheduler.max_num_batched_tokens < model.max_model_len
        ):
            scheduler.max_num_batched_tokens = model.max_model_len
        parallel = ParallelConfig(self.tensor_parallel_size, self.distributed_executor_backend)
        speculative = SpeculativeConfig.parse(self.speculative_config)
        if speculative is not None:
            scheduler.num_lookahead_tokens = speculative.num_speculative_tokens
            # MLA attention reads each request's length on the host, which a step scheduled
            # ahead knows only on the device
            mla = getattr(model.hf_config, "kv_lora_rank", None) is not None
            on_device = speculative.method in ("ngram", "medusa")
            scheduler.drafts_on_device = on_device and not mla
        return EngineConfig(model, cache, scheduler, self, parallel, speculative)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}


@dataclass
class ModelConfig:
    path: Path
    hf_config: PretrainedConfig
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    eos_token_ids: frozenset[int]
    load_format: str
    attention_backend: str
    enforce_eager: bool
    seed: int
    max_logprobs: int
    sampling_defaults: dict[str, Any] = field(default_factory=dict)  # SamplingParams kwargs
    quantization: str | None = None
    kv_cache_dtype: str = "auto"  # the loader checks the checkpoint's KV cache scheme against it

    @property
    def compute_dtype(self) -> torch.dtype:
        """The activations' dtype: dtype, but float32 for bfloat16 on CPU, where dtype is only
        what the linear weights and the KV cache are stored in (layers/quantization/cpu_bf16.py
        says why)."""
        if self.device.type == "cpu" and self.dtype == torch.bfloat16:
            return torch.float32
        return self.dtype

    @classmethod
    def from_args(cls, args: EngineArgs) -> ModelConfig:
        path = resolve_model_path(args.model)
        hf_config = _load_hf_config(path)
        device = _resolve_device(args.device)
        limit = getattr(hf_config, "max_position_embeddings", 2048)
        max_model_len = args.max_model_len or limit
        if max_model_len > limit:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's limit of {limit}.")
        backend = args.attention_backend
        if backend == "auto":
            backend = "triton" if device.type == "cuda" else "torch"
        return cls(
            path=path,
            hf_config=hf_config,
            dtype=_resolve_dtype(args.dtype, device),
            device=device,
            max_model_len=max_model_len,
            eos_token_ids=_eos_token_ids(path, hf_config),
            load_format=args.load_format,
            attention_backend=backend,
            enforce_eager=args.enforce_eager,
            seed=args.seed,
            max_logprobs=args.max_logprobs,
            sampling_defaults=sampling_defaults(
                path, args.generation_config, args.override_generation_config
            ),
            quantization=args.quantization,
            kv_cache_dtype=args.kv_cache_dtype,
        )


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    policy: str = "fcfs"
    enable_chunked_prefill: bool = True
    # when positive, the most tokens one request computes in a step
    long_prefill_token_threshold: int = 0
    # draft tokens a request may verify in a step (speculative decoding; 0: off)
    num_lookahead_tokens: int = 0
    # the proposer drafts on the device, so a speculating request may be scheduled again
    # while its step runs (async scheduling): its next input and drafts stay there
    drafts_on_device: bool = False

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}.")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}.")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be non-negative.")


SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle", "eagle3", "medusa")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's speculative_config keys. ngram looks the last prompt_lookup_max down to
    prompt_lookup_min tokens up earlier in the request; the other methods propose from model
    (a draft model of the same vocabulary, or EAGLE / EAGLE-3 / Medusa heads)."""

    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config method must be one of {', '.join(SPECULATIVE_METHODS)}; "
                f"got {self.method!r}."
            )
        if self.num_speculative_tokens < 1:
            raise ValueError("speculative_config num_speculative_tokens must be at least 1.")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max."
            )
        if self.method != "ngram" and self.model is None:
            raise ValueError(f"speculative_config method {self.method!r} needs a model.")

    @classmethod
    def parse(cls, value: dict | str | None) -> SpeculativeConfig | None:
        """From the CLI's JSON text or LLM()'s dict; None or {} turns speculation off."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from e
        if not value:
            return None
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a JSON object.")
        unknown = set(value) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"speculative_config has unknown keys: {', '.join(sorted(unknown))}.")
        if "method" not in value or "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs method and num_speculative_tokens.")
        return cls(**value)


@dataclass
class CacheConfig:
    block_size: int
    kv_cache_memory: int | None
    gpu_memory_utilization: float
    num_blocks: int | None
    enable_prefix_caching: bool
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in _KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(_KV_CACHE_DTYPES)}; "
                f"got {self.kv_cache_dtype!r}."
            )

    def cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return _KV_CACHE_DTYPES[self.kv_cache_dtype] or model_dtype


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    distributed_executor_backend: str = "mp"

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}."
            )
        if self.distributed_executor_backend not in ("mp", "ray"):
            raise ValueError(
                "distributed_executor_backend must be 'mp' or 'ray', got "
                f"{self.distributed_executor_backend!r}."
            )


@dataclass
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    args: EngineArgs
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig | None = None

    @property
    def async_scheduling(self) -> bool:
        """Schedule step N+1 and process step N's outputs while step N runs: free when the
        model runs on a GPU, a loss on CPU, where host and model share the same cores."""
        setting = self.args.async_scheduling
        return self.model.device.type == "cuda" if setting is None else setting

    @property
    def engine_process(self) -> bool:
        """On a GPU the server's event loop would otherwise hold up every step; on CPU the
        model and the server share the same few cores anyway."""
        setting = self.args.engine_process
        return self.model.device.type == "cuda" if setting is None else setting


def _load_hf_config(path: Path) -> PretrainedConfig:
    written = complete_config(path)  # a converted GGUF's, which needs no model config class
    if written is not None:
        return PretrainedConfig.from_dict(written)
    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"model: cannot read a Hugging Face config from {path}: {e}") from e


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {dtype!r}.")
    return _DTYPES[dtype]


def _eos_token_ids(path: Path, hf_config: PretrainedConfig) -> frozenset[int]:
    """EOS ids from generation_config.json, else config.json (never from the tokenizer)."""
    ids: list[int] = []
    generation_config = path / "generation_config.json"
    if generation_config.exists():
        ids = _as_list(json.loads(generation_config.read_text()).get("eos_token_id"))
    if not ids:
        ids = _as_list(getattr(hf_config, "eos_token_id", None))
    return frozenset(ids)


def _as_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)
