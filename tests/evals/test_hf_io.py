"""The run's tokenizer and the HF export: real ``tokenizers`` training, real
``save_pretrained`` / ``from_pretrained`` round trips (local files only)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.fresh_python import run_python
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from stages.errors import ErrorCode, ItoError
from stages.hf import export_hf, load_tokenizer, save_tokenizer, train_tokenizer
from stages.model.lm import build_model
from stages.model.tokenizer import ByteTokenizer
from stages.presets import load_model_preset

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


def test_the_drivers_bpe_folder_loads_like_save_pretrained_and_encodes_the_same(
    tmp_path: Path,
) -> None:
    """The driver saves the run's BPE with ``tokenizers`` alone (``stages.hf.bpe``): the
    folder loads as the same fast tokenizer as ``save_pretrained``'s (ids, specials,
    length, chat template, the SFT assistant mask), and its encoder gives the ids the
    wrapped tokenizer gives."""
    from stages.hf.bpe import BPEEncoder, save_bpe, train_bpe

    bpe = train_bpe(TEXTS, vocab_size=320)
    save_bpe(bpe, tmp_path / "driver", model_max_length=256)
    save_tokenizer(train_tokenizer(TEXTS, vocab_size=320, model_max_length=256), tmp_path / "hf")
    ours, ref = load_tokenizer(tmp_path / "driver"), load_tokenizer(tmp_path / "hf")
    assert ours.get_vocab() == ref.get_vocab() and len(ours) == 320
    text = "def function_7(x):\n    return x * 7 + <|eos|> café\n"
    for special in (True, False):
        assert (
            ours(text, add_special_tokens=special)["input_ids"]
            == ref(text, add_special_tokens=special)["input_ids"]
        )
    assert [ours.pad_token_id, ours.bos_token_id, ours.eos_token_id, ours.unk_token_id] == [
        ref.pad_token_id,
        ref.bos_token_id,
        ref.eos_token_id,
        ref.unk_token_id,
    ]
    assert ours.model_max_length == ref.model_max_length == 256
    chat = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    assert ours.apply_chat_template(
        chat, return_dict=True, return_assistant_tokens_mask=True
    ) == ref.apply_chat_template(chat, return_dict=True, return_assistant_tokens_mask=True)
    enc = BPEEncoder(bpe)
    assert enc.vocab_size == 320
    assert enc.encode(text) == [*ref(text, add_special_tokens=False)["input_ids"], ref.eos_token_id]


def test_the_drivers_data_path_imports_neither_torch_nor_transformers(tmp_path: Path) -> None:
    """What a run's driver runs (the pipeline, data prep with the ladder probe's
    orchestration, the engine that supervises the fleet, the phase data: tokenizer
    training, token shards, the held-out split, the phase-end reduction and the gate
    decision) never imports torch or transformers: the driver coordinates, the ranks
    compute (the probe's proxies too)."""
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS), encoding="utf-8")
    code = (
        "import sys, json\n"
        "from pathlib import Path\n"
        "import orchestrator.runtime.driver, orchestrator.runtime.pipeline\n"
        "import stages.trainer.fleet.engine, stages.trainer.phases, stages.trainer.stage\n"
        "from stages.trainer.rank.phase_data import prepare_phase_data\n"
        "from stages.trainer.phase_eval import PhaseEvalRequest\n"
        "from stages.evals.heldout import HeldoutSums, reduce_sums\n"
        "from stages.evals import BatteryResult, GateDecision, evaluate_gates\n"
        "import stages.data_prep.stage, stages.data_prep.ladder, stages.data_prep.ladder_ranks\n"
        f"src, out = Path({str(src)!r}), Path({str(tmp_path / 'work')!r})\n"
        "for vocab in (260, 300):\n"
        "    d = prepare_phase_data({'baseline': [src]}, out / str(vocab), text_field='text',\n"
        "        vocab_size=vocab, permille=100, min_docs=4)\n"
        "    assert d.role_shards['baseline'] and d.heldout_texts\n"
        "reduce_sums([HeldoutSums(batch_nats={0: 1.0}, tokens=2, bytes=3.0)])\n"
        "print(json.dumps(sorted(m for m in ('torch', 'transformers') if m in sys.modules)))\n"
    )
    assert run_python(code) == []
    # The shards it wrote train: the BPE folder loads for the ranks.
    assert len(load_tokenizer(tmp_path / "work" / "300" / "tokenizer")) == 300


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
    from stages.model.lm import set_rope_theta

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


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_export_streamed_from_a_sealed_checkpoint_is_what_save_pretrained_writes(
    tmp_path: Path, tied: bool
) -> None:
    """A phase's export comes from its closing DCP checkpoint a shard at a time: it
    reloads with ``from_pretrained`` to the same logits, with the config, generation
    config and tensors ``save_pretrained`` writes, and no load reads more than a shard."""
    from safetensors.torch import load_file

    from stages.checkpointing import Checkpointer, CheckpointPolicy
    from stages.checkpointing.seal import CheckpointBinding, seal_key
    from stages.checkpointing.sealed import SealedCheckpoint
    from stages.hf.export import export_hf_from_checkpoint
    from stages.model.lm import llama_config, set_config_rope_theta, set_rope_theta

    # Tied: the post-training policies' embeddings, which save_pretrained writes once.
    preset = load_model_preset("llama-tiny").model_copy(update={"tie_word_embeddings": tied})
    model = build_model(preset, seed=3)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    set_rope_theta(model, 22081.79)  # a long-context phase's base travels with it
    tok = train_tokenizer(TEXTS, vocab_size=260)
    policy = CheckpointPolicy(interval_steps=1, storage_uri=f"file://{tmp_path / 'ckpt'}")
    with Checkpointer(policy, async_staging=False) as ck:
        ck.save(5, {"train": {"model": model.state_dict(), "step": 5}})
        record = ck.wait()
    assert record is not None
    ref = export_hf(model, tok, tmp_path / "ref")

    class Counted(SealedCheckpoint):
        loads: list[int] = []

        def load(self, state_dict: dict[str, object], **kw: object) -> None:
            self.loads.append(sum(t.nbytes for t in state_dict.values()))  # type: ignore[attr-defined]
            super().load(state_dict)

    config = llama_config(preset)
    set_config_rope_theta(config, 22081.79)
    shard_bytes = 40_000  # llama-tiny's 20-21 tensors in several shards
    ckpt = Counted(Path(record.path), seal_key(), CheckpointBinding())
    out = export_hf_from_checkpoint(
        ckpt, config, tok, tmp_path / "export", metadata={"step": 5}, shard_bytes=shard_bytes
    )
    assert not list(tmp_path.glob(".export.tmp-*"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) == len(ckpt.loads) > 2
    biggest = max(p.numel() * 4 for p in model.parameters())
    assert max(ckpt.loads) <= max(shard_bytes, biggest)
    streamed = {k: v for f in files for k, v in load_file(str(out / f)).items()}
    saved = load_file(str(ref / "model.safetensors"))
    assert streamed.keys() == saved.keys()
    assert all(torch.equal(streamed[k], saved[k]) for k in saved)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in saved.values())
    for name in ("config.json", "generation_config.json"):
        assert json.loads((out / name).read_text()) == json.loads((ref / name).read_text())
    meta = json.loads((out / "ito_export.json").read_text())
    assert meta["step"] == 5 and "tokenizer.json" in meta["files"]

    loaded = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    ids = torch.tensor([tok("return x * 7 + the_answer")["input_ids"]])
    model.eval()
    loaded.eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, loaded(input_ids=ids).logits)
    # A checkpoint of another shape is refused with its code, and nothing is left behind.
    config.num_hidden_layers += 1
    with pytest.raises(ItoError) as e:
        export_hf_from_checkpoint(ckpt, config, tok, tmp_path / "other")
    assert e.value.code == ErrorCode.checkpoint_corrupt
    assert not (tmp_path / "other").exists() and not list(tmp_path.glob(".other.tmp-*"))
