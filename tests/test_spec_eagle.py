"""EAGLE and EAGLE-3 heads with random weights, in the layout the EAGLE authors publish: greedy
speculation gives exactly the target's own tokens, and bad checkpoints are refused clearly."""

import json

import pytest
import torch
import transformers
from test_spec_eagle_support import (
    GREEDY,
    HEAD_DIM,
    HEADS,
    HIDDEN,
    INTER,
    KV_HEADS,
    SEEDED,
    VOCAB,
    Target,
    drafter,
    eagle3_tensors,
    eagle_tensors,
    generate,
    head_config,
    random,
    record_drafts,
    rms_norm,
    spec_stats,
    speculate,
    write_head,
    write_heads,
)

from asyncllm import SamplingParams


@pytest.fixture(scope="module")
def target(default_model_dir, tmp_path_factory):
    return Target.write(default_model_dir, tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def eagle_dir(tmp_path_factory):
    return write_heads("eagle", tmp_path_factory.mktemp("eagle-head"))


@pytest.fixture(scope="module")
def eagle3_dir(tmp_path_factory):
    return write_heads("eagle3", tmp_path_factory.mktemp("eagle3-head"))


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_greedy_and_seeded_give_the_targets_own_tokens(target, eagle_dir, eagle3_dir, method):
    """Greedy drafts are single tokens: seeded sampling keeps its text too."""
    spec = speculate(target, method, eagle_dir if method == "eagle" else eagle3_dir)
    assert generate(spec, GREEDY) == target.greedy
    assert generate(spec, SEEDED) == target.seeded
    assert spec_stats(spec).num_draft_tokens > 0


def eagle_reference(
    hf_target: transformers.LlamaForCausalLM, head_dir, tokens: list[int], num_drafts: int
) -> list[int]:
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


def eagle3_reference(
    hf_target: transformers.LlamaForCausalLM, head_dir, tokens: list[int], num_drafts: int
) -> list[int]:
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
def test_drafts_are_the_heads_as_described(target, eagle_dir, eagle3_dir, monkeypatch, method):
    """Every draft the engine proposes (the head run incrementally over its own KV cache,
    chunk by chunk and after accepted and rejected drafts) is the head's output recomputed
    from scratch over the whole sequence."""
    from asyncllm.spec_decode.eagle import EagleProposer

    drafted = record_drafts(monkeypatch, EagleProposer)
    head_dir, reference = (eagle_dir, eagle_reference)
    if method == "eagle3":
        head_dir, reference = (eagle3_dir, eagle3_reference)
    prompt = list(range(3, 20))
    # prompts in chunks of 8 tokens: the head catches up on partial prefills too
    spec = speculate(target, method, head_dir, max_num_batched_tokens=8)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    output = spec.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    tokens = prompt + list(output[0].outputs[0].token_ids)
    assert sum(len(drafts) for _, drafts in drafted) > 6
    for position, drafts in drafted:
        assert drafts == reference(target.hf, head_dir, tokens[: position + 1], len(drafts))


def test_a_head_with_its_own_embedding_reads_it(target, tmp_path):
    """A checkpoint with embed_tokens and lm_head: the head uses them, not the target's."""
    torch.manual_seed(6)
    tensors = eagle_tensors(own_embedding=True) | {"lm_head.weight": random(VOCAB, HIDDEN)}
    head_dir = write_head(tmp_path, head_config("EagleLlamaForCausalLM"), tensors)
    spec = speculate(target, "eagle", head_dir)
    head = drafter(spec).head
    assert torch.equal(head.embed_tokens.weight, tensors["embed_tokens.weight"])
    assert generate(spec, GREEDY) == target.greedy


def test_eagle3_in_vllms_layout_loads_the_same_head(target, eagle3_dir, tmp_path):
    """vLLM's converted EAGLE-3 checkpoints name the midlayer layers.0."""
    tensors = {name.replace("midlayer.", "layers.0."): t for name, t in eagle3_tensors().items()}
    config = json.loads((eagle3_dir / "config.json").read_text())
    spec = speculate(target, "eagle3", write_head(tmp_path, config, tensors))
    head = drafter(spec).head
    want = eagle3_tensors()["midlayer.hidden_norm.weight"]
    assert torch.equal(head.midlayer.hidden_norm.weight, want)
    assert generate(spec, GREEDY) == target.greedy


@pytest.mark.parametrize(
    ("config", "tensors", "error"),
    [
        (
            head_config("LlamaForCausalLMEagle", hidden_size=32),
            {},
            "hidden states of size 32; the target's are 64",
        ),
        (head_config("LlamaForCausalLMEagle", vocab_size=48), {}, "vocabulary of 48 tokens"),
        (head_config("MedusaModel"), {}, r"architecture \['MedusaModel'\] is not a eagle head"),
        (head_config("LlamaForCausalLMEagle"), {"fc.weight": None}, "lacks fc.weight"),
        (
            head_config("LlamaForCausalLMEagle"),
            {"layers.1.mlp.up_proj.weight": random(INTER, HIDDEN)},
            "'layers.1.mlp.up_proj.weight' has no place in the head",
        ),
    ],
)
def test_a_mismatched_eagle_checkpoint_is_refused(target, tmp_path, config, tensors, error):
    torch.manual_seed(7)
    saved = {
        name: t for name, t in (eagle_tensors() | tensors).items() if t is not None
    }  # fmt: skip
    head_dir = write_head(tmp_path, config, saved)
    with pytest.raises(ValueError, match=error):
        speculate(target, "eagle", head_dir)


def test_eagle3_layers_the_target_lacks_are_refused(target, tmp_path):
    config = head_config(
        "LlamaForCausalLMEagle3", eagle_aux_hidden_state_layer_ids=[1, 2, 4], draft_vocab_size=16
    )
    head_dir = write_head(tmp_path, config, eagle3_tensors())
    with pytest.raises(ValueError, match=r"\[1, 2, 4\] do not name three"):
        speculate(target, "eagle3", head_dir)
