"""The run's tokenizer and the HF export: real ``tokenizers`` training, real
``save_pretrained`` / ``from_pretrained`` round trips (local files only)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from stages.errors import ErrorCode, ItoError
from stages.hf import export_hf, load_tokenizer, save_tokenizer, train_tokenizer
from stages.presets import load_model_preset
from stages.trainer.model import build_model
from stages.trainer.tokenizer import ByteTokenizer

TEXTS = [f"def function_{i}(x):\n    return x * {i} + the_answer  # café\n" for i in range(200)]


def test_byte_vocab_tokenizer_matches_the_byte_tokenizer_ids() -> None:
    tok = train_tokenizer(TEXTS, vocab_size=260)
    assert isinstance(tok, PreTrainedTokenizerFast)
    assert len(tok) == 260
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (
        256,
        257,
        258,
        259,
    )
    text = "Hello, wörld!\n  12 + 30 = 42 ✓"
    assert tok(text, add_special_tokens=False)["input_ids"] == ByteTokenizer().encode(
        text, eos=False
    )
    assert tok.decode(tok(text)["input_ids"]) == text


def test_trained_bpe_learns_merges_keeps_the_byte_layout_and_round_trips(tmp_path: Path) -> None:
    tok = train_tokenizer(TEXTS, vocab_size=320)
    assert len(tok) == 320
    text = "def function_7(x):\n    return x * 7 + the_answer  # café\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) < len(text.encode())  # merges were learned and used
    assert max(ids) >= 260
    assert tok.convert_ids_to_tokens(ord("A")) == "A"  # bytes keep their ids
    assert tok.decode(ids) == text
    # Deterministic: the same texts give the same vocabulary.
    assert train_tokenizer(TEXTS, vocab_size=320).get_vocab() == tok.get_vocab()

    save_tokenizer(tok, tmp_path / "tok")
    again = AutoTokenizer.from_pretrained(str(tmp_path / "tok"), local_files_only=True)
    assert again(text)["input_ids"] == tok(text)["input_ids"]
    assert again.pad_token == "<|pad|>" and again.eos_token == "<|eos|>"
    chat = again.apply_chat_template(
        [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}], tokenize=False
    )
    assert chat == "<|bos|>user\n2+2?<|eos|><|bos|>assistant\n4<|eos|>"
    prompt = again.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|bos|>assistant\n")


def test_vocab_below_bytes_and_specials_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ItoError) as e:
        train_tokenizer(TEXTS, vocab_size=100)
    assert e.value.code == ErrorCode.tokenizer_invalid
    with pytest.raises(ItoError) as e:
        load_tokenizer(tmp_path)
    assert e.value.code == ErrorCode.tokenizer_invalid


def test_export_reloads_with_from_pretrained_and_gives_the_same_logits(tmp_path: Path) -> None:
    model = build_model(load_model_preset("llama-tiny"), seed=3)
    with torch.no_grad():  # not just the init: perturb so a silent re-init would show
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    tok = train_tokenizer(TEXTS, vocab_size=260)
    out = export_hf(model, tok, tmp_path / "export", metadata={"phase": "pretrain", "step": 7})
    meta = json.loads((out / "ito_export.json").read_text())
    assert meta["phase"] == "pretrain" and meta["step"] == 7
    assert "model.safetensors" in meta["files"] and "tokenizer.json" in meta["files"]
    assert not list(tmp_path.glob(".export.tmp-*"))

    loaded = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    tok2 = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    ids = torch.tensor([tok2("return x * 7 + the_answer")["input_ids"]])
    model.eval()
    loaded.eval()
    with torch.no_grad():
        a = model(input_ids=ids).logits
        b = loaded(input_ids=ids).logits
    assert torch.equal(a, b)
    # A long-context phase's scaled RoPE base travels with the export.
    from stages.trainer.model import set_rope_theta

    set_rope_theta(model, 22081.79)
    out2 = export_hf(model, tok, tmp_path / "long")
    loaded2 = AutoModelForCausalLM.from_pretrained(str(out2), local_files_only=True).eval()
    with torch.no_grad():
        c = model(input_ids=ids).logits
        assert not torch.equal(a, c)
        assert torch.equal(c, loaded2(input_ids=ids).logits)
    # Exporting again replaces the folder atomically.
    export_hf(model, tok, out, metadata={"phase": "long_context", "step": 9})
    assert json.loads((out / "ito_export.json").read_text())["phase"] == "long_context"
