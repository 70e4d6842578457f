"""EAGLE and EAGLE-3 heads with random weights, in the layout the EAGLE authors publish: greedy
speculation gives exactly the target's own tokens, and bad checkpoints are refused clearly."""

import json

import pytest
import torch
import transformers
from safetensors.torch import save_file

from asyncllm import LLM, SamplingParams

PROMPTS = [{"prompt_token_ids": [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]}, {"prompt_token_ids": [7]}]
HIDDEN, HEADS, KV_HEADS, INTER, VOCAB = 64, 4, 2, 128, 32
HEAD_DIM = HIDDEN // HEADS


@pytest.fixture(scope="module")
def target_dir(default_model_dir, tmp_path_factory):
    """A random 4-layer Llama over 32 tokens (EAGLE-3's default layers 2, 2 and 1 exist)."""
    path = tmp_path_factory.mktemp("eagle-target")
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=4,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=256,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
    )
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    transformers.AutoTokenizer.from_pretrained(default_model_dir).save_pretrained(path)
    return path


def head_config(architecture: str, **extra) -> dict:
    return dict(
        architectures=[architecture],
        model_type="llama",
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=1,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        **extra,
    )


def random(*shape: int) -> torch.Tensor:
    return torch.randn(*shape) * 0.2


def layer_tensors(prefix: str, qkv_input: int, input_norm: bool) -> dict[str, torch.Tensor]:
    tensors = {
        f"{prefix}.self_attn.q_proj.weight": random(HEADS * HEAD_DIM, qkv_input),
        f"{prefix}.self_attn.k_proj.weight": random(KV_HEADS * HEAD_DIM, qkv_input),
        f"{prefix}.self_attn.v_proj.weight": random(KV_HEADS * HEAD_DIM, qkv_input),
        f"{prefix}.self_attn.o_proj.weight": random(HIDDEN, HEADS * HEAD_DIM),
        f"{prefix}.mlp.gate_proj.weight": random(INTER, HIDDEN),
        f"{prefix}.mlp.up_proj.weight": random(INTER, HIDDEN),
        f"{prefix}.mlp.down_proj.weight": random(HIDDEN, INTER),
        f"{prefix}.post_attention_layernorm.weight": 1 + random(HIDDEN),
    }
    if input_norm:
        tensors[f"{prefix}.input_layernorm.weight"] = 1 + random(HIDDEN)
    return tensors


def write_head(path, config: dict, tensors: dict[str, torch.Tensor]):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({name: t.contiguous() for name, t in tensors.items()}, path / "model.safetensors")
    return path


def eagle_tensors(own_embedding: bool = False) -> dict[str, torch.Tensor]:
    """EAGLE-1/2: fc (with its bias) over [embedding; hidden], a layer without input norm."""
    tensors = {"fc.weight": random(HIDDEN, 2 * HIDDEN), "fc.bias": random(HIDDEN)}
    tensors |= layer_tensors("layers.0", HIDDEN, input_norm=False)
    if own_embedding:
        tensors["embed_tokens.weight"] = random(VOCAB, HIDDEN)
    return tensors


def eagle3_tensors(draft_vocab: int = 16) -> dict[str, torch.Tensor]:
    """EAGLE-3: fc over three layers' states, midlayer reading 2H, its own small vocabulary
    (d2t: target id minus draft id; t2d: which target ids it covers)."""
    torch.manual_seed(3)
    draft_to_target = torch.randperm(VOCAB)[:draft_vocab].sort().values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[draft_to_target] = True
    tensors = {
        "fc.weight": random(HIDDEN, 3 * HIDDEN),
        "midlayer.hidden_norm.weight": 1 + random(HIDDEN),
        "norm.weight": 1 + random(HIDDEN),
        "lm_head.weight": random(draft_vocab, HIDDEN),
        "d2t": draft_to_target - torch.arange(draft_vocab),
        "t2d": t2d,
    }
    return tensors | layer_tensors("midlayer", 2 * HIDDEN, input_norm=True)


@pytest.fixture(scope="module")
def eagle_dir(tmp_path_factory):
    torch.manual_seed(1)
    path = tmp_path_factory.mktemp("eagle-head")
    return write_head(path, head_config("LlamaForCausalLM", bias=True), eagle_tensors())


@pytest.fixture(scope="module")
def eagle3_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("eagle3-head")
    config = head_config(
        "LlamaForCausalLMEagle3",
        draft_vocab_size=16,
        eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 3]},
    )
    return write_head(path, config, eagle3_tensors())


def engine_kwargs(target_dir) -> dict:
    return dict(model=str(target_dir), max_model_len=256, kv_cache_memory=1 << 24)


