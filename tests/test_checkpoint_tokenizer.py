"""A checkpoint's own tokenizer (engine.models.tokens), read from its folder's tokenizer.json or
its GGUF file, held to transformers' AutoTokenizer on the same files.

The checkpoint: a small random ``Qwen2ForCausalLM`` (a family with no tokenizer of its own here)
saved with a byte-level BPE trained in the test -- Qwen2's normalizer and split, as its tokenizer
class imposes them in transformers 5 --, whose post-processor adds a BOS and whose chat template
writes the BOS too (as Llama-3's does), plus a SentencePiece-style (Metaspace) one.
Bugs seen to fail: the folder's tokenizer not read (a Qwen2 folder then has none), the BOS
doubled on a chat prompt (its rendering opens with it), the post-processor skipped on plain text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from transformers import AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from engine import families

pytestmark = pytest.mark.timeout(600)
SPECIAL = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
          "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
          "{% endif %}")
CORPUS = ["The KV cache stores the keys and values of every token seen so far.",
          "A sliding window keeps only the last few rows; memory stays flat past it.",
          "Ça coûte 5 € ! naïve café, x² and 3.14159 -- numbers 1, 22, 333."] * 20
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
               r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
NUMBERS = ["In 1234567 of 2024's 1999 runs, 123 456 7890 and 31415926 it'll say they're 12."] * 40
TEXTS = ["The cache stores keys.", "naïve café: 3.14 €", "  two  spaces\nand a line",
         "<|im_start|>user\nhi<|im_end|>"]


def _trained(kind: str) -> Tokenizer:
    """A BPE of ~400 tokens: byte-level (Qwen2's split, BOS added by the post-processor), plain
    byte-level (GPT-2's regex, so digits and contractions merge: what a GGUF's pre-tokenizer
    must then split as llama.cpp does), or SentencePiece-style (Metaspace)."""
    tok = Tokenizer(models.BPE())
    if kind == "plain":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.train_from_iterator(CORPUS + NUMBERS, trainers.BpeTrainer(
            vocab_size=400, special_tokens=SPECIAL,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        return tok
    if kind == "byte":  # Qwen2's own normalizer and split, which its tokenizer class imposes
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        alphabet = []
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL, initial_alphabet=alphabet))
    if kind == "byte":
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return tok


def _folder(tmp: Path, kind: str, vocab_size: int = 512) -> Path:
    folder = tmp / kind
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=True)).save_pretrained(folder)
    fast = PreTrainedTokenizerFast(tokenizer_object=_trained(kind), bos_token="<s>",
                                   eos_token="<|im_end|>")
    fast.chat_template = CHATML
    fast.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def byte_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _folder(tmp_path_factory.mktemp("ckpt"), "byte")


def test_a_folders_tokenizer_encodes_as_transformers_does(byte_folder: Path) -> None:
    ref = AutoTokenizer.from_pretrained(byte_folder)
    state = families.load(str(byte_folder))
    ours = families.tokenizer(state)  # the model's checkpoint, found from its provenance
    assert ours.name == "byte/tokenizer.json" and ours.eos_id == ref.eos_token_id
    for text in TEXTS:
        want = ref(text)["input_ids"]
        assert want[0] == ref.bos_token_id  # the post-processor's BOS
        assert ours.encode(text) == want, text
        assert ours.decode(want) == ref.decode(want)
        assert b"".join(map(ours.token_bytes, want)).decode() == ref.decode(want)
        assert len(ours.decode_each(want)) == len(want)
    messages = [{"role": "user", "content": "Name a use of a KV cache."}]
    # transformers 5 saves the template beside tokenizer_config.json: read from there
    assert "chat_template" not in json.loads((byte_folder / "tokenizer_config.json").read_text())
    assert (byte_folder / "chat_template.jinja").is_file()
    assert families.preset(str(byte_folder)).chat  # the pages offer its chat template
    rendered = ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ours.chat("Name a use of a KV cache.") == rendered
    want = ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                   return_dict=False)
    ids = ours.encode(rendered)
    assert ids == list(want) and ids.count(ref.bos_token_id) == 1  # one BOS, not two


def test_a_sentencepiece_style_tokenizer_reads_back_per_token(tmp_path: Path) -> None:
    folder = _folder(tmp_path, "metaspace")
    # read as the file says (AutoTokenizer would impose Qwen2's byte-level split on it)
    ref = PreTrainedTokenizerFast.from_pretrained(folder)
    ours = families.tokenizer(families.config(str(folder)), str(folder))
    for text in TEXTS[:3]:
        want = ref(text)["input_ids"]
        assert ours.encode(text) == want, text
        assert ours.decode(want) == ref.decode(want)
        # SentencePiece drops the word marker of the first token only
        assert b"".join(map(ours.token_bytes, want)).decode().removeprefix(" ") == ref.decode(want)


def test_a_qwen2_folder_generates_from_text_through_the_cli(byte_folder: Path,
                                                            tmp_path: Path) -> None:
    """Without the folder's tokenizer a Qwen2 model has none here: the text-reading experiments
    (generation, the chat) now run on it, and the prompt's ids are transformers'."""
    from instruments import cli
    from instruments.store.results import load_runs

    ref = AutoTokenizer.from_pretrained(byte_folder)
    for argv in (["generation", "--prompt", TEXTS[0], "--new-tokens", "6"],
                 ["prefix_chat", "--turns", "1", "--answer-tokens", "4", "--repeats", "1"]):
        assert cli.main([*argv, "--model", str(byte_folder), "--results-dir", str(tmp_path),
                         "--no-progress"]) == 0, argv
    runs = {r["kind"]: r for r in load_runs(tmp_path).runs}
    assert runs["generation"]["meta"]["tokenizer"] == "byte/tokenizer.json"
    assert runs["generation"]["meta"]["prompt_tokens"] == len(ref(TEXTS[0])["input_ids"])
    turns = runs["prefix_chat"]["tables"]["turns"]
    assert turns and turns[0]["prompt_tokens"] == len(ref.apply_chat_template(
        [{"role": "user", "content": _first_turn()}], add_generation_prompt=True,
        tokenize=True, return_dict=False))


def _first_turn() -> str:
    from instruments.experiments.prefix.chat import USER_TURNS

    return USER_TURNS[0]


def test_a_gpt2_gguf_carries_its_tokenizer(tmp_path: Path) -> None:
    """gguf_out writes GPT-2's vocabulary and merges (pre-tokenizer "gpt-2"); loaded back as a
    path, the file's own tokenizer encodes as tiktoken does."""
    from engine.models.gpt2.tokenizer import encode
    from instruments.peers.gguf_out import write_gguf

    path = write_gguf(families.load("tiny").model, tmp_path / "tiny.gguf", "f32")
    state = families.load(str(path))
    tok = families.tokenizer(state)
    assert tok.name == "tiny.gguf's byte-level BPE"
    text = "The KV cache: 3.14159 naïve  café\n<|endoftext|>"
    assert tok.encode(text) == encode(text)


def test_bad_tokenizers_are_refused_naming_what_is_allowed(tmp_path: Path) -> None:
    small = _folder(tmp_path, "byte", vocab_size=300)  # 400 tokens for 300 rows
    with pytest.raises(ValueError, match="at most the model's rows"):
        families.tokenizer(families.config(str(small)), str(small))
    (small / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer is not readable"):
        families.tokenizer(families.config(str(small)), str(small))
    (small / "tokenizer.json").unlink()  # none at all: the family's, and Qwen2 has none here
    assert not families.preset(str(small)).chat
    with pytest.raises(ValueError, match=r"no tokenizer here.*allowed: token-id prompts"):
        families.tokenizer(families.config(str(small)), str(small))



def _served(folder: Path) -> Any:
    """The HTTP server on ``folder`` (``tests.test_server.serving``): its URL."""
    pytest.importorskip("requests")
    for module in ("starlette", "uvicorn", "prometheus_client"):
        pytest.importorskip(module)
    from .test_server import serving

    return serving(str(folder))


def test_the_http_server_reads_text_with_the_checkpoints_tokenizer(byte_folder: Path) -> None:
    """A completion's and a chat's prompt are the folder tokenizer's ids (usage.prompt_tokens as
    transformers counts them)."""
    import requests

    ref = AutoTokenizer.from_pretrained(byte_folder)
    body = {"model": str(byte_folder), "max_tokens": 3, "temperature": 0}
    messages = [{"role": "user", "content": "hi"}]
    with _served(byte_folder) as url:
        r = requests.post(url + "/v1/completions", json={**body, "prompt": TEXTS[1]}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(ref(TEXTS[1])["input_ids"])
        r = requests.post(url + "/v1/chat/completions", json={**body, "messages": messages},
                          timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(ref.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def test_a_model_with_no_tokenizer_is_served_on_token_ids(tmp_path: Path) -> None:
    """A Qwen2 folder without tokenizer.json: the server starts, takes token ids, and answers a
    text prompt or a chat with a 400 saying why."""
    import requests

    folder = _folder(tmp_path, "byte")
    (folder / "tokenizer.json").unlink()
    body = {"model": str(folder), "max_tokens": 3, "temperature": 0}
    with _served(folder) as url:
        r = requests.post(url + "/v1/completions", json={**body, "prompt": [5, 6, 7]}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
        ids = r.json()["choices"][0]["text"].split()
        assert len(ids) == 3 and all(0 <= int(i) < 512 for i in ids)
        r = requests.post(url + "/v1/completions", json={**body, "prompt": "hi"}, timeout=60)
        assert r.status_code == 400 and "allowed: a prompt of token ids" in r.text, r.text
        r = requests.post(url + "/v1/chat/completions", json={
            **body, "messages": [{"role": "user", "content": "hi"}]}, timeout=60)
        assert r.status_code == 400 and "no chat template" in r.text, r.text


def _gguf_with_vocab(tmp: Path, folder: Path, pre: str) -> Path:
    """The folder's Qwen2 written as GGUF (``gguf_out``) with a plain byte-level BPE as its
    vocabulary and merges, under llama.cpp's pre-tokenizer name ``pre``."""
    import gguf

    from instruments.peers.gguf_out import file_fields, file_tensors, write_gguf

    base = write_gguf(families.load(str(folder)).model, tmp / "base.gguf", "f32")
    data = json.loads(_trained("plain").to_str())
    vocab = data["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    path = tmp / f"{pre}.gguf"
    w = gguf.GGUFWriter(str(path), "qwen2")
    for key, value, vtype, sub in file_fields(base):
        if not key.startswith("tokenizer.") and key != "general.architecture":
            w.add_key_value(key, value, vtype, sub)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in SPECIAL else gguf.TokenType.NORMAL
                       for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m)
                        for m in data["model"]["merges"]])
    w.add_bos_token_id(vocab["<s>"])
    w.add_eos_token_id(vocab["<|im_end|>"])
    for name, _, values in file_tensors(base):
        w.add_tensor(name, values)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe"])
def test_a_gguf_vocabulary_splits_as_llama_cpp_does(byte_folder: Path, tmp_path: Path,
                                                     pre: str) -> None:
    """A GGUF file's BPE under Qwen2's and Llama 3's pre-tokenizers: our ids are llama.cpp's own
    tokenizer's on the same file (Llama 3 keeps up to three digits together, Qwen2 one)."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="make peers builds llama.cpp")
    path = _gguf_with_vocab(tmp_path, byte_folder, pre)
    ours = families.tokenizer(families.load(str(path)))
    assert ours.name == f"{pre}.gguf's byte-level BPE"
    ref = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    for text in [*TEXTS, NUMBERS[0], "numbers 1234567 and 22 333, IT'S 'll"]:
        want = ref.tokenize(text.encode(), add_bos=False, special=True)
        assert ours.encode(text) == want, (pre, text)
