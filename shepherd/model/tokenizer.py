"""Tokenizer, chat template and incremental detokenizer.

Built with the `tokenizers` library, either from a GGUF file's vocabulary and
merges (byte-level BPE, `tokenizer.ggml.model == "gpt2"`) or from a Hugging
Face folder's tokenizer.json. The chat template is rendered with a sandboxed
jinja2 environment, as transformers does.
"""
from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Any, Iterable, Optional, Sequence

# Pre-tokenizer regexes for the byte-level BPE vocabularies llama.cpp knows,
# keyed by `tokenizer.ggml.pre` (see llama.cpp's llm_tokenizer_bpe).
_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+")


class TokenizerError(ValueError):
    """The tokenizer cannot be built from what the model files hold."""


def _raise_exception(message: str):
    from jinja2.exceptions import TemplateError
    raise TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class Tokenizer:
    """A thin wrapper over a `tokenizers.Tokenizer` with the model's special tokens
    and chat template."""

    def __init__(self, hf_tokenizer, *, name: str, eos_token_ids: Sequence[int],
                 bos_token_id: Optional[int], chat_template: Optional[str] = None,
                 add_bos_token: bool = False, pad_token_id: Optional[int] = None):
        self._tok = hf_tokenizer
        self.name = name
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self.bos_token_id = bos_token_id
        self.pad_token_id = pad_token_id
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token
        self.vocab_size: int = hf_tokenizer.get_vocab_size(with_added_tokens=True)
        self._template = None
        self.special_ids: frozenset[int] = frozenset(
            i for i, t in hf_tokenizer.get_added_tokens_decoder().items() if t.special)

    # ---- basic -------------------------------------------------------------
    @property
    def hf(self):
        """The underlying `tokenizers.Tokenizer`."""
        return self._tok

    @property
    def eos_token(self) -> Optional[str]:
        return self.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else None

    @property
    def bos_token(self) -> Optional[str]:
        return self.id_to_token(self.bos_token_id) if self.bos_token_id is not None else None

    def id_to_token(self, token_id: int) -> Optional[str]:
        return self._tok.id_to_token(int(token_id))

    def token_to_id(self, token: str) -> Optional[int]:
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def __len__(self) -> int:
        return self.vocab_size

    # ---- chat --------------------------------------------------------------
    def set_chat_template(self, text: Optional[str]) -> None:
        """Replace the model's chat template (e.g. --chat-template FILE)."""
        self.chat_template = text
        self._template = None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render `messages` with the model's chat template (jinja2, sandboxed)."""
        if not self.chat_template:
            raise TokenizerError(
                f"model {self.name!r} has no chat template; use /v1/completions with a plain prompt")
        ctx = dict(bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        ctx.update(kwargs)
        return self.warm_chat_template().render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                **ctx)

    def warm_chat_template(self) -> Any:
        """The compiled chat template (None without one), built on the first call. A server calls
        this at start: built by the first chat request instead, importing jinja2 and compiling
        the template held its event loop (every stream and /health) for 0.16-0.79 s through Ray
        Serve on this 2-core machine. Raises jinja2's TemplateError for a template that does not
        compile."""
        if self._template is None and self.chat_template:
            from jinja2.sandbox import ImmutableSandboxedEnvironment
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = _strftime_now
            self._template = env.from_string(self.chat_template)
        return self._template

    # ---- construction ----------------------------------------------------------
    @classmethod
    def from_gguf_fields(cls, fields: dict, name: str) -> "Tokenizer":
        """Build from GGUF tokenizer metadata (`fields`: key -> python value)."""
        from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, Regex

        model = fields.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise TokenizerError(
                f"GGUF tokenizer model {model!r} is not supported (only byte-level BPE, 'gpt2'); "
                "use a Hugging Face folder with tokenizer.json instead")
        tokens: list[str] = list(fields["tokenizer.ggml.tokens"])
        types = list(fields.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        merges_raw = list(fields.get("tokenizer.ggml.merges") or [])
        merges = []
        for m in merges_raw:
            a, _, b = m.partition(" ")
            merges.append((a, b))
        vocab = {t: i for i, t in enumerate(tokens)}
        bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
        tok = HFTokenizer(bpe)
        pre = fields.get("tokenizer.ggml.pre", "default")
        if pre in ("llama-bpe", "llama3", "falcon3", "smaug-bpe", "dbrx"):
            regex = _LLAMA3_RE
        elif pre in ("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"):
            regex = _QWEN2_RE
        else:
            regex = None
        if regex is not None:
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ])
        elif pre in ("smollm", "starcoder", "refact", "codeshell", "exaone"):
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ])
        else:  # gpt2 / default
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        # control (3) and user-defined (4) tokens are matched whole, before BPE
        added = []
        for i, (t, ty) in enumerate(zip(tokens, types)):
            if ty in (3, 4):
                added.append(AddedToken(t, special=(ty == 3), normalized=False))
        if added:
            tok.add_special_tokens([a for a in added if a.special])
            tok.add_tokens([a for a in added if not a.special])

        def _get(key):
            v = fields.get(key)
            return int(v) if v is not None else None

        eos = [i for i in (_get("tokenizer.ggml.eos_token_id"), _get("tokenizer.ggml.eot_token_id"),
                           _get("tokenizer.ggml.eom_token_id")) if i is not None]
        return cls(tok, name=name, eos_token_ids=eos, bos_token_id=_get("tokenizer.ggml.bos_token_id"),
                   chat_template=fields.get("tokenizer.chat_template"),
                   add_bos_token=bool(fields.get("tokenizer.ggml.add_bos_token", False)),
                   pad_token_id=_get("tokenizer.ggml.padding_token_id"))

    @classmethod
    def from_hf_folder(cls, folder: str, name: Optional[str] = None) -> "Tokenizer":
        from tokenizers import Tokenizer as HFTokenizer

        tj = os.path.join(folder, "tokenizer.json")
        if not os.path.exists(tj):
            raise TokenizerError(f"{folder}: no tokenizer.json (a fast tokenizer file is required)")
        tok = HFTokenizer.from_file(tj)
        tok.no_padding()
        tok.no_truncation()
        cfg: dict = {}
        tcp = os.path.join(folder, "tokenizer_config.json")
        if os.path.exists(tcp):
            with open(tcp) as f:
                cfg = json.load(f)
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        jinja = os.path.join(folder, "chat_template.jinja")
        if template is None and os.path.exists(jinja):
            with open(jinja) as f:
                template = f.read()

        def _tok_str(v):
            if isinstance(v, dict):
                return v.get("content")
            return v

        def _id(v):
            s = _tok_str(v)
            return tok.token_to_id(s) if s else None

        eos_ids: list[int] = []
        gen = os.path.join(folder, "generation_config.json")
        model_cfg = os.path.join(folder, "config.json")
        for p in (gen, model_cfg):
            if os.path.exists(p):
                with open(p) as f:
                    e = json.load(f).get("eos_token_id")
                if isinstance(e, int):
                    eos_ids.append(e)
                elif isinstance(e, list):
                    eos_ids.extend(int(x) for x in e)
        e = _id(cfg.get("eos_token"))
        if e is not None:
            eos_ids.insert(0, e)
        return cls(tok, name=name or os.path.basename(os.path.normpath(folder)), eos_token_ids=eos_ids,
                   bos_token_id=_id(cfg.get("bos_token")), chat_template=template,
                   add_bos_token=bool(cfg.get("add_bos_token", False)),
                   pad_token_id=_id(cfg.get("pad_token")))

    def save_hf(self, out_dir: str) -> None:
        """Write tokenizer.json and tokenizer_config.json (with the chat template)."""
        os.makedirs(out_dir, exist_ok=True)
        self._tok.save(os.path.join(out_dir, "tokenizer.json"))
        added = {str(i): {"content": t.content, "lstrip": t.lstrip, "rstrip": t.rstrip,
                          "normalized": t.normalized, "single_word": t.single_word, "special": t.special}
                 for i, t in self._tok.get_added_tokens_decoder().items()}
        cfg = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": self.add_bos_token,
            "add_prefix_space": False,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": self.id_to_token(self.pad_token_id) if self.pad_token_id is not None else self.eos_token,
            "unk_token": None,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 1000000000,
            "added_tokens_decoder": added,
        }
        if self.chat_template:
            cfg["chat_template"] = self.chat_template
        with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
            json.dump(cfg, f, indent=2, ensure_ascii=False)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas without ever splitting a
    UTF-8 character: text that ends in U+FFFD (an incomplete byte sequence) is
    held back until the following tokens complete it (or until flush())."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True,
                 prompt_ids: Optional[Sequence[int]] = None):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""          # all text emitted so far
        # A few context tokens from the prompt let a window start mid-word correctly.
        if prompt_ids:
            ctx = list(prompt_ids[-4:])
            self.ids.extend(ctx)
            self.prefix_offset = 0
            self.read_offset = len(ctx)
            # never let a context window begin inside a multi-byte character
            while self.prefix_offset < self.read_offset and \
                    self._decode(self.ids[self.prefix_offset:self.read_offset]).startswith("\ufffd"):
                self.prefix_offset += 1

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """Emit whatever is held back, at the request's end, less a last character the tokens left
        incomplete (it decodes as U+FFFD): a reply cut by max_tokens in the middle of a character
        then ends on the characters before it, a prefix of what the model was writing, as vLLM's
        decode stream leaves it (a JSON string cut there read as "...\ufffd" before)."""
        if self.read_offset >= len(self.ids):
            return ""
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        delta = new_text[len(prefix_text):] if new_text.startswith(prefix_text) else new_text
        if delta.endswith("\ufffd"):
            delta = delta[:-1]
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta
