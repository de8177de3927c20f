"""Decontamination against GSM8K: recall on planted test questions (verbatim, embedded
in long documents, re-cased / re-punctuated / re-spaced) and the false-positive rate
on GSM8K train questions (same style, different items)."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
from helpers.xdist_groups import module_group

from stages.data_prep.config import DecontaminationConfig
from stages.data_prep.decontam import EvalIndex, decontaminate
from stages.data_prep.evals import EvalItem, list_eval_suites, load_eval_items, load_eval_suite
from stages.errors import ErrorCode, ItoError

pytestmark = module_group(__name__)

REPO = Path(__file__).resolve().parents[2]


def _jsonl(path: Path, field: str) -> list[str]:
    return [json.loads(line)[field] for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def gsm8k_test() -> list[EvalItem]:
    items, infos = load_eval_items(["gsm8k"])
    assert len(items) == 1319 and infos[0].items == 1319
    return items


@pytest.fixture(scope="module")
def filler() -> list[str]:
    return _jsonl(REPO / "data" / "python_docs" / "train.jsonl", "text")


def perturb(text: str, rng: random.Random) -> str:
    """Change case, punctuation and whitespace, never the words themselves."""
    out = []
    for token in re.findall(r"\w+|[^\w\s]|\s+", text):
        if token.isspace():
            out.append(rng.choice([" ", "  ", "\n", "\t ", " \n  "]))
        elif re.fullmatch(r"\w+", token):
            out.append(rng.choice([token.upper(), token.lower(), token.title(), token]))
        else:  # punctuation: swap, drop to a space, or double it
            out.append(rng.choice([" ", token * 2, ",", "!", " ; ", "\u2019", "-"]))
    return "".join(out)


def test_planted_gsm8k_test_questions_are_found(
    gsm8k_test: list[EvalItem], filler: list[str]
) -> None:
    rng = random.Random(0)
    questions = [it.text for it in gsm8k_test]
    verbatim = list(questions)
    embedded = [" ".join([*rng.sample(filler, 3), q, *rng.sample(filler, 3)]) for q in questions]
    changed = [perturb(q, rng) for q in questions]
    assert sum(c != q for c, q in zip(changed, questions, strict=True)) > 1300
    clean = rng.sample(filler, 500)
    docs = verbatim + embedded + changed + clean
    result = decontaminate(docs, EvalIndex(gsm8k_test, DecontaminationConfig()))
    planted = 3 * len(questions)
    recall = result.contaminated[:planted].mean()
    assert recall == 1.0, recall  # what docs/data_prep.md claims
    assert not result.contaminated[planted:].any()  # unrelated prose is never flagged
    # The record says which item matched which document.
    record = result.record()
    first = record["contaminated_documents"][0]
    assert first["doc"] == 0 and first["matches"][0]["item"] == 0
    assert first["matches"][0]["suite"] == "gsm8k"
    assert record["documents_contaminated"] == int(result.contaminated.sum())
    assert record["parameters"]["ngram"] == 13


@pytest.mark.parametrize("mode", ["ngram", "overlap"])
def test_gsm8k_train_questions_rarely_flagged(gsm8k_test: list[EvalItem], mode: str) -> None:
    train = _jsonl(REPO / "data" / "gsm8k" / "train.jsonl", "question")
    assert len(train) == 7473
    result = decontaminate(train, EvalIndex(gsm8k_test, DecontaminationConfig(mode=mode)))
    assert result.contaminated.mean() <= 0.005
    if mode == "overlap":  # the overlap mode also catches the verbatim items
        hits = decontaminate(
            [it.text for it in gsm8k_test[:200]],
            EvalIndex(gsm8k_test, DecontaminationConfig(mode=mode)),
        )
        assert hits.contaminated.all()


def test_overlap_ratio_threshold() -> None:
    item = EvalItem("s", "f", 0, " ".join(f"w{i}" for i in range(30)))  # 23 8-grams
    index = EvalIndex(
        [item], DecontaminationConfig(mode="overlap", overlap_ngram=8, overlap_threshold=0.5)
    )
    half = " ".join(f"w{i}" for i in range(19))  # 12 of 23 8-grams
    less = " ".join(f"w{i}" for i in range(17))  # 10 of 23
    result = decontaminate([half, less], index)
    assert result.contaminated.tolist() == [True, False]
    assert result.matches[0].grams == 12 and result.matches[0].ratio == pytest.approx(12 / 23)


def test_short_items_fall_back_to_exact_match() -> None:
    items = [EvalItem("s", "f", 0, "What is two plus two?"), EvalItem("s", "f", 1, "Hi")]
    index = EvalIndex(items, DecontaminationConfig(ngram=13))
    assert index.short_items == 2
    docs = [
        "Quiz: WHAT is two, plus two. Answer four",
        "what is two plus three",
        "Hill",
        "hi there",
    ]
    result = decontaminate(docs, index)
    assert result.contaminated.tolist() == [True, False, False, True]
    assert {m.method for m in result.matches} == {"exact"}


def test_suite_registry() -> None:
    assert "gsm8k" in list_eval_suites()
    suite = load_eval_suite("gsm8k")
    assert suite.files[0].field == "question" and suite.license == "MIT"
    items, _ = load_eval_items(["gsm8k"])
    assert items[0].text.startswith("Janet") and items[0].answer.endswith("#### 18")
    with pytest.raises(ItoError) as e:
        load_eval_suite("no-such-suite")
    assert e.value.code == ErrorCode.eval_suite_unknown


def test_extra_eval_files_jsonl_and_text(tmp_path: Path) -> None:
    (tmp_path / "mine.jsonl").write_text('{"q": "alpha beta gamma"}\n', encoding="utf-8")
    (tmp_path / "lines.txt").write_text("delta epsilon\n\nzeta eta\n", encoding="utf-8")
    items, infos = load_eval_items(
        [], [f"file://{tmp_path / 'mine.jsonl'}", str(tmp_path / "lines.txt")], field="q"
    )
    assert [(i.suite, i.text) for i in items] == [
        ("mine", "alpha beta gamma"),
        ("lines", "delta epsilon"),
        ("lines", "zeta eta"),
    ]
    assert [i.items for i in infos] == [1, 2]
