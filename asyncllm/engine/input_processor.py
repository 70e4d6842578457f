"""Turns a prompt (text, token ids or chat messages) into a validated EngineCoreRequest."""

from __future__ import annotations

import time
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from asyncllm.config import ModelConfig
from asyncllm.engine.messages import EngineCoreRequest
from asyncllm.errors import ValidationError
from asyncllm.sampling_params import SamplingParams

# a prompt is a string or {"prompt_token_ids": [...]} (or {"prompt": "..."}), as in vLLM
PromptType = str | dict[str, Any]


def load_tokenizer(model_config: ModelConfig) -> PreTrainedTokenizerBase | None:
    """The model folder's tokenizer, or None for a folder without one (dummy benchmark models).
    Given the config already read, AutoTokenizer does not read it again through its model's
    config class (for a converted GGUF, LlamaConfig's import: 2.5 s of start-up)."""
    path = model_config.path
    if not any((path / name).exists() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    return AutoTokenizer.from_pretrained(path, config=model_config.hf_config)


class InputProcessor:
    def __init__(
        self, model_config: ModelConfig, tokenizer: PreTrainedTokenizerBase | None
    ) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.vocab_size = model_config.hf_config.vocab_size

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        priority: int = 0,
        add_special_tokens: bool = True,
    ) -> tuple[EngineCoreRequest, str | None]:
        """Returns the request and the prompt text (None when given token ids).

        Chat prompts pass add_special_tokens=False: the template already holds them.
        """
        text, token_ids = self._tokenize(prompt, add_special_tokens)
        self._validate(token_ids, params)
        max_tokens = self.model_config.max_model_len - len(token_ids)
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            eos_token_ids=self.model_config.eos_token_ids,
            max_tokens=max_tokens,
            arrival_time=time.monotonic(),
            priority=priority,
            bad_words_token_ids=self._tokenize_bad_words(params.bad_words or []),
        )
        return request, text

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **template_kwargs: Any,
    ) -> str:
        """The conversation as prompt text, ending with the opening of a new assistant message
        (add_generation_prompt) or, with continue_final_message, inside the last message, which
        the reply then continues (vLLM's defaults: a new message)."""
        if self.tokenizer is None or not self.tokenizer.chat_template:
            raise ValidationError("messages: this model has no chat template.", "messages")
        try:
            return self.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **template_kwargs,
            )
        except Exception as e:  # jinja errors from a malformed conversation
            raise ValidationError(
                f"messages: cannot apply the chat template: {e}", "messages"
            ) from e

    def prompt_text(self, prompt: PromptType) -> str | None:
        """The text to tokenize, or None for a prompt that brings its token ids."""
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return None
        text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
        if not isinstance(text, str):
            raise ValidationError(
                "prompt must be a string or {'prompt_token_ids': [...]}.", "prompt"
            )
        if self.tokenizer is None:
            raise ValidationError(
                "prompt: this model has no tokenizer; pass prompt_token_ids.", "prompt"
            )
        return text

    def _tokenize(
        self, prompt: PromptType, add_special_tokens: bool
    ) -> tuple[str | None, list[int]]:
        text = self.prompt_text(prompt)
        if text is None:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        return text, self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _validate(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise ValidationError("prompt must not be empty.", "prompt")
        if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in token_ids):
            raise ValidationError(
                f"prompt_token_ids must be integers in [0, {self.vocab_size}).", "prompt_token_ids"
            )
        limit = self.model_config.max_model_len
        if len(token_ids) >= limit:
            raise ValidationError(
                f"prompt is {len(token_ids)} tokens long; the maximum model length is {limit}, "
                "which must leave room for at least one generated token.",
                code="context_length_exceeded",
            )
        self._validate_sampling(params)

    def _validate_sampling(self, params: SamplingParams) -> None:
        """The checks that need the model: the logprobs limit and the vocabulary size."""
        limit = self.model_config.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > limit:
                raise ValidationError(
                    f"{name} must be at most {limit} (max_logprobs), got {value}.", name
                )
        for name in ("logit_bias", "allowed_token_ids", "stop_token_ids"):
            ids = getattr(params, name) or []
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValidationError(
                    f"{name} has token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}.",
                    name,
                )
        if params.bad_words and self.tokenizer is None:
            raise ValidationError("bad_words: this model has no tokenizer.", "bad_words")
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                message = "structured_outputs: this model has no tokenizer."
                raise ValidationError(message, "structured_outputs")
            from asyncllm.structured_output.grammar import check_structured_outputs

            check_structured_outputs(params.structured_outputs)

    def _tokenize_bad_words(self, words: list[str]) -> list[list[int]]:
        """Each word as it reads alone and after a space (vLLM does the same): BPE tokenizers
        give the two different ids."""
        sequences: list[list[int]] = []
        for word in words:
            for variant in dict.fromkeys([word, " " + word.lstrip(" ")]):
                ids = self.tokenizer.encode(variant, add_special_tokens=False)
                if ids and ids not in sequences:
                    sequences.append(ids)
        return sequences