def generate(llm: LLM, params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def greedy_tokens(target_dir):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    return generate(LLM(**engine_kwargs(target_dir)), params)


def speculate(target_dir, method: str, head_dir, num_tokens: int = 3) -> LLM:
    config = {"method": method, "model": str(head_dir), "num_speculative_tokens": num_tokens}
    return LLM(**engine_kwargs(target_dir), speculative_config=config)


def spec_stats(llm: LLM):
    return llm.core_client.core.spec_decoding_stats


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_greedy_gives_the_targets_own_tokens(
    target_dir, greedy_tokens, eagle_dir, eagle3_dir, method
):
    head_dir = eagle_dir if method == "eagle" else eagle3_dir
    spec = speculate(target_dir, method, head_dir)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    assert generate(spec, params) == greedy_tokens
    assert spec_stats(spec).num_draft_tokens > 0


@pytest.fixture(scope="module")
def hf_target(target_dir):
    return transformers.LlamaForCausalLM.from_pretrained(target_dir).eval()


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


def eagle_reference(hf_target, head_dir, tokens: list[int], num_drafts: int) -> list[int]:
    """EAGLE-1 from its description, recomputed whole for each draft: HF's Llama layer (no
    input norm, no final norm) over fc([embedding of t+1; target state t]), the target's
    lm_head on the last row; each draft is appended with the head's own last state."""
    from safetensors.torch import load_file

    weights = load_file(head_dir / "model.safetensors")
    config = transformers.LlamaConfig.from_pretrained(head_dir)
    head = transformers.LlamaModel(config).eval()
    head.layers[0].input_layernorm = torch.nn.Identity()
    head.norm = torch.nn.Identity()
    head.load_state_dict(
        {k: v for k, v in weights.items() if k.startswith("layers.")}, strict=False
    )
    with torch.no_grad():
        states = hf_target.model(torch.tensor([tokens[:-1]])).last_hidden_state[0]
        ids = list(tokens[1:])
        drafts = []
        for _ in range(num_drafts):
            embeds = hf_target.model.embed_tokens(torch.tensor(ids))
            x = torch.cat([embeds, states], -1) @ weights["fc.weight"].T + weights["fc.bias"]
            out = head(inputs_embeds=x[None]).last_hidden_state[0]
            drafts.append(int(hf_target.lm_head(out[-1]).argmax()))
            ids.append(drafts[-1])
            states = torch.cat([states, out[-1:]])
    return drafts


def eagle3_reference(hf_target, head_dir, tokens: list[int], num_drafts: int) -> list[int]:
    """EAGLE-3 from its description, recomputed whole for each draft."""
    from safetensors.torch import load_file
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    w = load_file(head_dir / "model.safetensors")
    config = transformers.LlamaConfig.from_pretrained(head_dir)
    rotary = LlamaRotaryEmbedding(config)

    def layer(embeds, hidden):
        n = len(hidden)
        x = torch.cat([rms_norm(embeds, w["midlayer.input_layernorm.weight"]),
                       rms_norm(hidden, w["midlayer.hidden_norm.weight"])], -1)  # fmt: skip
        q, k, v = (
            (x @ w[f"midlayer.self_attn.{p}_proj.weight"].T).view(n, -1, HEAD_DIM).transpose(0, 1)
            for p in "qkv"
        )
        cos, sin = rotary(x[None], torch.arange(n)[None])
        q, k = apply_rotary_pos_emb(q[None], k[None], cos, sin)
        k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=-3) for t in (k, v[None]))
        attn = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = (
            hidden
            + attn[0].transpose(0, 1).reshape(n, -1) @ w["midlayer.self_attn.o_proj.weight"].T
        )
        m = rms_norm(h, w["midlayer.post_attention_layernorm.weight"])
        gate, up = m @ w["midlayer.mlp.gate_proj.weight"].T, m @ w["midlayer.mlp.up_proj.weight"].T
        h = h + (torch.nn.functional.silu(gate) * up) @ w["midlayer.mlp.down_proj.weight"].T
        return rms_norm(h, w["norm.weight"]), h

    with torch.no_grad():
        out = hf_target.model(torch.tensor([tokens[:-1]]), output_hidden_states=True)
        aux = torch.cat([out.hidden_states[i][0] for i in (0, 1, 3)], -1)
        states = aux @ w["fc.weight"].T
        ids, drafts = list(tokens[1:]), []
        for _ in range(num_drafts):
            normed, prenorm = layer(hf_target.model.embed_tokens(torch.tensor(ids)), states)
            draft = int((normed[-1] @ w["lm_head.weight"].T).argmax())
            drafts.append(draft + int(w["d2t"][draft]))
            ids.append(drafts[-1])
            states = torch.cat([states, prenorm[-1:]])
    return drafts


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_drafts_are_the_heads_as_described(
    target_dir, hf_target, eagle_dir, eagle3_dir, monkeypatch, method
):
    """Every draft the engine proposes (the head run incrementally over its own KV cache,
    chunk by chunk and after accepted and rejected drafts) is the head's output recomputed
    from scratch over the whole sequence."""
    from asyncllm.spec_decode.eagle import EagleProposer

    drafted = []
    original = EagleProposer.draft

    def recording(self, step):
        drafts = original(self, step)
        drafted.extend(zip(step.next_positions.tolist(), drafts))
        return drafts

    monkeypatch.setattr(EagleProposer, "draft", recording)
    head_dir, reference = (eagle_dir, eagle_reference)
    if method == "eagle3":
        head_dir, reference = (eagle3_dir, eagle3_reference)
    prompt = list(range(3, 20))
    config = {"method": method, "model": str(head_dir), "num_speculative_tokens": 3}
    # prompts in chunks of 8 tokens: the head catches up on partial prefills too
    spec = LLM(**engine_kwargs(target_dir), max_num_batched_tokens=8, speculative_config=config)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    output = spec.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    tokens = prompt + list(output[0].outputs[0].token_ids)
    assert sum(len(drafts) for _, drafts in drafted) > 6
    for position, drafts in drafted:
        assert drafts == reference(hf_target, head_dir, tokens[: position + 1], len(drafts))
