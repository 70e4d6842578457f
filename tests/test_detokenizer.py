import random
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from asyncllm.engine.detokenizer import IncrementalDetokenizer

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "stream",
    "token",
    "decode",
    "answer",
    "STOP",
    "stop",
    "hello",
    "world",
    "def",
    "return",
    "print",
    "café",
    "naïve",
    "über",
]
CJK = ["你好", "世界", "日本語", "テキスト", "한국어", "中文字符", "汉字"]
EMOJI = ["🎉", "🚀", "👍🏽", "👨‍👩‍👧", "🇫🇷", "😀", "🤖"]
PROPERTY_SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def corpus(n_lines: int = 300) -> list[str]:
    rng = random.Random(0)
    pool = WORDS + CJK + EMOJI + ["42", "3.14", "()", "{}", "\n", "STOP."]
    return [" ".join(rng.choices(pool, k=rng.randint(3, 12))) for _ in range(n_lines)]


def train_tiny_tokenizer(byte_level: bool) -> PreTrainedTokenizerFast:
    if byte_level:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        alphabet = []
    special = SPECIAL_TOKENS if byte_level else [*SPECIAL_TOKENS, "<unk>"]
    trainer = trainers.BpeTrainer(
        vocab_size=500, initial_alphabet=alphabet, special_tokens=special, show_progress=False
    )
    tok.train_from_iterator(corpus(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def load_smollm2() -> PreTrainedTokenizerBase:
    try:
        from asyncllm.model_files.model_path import resolve_model_path

        path = resolve_model_path(None)
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # the converted model is optional in this test run
        pytest.skip(f"SmolLM2 tokenizer unavailable ({type(exc).__name__}: {exc})")


@pytest.fixture(scope="session")
def tiny_bpe() -> PreTrainedTokenizerFast:
    return train_tiny_tokenizer(byte_level=True)


@pytest.fixture(scope="session", params=["tiny_bpe", "smollm2"])
def tokenizer(request: pytest.FixtureRequest) -> PreTrainedTokenizerBase:
    if request.param == "smollm2":
        return load_smollm2()
    return request.getfixturevalue("tiny_bpe")


def stream(
    detok: IncrementalDetokenizer,
    ids: Sequence[int],
    chunks: Sequence[int] = (),
    delta: bool = True,
) -> tuple[list[str], str | None]:
    """Feeds ids in chunks of the given sizes (1 by default); returns the emitted texts."""
    sizes = iter(chunks)
    outputs, i, stop = [], 0, None
    while i < len(ids) and stop is None:
        n = next(sizes, 1)
        stop = detok.update(ids[i : i + n])
        i += n
        outputs.append(detok.get_next_output_text(finished=stop is not None, delta=delta))
    if stop is None:
        outputs.append(detok.get_next_output_text(finished=True, delta=delta))
    return outputs, stop


def truncate_at_first_stop(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Reference: the first stop to complete, char by char; the longest if several complete."""
    for end in range(len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            stop = max(done, key=len)
            return text[: end if include else end - len(stop)], stop
    return text, None


def detokenize(
    tokenizer: PreTrainedTokenizerBase, text: str, prompt: str = "Q:", **kwargs
) -> tuple[str, str | None]:
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt), **kwargs)
    outputs, stop = stream(detok, tokenizer.encode(text))
    return "".join(outputs), stop


@PROPERTY_SETTINGS
@given(data=st.data(), skip_special_tokens=st.booleans())
def test_deltas_concatenate_to_full_decode_for_random_ids(
    tokenizer, data, skip_special_tokens: bool
) -> None:
    vocab = st.integers(0, len(tokenizer) - 1)
    prompt = data.draw(st.lists(vocab, max_size=6))
    ids = data.draw(st.lists(vocab, max_size=40))
    chunks = data.draw(st.lists(st.integers(1, 4), max_size=40))
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip_special_tokens)
    outputs, _ = stream(detok, ids, chunks)
    expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert "".join(outputs) == expected
    assert detok.output_text == expected


@pytest.mark.parametrize(
    "text",
    [
        "你好，世界！ 日本語のテキスト",
        "party 🎉🚀 time 👨‍👩‍👧 family 🇫🇷",
        "mixed: café 中文字符 👍🏽 done",
        "漢字🦀",
    ],
)
def test_multibyte_text_streams_one_token_at_a_time(tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say:"))
    outputs, _ = stream(detok, ids)
    assert "".join(outputs) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in out for out in outputs)


def test_characters_split_over_tokens_are_held_until_complete(tiny_bpe) -> None:
    ids = tiny_bpe.encode("漢🦀")  # rare characters fall back to several byte tokens
    detok = IncrementalDetokenizer(tiny_bpe, [])
    steps = [detok.update([i]) or detok.get_next_output_text(False, True) for i in ids]
    assert len(ids) > 2
    assert "" in steps
    assert "".join(steps) == "漢🦀"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_text_after_special_tokens(tokenizer, skip_special_tokens: bool) -> None:
    special = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    ids = tokenizer.encode("before 你好") + [special] + tokenizer.encode(" after 🎉")
    detok = IncrementalDetokenizer(tokenizer, [special], skip_special_tokens=skip_special_tokens)
    outputs, _ = stream(detok, ids)
    assert "".join(outputs) == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_prompt_text_never_leaks_into_output(tiny_bpe) -> None:
    ids = tiny_bpe.encode("hello 漢🦀 world")
    # the prompt ends in the middle of a character, so it cannot prime the stream as is
    for split in range(1, len(ids)):
        detok = IncrementalDetokenizer(tiny_bpe, ids[:split])
        outputs, _ = stream(detok, ids[split:])
        assert "".join(outputs) == tiny_bpe.decode(ids[split:])


def test_output_ending_mid_character_is_flushed_at_finish(tiny_bpe) -> None:
    ids = tiny_bpe.encode("ok 🦀")[:-1]
    detok = IncrementalDetokenizer(tiny_bpe, [])
    outputs, _ = stream(detok, ids)
    assert "".join(outputs) == tiny_bpe.decode(ids)
    assert outputs[-1].endswith("\ufffd")


def test_sentencepiece_style_first_token_keeps_its_leading_space() -> None:
    tokenizer = train_tiny_tokenizer(byte_level=False)
    prompt, output = tokenizer.encode("hello"), tokenizer.encode("world 你好")
    detok = IncrementalDetokenizer(tokenizer, prompt)
    outputs, _ = stream(detok, output)
    both = tokenizer.decode(prompt + output)
    assert "".join(outputs) == both[len(tokenizer.decode(prompt)) :] == " world 你好"


def test_stop_string_spanning_tokens_is_detected_and_not_emitted(tokenizer) -> None:
    text, stop = "the answer is 42 END_OF_ANSWER and more", "END_OF_ANSWER"
    ids = tokenizer.encode(text)
    assert not any(stop in tokenizer.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tokenizer, [], stop=[stop])
    outputs, found = stream(detok, ids)
    assert found == stop
    assert "".join(outputs) == "the answer is 42 "
    assert detok.output_text == "the answer is 42 "


def test_include_stop_str_in_output(tokenizer) -> None:
    text, found = detokenize(
        tokenizer, "hello world STOP. trailing", stop=["STOP"], include_stop_str_in_output=True
    )
    assert (text, found) == ("hello world STOP", "STOP")


def test_text_that_may_start_a_stop_string_is_withheld_until_finish(tiny_bpe) -> None:
    detok = IncrementalDetokenizer(tiny_bpe, [], stop=["STOP!"])
    assert detok.update(tiny_bpe.encode("hello ST")) is None
    assert detok.get_next_output_text(finished=False, delta=True) == "hell"
    assert detok.get_next_output_text(finished=True, delta=True) == "o ST"
    assert detok.output_text == "hello ST"


def test_withheld_text_is_released_once_it_cannot_start_a_stop(tiny_bpe) -> None:
    detok = IncrementalDetokenizer(tiny_bpe, [], stop=["STOP"])
    detok.update(tiny_bpe.encode("one STO"))
    assert detok.get_next_output_text(finished=False, delta=True) == "one "
    detok.update(tiny_bpe.encode("x two"))
    assert detok.get_next_output_text(finished=False, delta=True) == "STOx "


@pytest.mark.parametrize("chunk", [1, 100])
def test_earliest_stop_string_wins(tokenizer, chunk: int) -> None:
    detok = IncrementalDetokenizer(tokenizer, [], stop=["world", "hello"])
    outputs, found = stream(detok, tokenizer.encode("say hello to the world"), [chunk] * 100)
    assert ("".join(outputs), found) == ("say ", "hello")


def test_stop_string_that_completes_first_wins_within_one_update(tiny_bpe) -> None:
    detok = IncrementalDetokenizer(tiny_bpe, [], stop=["xyz", "y"])
    assert detok.update(tiny_bpe.encode("abxyz")) == "y"
    assert detok.get_next_output_text(finished=True, delta=True) == "abx"


def test_tokens_after_a_stop_are_ignored(tiny_bpe) -> None:
    detok = IncrementalDetokenizer(tiny_bpe, [], stop=["STOP"])
    assert detok.update(tiny_bpe.encode("a STOP b")) == "STOP"
    assert detok.update(tiny_bpe.encode(" more")) is None
    assert detok.output_text == "a "


def test_delta_false_returns_the_cumulative_text(tokenizer) -> None:
    ids = tokenizer.encode("hello world, 你好 🎉 END")
    detok = IncrementalDetokenizer(tokenizer, [], stop=["END"])
    outputs, found = stream(detok, ids, delta=False)
    assert found == "END"
    assert outputs[-1] == "hello world, 你好 🎉 "
    assert all(b.startswith(a) for a, b in zip(outputs, outputs[1:], strict=False))


@PROPERTY_SETTINGS
@given(data=st.data(), include_stop=st.booleans())
def test_streamed_text_matches_truncating_the_full_text(tiny_bpe, data, include_stop) -> None:
    alphabet = st.sampled_from(list("ab 你🎉"))
    text = data.draw(st.text(alphabet, max_size=30))
    stops = data.draw(st.lists(st.text(alphabet, min_size=1, max_size=4), max_size=3))
    chunks = data.draw(st.lists(st.integers(1, 4), max_size=30))
    ids = tiny_bpe.encode(text)
    detok = IncrementalDetokenizer(
        tiny_bpe, [], stop=stops, include_stop_str_in_output=include_stop
    )
    outputs, found = stream(detok, ids, chunks)
    expected, expected_stop = truncate_at_first_stop(text, stops, include_stop)
    assert (found, "".join(outputs)) == (expected_stop, expected)
