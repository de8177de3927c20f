"""The trainer's own Llama against transformers' LlamaForCausalLM: the same weights
give bit-identical logits and gradients, HF folders load to HF's logits, what it is
not is refused with a code, and a rank importing the trainer imports no transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.fresh_python import run_python
from transformers import AutoModelForCausalLM

from stages.errors import ErrorCode, ItoError
from stages.hf.view import as_hf
from stages.model.llama import Llama, load_hf_folder
from stages.model.lm import build_model, causal_lm_loss, set_rope_theta
from stages.presets import load_model_preset


def _ids(seed: int, shape: tuple[int, int] = (4, 32), vocab: int = 260) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def test_a_preset_model_computes_what_transformers_computes_bit_for_bit() -> None:
    model = build_model(load_model_preset("llama-tiny"), seed=1)
    hf = as_hf(model)  # transformers' class over the same parameters
    assert type(hf).__name__ == "LlamaForCausalLM"
    assert all(a is b for a, b in zip(model.parameters(), hf.parameters(), strict=True))
    ids = _ids(0)
    mask = torch.ones_like(ids)
    mask[1, 20:] = 0  # right padding, as the SFT and DPO batches pad
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, hf(input_ids=ids).logits)
        ours = model(input_ids=ids, attention_mask=mask).logits
        theirs = hf(input_ids=ids, attention_mask=mask).logits
        assert torch.equal(ours, theirs)
        assert not torch.equal(ours, model(input_ids=ids).logits)  # the mask is applied
    grads = []
    for m in (model, hf):
        model.zero_grad()
        causal_lm_loss(m, ids).backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert len(grads[0]) == len(list(model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_a_changed_rope_base_reaches_the_rotary_module_and_the_hf_config() -> None:
    model = build_model(load_model_preset("llama-tiny"), seed=1)
    ids = _ids(1)
    with torch.no_grad():
        before = model(input_ids=ids).logits
        set_rope_theta(model, 22081.79)
        after = model(input_ids=ids).logits
        assert not torch.equal(before, after)
        hf = as_hf(model)
        assert hf.config.rope_parameters["rope_theta"] == pytest.approx(22081.79)
        assert torch.equal(after, hf(input_ids=ids).logits)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_an_hf_folder_loads_to_transformers_logits(tmp_path: Path, tied: bool) -> None:
    from stages.hf import export_hf, train_tokenizer

    tok = train_tokenizer([f"say {i} " * 4 for i in range(50)], vocab_size=260)
    preset = load_model_preset("llama-tiny").model_copy(update={"tie_word_embeddings": tied})
    folder = export_hf(build_model(preset, seed=2), tok, tmp_path / "hf")
    ours = load_hf_folder(folder)
    theirs = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True)
    assert isinstance(ours, Llama)
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tied
    assert all(p.dtype == torch.float32 for p in ours.parameters())
    ids = _ids(2)
    with torch.no_grad():
        assert torch.equal(ours(input_ids=ids).logits, theirs.eval()(input_ids=ids).logits)


def test_an_hf_folder_that_is_not_a_dense_default_rope_llama_is_refused(tmp_path: Path) -> None:
    config = {
        "model_type": "llama",
        "vocab_size": 260,
        "hidden_size": 64,
        "intermediate_size": 172,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 256,
        "hidden_act": "silu",
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0},
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ItoError) as err:
        load_hf_folder(tmp_path)
    assert err.value.code == ErrorCode.post_training_model_invalid
    assert "rope_type 'llama3'" in str(err.value)


def test_the_trainer_rank_modules_import_no_transformers() -> None:
    """A trainer rank imports these (the loop, its set-up, the layouts, the model, the
    ladder probe's proxy); transformers stays out of the process."""
    loaded = run_python(
        "import json, sys\n"
        "import stages.trainer.rank.loop, stages.trainer.rank.setup\n"
        "import stages.trainer.parallel.parallelize\n"
        "import stages.model.lm, stages.data_prep.ladder_arm\n"
        "from stages.presets import load_model_preset\n"
        "stages.model.lm.build_model(load_model_preset('llama-tiny'))\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('transformers', 'lm_eval', 'trl'))))"
    )
    assert loaded == []
