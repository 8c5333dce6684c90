"""Tokenizer built from the GGUF metadata: encoding parity with transformers'
GGUF tokenizer, round trips, the chat template, and incremental detokenisation
that never splits a UTF-8 character."""
import os

import pytest

from shepherd.model.loader import ModelNotFoundError, load_tokenizer
from shepherd.model.tokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello, world!",
    "  leading spaces and   runs   of spaces\n\n\tand tabs",
    "Numbers 1234567890 and 3.14159, dates 2024-01-31.",
    "émigré naïve café — “quotes” ‘single’ …",
    "emoji 😀👍🏽🇫🇷 family 👨‍👩‍👧 and CJK 中文字符 日本語 한국어",
    "code: def f(x):\n    return x ** 2  # comment",
    "<|im_start|>user\nhi<|im_end|>",
    "mixed<|im_end|>special tokens<|endoftext|>",
    "",
]


@pytest.fixture(scope="module")
def tok(default_model_path):
    return load_tokenizer(default_model_path)


def test_attributes(tok):
    assert tok.vocab_size == 49152
    assert tok.eos_token_ids == (2,)          # <|im_end|>
    assert tok.bos_token_id == 1
    assert tok.id_to_token(2) == "<|im_end|>"
    assert "SmolLM2" in tok.name or "smollm2" in tok.name.lower()


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert all(0 <= i < tok.vocab_size for i in ids)


def test_special_tokens_are_single_ids_and_skippable(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_digits_split_individually(tok):
    # SmolLM's pre-tokenizer splits every digit (llama.cpp 'smollm' pre type)
    ids = tok.encode("12345")
    assert len(ids) == 5


def test_matches_transformers_gguf_tokenizer(tok, default_model_path):
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(os.path.dirname(default_model_path),
                                                     gguf_file=os.path.basename(default_model_path))
    for text in TEXTS:
        assert tok.encode(text) == ref.encode(text, add_special_tokens=False), text


def test_chat_template(tok):
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    s = tok.apply_chat_template(msgs)
    assert s == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                 "<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    s2 = tok.apply_chat_template([{"role": "system", "content": "Be brief."}] + msgs, add_generation_prompt=False)
    assert s2 == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
    ids = tok.encode(s)
    assert ids[0] == 1 and ids.count(2) == 2


def test_chat_template_is_sandboxed(tok):
    from shepherd.model.tokenizer import Tokenizer
    evil = Tokenizer(tok.hf, name="x", eos_token_ids=[2], bos_token_id=1,
                     chat_template="{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(Exception):
        evil.apply_chat_template([{"role": "user", "content": "x"}])


def _stream(tok, ids, **kw):
    d = IncrementalDetokenizer(tok, **kw)
    deltas = [d.push(i) for i in ids]
    deltas.append(d.flush())
    return deltas


@pytest.mark.parametrize("text", [t for t in TEXTS if t])
def test_incremental_detok_equals_full_decode(tok, text):
    ids = tok.encode(text)
    deltas = _stream(tok, ids, skip_special_tokens=False)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=False) == text
    for d in deltas:
        assert "\ufffd" not in d


def test_incremental_detok_never_splits_multibyte(tok):
    text = "😀👍🏽🇫🇷👨‍👩‍👧中文字符"
    ids = tok.encode(text)
    # the test means something only if some tokens are partial UTF-8 sequences
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    d = IncrementalDetokenizer(tok)
    out = ""
    for i in ids:
        delta = d.push(i)
        assert "\ufffd" not in delta
        delta.encode("utf-8")          # a complete, encodable string
        out += delta
        assert text.startswith(out)
    out += d.flush()
    assert out == text


def test_incremental_detok_with_prompt_context_and_skip_special(tok):
    prompt = tok.encode("<|im_start|>assistant\n")
    gen = tok.encode("Bonjour, ça va? 😀") + [2]
    d = IncrementalDetokenizer(tok, skip_special_tokens=True, prompt_ids=prompt)
    out = "".join(d.push(i) for i in gen) + d.flush()
    assert out == "Bonjour, ça va? 😀"


def test_a_character_cut_in_the_middle_is_dropped_at_the_end(tok):
    """A reply cut by max_tokens inside a character ends on the characters before it (vLLM's
    decode stream leaves it so), not on U+FFFD; what came before it is all there."""
    ids = tok.encode("ok 😀")
    assert "\ufffd" in tok.decode(ids[:-1])           # the emoji takes more than one token
    d = IncrementalDetokenizer(tok)
    out = "".join(d.push(i) for i in ids[:-1]) + d.flush()
    assert out == "ok "


def test_missing_model_is_a_clear_error(tmp_path):
    with pytest.raises(ModelNotFoundError) as e:
        load_tokenizer(str(tmp_path / "nope.gguf"))
    assert "does not exist" in str(e.value)
    assert isinstance(e.value, ValueError)


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    import json

    from shepherd.model.loader import UnsupportedArchitectureError, load_model
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(UnsupportedArchitectureError) as e:
        load_model(str(tmp_path))
    assert "not supported" in str(e.value) and "GPT2LMHeadModel" in str(e.value)


def test_folder_without_weights_is_a_clear_error(tmp_path, tok):
    import json

    from shepherd.model.loader import ModelLoadError, load_model
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2}))
    tok.save_hf(str(tmp_path))
    with pytest.raises(ModelLoadError) as e:
        load_model(str(tmp_path))
    assert "safetensors" in str(e.value)
